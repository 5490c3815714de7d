"""A forward's kernel calls as records on fixed arguments, run in order by one C call (``call_list.c``).

Why: a decode step of a small model makes about ten kernel calls a block (the products, the row
operations between them, attention), each from Python: a few microseconds of interpreter and ctypes
argument conversion a call, more than the arithmetic of a row operation, and a large share of a one-row
step. A :class:`KernelCall` is one such call with its arguments fixed once (bound buffers); a
:class:`CallList` holds a forward's calls as C records and runs them all in one ctypes call.

Exactness: each function is called with exactly the arguments, in the order, a :class:`KernelCall` passes
from Python: the same bits (tested).

Example:
    >>> calls = CallList([bound_norm, bound_product])                  # doctest: +SKIP
    >>> calls(threads=2)                                               # doctest: +SKIP
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable, Sequence

import torch

from .build import KernelLibrary

__all__ = ["KernelCall", "KernelCalls", "CallList", "call_kind", "call_list_unavailable", "call_list_source",
           "side_by_side", "INTEGERS", "PRODUCT", "PRODUCT_STATUS"]

_SOURCE = Path(__file__).with_name("call_list.c")
INTEGERS = 18                   # pointer and integer arguments a record holds, as call_list.c
_FLOATS = 2
# The kinds of call_list.c: the row operations and attention by their functions' names; the products' kinds
# are given by the products that make their calls (one signature for every record kind of each kernel).
_KINDS = {"rowops_norm": 2, "rowops_residual_norm": 3, "rowops_rotate": 4, "rowops_gated": 5,
          "attention_rows": 6}
PRODUCT_STATUS, PRODUCT = 0, 1      # int f(...) returning a status (8-bit products); void f(...) (float32)
_COPY = 7


def call_kind(function: Callable) -> int | None:
    """The record kind of a row operation or the attention kernel (a ctypes function of this package's
    kernels), or None where ``call_list.c`` has no record for it by name."""
    return _KINDS.get(getattr(function, "__name__", ""))


class KernelCall:
    """One call of a compiled kernel on fixed arguments, checked once: ``call(threads)`` runs it again on
    whatever its tensors hold (the thread count appended, or 1 where the work is too small to share).
    ``failure``: the MemoryError's message where the kernel returns a status other than 0 (None: the
    function returns nothing). ``kind``: its ``call_list.c`` record kind (:data:`PRODUCT_STATUS`,
    :data:`PRODUCT`), else found by :func:`call_kind`."""

    __slots__ = ("function", "arguments", "threaded", "failure", "kind")

    def __init__(self, function: Callable, arguments: tuple, threaded: bool = True,
                 failure: str | None = None, kind: int | None = None) -> None:
        self.function, self.arguments, self.threaded, self.failure = function, arguments, threaded, failure
        self.kind = call_kind(function) if kind is None else kind

    def __call__(self, threads: int) -> None:
        status = self.function(*self.arguments, threads if self.threaded else 1)
        if self.failure is not None and status:
            raise MemoryError(self.failure)


class KernelCalls:
    """Several calls of the thread count made in order as one: ``calls(threads)``; a :class:`CallList` takes
    each where each is a :class:`KernelCall`.
    ``buffers``: tensors the calls write and read, kept alive with them."""

    __slots__ = ("calls", "buffers")

    def __init__(self, calls: Sequence[Callable[[int], None]], buffers: Sequence[torch.Tensor] = ()) -> None:
        self.calls, self.buffers = list(calls), list(buffers)

    def __call__(self, threads: int) -> None:
        for call in self.calls:
            call(threads)


def side_by_side(binds: Sequence[tuple[Callable, int]], rows: torch.Tensor, out: torch.Tensor) -> KernelCalls:
    """Products whose outputs sit side by side in ``out (m, total)``, each bound (``bind(rows, part_out)``)
    into a buffer of its own ``(m, its outputs)``, as calls: each product, then the copy of its outputs into
    its columns of ``out`` (the same numbers as the concatenation of their results). ``binds``: each part's
    ``(bind, its outputs)``. Where call lists are unavailable the copies are PyTorch's (then no
    :class:`CallList` takes them)."""
    library = _LIBRARY.library()
    calls: list = []
    parts, column = [], 0
    for bind, outputs in binds:
        part, columns = out.new_empty(out.shape[0], outputs), out[:, column:column + outputs]
        calls.append(bind(rows, part))
        if library is not None:
            calls.append(KernelCall(library.copy_columns, (part.data_ptr(), columns.data_ptr(), out.shape[0], outputs,
                                                           out.stride(0)), threaded=False, kind=_COPY))
        else:
            calls.append(lambda threads, part=part, columns=columns: columns.copy_(part))
        parts.append(part)
        column += outputs
    return KernelCalls(calls, parts)


def _configure(library: ctypes.CDLL) -> str | None:
    library.call_record_bytes.restype = library.call_record_integers.restype = ctypes.c_int64
    if library.call_record_integers() != INTEGERS or library.call_record_bytes() != ctypes.sizeof(_Record):
        return "the call records of the C source and of its wrapper differ"
    library.run_calls.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int]
    library.copy_columns.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64,
                                     ctypes.c_int]
    library.copy_columns.restype = None
    library.run_calls.restype = ctypes.c_int64
    return None


class _Record(ctypes.Structure):
    _fields_ = [("kind", ctypes.c_int64), ("threaded", ctypes.c_int64), ("function", ctypes.c_void_p),
                ("integers", ctypes.c_int64 * INTEGERS), ("floats", ctypes.c_float * _FLOATS)]


_LIBRARY = KernelLibrary("calls", _SOURCE, "kernel call lists (each call is made from Python instead)",
                         configure=_configure)


def call_list_source() -> Path:
    """The C source (what its release is the hash of)."""
    return _SOURCE


def call_list_unavailable() -> str | None:
    """None when call lists run here, else why not (one line); ``SPECULUM_KERNELS=off`` is read at each
    call."""
    return _LIBRARY.unavailable()


def _layout(call: KernelCall) -> tuple[list[int], list[int]]:
    """The positions of a call's integer (pointer, count) and float arguments among its arguments, threads
    excluded, by the function's argument types; ValueError where they do not fit a record."""
    kinds = call.function.argtypes[:-1]
    integers = [i for i, kind in enumerate(kinds) if kind is not ctypes.c_float]
    floats = [i for i, kind in enumerate(kinds) if kind is ctypes.c_float]
    if len(integers) > INTEGERS or len(floats) > _FLOATS or len(call.arguments) != len(kinds):
        raise ValueError(f"{call.function.__name__} does not fit a call record")
    return integers, floats


class CallList:
    """``calls`` (each a :class:`KernelCall` whose :func:`call_kind` is not None) as C records:
    ``call_list(threads)`` makes every call, in order, in one ctypes call, as calling each would
    (raising its MemoryError where one fails, after which none runs). :meth:`set_arguments` replaces a
    record's arguments (calls whose tensors change from forward to forward). Raises RuntimeError where
    call lists are unavailable (:func:`call_list_unavailable`), ValueError for a call without a record."""

    __slots__ = ("calls", "_records", "_layouts", "_run")

    def __init__(self, calls: Sequence[KernelCall]) -> None:
        library = _LIBRARY.require("kernel call lists")
        self.calls = list(calls)
        self._records = (_Record * len(self.calls))()
        self._layouts = []
        for index, call in enumerate(self.calls):
            if call.kind is None:
                raise ValueError(f"{getattr(call.function, '__name__', call.function)} has no call record")
            self._layouts.append(_layout(call))
            record = self._records[index]
            record.kind, record.threaded = call.kind, int(call.threaded)
            record.function = ctypes.cast(call.function, ctypes.c_void_p).value
            self.set_arguments(index, call.arguments)
        self._run = library.run_calls

    def set_arguments(self, index: int, arguments: tuple) -> None:
        """Record ``index`` from now on calls its function with ``arguments`` (threads excluded)."""
        integers, floats = self._layouts[index]
        if len(arguments) != len(integers) + len(floats):
            raise ValueError(f"{self.calls[index].function.__name__} takes {len(integers) + len(floats)} "
                             f"arguments before its thread count, not {len(arguments)}")
        record = self._records[index]
        record.integers[:len(integers)] = [arguments[i] or 0 for i in integers]     # a None pointer is 0
        if floats:
            record.floats[:len(floats)] = [arguments[i] for i in floats]

    def __call__(self, threads: int) -> None:
        status = self._run(self._records, len(self.calls), threads)
        if status:
            if status < 0:
                raise RuntimeError("a call list holds a record of an unknown kind")
            raise MemoryError(self.calls[status - 1].failure or "a kernel could not allocate its buffers")
