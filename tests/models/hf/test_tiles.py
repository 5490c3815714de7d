"""bfloat16 products on AMX tiles (speculum.models.hf.kernels.amx_tiles).

Invariants, where this machine has the tiles: each output is the float32 sum of the bfloat16-rounded rows
times the bfloat16 weights (to float32 rounding of the sum); every row is bitwise the same alone, among
others, at any offset and at any thread count; padded shapes (widths not whole tiles) give the same as
the unpadded sums. Everywhere: without the tiles, the reason is one line and bfloat16 products stay on
oneDNN, rows still alone; where oneDNN has no bfloat16 kernel either (AVX2 alone), they run in float32.
"""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")

from support.bf16_products import check_bfloat16_product  # noqa: E402
from speculum.models.hf.kernels import amx_tiles, products  # noqa: E402
from speculum.models.hf.kernels.amx_tiles import TileProduct, tiles_unavailable  # noqa: E402
from speculum.models.hf.kernels.probe import gives_rows_alone  # noqa: E402
from speculum.models.hf.kernels.products import build_product  # noqa: E402

needs_tiles = pytest.mark.skipif(tiles_unavailable() is not None, reason=f"no AMX tiles: {tiles_unavailable()}")


@needs_tiles
@given(st.integers(1, 70), st.integers(1, 100), st.integers(0, 40), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_tile_products_are_float32_sums_of_the_rounded_rows_each_row_alone(out_features, in_features, rows, seed):
    check_bfloat16_product(TileProduct, out_features, in_features, rows, seed)


@needs_tiles
def test_tile_products_do_not_depend_on_the_thread_count():
    generator = torch.Generator().manual_seed(0)
    product = TileProduct(torch.randn(1024, 576, generator=generator).bfloat16())
    inputs = torch.randn(100, 576, generator=generator)
    threads = torch.get_num_threads()
    try:
        outs = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            outs.append(product(inputs))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(outs[0], other) for other in outs[1:])
    assert gives_rows_alone(product, 576, torch.Generator().manual_seed(1))


@needs_tiles
def test_a_bfloat16_product_runs_on_the_tiles_and_refuses_a_wrong_width():
    layers = [torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16) for _ in range(2)]
    product = build_product(layers)
    assert isinstance(product.run, TileProduct) and product.rows_alone
    rows = torch.randn(5, 64)
    expected = torch.cat([TileProduct(layer.weight)(rows) for layer in layers], dim=1)
    assert torch.equal(product(rows), expected)
    with pytest.raises(ValueError, match="expected rows of 64"):
        product.run(torch.randn(2, 63))


def test_without_tiles_the_reason_is_given_and_bfloat16_stays_on_onednn(monkeypatch):
    monkeypatch.delenv("SPECULUM_KERNELS", raising=False)       # the CPU's reason, not the switch's
    monkeypatch.setattr(amx_tiles, "cpu_flags", lambda: {"avx2", "fma"})
    amx_tiles.forget()
    try:
        assert amx_tiles.tiles_unavailable() == "this CPU has no AMX-BF16 tiles"
        with pytest.raises(RuntimeError, match="no AMX-BF16"):
            TileProduct(torch.zeros(16, 32, dtype=torch.bfloat16))
        product = build_product([torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)])
        assert not isinstance(product.run, TileProduct) and product.rows_alone
    finally:
        amx_tiles.forget()


def test_without_any_bfloat16_kernel_the_product_multiplies_the_weights_in_float32(monkeypatch):
    """A CPU with AVX2 alone: no tiles, no AVX-512 BF16, and oneDNN refuses to pack a bfloat16 weight. The
    product then multiplies float32 rows by the bfloat16 weights widened to float32 (exactly), rows alone."""
    monkeypatch.setattr(products, "tiles_unavailable", lambda: "no tiles here")
    monkeypatch.setattr(products, "dot_unavailable", lambda: "no AVX-512 BF16 here")
    monkeypatch.setattr(products, "onednn_bf16_available", lambda: False)
    generator = torch.Generator().manual_seed(11)
    layer = torch.nn.Linear(64, 48, bias=False).to(torch.bfloat16)
    rows = torch.randn(5, 64, generator=generator)
    product = build_product([layer])
    assert product.rows_alone
    widened = rows @ layer.weight.float().T
    assert torch.allclose(product(rows), widened, rtol=1e-5, atol=1e-5)     # the rows are not rounded to bfloat16
    assert not torch.allclose(rows.bfloat16().float() @ layer.weight.float().T, widened, rtol=1e-5, atol=1e-5)


def test_every_kernel_source_ships_in_the_package():
    """The kernels are compiled from their sources at run time: each ``.c`` beside the modules is package data."""
    import tomllib
    from pathlib import Path

    root = Path(__file__).resolve().parents[3]
    package = root / "src" / "speculum"
    settings_ = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    shipped = set(settings_["package-data"]["speculum"])
    sources = {path.relative_to(package).as_posix() for path in package.rglob("*.c")}
    assert sources and sources <= shipped


def test_the_tiles_are_tried_in_a_child_process_once_and_a_crash_costs_only_a_reason(tmp_path, monkeypatch):
    import subprocess

    library = tmp_path / "tiles-0.so"
    calls = []

    def child(returncode):
        def run(command, **kwargs):
            calls.append(command)
            return subprocess.CompletedProcess(command, returncode, b"", b"")
        return run

    monkeypatch.setattr(amx_tiles.subprocess, "run", child(-4))          # killed by SIGILL
    assert "crashed a test process (exit -4)" in amx_tiles.self_test(library)
    assert "crashed a test process (exit -4)" in amx_tiles.self_test(library)      # recorded: no second child
    for record in tmp_path.glob("*.failed"):
        record.unlink()                                                   # deleting the record tries again
    monkeypatch.setattr(amx_tiles.subprocess, "run", child(3))
    assert "not granted or compute wrong sums" in amx_tiles.self_test(library)
    for record in tmp_path.glob("*.failed"):
        record.unlink()
    monkeypatch.setattr(amx_tiles.subprocess, "run", child(0))
    assert amx_tiles.self_test(library) is None and amx_tiles.self_test(library) is None
    assert len(calls) == 3                       # the pass is remembered beside the library: no fourth child


@needs_tiles
def test_the_tiles_self_test_passes_in_a_real_child_process():
    from speculum.models.hf.kernels.build import build

    library = build("tiles", amx_tiles.tile_source())
    for passed in library.parent.glob(f"{library.stem}.*.passed"):
        passed.unlink()
    assert amx_tiles.self_test(library) is None
