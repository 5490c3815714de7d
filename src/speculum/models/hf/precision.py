"""The target's precision: ``float32``, ``bfloat16``, ``float16``, ``int8`` weights (weight-only, one
scale per output channel, as llama.cpp's Q8_0 keeps 8-bit weights) with float32 activations, or ``q8``:
a GGUF file's weight groups multiplied by activations quantised to 8 bits, as llama.cpp multiplies them.

Each precision is a target of its own: every guarantee (greedy speculative output equal to plain greedy
output, the exact law, exact enumeration scores) holds relative to the target loaded. ``int8`` replaces
every projection and the vocabulary head by :class:`~speculum.models.hf.kernels.int8_weights.Int8Linear`,
whose product is PyTorch's CPU ``_weight_int8pack_mm`` kernel: it holds a quarter of float32's weight bytes
and converts the weights inside the product. That kernel is not tuned on CPU (slower than float32's), so
``int8`` saves memory, not time.

``q8`` keeps the module in float32 and marks it (:func:`activations_quantised`): its fused forward multiplies
every projection and the head by the file's weight groups with each row quantised to 8 bits in blocks of 32
(:mod:`~speculum.models.hf.kernels.q8_groups`, integer dot products: AVX-512 VNNI, else AVX2). Row-canonical
like float32, but APPROXIMATE relative to float32 (about 1e-2 of a product's scale). Only a model whose every
product has weight groups runs it (:func:`q8_refusal`): a GGUF file of a Llama, Gemma 3, Qwen2 or Qwen3, or the
embedded model.

Example:
    >>> import torch
    >>> parse_dtype("int8"), parse_dtype("bfloat16")
    (torch.float32, torch.bfloat16)
    >>> module = torch.nn.Sequential(torch.nn.Linear(64, 32, bias=False))
    >>> quantise_int8(module), type(module[0]).__name__
    (1, 'Int8Linear')
"""
from __future__ import annotations

import warnings

import torch

from ...validation import InputError
from ..cpu import cpu_flags  # re-exported: the dtype advice reads it
from .kernels.gguf_groups import GROUPS
from .kernels.int8_weights import Int8Linear
from .kernels.q8_groups import Q8_KINDS, q8_unavailable

__all__ = ["DTYPES", "parse_dtype", "cast_module", "quantise_int8", "prepare_module", "dtype_advice", "cpu_flags",
           "activations_quantised", "float_activations", "quantise_activations", "q8_refusal", "Q8_REFUSAL"]

# Weights' precision -> the dtype the module's float tensors (activations, norms, embeddings) are kept in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.float32,
          "q8": torch.float32}
_Q8 = "speculum_q8"          # the attribute marking a module of the ``q8`` target
Q8_REFUSAL = "q8 multiplies a GGUF file's weight groups: load a GGUF file or the embedded model"


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16" | "int8" | "q8"`` (or a torch dtype) -> the dtype the module's
    float tensors are held in (float32 for ``int8``, whose weights are converted by :func:`prepare_module`,
    and for ``q8``); InputError otherwise."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype not in DTYPES:
        raise InputError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return DTYPES[dtype]


def quantise_int8(module: torch.nn.Module) -> int:
    """Replace every bias-free ``nn.Linear`` of ``module`` (projections and the vocabulary head; a head tied
    to the embeddings gets an int8 copy, the embeddings stay float) by
    :class:`~speculum.models.hf.kernels.int8_weights.Int8Linear`, in place. Returns how many were replaced."""
    count = 0
    for parent in list(module.modules()):
        for name, child in list(parent.named_children()):
            if type(child) is torch.nn.Linear and child.bias is None:
                setattr(parent, name, Int8Linear.from_linear(child))
                count += 1
    if hasattr(module, "config"):
        module.config.tie_word_embeddings = False      # the head is its own int8 tensor now
    return count


def cast_module(module: torch.nn.Module, dtype: torch.dtype) -> torch.nn.Module:
    """``module.to(dtype)`` (in place), except the rotary embedding's inverse frequencies (buffers named
    ``*inv_freq``), which stay float32 as transformers loads them: rounded to bfloat16 they would turn a
    rotation angle by up to ~1 radian per thousand positions."""
    kept = {name: buffer for name, buffer in module.named_buffers() if name.endswith("inv_freq")}
    module.to(dtype)
    for name, buffer in kept.items():
        owner, _, leaf = name.rpartition(".")
        setattr(module.get_submodule(owner) if owner else module, leaf, buffer)
    return module


def prepare_module(module: torch.nn.Module, dtype: str | torch.dtype) -> torch.nn.Module:
    """``module`` in the precision ``dtype`` (converted in place where it needs converting)."""
    module = cast_module(module, parse_dtype(dtype))
    if dtype == "int8":
        quantise_int8(module)
    if dtype == "q8":
        quantise_activations(module)
    return module


def quantise_activations(module: torch.nn.Module) -> torch.nn.Module:
    """Mark ``module`` (in place) as the ``q8`` target: its fused forward multiplies with 8-bit activations."""
    setattr(module, _Q8, True)
    return module


def activations_quantised(module: torch.nn.Module) -> bool:
    """True for a module of the ``q8`` target (:func:`prepare_module`): its fused forward multiplies with
    8-bit activations."""
    return bool(getattr(module, _Q8, False))


def float_activations(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` without the ``q8`` mark (in place): a copy made into another target (the int8 and bfloat16
    twins) multiplies with its own float activations."""
    module.__dict__.pop(_Q8, None)
    return module


def q8_refusal(module: torch.nn.Module) -> str | None:
    """None when every projection of ``module``'s blocks and its head carry weight groups of a kind the 8-bit
    kernel multiplies and that kernel runs here, else why ``q8`` cannot run it (one line)."""
    unavailable = q8_unavailable()
    if unavailable is not None:
        return f"q8 needs its compiled kernel: {unavailable}"
    decoder = module.get_decoder() if hasattr(module, "get_decoder") else None
    head = module.get_output_embeddings() if hasattr(module, "get_output_embeddings") else None
    layers = [head]
    for block in getattr(decoder, "layers", None) or []:
        layers += [child for owner in (block.self_attn, block.mlp) for child in owner.children()
                   if type(child) is torch.nn.Linear]
    if decoder is None or head is None or len(layers) == 1:
        return Q8_REFUSAL
    for layer in layers:
        groups = getattr(layer, GROUPS, None)
        if groups is None:
            return Q8_REFUSAL
        if groups.kind not in Q8_KINDS:
            return f"q8 multiplies {', '.join(Q8_KINDS)} weight groups, not {groups.kind}"
    return None


def dtype_advice(dtype: str, flags: frozenset[str] | None = None) -> str | None:
    """Why ``dtype`` may run slower than float32 on this CPU (None: no reason known). bfloat16 products
    pay where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX); float16 where it has AVX-512 FP16
    or AMX-FP16; without them PyTorch converts every weight on the fly. int8's weight-only kernel is a
    reference implementation in PyTorch's CPU build, slower than float32 on every CPU. q8's integer products
    run ahead of float32 wherever its kernel runs (AVX-512 VNNI, or AVX2's int16 pair sums); without its
    compiled kernel q8 is refused."""
    flags = cpu_flags() if flags is None else flags
    if dtype == "q8":
        if q8_unavailable() is not None:
            return f"its compiled kernel does not run here ({q8_unavailable()}): q8 models are refused"
        return None
    if dtype == "int8":
        return ("PyTorch's CPU kernel for int8 weight-only products (_weight_int8pack_mm) is slower than its float32 "
                "products: int8 saves the weights' memory, not time (benchmarks/dtypes.py)")
    if not flags:
        return None
    if dtype == "bfloat16" and not flags & {"avx512_bf16", "amx_bf16"}:
        return "this CPU has neither AVX-512 BF16 nor AMX: bfloat16 products are emulated and usually slower " \
               "than float32"
    if dtype == "float16" and not flags & {"avx512_fp16", "amx_fp16"}:
        return "this CPU has neither AVX-512 FP16 nor AMX-FP16: float16 products are emulated and usually " \
               "slower than float32"
    return None


def warn_if_slow(dtype: str) -> None:
    advice = dtype_advice(dtype)
    if advice is not None:
        warnings.warn(f"dtype={dtype}: {advice}", RuntimeWarning, stacklevel=3)
