"""Every GGUF type the grouped kernel reads (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K): its records
hold the weights gguf-py's dequantize gives, bit for bit, the kernel rebuilds exactly those, its products are
float32-close to the float64 ones and each row's outputs do not depend on the other rows."""
from __future__ import annotations

import ctypes
import shutil
import subprocess

import numpy as np
import pytest

torch = pytest.importorskip("torch")
gguf = pytest.importorskip("gguf")
pytest.importorskip("safetensors")
from hypothesis import given, settings, strategies as st  # noqa: E402

from speculum.models.hf.kernels.gguf_groups import (GroupedProduct, GroupedProducts, grouped_run,  # noqa: E402
                                                    kernel_source, kernel_unavailable, load_groups, read_groups)
from speculum.models.hf.kernels.gguf_records import RECORD_BYTES, pack  # noqa: E402
from support.grouped_weights import LLAMA_GGUF_NAMES  # noqa: E402

needs_kernel = pytest.mark.skipif(kernel_unavailable() is not None, reason=f"no grouped kernel: {kernel_unavailable()}")
TYPES = ["q4_0", "q4_1", "q5_0", "q5_1", "q8_0", "q4_k", "q5_k", "q6_k"]
_WITH_MINIMUM = {"q4_1", "q5_1", "q4_k", "q5_k"}          # a second float16 (m, dmin) at bytes 2..4


def gguf_block(gguf_type: str) -> tuple[int, int]:
    """(weights, bytes) of one GGUF block of ``gguf_type``, from gguf-py's table."""
    import gguf

    return gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[gguf_type.upper()]]


def random_blocks(gguf_type: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """Valid GGUF blocks ``(rows, bytes)`` of ``gguf_type``: random quant and scale bytes, and float16 scales
    (and minimums) drawn from every finite float16 (subnormal, zero, the largest, either sign)."""
    per_block, block_bytes = gguf_block(gguf_type)
    count = columns // per_block
    blocks = rng.integers(0, 256, size=(rows, count, block_bytes), dtype=np.uint8)

    def halves() -> np.ndarray:
        bits = rng.integers(0, 0x7C00, size=(rows, count), dtype=np.uint16)       # below 0x7C00: finite
        return (bits | (rng.integers(0, 2, size=(rows, count), dtype=np.uint16) << 15))[..., None].view(np.uint8)

    scale_at = 208 if gguf_type == "q6_k" else 0
    blocks[..., scale_at:scale_at + 2] = halves()
    if gguf_type in _WITH_MINIMUM:
        blocks[..., 2:4] = halves()
    return blocks.reshape(rows, -1)


def dequantized(gguf_type: str, blocks: np.ndarray) -> np.ndarray:
    return gguf.quants.dequantize(blocks, gguf.GGMLQuantizationType[gguf_type.upper()])


@settings(max_examples=40, deadline=None)
@given(gguf_type=st.sampled_from(TYPES), lanes=st.integers(1, 3), supers=st.integers(1, 2),
       seed=st.integers(0, 2**32 - 1))
def test_records_expand_bitwise_to_what_gguf_dequantizes(gguf_type, lanes, supers, seed):
    blocks = random_blocks(gguf_type, 16 * lanes, 256 * supers, np.random.default_rng(seed))
    expected = dequantized(gguf_type, blocks)
    weight = pack(gguf_type, blocks)
    assert weight.records.shape == (lanes, 8 * supers, RECORD_BYTES[weight.kind])
    assert np.array_equal(weight.expanded().numpy().view(np.int32), expected.view(np.int32))


@pytest.mark.parametrize("gguf_type", [t for t in TYPES if t not in ("q4_k", "q5_k", "q6_k")])
def test_quantized_weights_expand_as_gguf_dequantizes_them(gguf_type):
    """Blocks as gguf-py's own quantizer writes them (it has none for the K types)."""
    weights = np.random.default_rng(5).standard_normal((32, 256)).astype(np.float32)
    blocks = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[gguf_type.upper()])
    expected = dequantized(gguf_type, blocks)
    assert np.array_equal(pack(gguf_type, blocks).expanded().numpy().view(np.int32), expected.view(np.int32))


def test_pack_names_the_types_it_reads():
    with pytest.raises(ValueError, match="q6_k, q8_0, not 'q3_k'"):
        pack("q3_k", np.zeros((16, 110), np.uint8))
    with pytest.raises(ValueError, match="does not fill"):
        pack("q6_k", random_blocks("q6_k", 16, 256, np.random.default_rng(0))[:, :200])


def check_product(run: GroupedProduct, expanded: torch.Tensor, rng: np.random.Generator) -> None:
    """``run`` rebuilds each weight exactly (the identity's products are the weights), is float32-close to
    the float64 product, and ROW-CANONICAL: every row count gives each row the same outputs."""
    inputs = expanded.shape[1]
    assert torch.equal(run(torch.eye(inputs)).T, expanded)
    x = torch.from_numpy(rng.standard_normal((13, inputs)).astype(np.float32))
    full = run(x)
    reference = x.double() @ expanded.double().T
    scale = (x.double().abs() @ expanded.double().abs().T).max()
    assert float((full.double() - reference).abs().max()) <= 1e-5 * float(scale)
    for count in range(1, 13):
        for start in (0, 13 - count):
            assert torch.equal(run(x[start:start + count]), full[start:start + count])


@needs_kernel
@pytest.mark.parametrize("gguf_type", TYPES)
def test_kernel_rebuilds_the_weights_and_keeps_rows_alone(gguf_type):
    rng = np.random.default_rng(6)
    # Moderate scales for the sums (the exactness check above already draws from every float16).
    weights = [pack(gguf_type, gguf_blocks) for gguf_blocks in
               (moderate_blocks(gguf_type, rows, 512, rng) for rows in (48, 16))]
    run = grouped_run(weights)
    check_product(run, torch.cat([w.expanded() for w in weights]), rng)


@needs_kernel
@settings(max_examples=12, deadline=None)
@given(gguf_type=st.sampled_from(TYPES), seed=st.integers(0, 2**32 - 1))
def test_kernel_rebuilds_every_float16_scale_exactly(gguf_type, seed):
    weight = pack(gguf_type, random_blocks(gguf_type, 16, 256, np.random.default_rng(seed)))
    assert torch.equal(grouped_run([weight])(torch.eye(256)).T, weight.expanded())


def moderate_blocks(gguf_type: str, rows: int, columns: int, rng: np.random.Generator) -> np.ndarray:
    """:func:`random_blocks` with scales and minimums of -0.05..0.05 (sums of a sensible size)."""
    blocks = random_blocks(gguf_type, rows, columns, rng)
    per_block, block_bytes = gguf_block(gguf_type)
    blocks = blocks.reshape(rows, -1, block_bytes)

    def halves() -> np.ndarray:
        return rng.uniform(-0.05, 0.05, size=blocks.shape[:2]).astype(np.float16)[..., None].view(np.uint8)

    scale_at = 208 if gguf_type == "q6_k" else 0
    blocks[..., scale_at:scale_at + 2] = halves()
    if gguf_type in _WITH_MINIMUM:
        blocks[..., 2:4] = halves()
    return blocks.reshape(rows, -1)


@pytest.mark.skipif(shutil.which("gcc") is None or "avx2" not in open("/proc/cpuinfo").read(),
                    reason="needs gcc and an AVX2 CPU")
@pytest.mark.parametrize("gguf_type", TYPES)
def test_avx2_path_rebuilds_the_same_weights(tmp_path, gguf_type):
    """The AVX2 decodes, built as for a CPU without AVX-512 (one thread, no OpenMP), on this machine."""
    library = tmp_path / "grouped_avx2.so"
    subprocess.run(["gcc", "-O3", "-mavx2", "-mfma", "-mno-avx512f", "-ffp-contract=off", "-fPIC", "-shared",
                    "-Wno-unknown-pragmas", str(kernel_source()), "-o", str(library)], check=True, timeout=120)
    weight = pack(gguf_type, moderate_blocks(gguf_type, 32, 256, np.random.default_rng(7)))
    function = getattr(ctypes.CDLL(str(library)), f"{weight.kind}_product")
    function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                         ctypes.c_void_p, ctypes.c_int]
    run = GroupedProduct(function, weight.kind, weight.records, 256, 32)
    check_product(run, weight.expanded(), np.random.default_rng(8))


@pytest.mark.parametrize("kind", sorted(RECORD_BYTES))
def test_loaded_records_of_each_kind_must_have_its_byte_count(tmp_path, kind):
    from safetensors.torch import save_file

    save_file({"blk.0.ffn_up.weight": torch.zeros(1, 8, RECORD_BYTES[kind] - 64, dtype=torch.uint8)},
              str(tmp_path / "groups.safetensors"), metadata={"blk.0.ffn_up.weight": f"{kind},16,256"})
    with pytest.raises(ValueError, match=f"blk.0.ffn_up.weight: records of shape .* do not fit {kind} 16 x 256"):
        load_groups(tmp_path)


# ------------------------------------------------------------------------------------------ GGUF files
def write_model_file(path, architecture: str, rng: np.random.Generator) -> dict[str, tuple[str, np.ndarray]]:
    """A GGUF file of ``architecture`` with 4 heads (2 for keys) and K-type query, key and down
    projections; returns each tensor's type and blocks as written."""
    writer = gguf.GGUFWriter(str(path), architecture)
    writer.add_head_count(4)
    writer.add_head_count_kv(2)
    tensors = {"blk.0.attn_q.weight": ("q6_k", 32), "blk.0.attn_k.weight": ("q4_k", 16),
               "blk.0.ffn_down.weight": ("q5_k", 16)}
    written = {}
    for name, (gguf_type, rows) in tensors.items():
        blocks = moderate_blocks(gguf_type, rows, 256, rng)
        writer.add_tensor(name, blocks, raw_shape=blocks.shape,
                          raw_dtype=gguf.GGMLQuantizationType[gguf_type.upper()])
        written[name] = (gguf_type, blocks)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return written


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "gemma3"])
def test_read_groups_keeps_the_rows_of_other_architectures(tmp_path, architecture):
    written = write_model_file(tmp_path / "tiny.gguf", architecture, np.random.default_rng(9))
    groups = read_groups(tmp_path / "tiny.gguf")
    assert groups.keys() == written.keys()
    for name, (gguf_type, blocks) in written.items():
        assert torch.equal(groups[name].expanded(), torch.from_numpy(dequantized(gguf_type, blocks))), name


def test_read_groups_puts_llama_query_and_key_rows_back(tmp_path):
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    written = write_model_file(tmp_path / "tiny.gguf", "llama", np.random.default_rng(10))
    groups = read_groups(tmp_path / "tiny.gguf")
    processor = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    for name, (gguf_type, blocks) in written.items():
        expected = processor.process(weights=dequantized(gguf_type, blocks), name=name).weights
        assert torch.equal(groups[name].expanded(), torch.from_numpy(np.ascontiguousarray(expected))), name


def tiny_model(model_type: str):
    """A tiny float32 Qwen2, Qwen3 or Gemma 3 model (two blocks; Gemma 3's head tied to its embedding)."""
    import transformers

    shape = dict(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2)
    config, model = {"qwen2": (transformers.Qwen2Config(**shape), transformers.Qwen2ForCausalLM),
                     "qwen3": (transformers.Qwen3Config(**shape, head_dim=16), transformers.Qwen3ForCausalLM),
                     "gemma3_text": (transformers.Gemma3TextConfig(**shape, head_dim=16),
                                     transformers.Gemma3ForCausalLM)}[model_type]
    torch.manual_seed(0)
    return model(config).float()


@needs_kernel
@pytest.mark.parametrize("model_type", ["qwen2", "qwen3", "gemma3_text"])
def test_attach_groups_to_other_architectures_by_the_same_names(model_type):
    from speculum.models.hf.kernels.gguf_groups import GROUPS, attach_groups

    module, rng = tiny_model(model_type), np.random.default_rng(11)
    groups, layers = {}, []
    with torch.no_grad():
        for index, block in enumerate(module.model.layers):
            for owner in (block.self_attn, block.mlp):
                for name, gguf_name in LLAMA_GGUF_NAMES.items():
                    if hasattr(owner, name):
                        layer = getattr(owner, name)
                        groups[f"blk.{index}.{gguf_name}.weight"] = pack("q4_0", moderate_blocks(
                            "q4_0", *layer.weight.shape, rng))
                        layer.weight.copy_(groups[f"blk.{index}.{gguf_name}.weight"].expanded())
                        layers.append(layer)
        head = "token_embd.weight" if model_type == "gemma3_text" else "output.weight"   # Gemma 3: tied
        groups[head] = pack("q8_0", moderate_blocks("q8_0", 64, 64, rng))
        module.get_output_embeddings().weight.copy_(groups[head].expanded())
    assert attach_groups(module, groups) == 2 * 7 + 1
    assert all(getattr(layer, GROUPS) is not None for layer in [*layers, module.get_output_embeddings()])


@needs_kernel
def test_layers_of_different_kinds_share_a_product_one_call_a_kind():
    """A fused product over layers of several GGUF types (a Q4_K_M file's Q4_K query and key, Q6_K value):
    the outputs side by side, each rebuilt exactly, rows alone."""
    rng = np.random.default_rng(12)
    weights = [pack(t, moderate_blocks(t, rows, 256, rng)) for t, rows in
               (("q4_k", 32), ("q4_k", 16), ("q6_k", 16), ("q4_0", 16))]
    run = grouped_run(weights)
    assert isinstance(run, GroupedProducts) and run.kind == "q4_1+q6_k+q4_0" and run.out_features == 80
    check_product(run, torch.cat([w.expanded() for w in weights]), rng)
    # The row probe's sample: each part's first outputs, bitwise those of the whole product.
    rows = torch.from_numpy(rng.standard_normal((5, 256)).astype(np.float32))
    whole, sample = run(rows), run.first_outputs(16)
    assert sample.out_features == 48
    assert torch.equal(sample(rows), torch.cat([whole[:, :16], whole[:, 48:64], whole[:, 64:80]], dim=1))


@needs_kernel
def test_a_tiny_llama_of_mixed_kinds_keeps_every_guarantee(tmp_path):
    """Query and key of one kind, value and the MLP of others: every block projection multiplies by its
    groups, and greedy tokens are transformers' own."""
    import speculum
    from support.hf_tiny import save_tiny_model
    from speculum.models.hf import HFModel

    plain = HFModel.from_pretrained(save_tiny_model(tmp_path / "tiny"), prepack=False)
    types = {"q_proj": "q4_0", "k_proj": "q4_0", "v_proj": "q8_0", "o_proj": "q5_1", "gate_proj": "q5_0",
             "up_proj": "q4_1", "down_proj": "q5_0"}
    rng, groups = np.random.default_rng(13), {}
    with torch.no_grad():
        for index, block in enumerate(plain.module.model.layers):
            for owner in (block.self_attn, block.mlp):
                for name, gguf_name in LLAMA_GGUF_NAMES.items():
                    if hasattr(owner, name):
                        layer = getattr(owner, name)
                        grouped = pack(types[name], moderate_blocks(types[name], *layer.weight.shape, rng))
                        layer.weight.copy_(grouped.expanded())
                        groups[f"blk.{index}.{gguf_name}.weight"] = grouped
    model = HFModel(plain.module, plain.tokenizer, groups=groups)
    assert model.grouped_layers == 7 * 3 and model.capabilities.canonical_rows
    assert isinstance(model.fused.blocks[0].qkv.run, GroupedProducts)
    assert isinstance(model.fused.blocks[0].gate_up.run, GroupedProducts)
    prompt = [1, 5, 9, 4]
    reference = speculum.generate(plain, prompt, max_new_tokens=10, temperature=0, eos_token_id=None).tokens
    assert speculum.generate(model, prompt, max_new_tokens=10, temperature=0, eos_token_id=None).tokens == reference
    batch = speculum.generate_batch(model, [prompt, [1, 7]], max_new_tokens=10, temperature=0, eos_token_id=None)
    assert batch[0].tokens == reference
