"""Exact small models in NumPy, for tests, exact checks and benchmarks.

Why: every log-prob here is exact (float64); these models are the ground truth that speculative decoding
and enumeration are checked against by brute force, and they run where no real-model extra is installed.

* :class:`MarkovModel` (``markov.py``) — order-1/2 chains from explicit logits;
* :class:`NGramModel` (``ngram.py``) — smoothed token-id n-gram, fitted from data, updatable online;
* :class:`TinyTransformer` (``tiny_transformer.py``) — a random-weight causal transformer with a KV cache.

Example:
    >>> from speculum.models.reference import MarkovModel
    >>> MarkovModel.random(5, seed=0).vocab_size
    5
"""
from __future__ import annotations

from .markov import MarkovModel
from .ngram import NGramModel
from .tiny_transformer import TinyTransformer

__all__ = ["MarkovModel", "NGramModel", "TinyTransformer"]
