"""Packed forwards of the PyTorch backend: the KV store shared by packed sessions
(speculum.models.hf.kv.store) and prompts deferred into the packed forward (``start_deferred``).

Invariants: a slot holds exactly what a cache of its own fed the same appends and trims holds, whatever the
other slots do and however often the store grows (tests/models/hf/test_kv_cache.py); sessions verified in one packed forward over the store
get the rows and states of their own forwards (joins, leaves, ragged blocks, rollbacks); slots come back
when sessions go, and the store's memory with the last one; a session whose prompt is deferred gives the
rows of a prefilled one, alone or packed; a scheduler that packs prompts keeps every greedy output.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from speculum.models.base import Feed  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.hf import model as hf_module  # noqa: E402
from speculum.drafts.twins import truncated_draft  # noqa: E402
from speculum.validation import InputError  # noqa: E402


@pytest.fixture(scope="module")
def tiny() -> HFModel:
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as folder:
        return HFModel.from_pretrained(save_tiny_model(Path(folder) / "model"))


@contextmanager
def small_first_buffers(store):
    """``store`` (empty) starting with one slot of 2 tokens while in the block, so that tests grow it often. A
    store left uninitialised (the compiled forward's) is filled with NaN instead: a forward that read past a
    session's keys would spread it into the rows. The sessions of earlier tests are gone by then (dropped
    sessions give their slots back at once)."""
    assert store.in_use == 0 and store.keys == []
    sizes = store.first_slots, store.first_capacity, store.fill
    store.first_slots, store.first_capacity = 1, 2
    if store.fill is None:
        store.fill = float("nan")
    try:
        yield store
    finally:
        store.first_slots, store.first_capacity, store.fill = sizes


def test_only_the_compiled_forward_leaves_the_store_uninitialised(tiny):
    """Zeros where PyTorch's packed attention reads whole slots (masking past each session), none where the
    compiled kernel reads each session's keys only (the test above fills it with NaN)."""
    compiled = tiny.fused is not None and tiny.fused.row_ops is not None
    assert (tiny.kv_store.fill is None) == compiled
    assert tiny.kv_store.fill in (None, 0.0)


# ----------------------------------------------------------------------- packed forwards over the store
@given(st.lists(st.tuples(st.integers(1, 6), st.lists(st.tuples(st.booleans(), st.integers(0, 4), st.integers(0, 4)),
                                                      min_size=1, max_size=5)),
                min_size=2, max_size=5),
       st.integers(0, 2**31))
@settings(max_examples=25, deadline=None)
def test_packed_sessions_on_the_store_equal_their_own_forwards(tiny, requests, seed):
    """Requests join (prompt of p tokens), take part in some rounds (a block of b tokens, then a rollback
    of r) and leave after their last round, on a store that grows from one 2-token slot: every row of
    every packed call equals the session's own extend to float32 rounding, states stay equal, and a session
    dropped gives its slot back at once (reference counting, no garbage collection)."""
    rng = np.random.default_rng(seed)
    with small_first_buffers(tiny.kv_store):
        live: dict[int, tuple] = {}
        for round_ in range(6):
            for i, (prompt_length, rounds) in enumerate(requests):
                if round_ == i % 3 and i not in live:                        # joins at round i % 3
                    prompt = rng.integers(3, tiny.vocab_size, size=prompt_length).tolist()
                    live[i] = (tiny.start(prompt), tiny.start(prompt), list(rounds))
            taking_part = [i for i, (_, _, rounds) in live.items() if rounds and rounds[0][0]]
            for i in list(live):
                if i not in taking_part and live[i][2]:
                    live[i][2].pop(0)                                       # sits this round out
            if taking_part:
                blocks = [rng.integers(3, tiny.vocab_size, size=max(1, live[i][2][0][1])).tolist()
                          for i in taking_part]
                got = tiny.extend_sessions([live[i][1] for i in taking_part], blocks)
                assert all(live[i][1].cache.store is tiny.kv_store for i in taking_part)
                for i, block, rows in zip(taking_part, blocks, got):
                    solo, packed, rounds = live[i]
                    want = solo.extend(block)
                    assert rows.shape == want.shape and np.abs(rows - want).max() < 1e-4
                    back = min(rounds.pop(0)[2], len(block))
                    solo.rollback(back), packed.rollback(back)
            for i in [i for i, (_, _, rounds) in live.items() if not rounds]:
                solo, packed, _ = live.pop(i)                               # leaves: its slot is freed
                assert solo.tokens == packed.tokens
                assert np.abs(solo.next_logprobs() - packed.next_logprobs()).max() < 1e-4
        for solo, packed, _ in live.values():
            assert np.abs(solo.extend([3]) - packed.extend([3])).max() < 1e-4
        live = solo = packed = None
        assert tiny.kv_store.in_use == 0 and tiny.kv_store.keys == []


def test_sessions_keep_their_own_caches_beyond_the_store_budget(tiny, monkeypatch):
    """A store that would pass its budget is not used; the packed forward then attends per session."""
    monkeypatch.setattr(hf_module, "ARENA_BUDGET_BYTES", 0)
    solo, packed = [tiny.start([3, 4, 5]), tiny.start([6])], [tiny.start([3, 4, 5]), tiny.start([6])]
    got = tiny.extend_sessions(packed, [[7, 8], [9]])
    assert all(session.cache.store is None for session in packed)
    for session, block, rows in zip(solo, [[7, 8], [9]], got):
        assert np.abs(session.extend(block) - rows).max() < 1e-4


def test_a_layer_draft_reads_a_session_on_the_store(tiny):
    """A layer-truncated draft adopts the first layers of a target session that lives in the store."""
    draft = truncated_draft(tiny, 2)
    target_sessions = [tiny.start([3, 4, 5, 6]), tiny.start([7, 8])]
    tiny.extend_sessions(target_sessions, [[9, 10], [11]])
    assert target_sessions[0].cache.store is tiny.kv_store
    shared = draft.start_sharing(target_sessions[0])
    assert shared is not None
    np.testing.assert_allclose(shared.advance([12]), draft.start([3, 4, 5, 6, 9, 10]).advance([12]), atol=1e-5)
    np.testing.assert_allclose(target_sessions[0].extend([12]), tiny.start([3, 4, 5, 6, 9, 10]).extend([12]),
                               atol=1e-5)


def test_schedulers_in_two_threads_share_the_store(tiny):
    """Two threads each generating a batch on one model (one store): every output is its solo greedy one."""
    prompts = [[[3, 4, 5], [6], [7, 8, 9, 10]], [[11, 12], [13, 14, 15], [16]]]
    want = [[speculum.generate(tiny, p, max_new_tokens=20, temperature=0, eos_token_id=None).tokens for p in batch]
            for batch in prompts]
    got: list = [None, None]
    errors: list = []

    def work(k: int) -> None:
        try:
            for _ in range(3):
                got[k] = [r.tokens for r in speculum.generate_batch(tiny, prompts[k], max_new_tokens=20,
                                                                    temperature=0, eos_token_id=None)]
                assert got[k] == want[k]
        except Exception as exc:          # reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(k,)) for k in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors
    assert got == want


# ------------------------------------------------------------------------------------ deferred prompts
@given(st.integers(1, 8), st.lists(st.tuples(st.sampled_from(["extend", "advance", "next", "rollback", "part"]),
                                            st.integers(0, 4)), min_size=1, max_size=6), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_a_deferred_prompt_gives_the_rows_of_a_prefilled_one(tiny, prompt_length, operations, seed):
    """Whatever comes first (an extend, an advance, next_logprobs, a rollback into the unfed prompt, a
    part of the prompt fed alone), a session started with start_deferred answers as a prefilled one."""
    rng = np.random.default_rng(seed)
    prompt = rng.integers(3, tiny.vocab_size, size=prompt_length).tolist()
    deferred, prefilled = tiny.start_deferred(prompt), tiny.start(prompt)
    assert deferred.unfed == prompt_length and deferred.tokens == prompt
    for kind, n in operations:
        tokens = rng.integers(3, tiny.vocab_size, size=n).tolist()
        if kind == "extend":
            want, got = prefilled.extend(tokens), deferred.extend(tokens)
        elif kind == "advance":
            want, got = prefilled.advance(tokens), deferred.advance(tokens)
        elif kind == "next" and prefilled.tokens:
            want, got = prefilled.next_logprobs(), deferred.next_logprobs()
        elif kind == "part":
            unfed = deferred.unfed
            want, got = np.zeros((0, tiny.vocab_size)), deferred.feed_prompt(n)
            assert deferred.unfed == max(0, unfed - n)
        else:
            back = min(n, len(prefilled.tokens) - 1)
            prefilled.rollback(back), deferred.rollback(back)
            want = got = np.zeros(0)
        assert got.shape == want.shape and (got.size == 0 or np.abs(got - want).max() < 1e-4)
        assert deferred.tokens == prefilled.tokens
    assert np.abs(deferred.extend([3]) - prefilled.extend([3])).max() < 1e-4 and deferred.unfed == 0


@pytest.mark.parametrize("budget", [None, 0])
def test_deferred_prompts_ride_in_the_packed_forward(tiny, monkeypatch, budget):
    """New sessions with deferred prompts packed with running ones (on the store, and beyond its budget):
    each gets only its block's rows, equal to a prefilled session's extend."""
    if budget is not None:
        monkeypatch.setattr(hf_module, "ARENA_BUDGET_BYTES", budget)
    prompts, blocks = [[3, 4, 5, 6, 7], [8], [9, 10, 11]], [[12, 13], [14], [15, 16, 17]]
    running = tiny.start([18, 19])
    packed = [tiny.start_deferred(p) for p in prompts] + [running]
    solo = [tiny.start(p) for p in prompts] + [tiny.start([18, 19])]
    got = tiny.extend_sessions(packed, blocks + [[20]])
    for session, other, block, rows in zip(solo, packed, blocks + [[20]], got):
        want = session.extend(block)
        assert rows.shape == want.shape and np.abs(rows - want).max() < 1e-4
        assert other.unfed == 0 and other.tokens == session.tokens


def test_scheduler_packs_new_prompts_and_keeps_greedy_outputs(tiny):
    """Generations joining between steps (plain, prompt lookup, a layer draft that reads the target's
    cache and so is prefilled at once): each greedy output equals its solo run; steps that fed a prompt
    are not taken as measures of verification cost."""
    from speculum.decoding.scheduler import Scheduler
    from speculum.models import PromptLookup

    draft = truncated_draft(tiny, 1)
    requests = [([3, 4, 5, 3, 4], dict(draft=PromptLookup(), gamma=3)), ([6, 7], {}),
                ([8, 9, 10, 11], dict(draft=draft, gamma=2)), ([12, 13, 12, 13, 12], dict(draft=PromptLookup()))]
    scheduler = Scheduler(tiny)
    assert scheduler.defer_prefill
    observed: list[int] = []
    real_observe = scheduler.packed_cost.observe
    scheduler.packed_cost.observe = lambda tokens, seconds: observed.append(tokens) or real_observe(tokens, seconds)
    out: dict[int, list[int]] = {}
    order: list[int] = []
    timed_steps = 0

    def step() -> None:
        nonlocal timed_steps
        decoders = list(scheduler.decoders.values())
        if sum(1 for d in decoders if d.pending) > 1 and not any(d.prefilling for d in decoders):
            timed_steps += 1
        for ident, chunk in scheduler.step():
            out.setdefault(ident, []).extend(chunk.tokens)

    for prompt, arguments in requests:           # one joins before each of the first steps
        request = scheduler.add(prompt, max_new_tokens=15, temperature=0, eos_token_id=None, **arguments)
        order.append(request)
        assert scheduler.decoders[request].prefilling == (arguments.get("draft") is not draft)
        step()
    while scheduler.active:
        step()
    for request, (prompt, arguments) in zip(order, requests):
        assert out[request] == speculum.generate(tiny, prompt, max_new_tokens=15, temperature=0,
                                                 eos_token_id=None).tokens
    assert 0 < len(observed) == timed_steps      # the cost model learnt from the steps without a prompt only


def test_a_cancelled_generation_gives_its_slot_back(tiny):
    """A generation cancelled mid-run (a client gone) frees its slot at once; the last one frees the store."""
    from speculum.decoding.scheduler import Scheduler

    scheduler = Scheduler(tiny)
    requests = [scheduler.add(p, max_new_tokens=30, temperature=0, eos_token_id=None) for p in ([3, 4], [5, 6, 7], [8, 9])]
    for _ in range(3):
        scheduler.step()
    arena = tiny.kv_store
    assert arena.in_use == 3
    scheduler.cancel(requests[1])
    assert arena.in_use == 2
    scheduler.close()
    assert arena.in_use == 0 and arena.keys == []


def test_a_long_prompt_is_fed_in_parts_across_packed_forwards(tiny):
    """A feed's prompt_limit feeds part of a deferred prompt (no rows) beside other sessions' blocks; the
    session then answers as a prefilled one. The parallel form (prompt_limits) is the same call. Bad limits
    are refused in either form."""
    prompt = [3, 4, 5, 6, 7, 8, 9, 10, 11]
    long, running = tiny.start_deferred(prompt), tiny.start([12, 13])
    solo_long, solo_running = tiny.start(prompt), tiny.start([12, 13])
    for limit, block in ((4, [14]), (3, [15])):
        got = tiny.extend_sessions([Feed(long, [], limit), Feed(running, block)])
        assert got[0].shape == (0, tiny.vocab_size) and np.abs(got[1] - solo_running.extend(block)).max() < 1e-4
    assert long.unfed == 2 and long.tokens == prompt
    rows = tiny.extend_sessions([long, running], [[16], [17]], [5, None])   # the rest fits: fed with the block
    assert long.unfed == 0 and np.abs(rows[0] - solo_long.extend([16])).max() < 1e-4
    with pytest.raises(InputError, match="prompt_limits"):
        tiny.extend_sessions([running], [[1]], [0])
    with pytest.raises(InputError, match=r"feeds\[0\]\.prompt_limit"):
        tiny.extend_sessions([Feed(running, [1], 0)])
    with pytest.raises(InputError, match=r"feeds\[1\] must be a Feed"):
        tiny.extend_sessions([Feed(running, [1]), long])
    with pytest.raises(InputError, match="part of its deferred prompt"):
        tiny.extend_sessions([tiny.start_deferred(prompt), running], [[1], [2]], [2, None])


def test_scheduler_feeds_long_prompts_in_parts_and_running_generations_never_wait(tiny):
    """With 4 prompt tokens per step, prompts of 9-14 tokens join two running generations: those emit at
    every step, the new ones start once their prompt is in, and every greedy output is its solo one."""
    from speculum.decoding.scheduler import Scheduler

    scheduler = Scheduler(tiny, prompt_tokens_per_step=4)
    running = {scheduler.add(p, max_new_tokens=24, temperature=0, eos_token_id=None): p for p in ([3, 4], [5])}
    out: dict[int, list[int]] = {request: [] for request in running}
    for request, chunk in scheduler.step():
        out[request].extend(chunk.tokens)
    long_prompts = [[6 + i % 15 for i in range(9)], [7 + i % 13 for i in range(14)]]
    joined = {scheduler.add(p, max_new_tokens=6, temperature=0, eos_token_id=None): p for p in long_prompts}
    out.update({request: [] for request in joined})
    first_emission: dict[int, int] = {}
    for step in range(1, 7):
        emitted = {request: chunk.tokens for request, chunk in scheduler.step()}
        assert all(emitted.get(request) for request in running)        # never stalled by the prompts
        for request, tokens in emitted.items():
            out[request].extend(tokens)
            if request in joined and tokens:
                first_emission.setdefault(request, step)
    # Deferred prompts of 8 and 13 tokens (each one's last is fed with its first block), 4 per step, oldest
    # first: the first in steps 1-2 (emitting at 2), the second in steps 3-6.
    assert sorted(first_emission.values()) == [2, 6]
    while scheduler.active:
        for request, chunk in scheduler.step():
            out[request].extend(chunk.tokens)
    for request, prompt in {**running, **joined}.items():
        assert out[request] == speculum.generate(tiny, prompt, max_new_tokens=len(out[request]), temperature=0,
                                                 eos_token_id=None).tokens
    with pytest.raises(ValueError, match="prompt_tokens_per_step"):
        Scheduler(tiny, prompt_tokens_per_step=0)
