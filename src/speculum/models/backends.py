"""The backends a model loads on, in one table, and :func:`load_model`, which reads it.

Why: a backend named by a string compared wherever it matters (``load_model``, the command line's
``--backend`` and its checks, the Ray pool's model spec) makes a new backend touch every one of them.
Here each backend is one :class:`Backend` entry of :data:`BACKENDS`: its loader and what it declares — the
precisions it loads, the other ``load_model`` options it takes, what a path names for it, whether the
twin drafts (int8, bf16, layers:K: built from the target's own weights) can be built from its models,
whether it runs in a Ray pool's actors. Everything else reads those flags.

Loaders are named in :data:`_LAZY` and imported on first load: the backends need optional extras (torch
and transformers, llama-cpp-python), and importing this table imports none of them. A new backend touches
this file (its entry and its loader's line in ``_LAZY``), its own package and its tests.

Example:
    >>> list(BACKENDS)
    ['hf', 'llamacpp']
    >>> BACKENDS["llamacpp"].dtypes, BACKENDS["hf"].twin_drafts
    ((), True)
    >>> backend_named("onnx")  # doctest: +IGNORE_EXCEPTION_DETAIL
    Traceback (most recent call last):
    ...
    InputError: backend must be one of hf, llamacpp, got 'onnx'
"""
from __future__ import annotations

import contextlib
import gc
import importlib
import os
from dataclasses import dataclass
from typing import Any, Callable

from ..validation import InputError
from .paths import DEFAULT_MODEL

__all__ = ["Backend", "BACKENDS", "DEFAULT_BACKEND", "backend_named", "backend_names", "load_model"]

# Loader name -> its module, imported on first load (the import checker reads this table as imports).
_LAZY = {
    "load_hf_model": "speculum.models.hf_loading",
    "dtype_advice": "speculum.models.hf.precision",
    "load_llamacpp_model": "speculum.models.llamacpp",
}

# The load_model options a backend may take besides dtype (which it takes when it lists dtypes).
OPTIONS = ("progress", "prepack", "verify")


@dataclass(frozen=True)
class Backend:
    """One backend: its name, its loader and what it declares.

    ``loader``: the name in ``_LAZY`` of ``load(name_or_path, **options) -> model``, given ``dtype`` when
    ``dtypes`` lists any and the options in ``options``. ``summary``: what it runs on (``--backend``'s
    help). ``opens``: what a path names for it (an embedded model's name works on every backend).
    ``dtypes``: the precisions it loads, the default first; none when the model file fixes them, and then
    ``fixed_dtype`` says why. ``twin_drafts``: the int8 / bf16 / layers:K drafts can be built from its
    models. ``ray``: it loads in a :class:`~speculum.distributed.RayPool`'s actors. ``advice``: the name in
    ``_LAZY`` of ``advice(dtype) -> str | None``, why a dtype may run slower than the default on this CPU.
    """

    name: str
    loader: str
    summary: str
    opens: str
    dtypes: tuple[str, ...] = ()
    fixed_dtype: str = ""
    options: frozenset[str] = frozenset()
    twin_drafts: bool = False
    ray: bool = True
    advice: str = ""

    @property
    def takes_dtype(self) -> bool:
        return bool(self.dtypes)

    def load(self, name_or_path: Any, **options: Any) -> Any:
        """The model, loaded with the options this backend takes (the others are left out)."""
        taken = {key: value for key, value in options.items()
                 if key in self.options or (key == "dtype" and self.takes_dtype)}
        return _lazy(self.loader)(name_or_path, **taken)

    def dtype_advice(self, dtype: str) -> str | None:
        """Why ``dtype`` may run slower than the default here (None: no reason known, or no advice)."""
        return _lazy(self.advice)(dtype) if self.advice else None


BACKENDS: dict[str, Backend] = {backend.name: backend for backend in (
    Backend("hf", "load_hf_model", "PyTorch via transformers", "local model directory or GGUF file",
            dtypes=("float32", "bfloat16", "float16", "int8", "q8"), options=frozenset(OPTIONS), twin_drafts=True,
            advice="dtype_advice"),
    Backend("llamacpp", "load_llamacpp_model", "llama-cpp-python", "GGUF file",
            fixed_dtype="the GGUF file fixes the weights' types"),
)}
DEFAULT_BACKEND = "hf"


def _lazy(name: str) -> Callable[..., Any]:
    return getattr(importlib.import_module(_LAZY[name]), name)


def backend_names(predicate: Callable[[Backend], bool] = lambda backend: True) -> tuple[str, ...]:
    """The names of the backends for which ``predicate`` holds, in table order (default: all)."""
    return tuple(name for name, backend in BACKENDS.items() if predicate(backend))


def backend_named(name: Any) -> Backend:
    """The entry of :data:`BACKENDS` called ``name``; InputError (one line, naming the known ones) otherwise."""
    if not isinstance(name, str) or name not in BACKENDS:
        raise InputError(f"backend must be one of {', '.join(BACKENDS)}, got {name!r}")
    return BACKENDS[name]


def load_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    backend: str = DEFAULT_BACKEND,
    dtype: str = "float32",
    progress: Any = True,
    prepack: bool = True,
    verify: bool = False,
) -> Any:
    """Load a target or draft model by embedded name or local path.

    Args:
        name_or_path: ``"smollm2-135m"`` (the embedded default) or a local Hugging Face model directory
            (``backend="hf"``) / GGUF file (``backend="llamacpp"``).
        backend: a name in :data:`BACKENDS`: ``"hf"`` (PyTorch via transformers) or ``"llamacpp"``
            (llama-cpp-python, optional).
        dtype: ``"float32"`` (default), ``"bfloat16"``, ``"float16"``, ``"int8"`` (weight-only, one scale
            per output channel, float32 activations) or ``"q8"`` (a GGUF file's weight groups times
            activations quantised to 8 bits, as llama.cpp multiplies; GGUF files and the embedded model
            only) — hf backend only. Each is a target of its own: every
            guarantee holds relative to the target loaded (docs/backends.md says which to pick).
        progress: how the one-time conversion of an embedded model (~30 s) is reported: a callable
            receives a :class:`~speculum.models.hf_loading.ConversionProgress` per stage (the ``speculum``
            command passes one drawing a bar); ``True`` prints one plain line per stage on stderr
            (:func:`~speculum.models.hf_loading.print_conversion_progress`); ``False`` or ``None`` reports
            nothing and also turns off transformers' own progress bars while an embedded model loads from
            its GGUF file. ``load_model`` itself never draws a progress bar.
        prepack: hf backend, float32 on CPU: the fast path, same results to float32 rounding — the fused
            forward (:mod:`speculum.models.hf.forward.fused`) where it applies, else Linear weights
            pre-packed for oneDNN (:mod:`speculum.models.hf.kernels.onednn`); False keeps transformers' forward with
            PyTorch's default kernels, bit for bit what transformers computes.
        verify: embedded models: check the checksum of every cached file even where this machine has
            confirmed them (sizes and stat stamps are always checked; see :mod:`speculum.models.checkpoints`).

    Options a backend does not take (:attr:`Backend.options`, :attr:`Backend.dtypes`) are ignored. A damaged
    cache of an embedded model is rebuilt with a one-line warning; an unwritable one is bypassed (one-line
    warning, the model is de-quantised from its GGUF on every load).

    Raises ValueError (unknown name / backend / dtype; :class:`~speculum.models.checkpoints.ModelCacheError` when
    the embedded model loads neither from its rebuilt cache nor from its GGUF), FileNotFoundError (missing
    path), ImportError (missing optional dependency). Never contacts a model hub.

    Example:
        >>> import speculum
        >>> target = speculum.load_model("smollm2-135m")                     # doctest: +SKIP
        >>> target.vocab_size                                                # doctest: +SKIP
        49152
    """
    entry = backend_named(backend)
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise InputError(f"progress must be True, False, None or a callable, got {progress!r}")
    # Everything here is local; make sure transformers never tries the network.
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
    with _collection_paused():
        return entry.load(name_or_path, dtype=dtype, progress=progress, prepack=prepack, verify=verify)


@contextlib.contextmanager
def _collection_paused() -> Any:
    """Automatic garbage collection off for the block, then as it was. Loading a model creates hundreds of
    thousands of objects that outlive it (modules, parameters, the libraries' caches), and each full
    collection on the way walks all of them again; the first one after the load walks them once. Explicit
    ``gc.collect()`` calls still run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
