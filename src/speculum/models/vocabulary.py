"""The bytes each token id adds to the decoded text: what a byte-level automaton (a regex constraint) needs.

``token_bytes(model)`` returns, for every token id, the exact bytes that token contributes in the middle of
a text, or None for a token that adds no text (special / control tokens such as bos, eos or
``<|im_start|>``, ids past the tokenizer's end, tokens that decode to nothing). Every speculum model spells
its own tokens (``model.token_bytes()``: llama.cpp's pieces, or its tokenizer read here); for any other
object its ``tokenizer`` is read. The result is cached per model.

Exact for the tokenizer families whose decoder is a per-token byte mapping:

* byte-level BPE (GPT-2, SmolLM2, Llama 3): token strings spell bytes through GPT-2's ``bytes_to_unicode``
  table, which is inverted here, so a token may be part of a UTF-8 character (it need not decode alone);
* SentencePiece style (Llama 2, Mistral; the Replace / ByteFallback / Fuse / Strip decoders, or
  Metaspace): ``"▁"`` is a space and ``"<0xNN>"`` is the single byte 0xNN. The decoder's strip of the
  text's first space is ignored on purpose: a token's bytes are those it adds mid-text, so a tokenizer
  that prepends ``"▁"`` to the text yields ``b" " + text`` over its encoding;
* llama.cpp models and tokenizers: llama.cpp's own piece of every token (their ``token_bytes()``).

For byte-level tokenizers, ``b"".join(token_bytes(model)[t] for t in ids) == text.encode()`` for
``ids = tokenizer(text, add_special_tokens=False)``. Any other decoder (WordLevel, WordPiece, ...) falls
back to the token's text as the tokenizer renders that single token; decoders that insert separators
between tokens (WordLevel joins words with spaces) are therefore approximate: a token's bytes are its own
word, without the separator. ``vocabulary=`` spells every token explicitly instead.

Example:
    >>> class Toy:                       # any object with vocab_size works with an explicit vocabulary
    ...     vocab_size = 4
    >>> token_bytes(Toy(), vocabulary=["<eos>", "a", b"\\xc3", None])[1:]
    [b'a', b'\\xc3', None]
"""
from __future__ import annotations

import json
import operator
import re
import sys
import weakref
from functools import lru_cache
from typing import Any, Sequence

from ..validation import InputError

__all__ = ["token_bytes", "tokenizer_bytes", "hf_token_bytes"]

# model -> (the tokenizer it was read from, the bytes by id); building it for 49k tokens takes about half a
# second, and a regex constraint asks for it once per compile. The tokenizer itself (not its id, which a
# new object may reuse) tells a replaced tokenizer apart; the model holds it anyway.
_CACHE: "weakref.WeakKeyDictionary[Any, tuple[Any, tuple[bytes | None, ...]]]" = weakref.WeakKeyDictionary()

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")
# Text the byte-level reading must reproduce from the tokenizer's own encoding: ASCII, punctuation,
# digits, whitespace, accents, a 3-byte and a 4-byte character.
_PROBE = "Hello, world! 4821-9935 \tcafé – naïve 😀 end\n"


def token_bytes(model: Any, vocabulary: Sequence[str | bytes | None] | None = None) -> list[bytes | None]:
    """``(vocab_size,)`` the bytes each token id adds to the decoded text; None for a token that adds no text.

    Args:
        model: any model with ``vocab_size``; without ``vocabulary`` it must spell its tokens
            (``model.token_bytes()``, as every speculum model does) or carry a tokenizer
            (``model.tokenizer``, read by :func:`tokenizer_bytes`).
        vocabulary: overrides the tokenizer: one entry per token id, a ``str`` (its UTF-8 encoding),
            ``bytes``, or None (no text).

    Returns a fresh list (callers may modify it); the tokenizer is read once per model and cached.
    Exact for byte-level, SentencePiece-style and llama.cpp tokenizers (module docstring); other decoders
    give each token's own rendered text. Raises ``InputError`` for a malformed ``vocabulary`` or a model
    without a tokenizer.

    Example:
        >>> class Toy:
        ...     vocab_size = 3
        >>> token_bytes(Toy(), vocabulary=["é", b"\\xff", ""])
        [b'\\xc3\\xa9', b'\\xff', None]
    """
    size = _vocab_size(model)
    if vocabulary is not None:
        return _from_vocabulary(vocabulary, size)
    tokenizer = getattr(model, "tokenizer", None)
    try:
        cached = _CACHE.get(model)
    except TypeError:  # an unhashable or not weakly referenceable model: no cache
        cached = None
    if cached is not None and cached[0] is tokenizer and len(cached[1]) == size:
        return list(cached[1])
    pieces = tuple(_read(model, tokenizer, size))
    try:
        _CACHE[model] = (tokenizer, pieces)
    except TypeError:
        pass
    return list(pieces)


# ------------------------------------------------------------------------------------------- inputs
def _model_name(model: Any) -> str:
    return str(getattr(model, "name", None) or type(model).__name__)


def _vocab_size(model: Any) -> int:
    size = getattr(model, "vocab_size", None)
    try:
        if isinstance(size, bool):
            raise TypeError
        size = operator.index(size)  # an int or a NumPy integer, never a float or a bool
    except TypeError:
        size = -1
    if size < 0:
        raise InputError(f"{_model_name(model)} has no vocab_size (a non-negative int)")
    return size


def _from_vocabulary(vocabulary: Any, size: int) -> list[bytes | None]:
    """The explicit ``vocabulary=`` checked and spelled as bytes."""
    if isinstance(vocabulary, (str, bytes, bytearray)) or not hasattr(vocabulary, "__len__"):
        raise InputError(
            f"vocabulary must be a sequence of token texts (str, bytes or None), got {type(vocabulary).__name__}"
        )
    if len(vocabulary) != size:
        raise InputError(f"vocabulary has {len(vocabulary)} entries; the model's vocabulary has {size} tokens")
    out: list[bytes | None] = []
    for token_id, entry in enumerate(vocabulary):
        if entry is None:
            out.append(None)
        elif isinstance(entry, str):
            try:
                out.append(entry.encode("utf-8") or None)
            except UnicodeEncodeError:
                raise InputError(f"vocabulary[{token_id}] is not encodable as UTF-8 (a lone surrogate): "
                                 "give its bytes") from None
        elif isinstance(entry, (bytes, bytearray)):
            out.append(bytes(entry) or None)
        else:
            raise InputError(f"vocabulary[{token_id}] must be str, bytes or None, got {type(entry).__name__}")
    return out


# ----------------------------------------------------------------------------------- tokenizer kinds
def _read(model: Any, tokenizer: Any, size: int) -> list[bytes | None]:
    """The model's own spelling where it gives one (checked like an explicit vocabulary), else its tokenizer's."""
    own = getattr(model, "token_bytes", None)
    if callable(own):
        return _from_vocabulary(own(), size)
    return tokenizer_bytes(tokenizer, size, name=_model_name(model))


def tokenizer_bytes(tokenizer: Any, size: int, *, name: str = "the model") -> list[bytes | None]:
    """``(size,)`` the bytes each token id adds to the decoded text, read from ``tokenizer``: a transformers
    tokenizer (:func:`hf_token_bytes`) or one that spells its tokens itself (``tokenizer.token_bytes()``,
    llama.cpp's). Ids past the tokenizer's end add nothing. ``InputError`` naming ``name`` for anything else
    (None included).

    Example:
        >>> tokenizer_bytes(None, 3, name="toy")   # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        InputError: toy has no tokenizer: pass vocabulary=[token text by id]
    """
    if _is_transformers_tokenizer(tokenizer):
        return _hf_bytes(tokenizer, size, name)
    own = getattr(tokenizer, "token_bytes", None)
    if callable(own):
        pieces = list(own())[:size]
        return _from_vocabulary(pieces + [None] * (size - len(pieces)), size)
    raise InputError(f"{name} has no tokenizer: pass vocabulary=[token text by id]")


def hf_token_bytes(tokenizer: Any, size: int | None = None, *, name: str = "the model") -> list[bytes | None]:
    """``(size,)`` the bytes each token id of a transformers tokenizer adds to the decoded text (``size``:
    the model's logits width, default the tokenizer's length; ids past the tokenizer add nothing). Exact
    for byte-level and SentencePiece-style decoders (module docstring); ``InputError`` naming ``name`` for
    an object that is not a transformers tokenizer, or a byte-level one whose tokens do not spell its own
    encoding back."""
    if not _is_transformers_tokenizer(tokenizer):
        raise InputError(f"{name} has no tokenizer: pass vocabulary=[token text by id]")
    return _hf_bytes(tokenizer, len(tokenizer) if size is None else size, name)


def _is_transformers_tokenizer(tokenizer: Any) -> bool:
    # A transformers tokenizer exists only once transformers is imported: no import of it here.
    transformers = sys.modules.get("transformers")
    base = getattr(transformers, "PreTrainedTokenizerBase", None) if transformers is not None else None
    return base is not None and isinstance(tokenizer, base)


@lru_cache(maxsize=1)
def _unicode_to_byte() -> dict[str, int]:
    """The inverse of GPT-2's ``bytes_to_unicode``: printable bytes stand for themselves, the other 68 are
    shifted to code points 256 and up, in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + shifted)] = b
            shifted += 1
    return table


def _decoder_steps(decoder: dict | None) -> list[tuple] | None:
    """A fast tokenizer's decoder (its JSON) as per-token steps; None when some step is not per-token
    (then each token is rendered by the tokenizer itself)."""
    if not decoder:
        return None
    if decoder.get("type") != "Sequence":
        return _decoder_step(decoder, fused=False)
    steps: list[tuple] = []
    fused = False  # after Fuse the later steps see the whole text as one token
    for part in decoder.get("decoders") or []:
        inner = _decoder_step(part, fused)
        if inner is None:
            return None
        steps.extend(inner)
        fused = fused or part.get("type") == "Fuse"
    return steps


def _decoder_step(decoder: dict, fused: bool) -> list[tuple] | None:
    kind = decoder.get("type")
    if kind == "ByteLevel":
        return [("byte_level",)]
    if kind == "ByteFallback":
        return [("byte_fallback",)]
    if kind == "Fuse":
        return []
    if kind == "Strip":
        # On the fused text it trims the text's ends (a leading space), which a token mid-text never sees;
        # before Fuse it trims every token.
        content, start, stop = decoder.get("content"), decoder.get("start", 0), decoder.get("stop", 0)
        if fused:
            return []
        return [("strip", content, int(start), int(stop))] if isinstance(content, str) and len(content) == 1 else None
    if kind == "Replace":
        pattern, content = decoder.get("pattern") or {}, decoder.get("content")
        if "String" not in pattern or not isinstance(content, str):
            return None  # a regex replacement is not a per-token byte mapping we can invert
        return [("replace", pattern["String"], content)]
    if kind == "Metaspace":
        return [("replace", decoder.get("replacement", "▁"), " ")]
    return None


def _apply_steps(token: str, steps: list[tuple]) -> bytes:
    """One token's bytes through the decoder's steps, as the tokenizers library decodes it mid-text."""
    piece: str | bytes = token
    for step in steps:
        if step[0] == "replace":
            old, new = step[1], step[2]
            piece = piece.replace(old, new) if isinstance(piece, str) else piece.replace(old.encode(), new.encode())
        elif step[0] == "byte_fallback" and isinstance(piece, str):
            match = _BYTE_TOKEN.fullmatch(piece)
            if match:
                piece = bytes([int(match.group(1), 16)])
        elif step[0] == "strip":
            piece = _strip(piece, step[1], step[2], step[3])
        elif step[0] == "byte_level" and isinstance(piece, str):
            table = _unicode_to_byte()
            # As the tokenizers library does: a token with a character outside the table keeps its UTF-8.
            if all(ch in table for ch in piece):
                piece = bytes(table[ch] for ch in piece)
    return piece.encode("utf-8") if isinstance(piece, str) else piece


def _strip(piece: str | bytes, content: str, start: int, stop: int) -> str | bytes:
    """Up to ``start`` leading and ``stop`` trailing ``content`` characters removed (the Strip decoder)."""
    unit = content if isinstance(piece, str) else content.encode("utf-8")
    for _ in range(start):
        if not piece.startswith(unit):  # type: ignore[arg-type]
            break
        piece = piece[len(unit):]
    for _ in range(stop):
        if not piece.endswith(unit):  # type: ignore[arg-type]
            break
        piece = piece[: len(piece) - len(unit)]
    return piece


def _backend_json(tokenizer: Any) -> dict | None:
    """A fast tokenizer's full description (decoder, normalizer, ...); None for a slow tokenizer."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return None
    try:
        return json.loads(backend.to_str())
    except (ValueError, AttributeError, TypeError):
        return {}


def _hf_steps(tokenizer: Any, description: dict | None) -> list[tuple] | None:
    if description is not None:
        return _decoder_steps(description.get("decoder"))
    # Slow (Python) tokenizers: GPT-2 style keeps a byte decoder, SentencePiece ones a model.
    if hasattr(tokenizer, "byte_decoder"):
        return [("byte_level",)]
    if hasattr(tokenizer, "sp_model"):
        return [("replace", "▁", " "), ("byte_fallback",)]
    return None


def _hf_bytes(tokenizer: Any, size: int, name: str) -> list[bytes | None]:
    """Every token of a transformers tokenizer (see the module docstring for the kinds read exactly)."""
    count = min(size, len(tokenizer))
    tokens = tokenizer.convert_ids_to_tokens(list(range(count)))
    special = {int(i) for i in getattr(tokenizer, "all_special_ids", []) or []}
    for token_id, added in (getattr(tokenizer, "added_tokens_decoder", None) or {}).items():
        if getattr(added, "special", False):
            special.add(int(token_id))
    description = _backend_json(tokenizer)
    steps = _hf_steps(tokenizer, description)
    out: list[bytes | None] = [None] * size
    for token_id, token in enumerate(tokens):
        if token is None or token_id in special:
            continue
        if steps is not None:
            piece = _apply_steps(token, steps)
        else:
            piece = tokenizer.convert_tokens_to_string([token]).encode("utf-8")
        out[token_id] = piece or None
    # A normalizer may rewrite the text before encoding (lowercase, NFC): then the encoding cannot spell
    # the text back and there is nothing to check.
    if steps is not None and ("byte_level",) in steps and not (description or {}).get("normalizer"):
        _check_byte_level(tokenizer, out, name)
    return out


def _check_byte_level(tokenizer: Any, pieces: list[bytes | None], name: str) -> None:
    """The inverted byte table must spell the tokenizer's own encoding of a probe text back (a leading space
    is allowed: some byte-level tokenizers prepend one); anything else means the decoder was misread."""
    try:
        ids = tokenizer(_PROBE, add_special_tokens=False)["input_ids"]
    except Exception:  # noqa: BLE001 - a tokenizer that cannot encode text leaves nothing to compare
        return
    if not all(0 <= t < len(pieces) and pieces[t] is not None for t in ids):
        return  # an unknown-character or special token in the encoding: it cannot spell the text
    spelled = b"".join(pieces[t] for t in ids)
    expected = _PROBE.encode("utf-8")
    if spelled not in (expected, b" " + expected):
        raise InputError(
            f"cannot read the token bytes of {name}'s byte-level tokenizer (its tokens do not spell its own "
            "encoding back): pass vocabulary=[token text by id]"
        )
