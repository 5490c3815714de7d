"""Choosing a draft by name: one registry of every draft kind, for decoding and for enumeration.

A spec (the CLI's ``--draft`` value or a Python string) names one kind: ``none``, ``lookup``, ``ngram``,
``llamacpp`` / ``llamacpp:FILE.gguf``, ``int8``, ``bf16``, ``layers:K`` or a ``PATH``. Each kind in
:data:`DRAFT_REGISTRY` says what it is for — decoding (``speculum.generate`` accepts ``None``, a proposer of
fixed tokens or a model), enumeration (a draft *model*: enumeration needs a distribution), or both — how
its spec is checked without loading anything, and how it is built. :func:`make_draft` builds decoding
drafts, :func:`make_enumeration_draft` enumeration drafts (draft *models*: for the embedded default,
``llamacpp`` is the same weights on llama.cpp's arithmetic, the closest draft), and :func:`check_draft_spec`
checks a spec for either purpose. A draft given as another model must share the
target's tokenizer — drafting compares token ids — which :func:`check_same_tokenizer` verifies.

Example:
    >>> target = speculum.load_model()                       # doctest: +SKIP
    >>> draft = make_draft("lookup", target)                   # doctest: +SKIP
    >>> speculum.generate(target, ids, draft=draft, temperature=0)   # doctest: +SKIP
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

from ..models.backends import DEFAULT_BACKEND, load_model
from ..models.llamacpp import load_llamacpp_model
from ..models.reference.ngram import NGramModel
from ..models.paths import DEFAULT_MODEL, EMBEDDED_MODELS, is_embedded_model
from ..validation import InputError, check_int
from .ngram_fit import NGRAM_ORDER, NGRAM_SAMPLES, fit_ngram_draft
from .proposers import NGramProposer, PromptLookup

__all__ = ["make_draft", "make_enumeration_draft", "build_draft", "check_draft_spec", "is_embedded_model",
           "is_twin_draft", "check_same_tokenizer", "draft_kinds", "DraftKind", "DraftRequest", "DRAFT_REGISTRY",
           "DRAFT_KINDS", "ENUMERATION_DRAFTS", "DECODING", "ENUMERATION"]

DECODING = "decoding"
ENUMERATION = "enumeration"

# Prompt lookup and n-gram settings: 3-token matches fall back to 1, proposals of up to 16 tokens
# (Saxena 2023 uses max_ngram 3, 10 tokens); the n-gram draft only proposes from a seen bigram context.
LOOKUP_MAX_NGRAM = 3
LOOKUP_NUM_TOKENS = 16
NGRAM_NUM_TOKENS = 8


@dataclass(frozen=True)
class DraftRequest:
    """What a builder may use beyond the spec and the target; each purpose fills its own fields."""

    corpus: Sequence[Sequence[int]] = ()   # decoding n-gram: sequences fitted before it learns online
    prompt: Sequence[int] = ()             # enumeration: the prompt whose continuations are enumerated
    length: int = 16                       # enumeration: longest continuation the fitted n-gram samples
    eos: int | None = None                 # enumeration: samples stop at eos
    n_samples: int = NGRAM_SAMPLES         # enumeration: target samples the fitted n-gram is fitted on
    seed: int = 0                          # enumeration: seed of that sampler


Builder = Callable[[str, Any, DraftRequest], Any]


def _accept(spec: str) -> None:
    """The check of a kind whose spec is a fixed word: nothing more to check."""


@dataclass(frozen=True)
class DraftKind:
    """One kind of draft.

    ``label``: how it is listed (``"layers:K"``, ``"PATH"``). ``uses``: for each purpose it serves, what it
    is for that purpose and its builder ``(spec, target, request) -> draft``. ``refusals``: for a purpose it
    does not serve, why. ``matches(spec)``: whether a stripped spec names this kind. ``check(spec)``: raises
    (``InputError`` / ``FileNotFoundError``) for a bad value, a bad K or a missing file, loading nothing.
    ``twin``: built from the target's own weights, so only on a backend whose entry in
    :data:`~speculum.models.backends.BACKENDS` declares ``twin_drafts``.
    """

    label: str
    uses: Mapping[str, tuple[str, Builder]]
    matches: Callable[[str], bool]
    check: Callable[[str], None] = _accept
    refusals: Mapping[str, str] = field(default_factory=dict)
    twin: bool = False


# ---------------------------------------------------------------------------------------------- builders
def _build_none(spec: str, target: Any, request: DraftRequest) -> None:
    return None


def _build_lookup(spec: str, target: Any, request: DraftRequest) -> Any:
    return PromptLookup(LOOKUP_MAX_NGRAM, num_pred_tokens=LOOKUP_NUM_TOKENS, vocab_size=target.vocab_size)


def _build_online_ngram(spec: str, target: Any, request: DraftRequest) -> Any:
    model = NGramModel(NGRAM_ORDER, target.vocab_size)
    for sequence in request.corpus:
        model.update(sequence)
    return NGramProposer(model, num_pred_tokens=NGRAM_NUM_TOKENS, learn=True, min_context=1)


def _build_fitted_ngram(spec: str, target: Any, request: DraftRequest) -> Any:
    return fit_ngram_draft(target, request.prompt, length=request.length, eos=request.eos,
                           n_samples=request.n_samples, seed=request.seed)


def _llamacpp_source(spec: str) -> str | None:
    """The GGUF of a ``llamacpp:FILE`` spec (None for plain ``llamacpp``: the embedded default)."""
    return spec[len("llamacpp:"):] if spec.lower().startswith("llamacpp:") else None


def _build_llamacpp(spec: str, target: Any, request: DraftRequest) -> Any:
    # draft_for: the GGUF must share the target's tokenizer (InputError otherwise).
    return load_llamacpp_model(_llamacpp_source(spec) or DEFAULT_MODEL, draft_for=target)


def _build_twin(spec: str, target: Any, request: DraftRequest) -> Any:
    # torch (the optional [llm] extra): the twins are built from a PyTorch target's weights.
    from ..models.hf import HFModel
    from .twins import bf16_twin, int8_twin, truncated_draft  # torch too

    kind = spec.lower()
    if not isinstance(target, HFModel):
        raise InputError(f"draft {kind!r} is built from the target's weights and needs a Hugging Face target")
    if kind == "int8":
        return int8_twin(target)
    if kind == "bf16":
        return bf16_twin(target)
    return truncated_draft(target, int(kind.split(":", 1)[1]))  # K checked by _check_layers


def _build_path(spec: str, target: Any, request: DraftRequest) -> Any:
    # A llama.cpp target takes its draft from llama.cpp too (a GGUF path or embedded name).
    draft = load_model(spec, backend=getattr(target, "backend", DEFAULT_BACKEND), dtype=_dtype_name(target))
    check_same_tokenizer(target, draft)
    return draft


# ------------------------------------------------------------------------------------------------ checks
def _word(word: str) -> Callable[[str], bool]:
    return lambda spec: spec.lower() == word


def _prefix(prefix: str) -> Callable[[str], bool]:
    return lambda spec: spec.lower().startswith(prefix)


def _check_layers(spec: str) -> None:
    count = spec.split(":", 1)[1]
    try:
        layers = int(count)
    except ValueError:
        raise InputError(f"draft layers:K needs an integer K, got {count!r}") from None
    check_int(layers, "draft layers:K: layers", minimum=1)   # K's upper bound is the target's, checked when built


def _check_gguf(spec: str) -> None:
    source = _llamacpp_source(spec)
    if not (Path(source).expanduser().is_file() or is_embedded_model(source)):
        raise FileNotFoundError(f"draft llamacpp: no GGUF file at {source!r} and no embedded model by that name")


def _looks_like_path(spec: str) -> bool:
    return "/" in spec or os.sep in spec or spec.startswith((".", "~"))


def _names_a_model(spec: str) -> bool:
    return is_embedded_model(spec) or Path(spec).expanduser().exists() or _looks_like_path(spec)


def _check_path(spec: str) -> None:
    if not (is_embedded_model(spec) or Path(spec).expanduser().exists()):
        raise FileNotFoundError(f"draft path {spec!r} does not exist")


# ---------------------------------------------------------------------------------------------- registry
_TWIN = "the target with int8 dynamically quantised Linear layers"
_MODEL = "another local model directory (or embedded name) with the same tokenizer"
_LAYERS = "the target's first K blocks + final norm + head (shares its weights)"

# In listing order; the first kind whose ``matches`` accepts a spec is the one it names.
DRAFT_REGISTRY: tuple[DraftKind, ...] = (
    DraftKind("none", {DECODING: ("plain decoding (no draft)", _build_none),
                       ENUMERATION: ("the exact index on the target (no draft)", _build_none)}, _word("none")),
    DraftKind("lookup", {DECODING: ("prompt lookup: copy what followed the last n-gram's earlier occurrence",
                                    _build_lookup)}, _word("lookup"),
              refusals={ENUMERATION: "proposes fixed tokens; enumeration needs a draft model"}),
    DraftKind("ngram", {DECODING: ("an n-gram model of token ids, learning online from the prompt and the output",
                                   _build_online_ngram),
                        ENUMERATION: ("an n-gram model fitted to continuations sampled from the target",
                                      _build_fitted_ngram)}, _word("ngram")),
    DraftKind("llamacpp", {ENUMERATION: ("the embedded GGUF on llama.cpp (the weights the default target is "
                                         "de-quantised from)", _build_llamacpp)}, _word("llamacpp"),
              refusals={DECODING: "is an enumeration draft; for decoding give a GGUF file as PATH"}),
    DraftKind("llamacpp:GGUF", {ENUMERATION: ("another GGUF file on llama.cpp, with the target's tokenizer",
                                              _build_llamacpp)}, _prefix("llamacpp:"), _check_gguf,
              refusals={DECODING: "is an enumeration draft; for decoding give the GGUF file as PATH"}),
    DraftKind("int8", {DECODING: (_TWIN, _build_twin), ENUMERATION: (_TWIN, _build_twin)}, _word("int8"),
              twin=True),
    DraftKind("bf16", {DECODING: ("a bfloat16 copy of the target", _build_twin),
                       ENUMERATION: ("a bfloat16 copy of the target", _build_twin)}, _word("bf16"), twin=True),
    DraftKind("layers:K", {DECODING: (_LAYERS, _build_twin), ENUMERATION: (_LAYERS, _build_twin)},
              _prefix("layers:"), _check_layers, twin=True),
    DraftKind("PATH", {DECODING: (_MODEL, _build_path), ENUMERATION: (_MODEL, _build_path)}, _names_a_model,
              _check_path),
)


def draft_kinds(purpose: str) -> dict[str, str]:
    """``{label: what it is for}`` of the kinds serving ``purpose`` (:data:`DECODING` or :data:`ENUMERATION`),
    in listing order."""
    if purpose not in (DECODING, ENUMERATION):
        raise InputError(f"purpose must be {DECODING!r} or {ENUMERATION!r}, got {purpose!r}")
    return {kind.label: kind.uses[purpose][0] for kind in DRAFT_REGISTRY if purpose in kind.uses}


# Shown by `speculum generate --help` and `speculum enumerate --help`.
DRAFT_KINDS = draft_kinds(DECODING)
ENUMERATION_DRAFTS = tuple(draft_kinds(ENUMERATION))


def is_twin_draft(spec: Any) -> bool:
    """Whether ``spec`` names a draft built from the target's own weights (``int8``, ``bf16``, ``layers:K``),
    checked or not; such a draft needs a backend that declares ``twin_drafts``."""
    if not isinstance(spec, str):
        return False
    kind = next((kind for kind in DRAFT_REGISTRY if kind.matches(spec.strip())), None)
    return kind is not None and kind.twin


def _listed(kinds: Iterable[str]) -> str:
    choices = list(kinds)
    return f"{', '.join(choices[:-1])} or {choices[-1]}" if len(choices) > 1 else ", ".join(choices)


def _resolve(spec: Any, purpose: str, kinds: Iterable[str] | None) -> tuple[str, DraftKind]:
    """The stripped spec and the kind it names for ``purpose``; raises (listing ``kinds``, default: the
    purpose's) when it names none, one for another purpose, or an invalid value."""
    listed = tuple(draft_kinds(purpose)) if kinds is None else tuple(kinds)
    if not isinstance(spec, str) or not spec.strip():
        raise InputError(f"draft must be a non-empty string, got {spec!r}")
    spec = spec.strip()
    for kind in DRAFT_REGISTRY:
        if not kind.matches(spec):
            continue
        if purpose not in kind.uses:
            reason = kind.refusals.get(purpose, f"is not a {purpose} draft")
            raise InputError(f"draft {spec!r} {reason} ({', '.join(listed)})")
        kind.check(spec)
        return spec, kind
    raise InputError(f"unknown draft {spec!r}: use {_listed(listed)} (a local model, or an embedded one: "
                     f"{', '.join(EMBEDDED_MODELS)})")


# ------------------------------------------------------------------------------------------- public API
def build_draft(spec: str, target: Any, *, purpose: str, request: DraftRequest = DraftRequest()) -> Any:
    """The draft named by ``spec`` for ``target`` and ``purpose``: checked first (as :func:`check_draft_spec`),
    then built with what ``request`` carries."""
    spec, kind = _resolve(spec, purpose, None)
    return kind.uses[purpose][1](spec, target, request)


def make_draft(spec: str | None, target: Any, *, corpus: Sequence[Sequence[int]] = ()) -> Any:
    """Build the decoding draft named by ``spec`` for ``target``.

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
    return build_draft(spec, target, purpose=DECODING, request=DraftRequest(corpus=corpus))


def make_enumeration_draft(spec: str, target: Any, *, prompt: Sequence[int], length: int,
                           eos: int | None = None, n_samples: int = NGRAM_SAMPLES, seed: int = 0) -> Any:
    """The draft model named by ``spec`` (one of :data:`ENUMERATION_DRAFTS`) for enumerating ``target``'s
    continuations; None for ``none``. ``ValueError`` / ``FileNotFoundError`` for a spec that names no
    enumeration draft, checked before anything loads.

    ``ngram`` costs ``length`` batched target calls (the samples, :func:`~speculum.drafts.ngram_fit.fit_ngram_draft`);
    the twins cost no target call.

    Example:
        >>> draft = make_enumeration_draft("ngram", target, prompt=prompt_ids, length=3)   # doctest: +SKIP
    """
    request = DraftRequest(prompt=tuple(prompt), length=length, eos=eos, n_samples=n_samples, seed=seed)
    return build_draft(spec, target, purpose=ENUMERATION, request=request)


def check_draft_spec(spec: Any, *, kinds: Iterable[str] | None = None, purpose: str = DECODING) -> str:
    """Check a draft spec for ``purpose`` without loading anything; return it stripped of surrounding blanks.

    Accepts the kinds serving ``purpose`` (``layers:K`` with an integer K >= 1, ``llamacpp:FILE`` with an
    existing file or embedded name, an embedded model name or an existing path). Raises ValueError for
    anything else, listing ``kinds`` (default: the purpose's kinds), and FileNotFoundError for a spec that
    looks like a path (a separator, or a leading ``.`` or ``~``) but does not exist. K's upper bound depends
    on the target and is checked when the draft is built.

    Example:
        >>> check_draft_spec(" layers:4 ")
        'layers:4'
        >>> check_draft_spec("lookup", purpose="enumeration")  # doctest: +IGNORE_EXCEPTION_DETAIL
        Traceback (most recent call last):
        ...
        InputError: draft 'lookup' proposes fixed tokens; enumeration needs a draft model (none, ngram, ...)
    """
    return _resolve(spec, purpose, kinds)[0]


def check_same_tokenizer(target: Any, draft: Any) -> None:
    """Raise ValueError unless ``draft`` and ``target`` map text to the same token ids.

    Compares the logits widths and, when both carry tokenizers, their full vocabularies (token -> id).
    """
    target_name, draft_name = getattr(target, "name", "target"), getattr(draft, "name", "draft")
    if draft.vocab_size != target.vocab_size:
        raise InputError(
            f"draft {draft_name} has a vocabulary of {draft.vocab_size} tokens but target {target_name} has "
            f"{target.vocab_size}: a draft must use the target's tokenizer"
        )
    target_tok, draft_tok = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    if target_tok is not None and draft_tok is not None and target_tok.get_vocab() != draft_tok.get_vocab():
        raise InputError(
            f"draft {draft_name} has a different tokenizer from target {target_name} (same size, different "
            f"token ids): a draft must use the target's tokenizer"
        )


def _dtype_name(target: Any) -> str:
    dtype = getattr(target, "dtype", None)
    return str(dtype).replace("torch.", "") if dtype is not None else "float32"
