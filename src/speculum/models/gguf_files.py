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
    import gguf  # the [llm] extra: llama.cpp's own reader of the format

    size = os.path.getsize(path)
    try:
        reader = gguf.GGUFReader(path)
        architecture = _text_field(reader, "general.architecture")
        name = _text_field(reader, "general.name") or path.stem
        end = max((t.data_offset + int(t.n_bytes) for t in reader.tensors), default=0)
        types: dict[str, int] = {}
        for tensor in reader.tensors:
            types[tensor.tensor_type.name] = types.get(tensor.tensor_type.name, 0) + 1
    except Exception as exc:  # noqa: BLE001  (the reader fails in many ways on a damaged file)
        raise InputError(f"{path} is not a complete GGUF file (truncated or damaged: "
                         f"{' '.join(str(exc).split()) or type(exc).__name__})") from None
    if not architecture:
        raise InputError(f"{path} has no general.architecture: it does not say what model it holds")
    if end > size:
        raise InputError(f"{path} is truncated: its tensors need {end:,} bytes, the file has {size:,}")
    return GGUFInfo(path, architecture, name, types, len(reader.tensors))


def _text_field(reader, key: str) -> str:
    field = reader.fields.get(key)
    if field is None or not field.parts:
        return ""
    return bytes(field.parts[-1]).decode("utf-8", errors="replace")


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
