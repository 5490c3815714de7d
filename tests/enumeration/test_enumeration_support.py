"""One Support for every index, declared capabilities instead of probing, one index interface."""
from __future__ import annotations

import ast
import itertools
from pathlib import Path

import numpy as np
import pytest

import speculum.enumeration
from speculum.enumeration import (AREnvelopeIndex, AutoregressiveEnumerable, EnumerationIndex, RescoredIndex,
                                  ScoringIndex, Support)
from speculum.models import MarkovModel
from speculum.models.base import Capabilities

from support.counting import CountingModel

ENUMERATION_SOURCES = sorted(Path(speculum.enumeration.__file__).parent.rglob("*.py"))


def every_sequence(vocab_size: int, max_len: int) -> list[tuple[int, ...]]:
    """Every token sequence of 1..max_len tokens."""
    return [seq for n in range(1, max_len + 1) for seq in itertools.product(range(vocab_size), repeat=n)]


# ------------------------------------------------------------------------------------------- Support
@pytest.mark.parametrize("vocab_size", [2, 3, 4])
@pytest.mark.parametrize("max_len", [1, 2, 3])
@pytest.mark.parametrize("eos", [None, 0, 1])
def test_size_and_membership_agree_with_brute_force(vocab_size, max_len, eos):
    support = Support(max_len=max_len, eos=eos)
    members = [seq for seq in every_sequence(vocab_size, max_len) if support.contains(seq)]
    assert support.size(vocab_size) == len(members)
    if eos is None:
        assert all(len(seq) == max_len for seq in members)
    else:
        assert all(seq[-1] == eos and eos not in seq[:-1] for seq in members)
    # The tree's view: a member's every proper prefix may grow, and it is complete at its last token.
    for seq in members:
        assert all(support.expandable(depth) for depth in range(len(seq)))
        assert support.is_complete(len(seq), np.array([seq[-1]]))[0]


def test_uncapped_eos_support_is_infinite_and_values_are_checked():
    assert Support(eos=3).size(10) is None and Support(eos=3).expandable(10**6)
    assert Support(max_len=2) == Support(max_len=np.int64(2)) and hash(Support(max_len=2)) == hash(Support(max_len=2))
    with pytest.raises(ValueError, match="max_len"):
        Support()
    with pytest.raises(ValueError, match="max_len"):
        Support(max_len=0)
    with pytest.raises(ValueError, match="length-2"):
        Support(max_len=2).check([0], vocab_size=3)
    with pytest.raises(ValueError, match="eos=1"):
        Support(max_len=3, eos=1).check([1, 1], vocab_size=3)
    with pytest.raises(ValueError, match="vocabulary"):
        Support(max_len=1).check([5], vocab_size=3)


def test_every_index_reports_one_support():
    model = MarkovModel.random(4, seed=0, eos_token_id=3)
    ar = AutoregressiveEnumerable(model, eos=True, max_len=3, prompt=[0])
    envelope = AREnvelopeIndex(ar, n_paths=2)
    for index in (ar, ar.seek_index(), envelope):
        assert isinstance(index, EnumerationIndex) and isinstance(index, ScoringIndex)
        assert index.support == Support(max_len=3, eos=3)
        assert (index.max_len, index.eos) == (3, 3)


def test_a_rank_past_the_support_size_is_refused_without_a_forward():
    """Eos-terminated, length <= 3, vocabulary 4: exactly 1 + 3 + 9 = 13 sequences exist, so rank 13 and
    beyond are refused by counting, before any prefix is forwarded."""
    model = CountingModel(MarkovModel.random(4, seed=1, eos_token_id=3))
    ar = AutoregressiveEnumerable(model, eos=3, max_len=3, prompt=[0])
    with pytest.raises(IndexError, match="at most 13 sequences"):
        ar.unrank(14)
    assert ar.slice(13, 5) == []
    assert model.calls == 0
    assert len(ar.top_k(20)) == 13   # every one of them has positive probability under this model


# ---------------------------------------------------------------------------- declared capabilities
def test_no_probing_for_hooks_in_enumeration():
    """Enumeration reads declared capabilities and classifies objects by isinstance; the lazy-import
    ``__getattr__`` of the package is module machinery, not a probe."""
    found = []
    for path in ENUMERATION_SOURCES:
        tree = ast.parse(path.read_text())
        allowed = set()
        for node in tree.body:
            if isinstance(node, ast.FunctionDef) and node.name == "__getattr__":
                allowed.update(id(inner) for inner in ast.walk(node))
        for node in ast.walk(tree):
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
                    and node.func.id in ("hasattr", "getattr") and id(node) not in allowed):
                found.append(f"{path.name}:{node.lineno}: {node.func.id}(")
    assert len(ENUMERATION_SOURCES) >= 10 and not found, found


class UndeclaredHook(CountingModel):
    """Offers ``next_logprobs_above`` without declaring it: the tree must not call it."""

    def next_logprobs_above(self, prefixes, min_logprobs):
        raise AssertionError("called a hook the model does not declare")


class DeclaredHook(CountingModel):
    capabilities = Capabilities(sparse_rows=True)
    sparse_calls = 0

    def next_logprobs_above(self, prefixes, min_logprobs):
        self.sparse_calls += 1
        rows = self.next_logprobs(prefixes)
        finite = np.isfinite(rows)
        r, tok = np.nonzero(finite & (rows >= np.asarray(min_logprobs)[:, None]))
        return r, tok, rows[r, tok], finite.sum(axis=1)


def test_the_tree_uses_the_sparse_rows_only_where_declared():
    markov = MarkovModel.random(5, seed=2)
    dense = AutoregressiveEnumerable(UndeclaredHook(markov), max_len=3).top_k(30)
    declared = DeclaredHook(markov)
    assert AutoregressiveEnumerable(declared, max_len=3).top_k(30) == dense
    assert declared.sparse_calls > 0


# ---------------------------------------------------------------------------------- rescoring entry
class UnrankOnly:
    def unrank(self, i):
        return (0, 0), 0.0


class ForwardOnly:
    """A model known only by ``forward(ids[1, T]) -> logits[1, T, V]`` (adapted by ``as_model``)."""

    def __init__(self, markov):
        self.markov = markov

    def forward(self, ids):
        tokens = [int(t) for t in ids[0]]
        return self.markov.next_logprobs([tokens[: j + 1] for j in range(len(tokens))])[None]


def test_rescoring_classifies_its_inputs_where_they_enter():
    draft, target = MarkovModel.random(4, seed=3), MarkovModel.random(4, seed=4)
    draft_index = AutoregressiveEnumerable(draft, max_len=2, prompt=[1])
    with pytest.raises(ValueError, match="draft_index must be an enumeration index"):
        RescoredIndex(UnrankOnly(), target)
    expected = RescoredIndex(draft_index, target, rerank_window=16).top_k(5)["items"]
    adapted = RescoredIndex(draft_index, ForwardOnly(target), rerank_window=16).top_k(5)["items"]
    assert [seq for seq, _ in adapted] == [seq for seq, _ in expected]
    np.testing.assert_allclose([lp for _, lp in adapted], [lp for _, lp in expected], rtol=0, atol=1e-12)
    scored = RescoredIndex(draft_index, lambda seqs: target.score_sequences(seqs, prompt=[1]), rerank_window=16)
    assert scored.top_k(5)["items"] == expected
    index_target = AutoregressiveEnumerable(target, max_len=2, prompt=[1])
    assert RescoredIndex(draft_index, index_target, rerank_window=16).top_k(5)["items"] == expected
