"""Threads that follow the free cores: the count follows what other processes leave, and never changes a
number (a model is governed only where its rows ignore the thread count)."""
from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models.hf import HFModel, threads  # noqa: E402
from speculum.models.hf.threads import ThreadGovernor  # noqa: E402


class FakeMachine:
    """``/proc/stat``'s busy seconds and this process's CPU seconds, advanced by hand."""

    def __init__(self, monkeypatch) -> None:
        self.busy = self.own = self.wall = 0.0
        monkeypatch.setattr(threads, "_busy_seconds", lambda: self.busy)
        monkeypatch.setattr(threads, "_own_seconds", lambda: self.own)
        monkeypatch.setattr(threads.time, "monotonic", lambda: self.wall)

    def run(self, seconds: float, *, own_cores: float, other_cores: float) -> None:
        self.wall += seconds
        self.own += own_cores * seconds
        self.busy += (own_cores + other_cores) * seconds


@pytest.fixture
def restore_threads():
    before = torch.get_num_threads()
    yield
    torch.set_num_threads(before)


def test_the_count_is_the_cores_others_leave_free(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    torch.set_num_threads(4)
    governor = ThreadGovernor(most=4, interval=0.5)
    assert governor.adjust() == 4                        # the first reading: nothing known yet
    machine.run(1.0, own_cores=4, other_cores=0.1)       # background noise keeps every thread
    assert governor.adjust() == 4
    machine.run(1.0, own_cores=2, other_cores=2)         # two busy processes
    assert governor.adjust() == 2 and torch.get_num_threads() == 2
    machine.run(0.2, own_cores=2, other_cores=4)         # within the interval: no new reading
    assert governor.adjust() == 2
    machine.run(1.0, own_cores=0.5, other_cores=3.5)
    assert governor.adjust() == 1                        # at least one
    machine.run(1.0, own_cores=1, other_cores=0)         # they are gone: every thread again
    assert governor.adjust() == 4 and torch.get_num_threads() == 4


def test_a_model_is_governed_only_where_its_rows_ignore_the_thread_count(tmp_path, monkeypatch, restore_threads):
    path = save_tiny_model(tmp_path / "tiny", layers=2)
    torch.set_num_threads(2)
    model = HFModel.from_pretrained(path, threads=2)
    assert model.govern_threads() in (1, 2)
    monkeypatch.setattr(threads, "rows_ignore_threads", lambda most, rows: False)
    assert HFModel.from_pretrained(path, threads=2).govern_threads() is None
    monkeypatch.undo()
    monkeypatch.setenv("SPECULUM_THREADS", "fixed")
    assert HFModel.from_pretrained(path, threads=2).govern_threads() is None


def test_rows_and_greedy_output_do_not_depend_on_the_thread_count(tmp_path, monkeypatch, restore_threads):
    """Every forward on another thread count than the one before it: the same rows, bitwise, and the same
    greedy speculative and plain output (the probe's promise, checked on whole generations)."""
    path = save_tiny_model(tmp_path / "tiny", layers=2)
    model = HFModel.from_pretrained(path, threads=2)
    if model.govern_threads() is None:
        pytest.skip("this machine's kernels round otherwise at another thread count: the count stays fixed")
    prompt = [1, 5, 9, 4, 7, 3, 8, 2]
    fixed_rows = model.start(prompt[:3]).extend(prompt[3:])
    fixed = speculum.generate(model, prompt, max_new_tokens=16, temperature=0, eos_token_id=None).tokens
    counts = iter([1, 2] * 1000)
    monkeypatch.setattr(model, "govern_threads", lambda: torch.set_num_threads(next(counts)))
    assert np.array_equal(model.start(prompt[:3]).extend(prompt[3:]), fixed_rows)
    assert speculum.generate(model, prompt, max_new_tokens=16, temperature=0, eos_token_id=None).tokens == fixed
    speculative = speculum.generate(model, prompt, draft=model, gamma=3, max_new_tokens=16, temperature=0,
                                    eos_token_id=None)
    assert speculative.tokens == fixed


def test_a_count_the_user_sets_becomes_the_most(monkeypatch, restore_threads):
    machine = FakeMachine(monkeypatch)
    torch.set_num_threads(4)
    governor = ThreadGovernor(most=4)
    governor.adjust()
    torch.set_num_threads(1)                             # the user's choice
    machine.run(1.0, own_cores=1, other_cores=0)
    assert governor.adjust() == 1 and governor.most == 1


def test_the_thread_probe_stays_within_a_short_context(tmp_path, restore_threads):
    for context in (2, 8):
        model = HFModel.from_pretrained(save_tiny_model(tmp_path / f"c{context}", layers=2, max_context=context),
                                        threads=2)
        assert model.govern_threads() in (None, 1, 2)
        assert len(model.start([1]).extend([2] * (context - 1))) == context - 1
