"""The llama.cpp backend: protocol invariants on the embedded SmolLM2-135M GGUF.

Invariants checked: sessions agree with fresh evaluation after rollback (and a rollback re-evaluates
nothing), interleaved sessions do not disturb each other, the batched calls equal the session rows,
greedy speculative decoding with prompt lookup reproduces plain greedy decoding token for token, and
(slow) log-probs agree with the PyTorch backend to within quantisation error.
"""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from speculum.models import llamacpp as llamacpp_module
from speculum.validation import InputError

pytestmark = pytest.mark.llamacpp


def assert_same_rows(rows: np.ndarray, expected: np.ndarray) -> None:
    """Rows computed with the same batch shapes must be identical; with different shapes llama.cpp's
    kernels may round differently at some context lengths (see the module docstring of
    speculum.models.llamacpp), which must never change the distribution materially or its top token."""
    assert rows.shape == expected.shape
    total_variation = 0.5 * np.abs(np.exp(rows) - np.exp(expected)).sum(axis=-1)
    assert total_variation.max() < 0.02
    assert np.array_equal(rows.argmax(axis=-1), expected.argmax(axis=-1))


PROMPTS = (
    "Summarise: The cat sat on the mat. The cat was happy on the mat because the mat was warm.",
    "Rewrite in the passive voice: The committee approved the budget and the board signed the plan.",
    "Tell me a short story about a robot who learns to paint.",
)


@pytest.fixture(scope="module")
def model():
    pytest.importorskip("llama_cpp")
    try:
        # One thread: the results do not depend on it, and a shared CPU makes multi-thread spinning slow.
        return llamacpp_module.load_llamacpp_model("smollm2-135m", n_ctx=1024, n_threads=1)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))


@pytest.fixture(scope="module")
def prompt_ids(model):
    return model.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[0]}])


def test_missing_extra_gives_one_line_install_message(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", None)  # makes `import llama_cpp` raise ImportError
    with pytest.raises(ImportError) as info:
        llamacpp_module.load_llamacpp_model("smollm2-135m")
    assert str(info.value) == "llama-cpp-python is not installed: pip install 'speculum[llamacpp]'"


def test_attributes_and_tokenizer(model):
    assert model.vocab_size == 49152 and model.max_context >= 1024
    assert model.eos_token_id is not None and 0 <= model.eos_token_id < model.vocab_size
    text = "Hello world, speculative decoding!"
    assert model.tokenizer.decode(model.tokenizer.encode(text)) == text
    chat = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False)
    assert chat.rstrip().endswith("assistant") and "Hi" in chat
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    assert ids == model.tokenizer.encode(chat, add_special_tokens=False)


def test_rows_are_normalised_distributions(model, prompt_ids):
    rows = model.start(prompt_ids).extend([100, 200, 300])
    assert rows.shape == (3, model.vocab_size) and rows.dtype == np.float64
    np.testing.assert_allclose(np.exp(rows).sum(axis=1), 1.0, atol=1e-9)


@pytest.fixture
def decoded_tokens(model, monkeypatch):
    """Every token that goes through ``llama_decode`` while the test runs, in order."""
    decoded: list[int] = []
    real_decode = model._decode
    monkeypatch.setattr(model, "_decode", lambda tokens, *args: decoded.extend(tokens) or real_decode(tokens, *args))
    return decoded


def test_rollback_equals_fresh_session_and_reevaluates_nothing(model, prompt_ids, decoded_tokens):
    continuation = [504, 3096, 314, 260, 1345]
    session = model.start(prompt_ids)
    session.extend([28, 29, 30, 31])
    session.rollback(4)
    assert session.length == len(prompt_ids)
    decoded_tokens.clear()
    after_rollback = session.extend(continuation)
    assert decoded_tokens == continuation  # only the new tokens went through llama_decode

    fresh = model.start(prompt_ids).extend(continuation)
    np.testing.assert_array_equal(after_rollback, fresh)  # same batch shapes: bit-identical


def test_advance_is_the_last_row_of_extend_and_decodes_each_token_once(model, prompt_ids, decoded_tokens):
    session = model.start(prompt_ids)
    decoded_tokens.clear()
    row = session.advance([28, 29, 30])
    assert decoded_tokens == [28, 29, 30]
    assert_same_rows(row[None], model.start(prompt_ids).extend([28, 29, 30])[-1:])
    assert session.tokens[-3:] == [28, 29, 30] and np.array_equal(session.next_logprobs(), row)
    session.rollback(1)  # into rows never computed: re-evaluated, still the exact row
    assert_same_rows(session.next_logprobs()[None], model.start(prompt_ids + [28, 29]).next_logprobs()[None])


def test_partial_rollback_keeps_rows_and_continues_exactly(model, prompt_ids, decoded_tokens):
    session = model.start(prompt_ids)
    rows = session.extend([28, 29, 30])
    session.rollback(2)  # keep token 28: its row is known, so no evaluation is needed
    decoded_tokens.clear()
    assert np.array_equal(session.next_logprobs(), rows[0]) and decoded_tokens == []
    session.rollback(1)  # the row before the last extend is kept too
    assert np.array_equal(session.next_logprobs(), model.start(prompt_ids).next_logprobs())
    session.extend([28])
    continued = session.extend([40, 41])
    fresh = model.start(prompt_ids + [28]).extend([40, 41])
    assert_same_rows(continued, fresh)  # token 28 was decoded in a batch of 3 here, in the prompt there


def test_interleaved_sessions_do_not_disturb_each_other(model, prompt_ids):
    first, second = model.start(prompt_ids), model.start(prompt_ids[:-3])
    a1 = first.extend([28, 29])
    b1 = second.extend([50])
    a2 = first.extend([30])  # takes the context back from `second`
    first.rollback(1)
    b2 = second.extend([51, 52])
    alone_a = model.start(prompt_ids).extend([28, 29, 30])
    alone_b = model.start(prompt_ids[:-3]).extend([50, 51, 52])
    assert_same_rows(np.vstack([a1, a2]), alone_a)
    assert_same_rows(np.vstack([b1, b2]), alone_b)


def test_batched_calls_equal_session_rows(model, prompt_ids):
    sequences = [[28, 29, 30], [28, 31], [604]]
    rows = {tuple(seq): model.start(prompt_ids).extend(seq) for seq in sequences}
    first_row = model.start(prompt_ids).next_logprobs()
    expected_scores = [
        first_row[seq[0]] + sum(rows[tuple(seq)][j, seq[j + 1]] for j in range(len(seq) - 1)) for seq in sequences
    ]
    scores = model.score_sequences(sequences, prompt=prompt_ids)
    np.testing.assert_allclose(scores, expected_scores, rtol=0, atol=0.1)

    prefixes = [prompt_ids + [28, 29], prompt_ids, prompt_ids + [28, 31], prompt_ids + [604]]
    expected = np.vstack([rows[(28, 29, 30)][1], first_row, rows[(28, 31)][1], rows[(604,)][0]])
    assert_same_rows(model.next_logprobs(prefixes), expected)


def test_inputs_are_validated(model, prompt_ids):
    session = model.start(prompt_ids)
    with pytest.raises(ValueError, match="tokens"):
        session.extend([model.vocab_size])
    with pytest.raises(InputError, match="n must be"):
        session.rollback(session.length + 1)
    with pytest.raises(InputError, match="context length"):
        model.start([1] * (model.max_context + 1))
    with pytest.raises(FileNotFoundError):
        llamacpp_module.load_llamacpp_model("/nonexistent/model.gguf")


def test_vocabulary_check_rejects_a_foreign_draft(model):
    class OtherVocabulary:
        vocab_size = model.vocab_size
        vocabulary_fingerprint = "not the same tokenizer"

    llamacpp_module.check_same_vocabulary(model, model)
    with pytest.raises(ValueError, match="tokenizer"):
        llamacpp_module.check_same_vocabulary(model, OtherVocabulary())
    OtherVocabulary.vocab_size = 100
    with pytest.raises(ValueError, match="vocabulary"):
        llamacpp_module.check_same_vocabulary(model, OtherVocabulary())


def test_the_model_spells_its_tokens_with_llama_cpps_pieces(model):
    """``token_bytes()`` is llama.cpp's piece of every token: the pieces of a text's encoding join to the
    text, special tokens add nothing, and the vocabulary module and the tokenizer alone give the same."""
    from speculum.models.vocabulary import token_bytes, tokenizer_bytes

    pieces = model.token_bytes()
    assert len(pieces) == model.vocab_size and pieces[model.eos_token_id] is None
    for text in ("Hello world!", " 4821-9935", "Naïve café, 😀 ok?\n\tdone"):
        ids = model.tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(pieces[t] for t in ids) == text.encode("utf-8"), text
    assert token_bytes(model) == pieces == tokenizer_bytes(model.tokenizer, model.vocab_size)


def test_second_gguf_draft_by_name_pairs_with_a_llamacpp_target(model):
    drafts = pytest.importorskip("speculum.drafts")
    draft = drafts.make_draft("smollm2-135m", model)  # what `--backend llamacpp --draft PATH` does
    assert isinstance(draft, llamacpp_module.LlamaCppModel) and draft is not model
    assert draft.tokenizer.get_vocab() == model.tokenizer.get_vocab()
    assert draft.vocabulary_fingerprint == model.vocabulary_fingerprint


def _decoding():
    speculum = pytest.importorskip("speculum")
    try:
        from speculum.models import PromptLookup

        return speculum.generate, PromptLookup
    except (ImportError, AttributeError) as exc:
        pytest.skip(f"decoding loop or prompt lookup not available: {exc}")


@pytest.mark.parametrize("prompt", PROMPTS)
def test_greedy_speculative_equals_plain_greedy(model, prompt):
    generate, PromptLookup = _decoding()
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    plain = generate(model, ids, max_new_tokens=64, temperature=0)
    speculative = generate(model, ids, draft=PromptLookup(), max_new_tokens=64, gamma="auto", temperature=0)
    assert speculative.tokens == plain.tokens
    assert len(plain.tokens) == 64 or plain.tokens[-1] == model.eos_token_id


@pytest.mark.slow
def test_second_gguf_as_draft_is_accepted_and_exact(model, prompt_ids):
    generate, _ = _decoding()
    draft = llamacpp_module.load_llamacpp_model(model.model_path, n_ctx=1024, n_threads=1, draft_for=model)
    plain = generate(model, prompt_ids, max_new_tokens=32, temperature=0)
    result = generate(model, prompt_ids, draft=draft, max_new_tokens=32, gamma=4, temperature=0)
    assert result.tokens == plain.tokens
    assert result.stats.acceptance_rate > 0.9  # same weights: rejections only from batch-shape rounding


@pytest.mark.slow
@pytest.mark.llm
def test_logprobs_agree_with_pytorch_backend_within_quantisation_error(model):
    """The same Q4_1 weights, dequantised to float32 in PyTorch versus llama.cpp's Q4_1 kernels, which
    quantise activations to 8 bits (Q8_1) on the fly. Measured on two prompts: max |Δ log p| 0.43 nats
    on tokens with p > 1e-3, per-row total variation <= 0.077 (mean 0.021), KL <= 0.013 nats, greedy
    argmax agreeing at 96-100 % of positions. The bounds below leave ~1.4x headroom."""
    speculum = pytest.importorskip("speculum")
    pytest.importorskip("torch")
    reference = speculum.load_model("smollm2-135m")
    prompt = "Tell me a short story about a robot who learns to paint."
    continuation = " Once upon a time, in a small town, there lived a robot named Max who loved colours."
    ids = model.tokenizer.apply_chat_template([{"role": "user", "content": prompt}])
    assert ids == reference.encode(prompt)  # same chat template rendering and tokenizer
    tokens = model.tokenizer.encode(continuation, add_special_tokens=False)
    ours = model.start(ids).extend(tokens)  # (n, vocab)
    theirs = reference.start(ids).extend(tokens)
    likely = theirs > np.log(1e-3)  # far tails carry large relative noise in nats and no mass
    assert np.abs(ours - theirs)[likely].max() < 0.6
    total_variation = 0.5 * np.abs(np.exp(ours) - np.exp(theirs)).sum(axis=1)
    assert total_variation.max() < 0.11 and total_variation.mean() < 0.03
    assert (ours.argmax(axis=1) == theirs.argmax(axis=1)).mean() >= 0.9


# ------------------------------------------------------------------------------ crashing native builds
def _probe_command(exit_code=None, signum=None):
    """A stand-in probe: exits with ``exit_code`` or kills itself with ``signum``."""
    body = f"import os, signal; os.kill(os.getpid(), {signum})" if signum else f"raise SystemExit({exit_code})"
    return [sys.executable, "-c", body]


def test_native_build_check_turns_a_crash_into_a_one_line_error(tmp_path, monkeypatch):
    from speculum.models.llamacpp.build_check import REBUILD_COMMAND, check_native_build

    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path))
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ImportError, match="SIGSEGV") as info:
        check_native_build(str(gguf), "CPU : AVX2 = 1 | AMX_INT8 = 1 |", command=_probe_command(signum=11))
    assert REBUILD_COMMAND in str(info.value) and "\n" not in str(info.value)
    # A build without AMX is not probed at all (the command would crash).
    check_native_build(str(gguf), "CPU : AVX2 = 1 |", command=_probe_command(signum=11))
    # A probe that passes is remembered: the next check runs no command (it would crash otherwise).
    check_native_build(str(gguf), "AMX_INT8 = 1", command=_probe_command(exit_code=0))
    check_native_build(str(gguf), "AMX_INT8 = 1", command=_probe_command(signum=11))


# ------------------------------------------------------------------------------ one list of build flags
ROOT = Path(__file__).resolve().parents[2]


def test_make_install_and_the_rebuild_hint_use_one_list_of_build_flags(monkeypatch):
    """`make install`, the crash message's rebuild command and any documented build command compile
    llama.cpp with the same flags and the version the extra pins."""
    from speculum.models.llamacpp.build_check import CMAKE_ARGS, LLAMACPP_REQUIREMENT, REBUILD_COMMAND

    assert "-DGGML_NATIVE=OFF" in CMAKE_ARGS.split()
    assert f"CMAKE_ARGS='{CMAKE_ARGS}' " in REBUILD_COMMAND and REBUILD_COMMAND.endswith(LLAMACPP_REQUIREMENT)
    extra = re.search(r'^llamacpp = \["(.*)"\]$', (ROOT / "pyproject.toml").read_text(), re.MULTILINE)
    assert extra is not None and extra.group(1) == LLAMACPP_REQUIREMENT
    for document in [ROOT / "README.md", *sorted((ROOT / "docs").glob("**/*.md"))]:
        for flags in re.findall(r"""CMAKE_ARGS=["']([^"']*GGML[^"']*)["']""", document.read_text()):
            assert flags == CMAKE_ARGS, document.name
    make = shutil.which("make")
    if make is None:
        pytest.skip("make is not installed")
    for name in ("LLAMACPP_CMAKE_ARGS", "MAKEFLAGS", "MFLAGS"):  # a user's override is not the Makefile's list
        monkeypatch.delenv(name, raising=False)
    printed = subprocess.run(
        [make, "-s", "--no-print-directory", "-C", str(ROOT), "--eval",
         'print-llamacpp-flags: ; @echo "$(LLAMACPP_CMAKE_ARGS)"', "print-llamacpp-flags"],
        capture_output=True, text=True, check=True)
    assert printed.stdout.strip() == CMAKE_ARGS
