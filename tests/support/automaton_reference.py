"""The token automaton built in full, the direct way, as a reference for the one built on demand.

A breadth-first walk of the vocabulary's byte trie from every state reached (one byte at a time, a pending
incomplete character kept as bytes), then every state that cannot reach an accepting one removed. No
vectorisation, no liveness bracket: the tests compare the library's automaton against this.
"""
from __future__ import annotations

from collections import deque


def _utf8_length(lead: int) -> int:
    if lead < 0x80:
        return 1
    for length, (low, high) in ((2, (0xC2, 0xDF)), (3, (0xE0, 0xEF)), (4, (0xF0, 0xF4))):
        if low <= lead <= high:
            return length
    return 0


def _walk(trie: dict, chars, start: tuple[int, bytes]) -> list[tuple[int, tuple[int, bytes]]]:
    """``(token, state after it)`` for every token the character automaton can read from ``start``."""
    out, stack = [], [(trie, start[0], start[1])]
    while stack:
        node, state, pending = stack.pop()
        for byte, child in node.items():
            if byte == -1:
                continue
            data = pending + bytes((byte,))
            need = _utf8_length(data[0])
            if need == 0 or (pending and not 0x80 <= byte <= 0xBF):
                continue
            if len(data) < need:
                nxt, rest = state, data
            else:
                try:
                    char = data.decode("utf-8")
                except UnicodeDecodeError:
                    continue
                nxt, rest = chars.step(state, char), b""
                if nxt is None:
                    continue
            out.extend((token, (nxt, rest)) for token in child.get(-1, ()))
            stack.append((child, nxt, rest))
    return out


def full_build(chars, pieces) -> tuple[list[bool], list[list[tuple[int, int]]]] | None:
    """``(accepting, moves)`` over the live states reachable from the start, numbered breadth first with
    moves in token order; ``moves[s]``: sorted ``(token, target)``. None when the start is not live."""
    trie: dict = {}
    for token, piece in enumerate(pieces):
        if piece:
            node = trie
            for byte in piece:
                node = node.setdefault(byte, {})
            node.setdefault(-1, []).append(token)
    start = (chars.initial, b"")
    number, order, edges, queue = {start: 0}, [start], [], deque([start])
    while queue:
        moves = {}
        for token, reached in _walk(trie, chars, queue.popleft()):
            if reached not in number:
                number[reached] = len(order)
                order.append(reached)
                queue.append(reached)
            moves[token] = number[reached]
        edges.append(moves)
    finals = {i for i, (state, pending) in enumerate(order) if not pending and state in chars.finals}
    reverse: dict[int, set[int]] = {}
    for source, moves in enumerate(edges):
        for target in moves.values():
            reverse.setdefault(target, set()).add(source)
    live, queue = set(finals), deque(finals)
    while queue:
        for source in reverse.get(queue.popleft(), ()):
            if source not in live:
                live.add(source)
                queue.append(source)
    if 0 not in live:
        return None
    keep, seen, queue = [0], {0}, deque([0])
    while queue:
        for _, target in sorted(edges[queue.popleft()].items()):
            if target in live and target not in seen:
                seen.add(target)
                keep.append(target)
                queue.append(target)
    renumber = {state: i for i, state in enumerate(keep)}
    moves = [sorted((t, renumber[n]) for t, n in edges[s].items() if n in live) for s in keep]
    return [s in finals for s in keep], moves
