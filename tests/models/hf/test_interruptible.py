"""Packed forwards that stop between two layers when their caller asks (``HFModel.interruptible``).

Invariants: a stopped ``extend_rows`` leaves every session as it was (tokens, cache length, each layer's
keys), whatever layer it stopped at and whatever its sessions' caches are (their own, forks, slots of the
store), and the same call made again gives bitwise the rows of a call never stopped; a call that is not
stopped gives the rows it gives outside the context; only ``extend_rows`` stops; a model whose caches
cannot forget a layer's writes (sliding windows) never stops; a stopped scoring round changes nothing in
the scorer; the engine stops an idle scoring round for an arriving generation or a cancelled echo, and
every answer is the one it gets alone.
"""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import speculum  # noqa: E402
from support.hf_tiny import save_tiny_model  # noqa: E402
from support.serving import same  # noqa: E402
from speculum.models.hf import HFModel  # noqa: E402
from speculum.models.interruption import Interrupted  # noqa: E402
from speculum.models.prompt_scores import PromptScorer  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="PyTorch built without oneDNN")

LAYERS = 3
tokens = st.lists(st.integers(min_value=3, max_value=22), min_size=1, max_size=12)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    model = HFModel.from_pretrained(save_tiny_model(tmp_path_factory.mktemp("stop") / "model", layers=LAYERS,
                                                    max_context=512))
    assert model.capabilities.interruptible_rows
    return model


class StopAt:
    """A caller's check that says stop at its ``at``-th call (0: the first layer of the first forward)."""

    def __init__(self, at: int) -> None:
        self.at, self.calls = at, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.calls > self.at


def layer_lengths(session) -> list[int]:
    return [session.cache.view(layer)[0].shape[2] if session.cache.length else 0 for layer in range(LAYERS)]


def sessions_of(model, prompts, kinds):
    """A session per prompt, fed: a cache of its own, a fork of one, or a slot of the model's store."""
    made = []
    for prompt, kind in zip(prompts, kinds):
        session = model.start(prompt)
        if kind == "fork":
            session = session.fork()
        elif kind == "store":
            session.move_cache_into(model.kv_store)
        made.append(session)
    return made


@settings(max_examples=30, deadline=None)
@given(prompts=st.lists(tokens, min_size=1, max_size=3), blocks=st.lists(tokens, min_size=3, max_size=3),
       kinds=st.lists(st.sampled_from(["own", "fork", "store"]), min_size=3, max_size=3),
       at=st.integers(0, LAYERS))
def test_a_stopped_forward_leaves_every_session_as_it_was(tiny, prompts, blocks, kinds, at):
    # Slots of the store take the forward's store path only when every session is one: all or none.
    kinds = kinds[:len(prompts)] if "store" not in kinds[:len(prompts)] else ["store"] * len(prompts)
    blocks = blocks[:len(prompts)]
    want = tiny.extend_rows(sessions_of(tiny, prompts, kinds), blocks)
    sessions = sessions_of(tiny, prompts, kinds)
    before = [(list(s.tokens), s.cache.length, layer_lengths(s)) for s in sessions]
    try:
        with tiny.interruptible(StopAt(at)):
            got = tiny.extend_rows(sessions, blocks)
        assert at >= LAYERS, "a forward went past the layer its caller stopped it at"
    except Interrupted:
        assert [(list(s.tokens), s.cache.length, layer_lengths(s)) for s in sessions] == before
        got = tiny.extend_rows(sessions, blocks)
    for rows, wanted in zip(got, want):
        assert np.array_equal(rows, wanted)


@settings(max_examples=20, deadline=None)
@given(prompts=st.lists(tokens, min_size=1, max_size=3), blocks=st.lists(tokens, min_size=3, max_size=3),
       at=st.integers(0, LAYERS - 1))
def test_the_same_call_after_a_stop_gives_the_rows_of_a_call_never_stopped(tiny, prompts, blocks, at):
    blocks = blocks[:len(prompts)]
    want = tiny.extend_rows([tiny.start_deferred(p) for p in prompts], blocks)
    sessions = [tiny.start_deferred(p) for p in prompts]
    with tiny.interruptible(StopAt(at)), pytest.raises(Interrupted):
        tiny.extend_rows(sessions, blocks)
    assert all(session.unfed == len(prompt) for session, prompt in zip(sessions, prompts))
    for rows, wanted in zip(tiny.extend_rows(sessions, blocks), want):
        assert np.array_equal(rows, wanted)
    again = [s.extend([5, 6]) for s in sessions]          # the caches hold exactly the tokens fed
    fresh = [tiny.start(p + b).extend([5, 6]) for p, b in zip(prompts, blocks)]
    for rows, wanted in zip(again, fresh):
        assert np.array_equal(rows, wanted)


def test_only_extend_rows_stops(tiny):
    """Sessions' own forwards and the scheduler's packed steps run to their end inside the context."""
    outside = [tiny.start([4, 5, 6]).extend([7, 8]),
               tiny.extend_sessions([tiny.start([4, 5]), tiny.start([9])], [[6, 7], [8]])[0]]
    with tiny.interruptible(lambda: True):
        inside = [tiny.start([4, 5, 6]).extend([7, 8]),
                  tiny.extend_sessions([tiny.start([4, 5]), tiny.start([9])], [[6, 7], [8]])[0]]
    for rows, wanted in zip(inside, outside):
        assert np.array_equal(rows, wanted)


def test_a_model_with_sliding_windows_never_stops(tmp_path):
    """A sliding-window layer's cache forgets keys for good: such a model declares nothing and runs on."""
    model = HFModel.from_pretrained(save_tiny_model(tmp_path / "gemma", family="gemma3_text", layers=LAYERS))
    assert not model.capabilities.interruptible_rows
    want = model.extend_rows([model.start_deferred([4, 5, 6])], [[7]])[0]
    with model.interruptible(lambda: True):
        assert np.array_equal(model.extend_rows([model.start_deferred([4, 5, 6])], [[7]])[0], want)


@settings(max_examples=15, deadline=None)
@given(first=tokens, second=tokens, shared=st.integers(0, 12), at=st.integers(0, LAYERS - 1),
       budget=st.integers(1, 30))
def test_a_stopped_scoring_round_changes_nothing(tiny, first, second, shared, at, budget):
    """A prompt resuming a resident one's prefix, scored in rounds of ``budget`` tokens, one of them stopped:
    its answer is bitwise the one a fresh scorer gives."""
    second = first[:shared] + second
    scorer = PromptScorer(tiny)
    scorer.score(first, top=3)
    work = scorer.start(second, top=3)
    scorer.advance(budget)
    if not work.finished:
        with tiny.interruptible(StopAt(at)), pytest.raises(Interrupted):
            scorer.advance(budget)
        assert scorer.busy
    while not work.finished:
        scorer.advance(budget)
    assert same(scorer.scores(work), PromptScorer(tiny).score(second, top=3))


# ------------------------------------------------------------------------------------------- the engine
class Held:
    """``model`` whose stoppable forwards wait at their first layer until the test says ``go``: the engine's
    check then sees what the test did meanwhile (a generation queued, an echo cancelled)."""

    def __init__(self, model) -> None:
        self.model = model
        self.waiting, self.go = threading.Event(), threading.Event()

    def __getattr__(self, name):
        return getattr(self.model, name)

    def interruptible(self, check):
        def held() -> bool:
            self.waiting.set()
            assert self.go.wait(30)
            return check()

        return self.model.interruptible(held)


@pytest.fixture
def engine_on(tiny):
    pytest.importorskip("fastapi")
    from speculum.serving import Engine

    engines = []

    def make(target):
        engines.append(Engine(target, decode=lambda ids: " ".join(map(str, ids))))
        return engines[-1]

    yield make
    for engine in engines:
        engine.close()


def test_an_arriving_generation_stops_the_idle_scoring_round(tiny, engine_on):
    from speculum.serving import GenerationRequest

    held = Held(tiny)
    engine = engine_on(held)
    prompt = np.random.default_rng(0).integers(3, 23, 300).tolist()
    scoring = engine.score(prompt, top=3)
    assert held.waiting.wait(30)
    generation = engine.submit(GenerationRequest([4, 5, 6], max_tokens=6, temperature=0.0))
    held.go.set()
    solo = speculum.generate(tiny, [4, 5, 6], max_new_tokens=6, temperature=0).tokens
    assert "".join(delta.text for delta in generation) == " ".join(map(str, solo))
    assert same(scoring.result(timeout=60), PromptScorer(tiny).score(prompt, top=3))
    assert engine.metrics.scoring_rounds_stopped >= 1


def test_a_cancelled_echo_stops_its_round(tiny, engine_on):
    held = Held(tiny)
    engine = engine_on(held)
    scoring = engine.score(np.random.default_rng(1).integers(3, 23, 300).tolist(), top=0)
    assert held.waiting.wait(30)
    fed = engine.scorer.forwarded_tokens
    scoring.cancel(disconnected=True)
    held.go.set()
    with pytest.raises(Exception, match="cancelled"):
        scoring.result(timeout=30)
    deadline = time.monotonic() + 30
    while engine.admitted:                       # the worker ends the job after the round it stopped
        assert time.monotonic() < deadline, "the cancelled echo was never ended"
        time.sleep(0.005)
    assert engine.metrics.scoring_rounds_stopped == 1 and engine.scorer.forwarded_tokens == fed
    assert (engine.metrics.requests_cancelled, engine.metrics.requests_disconnected) == (1, 1)
