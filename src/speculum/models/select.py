"""Choosing a draft by name: ``none | lookup | ngram | int8 | bf16 | layers:K | PATH``.

One function, :func:`make_draft`, turns the CLI's ``--draft`` value (or a Python string) into what
``speculum.generate`` accepts: ``None`` (plain decoding), a proposer of fixed tokens (point-mass
verification) or a model (distribution-aware verification). A draft given as another model directory
must share the target's tokenizer — speculative decoding compares token ids — which
:func:`check_same_tokenizer` verifies with a clear error.

Example:
    >>> target = speculum.load_model()                       # doctest: +SKIP
    >>> draft = make_draft("lookup", target)                   # doctest: +SKIP
    >>> speculum.generate(target, ids, draft=draft, temperature=0)   # doctest: +SKIP
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Iterable, Sequence

__all__ = ["make_draft", "check_draft_spec", "is_embedded_model", "check_same_tokenizer", "DRAFT_KINDS"]

# Shown by `speculum generate --help`.
DRAFT_KINDS = {
    "none": "plain decoding (no draft)",
    "lookup": "prompt lookup: copy what followed the last n-gram's earlier occurrence",
    "ngram": "an n-gram model of token ids, learning online from the prompt and the output",
    "int8": "the target with int8 dynamically quantised Linear layers",
    "bf16": "a bfloat16 copy of the target",
    "layers:K": "the target's first K blocks + final norm + head (shares its weights)",
    "PATH": "another local model directory (or embedded name) with the same tokenizer",
}

# Kinds named by a fixed word (layers:K and PATH carry a value).
_NAMED_KINDS = ("none", "lookup", "ngram", "int8", "bf16")

# Prompt lookup and n-gram settings: 3-token matches fall back to 1, proposals of up to 16 tokens
# (Saxena 2023 uses max_ngram 3, 10 tokens); the n-gram draft only proposes from a seen bigram context.
LOOKUP_MAX_NGRAM = 3
LOOKUP_NUM_TOKENS = 16
NGRAM_ORDER = 3
NGRAM_NUM_TOKENS = 8


def make_draft(spec: str | None, target: Any, *, corpus: Sequence[Sequence[int]] = ()) -> Any:
    """Build the draft named by ``spec`` for ``target``.

    Args:
        spec: one of :data:`DRAFT_KINDS` (``"layers:K"`` with an integer K, or a path / embedded name).
        target: the target model; twins and truncated drafts need a Hugging Face target (``HFModel``).
        corpus: token-id sequences the n-gram draft is fitted on before it starts learning online.

    Returns None, a proposer (``propose(context, max_tokens)``) or a protocol model. Raises ValueError
    for an unknown or invalid spec and for a draft whose tokenizer differs from the target's.

    Example:
        >>> make_draft("none", target) is None     # doctest: +SKIP
        True
    """
    if spec is None:
        return None
    kind = check_draft_spec(spec)
    lowered = kind.lower()
    if lowered == "none":
        return None
    if lowered == "lookup":
        from .drafts import PromptLookup

        return PromptLookup(LOOKUP_MAX_NGRAM, num_pred_tokens=LOOKUP_NUM_TOKENS, vocab_size=target.vocab_size)
    if lowered == "ngram":
        from .drafts import NGramProposer
        from .ngram import NGramModel

        model = NGramModel(NGRAM_ORDER, target.vocab_size)
        for sequence in corpus:
            model.update(sequence)
        return NGramProposer(model, num_pred_tokens=NGRAM_NUM_TOKENS, learn=True, min_context=1)
    if lowered in ("int8", "bf16") or lowered.startswith("layers:"):
        return _twin(lowered, target)
    from .default import load_model

    # A llama.cpp target takes its draft from llama.cpp too (a GGUF path or embedded name).
    draft = load_model(kind, backend=getattr(target, "backend", "hf"), dtype=_dtype_name(target))
    check_same_tokenizer(target, draft)
    return draft


def check_draft_spec(spec: Any, *, kinds: Iterable[str] = tuple(DRAFT_KINDS)) -> str:
    """Check a draft spec without loading anything; return it stripped of surrounding blanks.

    Accepts the named kinds, ``layers:K`` with an integer K >= 1, an embedded model name and an existing
    path. Raises ValueError for anything else, listing ``kinds`` (the choices the caller offers), and
    FileNotFoundError for a spec that looks like a path (it has a separator or starts with ``.`` or ``~``)
    but does not exist. K's upper bound depends on the target and is checked when the draft is built.

    Example:
        >>> check_draft_spec(" layers:4 ")
        'layers:4'
        >>> check_draft_spec("lookahead")   # ValueError: unknown draft 'lookahead': use none, lookup, ...
    """
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"draft must be a non-empty string, got {spec!r}")
    kind = spec.strip()
    lowered = kind.lower()
    if lowered in _NAMED_KINDS:
        return kind
    if lowered.startswith("layers:"):
        count = kind.split(":", 1)[1]
        try:
            layers = int(count)
        except ValueError:
            raise ValueError(f"draft layers:K needs an integer K, got {count!r}") from None
        if layers < 1:
            raise ValueError(f"draft layers:K: layers must be an integer >= 1, got {layers}")
        return kind
    if is_embedded_model(kind) or Path(kind).expanduser().exists():
        return kind
    if "/" in kind or os.sep in kind or kind.startswith((".", "~")):
        raise FileNotFoundError(f"draft path {kind!r} does not exist")
    from .default import EMBEDDED_MODELS

    choices = list(kinds)
    listed = f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else ", ".join(choices)
    raise ValueError(f"unknown draft {kind!r}: use {listed} (a local model, or an embedded one: "
                     f"{', '.join(EMBEDDED_MODELS)})")


def is_embedded_model(name: str) -> bool:
    """True when ``name`` (or an alias of it) is one of the models shipped with speculum."""
    from .default import _canonical

    return _canonical(name) is not None


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Raise ValueError unless ``draft`` and ``target`` map text to the same token ids.

    Compares the logits widths and, when both carry tokenizers, their full vocabularies (token -> id).
    """
    target_name, draft_name = getattr(target, "name", "target"), getattr(draft, "name", "draft")
    if draft.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft {draft_name} has a vocabulary of {draft.vocab_size} tokens but target {target_name} has "
            f"{target.vocab_size}: a draft must use the target's tokenizer"
        )
    target_tok, draft_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise ValueError(
            f"draft {draft_name} has a different tokenizer from target {target_name} (same size, different "
            f"token ids): a draft must use the target's tokenizer"
        )


def _twin(kind: str, target: Any) -> Any:
    from .hf import HFModel
    from .twins import bf16_twin, int8_twin, truncated_draft

    if not isinstance(target, HFModel):
        raise ValueError(f"draft {kind!r} is built from the target's weights and needs a Hugging Face target")
    if kind == "int8":
        return int8_twin(target)
    if kind == "bf16":
        return bf16_twin(target)
    return truncated_draft(target, int(kind.split(":", 1)[1]))  # K parsed by check_draft_spec


def _dtype_name(target: Any) -> str:
    dtype = getattr(target, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else "float32"
