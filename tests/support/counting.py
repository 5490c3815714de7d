"""One model wrapper that counts a model's work, for the enumeration tests and benchmarks.

``calls`` counts batched calls; ``positions`` (alias ``forwards``) counts the rows computed: one per prefix
for ``next_logprobs`` (and the sparse ``next_logprobs_above``), one per distinct proper prefix of the batch
for a prefix-sharing ``score_sequences``. With ``record=True`` it also keeps every prefix forwarded
(``forwarded``) and every sequence scored (``scored``); off by default, since a benchmark's memory figures
must not include that record. The benchmarks load this file by path (``benchmarks/counting.py``).
"""
from __future__ import annotations

from speculum.models.base import Capabilities, capabilities_of


class CountingModel:
    """Delegates to ``inner``, counting batched calls and the positions (rows) they compute.

    ``sparse_rows``: whether to offer ``next_logprobs_above`` (None: as ``inner`` declares; False forces the
    dense rows, to compare the two paths on one model).
    """

    def __init__(self, inner, *, record: bool = False, sparse_rows: bool | None = None) -> None:
        self.inner, self.vocab_size = inner, inner.vocab_size
        self.accepts_empty_prompt = getattr(inner, "accepts_empty_prompt", False)
        self.eos_token_id = getattr(inner, "eos_token_id", None)
        self.bos_token_id = getattr(inner, "bos_token_id", None)
        declared = capabilities_of(inner)
        # Sessions are the inner model's own, so their capability carries over; prefix sharing does not.
        self._capabilities = Capabilities(
            sparse_rows=declared.sparse_rows if sparse_rows is None else sparse_rows and declared.sparse_rows,
            session_advance=declared.session_advance)
        self.record = record
        self.forwarded: list[tuple[int, ...]] = []
        self.scored: list[tuple[int, ...]] = []
        self.calls = self.positions = 0

    @property
    def capabilities(self) -> Capabilities:
        return self._capabilities

    @property
    def forwards(self) -> int:
        return self.positions

    def _count(self, prefixes) -> None:
        self.calls += 1
        self.positions += len(prefixes)
        if self.record:
            self.forwarded.extend(tuple(p) for p in prefixes)

    def next_logprobs(self, prefixes):
        self._count(prefixes)
        return self.inner.next_logprobs(prefixes)

    def next_logprobs_above(self, prefixes, min_logprobs):
        self._count(prefixes)
        return self.inner.next_logprobs_above(prefixes, min_logprobs)

    def score_sequences(self, sequences, prompt=()):
        self.calls += 1
        self.positions += len({tuple(s[:j]) for s in sequences for j in range(len(s))})
        if self.record:
            self.scored.extend(tuple(s) for s in sequences)
        return self.inner.score_sequences(sequences, prompt=prompt)

    def start(self, prompt):
        return self.inner.start(prompt)

    def reset(self) -> None:
        self.calls = self.positions = 0
        self.forwarded.clear()
        self.scored.clear()
