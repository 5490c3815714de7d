"""bfloat16 products by AVX-512 BF16 dot products, each output summed in one fixed order: rows in bfloat16,
sums in float32.

Why: a bfloat16 target on a CPU with AVX-512 BF16 but no AMX tiles (AMD Zen 4 and later, Intel Cooper
Lake) should multiply any number of rows a call, and every row must come out the same whatever rows
surround it. oneDNN's bfloat16 kernels give that only for calls of at most 32 rows, each reading the whole
weight again, and round their outputs to bfloat16. ``bf16_dot.c`` gives each output one float32
accumulator to which VDPBF16PS adds one pair of inputs' products at a time, the pairs always in the order
of the inputs, and keeps the float32 sum: ROW-CANONICAL by construction, which the product probe of
:mod:`~speculum.models.hf.kernels.products` checks as for every kernel.

Numbers: each row is rounded to bfloat16 once (round to nearest even, as ``torch.Tensor.bfloat16``) and
multiplied by the bfloat16 weights; the products and sums are float32 (the instruction's own rounding,
subnormals flushed to zero), so the outputs differ from float32 rows by the rows' rounding to bfloat16.

Where the CPU has no AVX-512 BF16, or the compiler does not target it, or there is no C compiler, or
``SPECULUM_KERNELS=off``, the bfloat16 products stay on oneDNN (:func:`dot_unavailable` says why).

Example:
    >>> product = DotProduct(torch.randn(64, 96).bfloat16())           # doctest: +SKIP
    >>> product(torch.randn(5, 96)).shape                              # doctest: +SKIP
    torch.Size([5, 64])
"""
from __future__ import annotations

import ctypes
from pathlib import Path

import torch

from ...cpu import cpu_flags
from .build import KernelLibrary

__all__ = ["forget", "dot_source", "DotProduct", "dot_unavailable"]

_SOURCE = Path(__file__).with_name("bf16_dot.c")
_LANES = 16                 # outputs a 512-bit accumulator holds


def dot_source() -> Path:
    """The kernel's C source (what its release is the hash of)."""
    return _SOURCE


def dot_unavailable() -> str | None:
    """None when the dot-product kernel is built and runs on this machine, else why not (one line);
    ``SPECULUM_KERNELS=off`` is read at each call."""
    return _LIBRARY.unavailable()


def forget() -> None:
    """Drop what this process remembers about the dot-product kernel (loaded, or why not): the next use
    looks for it and builds it again, in the cache ``SPECULUM_CACHE`` names then. Products built before keep
    their kernel."""
    _LIBRARY.forget()


def _requires() -> str | None:
    return None if "avx512_bf16" in cpu_flags() else "this CPU has no AVX-512 BF16"


def _configure(library: ctypes.CDLL) -> str | None:
    if not library.bf16_dot_compiled():
        return "the compiler did not target AVX-512 BF16"
    library.bf16_dot_product.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                         ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.bf16_dot_product.restype = None
    return None


_LIBRARY = KernelLibrary("bf16dot", _SOURCE, "bfloat16 dot products (oneDNN multiplies instead)", _requires,
                         _configure)


class DotProduct:
    """``rows (m, in_features) float32 -> (m, out_features) float32`` by a bfloat16 weight, the rows rounded
    to bfloat16. Guarantee: ROW-CANONICAL (see the module); needs :func:`dot_unavailable` to be None.

    The weight is packed once: each lane block of 16 outputs as pairs of adjacent inputs, 16 lanes by 2
    inputs a 512-bit load, padded with zeros to whole blocks and an even width (zeros add exact zeros)."""

    __slots__ = ("packed", "in_features", "out_features", "_width", "_function")

    def __init__(self, weight: torch.Tensor) -> None:
        library = _LIBRARY.require("bfloat16 dot products")
        self._function = library.bf16_dot_product
        self.out_features, self.in_features = weight.shape
        self._width = self.in_features + self.in_features % 2
        outputs = -(-self.out_features // _LANES) * _LANES
        full = weight.new_zeros(outputs, self._width, dtype=torch.bfloat16)
        full[:self.out_features, :self.in_features] = weight.detach()
        # (blocks, 16 lanes, pairs, 2) -> (blocks, pairs, 16 lanes, 2)
        self.packed = full.view(outputs // _LANES, _LANES, self._width // 2, 2).permute(0, 2, 1, 3).contiguous()

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[1] != self.in_features:
            raise ValueError(f"bfloat16 dot product: expected rows of {self.in_features}, got {tuple(rows.shape)}")
        count = rows.shape[0]
        if self._width == self.in_features:
            low = rows.to(torch.bfloat16).contiguous()
        else:
            low = rows.new_zeros(count, self._width, dtype=torch.bfloat16)
            low[:, :self.in_features] = rows
        out = rows.new_empty(count, self.out_features, dtype=torch.float32)
        if count:
            self._function(low.data_ptr(), self.packed.data_ptr(), out.data_ptr(), count, self.out_features,
                           self._width, torch.get_num_threads())
        return out
