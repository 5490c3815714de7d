"""A protocol-model wrapper that counts the target's work, shared by the enumeration benchmarks.

``calls`` counts batched calls; ``positions`` (alias ``forwards``) counts the rows computed: one per
prefix for ``next_logprobs`` (and the PyTorch backend's sparse ``next_logprobs_above``), one per distinct
proper prefix of the batch for a prefix-sharing ``score_sequences``.
"""
from __future__ import annotations


class CountingModel:
    """Delegates to ``inner``, counting batched calls and the positions (rows) they compute."""

    def __init__(self, inner) -> None:
        self.inner, self.vocab_size = inner, inner.vocab_size
        self.accepts_empty_prompt = getattr(inner, "accepts_empty_prompt", False)
        self.eos_token_id = getattr(inner, "eos_token_id", None)
        self.bos_token_id = getattr(inner, "bos_token_id", None)
        self.calls = self.positions = 0

    @property
    def forwards(self) -> int:
        return self.positions

    def next_logprobs(self, prefixes):
        self.calls += 1
        self.positions += len(prefixes)
        return self.inner.next_logprobs(prefixes)

    def __getattr__(self, name):
        # The sparse hook (``next_logprobs_above``) is passed on, and counted, only when the model has it.
        if name != "next_logprobs_above" or not hasattr(self.inner, name):
            raise AttributeError(name)

        def next_logprobs_above(prefixes, min_logprobs):
            self.calls += 1
            self.positions += len(prefixes)
            return self.inner.next_logprobs_above(prefixes, min_logprobs)
        return next_logprobs_above

    def score_sequences(self, sequences, prompt=()):
        self.calls += 1
        self.positions += len({tuple(s[:j]) for s in sequences for j in range(len(s))})
        return self.inner.score_sequences(sequences, prompt=prompt)

    def start(self, prompt):
        return self.inner.start(prompt)

    def reset(self) -> None:
        self.calls = self.positions = 0
