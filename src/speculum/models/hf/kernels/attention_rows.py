"""Causal attention of every query row of a forward in one C call a layer, each row alone.

Why: PyTorch's attention kernel rounds a row differently beside other rows or other (masked) keys, so
:mod:`~speculum.models.hf.forward.attention` gives each row a shape its position alone fixes and calls the
kernel once per such shape: one call per sequence and key block a layer, each ~35 us of PyTorch's per-call
cost on a 2-core CPU. A packed step of 8 sequences, or a round of 8 scored prompts, pays it 8 times a layer,
and a decode step pays it once a layer with little to compute. ``attention_rows.c`` computes every (row,
head) of a call by itself, in one fixed order of float32 adds and multiplies: reading only the row's own
keys (none masked), and the same numbers whatever else the call holds, the thread that runs it or the
vector width (see the C source for the formula and its order).

Guarantee: ROW-CANONICAL by construction (a row's output is a function of its query, keys and values
alone); relative to exact attention, float32 rounding (softmax by Cephes' exp polynomial, within 2 ulp).
Its rows differ from PyTorch's kernel's by float32 rounding: a model runs one or the other for its whole
life (:class:`~speculum.models.hf.forward.fused.FusedForward` chooses at build).

Where there is no C compiler, or ``SPECULUM_KERNELS=off``, attention stays on PyTorch's kernel
(:func:`attention_unavailable` says why).

Example:
    >>> plan = AttentionRows(positions=torch.tensor([4, 5]), slots=torch.tensor([0, 0]))      # doctest: +SKIP
    >>> out = plan(q, keys, values, scale=0.125)     # q (2, heads, d); keys, values (1, kv_heads, >= 6, d)  # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Sequence

import torch

from .build import KernelLibrary
from .call_list import KernelCall

__all__ = ["AttentionRows", "attention_call", "attention_unavailable", "attention_source", "forget"]

_SOURCE = Path(__file__).with_name("attention_rows.c")
_LANES = 16
FAILURE = "the attention kernel could not allocate its score buffers"


def attention_source() -> Path:
    """The kernel's C source (what its release is the hash of)."""
    return _SOURCE


def attention_unavailable() -> str | None:
    """None when the attention kernel is built and runs here, else why not (one line);
    ``SPECULUM_KERNELS=off`` is read at each call."""
    return _LIBRARY.unavailable()


def forget() -> None:
    """Drop what this process remembers about the kernel (loaded, or why not): the next use looks for it and
    builds it again. Plans made before keep their kernel."""
    _LIBRARY.forget()


def _configure(library: ctypes.CDLL) -> str | None:
    if library.attention_rows_lanes() != _LANES:
        return "the kernel's lane count differs from its wrapper's"
    pointer, count = ctypes.c_void_p, ctypes.c_int64
    library.attention_rows.argtypes = [count, count, count, count, pointer, count, pointer, pointer, count,
                                       pointer, pointer, pointer, ctypes.c_float, pointer, pointer, pointer, count,
                                       ctypes.c_int]
    library.attention_rows.restype = ctypes.c_int
    return None


_LIBRARY = KernelLibrary("attention", _SOURCE, "attention rows (PyTorch's kernel attends instead)",
                         configure=_configure)


def attention_call() -> KernelCall:
    """The attention kernel as a :class:`KernelCall` of no rows yet: a call list's record, whose arguments each
    forward sets (:meth:`AttentionRows.arguments`)."""
    library = _LIBRARY.require("attention rows", off_switch=False)
    return KernelCall(library.attention_rows, (0,) * (len(library.attention_rows.argtypes) - 1), failure=FAILURE)


class AttentionRows:
    """The attention of query rows at ``positions (rows,)``, row ``r`` reading the keys and values of index
    ``slots[r]`` along the store's first dimension (a slot of a KV store, or a sequence of a batch), keys
    ``0 .. positions[r]``, only the last ``window`` of them on a sliding-window layer (transformers' window:
    key > position - window). Built once per forward and window, called once per layer. ROW-CANONICAL
    (see the module); needs :func:`attention_unavailable` to be None."""

    __slots__ = ("rows", "slots", "first", "last", "_end", "_slot_end", "_offsets", "_function")

    def __init__(self, positions: torch.Tensor, slots: torch.Tensor, window: int | None = None) -> None:
        # SPECULUM_KERNELS is read where a model chooses its attention, once: a plan keeps to that choice.
        library = _LIBRARY.require("attention rows", off_switch=False)
        if positions.shape != slots.shape or positions.dim() != 1 or (window is not None and window < 1):
            raise ValueError(f"attention rows need positions and slots of one length and a window >= 1, not "
                             f"{tuple(positions.shape)}, {tuple(slots.shape)}, window={window}")
        self._function = library.attention_rows
        self.rows = len(positions)
        self.last = positions.to(torch.int64).contiguous()
        self.first = torch.zeros_like(self.last) if window is None else (self.last - window + 1).clamp_(min=0)
        self.slots = slots.to(torch.int64).contiguous()
        # Bounds the C code relies on, checked against each call's store by two integer comparisons.
        self._end = int(self.last.max()) + 1 if self.rows else 0
        self._slot_end = int(self.slots.max()) + 1 if self.rows else 0
        if self.rows and (int(self.last.min()) < 0 or int(self.slots.min()) < 0):
            raise ValueError("attention rows need positions and slots >= 0")
        # slots * the store's slot stride, by that stride: kept, as a call list holds their addresses
        self._offsets: dict[int, torch.Tensor] = {}

    def __call__(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                 out: torch.Tensor | None = None, new_keys: torch.Tensor | None = None,
                 new_values: torch.Tensor | None = None) -> torch.Tensor:
        """``q (rows, heads, d)`` (any row stride; heads and their features contiguous) attending ``keys`` /
        ``values (slots, kv_heads, >= every row's position + 1, d)`` float32 -> ``(rows, heads, d)``,
        row-major: into ``out`` where given (contiguous float32 of that shape). The rows' own keys and values
        are written already, or given as ``new_keys`` / ``new_values (rows, kv_heads, d)`` (one row stride,
        heads and features contiguous), which the call writes at each row's slot and position first."""
        if out is None:
            out = q.new_empty(q.shape)
        arguments = self.arguments(q, keys, values, scale, out, new_keys, new_values)
        if arguments is not None and self._function(*arguments, torch.get_num_threads()):
            raise MemoryError(FAILURE)
        return out

    def arguments(self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float,
                  out: torch.Tensor, new_keys: torch.Tensor | None = None,
                  new_values: torch.Tensor | None = None) -> tuple | None:
        """The kernel's arguments (the thread count excluded) for the call :meth:`__call__` makes, checked
        as it checks them (ValueError); None where there are no rows (nothing to call)."""
        rows, heads, dim = q.shape
        _, kv_heads, length, _ = keys.shape
        strides = keys.stride()
        if (rows != self.rows or heads % kv_heads or keys.dtype != torch.float32 or q.dtype != torch.float32
                or values.dtype != torch.float32 or values.shape != keys.shape or values.stride() != strides
                or strides[2:] != (dim, 1) or q.stride()[1:] != (dim, 1) or keys.shape[3] != dim
                or length < self._end or keys.shape[0] < self._slot_end):
            raise ValueError(f"attention of rows {tuple(q.shape)} on keys {tuple(keys.shape)} (strides {strides}) "
                             f"does not fit {self.rows} rows at positions below {self._end} in slots below "
                             f"{self._slot_end}, float32, heads and features contiguous")
        new_stride = 0
        if new_keys is not None:
            if (new_values is None or new_keys.shape != (rows, kv_heads, dim) or new_values.shape != new_keys.shape
                    or new_keys.stride() != new_values.stride() or new_keys.stride()[1:] != (dim, 1)
                    or new_keys.dtype != torch.float32 or new_values.dtype != torch.float32):
                raise ValueError(f"new keys {tuple(new_keys.shape)} and values do not fit {rows} rows of "
                                 f"{kv_heads} key heads of {dim}, float32, heads and features contiguous")
            new_stride = new_keys.stride(0)
        if out.shape != q.shape or out.dtype != torch.float32 or not out.is_contiguous():
            raise ValueError(f"attention rows into {tuple(out.shape)} {out.dtype}: expected contiguous float32 "
                             f"{tuple(q.shape)}")
        if not rows:
            return None
        offsets = self._offsets.get(strides[0])
        if offsets is None:
            offsets = self._offsets[strides[0]] = self.slots * strides[0]
        return (rows, heads, kv_heads, dim, q.data_ptr(), q.stride(0), keys.data_ptr(), values.data_ptr(),
                strides[1], offsets.data_ptr(), self.first.data_ptr(), self.last.data_ptr(), scale,
                out.data_ptr(), None if new_keys is None else new_keys.data_ptr(),
                None if new_values is None else new_values.data_ptr(), new_stride)

    def layer_arguments(self, q: torch.Tensor, keys: Sequence[torch.Tensor], values: Sequence[torch.Tensor],
                        scale: float, out: torch.Tensor, new_keys: torch.Tensor | None = None,
                        new_values: torch.Tensor | None = None) -> list[tuple] | None:
        """:meth:`arguments` for the same rows on each layer's ``keys[i]`` / ``values[i]``: the first layer's
        checked in full, each other's by its shapes and strides being the first's (what every check reads);
        None where there are no rows."""
        first = self.arguments(q, keys[0], values[0], scale, out, new_keys, new_values)
        if first is None:
            return None
        shape, strides = keys[0].shape, keys[0].stride()
        head, tail = first[:6], first[8:]
        calls = [first]
        for layer_keys, layer_values in zip(keys[1:], values[1:]):
            if (layer_keys.shape != shape or layer_values.shape != shape or layer_keys.stride() != strides
                    or layer_values.stride() != strides or layer_keys.dtype != torch.float32
                    or layer_values.dtype != torch.float32):
                return [self.arguments(q, k, v, scale, out, new_keys, new_values) for k, v in zip(keys, values)]
            calls.append(head + (layer_keys.data_ptr(), layer_values.data_ptr()) + tail)
        return calls
