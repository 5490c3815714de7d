"""GGUF weight blocks packed as the grouped kernel's records, and the float32 weights those records hold.

A record holds one lane block (16 output features) by one group of 32 inputs: the 16 features' float32
scales (and minimums), then the quantised weights input-major (``gguf_groups.c`` reads it). Each GGUF type
is packed into the record kind whose decode rebuilds every weight as the float32 value gguf-py's
``dequantize`` gives (and so transformers' GGUF loader):

=========  =====================================  ==========================  ======================
record     decode (float32)                       holds GGUF                  bits a weight (record)
=========  =====================================  ==========================  ======================
``q4_0``   ``scale * (q - 8)``, q in 0..15        Q4_0                        5   (GGUF: 4.5)
``q4_1``   ``fma(scale, q, minimum)``, q 0..15    Q4_1, Q4_K                  6   (5, 4.5)
``q5_0``   ``scale * (q - 16)``, q in 0..31       Q5_0                        6   (5.5)
``q5_1``   ``fma(scale, q, minimum)``, q 0..31    Q5_1, Q5_K                  7   (6, 5.5)
``q6_k``   ``scale[half] * (q - 32)``, q 0..63    Q6_K                        8   (6.5625)
``q8_0``   ``scale * q``, q in -128..127          Q8_0                        9   (8.5)
=========  =====================================  ==========================  ======================

Why each is exact: the scale is a float16 (11 significant bits), or for the K types a float16 times a 6-bit
(Q4_K, Q5_K) or 8-bit (Q6_K) integer, exact in float32 either way. Times a quant of at most 8 bits the
product stays within float32's 24 bits: exact. So ``scale * q + minimum`` rounds once, as a fused
multiply-add does, and ``scale * (q - offset)`` rounds once (Q6_K) or not at all (Q4_0, Q5_0, Q8_0): the
same operations gguf-py performs in float32. Q4_K and Q5_K subtract ``dmin * m`` (exact); their record holds
its negation as the minimum (``a - b`` is ``a + (-b)`` in IEEE arithmetic, bit for bit).

The K types come in super-blocks of 256 inputs; their 32-input sub-blocks (Q4_K, Q5_K) are the kernel's
groups, and Q6_K's 16-input sub-blocks are the halves of a group, each with its own scale (two scales a
record). The quants of 5 and 6 bits are stored as the low nibble pairs of ``q4_*`` records plus a plane of
the high bits: for each input, one bit (``q5_*``, a uint16) or two bits (``q6_k``, a uint32) per lane, lane
``l`` at bit ``l`` or ``2 l``. The kinds decoded as ``scale * (q - offset)`` store ``q XOR offset``, the bits of
``q - offset`` in two's complement: the kernel sign-extends them, with no subtraction.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GroupedWeight", "pack", "record_kind", "checked_rows", "check_binding", "GGUF_KINDS", "LANES", "GROUP",
           "RECORD_BYTES"]

LANES = 16                        # output features sharing one record (gguf_groups.c)
GROUP = 32                        # inputs sharing one record
_SCALES = LANES * 4               # one float32 a lane
_NIBBLES = 16 * LANES             # 32 x 16 quants, two a byte
RECORD_BYTES = {"q4_0": _SCALES + _NIBBLES, "q4_1": 2 * _SCALES + _NIBBLES,
                "q5_0": _SCALES + _NIBBLES + 32 * 2, "q5_1": 2 * _SCALES + _NIBBLES + 32 * 2,
                "q6_k": 2 * _SCALES + _NIBBLES + 32 * 4, "q8_0": _SCALES + 32 * LANES}
GGUF_KINDS = {"q4_0": "q4_0", "q4_1": "q4_1", "q4_k": "q4_1", "q5_0": "q5_0", "q5_1": "q5_1", "q5_k": "q5_1",
              "q6_k": "q6_k", "q8_0": "q8_0"}          # GGUF type (lower case) -> its record kind
_GGUF_BLOCK = {"q4_0": (32, 18), "q4_1": (32, 20), "q5_0": (32, 22), "q5_1": (32, 24), "q8_0": (32, 34),
               "q4_k": (256, 144), "q5_k": (256, 176), "q6_k": (256, 210)}     # (weights, bytes) a GGUF block
_OFFSET = {"q4_0": 8, "q5_0": 16, "q6_k": 32, "q8_0": 0}    # kinds decoded as scale * (q - offset)


def record_kind(gguf_type: str) -> str:
    """The record kind holding GGUF blocks of ``gguf_type`` (lower case, ``"q4_k"``); ValueError if none."""
    if gguf_type not in GGUF_KINDS:
        raise ValueError(f"grouped products support {', '.join(GGUF_KINDS)}, not {gguf_type!r}")
    return GGUF_KINDS[gguf_type]


@dataclass(frozen=True)
class GroupedWeight:
    """A weight ``(out_features, in_features)`` as packed group records (see the module docstring)."""

    kind: str                  # a key of RECORD_BYTES
    records: torch.Tensor      # uint8 (out_features / 16, in_features / 32, RECORD_BYTES[kind])
    out_features: int
    in_features: int

    @property
    def nbytes(self) -> int:
        return self.records.numel()

    def expanded(self) -> torch.Tensor:
        """The float32 weight ``(out_features, in_features)`` the records hold, each value as the kernel's
        decode rebuilds it."""
        blocks, groups = self.records.shape[:2]
        records = self.records.reshape(blocks, groups, -1)

        def floats(start: int, count: int) -> torch.Tensor:     # (blocks, groups, count, 16) float32
            return records[..., start:start + count * _SCALES].contiguous().view(torch.float32).reshape(
                blocks, groups, count, LANES)

        if self.kind == "q8_0":
            quants = records[..., _SCALES:].contiguous().view(torch.int8).reshape(blocks, groups, 32, LANES)
            weights = quants.float() * floats(0, 1)
        else:
            two = self.kind in ("q4_1", "q5_1", "q6_k")       # minimums, or Q6_K's second scales
            start = (2 if two else 1) * _SCALES
            pairs = records[..., start:start + _NIBBLES].reshape(blocks, groups, 16, LANES).int()
            quants = torch.cat([pairs & 15, pairs >> 4], dim=2)                                # (b, g, 32, 16)
            plane = records[..., start + _NIBBLES:].contiguous()
            lane = torch.arange(LANES, dtype=torch.int64)
            if self.kind in ("q5_0", "q5_1"):
                bits = plane.view(torch.int16).long()[..., None] & 0xFFFF                       # (b, g, 32, 1)
                quants = quants | (((bits >> lane) & 1) << 4).int()
            elif self.kind == "q6_k":
                bits = plane.view(torch.int32).long()[..., None] & 0xFFFFFFFF
                quants = quants | (((bits >> (2 * lane)) & 3) << 4).int()
            if self.kind in ("q4_1", "q5_1"):
                weights = quants.float() * floats(0, 1) + floats(_SCALES, 1)
            else:       # stored as q XOR offset
                quants = quants ^ _OFFSET[self.kind]
                scales = floats(0, 2 if two else 1).repeat_interleave(16 if two else 32, dim=2)
                weights = (quants - _OFFSET[self.kind]).float() * scales
        return weights.permute(0, 3, 1, 2).reshape(self.out_features, self.in_features)


def pack(gguf_type: str, blocks: np.ndarray) -> GroupedWeight:
    """Records of GGUF blocks ``(out_features, in_features / block weights * block bytes)`` uint8 of
    ``gguf_type`` (lower case, ``"q4_k"``), of the kind :func:`record_kind` names. ValueError where the type
    has no record kind, or the rows do not fill records (a multiple of 16) or bytes whole blocks."""
    kind = record_kind(gguf_type)
    per_block, block_bytes = _GGUF_BLOCK[gguf_type]
    rows = blocks.shape[0]
    if rows % LANES or blocks.shape[1] % block_bytes:
        raise ValueError(f"a {gguf_type} weight of {rows} rows x {blocks.shape[1]} bytes does not fill records")
    blocks = np.ascontiguousarray(blocks, dtype=np.uint8).reshape(-1, block_bytes)
    quants, scales, minimums = _UNPACK[gguf_type](blocks)
    in_features = blocks.shape[0] // rows * per_block
    lanes, groups = rows // LANES, in_features // GROUP

    def lane_minor(values: np.ndarray) -> np.ndarray:     # (rows, groups * k) -> (lanes, groups, k * 16 float32)
        values = values.astype(np.float32).reshape(lanes, LANES, groups, -1).transpose(0, 2, 3, 1)
        return np.ascontiguousarray(values).view(np.uint8).reshape(lanes, groups, -1)

    # q XOR offset: the bits of q - offset in two's complement, which the kernel sign-extends.
    quants = quants.reshape(lanes, LANES, groups, GROUP)
    if kind in ("q4_0", "q5_0", "q6_k"):
        quants = quants ^ np.uint8(_OFFSET[kind])
    parts = [lane_minor(scales.reshape(rows, -1))]
    if minimums is not None:
        parts.append(lane_minor(minimums.reshape(rows, -1)))
    if kind == "q8_0":
        parts.append(quants.transpose(0, 2, 3, 1).reshape(lanes, groups, -1).view(np.uint8))
    else:
        pairs = (quants[..., :16] & 15) | ((quants[..., 16:] & 15) << 4)            # input kk and kk + 16
        parts.append(pairs.transpose(0, 2, 3, 1).reshape(lanes, groups, _NIBBLES))
        high = quants.astype(np.uint32) >> 4                                          # (lanes, 16, groups, 32)
        lane = np.arange(LANES, dtype=np.uint32)[None, :, None, None]
        if kind in ("q5_0", "q5_1"):
            plane = np.bitwise_or.reduce((high & 1) << lane, axis=1).astype(np.uint16)
            parts.append(np.ascontiguousarray(plane).view(np.uint8))
        elif kind == "q6_k":
            plane = np.bitwise_or.reduce((high & 3) << (2 * lane), axis=1).astype(np.uint32)
            parts.append(np.ascontiguousarray(plane).view(np.uint8))
    records = np.concatenate(parts, axis=-1)
    assert records.shape[-1] == RECORD_BYTES[kind]
    return GroupedWeight(kind, torch.from_numpy(np.ascontiguousarray(records)), rows, in_features)


# ---------------------------------------------------- each GGUF type's blocks -> (quants, scales, minimums)
# As gguf-py's dequantize reads them: quants (blocks, weights) uint8 (int8 for Q8_0), in input order;
# float32 scales and minimums per 32 weights (Q6_K: per 16); minimums None where the kind has none.

def _half(blocks: np.ndarray, start: int) -> np.ndarray:
    return np.ascontiguousarray(blocks[:, start:start + 2]).view(np.float16).astype(np.float32)  # (n, 1)


def _nibbles(bytes_: np.ndarray) -> np.ndarray:
    """Blocks of 16 bytes -> their 32 quants: low nibbles first, then high nibbles."""
    return np.concatenate([bytes_ & 15, bytes_ >> 4], axis=-1)


def _fifth_bits(qh: np.ndarray) -> np.ndarray:       # 4 bytes a block -> bit i of the uint32, for i < 32
    return np.unpackbits(qh, axis=-1, bitorder="little")


def _q4_0(b):
    return _nibbles(b[:, 2:18]), _half(b, 0), None


def _q4_1(b):
    return _nibbles(b[:, 4:20]), _half(b, 0), _half(b, 2)


def _q5_0(b):
    return _nibbles(b[:, 6:22]) | (_fifth_bits(b[:, 2:6]) << 4), _half(b, 0), None


def _q5_1(b):
    return _nibbles(b[:, 8:24]) | (_fifth_bits(b[:, 4:8]) << 4), _half(b, 0), _half(b, 2)


def _q8_0(b):
    return np.ascontiguousarray(b[:, 2:34]).view(np.int8), _half(b, 0), None


def _k_scales(b):
    """Q4_K / Q5_K: the 8 sub-blocks' scales ``d * sc`` and minimums ``-(dmin * m)`` (both exact)."""
    scales = b[:, 4:16].reshape(-1, 3, 4)
    d, m, m_d = scales[:, 0], scales[:, 1], scales[:, 2]
    sc = np.concatenate([d & 0x3F, (m_d & 0x0F) | ((d >> 2) & 0x30)], axis=-1).astype(np.float32)
    mins = np.concatenate([m & 0x3F, (m_d >> 4) | ((m >> 2) & 0x30)], axis=-1).astype(np.float32)
    return _half(b, 0) * sc, -(_half(b, 2) * mins)


def _q4_k(b):
    low = b[:, 16:144].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (low & 15).reshape(-1, 256), *_k_scales(b)


def _q5_k(b):
    low = b[:, 48:176].reshape(-1, 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = b[:, 16:48].reshape(-1, 1, 32) >> np.arange(8, dtype=np.uint8).reshape(1, 8, 1)
    return ((low & 15).reshape(-1, 8, 32) | ((high & 1) << 4)).reshape(-1, 256), *_k_scales(b)


def _q6_k(b):
    low = b[:, :128].reshape(-1, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    high = b[:, 128:192].reshape(-1, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    quants = (low & 15).reshape(-1, 8, 32) | ((high & 3).reshape(-1, 8, 32) << 4)
    scales = _half(b, 208) * np.ascontiguousarray(b[:, 192:208]).view(np.int8).astype(np.float32)   # (n, 16)
    return quants.reshape(-1, 256), scales, None


_UNPACK = {"q4_0": _q4_0, "q4_1": _q4_1, "q5_0": _q5_0, "q5_1": _q5_1, "q8_0": _q8_0, "q4_k": _q4_k,
           "q5_k": _q5_k, "q6_k": _q6_k}


def checked_rows(what: str, rows: torch.Tensor, in_features: int) -> torch.Tensor:
    """``rows`` as a product over weight groups multiplies them: contiguous float32 ``(m, in_features)``;
    ValueError naming the product (``what``) otherwise."""
    rows = rows.contiguous()
    if rows.dtype != torch.float32 or rows.dim() != 2 or rows.shape[1] != in_features:
        raise ValueError(f"{what}: expected float32 rows of {in_features}, got {rows.dtype} {tuple(rows.shape)}")
    return rows


def check_binding(what: str, rows: torch.Tensor, out: torch.Tensor, in_features: int, out_features: int) -> None:
    """ValueError naming the product (``what``) unless ``rows (m, in_features)`` and ``out (m, out_features)`` are
    contiguous float32: what a product bound to them reads and writes on every call."""
    if (rows.dtype != torch.float32 or out.dtype != torch.float32 or not rows.is_contiguous()
            or not out.is_contiguous() or rows.dim() != 2 or rows.shape[1] != in_features
            or tuple(out.shape) != (rows.shape[0], out_features)):
        raise ValueError(f"{what}: cannot bind rows {tuple(rows.shape)} and out {tuple(out.shape)} to "
                         f"{in_features} -> {out_features}")
