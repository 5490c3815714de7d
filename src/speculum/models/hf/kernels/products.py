"""The fused forward's matrix products, each checked once for rows that do not depend on their neighbours.

Why: a row of a product should be the same number whether it is multiplied alone (a decode step), among
eight (a speculative verification) or among hundreds (a prompt, a packed forward); then a sequence's
logits do not depend on how its tokens were fed, and greedy speculative output is plain greedy output
bit for bit. A matrix kernel does not promise that: it may take another path for one row (a
matrix-vector product), for few rows or for many. Each product here keeps its rows on one path where it
can, and :class:`RowProduct` records whether that holds on this machine's kernels
(:func:`~speculum.models.hf.kernels.probe.gives_rows_alone`, probed once per kind and shape).

Kinds:

* 8-bit activations by weight groups (:mod:`~speculum.models.hf.kernels.q8_groups`: the ``q8`` target): each
  row quantised by itself in blocks of 32, integer dot products, per-group float terms in one fixed order;
* float32 from weight groups (:mod:`~speculum.models.hf.kernels.gguf_groups`: layers whose GGUF
  groups are attached): the groups de-quantised inside the product, each output summed in one fixed
  order;
* float32: oneDNN on a weight packed once; more than :data:`~speculum.models.hf.kernels.probe.PROBE_ROWS`
  rows are split into calls of at most that many (the row counts the probe covers), and where a lone row
  takes another path than two it is multiplied beside a copy of itself;
* bfloat16 on AMX tiles (:mod:`~speculum.models.hf.kernels.amx_tiles`, where the CPU has AMX-BF16): the
  float32 rows rounded to bfloat16, each output summed in float32 in one fixed order, any number of rows a
  call;
* bfloat16 by AVX-512 BF16 dot products (:mod:`~speculum.models.hf.kernels.bf16_dot`, where the CPU has
  AVX-512 BF16 but no tiles): the float32 rows rounded to bfloat16, each output summed in float32 in one
  fixed order, any number of rows a call;
* bfloat16 elsewhere: the float32 rows rounded to bfloat16 and multiplied by oneDNN (AVX-512 BF16 or AMX,
  accumulating in float32, the outputs rounded to bfloat16) 2 to 32 rows a call, the one path that gives
  each row the same at any position and count; where this machine's kernel still does not, the product
  runs in float32 on the same weights, as it does where oneDNN has no bfloat16 kernel for this CPU (AVX2
  alone);
* int8 weight-only (:class:`~speculum.models.hf.kernels.int8_weights.Int8Linear`): ``_weight_int8pack_mm``,
  probed;
* int8 dynamically quantised (the int8 twin): the modules' own ops, whose activation scale is the whole
  batch's, so never row-alone.

Example:
    >>> product = build_product([torch.nn.Linear(8, 4, bias=False)])     # doctest: +SKIP
    >>> product(torch.randn(3, 8)).shape, product.rows_alone               # doctest: +SKIP
    (torch.Size([3, 4]), True)
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from ...cpu import KERNEL_FLAGS, cpu_flags
from .amx_tiles import TileProduct, tile_source, tiles_unavailable
from .attention_rows import attention_source, attention_unavailable
from .bf16_dot import DotProduct, dot_source, dot_unavailable
from .row_ops import row_ops_source, row_ops_unavailable
from .build import kernels_disabled, library_release
from .gguf_groups import GROUPS, kernel_source, kernel_unavailable, multiply_by_groups
from .int8_weights import Int8Linear
from .onednn import onednn_bf16_available, pack_weight, packed_linear
from .probe import PROBE_ROWS, probed_once
from .q8_groups import q8_run, q8_source, q8_unavailable

__all__ = ["RowProduct", "build_product", "is_float_linear", "is_int8_linear", "is_weight_int8", "product_paths"]

_BF16_ROWS_A_CALL = 32      # most rows a bfloat16 kernel call multiplies
_GROUPED_PROBE_OUTPUTS = 512  # outputs of a grouped product the row probe multiplies (32 lane blocks)


class RowProduct:
    """``rows (m, in) -> (m, out)`` float32; ``rows_alone``: each row bitwise the same whatever rows surround
    it, on this machine's kernels (see the module)."""

    __slots__ = ("run", "rows_alone")

    def __init__(self, run: Callable[[torch.Tensor], torch.Tensor], rows_alone: bool) -> None:
        self.run, self.rows_alone = run, rows_alone

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        return self.run(rows)

    def bind(self, rows: torch.Tensor, out: torch.Tensor) -> Callable[[int], None]:
        """This product from ``rows`` into ``out`` as a call of the thread count, checked once: the kernel's own
        bound call where it has one (no checks or allocation a call), else a call that copies the product's
        result into ``out``."""
        bind = getattr(self.run, "bind", None)
        if bind is not None:
            return bind(rows, out)
        run = self.run
        return lambda threads: out.copy_(run(rows))


def is_float_linear(layer: Any) -> bool:
    """A plain float ``nn.Linear`` (its bias, if any, is the caller's to add: products multiply only)."""
    return type(layer) is torch.nn.Linear


def is_int8_linear(layer: Any) -> bool:
    """An int8 dynamically quantised Linear without bias (``torch.ao`` ``quantize_dynamic``: the int8 twin)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear  # loaded only where an int8 twin is checked

    params = getattr(layer, "_packed_params", None)
    return (type(layer) is DynamicLinear and getattr(params, "dtype", None) == torch.qint8
            and layer.bias() is None)


def is_weight_int8(layer: Any) -> bool:
    """An int8 weight-only Linear (:class:`~speculum.models.hf.kernels.int8_weights.Int8Linear`: the ``int8``
    target)."""
    return type(layer) is Int8Linear


def _split(run: Callable[[torch.Tensor], torch.Tensor], most: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run`` over at most ``most`` rows a call."""
    def split(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] <= most:
            return run(rows)
        return torch.cat([run(part) for part in rows.split(most)])

    return split


def _paired(run: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``run`` with a lone row multiplied beside a copy of itself: the kernel's matrix path, not its
    matrix-vector one."""
    def paired(rows: torch.Tensor) -> torch.Tensor:
        if rows.shape[0] == 1:
            return run(rows.expand(2, -1))[:1]
        return run(rows)

    return paired


def _float32_product(weight: torch.Tensor) -> RowProduct:
    packed = pack_weight(weight)
    shape = tuple(weight.shape)
    plain = _split(lambda rows: packed_linear(rows, packed), PROBE_ROWS)
    # float32 outputs show any change of summation order, so the probe decides whether lone rows need a pair.
    if probed_once("float32", shape, plain):
        return RowProduct(plain, True)
    paired = _paired(plain)
    return RowProduct(paired, probed_once("float32, lone rows paired", shape, paired))


def _bf16_product(weight: torch.Tensor) -> RowProduct:
    if tiles_unavailable() is None:
        tiles = TileProduct(weight)
        if probed_once("bfloat16 tiles", tuple(weight.shape), tiles):
            return RowProduct(tiles, True)
    elif dot_unavailable() is None:
        dot = DotProduct(weight)
        if probed_once("bfloat16 dot", tuple(weight.shape), dot):
            return RowProduct(dot, True)
    if not onednn_bf16_available():
        return _float32_product(weight.float())
    packed, out_features = pack_weight(weight), weight.shape[0]

    def widened(rows: torch.Tensor) -> torch.Tensor:
        # Rows rounded once; each call's bfloat16 outputs widened straight into the float32 result
        # (element-wise: the same numbers as concatenating, then widening).
        low = rows.to(torch.bfloat16)
        out = rows.new_empty(rows.shape[0], out_features)
        for start in range(0, low.shape[0], _BF16_ROWS_A_CALL):
            part = low[start:start + _BF16_ROWS_A_CALL]
            out[start:start + part.shape[0]].copy_(packed_linear(part, packed))
        return out

    # Lone rows always go in pairs: the outputs' rounding to bfloat16 hides the matrix-vector path's other
    # summation order from a probe on most rows, not on all.
    run = _paired(widened)
    if probed_once("bfloat16", tuple(weight.shape), run):
        return RowProduct(run, True)
    return _float32_product(weight.float())


def build_product(layers: list, q8: bool = False) -> RowProduct:
    """One product computing the concatenated outputs of ``layers`` (all float, all int8 weight-only, or
    all int8 dynamic), without their biases: float layers' biases are the caller's to add.

    ``q8``: float32 layers that all carry weight groups multiply by them with 8-bit activations (the ``q8``
    target); ValueError where one has none or of a kind the 8-bit kernel does not multiply.

    Float32 layers that all carry weight groups of one kind multiply by them (one kernel call).
    Float weights are concatenated and packed once for oneDNN: each output element is still the same dot
    product. Dynamic int8 layers run their own ``quantized::linear_dynamic`` ops one after another (exactly
    what their modules run; fusing them would re-quantise the weights with other scales)."""
    if q8 and all(is_float_linear(layer) and layer.weight.dtype == torch.float32 for layer in layers):
        groups = [getattr(layer, GROUPS, None) for layer in layers]
        if any(g is None for g in groups):
            raise ValueError("8-bit products need every layer's weight groups")
        run = q8_run(groups)
        return RowProduct(run, probed_once(f"8-bit {run.kind}", (run.out_features, run.in_features), run))
    if all(is_float_linear(layer) for layer in layers):
        run = multiply_by_groups(layers)
        if run is not None:
            # Probed on its first outputs: the kernel's path depends on the rows and the input width, not on
            # how many lane blocks follow (a 262k-row head would cost seconds a load).
            sample = run.first_outputs(_GROUPED_PROBE_OUTPUTS)
            return RowProduct(run, probed_once(f"grouped {run.kind}", (sample.out_features, run.in_features), sample))
        weight = torch.cat([layer.weight for layer in layers])
        return _bf16_product(weight) if weight.dtype == torch.bfloat16 else _float32_product(weight)
    if all(is_weight_int8(layer) for layer in layers):
        # Concatenated rows keep each output channel's own weights and scale: the same products.
        weight = torch.cat([layer.weight_int8 for layer in layers]).contiguous()
        scales = torch.cat([layer.scales for layer in layers]).contiguous()
        run = _split(lambda rows: torch.ops.aten._weight_int8pack_mm(rows, weight, scales), PROBE_ROWS)
        return RowProduct(run, probed_once("int8 weight-only", tuple(weight.shape), run))
    ops = [(layer._packed_params._packed_params, layer.version is not None and layer.version >= 4)
           for layer in layers]
    if len(ops) == 1:
        (params, reduce), = ops
        return RowProduct(lambda rows: torch.ops.quantized.linear_dynamic(rows, params, reduce_range=reduce), False)
    return RowProduct(lambda rows: torch.cat([torch.ops.quantized.linear_dynamic(rows, params, reduce_range=reduce)
                                              for params, reduce in ops], dim=-1), False)


def product_paths() -> dict[str, Any]:
    """What decides this machine's product paths: ``kernels_off`` (why the compiled kernels are off, else
    None), ``grouped``, ``q8``, ``tiles``, ``bf16_dot``, ``attention`` and ``row_ops`` (each kernel's release,
    :func:`~speculum.models.hf.kernels.build.library_release`, where it runs here, else None) and ``cpu_flags`` (those of :data:`~speculum.models.cpu.KERNEL_FLAGS` this
    CPU has: they pick PyTorch's kernels too). Two processes with equal reports and thread counts multiply
    every kind of product above on the same kernels, and attend on the same kernel."""
    return {"kernels_off": kernels_disabled(),
            "grouped": library_release(kernel_source()) if kernel_unavailable() is None else None,
            "q8": library_release(q8_source()) if q8_unavailable() is None else None,
            "tiles": library_release(tile_source()) if tiles_unavailable() is None else None,
            "bf16_dot": (library_release(dot_source())
                         if tiles_unavailable() is not None and dot_unavailable() is None else None),
            "attention": library_release(attention_source()) if attention_unavailable() is None else None,
            "row_ops": library_release(row_ops_source()) if row_ops_unavailable() is None else None,
            "cpu_flags": sorted(flag for flag in KERNEL_FLAGS if flag in cpu_flags())}
