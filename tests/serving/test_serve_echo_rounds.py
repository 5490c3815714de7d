"""Echo scoring in rounds: a long prompt's scoring is interleaved with the generations' steps (a short
generation ends while it is still being scored), a cancelled scoring stops at the next round and is counted
as a cancelled request, and the answer is bitwise the same however the prompt was cut into rounds.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

pytest.importorskip("fastapi")

from speculum.models import MarkovModel  # noqa: E402
from speculum.serving import Engine, GenerationRequest  # noqa: E402
from speculum.serving.engine import SCORING_SHARE  # noqa: E402
from speculum.serving.rounds import (IDLE_ROUND_SECONDS, MIN_ROUND_TOKENS, MIN_SHARE_TOKENS, RoundCosts,  # noqa: E402
                                     STOPPABLE_ROUND_SECONDS, next_idle_seconds, round_budget)
from speculum.models.prompt_scores import DEFAULT_CHUNK, PromptScorer, _shares, likeliest, likeliest_rows  # noqa: E402

from support.serving import decode  # noqa: E402
from support.serving import same  # noqa: E402

LONG = 4000                  # prompt tokens: over a hundred rounds of the scorer's chunk


class SlowChain(MarkovModel):
    """A first-order chain whose sessions take a moment per forward, as a real model's do."""

    def start(self, prompt):
        session = super().start(prompt)
        extend = session.extend

        def slow_extend(tokens):
            time.sleep(0.001)
            return extend(tokens)

        session.extend = slow_extend
        return session


def slow_chain() -> SlowChain:
    base = MarkovModel.random(8, seed=3, scale=2.0)
    return SlowChain(base.transition_logprobs, base.initial_logprobs, eos_token_id=None)


def long_prompt(seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, 7, LONG).tolist()


def wait_until(condition, seconds: float = 20) -> None:
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.005)


def test_a_short_generation_ends_while_a_long_echo_is_still_scored():
    engine = Engine(slow_chain(), decode=decode)
    try:
        scoring = engine.score(long_prompt(), top=5)
        wait_until(lambda: engine.scorer.forwards > 0)
        generation = engine.submit(GenerationRequest([1, 2], max_tokens=4, temperature=0.0))
        assert [d.finish_reason for d in generation][-1] == "length"
        assert not scoring.done                      # the generation did not wait for the whole prompt
        scores = scoring.result(timeout=60)
    finally:
        engine.close()
    assert same(scores, PromptScorer(slow_chain()).score(long_prompt(), top=5))


def test_a_cancelled_echo_stops_at_the_next_round_and_counts_as_cancelled():
    engine = Engine(slow_chain(), decode=decode)
    try:
        scoring = engine.score(long_prompt(), top=5)
        wait_until(lambda: engine.scorer.forwards > 2)
        scoring.cancel(disconnected=True)
        wait_until(lambda: scoring.done)
        fed_then = engine.scorer.forwarded_tokens
        assert fed_then < LONG // 2
        time.sleep(0.05)
        assert engine.scorer.forwarded_tokens == fed_then     # nothing more fed for it
        wait_until(lambda: engine.admitted == 0)
        assert (engine.metrics.requests_cancelled, engine.metrics.requests_disconnected) == (1, 1)
        with pytest.raises(Exception, match="cancelled"):
            scoring.result(timeout=1)
        # The worker is free: the next request is served at once.
        job = engine.submit(GenerationRequest([1, 2], max_tokens=2, temperature=0.0))
        assert [d.finish_reason for d in job][-1] == "length"
    finally:
        engine.close()


def test_interleaved_scoring_rounds_answer_each_prompt_as_alone():
    """Prompts started at different rounds of one scorer, each bitwise its answer from a fresh scorer."""
    target = MarkovModel.random(8, seed=5, scale=2.0)
    rng = np.random.default_rng(1)
    prompts = [rng.integers(0, 8, int(n)).tolist() for n in rng.integers(1, 200, 6)]
    scorer = PromptScorer(target, chunk=7)
    works, pending = [], list(prompts)
    while pending or scorer.busy:
        if pending:
            works.append(scorer.start(pending.pop(0), top=3))
        scorer.advance()
    for prompt, work in zip(prompts, works):
        assert same(scorer.scores(work), PromptScorer(target, chunk=7).score(prompt, top=3))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    pytest.importorskip("transformers")
    from support.hf_tiny import save_tiny_model
    from speculum.models.hf import HFModel

    return HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("rounds") / "tiny", max_context=1024))


@pytest.mark.parametrize("length,chunk", [(40, 1), (40, 3), pytest.param(300, 7, marks=pytest.mark.slow),
                                          pytest.param(1000, DEFAULT_CHUNK, marks=pytest.mark.slow)])
def test_a_row_canonical_model_scores_bitwise_the_same_in_any_chunking(tiny_llama, length, chunk):
    """The PyTorch fused forward is row-canonical: a prompt scored in rounds of ``chunk`` tokens gets the
    rows it gets scored in one forward, bit for bit (long prompts against short chunks included)."""
    if not tiny_llama.capabilities.canonical_rows:
        pytest.skip("this model's forward is not row-canonical here")
    prompt = np.random.default_rng(length).integers(3, tiny_llama.vocab_size, length).tolist()
    whole = PromptScorer(tiny_llama, chunk=length).score(prompt, top=5)
    assert same(PromptScorer(tiny_llama, chunk=chunk).score(prompt, top=5), whole)


def test_scoring_never_runs_between_two_steps_for_longer_than_its_share_of_the_step_before():
    """While generations run, the worker spends at most SCORING_SHARE of its generating time scoring (plus
    one round)."""
    engine = Engine(slow_chain(), decode=decode, background=False)
    spent = {"generate": 0.0, "score": 0.0, "rounds": 0, "longest": 0.0}
    generate, score_round = engine._generate, engine._score_round

    def timed_generate():
        took = generate()
        spent["generate"] += took
        return took

    def timed_round(*budget):
        took = score_round(*budget)
        spent["score"] += took
        spent["rounds"] += 1
        spent["longest"] = max(spent["longest"], took)
        return took

    engine._generate, engine._score_round = timed_generate, timed_round
    scoring = engine.score(long_prompt(), top=0)
    generation = engine.submit(GenerationRequest([1, 2], max_tokens=200, temperature=0.0))
    worker = threading.Thread(target=engine.run)
    worker.start()
    try:
        assert [d.finish_reason for d in generation][-1] == "length"
        generated, scored = spent["generate"], spent["score"]
    finally:
        engine.close()
        worker.join(10)
    assert spent["rounds"] > 0 and scored <= SCORING_SHARE * generated + spent["longest"]
    del scoring


def reference_scores(model, prompt: list[int], top: int):
    """A prompt's scores the plain way: one session, every row from one forward of the whole prompt, each
    position's alternatives by :func:`likeliest` row by row."""
    session = model.start(prompt[:1])
    rows = np.vstack([np.asarray(session.next_logprobs())[None], *(
        [np.asarray(session.extend(prompt[1:]))] if len(prompt) > 1 else [])])
    logprobs = (None, *(float(rows[i - 1][prompt[i]]) for i in range(1, len(prompt))))
    tops = ((),) + tuple(tuple((int(t), float(rows[i - 1][t])) for t in likeliest(rows[i - 1], top))
                         for i in range(1, len(prompt)))
    return tuple(prompt), logprobs, tops, rows[-1]


def equals_reference(scores, reference) -> bool:
    tokens, logprobs, tops, last = reference
    return (scores.tokens == tokens and scores.logprobs == logprobs and scores.top == tops
            and np.array_equal(scores.next_logprobs, last))


@pytest.mark.parametrize("k", [1, 5, 20])
def test_likeliest_rows_equals_likeliest_row_by_row_ties_and_impossible_tokens_included(k):
    rng = np.random.default_rng(k)
    rows = rng.standard_normal((12, 300))
    rows[1] = np.round(rows[1] * 2)                       # ties everywhere, at the boundary too
    rows[2, 5:] = -np.inf                                 # fewer possible tokens than k
    rows[3, k:] = -np.inf                                 # exactly k
    rows[4] = 0.0                                         # all tied
    rows[5, :k + 3] = rows[5].max() + 1.0                 # k + 3 tied for first place
    for row, ids in zip(rows, likeliest_rows(rows, k)):
        assert list(ids) == list(likeliest(row, k))


def test_a_row_canonical_model_resumes_at_the_shared_length_and_answers_as_the_reference(tiny_llama):
    """On a row-canonical model a prompt resumes where it parts from a resident one (not at a chunk cut),
    rounds are sized by a budget, prompts in one state share what they have in common: every answer is
    bitwise the reference's (one forward of the whole prompt, each row's alternatives found alone)."""
    if not tiny_llama.capabilities.canonical_rows:
        pytest.skip("this model's forward is not row-canonical here")
    rng = np.random.default_rng(7)
    context = rng.integers(3, tiny_llama.vocab_size, 45).tolist()
    prompts = [context + rng.integers(3, tiny_llama.vocab_size, int(n)).tolist() for n in (1, 4, 9, 4)]
    prompts += [context[:20], context[:45] + prompts[1][45:47]]
    scorer = PromptScorer(tiny_llama, chunk=16)
    first = scorer.score(prompts[0], top=5)
    assert equals_reference(first, reference_scores(tiny_llama, prompts[0], 5))
    again = scorer.score(prompts[1], top=5)
    assert again.forwarded == len(prompts[1]) - len(context) + 1           # from the shared length on
    for budget, round_cost in ((1, 0), (7, 0), (200, 0), (7, 30), (200, 1000)):
        works = [scorer.start(prompt, top=3) for prompt in prompts]
        while scorer.busy:
            scorer.advance(budget, round_cost=round_cost)
        for prompt, work in zip(prompts, works):
            assert equals_reference(scorer.scores(work), reference_scores(tiny_llama, prompt, 3))


def test_prompts_in_one_state_feed_what_they_share_once(tiny_llama):
    if not tiny_llama.capabilities.canonical_rows:
        pytest.skip("this model's forward is not row-canonical here")
    rng = np.random.default_rng(8)
    context = rng.integers(3, tiny_llama.vocab_size, 40).tolist()
    prompts = [context + [int(t)] for t in rng.integers(3, tiny_llama.vocab_size, 4)]
    scorer = PromptScorer(tiny_llama, chunk=16, max_tokens=0)
    for prompt in prompts:
        scorer.start(prompt)
    scorer.advance(1000)
    assert scorer.forwarded_tokens == len(context)            # the context once, up to where they part
    while scorer.busy:
        scorer.advance(1000)
    assert scorer.forwarded_tokens == len(context) + len(prompts)


def test_a_short_common_part_is_fed_again_rather_than_cost_a_round(tiny_llama):
    """Where what prompts in one state share saves fewer tokens than a round costs, each feeds it itself:
    one round instead of two, and the same answers."""
    if not tiny_llama.capabilities.canonical_rows:
        pytest.skip("this model's forward is not row-canonical here")
    rng = np.random.default_rng(9)
    context = rng.integers(3, tiny_llama.vocab_size, 3).tolist()
    prompts = [context + rng.integers(3, tiny_llama.vocab_size, 5).tolist() for _ in range(4)]
    for round_cost, rounds, fed in ((0, 2, 3 + 4 * 5), (40, 1, 4 * 8)):
        scorer = PromptScorer(tiny_llama, chunk=16, max_tokens=0)
        works = [scorer.start(prompt, top=2) for prompt in prompts]
        count = 0
        while scorer.busy:
            scorer.advance(1000, round_cost=round_cost)
            count += 1
        assert (count, scorer.forwarded_tokens) == (rounds, fed)
        for prompt, work in zip(prompts, works):
            assert equals_reference(scorer.scores(work), reference_scores(tiny_llama, prompt, 2))


@given(needs=st.lists(st.integers(1, 60), min_size=1, max_size=12), budget=st.integers(1, 300))
def test_shares_fill_the_budget_fairly(needs, budget):
    """Each prompt gets at least one token and at most what it needs; the budget is spent where prompts
    need it (no more than one token each beyond it); a prompt cut short got no less than any other."""
    shares = _shares(needs, budget)
    assert all(1 <= share <= need for share, need in zip(shares, needs))
    assert sum(shares) <= max(budget, len(needs))
    short = [share for share, need in zip(shares, needs) if share < need]
    if short:
        assert sum(shares) >= min(budget, sum(needs)) - len(needs)
        assert min(short) == max(shares)


def test_rounds_are_sized_by_the_time_they_have():
    """A round feeds what fits its time on the last rounds' costs: IDLE_ROUND_SECONDS with nothing else
    running (and MIN_SHARE_TOKENS a prompt), the generations' last step (the credit) while they run, never
    fewer than MIN_ROUND_TOKENS."""
    costs = RoundCosts()
    assert round_budget(costs, prompts=0, credit=None) is None         # no round timed yet: a chunk a prompt
    costs.add(100, 0.05)                                                # one size seen: 0.5 ms a token, no fixed part
    assert round_budget(costs, prompts=0, credit=None) == int(IDLE_ROUND_SECONDS / 0.0005)
    # ten prompts, nothing generating: a share each
    assert round_budget(costs, prompts=10, credit=None) == 10 * MIN_SHARE_TOKENS > int(IDLE_ROUND_SECONDS / 0.0005)
    assert round_budget(costs, prompts=10, credit=0.02) == 40           # generations running: the credit
    # a target whose rounds stop for an arriving generation: longer idle rounds, the same credit
    assert round_budget(costs, prompts=1, credit=None, idle_seconds=STOPPABLE_ROUND_SECONDS) == int(
        STOPPABLE_ROUND_SECONDS / 0.0005) > int(IDLE_ROUND_SECONDS / 0.0005)
    assert round_budget(costs, prompts=10, credit=0.02, idle_seconds=STOPPABLE_ROUND_SECONDS) == 40
    assert round_budget(costs, prompts=10, credit=0.0) == MIN_ROUND_TOKENS


@given(st.lists(st.booleans(), max_size=20))
def test_idle_rounds_are_short_after_a_stop_and_grow_back_to_long_ones(stops):
    """After a stopped round the next is IDLE_ROUND_SECONDS long; each round not stopped doubles it, up to
    STOPPABLE_ROUND_SECONDS, which enough rounds in a row reach."""
    seconds = STOPPABLE_ROUND_SECONDS
    for stopped in stops:
        following = next_idle_seconds(seconds, stopped=stopped)
        assert following == (IDLE_ROUND_SECONDS if stopped else min(2 * seconds, STOPPABLE_ROUND_SECONDS))
        assert IDLE_ROUND_SECONDS <= following <= STOPPABLE_ROUND_SECONDS
        seconds = following
    for _ in range(8):
        seconds = next_idle_seconds(seconds, stopped=False)
    assert seconds == STOPPABLE_ROUND_SECONDS


@given(fixed=st.floats(0.0, 0.05), per_token=st.floats(1e-5, 1e-2), sizes=st.lists(st.integers(1, 500), min_size=2,
                                                                                      max_size=16, unique=True))
def test_round_costs_separate_the_fixed_part(fixed, per_token, sizes):
    """Rounds timed on an exact line give back its two parts, and a round of the size they choose fits
    the time it is given: a short round's fixed part never makes the next round shorter."""
    costs = RoundCosts()
    for tokens in sizes:
        costs.add(tokens, fixed + per_token * tokens)
    got_fixed, got_per_token = costs.line()
    assert got_per_token == pytest.approx(per_token, rel=1e-6, abs=1e-12)
    assert got_fixed == pytest.approx(fixed, rel=1e-6, abs=1e-9)
    within = costs.tokens_within(0.1)
    assert fixed + per_token * within <= 0.1 + 1e-9
    assert within == 0 or fixed + per_token * (within + 2) > 0.1


def test_round_costs_escape_the_smallest_round():
    """Rounds all of one small size, each mostly fixed cost, still ask for a larger next round."""
    costs = RoundCosts()
    for _ in range(5):
        costs.add(8, 0.025)
    assert costs.tokens_within(0.06) > 8
    costs.add(costs.tokens_within(0.06), 0.025 + 19 * 0.0001)
    assert costs.tokens_within(0.06) > 100          # the line now shows the round is mostly its fixed part
