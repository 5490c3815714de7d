"""``gamma="auto"`` on the machine at hand: costs measured robustly, and drafting checked against what it
delivers. Costs are injected, never timed here (wall-clock timings are noisy on shared machines)."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from speculum.decoding.gamma.controller import GammaController
from speculum.decoding.gamma.costs import CostModel


@settings(max_examples=50, deadline=None)
@given(step=st.floats(0.001, 0.1), per_row=st.floats(0.0, 0.5), stalls=st.lists(st.floats(1.5, 20.0), max_size=4),
       at=st.integers(0, 8))
def test_a_minority_of_stalls_does_not_move_the_measured_costs(step, per_row, stalls, at):
    """Interference only adds time: fewer stalled timings than half a window leave every cost as measured."""
    costs = CostModel()
    timings = [1.0] * costs.window
    for index, factor in enumerate(stalls):
        timings[(at + 2 * index) % costs.window] = factor
    for n in (1, 3, 9):
        for factor in timings:
            costs.observe_target(n, step * (1 + per_row * (n - 1)) * factor)
    assert costs.step_seconds() == step
    for gamma in (2, 8):
        assert abs(costs.verify_cost(gamma) - (1 + per_row * gamma)) < 1e-9


def test_costs_follow_a_lasting_change_of_speed_within_a_window():
    costs = CostModel()
    for _ in range(20):
        costs.observe_target(1, 0.010)
    for _ in range(costs.window // 2 + 1):
        costs.observe_target(1, 0.030)           # the machine got slower, and stays so
    assert costs.step_seconds() == 0.030


def _drafting_controller() -> GammaController:
    """A controller whose estimates say drafting pays in situation 5: cheap verification, full acceptance."""
    ctl = GammaController(max_gamma=8, explore_every=1000)
    ctl.observe_target(1, 0.010)
    for n in range(2, 10):
        ctl.observe_target(n, 0.010 + 0.0005 * n)
    for _ in range(10):
        ctl.observe_acceptance(proposed=4, accepted=4, key=5)
    return ctl


def test_drafting_that_delivers_less_than_plain_steps_is_stopped():
    """Whatever the estimates say, a situation whose drafting blocks, timed whole, emit fewer tokens a second
    than plain steps gets plain steps (then probes, as any situation that does not pay)."""
    ctl = _drafting_controller()
    assert ctl.next_gamma(key=5) > 0
    for _ in range(3):
        ctl.observe_delivered(0.060, 5, key=5)   # 5 tokens in 60 ms: 0.83x a 10 ms plain step's rate
    assert ctl.delivered_speedup(5) < 1.0
    assert ctl.next_gamma(key=5) == 0
    other = _drafting_controller()
    for _ in range(3):
        other.observe_delivered(0.030, 5, key=5)  # 5 tokens in 30 ms: 1.67x
    assert other.delivered_speedup(5) > 1.0 and other.next_gamma(key=5) > 0


def test_too_few_blocks_cannot_veto_a_situation():
    ctl = _drafting_controller()
    for _ in range(ctl.min_realized_blocks - 1):
        ctl.observe_delivered(1.0, 1, key=5)
    assert ctl.delivered_speedup(5) is None and ctl.next_gamma(key=5) > 0


def test_an_untimed_controller_ignores_what_blocks_delivered():
    """A seeded sampler's γ must not depend on wall-clock time."""
    ctl = GammaController(timed=False)
    for _ in range(5):
        ctl.observe_delivered(1.0, 1, key=5)
    assert ctl.delivered_speedup(5) is None


@settings(max_examples=50, deadline=None)
@given(fixed=st.floats(0.0, 0.05), per_token=st.floats(1e-4, 0.01), blocks=st.integers(1, 16),
       gamma=st.integers(1, 12))
def test_a_shared_forward_charges_a_block_what_it_adds_at_the_batch_size(fixed, per_token, blocks, gamma):
    """In a forward shared by ``blocks`` blocks, a plain step's share is fixed / blocks + per_token and a
    block of γ proposals costs γ more tokens, whatever this generation's own timings said; after
    ``forward_alone`` its own timings count again."""
    costs = CostModel()
    for n in (1, 5):
        for _ in range(costs.window):
            costs.observe_target(n, 0.010 * n)
    costs.share_forward(fixed, per_token, blocks)
    step = fixed / blocks + per_token
    assert abs(costs.step_seconds() - step) <= 1e-12 * step
    expected = (fixed / blocks + per_token * (gamma + 1)) / step
    assert abs(costs.verify_cost(gamma) - expected) <= 1e-9 * expected
    costs.forward_alone()
    assert costs.step_seconds() == 0.010 and abs(costs.verify_cost(4) - 5.0) < 1e-9


def test_a_shared_forward_cannot_move_an_untimed_controller():
    """A seeded sampler's γ must not depend on wall-clock time, the batch's fitted costs included."""
    ctl = GammaController(timed=False)
    ctl.observe_target(1, 0.010)
    before = (ctl.step_seconds(), ctl.verify_cost(4))
    ctl.share_forward(0.5, 0.001, 8)
    assert (ctl.step_seconds(), ctl.verify_cost(4)) == before


def test_delivered_blocks_count_in_the_plain_steps_of_their_moment():
    """Blocks timed while a plain step cost 40 ms (a full batch) keep their speed-up when the batch shrinks
    and a plain step costs 10 ms: the earlier blocks neither veto nor excuse drafting afterwards."""
    ctl = _drafting_controller()
    ctl.share_forward(0.032, 0.036, 8)                # a plain step's share: 40 ms
    for _ in range(3):
        ctl.observe_delivered(0.060, 3, key=5)        # 3 tokens in 1.5 steps: 2x
    ctl.share_forward(0.004, 0.006, 1)                # alone: 10 ms a plain step
    assert abs(ctl.delivered_speedup(5) - 2.0) < 1e-9
