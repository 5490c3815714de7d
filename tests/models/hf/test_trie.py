"""The prefix-tree walk behind ``HFModel.next_logprobs``: each node forwarded once, one step a depth, every
asked suffix (duplicates included) answered with its own path's row."""
import pytest

torch = pytest.importorskip("torch")

from hypothesis import given, settings, strategies as st  # noqa: E402

from speculum.models.hf.forward.prefix_levels import trie_forward  # noqa: E402


def path_row(path: tuple[int, ...]) -> torch.Tensor:
    """A row that names its path: token counts weighted by depth (distinct paths, distinct rows here)."""
    row = torch.zeros(8, dtype=torch.float64)
    for depth, token in enumerate(path, start=1):
        row[token] += depth ** 2
    return row


@settings(max_examples=60, deadline=None)
@given(st.lists(st.lists(st.integers(0, 7), min_size=1, max_size=4).map(tuple), min_size=1, max_size=12))
def test_every_suffix_gets_its_own_row_and_each_node_is_forwarded_once(suffixes):
    forwarded: list[tuple[int, ...]] = []
    steps = []

    def step(level, parents, tokens):
        nodes = [level[p] + (t,) for p, t in zip(parents, tokens)]
        forwarded.extend(nodes)
        steps.append(len(nodes))
        return nodes, torch.stack([path_row(n) for n in nodes])

    got: dict[int, torch.Tensor] = {}

    def emit(rows, logits):
        for row, values in zip(rows, logits):
            assert row not in got
            got[row] = values

    rows = [10 * j for j in range(len(suffixes))]
    trie_forward(step, [()], suffixes, rows, emit)
    assert sorted(got) == rows
    for row, suffix in zip(rows, suffixes):
        assert torch.equal(got[row], path_row(suffix))
    # Each distinct proper prefix or suffix is forwarded exactly once, one step per depth.
    assert sorted(forwarded) == sorted({s[:d] for s in suffixes for d in range(1, len(s) + 1)})
    assert len(steps) == max(len(s) for s in suffixes)


def test_an_empty_suffix_is_refused():
    with pytest.raises(ValueError, match="needs a token"):
        trie_forward(lambda *a: None, [()], [()], [0], lambda *a: None)
