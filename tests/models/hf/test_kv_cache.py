"""The KV caches of the PyTorch backend (speculum.models.hf.kv.cache) and the package's boundaries.

Invariants: a slot of the store and a cache of its own, fed the same appends and trims, return the same
attention views and hold the same keys and values, bit for bit, whatever the other slots do and however
often the store grows; moving a cache into the store and adopting a cache's first layers keep what it
holds; slots come back when caches go, and the store's memory with the last one. No module of the
backend reaches into another object's private members.
"""
from __future__ import annotations

import ast
import doctest
import importlib
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from speculum.models.hf.kv.cache import KVCache, OwnCache, SlotCache  # noqa: E402
from speculum.models.hf.kv.store import KVArena  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM = 2, 2, 3
PACKAGE = Path(__file__).resolve().parents[3] / "src" / "speculum" / "models" / "hf"


def small_store() -> KVArena:
    """A store that starts with one slot of 2 tokens, so that the tests grow it often."""
    return KVArena(layers=LAYERS, kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=torch.float32,
                   first_slots=1, first_capacity=2)


def hold_the_same(one: KVCache, other: KVCache, layers: int = LAYERS) -> bool:
    """Same length and, when they hold anything, bitwise the same views of every layer."""
    if one.length != other.length:
        return False
    return all(torch.equal(a, b) for layer in range(layers if one.length else 0)
               for a, b in zip(one.view(layer), other.view(layer)))


def append_everywhere(caches: tuple, n: int, generator: torch.Generator) -> list:
    """Append the same n random tokens' keys and values to each cache, layer by layer; their returned views."""
    views = []
    for layer in range(LAYERS):
        keys, values = torch.randn(2, 1, KV_HEADS, n, HEAD_DIM, generator=generator)
        views.append([cache.append(keys, values, layer) for cache in caches])
    return views


# ------------------------------------------------------------------------------ the two kinds agree
@given(st.lists(st.tuples(st.integers(0, 2), st.sampled_from(["append", "trim", "renew", "move"]), st.integers(0, 5)),
                max_size=30), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_a_slot_and_a_cache_of_its_own_hold_the_same_under_appends_and_trims(operations, seed):
    """Three sessions' appends, trims, replacements and moves into the store, interleaved on a store that
    starts at one slot of 2 tokens: every append returns the same attention views from both kinds, every
    slot always equals its own-cache twin, and the store frees its buffers as soon as its last session is
    dropped (reference counting: no garbage collection needed)."""
    generator = torch.Generator().manual_seed(seed)
    arena = small_store()
    pairs = [(SlotCache(arena), OwnCache()) for _ in range(3)]
    for which, kind, n in operations:
        slot_cache, own = pairs[which]
        if kind == "append":
            for views in append_everywhere((slot_cache, own), n, generator):
                (slot_keys, slot_values), (own_keys, own_values) = views
                assert torch.equal(slot_keys, own_keys) and torch.equal(slot_values, own_values)
        elif kind == "trim":
            n = min(n, own.length)
            slot_cache.trim(n), own.trim(n)
        elif kind == "move":                   # a cache of its own joins the store: the same keys in a slot
            moved = own.into_store(arena)
            assert moved.store is arena and hold_the_same(moved, own) and slot_cache.into_store(arena) is slot_cache
            pairs[which] = (moved, own)
            slot_cache = moved = None
        else:                                  # the session ends: its slot is free for the next one
            slot_cache = own = pairs[which] = None
            pairs[which] = (SlotCache(arena), OwnCache())
        assert all(hold_the_same(*pair) for pair in pairs)
    assert arena.in_use == 3 and len({cache.slot for cache, _ in pairs}) == 3
    pairs = slot_cache = own = None
    assert arena.in_use == 0 and arena.keys == [] and arena.slots == 0


@given(st.lists(st.integers(1, 4), min_size=1, max_size=4), st.integers(0, 3), st.integers(1, LAYERS),
       st.integers(0, 2**31))
@settings(max_examples=30, deadline=None)
def test_the_first_layers_adopted_from_either_kind_are_the_same_and_independent(blocks, back, count, seed):
    """A layer draft adopts the first ``count`` layers of a slot or of a cache of its own: both give the
    same cache of its own, and appending to or trimming it leaves the source untouched."""
    generator = torch.Generator().manual_seed(seed)
    slot_cache, own = SlotCache(small_store()), OwnCache()
    for n in blocks:
        append_everywhere((slot_cache, own), n, generator)
    back = min(back, own.length)
    slot_cache.trim(back), own.trim(back)
    before = [tuple(t.clone() for t in own.view(layer)) for layer in range(LAYERS)] if own.length else []
    from_slot, from_own = slot_cache.prefix_layers(count, None), own.prefix_layers(count, None)
    assert isinstance(from_slot, OwnCache) and isinstance(from_own, OwnCache)
    assert hold_the_same(from_slot, from_own, count) and from_own.length == own.length
    keys, values = torch.randn(2, 1, KV_HEADS, 2, HEAD_DIM, generator=generator)
    for adopted in (from_slot, from_own):
        for layer in range(count):
            adopted.append(keys, values, layer)
        adopted.trim(1)
    assert hold_the_same(slot_cache, own)
    assert all(torch.equal(a, b) for layer, pair in enumerate(before) for a, b in zip(own.view(layer), pair))
    assert slot_cache.prefix_layers(LAYERS + 1, None) is None and own.prefix_layers(LAYERS + 1, None) is None


@given(st.lists(st.tuples(st.integers(0, 3), st.sampled_from(["append", "trim", "fork"]), st.integers(0, 4),
                          st.integers(0, 70)), max_size=30), st.integers(0, 2**31))
@settings(max_examples=60, deadline=None)
def test_caches_sharing_layers_keep_their_own_keys_whatever_the_others_do(operations, seed):
    """Caches of their own forked from each other (shared layers, batch-1 appends written into room) and a
    slot twin of each: appends (with a span of room to read), trims and forks in any order leave every
    cache holding exactly its own keys, and every append's views agree between the kinds up to ``span``."""
    generator = torch.Generator().manual_seed(seed)
    arena = small_store()
    caches = [(OwnCache(), SlotCache(arena))]
    for which, kind, n, span in operations:
        own, slot_cache = caches[which % len(caches)]
        if kind == "append":
            end = own.length + n
            for layer in range(LAYERS):
                keys, values = torch.randn(2, 1, KV_HEADS, n, HEAD_DIM, generator=generator)
                own_views = own.append(keys, values, layer, span)
                slot_views = slot_cache.append(keys, values, layer, span)
                for a, b in zip(own_views, slot_views):
                    assert a.shape[2] == b.shape[2] == max(end, span) and torch.isfinite(a).all()
                    assert torch.equal(a[:, :, :end], b[:, :, :end])
        elif kind == "trim":
            n = min(n, own.length)
            own.trim(n), slot_cache.trim(n)
        elif own.length:
            caches.append((own.prefix_layers(LAYERS, None), slot_cache.prefix_layers(LAYERS, None).into_store(arena)))
        assert all(hold_the_same(*pair) for pair in caches)


def test_a_trimmed_cache_never_writes_into_keys_a_fork_still_holds():
    generator = torch.Generator().manual_seed(0)
    source = OwnCache()
    for _ in range(2):                                   # the second append writes into room
        source.append(*torch.randn(2, 1, KV_HEADS, 2, HEAD_DIM, generator=generator), 0)
    fork = source.prefix_layers(1, None)
    held = [t.clone() for t in fork.view(0)]
    source.trim(2)
    source.append(*torch.randn(2, 1, KV_HEADS, 2, HEAD_DIM, generator=generator), 0)
    assert all(torch.equal(a, b) for a, b in zip(fork.view(0), held))


def test_both_kinds_declare_their_capabilities():
    arena = small_store()
    slot_cache, own = SlotCache(arena), OwnCache()
    assert isinstance(slot_cache, KVCache) and isinstance(own, KVCache)
    assert slot_cache.is_trimmable and own.is_trimmable
    assert slot_cache.store is arena and own.store is None
    assert slot_cache.transformers_cache is None and own.transformers_cache is own.dynamic
    assert slot_cache.exclusive() is arena.lock


def test_the_store_trims_the_heap_when_it_regrows(monkeypatch):
    from speculum.models.hf.kv import store as kv_store

    trims = []
    monkeypatch.setattr(kv_store, "trim_heap", lambda: trims.append(1))
    store = small_store()
    slot = store.allocate(2)
    assert not trims                                  # the first buffers replace nothing
    store.reserve(5)
    assert len(trims) == 1 and store.capacity == 8    # the old buffers were freed
    store.release(slot)
    assert len(trims) == 1 and store.keys == []       # emptied: the engine trims once it idles


def test_trim_refuses_more_than_is_held():
    for cache in (SlotCache(small_store()), OwnCache()):
        for layer in range(LAYERS):
            cache.append(torch.zeros(1, KV_HEADS, 2, HEAD_DIM), torch.zeros(1, KV_HEADS, 2, HEAD_DIM), layer)
        cache.trim(0)
        assert cache.length == 2
        for bad in (3, -1):
            with pytest.raises(ValueError, match="holding 2 tokens"):
                cache.trim(bad)


def test_rows_of_a_batched_cache_select_without_touching_it():
    own = OwnCache()
    keys = torch.arange(2 * KV_HEADS * 3 * HEAD_DIM, dtype=torch.float32).view(2, KV_HEADS, 3, HEAD_DIM)
    for layer in range(LAYERS):
        own.append(keys, -keys, layer)
    picked = own.rows(torch.tensor([1, 1, 0]))
    assert picked.length == 3 and torch.equal(picked.view(0)[0], keys[[1, 1, 0]])
    assert torch.equal(own.view(1)[1], -keys)
    assert OwnCache().rows(torch.tensor([0, 0])).length == 0



@given(st.lists(st.tuples(st.integers(1, 3), st.integers(0, 12)), min_size=1, max_size=4), st.integers(0, 2**31))
@settings(max_examples=40, deadline=None)
def test_appends_to_selected_rows_hold_their_keys_and_read_zeros_up_to_the_span(appends, seed):
    """Rows selected from a batched cache (an enumeration level), then appended to with a span to read: each
    returned view is the held keys, then the new ones, then zeros up to the span; the cache selected from is
    untouched, and so is a selection of the appended cache after it appends again."""
    generator = torch.Generator().manual_seed(seed)
    source = OwnCache()
    first = torch.randn(2, 3, KV_HEADS, 2, HEAD_DIM, generator=generator)
    for layer in range(LAYERS):
        source.append(first[0], first[1], layer)
    picked = source.rows(torch.tensor([1, 0, 1, 1]))
    held = [(first[0][[1, 0, 1, 1]], first[1][[1, 0, 1, 1]]) for _ in range(LAYERS)]
    for n, span in appends:
        new = torch.randn(LAYERS, 2, 4, KV_HEADS, n, HEAD_DIM, generator=generator)
        fork, fork_held = picked.rows(torch.tensor([3, 2])), [(k[[3, 2]], v[[3, 2]]) for k, v in held]
        for layer in range(LAYERS):
            keys, values = picked.append(new[layer, 0], new[layer, 1], layer, span)
            held[layer] = tuple(torch.cat([old, add], dim=2) for old, add in zip(held[layer], new[layer]))
            reach = max(span, held[layer][0].shape[2])
            for got, want in zip((keys, values), held[layer]):
                assert got.shape[2] == reach and torch.equal(got[:, :, :want.shape[2]], want)
                assert not got[:, :, want.shape[2]:].any()
        assert hold_the_same(fork, _holding(fork_held))
    assert hold_the_same(picked, _holding(held))
    assert torch.equal(source.view(0)[0], first[0]) and torch.equal(source.view(1)[1], first[1])


def _holding(layers: list) -> OwnCache:
    """A cache of its own holding ``layers``: one ``(keys, values)`` per layer."""
    cache = OwnCache()
    for layer, (keys, values) in enumerate(layers):
        cache.append(keys, values, layer)
    return cache


# ------------------------------------------------------------------------------ the package's boundaries
# Private members of third-party objects the backend reads on purpose, each with why.
FOREIGN_PRIVATE = {
    "_packed_params": "torch's dynamic int8 Linear keeps its packed weight there, with no public accessor",
}


def private_reaches(path: Path) -> list[str]:
    """``x._name`` in ``path`` where ``x`` is not ``self`` / ``cls`` nor rooted at an imported module
    (``torch.ops.mkldnn._op`` is a module's function)."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    modules = {(alias.asname or alias.name).split(".")[0]
               for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    found = []
    for node in ast.walk(tree):
        dunder = node.attr.startswith("__") and node.attr.endswith("__") if isinstance(node, ast.Attribute) else True
        if dunder or not node.attr.startswith("_"):
            continue
        if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
            continue
        root = node.value
        while isinstance(root, ast.Attribute):
            root = root.value
        if isinstance(root, ast.Name) and root.id in modules or node.attr in FOREIGN_PRIVATE:
            continue
        found.append(f"{path.name}:{node.lineno}: {ast.unparse(node)}")
    return found


def test_no_module_of_the_backend_reaches_into_another_objects_private_members():
    modules = sorted(PACKAGE.rglob("*.py"))
    assert {"model.py", "session.py", "kv/cache.py", "kv/store.py"} <= {path.relative_to(PACKAGE).as_posix()
                                                                        for path in modules}
    offenders = [line for path in modules for line in private_reaches(path)]
    assert not offenders, "\n".join(offenders)


def test_the_private_reach_check_catches_what_it_is_for(tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text("import torch\n"
                     "def f(self, session, model):\n"
                     "    session._cache, self.model._forward, self._own, torch.ops._op, model.__dict__\n")
    assert private_reaches(probe) == ["probe.py:3: session._cache", "probe.py:3: self.model._forward"]


@pytest.mark.parametrize("module", ["speculum.models.hf.kv", "speculum.models.hf.kv.cache",
                                    "speculum.models.hf.kv.store", "speculum.models.hf.logprobs",
                                    "speculum.models.hf.kernels.onednn", "speculum.models.hf.kernels.probe",
                                    "speculum.models.hf.kernels.int8_weights"])
def test_docstring_examples_run(module):
    result = doctest.testmod(importlib.import_module(module))
    assert result.attempted > 0 and result.failed == 0
