"""The target's precision: ``float32``, ``bfloat16``, ``float16``, or ``int8`` weights (weight-only, one
scale per output channel, as llama.cpp's Q8_0 keeps 8-bit weights) with float32 activations.

Each precision is a target of its own: every guarantee (greedy speculative output equal to plain greedy
output, the exact law, exact enumeration scores) holds relative to the target loaded. ``int8`` replaces
every projection and the vocabulary head by :class:`~speculum.models.hf.kernels.int8_weights.Int8Linear`,
whose product is PyTorch's CPU ``_weight_int8pack_mm`` kernel: it holds a quarter of float32's weight bytes
and converts the weights inside the product. That kernel is not tuned on CPU (slower than float32's), so
``int8`` saves memory, not time.

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
from .kernels.int8_weights import Int8Linear

__all__ = ["DTYPES", "parse_dtype", "cast_module", "quantise_int8", "prepare_module", "dtype_advice", "cpu_flags"]

# Weights' precision -> the dtype the module's float tensors (activations, norms, embeddings) are kept in.
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "int8": torch.float32}


def parse_dtype(dtype: str | torch.dtype) -> torch.dtype:
    """``"float32" | "bfloat16" | "float16" | "int8"`` (or a torch dtype) -> the dtype the module's float
    tensors are held in (float32 for ``int8``, whose weights are converted by :func:`prepare_module`);
    InputError otherwise."""
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
    return module


def dtype_advice(dtype: str, flags: frozenset[str] | None = None) -> str | None:
    """Why ``dtype`` may run slower than float32 on this CPU (None: no reason known). bfloat16 products
    pay where the CPU multiplies bfloat16 natively (AVX-512 BF16 or AMX); float16 where it has AVX-512 FP16
    or AMX-FP16; without them PyTorch converts every weight on the fly. int8's weight-only kernel is a
    reference implementation in PyTorch's CPU build, slower than float32 on every CPU."""
    if dtype == "int8":
        return ("PyTorch's CPU kernel for int8 weight-only products (_weight_int8pack_mm) is slower than its float32 "
                "products: int8 saves the weights' memory, not time (benchmarks/dtypes.py)")
    flags = cpu_flags() if flags is None else flags
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
