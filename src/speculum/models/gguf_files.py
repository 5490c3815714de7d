"""A GGUF file checked before anything is converted: what it holds, and whether the PyTorch backend can read it.

Why: a GGUF file given to the PyTorch backend is converted once into a cached checkpoint (transformers
de-quantises it, tens of seconds for a small model, minutes for a large one). A path that is not GGUF, a
file cut short by an interrupted download, an architecture transformers' GGUF reader does not know or a
quant type it cannot de-quantise must each be refused at once, in one line that says which, and not after
a conversion has started (or with a stack trace from inside it). The header and tensor table are read
without touching the weights.

Exactness: nothing here changes a weight; it decides only whether a file is read.

Example:
    >>> info = inspect_gguf(Path("gemma-3-270m-q4_k_m.gguf"))          # doctest: +SKIP
    >>> info.architecture, sorted(info.tensor_types)                    # doctest: +SKIP
    ('gemma3', ['F32', 'Q4_K', 'Q5_0', 'Q6_K', 'Q8_0'])
    >>> unreadable_reason(info) is None                                  # doctest: +SKIP
    True
"""
from __future__ import annotations

import functools
import hashlib
import mmap
import os
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..validation import InputError
from .checkpoints import source_identity

__all__ = ["GGUF_MAGIC", "GGUFInfo", "is_gguf_file", "inspect_gguf", "unreadable_reason", "cache_key"]

GGUF_MAGIC = b"GGUF"
# The types transformers' reader takes as they are (no de-quantisation).
_PLAIN_TYPES = {"F32", "F16", "BF16"}


@dataclass(frozen=True)
class GGUFInfo:
    """What a GGUF file's header says: its ``architecture`` (``general.architecture``), ``name``
    (``general.name``, or the file's stem), and the storage type of each tensor (``tensor_types``: type name
    -> tensor count)."""

    path: Path
    architecture: str
    name: str
    tensor_types: dict[str, int]
    tensors: int


def is_gguf_file(path: Path) -> bool:
    """True when ``path`` is a file starting with the GGUF magic bytes."""
    try:
        with open(path, "rb") as handle:
            return handle.read(4) == GGUF_MAGIC
    except OSError:
        return False


def inspect_gguf(path: Path) -> GGUFInfo:
    """The header of the GGUF file at ``path``, checked: raises :class:`InputError` (one line) when the file
    does not start with the GGUF magic, when its header or tensor table does not parse, or when its tensors
    reach past its end (a truncated download)."""
    if not is_gguf_file(path):
        raise InputError(f"{path} is not a GGUF file (it does not start with the GGUF magic bytes)")
    size = os.path.getsize(path)
    try:
        header = _read_header(path)
    except Exception as exc:  # noqa: BLE001  (a damaged file fails the parse in many ways)
        raise InputError(f"{path} is not a complete GGUF file (truncated or damaged: "
                         f"{' '.join(str(exc).split()) or type(exc).__name__})") from None
    architecture = header.texts.get("general.architecture", "")
    if not architecture:
        raise InputError(f"{path} has no general.architecture: it does not say what model it holds")
    if header.end > size:
        raise InputError(f"{path} is truncated: its tensors need {header.end:,} bytes, the file has {size:,}")
    return GGUFInfo(path, architecture, header.texts.get("general.name") or path.stem, header.tensor_types,
                    header.tensors)


@dataclass(frozen=True)
class _Header:
    texts: dict[str, str]            # the string-valued metadata
    tensor_types: dict[str, int]     # storage type name -> tensor count
    tensors: int
    end: int                         # the byte just past the last tensor's data


# GGUF metadata value types (the format's spec): fixed sizes, and the two variable-length kinds.
_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9


def _read_header(path: Path) -> _Header:
    """The metadata's strings and the tensor table of a GGUF (version 2 or 3) file, read by walking its
    header: gguf-py's reader builds an object for every entry of every array (a 262k-token vocabulary
    takes seconds), while only the strings and the tensor table are needed here."""
    import gguf  # the [llm] extra: llama.cpp's own table of the storage types' block sizes

    with open(path, "rb") as handle, mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
        position = 4

        def number(width: int) -> int:
            nonlocal position
            if position + width > len(data):
                raise ValueError(f"the header ends at byte {len(data):,}, inside a field")
            value = int.from_bytes(data[position:position + width], "little")
            position += width
            return value

        def text() -> str:
            nonlocal position
            length = number(8)
            if position + length > len(data):
                raise ValueError(f"a string of {length:,} bytes runs past the end of the file")
            value = data[position:position + length].decode("utf-8", errors="replace")
            position += length
            return value

        def skip(kind: int) -> None:
            nonlocal position
            if kind == _STRING:
                length = number(8)           # read first: ``position += number(8)`` would lose the 8
                position += length
            elif kind == _ARRAY:
                item, count = number(4), number(8)
                if item in _SIZES:
                    position += _SIZES[item] * count
                else:
                    for _ in range(count):
                        skip(item)
            elif kind in _SIZES:
                position += _SIZES[kind]
            else:
                raise ValueError(f"unknown metadata value type {kind}")

        version = number(4)
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (versions 2 and 3 are read)")
        tensor_count, field_count = number(8), number(8)
        texts: dict[str, str] = {}
        alignment = 32
        for _ in range(field_count):
            key, kind = text(), number(4)
            if kind == _STRING:
                texts[key] = text()
            elif key == "general.alignment" and kind in _SIZES:
                alignment = number(_SIZES[kind])
            else:
                skip(kind)
        types: dict[str, int] = {}
        end = 0
        for _ in range(tensor_count):
            text()
            dims = [number(8) for _ in range(number(4))]
            kind = gguf.GGMLQuantizationType(number(4))
            offset = number(8)
            block, block_bytes = gguf.GGML_QUANT_SIZES[kind]
            elements = int(np.prod(dims, dtype=np.int64))
            end = max(end, offset + elements // block * block_bytes)
            types[kind.name] = types.get(kind.name, 0) + 1
        start = -(-position // alignment) * alignment           # tensor data follows the table, aligned
        return _Header(texts, types, tensor_count, start + end if tensor_count else position)


def unreadable_reason(info: GGUFInfo) -> str | None:
    """Why transformers' GGUF reader cannot convert ``info``'s file (its architecture or a quant type it
    cannot de-quantise), with the way out; None when it can."""
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES  # the [llm] extra

    known = {_reader_name(a) for a in GGUF_SUPPORTED_ARCHITECTURES} - {"general", "tokenizer"}
    if _reader_name(info.architecture) not in known:
        return (f"{info.path.name}: transformers cannot read GGUF architecture {info.architecture!r} (it reads "
                f"{', '.join(sorted(known))}); run it with --backend llamacpp")
    unknown = sorted(name for name in info.tensor_types if not _dequantisable(name))
    if unknown:
        return (f"{info.path.name}: transformers cannot de-quantise the GGUF quant type{'s' if len(unknown) > 1 else ''} "
                f"{', '.join(unknown)}; run it with --backend llamacpp")
    return None


@functools.lru_cache(maxsize=None)
def _dequantisable(type_name: str) -> bool:
    """True when gguf-py (which transformers' reader calls) de-quantises the GGUF storage type ``type_name``:
    tried on one zero block."""
    import gguf  # the [llm] extra

    if type_name in _PLAIN_TYPES:
        return True
    try:
        qtype = gguf.GGMLQuantizationType[type_name]
        gguf.quants.dequantize(np.zeros((1, gguf.GGML_QUANT_SIZES[qtype][1]), dtype=np.uint8), qtype)
    except (KeyError, NotImplementedError, ValueError):
        return False
    return True


def _reader_name(architecture: str) -> str:
    # llama.cpp spells some families otherwise than transformers' table (qwen2moe, gpt-oss).
    spelled = {"qwen2moe": "qwen2_moe", "qwen3moe": "qwen3_moe", "gpt-oss": "gpt_oss", "minimax-m2": "minimax_m2"}
    return spelled.get(architecture, architecture)


def cache_key(path: Path) -> str:
    """The name of ``path``'s converted checkpoint in the cache: its stem and a digest of its identity (size
    and the sha256 of its first and last MiB), so that a moved file finds its conversion and another
    version of the file gets one of its own."""
    identity = source_identity(path)
    digest = hashlib.sha256(f"{identity['size']}:{identity['edge_sha256']}".encode()).hexdigest()[:12]
    stem = re.sub(r"[^A-Za-z0-9._-]+", "-", path.stem)[:48] or "model"
    return f"gguf-{stem}-{digest}"
