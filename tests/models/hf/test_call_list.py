"""A forward's kernel calls run by one C call (speculum.models.hf.kernels.call_list).

Invariants: a forward on kept buffers whose calls all have records runs them as one call list; its logits are
bitwise those of the same calls made from Python, on a session's own cache (rows written into its room) and on
the KV store (packed sessions), for one row and for blocks of several; a forward that may be stopped between
layers makes its calls from Python (and stops); a call without a record is refused by name; products of
several weight kinds bound side by side give their concatenation, called from Python or as a call list.
"""
from __future__ import annotations

import copy
import ctypes

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf")

from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf.forward import glued  # noqa: E402
from speculum.models.hf.kernels.call_list import CallList, KernelCall, call_list_unavailable  # noqa: E402
from speculum.models.hf.kernels.gguf_records import pack  # noqa: E402
from speculum.models.hf.kernels.q8_groups import q8_unavailable  # noqa: E402
from speculum.models.hf.kernels.row_ops import row_ops_unavailable  # noqa: E402
from speculum.models.hf.precision import prepare_module  # noqa: E402
from speculum.models.interruption import Interrupted  # noqa: E402
from support.grouped_weights import grouped_tiny  # noqa: E402

pytestmark = pytest.mark.skipif(
    (q8_unavailable() or row_ops_unavailable() or call_list_unavailable()) is not None,
    reason=f"kernels unavailable: {q8_unavailable() or row_ops_unavailable() or call_list_unavailable()}")


@pytest.fixture(scope="module", params=["q8", "float32"])
def model(request, tmp_path_factory) -> HFModel:
    """The tiny Llama with Q4_1 blocks and a Q8_0 head: 8-bit products, or float32 ones from the groups."""
    grouped, groups = grouped_tiny(tmp_path_factory.mktemp(request.param) / "model", "q4_1", head="q8_0")
    module = prepare_module(copy.deepcopy(grouped.module), "q8") if request.param == "q8" else grouped.module
    loaded = HFModel(module, grouped.tokenizer, groups=groups)
    assert all(isinstance(call, KernelCall) for call in glued.BoundBlocks(loaded.fused, 1).layers[0])
    return loaded


class Counted:
    """Counts the call lists run (and lets them run)."""

    def __init__(self, monkeypatch) -> None:
        self.runs = 0
        run = CallList.__call__

        def counted(calls, threads):
            self.runs += 1
            return run(calls, threads)

        monkeypatch.setattr(CallList, "__call__", counted)


def from_python(monkeypatch) -> None:
    """Every forward from now on makes its calls from Python."""
    monkeypatch.setattr(glued, "use_call_lists", False)


def own_cache_run(model) -> list[np.ndarray]:
    session = model.start([1, 4, 5, 6, 4, 5])
    rows = []
    for block in ([7], [4, 5, 6, 7], [8], [4, 9, 10], [11], [12], [4, 5], [13], [14], [6, 7, 8, 9], [15], [16]):
        rows.append(session.extend(block))                      # single rows and blocks of several
    return rows


def store_run(model) -> list[np.ndarray]:
    sessions = [model.start(prompt) for prompt in ([1, 4, 5], [1, 6, 7, 8, 9], [1, 10])]
    rows = []
    for blocks in ([[4], [5], [6]], [[4, 5, 6], [7], [8, 9]], [[10], [11, 12, 13, 14], [15]]):
        rows.extend(model.extend_sessions(sessions, blocks))
    return rows


@pytest.mark.parametrize("run", [own_cache_run, store_run])
def test_call_lists_give_the_python_calls_bits(model, monkeypatch, run):
    model.fused.bound_blocks.shapes.clear()
    counted = Counted(monkeypatch)
    listed = run(model)
    assert counted.runs >= 3                                    # the forwards after the first ran as call lists
    from_python(monkeypatch)
    runs = counted.runs
    python = run(model)
    assert counted.runs == runs
    assert len(listed) == len(python) and all(a.tobytes() == b.tobytes() for a, b in zip(listed, python))


def test_a_forward_that_may_stop_between_layers_makes_its_calls_from_python(model, monkeypatch):
    model.fused.bound_blocks.shapes.clear()
    sessions = [model.start([1, 4, 5, 6]) for _ in range(2)]
    for session in sessions:
        for token in (7, 8, 9):
            session.extend([token])                             # room for more keys on every layer
    counted = Counted(monkeypatch)
    model.fused(torch.tensor([[10]]), sessions[0].cache)
    assert counted.runs == 1                                    # a call list, where nothing may stop it
    interruption = model.fused.interruption
    checks = []
    with interruption.requested(lambda: checks.append(1) is None and len(checks) == 2), interruption.armed():
        with pytest.raises(Interrupted):
            model.fused(torch.tensor([[10]]), sessions[1].cache)
    assert counted.runs == 1 and len(checks) == 2               # stopped before the second layer, from Python


def test_a_call_without_a_record_is_refused_by_name():
    libc = ctypes.CDLL(None)
    libc.labs.argtypes, libc.labs.restype = [ctypes.c_long, ctypes.c_int], ctypes.c_long
    with pytest.raises(ValueError, match="labs has no call record"):
        CallList([KernelCall(libc.labs, (3,))])


@pytest.mark.parametrize("run", ["q8", "float32"])
def test_products_of_several_kinds_bound_side_by_side_give_their_concatenation(run):
    from speculum.models.hf.kernels.gguf_groups import grouped_run
    from speculum.models.hf.kernels.q8_groups import q8_run
    from support.grouped_weights import random_blocks

    rng = np.random.default_rng(5)
    weights = [pack(kind, random_blocks(kind, outputs, 64, rng))
               for kind, outputs in (("q4_1", 32), ("q8_0", 16), ("q4_1", 48))]
    product = (q8_run if run == "q8" else grouped_run)(weights)
    rows, out = torch.randn(3, 64), torch.full((3, 96), float("nan"))
    bound = product.bind(rows, out)
    assert len(bound.calls) == 6                                # each part, then its columns
    bound(2)
    assert torch.equal(out, product(rows))
    out.fill_(float("nan"))
    CallList(bound.calls)(2)
    assert torch.equal(out, product(rows))
