"""Row-wise float32 operations between a decoder block's matrix products, one C call each: RMSNorm, the
residual add with the next norm, the query/key bias, head norms and rotary rotation, the MLP's gate; and
after the head, each row's float64 log-sum-exp with its log-probabilities (:meth:`RowOps.log_mass`, what
:mod:`~speculum.models.hf.logprobs` uses: one pass over a vocabulary-wide row, rows shared among threads).

Why: on a small model a decode step runs one row through each block, and the glue between the products
(RMSNorm, rotary embedding, residual adds, SiLU or GELU times up) is about twenty tiny PyTorch calls a
block, each costing microseconds of dispatch for nanoseconds of arithmetic. Here each piece of glue is
one ctypes call into ``row_ops.c``.

How: the kernel is compiled for this machine on first use and cached (:mod:`~speculum.models.hf.kernels.build`).
The C code uses GCC's generic vectors of the CPU's own width (16 floats with AVX-512, else 8), a sum's
16 lanes held in one or two of them; exp is its own range-reduced polynomial (within 2 ulp of expf), so
the SiLU and GELU gates are vectorised without fast-math. Rows are spread over OpenMP threads only when a call holds more
than 32768 elements; below that one thread is quicker than waking others.

Guarantee: ROW-CANONICAL by construction: each output row is a function of its own input row alone,
computed in one fixed order (sums of squares in 16 lanes, then a fixed tree over them), so a row comes
out bitwise the same alone or among any other rows, at any thread count, and at any vector width. The
results agree with PyTorch's (``F.rms_norm``, ``q * cos + rotate_half(q) * sin``, ``F.silu``,
``F.gelu(approximate="tanh")``) to a few float32 ulps of the outputs' size: the same formulas, with sums
in another order and another exp.

Where there is no C compiler or ``SPECULUM_KERNELS=off``, :func:`row_ops_unavailable` says why and the
caller keeps PyTorch's operations.

Example:
    >>> ops = RowOps()                                                      # doctest: +SKIP
    >>> x = torch.randn(3, 576); out = torch.empty_like(x)                  # doctest: +SKIP
    >>> ops.norm(x, torch.ones(576), 1e-5, out) is out                      # doctest: +SKIP
    True
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any, Callable

import torch

from .build import KernelLibrary
from .call_list import KernelCall

__all__ = ["RowOps", "bind", "forget", "row_ops_unavailable", "row_ops_source"]

_SOURCE = Path(__file__).with_name("row_ops.c")
_PARALLEL_ELEMENTS = 32768      # as row_ops.c: smaller calls run on one thread
_ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1}
_F32 = torch.float32
_POINTER, _INT64, _FLOAT, _INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_SIGNATURES = {
    "rowops_norm": [_POINTER, _POINTER, _FLOAT, _POINTER, _INT64, _INT64, _INT],
    "rowops_residual_norm": [_POINTER, _POINTER, _POINTER, _FLOAT, _POINTER, _POINTER, _FLOAT, _INT64, _INT64,
                             _INT],
    "rowops_rotate": [_POINTER, _INT64, _INT64, _INT64, _INT64, _POINTER, _INT64, _POINTER, _INT64, _POINTER,
                      _POINTER, _FLOAT, _INT],
    "rowops_gated": [_POINTER, _POINTER, _INT64, _INT64, _INT, _INT],
    "rowops_exp": [_POINTER, _POINTER, _INT64],
    "rowops_log_mass": [_POINTER, _INT64, _INT64, _POINTER, _POINTER, _INT],
}


def row_ops_source() -> Path:
    """The kernel's C source (what its release is the hash of)."""
    return _SOURCE


def row_ops_unavailable() -> str | None:
    """None when the row kernel is built and runs here, else why not (one line); ``SPECULUM_KERNELS=off`` is
    read at each call."""
    return _LIBRARY.unavailable()


def forget() -> None:
    """Drop what this process remembers about the row kernel (loaded, or why not): the next use looks for
    it and builds it again, in the cache ``SPECULUM_CACHE`` names then. Bound :class:`RowOps` keep theirs."""
    _LIBRARY.forget()


def bind(library: ctypes.CDLL) -> ctypes.CDLL:
    """``library`` (a build of ``row_ops.c``: this process's, or one for another target being compared) with
    its functions' argument types set; returns it."""
    for name, argtypes in _SIGNATURES.items():
        function = getattr(library, name)
        function.argtypes, function.restype = argtypes, None
    return library


def _configure(library: ctypes.CDLL) -> None:
    bind(library)


_LIBRARY = KernelLibrary("rowops", _SOURCE, "row operations (PyTorch's element-wise operations instead)",
                         configure=_configure)


class RowOps:
    """The row kernel's operations on float32 CPU tensors, each one C call (see the module). Bound once;
    raises RuntimeError with the reason where the kernel is unavailable.

    The methods check only what is cheap (shapes, contiguity, float32 of the rows; weights are taken to be
    float32) and raise ValueError otherwise. ``rows`` may be any number, 0 included. Guarantee: ROW-CANONICAL."""

    __slots__ = ("_norm", "_residual_norm", "_rotate", "_gated", "_exp", "_log_mass")

    def __init__(self, library: ctypes.CDLL | None = None) -> None:
        """``library``: a build bound by :func:`bind` (default: this process's, when available)."""
        if library is None:
            library = _LIBRARY.require("row operations")
        self._norm, self._residual_norm = library.rowops_norm, library.rowops_residual_norm
        self._rotate, self._gated, self._exp = library.rowops_rotate, library.rowops_gated, library.rowops_exp
        self._log_mass = library.rowops_log_mass

    def log_mass(self, logits: torch.Tensor, mass: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """``mass (rows,)`` float64: each row's log-sum-exp of ``logits (rows, vocab)`` float32 (its exponentials
        by the kernel's float64 exp, within a few ulp, summed in one fixed order); with ``out (rows, vocab)``
        float64 also the rows' log-probabilities ``logits - mass``. A row holding NaN or +inf gets NaN, a row
        of -inf gets -inf. Returns ``mass``. Example:

            >>> RowOps().log_mass(torch.zeros(1, 4), torch.empty(1, dtype=torch.float64)).tolist()  # doctest: +SKIP
            [1.3862943611198906]
        """
        rows, vocab = logits.shape
        if (logits.dtype is not _F32 or mass.dtype is not torch.float64 or mass.shape != (rows,)
                or not (logits.is_contiguous() and mass.is_contiguous())
                or (out is not None and (out.dtype is not torch.float64 or out.shape != logits.shape
                                         or not out.is_contiguous()))):
            raise ValueError(_wrong("log_mass", logits, mass, out))
        elements = rows * vocab
        self._log_mass(logits.data_ptr(), rows, vocab, mass.data_ptr(), None if out is None else out.data_ptr(),
                       torch.get_num_threads() if elements > _PARALLEL_ELEMENTS else 1)
        return mass

    def exp(self, x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """``out = exp(x)`` element-wise by the kernel's polynomial (what its gates use), for contiguous float32
        tensors of one size. Returns ``out``."""
        if (x.numel() != out.numel() or x.dtype is not _F32 or out.dtype is not _F32
                or not (x.is_contiguous() and out.is_contiguous())):
            raise ValueError(_wrong("exp", x, out))
        self._exp(x.data_ptr(), out.data_ptr(), x.numel())
        return out

    def norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor, bind: bool = False) -> Any:
        """``out = (x * r) * weight``, ``r = 1 / sqrt(mean(x²) + eps)`` per row of ``x (rows, f)``;
        ``weight (f,)``, ``out (rows, f)``. Returns ``out`` (``bind``: a :class:`KernelCall` instead)."""
        shape = x.shape
        rows, features = shape
        if (out.shape != shape or weight.numel() != features or x.dtype is not _F32 or out.dtype is not _F32
                or not (x.is_contiguous() and out.is_contiguous() and weight.is_contiguous())):
            raise ValueError(_wrong("norm", x, weight, out))
        return self._call(bind, self._norm, (x.data_ptr(), weight.data_ptr(), eps, out.data_ptr(), rows, features),
                          rows * features, out)

    def residual_norm(self, x: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float,
                      out: torch.Tensor, post_weight: torch.Tensor | None = None, post_eps: float = 0.0,
                      bind: bool = False) -> Any:
        """In place ``x += delta`` (``x += norm(delta, post_weight, post_eps)`` where ``post_weight`` is given:
        Gemma 3's norms after attention and after the MLP), then ``out = norm(x, weight, eps)``. ``x``,
        ``delta``, ``out`` ``(rows, f)``; ``weight`` and ``post_weight`` ``(f,)``. Returns ``out`` (``bind``: a
        :class:`KernelCall` instead)."""
        shape = x.shape
        rows, features = shape
        if (delta.shape != shape or out.shape != shape or weight.numel() != features or x.dtype is not _F32
                or delta.dtype is not _F32 or out.dtype is not _F32
                or not (x.is_contiguous() and delta.is_contiguous() and out.is_contiguous() and weight.is_contiguous())
                or (post_weight is not None and (post_weight.numel() != features or not post_weight.is_contiguous()))):
            raise ValueError(_wrong("residual_norm", x, delta, weight, out, post_weight))
        return self._call(bind, self._residual_norm,
                          (x.data_ptr(), delta.data_ptr(), weight.data_ptr(), eps, out.data_ptr(),
                           None if post_weight is None else post_weight.data_ptr(), post_eps, rows, features),
                          rows * features, out)

    def rotate(self, qkv: torch.Tensor, heads: int, kv_heads: int, head_dim: int, cos: torch.Tensor,
               sin: torch.Tensor, bias: torch.Tensor | None = None, head_weight: torch.Tensor | None = None,
               head_eps: float = 0.0, bind: bool = False) -> Any:
        """In place on ``qkv (rows, features)``: ``bias (features,)`` added to every feature where given;
        then each query and key head (the first ``heads + kv_heads`` heads of ``head_dim``) normalised by
        its row of ``head_weight (heads + kv_heads, head_dim)`` where given, and rotated: ``h * cos[r] +
        rotate_half(h) * sin[r]``. ``cos`` and ``sin`` are ``(rows, head_dim)`` of any row stride (0
        broadcasts one row), each row contiguous; value heads keep their values (bias aside). Returns None
        (``bind``: a :class:`KernelCall`)."""
        rows, features = qkv.shape
        rotated = heads + kv_heads
        (cos_row, cos_step), (sin_row, sin_step) = cos.stride(), sin.stride()     # one call each: stride(i) costs more
        if (features < (rotated + kv_heads) * head_dim or head_dim % 2 or qkv.dtype is not _F32
                or not qkv.is_contiguous() or cos.shape != (rows, head_dim) or sin.shape != (rows, head_dim)
                or cos_step != 1 or sin_step != 1 or cos.dtype is not _F32 or sin.dtype is not _F32
                or (bias is not None and (bias.numel() != features or not bias.is_contiguous()))
                or (head_weight is not None and (head_weight.numel() != rotated * head_dim
                                                 or not head_weight.is_contiguous()))):
            raise ValueError(_wrong(f"rotate ({heads} + {kv_heads} heads of {head_dim})", qkv, cos, sin, bias,
                                    head_weight))
        return self._call(bind, self._rotate,
                          (qkv.data_ptr(), rows, features, rotated, head_dim, cos.data_ptr(), cos_row, sin.data_ptr(),
                           sin_row, None if bias is None else bias.data_ptr(),
                           None if head_weight is None else head_weight.data_ptr(), head_eps), rows * features, None)

    def gated(self, gate_up: torch.Tensor, activation: str, out: torch.Tensor, bind: bool = False) -> Any:
        """``out (rows, I) = act(gate) * up`` of ``gate_up (rows, 2 I)``: gate its first ``I`` columns, up its
        last; ``activation`` ``"silu"`` or ``"gelu_pytorch_tanh"``. Returns ``out`` (``bind``: a :class:`KernelCall`
        instead)."""
        rows, width = gate_up.shape
        inner = width >> 1
        code = _ACTIVATIONS.get(activation)
        if (code is None or width & 1 or out.shape != (rows, inner) or out.dtype is not _F32
                or gate_up.dtype is not _F32 or not (gate_up.is_contiguous() and out.is_contiguous())):
            raise ValueError(_wrong(f"gated ({activation!r})", gate_up, out))
        return self._call(bind, self._gated, (gate_up.data_ptr(), out.data_ptr(), rows, inner, code), rows * width, out)

    @staticmethod
    def _call(bind: bool, function: Callable, arguments: tuple, elements: int, result: Any) -> Any:
        """``function(*arguments, threads)`` now, returning ``result``; or, with ``bind``, that call as a
        :class:`KernelCall` (the tensors must then stay alive and in place while it is called)."""
        threaded = elements > _PARALLEL_ELEMENTS
        if bind:
            return KernelCall(function, arguments, threaded)
        function(*arguments, torch.get_num_threads() if threaded else 1)
        return result


def _wrong(operation: str, *tensors: torch.Tensor | None) -> str:
    """What a call was given, for the error of one it cannot take."""
    given = ", ".join("None" if t is None else f"{tuple(t.shape)} {t.dtype} stride {t.stride()}" for t in tensors)
    return f"row operations: {operation} takes contiguous float32 rows of matching sizes (given {given})"
