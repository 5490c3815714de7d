"""Many generations at once (:class:`speculum.decoding.scheduler.Scheduler`).

Invariants: each generation's output is the one it gets alone — greedy tokens identical to plain greedy
decoding, a seeded sample identical to ``speculum.stream`` with that seed — whatever else runs and
whenever it joins; its law is exactly the target's under batching (chi-square); a target that declares
``batched_extend`` is called once per step with every active generation.
"""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import speculum
from speculum.decoding.scheduler import Scheduler
from speculum.models import MarkovModel, PromptLookup
from speculum.models.base import Capabilities
from speculum.validation import InputError

from support.laws import DRAFT, LEVEL, RESET, TARGET, block_law_pvalue, exact_block_law, required_blocks

VOCAB = 12


def run(scheduler: Scheduler, joins: dict[int, list[tuple[list[int], dict]]]) -> dict[int, list[int]]:
    """Step until done; ``joins[step]`` are generations (prompt, arguments) added before that step."""
    tokens: dict[int, list[int]] = {}
    step = 0
    while scheduler.active or any(s >= step for s in joins):
        for prompt, arguments in joins.get(step, []):
            tokens[scheduler.add(prompt, **arguments)] = []
        for request, chunk in scheduler.step():
            tokens[request].extend(chunk.tokens)
        step += 1
    return tokens


DRAFTS = {"none": None, "lookup": PromptLookup(), "model": MarkovModel.random(VOCAB, seed=8)}


@pytest.mark.parametrize("draft", DRAFTS.values(), ids=DRAFTS.keys())
def test_greedy_under_batching_is_plain_greedy_decoding(draft):
    target = MarkovModel.random(VOCAB, seed=7, eos_token_id=11)
    prompts = [[0, 1, 2, 0, 1], [3], [4, 4, 4, 4], [5, 6], [7, 8, 9, 7, 8, 9], [10]]
    lengths = [30, 5, 17, 1, 40, 23]
    joins = {0: [], 2: [], 5: []}
    for i, (prompt, length) in enumerate(zip(prompts, lengths)):
        joins[(0, 2, 5)[i % 3]].append((prompt, dict(draft=draft, max_new_tokens=length, temperature=0, gamma=3)))
    out = run(Scheduler(target), joins)
    order = [p for step in (0, 2, 5) for p, _ in joins[step]]
    for request, prompt in enumerate(order):
        length = lengths[prompts.index(prompt)]
        assert out[request] == speculum.generate(target, prompt, max_new_tokens=length, temperature=0).tokens


def test_generations_sharing_a_prompt_lookup_each_index_their_own_context():
    """One PromptLookup passed to every generation of a batch: each generation proposes from an index of its
    own (``per_generation``), so the shared object never takes turns re-indexing their contexts."""
    target = MarkovModel.random(VOCAB, seed=7)
    shared = PromptLookup()
    joins = {0: [(prompt, dict(draft=shared, max_new_tokens=20, temperature=0, gamma=3))
                 for prompt in ([0, 1, 2, 0, 1], [3, 4, 3, 4], [5, 6, 5])]}
    out = run(Scheduler(target), joins)
    assert shared.indexed == 0
    for request, (prompt, _) in enumerate(joins[0]):
        assert out[request] == speculum.generate(target, prompt, max_new_tokens=20, temperature=0).tokens


@pytest.mark.parametrize("draft", DRAFTS.values(), ids=DRAFTS.keys())
def test_a_seeded_generation_does_not_depend_on_the_batch(draft):
    target = MarkovModel.random(VOCAB, seed=7)
    arguments = dict(draft=draft, max_new_tokens=25, temperature=0.8, top_p=0.9, gamma="auto")
    alone = speculum.generate(target, [1, 2, 3], seed=42, **arguments).tokens
    joins = {0: [([4, 5], dict(arguments, seed=1)), ([1, 2, 3], dict(arguments, seed=42))],
             3: [([6], dict(arguments, seed=2, max_new_tokens=60))]}
    assert run(Scheduler(target), joins)[1] == alone


def test_the_law_under_batching_is_the_targets():
    """One long sampled generation shares every step with two others; its block law is exact (top-k 2
    keeps the support, hence the sample, small)."""
    warp = dict(temperature=1.5, top_k=2)
    law = exact_block_law(TARGET, 1.5, 2, None)
    n_blocks = required_blocks(max(int((law > 0).sum()) - 1, 1))
    others = dict(draft=DRAFT, gamma=2, max_new_tokens=8 * n_blocks, seed=5, temperature=0.9)
    joins = {0: [([RESET], dict(draft=DRAFT, gamma=3, max_new_tokens=4 * n_blocks, seed=0, **warp)),
                 ([RESET], others)],
             10: [([RESET], dict(others, seed=6, max_new_tokens=40))]}
    tokens = run(Scheduler(TARGET), joins)[0]
    pvalue = block_law_pvalue(tokens, law, n_blocks)
    assert pvalue > LEVEL, f"the law under batching differs from the target's (p = {pvalue:.2e})"


class BatchedMarkov(MarkovModel):
    """Declares ``batched_extend``; records how many sessions each call verifies."""

    capabilities = Capabilities(batched_extend=True)

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.calls: list[int] = []

    def extend_sessions(self, feeds):
        self.calls.append(len(feeds))
        return [feed.session.extend(feed.tokens) for feed in feeds]


def test_a_batched_target_verifies_every_generation_in_one_call():
    base = MarkovModel.random(VOCAB, seed=7)
    target = BatchedMarkov(base.transition_logprobs, base.initial_logprobs)
    joins = {0: [([1], dict(max_new_tokens=10, temperature=0, draft=DRAFTS["model"], gamma=2)),
                 ([2, 3], dict(max_new_tokens=4, temperature=0))]}
    out = run(Scheduler(target), joins)
    assert out[0] == speculum.generate(base, [1], max_new_tokens=10, temperature=0).tokens
    assert out[1] == speculum.generate(base, [2, 3], max_new_tokens=4, temperature=0).tokens
    assert target.calls[0] == 2 and all(n in (2,) for n in target.calls)   # a lone generation: a plain extend


def test_cancel_and_zero_budget():
    target = MarkovModel.random(VOCAB, seed=7)
    scheduler = Scheduler(target)
    keep = scheduler.add([1], max_new_tokens=6, temperature=0)
    drop = scheduler.add([2], max_new_tokens=100, temperature=0)
    empty = scheduler.add([3], max_new_tokens=0)
    first = dict(scheduler.step())
    assert first[empty].finished and first[empty].tokens == []
    scheduler.cancel(drop)
    emitted = len(first[keep].tokens)
    while scheduler.active:
        for request, chunk in scheduler.step():
            assert request == keep
            emitted += len(chunk.tokens)
    assert emitted == 6


def test_generation_arguments_are_checked_when_added():
    scheduler = Scheduler(MarkovModel.random(VOCAB, seed=7))
    with pytest.raises(speculum.InputError):
        scheduler.add([VOCAB + 1], max_new_tokens=3)
    with pytest.raises(speculum.InputError):
        scheduler.add([1], temperature=float("nan"))
    assert scheduler.active == 0
    np.testing.assert_equal(scheduler.step(), [])


@pytest.mark.parametrize("module", ["speculum.decoding.scheduler", "speculum.decoding.generation",
                                    "speculum.decoding.text"])
def test_docstring_examples_run(module):
    import doctest
    import importlib

    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0


def test_a_target_with_one_shared_state_runs_one_generation_at_a_time():
    """llama.cpp's backend declares independent_sessions=False: the engine and generate_batch then run
    one generation at a time (never interleaving sessions that would re-evaluate each other)."""
    from speculum.serving import Engine

    class Shared(MarkovModel):
        capabilities = Capabilities(independent_sessions=False)

    base = MarkovModel.random(VOCAB, seed=7)
    target = Shared(base.transition_logprobs, base.initial_logprobs)
    assert Scheduler(target).capacity == 1
    engine = Engine(target, decode=str, max_batch=8)
    try:
        assert engine.max_batch == 1
    finally:
        engine.close()
    results = speculum.generate_batch(target, [[1], [2], [3]], max_new_tokens=5, temperature=0, max_batch=8)
    assert [r.tokens for r in results] == [speculum.generate(base, [p], max_new_tokens=5, temperature=0).tokens
                                           for p in (1, 2, 3)]


def test_packed_cost_charges_each_block_what_it_adds():
    from speculum.decoding.scheduler import PackedCost

    cost = PackedCost()
    cost.observe(10, 0.5)
    assert cost.fit() is None and cost.split([2, 8], 1.0) == [0.5, 0.5]       # one batch size: even split
    rng = np.random.default_rng(0)
    for tokens in rng.integers(2, 64, size=200):
        cost.observe(int(tokens), 0.02 + 0.003 * tokens * (1 + 0.01 * rng.normal()))
    fixed, per_token = cost.fit()
    assert abs(fixed - 0.02) < 0.005 and abs(per_token - 0.003) < 0.0003
    parts = cost.split([1, 1, 30], 0.2)
    assert abs(sum(parts) - 0.2) < 1e-12 and parts[0] == parts[1] < parts[2]


# ---------------------------------------------------------------------- a reference model's batched extend
def tiny(seed: int = 4):
    from speculum.models import TinyTransformer

    return TinyTransformer(VOCAB, d_model=32, n_layers=2, seed=seed)


def extend_both_ways(model, shapes: list[tuple[int, int]], seed: int, rounds: int = 2):
    """Twin sessions over random prompts of ``shapes[i][0]`` tokens; each round extends one twin of each by
    its own ``extend`` and the other twins in one ``extend_sessions`` call, by random blocks of
    ``shapes[i][1]`` tokens: yields (own rows, batched rows, own sessions, batched sessions)."""
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, VOCAB, size=p).tolist() for p, _ in shapes]
    solo, batched = [model.start(p) for p in prompts], [model.start(p) for p in prompts]
    for _ in range(rounds):
        blocks = [rng.integers(0, VOCAB, size=b).tolist() for _, b in shapes]
        want = [session.extend(block) for session, block in zip(solo, blocks)]
        yield want, model.extend_sessions(batched, blocks), solo, batched


@given(st.lists(st.tuples(st.integers(1, 6), st.integers(0, 5)), min_size=1, max_size=5), st.integers(0, 10**6))
@settings(max_examples=25, deadline=None)
def test_tiny_transformer_extend_sessions_equals_each_sessions_own_extend(shapes, seed):
    """Ragged prompts and blocks (empty ones too), twice in a row: every row equals the session's own extend
    to float64 rounding, and the sessions end where their own extends leave them."""
    for want, got, solo, batched in extend_both_ways(tiny(), shapes, seed):
        for w, g in zip(want, got):
            assert w.shape == g.shape and np.allclose(w, g, rtol=0, atol=1e-12)
        assert [s.length for s in batched] == [s.length for s in solo]
        assert all(np.allclose(a.next_logprobs(), b.next_logprobs(), rtol=0, atol=1e-12)
                   for a, b in zip(solo, batched) if a.length)


def test_tiny_transformer_target_batched_greedy_equals_solo():
    """The scheduler verifies a TinyTransformer target's blocks in one forward; greedy output per request is
    plain greedy decoding's, with a draft model, prompt lookup and no draft side by side."""
    target = tiny()
    assert target.capabilities.batched_extend
    requests = [([1, 2], dict(max_new_tokens=12, temperature=0, draft=tiny(9), gamma=3)),
                ([3], dict(max_new_tokens=9, temperature=0, draft=PromptLookup())),
                ([4, 5, 6], dict(max_new_tokens=7, temperature=0))]
    out = run(Scheduler(target), {0: requests})
    for got, (prompt, _) in zip(out.values(), requests):
        assert got == speculum.generate(target, prompt, max_new_tokens=len(got), temperature=0).tokens


def test_tiny_transformer_extend_sessions_checks_its_input():
    model = tiny()
    session = model.start([1])
    with pytest.raises(InputError, match="token_lists"):
        model.extend_sessions([session], [[VOCAB]])
    with pytest.raises(InputError, match="not a session of this model"):
        model.extend_sessions([tiny(5).start([1])], [[2]])
    with pytest.raises(InputError, match="twice"):
        model.extend_sessions([session, session], [[1], [2]])
    with pytest.raises(InputError, match="sessions"):
        model.extend_sessions([session], [[1], [2]])


@given(st.lists(st.tuples(st.integers(0, 4), st.integers(0, 5)), min_size=1, max_size=5),
       st.sampled_from([1, 2]), st.integers(0, 10**6))
@settings(max_examples=25, deadline=None)
def test_markov_extend_sessions_equals_each_sessions_own_extend(shapes, order, seed):
    """The chain's batched extend (one gather over every block) gives bitwise the rows of each session's own
    extend, for both orders, ragged and empty prompts and blocks, twice in a row."""
    model = MarkovModel.random(VOCAB, order=order, seed=seed % 97)
    for want, got, solo, batched in extend_both_ways(model, shapes, seed):
        assert all(w.shape == g.shape and np.array_equal(w, g) for w, g in zip(want, got))
        assert [s.tokens for s in batched] == [s.tokens for s in solo]


def test_markov_extend_sessions_checks_its_input():
    model = MarkovModel.random(VOCAB, seed=1)
    session = model.start([1])
    assert model.capabilities.batched_extend
    with pytest.raises(InputError, match="token_lists"):
        model.extend_sessions([session], [[VOCAB]])
    with pytest.raises(InputError, match="not a session of this model"):
        model.extend_sessions([MarkovModel.random(VOCAB, seed=2).start([1])], [[2]])
    with pytest.raises(InputError, match="twice"):
        model.extend_sessions([session, session], [[1], [2]])
    with pytest.raises(InputError, match="sessions"):
        model.extend_sessions([session], [[1], [2]])


@pytest.mark.parametrize("bos", [None, 0])
def test_one_token_prompt_is_conditioned_on_that_token_alone(bos):
    """Greedy decoding from a one-token prompt follows the model's own rows after exactly that token (never
    after BOS + token), alone and in the scheduler, on a model that needs a context."""
    from speculum.models import TinyTransformer

    model = TinyTransformer(VOCAB, d_model=32, n_layers=2, seed=6, bos_token_id=bos)
    for first in (3, 5, 9):
        context = [first]
        for _ in range(6):
            context.append(int(np.argmax(model.next_logprobs([context])[0])))
        assert speculum.generate(model, [first], max_new_tokens=6, temperature=0).tokens == context[1:]
        assert speculum.generate_batch(model, [[first], [first, 2]], max_new_tokens=6, temperature=0)[0].tokens \
            == context[1:]


class _TimedTarget:
    """A reference target whose forwards take ``fixed + per_token · tokens`` seconds (sleeps): a batched
    forward whose cost is the weights' read (fixed) or the tokens' arithmetic (per token)."""

    @staticmethod
    def make(fixed: float, per_token: float):
        import time

        from speculum.models import TinyTransformer

        class Timed(TinyTransformer):
            def start(self, prompt):
                session = super().start(prompt)
                extend = session.extend

                def timed_extend(tokens):
                    time.sleep(fixed + per_token * len(tokens))
                    return extend(tokens)

                session.extend = timed_extend
                return session

            def extend_sessions(self, feeds):
                time.sleep(fixed + per_token * sum(len(feed.tokens) for feed in feeds))
                return super().extend_sessions(feeds)

        return Timed(VOCAB, d_model=32, n_layers=2, seed=4)


@pytest.mark.parametrize("fixed, per_token, drafts", [(0.03, 0.0001, True), (0.0, 0.002, False)],
                         ids=["fixed-cost forward: drafting pays", "per-token cost: drafting cannot pay"])
def test_auto_gamma_drafts_only_while_a_batched_forward_makes_draft_tokens_cheap(fixed, per_token, drafts):
    """``gamma="auto"`` with a draft model whose proposals are always accepted (the target's own weights),
    four generations per step: it keeps drafting while a packed forward costs the same whatever its tokens
    (a small batch on a memory-bound machine), and turns drafting off when every token fed costs as much
    (a large batch on a compute-bound one), where verifying proposals would cost more than plain steps."""
    from speculum.models import TinyTransformer

    target = _TimedTarget.make(fixed, per_token)
    draft = TinyTransformer(VOCAB, d_model=32, n_layers=2, seed=4)
    scheduler = Scheduler(target)
    for i in range(4):
        scheduler.add([1 + i, 2, 3, 4], draft=draft, gamma="auto", temperature=0, max_new_tokens=80)
    proposed = []
    while scheduler.active:
        chunks = [chunk for _, chunk in scheduler.step()]
        proposed.append(sum(chunk.proposed for chunk in chunks) / len(chunks))
    later = float(np.mean(proposed[len(proposed) // 2:]))
    assert (later > 1.5) if drafts else (later < 0.5), proposed


def test_each_generation_weighs_its_block_at_the_batch_size_of_the_step():
    """Once the packed forwards' costs are fitted, each generation's plain step costs its share of the step's
    packed forward: the fitted fixed cost over the blocks that run, plus one token's cost, so that drafting is
    judged at the batch's current size as generations leave."""
    from speculum.models import TinyTransformer

    target = _TimedTarget.make(0.004, 0.0005)
    draft = TinyTransformer(VOCAB, d_model=32, n_layers=2, seed=4)
    scheduler = Scheduler(target)
    for i in range(3):
        scheduler.add([1 + i, 2, 3, 4], draft=draft, gamma="auto", temperature=0, max_new_tokens=10 + 20 * i)
    sizes = set()
    while scheduler.active:
        fitted, blocks = scheduler.packed_cost.fit(), len(scheduler.decoders)
        scheduler.step()
        if fitted is None:
            continue
        share = fitted[0] / blocks + fitted[1]
        for decoder in scheduler.decoders.values():
            assert abs(decoder.policy.step_seconds() - share) <= 1e-9 * share
            sizes.add(blocks)
    assert len(sizes) >= 2, sizes
