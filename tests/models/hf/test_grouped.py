"""Float32 products from GGUF weight groups (Q4_1, Q8_0; ``test_quant_kinds`` has every type read): exact
weights, rows that do not depend on their neighbours, the fused forward's guarantees on top of them, and a
clear fallback where no kernel builds."""
from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("transformers")
from hypothesis import given, settings, strategies as st  # noqa: E402

import speculum  # noqa: E402
from support.grouped_weights import grouped_tiny, random_blocks  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.drafts.twins import bf16_twin  # noqa: E402
from speculum.models.hf.kernels.gguf_groups import (GROUPS, GroupedProduct,  # noqa: E402
                                                    _transformers_rows, attach_groups, grouped_run,
                                                    kernel_unavailable, load_groups, pack, save_groups)

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"no grouped kernel: {kernel_unavailable()}")
_GGML = {"q4_1": gguf.GGMLQuantizationType.Q4_1, "q8_0": gguf.GGMLQuantizationType.Q8_0}


@settings(max_examples=25, deadline=None)
@given(kind=st.sampled_from(["q4_1", "q8_0"]), lanes=st.integers(1, 3), groups=st.integers(1, 4),
       seed=st.integers(0, 2**32 - 1))
def test_records_expand_to_what_gguf_dequantizes(kind, lanes, groups, seed):
    blocks = random_blocks(kind, 16 * lanes, 32 * groups, np.random.default_rng(seed))
    expected = gguf.quants.dequantize(blocks, _GGML[kind]).astype(np.float32)
    assert torch.equal(pack(kind, blocks).expanded(), torch.from_numpy(expected))


def test_pack_refuses_rows_that_do_not_fill_records():
    with pytest.raises(ValueError, match="does not fill"):
        pack("q4_1", random_blocks("q4_1", 16, 64, np.random.default_rng(0))[:15])
    with pytest.raises(ValueError, match="not 'q3_k'"):
        pack("q3_k", np.zeros((16, 110), np.uint8))


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_product_rows_are_alone_and_exact_to_float32(kind):
    rng = np.random.default_rng(1)
    weights = [pack(kind, random_blocks(kind, rows, 96, rng)) for rows in (48, 16)]   # two layers, concatenated
    run = grouped_run(weights)
    expanded = torch.cat([w.expanded() for w in weights]).double()
    x = torch.from_numpy(rng.standard_normal((19, 96)).astype(np.float32))
    full = run(x)
    assert full.shape == (19, 64)
    reference = x.double() @ expanded.T
    assert float((full.double() - reference).abs().max()) <= 1e-5 * float(reference.abs().max())
    for count in range(1, 19):          # every row count, across the kernel's passes of 8 (AVX2: 4) rows
        for start in (0, 19 - count):
            assert torch.equal(run(x[start:start + count]), full[start:start + count])
    assert run(x[:0]).shape == (0, 64)
    with pytest.raises(ValueError, match="float32 rows of 96"):
        run(x[:, :32])
    if isinstance(run, GroupedProduct):     # bound to buffers: the same rows, whatever they hold at the call
        rows, out = torch.empty(5, 96), torch.empty(5, 64)
        bound = run.bind(rows, out)
        rows.copy_(x[3:8])
        bound(torch.get_num_threads())
        assert torch.equal(out, full[3:8])
        with pytest.raises(ValueError, match="cannot bind"):
            run.bind(rows, torch.empty(4, 64))


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_tiled_and_direct_products_give_the_same_bits(kind):
    """Many rows decode each group's weights once into a tile, or inside every pass of rows: which one is
    timed at load (``tiled_products``), so both must give the same bits at every row count."""
    from speculum.models.hf.kernels import gguf_groups

    rng = np.random.default_rng(3)
    run = grouped_run([pack(kind, random_blocks(kind, 48, 96, rng))])
    x = torch.from_numpy(rng.standard_normal((37, 96)).astype(np.float32))
    outputs = []
    try:
        for tiled in (True, False):
            gguf_groups.use_tiled_products(tiled)
            outputs.append([run(x[:count]) for count in range(1, 38)])
    finally:
        gguf_groups.use_tiled_products(None)
    for tiled, direct in zip(*outputs):
        assert torch.equal(tiled, direct)
    assert gguf_groups.tiled_products() in (True, False)


def test_query_rows_put_back_as_transformers_does():
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    for rows, heads in ((576, 9), (192, 3), (32, 4)):
        stored = np.arange(rows)
        expected = LlamaTensorProcessor(config={})._reverse_permute_weights(stored, heads, heads)
        assert np.array_equal(stored[_transformers_rows(rows, heads)], expected)


@needs_kernel
@pytest.mark.parametrize("kind", ["q4_1", "q8_0"])
def test_tiny_grouped_llama_keeps_every_guarantee(tmp_path, kind):
    plain, groups = grouped_tiny(tmp_path / "tiny", kind)
    model = HFModel(plain.module, plain.tokenizer, groups=groups)
    assert model.grouped_layers == 7 * 3 and model.fused_forward and model.capabilities.canonical_rows
    prompt = [1, 5, 9, 4]
    attn = model.module.model.layers[0].self_attn
    attached = [getattr(layer, GROUPS) for layer in (attn.q_proj, attn.k_proj, attn.v_proj)]
    assert torch.equal(attached[0].records, groups["blk.0.attn_q.weight"].records)
    # One copy in memory: the layers' groups are views of their fused product's records.
    assert len({g.records.untyped_storage().data_ptr() for g in attached}) == 1
    reference = speculum.generate(plain, prompt, max_new_tokens=12, temperature=0, eos_token_id=None).tokens
    alone = speculum.generate(model, prompt, max_new_tokens=12, temperature=0, eos_token_id=None).tokens
    with_draft = speculum.generate(model, prompt, draft=model, max_new_tokens=12, temperature=0, gamma=3,
                                   eos_token_id=None)
    assert with_draft.tokens == alone                     # greedy speculative output is plain greedy output
    assert with_draft.stats.acceptance_rate == 1.0        # draft == target accepts everything
    assert alone == reference                             # same weights as transformers' forward, well-separated
    batch = speculum.generate_batch(model, [prompt, [1, 7], prompt[:2]], max_new_tokens=12, temperature=0,
                                    eos_token_id=None)
    assert [r.tokens for r in batch][0] == alone          # packed with others: the same tokens
    assert isinstance(model.fused.blocks[0].qkv.run, GroupedProduct)
    # A bfloat16 copy carries the float32 weights' groups on its layers, and must not multiply by them.
    twin = bf16_twin(model)
    assert twin.fused_forward and not isinstance(twin.fused.blocks[0].qkv.run, GroupedProduct)


@needs_kernel
def test_attach_leaves_out_groups_of_other_weights(tmp_path):
    plain, groups = grouped_tiny(tmp_path / "tiny")
    with torch.no_grad():
        plain.module.model.layers[1].mlp.down_proj.weight[-1, 3] += 1e-3     # a last row that no longer matches
    assert attach_groups(plain.module, groups) == 7 * 3 - 1
    assert getattr(plain.module.model.layers[1].mlp.down_proj, GROUPS, None) is None


def test_groups_round_trip_through_their_file(tmp_path):
    rng = np.random.default_rng(3)
    groups = {"a": pack("q4_1", random_blocks("q4_1", 32, 64, rng)),
              "b": pack("q8_0", random_blocks("q8_0", 16, 32, rng))}
    save_groups(groups, tmp_path)
    loaded = load_groups(tmp_path)
    assert loaded.keys() == groups.keys()
    for name, weight in groups.items():
        assert (loaded[name].kind, loaded[name].out_features, loaded[name].in_features) == \
            (weight.kind, weight.out_features, weight.in_features)
        assert torch.equal(loaded[name].records, weight.records)


@pytest.mark.parametrize("records, meta, problem", [
    (torch.zeros(1, 2, 320, dtype=torch.uint8), "q3_k,16,64", "kind"),
    (torch.zeros(1, 2, 320, dtype=torch.uint8), "q4_1,24,64", "multiple of 16"),
    (torch.zeros(1, 2, 320, dtype=torch.uint8), "q4_1,16,48", "multiple of 32"),
    (torch.zeros(1, 2, 80, dtype=torch.float32), "q4_1,16,64", "uint8"),
    (torch.zeros(1, 2, 300, dtype=torch.uint8), "q4_1,16,64", "bytes"),
    (torch.zeros(1, 2, 320, dtype=torch.uint8), "q4_1,16", "kind,out,in"),
    (torch.zeros(1, 2, 320, dtype=torch.uint8), "q4_1,sixteen,64", "kind,out,in"),
])
def test_loaded_groups_are_checked_strictly_naming_the_tensor(tmp_path, records, meta, problem):
    from safetensors.torch import save_file

    save_file({"blk.0.attn_q.weight": records}, str(tmp_path / "groups.safetensors"),
              metadata={"blk.0.attn_q.weight": meta})
    with pytest.raises(ValueError) as error:
        load_groups(tmp_path)
    message = str(error.value)
    assert "\n" not in message and message.startswith("blk.0.attn_q.weight") and problem in message


def _kernels_on() -> dict:
    """This process's environment without ``SPECULUM_KERNELS`` (a child that must try to build them)."""
    return {k: v for k, v in os.environ.items() if k != "SPECULUM_KERNELS"}


def test_no_compiler_means_a_reason_and_the_oneDNN_path(tmp_path):
    script = ("from speculum.models.hf.kernels.gguf_groups import kernel_unavailable, grouped_run, pack\n"
              "import numpy as np\n"
              "print(kernel_unavailable())\n"
              "print(grouped_run([pack('q8_0', np.zeros((16, 34), np.uint8))]))\n")
    env = {**_kernels_on(), "CC": "/bin/false", "SPECULUM_CACHE": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason, run = out.stdout.splitlines()
    assert "does not compile here" in reason and run == "None"


@needs_kernel
def test_embedded_model_multiplies_by_its_gguf_groups():
    """The real model: every block projection and the head read their GGUF groups (the query and key rows
    only match after the rotary permutation is undone), and the logits agree with transformers' forward."""
    model = speculum.load_model("smollm2-135m", progress=False)
    assert model.grouped_layers == 30 * 7 + 1
    reference = speculum.load_model("smollm2-135m", progress=False, prepack=False)
    prompt = model.encode("The capital of France is")
    ours = model.start(prompt).next_logprobs()
    theirs = reference.start(prompt).next_logprobs()
    assert int(np.argmax(ours)) == int(np.argmax(theirs))
    assert float(np.abs(np.exp(ours) - np.exp(theirs)).sum()) < 1e-4


def test_unwritable_cache_still_builds_the_kernel(tmp_path):
    """A cache folder that cannot be written (a file in its way) builds the kernel for the process alone."""
    blocked = tmp_path / "cache"
    blocked.write_text("not a folder")
    script = ("from speculum.models.hf.kernels.gguf_groups import kernel_unavailable\n"
              "print(kernel_unavailable())\n")
    env = {**_kernels_on(), "SPECULUM_CACHE": str(blocked)}
    out = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    reason = out.stdout.strip()       # built (None), or this machine's compiler cannot build it at all
    assert reason == "None" or "does not compile here" in reason, reason


@needs_kernel
def test_products_do_not_depend_on_thread_count_or_calling_thread():
    """The kernel runs on as many threads as PyTorch is set to, from any calling thread; the numbers do not
    depend on it (each output is summed by one thread in one order)."""
    import threading

    weight = pack("q4_1", random_blocks("q4_1", 64, 96, np.random.default_rng(4)))
    run = grouped_run([weight])
    x = torch.randn(11, 96)
    before = torch.get_num_threads()
    try:
        expected = run(x)
        torch.set_num_threads(1)
        results = []
        worker = threading.Thread(target=lambda: results.append(run(x)))
        worker.start()
        worker.join()
        assert torch.equal(run(x), expected) and torch.equal(results[0], expected)
    finally:
        torch.set_num_threads(before)
