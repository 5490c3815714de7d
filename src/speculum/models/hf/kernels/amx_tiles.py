"""bfloat16 products on AMX tiles, each output summed in one fixed order: rows in bfloat16, sums in float32.

Why: a bfloat16 target on a CPU with AMX should multiply hundreds of rows (an enumeration level, a prompt,
a packed serving step) at the tiles' rate, and every row must come out the same whatever rows surround it.
oneDNN's bfloat16 kernels give that only for calls of at most 32 rows, each reading the whole weight again,
and round their outputs to bfloat16. ``amx_tiles.c`` sums each output over the input dimension in 32-wide tile
dot products (TDPBF16PS), always in the same order, and keeps the float32 sum: ROW-CANONICAL by
construction, which the product probe of :mod:`~speculum.models.hf.kernels.products` checks as for every kernel.

Numbers: each row is rounded to bfloat16 once (round to nearest even) and multiplied by the bfloat16
weights; the products and sums are float32, with the tiles' handling of subnormals (flushed to zero).

Where the CPU has no AMX-BF16, or Linux does not grant the tiles, or there is no C compiler, or
``SPECULUM_KERNELS=off``, the bfloat16 products stay on oneDNN (:func:`tiles_unavailable` says why).

Example:
    >>> product = TileProduct(torch.randn(64, 96).bfloat16())          # doctest: +SKIP
    >>> product(torch.randn(5, 96)).shape                              # doctest: +SKIP
    torch.Size([5, 64])
"""
from __future__ import annotations

import ctypes
import logging
import platform
import subprocess
import sys
from pathlib import Path

import torch

from ...cpu import cpu_flags
from .build import KernelLibrary, build
from .cache import read_record, untrusted, write_record

__all__ = ["forget", "self_test", "tile_source", "TileProduct", "tiles_unavailable"]

_SOURCE = Path(__file__).with_name("amx_tiles.c")
_ROWS, _STEP, _COLUMNS = 16, 32, 16       # a tile's rows, inputs per tile dot product, columns per block
_log = logging.getLogger("speculum")


def tile_source() -> Path:
    """The kernel's C source (what its release is the hash of)."""
    return _SOURCE


def tiles_unavailable() -> str | None:
    """None when the tile kernel is built and permitted on this machine, else why not (one line);
    ``SPECULUM_KERNELS=off`` is read at each call."""
    return _LIBRARY.unavailable()


def forget() -> None:
    """Drop what this process remembers about the tile kernel (loaded, or why not): the next use looks for
    it, builds it and tries it again, in the cache ``SPECULUM_CACHE`` names then. Products built before
    keep their kernel."""
    _LIBRARY.forget()


def _requires() -> str | None:
    if platform.system() != "Linux" or not {"amx_tile", "amx_bf16"} <= cpu_flags():
        return "this CPU has no AMX-BF16 tiles"
    return None


def _configure(library: ctypes.CDLL) -> str | None:
    """Checks the library compiled for AMX, runs the tiles in a child process (:func:`self_test`), and sets
    the product's argument types."""
    if not library.tiles_compiled():
        return "the compiler did not target AMX-BF16"
    reason = self_test(build("tiles", _SOURCE))      # the cached file just loaded (a lookup, not a build)
    if reason is not None:
        _log.info("bfloat16 tile products unavailable (%s); using oneDNN", reason)
        return reason
    if not library.tiles_permitted():
        return "Linux did not grant this process the AMX tiles"
    library.tiles_product.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                      ctypes.c_int64, ctypes.c_int64, ctypes.c_int]
    library.tiles_product.restype = None
    return None


_LIBRARY = KernelLibrary("tiles", _SOURCE, "bfloat16 tile products (oneDNN multiplies instead)", _requires,
                         _configure)


def self_test(library: Path) -> str | None:
    """None when the tiles computed a small product right in a child process on this system, else why not.
    A sandbox may report AMX and grant the tile state without running it: the first AMX instruction then
    kills the process, here the child. Either outcome is recorded beside the library, per library and
    Linux release (a record only this user may write: see :mod:`~speculum.models.hf.kernels.cache`), so
    the child runs once; deleting the ``.failed`` record tries again."""
    stem = f"{library.stem}.{platform.release()}"
    passed, failed = library.with_name(f"{stem}.passed"), library.with_name(f"{stem}.failed")
    if passed.is_file() and untrusted(passed) is None:
        return None
    record = read_record(failed)
    if record is not None and record.get("reason"):
        return f"{record['reason']} (recorded in {failed}: delete it to try again)"
    script = ("import ctypes, sys\n"
              f"sys.exit(0 if ctypes.CDLL({str(library)!r}).tiles_selftest() == 1 else 3)\n")
    try:
        result = subprocess.run([sys.executable, "-c", script], capture_output=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as exc:
        return f"the tiles' test process did not run: {exc}"      # not the tiles' fault: not recorded
    if result.returncode == 0:
        write_record(passed, {"release": platform.release()})   # an unwritable cache: tried in each process
        return None
    if result.returncode == 3:
        reason = "the AMX tiles are not granted or compute wrong sums on this system"
    else:
        reason = f"the AMX tiles crashed a test process (exit {result.returncode}): this system does not run them"
    write_record(failed, {"release": platform.release(), "reason": reason})
    return reason


def _padded(count: int, multiple: int) -> int:
    return -(-count // multiple) * multiple


class TileProduct:
    """``rows (m, in_features) float32 -> (m, out_features) float32`` by a bfloat16 weight on AMX tiles.
    Guarantee: ROW-CANONICAL (see the module); needs :func:`tiles_unavailable` to be None.

    The weight is packed once into the tiles' layout, padded with zeros to whole tiles (zeros add exact
    zeros to every sum)."""

    __slots__ = ("packed", "in_features", "out_features", "_inputs", "_outputs", "_function")

    def __init__(self, weight: torch.Tensor) -> None:
        library = _LIBRARY.require("bfloat16 tile products")
        self._function = library.tiles_product
        self.out_features, self.in_features = weight.shape
        self._inputs, self._outputs = _padded(self.in_features, _STEP), _padded(self.out_features, _COLUMNS)
        full = weight.new_zeros(self._outputs, self._inputs, dtype=torch.bfloat16)
        full[:self.out_features, :self.in_features] = weight.detach()
        # (blocks, 16 columns, steps, 16 pairs, 2) -> (blocks, steps, 16 pairs, 16 columns, 2)
        self.packed = (full.view(self._outputs // _COLUMNS, _COLUMNS, self._inputs // _STEP, _STEP // 2, 2)
                       .permute(0, 2, 3, 1, 4).contiguous())

    def __call__(self, rows: torch.Tensor) -> torch.Tensor:
        if rows.dim() != 2 or rows.shape[1] != self.in_features:
            raise ValueError(f"tile product: expected rows of {self.in_features}, got {tuple(rows.shape)}")
        count = rows.shape[0]
        height = _padded(count, _ROWS)
        if count == height and self.in_features == self._inputs:
            low = rows.to(torch.bfloat16).contiguous()
        else:
            low = rows.new_zeros(height, self._inputs, dtype=torch.bfloat16)
            low[:count, :self.in_features] = rows
        out = rows.new_empty(height, self._outputs, dtype=torch.float32)
        if height:
            self._function(low.data_ptr(), self.packed.data_ptr(), out.data_ptr(), height, self._outputs,
                           self._inputs, torch.get_num_threads())
        out = out[:count]
        return out if self._outputs == self.out_features else out[:, :self.out_features].contiguous()
