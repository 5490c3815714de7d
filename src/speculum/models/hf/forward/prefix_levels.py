"""Next-token rows after many prefixes, by a prefix tree walked one depth per forward.

Why: enumeration asks for the rows after hundreds of prefixes that share most of their tokens. Feeding
each prefix whole repeats the shared tokens; the tree feeds each distinct node once, one token a node, on
its parent's kept keys and values, so a depth costs one batched forward of the nodes at that depth.

Example:
    >>> trie_forward(model._level_step, root, [(5,), (5, 7), (9,)], [0, 1, 2], emit)   # doctest: +SKIP
"""
from __future__ import annotations

from collections import defaultdict
from typing import Any, Callable, Sequence

import torch

__all__ = ["trie_forward"]

# (level, parent index per node, token per node) -> (next level, logits (nodes, vocab))
LevelStep = Callable[[Any, list[int], list[int]], tuple[Any, torch.Tensor]]


def trie_forward(step: LevelStep, root: Any, suffixes: Sequence[tuple[int, ...]], rows: Sequence[int],
                 emit: Callable[[list[int], torch.Tensor], None]) -> None:
    """Call ``emit(rows, logits)`` with the raw logits after ``root + suffixes[j]`` for every ``rows[j]``, one
    ``step`` per tree depth (each non-empty suffix once per distinct value; a suffix asked twice gets the
    same row twice); ``logits`` may be a view of the step's output, which ``emit`` must not change. Exact:
    each node's logits are those of its own path, whatever else shares the forward, up to the float
    rounding of the batch shape."""
    rows_of: dict[tuple[int, ...], list[int]] = defaultdict(list)
    for suffix, row in zip(suffixes, rows):
        if not suffix:
            raise ValueError("every suffix needs a token (the input whose logits are wanted)")
        rows_of[tuple(suffix)].append(row)
    level_nodes: list[tuple[int, ...]] = [()]
    level = root
    depth = 0
    while True:
        depth += 1
        nodes = sorted({s[:depth] for s in rows_of if len(s) >= depth})
        if not nodes:
            return
        parent_of = {node: k for k, node in enumerate(level_nodes)}
        next_level, logits = step(level, [parent_of[n[:-1]] for n in nodes], [n[-1] for n in nodes])
        picked = [(k, row) for k, node in enumerate(nodes) for row in rows_of.get(node, ())]
        if picked:
            index = [k for k, _ in picked]
            # Usually every node of a depth is asked for, in order: a view then, not a copy of the rows.
            contiguous = index == list(range(index[0], index[0] + len(index)))
            emit([row for _, row in picked], logits[index[0]:index[0] + len(index)] if contiguous else logits[index])
        level_nodes, level = nodes, next_level
