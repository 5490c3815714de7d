"""Float32 products read from a GGUF file's weight groups, de-quantised inside the product.

Why: a single-token decode step reads every weight once, so its time is the bytes of the weights over the
memory bandwidth. A float32 checkpoint converted from a GGUF file is its quantised groups expanded: 32 bits
a weight holding what 4.5 to 8.5 bits hold. Multiplying float32 rows by the groups themselves, each weight
rebuilt as its float32 value inside the kernel, computes the same products from 3.5-6.4x fewer bytes. The
types read: Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K and Q6_K, packed into records of 5 to 9 bits a weight
(:mod:`~speculum.models.hf.kernels.gguf_records` has each kind's layout, cost and why its decode is exact).
The only difference from a float32 matrix kernel on the expanded weights is the order of the summation.

How: ``gguf_groups.c`` (AVX2 with FMA, or AVX-512) is compiled with the machine's C compiler on first use, for
this CPU, and cached (:mod:`~speculum.models.hf.kernels.build`); it runs on PyTorch's OpenMP threads. Each output
element is summed in one fixed order whatever the number of rows (ROW-CANONICAL), which the product probe of
:mod:`~speculum.models.hf.kernels.products` checks as for every kernel. Where there is no compiler or no AVX2, the
products stay on oneDNN with the expanded weights (:func:`kernel_unavailable` says why), as they do with
``SPECULUM_KERNELS=off``.

:func:`read_groups` packs the groups of a Llama, Gemma 3, Qwen2 or Qwen3 GGUF file (the embedded model caches
them beside its converted checkpoint); :func:`attach_groups` checks that each layer's groups expand to the
float32 weight the module holds, bit for bit, and attaches them to that layer; the fused forward (of Llama
models; the others keep transformers' forward, which does not read them) then multiplies by them.
Guarantee: EXACT weights; the products are float32 sums of exact products in a fixed order.

Example:
    >>> attach_groups(module, read_groups("SmolLM2-135M-Instruct.Q4_1.gguf"))   # doctest: +SKIP
    211
"""
from __future__ import annotations

import ctypes
import logging
import os
import time
from dataclasses import replace
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .build import KernelLibrary
from .call_list import PRODUCT, KernelCall, KernelCalls, side_by_side
from .gguf_records import GGUF_KINDS, GROUP, LANES, RECORD_BYTES, GroupedWeight, check_binding, checked_rows, pack

__all__ = ["forget", "kernel_source", "GroupedProduct", "GroupedProducts", "GroupedWeight", "attach_groups",
           "grouped_run", "kernel_unavailable", "load_groups", "multiply_by_groups", "pack", "read_groups",
           "save_groups", "tiled_products", "use_tiled_products", "GROUPS"]

GROUPS = "speculum_groups"        # the attribute of an ``nn.Linear`` holding its GroupedWeight
_SOURCE = Path(__file__).with_name("gguf_groups.c")
_log = logging.getLogger("speculum")


class GroupedProduct:
    """``rows (m, in_features) float32 -> (m, out_features)``: one kernel call over ``records`` (the
    concatenated records of one kind)."""

    __slots__ = ("kind", "records", "in_features", "out_features", "_function")

    def __init__(self, function: Callable, kind: str, records: torch.Tensor, in_features: int,
                 out_features: int) -> None:
        self._function, self.kind, self.records = function, kind, records
        self.in_features, self.out_features = in_features, out_features

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        rows = checked_rows("grouped product", rows, self.in_features)
        out = rows.new_empty(rows.shape[0], self.out_features)
        if rows.shape[0]:
            self._function(rows.data_ptr(), rows.shape[0], self.in_features, self.records.data_ptr(),
                           self.out_features, out.data_ptr(), torch.get_num_threads())
        return out

    def bind(self, rows: torch.Tensor, out: torch.Tensor) -> KernelCall:
        """This product from ``rows (m, in_features)`` into ``out (m, out_features)``, both contiguous float32,
        checked once: the returned call (of the thread count) multiplies whatever ``rows`` holds then, as
        :meth:`__call__` would."""
        check_binding("grouped product", rows, out, self.in_features, self.out_features)
        return KernelCall(self._function, (rows.data_ptr(), rows.shape[0], self.in_features, self.records.data_ptr(),
                                           self.out_features, out.data_ptr()), kind=PRODUCT)

    def first_outputs(self, count: int) -> "GroupedProduct":
        """The product of the first ``count`` outputs (a multiple of 16) alone, on the same kernel: a lane
        block's outputs are summed in the same order whatever the others, so its rows behave as the whole
        product's (what the row probe needs, at a fraction of a vocabulary head's cost)."""
        if count >= self.out_features:
            return self
        return GroupedProduct(self._function, self.kind, self.records[:count // LANES], self.in_features, count)


class GroupedProducts:
    """``rows (m, in_features) float32 -> (m, out_features)``: several :class:`GroupedProduct` (one per run of
    layers of one kind) side by side, for a fused product whose layers' records differ in kind (a Q4_K_M
    file's query and key are Q4_K, its value Q6_K). Each part is row-canonical, so their concatenation is."""

    __slots__ = ("parts", "kind", "in_features", "out_features")

    def __init__(self, parts: list[GroupedProduct]) -> None:
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

    def first_outputs(self, count: int) -> "GroupedProducts":
        """Each part's first ``count`` outputs (see :meth:`GroupedProduct.first_outputs`)."""
        return GroupedProducts([part.first_outputs(count) for part in self.parts])


def grouped_run(weights: list[GroupedWeight]) -> GroupedProduct | GroupedProducts | None:
    """The product computing the concatenated outputs of ``weights`` (one input width): one kernel call
    where they are of one kind, else one call per run of consecutive weights of one kind. None where the
    widths differ or the kernel is unavailable."""
    library = _LIBRARY.library()
    if library is None or not weights or len({w.in_features for w in weights}) != 1:
        return None
    runs: list[list[GroupedWeight]] = []
    for weight in weights:
        if runs and runs[-1][0].kind == weight.kind:
            runs[-1].append(weight)
        else:
            runs.append([weight])
    parts = [_one_call(library, run) for run in runs]
    return parts[0] if len(parts) == 1 else GroupedProducts(parts)


def _one_call(library: ctypes.CDLL, weights: list[GroupedWeight]) -> GroupedProduct:
    # Lane blocks are independent: concatenated records are the concatenated outputs' records.
    records = weights[0].records if len(weights) == 1 else torch.cat([w.records for w in weights])
    kind = weights[0].kind
    return GroupedProduct(getattr(library, f"{kind}_product"), kind, records.contiguous(), weights[0].in_features,
                          sum(w.out_features for w in weights))


def multiply_by_groups(layers: list) -> GroupedProduct | GroupedProducts | None:
    """:func:`grouped_run` of the groups attached to float32 ``layers`` (None unless every layer has
    groups). Each layer's groups then become a view of its kernel call's records: one copy of the bytes in
    memory."""
    # A copy cast to another dtype carries the float32 weights' groups, and must not use them.
    groups = [getattr(layer, GROUPS, None) if layer.weight.dtype == torch.float32 else None for layer in layers]
    run = grouped_run(groups) if all(g is not None for g in groups) else None
    if run is not None:
        pending = iter(zip(layers, groups))
        for part in run.parts if isinstance(run, GroupedProducts) else [run]:
            offset = 0
            while offset < part.records.shape[0]:
                layer, weight = next(pending)
                count = weight.records.shape[0]
                setattr(layer, GROUPS, replace(weight, records=part.records[offset:offset + count]))
                offset += count
    return run


# ------------------------------------------------------------------------------------------ the kernel


def kernel_source() -> Path:
    """The kernel's C source (what its release is the hash of)."""
    return _SOURCE


def kernel_unavailable() -> str | None:
    """None when the grouped kernel is built and loaded on this machine, else why not (one line);
    ``SPECULUM_KERNELS=off`` is read at each call."""
    return _LIBRARY.unavailable()


def forget() -> None:
    """Drop what this process remembers about the grouped kernel (loaded, or why not): the next use looks
    for it and builds it again, in the cache ``SPECULUM_CACHE`` names then. Products built before keep
    their kernel."""
    _LIBRARY.forget()


def _configure(library: ctypes.CDLL) -> None:
    for kind in RECORD_BYTES:
        function = getattr(library, f"{kind}_product")
        function.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                             ctypes.c_void_p, ctypes.c_int]
        function.restype = None
    library.grouped_tiled_from.argtypes = [ctypes.c_int64]
    library.grouped_tiled_from.restype = None
    library.grouped_rows_a_pass.restype = ctypes.c_int64
    global _TILED
    _TILED = _faster_tiled(library)
    _take_path(library, _TILED)


_NEVER = 2**62
_TILED: bool | None = None


def _faster_tiled(library: ctypes.CDLL, rows: int = 32, out_features: int = 1536, in_features: int = 576) -> bool:
    """Whether products of many rows run faster with each group's weights decoded once into a tile than
    decoded again inside every pass of rows, timed once a process on a product of ``rows`` rows (a few ms;
    zero weights, whose products take the time of any others). The two give the same bits, so the choice
    moves nothing but time."""
    records = torch.zeros(out_features // LANES, in_features // GROUP, RECORD_BYTES["q4_1"], dtype=torch.uint8)
    x, out = torch.zeros(rows, in_features), torch.empty(rows, out_features)
    function, threads = library.q4_1_product, torch.get_num_threads()
    best: dict[bool, float] = {}
    for _ in range(3):
        for tiled in (True, False):
            _take_path(library, tiled)
            started = time.perf_counter()
            for _ in range(3):
                function(x.data_ptr(), rows, in_features, records.data_ptr(), out_features, out.data_ptr(), threads)
            seconds = time.perf_counter() - started
            best[tiled] = min(best.get(tiled, seconds), seconds)
    return best[True] < best[False]


def tiled_products() -> bool | None:
    """Whether this process's grouped products of many rows (more than a pass: 8 rows with AVX-512, 4 with
    AVX2) decode each group's weights once into a tile (True) or inside every pass of rows (False), as timed
    when the kernel was loaded; None where the kernel is unavailable. Either gives the same bits."""
    return None if _LIBRARY.library() is None else _TILED


def use_tiled_products(tiled: bool | None) -> None:
    """Make this process's grouped products of many rows take the tiled path (True) or the direct one (False),
    or the one timed at load (None): for comparing the two, which give the same bits. Nothing where the kernel
    is unavailable."""
    library = _LIBRARY.library()
    if library is not None:
        _take_path(library, _TILED if tiled is None else tiled)


def _take_path(library: ctypes.CDLL, tiled: bool) -> None:
    """Products of more rows than a pass take the tiled path (True) or the direct one (False)."""
    library.grouped_tiled_from(library.grouped_rows_a_pass() + 1 if tiled else _NEVER)


_LIBRARY = KernelLibrary("grouped", _SOURCE, "grouped float32 products (oneDNN multiplies the expanded weights)",
                         configure=_configure)


# ------------------------------------------------------------------------------------------ GGUF groups
_MODEL_TYPES = ("llama", "gemma3", "gemma3_text", "qwen2", "qwen3")     # the same GGUF tensor names
_LLAMA_NAMES = {"q_proj": "attn_q", "k_proj": "attn_k", "v_proj": "attn_v", "o_proj": "attn_output",
                "gate_proj": "ffn_gate", "up_proj": "ffn_up", "down_proj": "ffn_down"}
_FILE = "groups.safetensors"
_MARKER = "speculum"      # the metadata entry every groups file carries (not a tensor)


def read_groups(gguf_path: str | os.PathLike) -> dict[str, GroupedWeight]:
    """The matrices of a GGUF file whose type has a record kind (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K,
    Q6_K) as records, by tensor name, each with its rows in transformers' order. In a Llama file
    (``general.architecture`` "llama") the query and key rows are stored permuted for the file's rotary
    layout, and are put back as transformers' GGUF loader puts them; it permutes no other architecture's
    rows (~2 s for SmolLM2, most of it reading the metadata)."""
    import gguf  # the [llm] extra, with torch

    reader = gguf.GGUFReader(str(gguf_path))

    def field(name: str) -> int | str | None:
        value = reader.fields.get(name)
        if value is None:
            return None
        part = value.parts[value.data[0]]
        return bytes(part).decode() if value.types and value.types[0] == gguf.GGUFValueType.STRING else int(part[0])

    architecture = field("general.architecture")
    heads = kv_heads = None
    if architecture == "llama":       # transformers' LlamaTensorProcessor, the only one that permutes these rows
        heads = field("llama.attention.head_count")
        kv_heads = field("llama.attention.head_count_kv") or heads
    groups = {}
    for tensor in reader.tensors:
        gguf_type = tensor.tensor_type.name.lower()
        if gguf_type not in GGUF_KINDS or len(tensor.data.shape) != 2:
            continue
        blocks = np.asarray(tensor.data)
        permuted = heads if ".attn_q." in tensor.name else kv_heads if ".attn_k." in tensor.name else None
        if permuted:
            blocks = blocks[_transformers_rows(blocks.shape[0], permuted)]
        try:
            groups[tensor.name] = pack(gguf_type, blocks)
        except ValueError:      # rows not a multiple of 16: that matrix stays on oneDNN
            continue
    return groups


def save_groups(groups: dict[str, GroupedWeight], folder: Path) -> None:
    """Write ``groups`` into ``folder`` (one safetensors file) for :func:`load_groups`."""
    from safetensors.torch import save_file  # with transformers, the [llm] extra

    # A marker entry: safetensors cannot read back a file with no tensors and no metadata (a model without
    # groups of a kind the kernel multiplies).
    save_file({name: weight.records for name, weight in groups.items()}, str(Path(folder) / _FILE),
              metadata={_MARKER: "gguf weight groups",
                        **{name: f"{w.kind},{w.out_features},{w.in_features}" for name, w in groups.items()}})


def load_groups(folder: Path) -> dict[str, GroupedWeight]:
    """The groups :func:`save_groups` wrote into ``folder``. Raises ValueError (one line, naming the tensor)
    for a record the kernel could misread: an unknown kind, widths that do not fill records (outputs a
    multiple of 16, inputs of 32), records not uint8 or not of the size the widths give."""
    from safetensors import safe_open  # with transformers, the [llm] extra

    groups = {}
    with safe_open(str(Path(folder) / _FILE), framework="pt") as handle:
        for name, shape in (handle.metadata() or {}).items():
            if name != _MARKER:
                groups[name] = _checked_groups(name, shape, handle.get_tensor(name))
    return groups


def _checked_groups(name: str, shape: str, records: torch.Tensor) -> GroupedWeight:
    """``records`` as a GroupedWeight of ``shape`` (``kind,out_features,in_features``), checked (see
    :func:`load_groups`)."""
    parts = shape.split(",")
    if len(parts) != 3 or not parts[1].isdigit() or not parts[2].isdigit():
        raise ValueError(f"{name}: its description {shape!r} is not kind,out,in")
    kind, out_features, in_features = parts[0], int(parts[1]), int(parts[2])
    if kind not in RECORD_BYTES:
        raise ValueError(f"{name}: unknown kind {kind!r} (known: {', '.join(RECORD_BYTES)})")
    if out_features <= 0 or out_features % LANES or in_features <= 0 or in_features % GROUP:
        raise ValueError(f"{name}: {out_features} x {in_features} is not a multiple of 16 outputs by a multiple "
                         f"of 32 inputs")
    if records.dtype != torch.uint8:
        raise ValueError(f"{name}: records of {records.dtype}, not uint8")
    expected = (out_features // LANES, in_features // GROUP, RECORD_BYTES[kind])
    if tuple(records.shape) != expected:
        raise ValueError(f"{name}: records of shape {tuple(records.shape)} ({records.numel()} bytes) do not "
                         f"fit {kind} {out_features} x {in_features} ({expected}: "
                         f"{expected[0] * expected[1] * expected[2]} bytes)")
    return GroupedWeight(kind, records, out_features, in_features)


def attach_groups(module: torch.nn.Module, groups: dict[str, GroupedWeight]) -> int:
    """Attach to each float32 Linear of a Llama, Gemma 3, Qwen2 or Qwen3 ``module`` its weight's groups (by
    GGUF tensor name, the same in the four: from :func:`read_groups` of the file the module was converted
    from); returns how many layers got them (0 where the kernel is unavailable). A layer gets its groups
    only where their first and last 16 rows expand bit for bit to the weight the layer holds (a file of
    another model, or rows in another order, is left out). The module's own forward is unchanged; the
    fused forward built afterwards (Llama) multiplies by the groups. A head without ``output.weight`` (tied,
    as Gemma 3's) is matched to ``token_embd``."""
    if not groups or kernel_unavailable() is not None or \
            getattr(getattr(module, "config", None), "model_type", None) not in _MODEL_TYPES:
        return 0
    targets: list[tuple[torch.nn.Module, str]] = []
    for index, block in enumerate(module.get_decoder().layers):
        for owner in (block.self_attn, block.mlp):
            targets += [(getattr(owner, name), f"blk.{index}.{gguf_name}.weight")
                        for name, gguf_name in _LLAMA_NAMES.items() if hasattr(owner, name)]
    head = "output.weight" if "output.weight" in groups else "token_embd.weight"
    targets.append((module.get_output_embeddings(), head))
    attached = 0
    for layer, name in targets:
        grouped = groups.get(name)
        if grouped is None or type(layer) is not torch.nn.Linear or layer.weight.dtype != torch.float32 or \
                tuple(layer.weight.shape) != (grouped.out_features, grouped.in_features):
            continue
        if all(torch.equal(_expanded_lanes(grouped, block), layer.weight.detach()[block * LANES:(block + 1) * LANES])
               for block in (0, grouped.out_features // LANES - 1)):
            setattr(layer, GROUPS, grouped)
            attached += 1
    return attached


def _expanded_lanes(weight: GroupedWeight, block: int) -> torch.Tensor:
    """The float32 rows ``16 * block ... 16 * block + 15`` of ``weight``."""
    one = GroupedWeight(weight.kind, weight.records[block:block + 1], LANES, weight.in_features)
    return one.expanded()


def _transformers_rows(rows: int, heads: int) -> np.ndarray:
    """For each row of transformers' query / key weight, its row in the GGUF file (the inverse of the
    converter's rotary permutation, as transformers' GGUF loader applies it)."""
    half = rows // heads // 2
    return np.arange(rows).reshape(heads, half, 2).swapaxes(1, 2).reshape(rows)
