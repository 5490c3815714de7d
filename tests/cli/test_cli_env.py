"""``speculum env``: the machine's kernels and dtype advice, without loading a model.

Invariants: the JSON report states, for each compiled kernel, exactly what the library's own availability
checks say, and a note for every dtype the backend accepts (slower-than-float32 exactly where the dtype
advice says so); the text report names every kernel and dtype; a CPU without AMX shows the tiles'
reason and no tiles advice.
"""
from __future__ import annotations

import json

import pytest

torch = pytest.importorskip("torch")

from speculum.cli import main  # noqa: E402
from speculum.models.hf.kernels import amx_tiles  # noqa: E402
from speculum.models.hf.kernels.gguf_groups import kernel_unavailable  # noqa: E402
from speculum.models.hf.precision import DTYPES, dtype_advice  # noqa: E402


def report(capsys, *flags: str) -> str:
    assert main(["env", *flags]) == 0
    return capsys.readouterr().out


def test_the_json_report_says_what_the_library_checks_say(capsys):
    data = json.loads(report(capsys, "--json"))
    assert data["versions"]["torch"] and data["versions"]["speculum"]
    kernels = data["kernels"]
    assert kernels["float32 from GGUF groups"] == {"runs": kernel_unavailable() is None,
                                                   "why_not": kernel_unavailable()}
    assert kernels["bfloat16 on AMX tiles"] == {"runs": amx_tiles.tiles_unavailable() is None,
                                                "why_not": amx_tiles.tiles_unavailable()}
    assert set(data["dtypes"]) == set(DTYPES)
    for dtype, state in data["dtypes"].items():
        assert state["slower"] == (dtype_advice(dtype) is not None) and state["note"]
    assert data["dtypes"]["int8"]["note"] == dtype_advice("int8")


def test_the_text_report_names_every_kernel_and_dtype(capsys):
    text = report(capsys)
    for name in ("onednn", "float32 from GGUF groups", "bfloat16 on AMX tiles", "bfloat16 by AVX-512 BF16 dot products",
                 *DTYPES, "cache:"):
        assert name in text


def test_without_amx_the_tiles_reason_shows_and_bfloat16_is_not_advised_for_them(capsys, monkeypatch):
    monkeypatch.delenv("SPECULUM_KERNELS", raising=False)       # the CPU's reason, not the switch's
    monkeypatch.setattr(amx_tiles, "cpu_flags", lambda: frozenset({"avx2", "fma"}))
    amx_tiles.forget()
    try:
        data = json.loads(report(capsys, "--json"))
    finally:
        amx_tiles.forget()
    assert data["kernels"]["bfloat16 on AMX tiles"] == {"runs": False, "why_not": "this CPU has no AMX-BF16 tiles"}
    assert "AMX tiles" not in data["dtypes"]["bfloat16"]["note"]


@pytest.fixture
def fresh_kernels():
    """The kernels' availability computed again for this test (and again after it)."""
    from speculum.models.hf.kernels import bf16_dot, gguf_groups, q8_groups

    modules = (gguf_groups, amx_tiles, q8_groups, bf16_dot)
    for module in modules:
        module.forget()
    yield
    for module in modules:
        module.forget()


def test_a_compiler_failure_shows_its_reason_after_the_colon(capsys, monkeypatch, tmp_path, fresh_kernels):
    monkeypatch.delenv("SPECULUM_KERNELS", raising=False)       # the compiler's reason, not the switch's
    monkeypatch.setenv("SPECULUM_CACHE", str(tmp_path))
    monkeypatch.setenv("CC", "/bin/false")
    text = report(capsys)
    line, = [line for line in text.splitlines() if "float32 from GGUF groups" in line]
    assert "does not compile here: the compiler (/bin/false) exited 1 with no message" in line


def test_a_cache_other_users_may_write_is_reported_and_not_used(capsys, monkeypatch, tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o777)
    monkeypatch.setenv("SPECULUM_CACHE", str(shared))
    data = json.loads(report(capsys, "--json"))
    assert data["kernel_cache"]["trusted"] is False and "other users" in data["kernel_cache"]["why_not"]
    assert not data["kernel_cache"]["folder"].startswith(str(shared))
    assert "not safe to share" in report(capsys)


def test_kernels_off_is_reported_with_every_fallback(capsys, monkeypatch, fresh_kernels):
    monkeypatch.setenv("SPECULUM_KERNELS", "off")
    data = json.loads(report(capsys, "--json"))
    assert "SPECULUM_KERNELS=off" in data["kernels_off"]
    for name in ("float32 from GGUF groups", "bfloat16 on AMX tiles", "8-bit products on GGUF groups",
                 "bfloat16 by AVX-512 BF16 dot products", "a forward's kernel calls in one call from Python"):
        assert data["kernels"][name]["runs"] is False and "SPECULUM_KERNELS=off" in data["kernels"][name]["why_not"]
    assert any(line.startswith("kernels: compiled kernels are off (SPECULUM_KERNELS=off)")
               for line in report(capsys).splitlines())
