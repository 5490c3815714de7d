"""Products of rows quantised to 8 bits with a GGUF file's weight groups, by integer dot products: the
``q8`` target.

Why: the float32 grouped products (:mod:`~speculum.models.hf.kernels.gguf_groups`) rebuild every weight as
float32 and multiply in float32: exact, but bound by the floating-point units (~20 G weights/s a core).
llama.cpp instead quantises the activations to 8 bits in blocks of 32 (its Q8_0 / Q8_1 blocks) and sums
integer products (AVX-512 VNNI ``vpdpbusd``, or AVX2 ``maddubs``): several times the products a cycle. This
module does the same, as a target of its own.

How: ``q8_groups.c`` (AVX-512 VNNI, else AVX2) is compiled on first use for this CPU and cached
(:mod:`~speculum.models.hf.kernels.build`). :class:`Q8Product` makes one C call, which quantises each row
by itself (per block of 32 inputs ``d = amax / 127``, ``q = roundf(x / d)``, the sums of the ``q``) and
multiplies it by the weight records, repacked once (:func:`repack`) so that the 4 weights one 32-bit lane
of ``vpdpbusd`` multiplies are adjacent. The C source states each output's float formula and its order.
The repacked records are a second copy of the groups beside the ones attached to the layers (which
:func:`~speculum.models.hf.precision.q8_refusal` reads when a draft shares the blocks). Q4_K, Q5_K and
Q6_K weights keep their floats factored per super-block (:func:`factored`): 4.75, 5.75 and 6.6 bits a
weight instead of 6, 7 and 8, the same outputs.

Guarantee: EXACT for itself and ROW-CANONICAL (a row's quants depend on that row alone, the integer sums
are exact, and the per-group float terms are added in one fixed order, whatever the rows beside it and
the thread count); APPROXIMATE relative to float32 (the activations carry 8 bits a block: a relative error
of about 1e-2 of an output's scale). Record kinds: all of :mod:`~speculum.models.hf.kernels.gguf_records`'s
(GGUF Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K).

Example:
    >>> product = q8_run([grouped_weight])                 # doctest: +SKIP
    >>> product(torch.randn(3, grouped_weight.in_features)).shape          # doctest: +SKIP
    torch.Size([3, 576])
"""
from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .build import KernelLibrary
from .call_list import PRODUCT_STATUS, KernelCall, KernelCalls, side_by_side
from .gguf_records import GROUP, LANES, RECORD_BYTES, GroupedWeight, check_binding, checked_rows

__all__ = ["factored", "forget", "Q8_KINDS", "Q8Product", "Q8Products", "q8_run", "q8_unavailable", "quantised_rows",
           "repack", "q8_source", "vector_bits"]

Q8_KINDS = ("q4_0", "q4_1", "q5_0", "q5_1", "q6_k", "q8_0")     # record kinds the integer kernel multiplies
_FACTORED = {"q4_1": "q4_1f", "q5_1": "q5_1f", "q6_k": "q6_kf"}   # kinds whose floats may factor (factored)
_SUPER = 8                                        # groups a super-block (256 inputs, as the K-quants)
_SOURCE = Path(__file__).with_name("q8_groups.c")
_SCALES = LANES * 4
_OFFSET = {"q4_0": 8, "q5_0": 16, "q6_k": 32}     # the float32 records hold q XOR offset (gguf_records.py)
_log = logging.getLogger("speculum")


def repack(weight: GroupedWeight) -> torch.Tensor:
    """The records of ``weight`` (:mod:`~speculum.models.hf.kernels.gguf_records`) with their quants reordered
    for the integer kernel, scales and minimums kept: ``(lane blocks, groups, record bytes)`` uint8, as many
    bytes as the float32 kernel's records.

    The 32 x 16 quants of a record become 8 quads (inputs ``4k .. 4k + 3``) of ``[lane][4]`` bytes, what one
    ``vpdpbusd`` multiplies: q8_0 as 8 quads of int8; the others as their raw quants (0 .. 2^bits - 1), in 4
    chunks of 64 bytes whose low nibbles hold quad ``v`` and high nibbles quad ``4 + v``, then for 5 and 6 bits
    one plane of 64 bytes per high bit, bit ``k`` of byte ``p`` that bit of quad ``k`` (``q8_groups.c``)."""
    if weight.kind not in Q8_KINDS:
        raise ValueError(f"8-bit products multiply {', '.join(Q8_KINDS)} records, not {weight.kind}")
    records = weight.records.numpy().reshape(*weight.records.shape[:2], RECORD_BYTES[weight.kind])
    start = (2 if weight.kind in ("q4_1", "q5_1", "q6_k") else 1) * _SCALES
    blocks, groups = records.shape[:2]
    raw = _raw_quants(weight.kind, records[..., start:])                          # (blocks, groups, 32, 16)
    quads = raw.reshape(blocks, groups, 8, 4, LANES).transpose(0, 1, 2, 4, 3).reshape(blocks, groups, 8, 64)
    if weight.kind == "q8_0":
        parts = [quads.reshape(blocks, groups, 512)]
    else:
        parts = [((quads[:, :, :4] & 15) | ((quads[:, :, 4:] & 15) << 4)).reshape(blocks, groups, 256)]
        weights = np.arange(8, dtype=np.uint16).reshape(1, 1, 8, 1)
        for bit in (4, 5)[:{"q5_0": 1, "q5_1": 1, "q6_k": 2}.get(weight.kind, 0)]:
            parts.append((((quads.astype(np.uint16) >> bit) & 1) << weights).sum(axis=2).astype(np.uint8))
    packed = np.concatenate([records[..., :start], *[part.astype(np.uint8) for part in parts]], axis=-1)
    assert packed.shape[-1] == RECORD_BYTES[weight.kind]
    return torch.from_numpy(np.ascontiguousarray(packed))


def factored(kind: str, packed: torch.Tensor) -> torch.Tensor | None:
    """Repacked records of ``kind`` (q4_1, q5_1 or q6_k; :func:`repack`) as the kernel's factored kinds, where
    every super-block of 8 groups factors each lane's floats exactly into one float32 times an int8 a group,
    as the K-quants build them (Q4_K, Q5_K: a float16 times a 6-bit integer, for the scales and for the
    minimums; Q6_K: a float16 times an int8, one per 16 inputs). Returns ``(lane blocks, groups / 8, factors +
    8 x (32 + quant bytes))`` uint8: per super-block the 16 lanes' float32 factors (of the scales, then of the
    minimums; q6_k: one set), then per group the lanes' two int8 factors and its quants; None where the
    groups are not whole super-blocks, the kind has no factored form, or a float does not factor (independent
    float16 scales, as Q4_1's).

    Why: 4.75 bits a weight instead of 6 (Q6_K: 6.6 instead of 8), so a decode step, bound by reading the
    records, reads a fifth less; the kernel multiplies the factors back into the very float32 values the
    records held (their product is exact), so the outputs are the same bits."""
    blocks, groups, size = packed.shape
    if kind not in _FACTORED or groups % _SUPER:
        return None
    supers = groups // _SUPER
    records = packed.numpy().reshape(blocks, supers, _SUPER, size)
    floats = np.ascontiguousarray(records[..., :2 * _SCALES]).view(np.float32).reshape(blocks, supers, _SUPER, 2,
                                                                                          LANES)
    if kind == "q6_k":      # one factor a lane for both halves' scales
        values = floats.transpose(0, 1, 4, 2, 3).reshape(blocks, supers, 1, LANES, 2 * _SUPER)
    else:                   # one for the scales, one for the minimums
        values = floats.transpose(0, 1, 3, 4, 2)                                          # (b, s, 2, 16, 8)
    split = _factor(values)
    if split is None:
        return None
    common, ints = split
    ints = ints.reshape(blocks, supers, -1, LANES, _SUPER, 2 if kind == "q6_k" else 1)
    per_group = ints.transpose(0, 1, 4, 2, 5, 3).reshape(blocks, supers, _SUPER, 2 * LANES)   # [first 16, second 16]
    group_records = np.concatenate([per_group.view(np.uint8), records[..., 2 * _SCALES:]], axis=-1)
    head = np.ascontiguousarray(common).view(np.uint8).reshape(blocks, supers, -1)
    out = np.concatenate([head, group_records.reshape(blocks, supers, -1)], axis=-1)
    return torch.from_numpy(np.ascontiguousarray(out))


def _factor(values: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """float32 ``values (..., k)`` -> ``(common (...) float32, ints (..., k) int8)`` with ``common * ints ==
    values`` exactly for every entry, or None. The common factor is the gcd of the values' odd integer
    mantissas at the lowest of their exponents: any exact factorisation with small integers has one of this
    form, and its integers are the smallest."""
    mantissa, exponent = np.frexp(values)                    # values = mantissa * 2^exponent, |mantissa| in [0.5, 1)
    whole = np.abs(mantissa.astype(np.float64) * 2.0 ** 24).astype(np.int64)          # exact: 24 bits
    nonzero = whole != 0
    trailing = np.where(nonzero, np.log2(np.where(nonzero, whole & -whole, 1)).astype(np.int64), 0)
    odd = whole >> trailing
    power = exponent.astype(np.int64) - 24 + trailing
    common = np.gcd.reduce(np.where(nonzero, odd, 0), axis=-1)                         # 0 where all are zero
    low = np.where(nonzero, power, np.iinfo(np.int64).max).min(axis=-1)
    low = np.where(common > 0, low, 0)
    shift = np.where(nonzero, power - low[..., None], 0)
    if (shift > 7).any():
        return None
    ints = np.where(nonzero, (odd // np.maximum(common, 1)[..., None]) << shift, 0)
    ints = np.where(values < 0, -ints, ints)
    # int8 holds -128 but not 128: a factor whose integers reach +128 (Q6_K's scale -128 times a negative d)
    # is negated.
    flip = (ints == 128).any(axis=-1)
    ints = np.where(flip[..., None], -ints, ints)
    if (ints > 127).any() or (ints < -128).any():
        return None
    ints = ints.astype(np.int8)
    factor = np.where(flip, -1.0, 1.0) * np.ldexp(common.astype(np.float64), low)
    factor = factor.astype(np.float32)
    if not np.array_equal(factor[..., None] * ints.astype(np.float32), values):      # exact, or not at all
        return None
    return factor, ints


def _raw_quants(kind: str, quants: np.ndarray) -> np.ndarray:
    """A record's quant bytes (after its scales) -> its quants ``(blocks, groups, 32 inputs, 16 lanes)``: int8
    for q8_0, else uint8 0 .. 2^bits - 1 (what GGUF stores, before any offset)."""
    blocks, groups = quants.shape[:2]
    if kind == "q8_0":
        return quants.reshape(blocks, groups, 32, LANES).view(np.int8)
    pairs = quants[..., :256].reshape(blocks, groups, 16, LANES)
    raw = np.concatenate([pairs & 15, pairs >> 4], axis=2).astype(np.uint32)       # input kk, then kk + 16
    lane = np.arange(LANES, dtype=np.uint32)
    if kind in ("q5_0", "q5_1"):
        plane = np.ascontiguousarray(quants[..., 256:]).view(np.uint16).astype(np.uint32)[..., None]
        raw |= ((plane >> lane) & 1) << 4
    elif kind == "q6_k":
        plane = np.ascontiguousarray(quants[..., 256:]).view(np.uint32)[..., None]
        raw |= ((plane >> (2 * lane)) & 3) << 4
    return (raw ^ _OFFSET.get(kind, 0)).astype(np.uint8)


def quantised_rows(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``rows (m, in)`` float32 as the kernel multiplies them: quants ``(m, in)`` int8, scales ``(m, in / 32)``
    float32 and the sums of each block's quants over its inputs 0..15 and 16..31 ``(m, in / 32, 2)`` int32,
    each block of 32 inputs of each row by itself (see the C source). Raises RuntimeError where the kernel is
    unavailable."""
    library = _LIBRARY.library()
    if library is None:
        raise RuntimeError(f"8-bit products unavailable: {q8_unavailable()}")
    rows = rows.contiguous()
    m, width = rows.shape
    q = torch.empty(m, width, dtype=torch.int8)
    d = torch.empty(m, width // GROUP, dtype=torch.float32)
    sums = torch.empty(m, width // GROUP, 2, dtype=torch.int32)
    if m:
        library.quantise_rows(rows.data_ptr(), m, width, q.data_ptr(), d.data_ptr(), sums.data_ptr(),
                              torch.get_num_threads())
    return q, d, sums


class Q8Product:
    """``rows (m, in_features) float32 -> (m, out_features)``: one kernel call, which quantises the rows and
    multiplies them by ``records`` (repacked records of one kind, concatenated)."""

    __slots__ = ("kind", "records", "in_features", "out_features", "_function")

    def __init__(self, library: ctypes.CDLL, kind: str, records: torch.Tensor, in_features: int,
                 out_features: int) -> None:
        self._function = getattr(library, f"{kind}_rows")
        self.kind, self.records = kind, records
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = checked_rows("8-bit product", rows, self.in_features)
        out = rows.new_empty(rows.shape[0], self.out_features)
        if rows.shape[0] and self._function(rows.data_ptr(), rows.shape[0], self.in_features, self.records.data_ptr(),
                                            self.out_features, out.data_ptr(), torch.get_num_threads()):
            raise MemoryError(f"8-bit product: no memory for {rows.shape[0]} quantised rows")
        return out

    def bind(self, rows: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """This product from ``rows (m, in_features)`` into ``out (m, out_features)``, both contiguous float32,
        checked once: the returned call (of the thread count) multiplies whatever ``rows`` holds then, as
        :meth:`__call__` would."""
        check_binding("8-bit product", rows, out, self.in_features, self.out_features)
        return KernelCall(self._function, (rows.data_ptr(), rows.shape[0], self.in_features, self.records.data_ptr(),
                                           self.out_features, out.data_ptr()),
                          failure=f"8-bit product: no memory for {rows.shape[0]} quantised rows",
                          kind=PRODUCT_STATUS)


class Q8Products:
    """Several :class:`Q8Product` side by side (layers of several record kinds in one fused product); each
    part is row-canonical, so their concatenation is."""

    __slots__ = ("parts", "kind", "in_features", "out_features")

    def __init__(self, parts: list[Q8Product]) -> None:
        self.parts = parts
        self.kind = "+".join(part.kind for part in parts)
        self.in_features, self.out_features = parts[0].in_features, sum(part.out_features for part in parts)

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return torch.cat([part(rows) for part in self.parts], dim=1)

    def bind(self, rows: torch.Tensor, out: torch.Tensor) -> KernelCalls:
        """The parts bound side by side into ``out`` (:func:`~speculum.models.hf.kernels.call_list.side_by_side`):
        each part's product into a buffer of its own, then its columns of ``out``, as :meth:`__call__` computes
        them."""
        return side_by_side([(part.bind, part.out_features) for part in self.parts], rows, out)


def q8_run(weights: list[GroupedWeight]) -> Q8Product | Q8Products:
    """The 8-bit product computing the concatenated outputs of ``weights`` (one input width): one kernel call
    per run of consecutive weights of one kind. Raises ValueError (one line) for a kind the kernel does not
    multiply or widths that differ, RuntimeError where the kernel is unavailable."""
    library = _LIBRARY.library()
    if library is None:
        raise RuntimeError(f"8-bit products unavailable: {q8_unavailable()}")
    if not weights or len({w.in_features for w in weights}) != 1:
        raise ValueError("8-bit products: weights of one input width expected")
    runs: list[list[GroupedWeight]] = []
    for weight in weights:
        if weight.kind not in Q8_KINDS:
            raise ValueError(f"8-bit products multiply {', '.join(Q8_KINDS)} weight groups, not {weight.kind}")
        if runs and runs[-1][0].kind == weight.kind:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    # Lane blocks are independent: concatenated records are the concatenated outputs' records.
    parts = []
    for run in runs:
        kind, packed = run[0].kind, [repack(w) for w in run]
        if kind in _FACTORED:
            compact = [factored(kind, records) for records in packed]
            if all(records is not None for records in compact):
                kind, packed = _FACTORED[kind], compact
        parts.append(Q8Product(library, kind, torch.cat(packed).contiguous(), run[0].in_features,
                               sum(w.out_features for w in run)))
    return parts[0] if len(parts) == 1 else Q8Products(parts)


# ------------------------------------------------------------------------------------------ the kernel


def q8_source() -> Path:
    """The kernel's C source (what its release is the hash of)."""
    return _SOURCE


def q8_unavailable() -> str | None:
    """None when the 8-bit kernel is built and loaded on this machine, else why not (one line)."""
    return _LIBRARY.unavailable()


def vector_bits() -> int | None:
    """The kernel's vector path: 512 (AVX-512 VNNI) or 256 (AVX2); None where it is unavailable."""
    library = _LIBRARY.library()
    return None if library is None else int(library.q8_vector_bits())


def forget() -> None:
    """Drop what this process remembers about the 8-bit kernel (loaded, or why not): the next use looks for it
    and builds it again. Products built before keep their kernel."""
    _LIBRARY.forget()


def _configure(library: ctypes.CDLL) -> None:
    pointer, size = ctypes.c_void_p, ctypes.c_int64
    library.quantise_rows.argtypes = [pointer, size, size, pointer, pointer, pointer, ctypes.c_int]
    library.quantise_rows.restype = None
    for kind in (*Q8_KINDS, *_FACTORED.values()):
        function = getattr(library, f"{kind}_rows")
        function.argtypes = [pointer, size, size, pointer, size, pointer, ctypes.c_int]
        function.restype = ctypes.c_int
    library.q8_vector_bits.argtypes, library.q8_vector_bits.restype = [], ctypes.c_int


_LIBRARY = KernelLibrary("q8", _SOURCE, "8-bit products", configure=_configure)
