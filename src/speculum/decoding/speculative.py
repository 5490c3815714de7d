"""The public loop: ``speculum.stream`` (a generator of chunks) and ``speculum.generate`` (blocking), each one
:class:`~speculum.decoding.generation.Decoder` run alone; ``generate_batch`` lives with the scheduler
(:mod:`speculum.decoding.scheduler`) and is re-exported here.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence

from .events import Chunk, DecodingStats, GenerationResult
from .generation import Decoder
from .plan import MODEL_EOS, plan_generation

__all__ = ["generate", "stream"]


# ------------------------------------------------------------------------------------------ public API
def stream(target: Any, prompt_ids: Sequence[int], *, draft: Any = None, max_new_tokens: int = 64,
           gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
           top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None,
           target_logprobs: bool = True) -> Iterator[Chunk]:
    """Speculative decoding, streamed: yields one :class:`Chunk` per target forward.

    Guarantee: exact — the emitted tokens have exactly the law of plain sampling from the target with the
    same temperature / top-k / top-p; at ``temperature=0`` they are identical to plain greedy decoding.

    Args:
        target: a protocol model (``speculum.models``); ``.forward`` models (the compatibility API's) are
            adapted.
        prompt_ids: integer token ids (a list of Python / NumPy ints or an integer array; text, floats and
            bools are refused: call ``model.encode(text)``); empty only if the target has a BOS token or
            an initial distribution.
        draft: a model (distribution-aware verification), a proposer with ``propose(context, max_tokens)``
            (point-mass verification), or None (plain decoding). A draft model whose ``max_context``
            cannot hold the prompt is not used, and one whose window the context outgrows stops drafting
            there: plain decoding continues, and ``stats.draft_skipped`` says why.
        max_new_tokens: exact cap on emitted tokens (also capped by the target's ``max_context``).
        gamma: proposals per target forward, or ``"auto"`` (adapted from measured acceptance and costs).
        temperature: 0 = greedy; any finite value > 0 samples the tempered law (a vanishing one: uniform
            over the tied most probable tokens); top_k / top_p: applied identically to draft and target rows.
        eos_token_id: generation stops after emitting it (nothing after it is emitted). Default: the
            target's ``eos_token_id`` (no stop if it has none); ``None`` never stops early.
        seed: int / SeedSequence / Generator / None; split into drafting, acceptance, resampling streams.
        target_logprobs: False when the chunks' ``target_logprobs`` are not read: a greedy generation then
            verifies on the target's greedy tokens alone where the target gives them
            (``Capabilities.greedy_tokens``), skipping its log-prob rows; the tokens are the same.

    Arguments are validated before any model work (``InputError``, a ``ValueError``, naming the argument).
    Generations in concurrent threads may share one draft object: what ``gamma="auto"`` learns about a
    draft model is merged, never overwritten, and with a model whose sessions are independent, or a
    proposer whose proposals depend on the context only (:class:`~speculum.models.PromptLookup`), each
    gets exactly the output it gets alone.

    Example:
        >>> from speculum.models import MarkovModel
        >>> target = MarkovModel.random(6, seed=0); draft = MarkovModel.random(6, seed=1)
        >>> chunks = list(stream(target, [0], draft=draft, max_new_tokens=5, seed=0))
        >>> sum(len(c.tokens) for c in chunks)
        5
    """
    plan = plan_generation(target, prompt_ids, draft=draft, max_new_tokens=max_new_tokens, gamma=gamma,
                           temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id,
                           seed=seed, target_logprobs=target_logprobs)
    return Decoder(plan).run()


def generate(target: Any, prompt_ids: Sequence[int], *, draft: Any = None, max_new_tokens: int = 64,
             gamma: int | str = 4, temperature: float = 1.0, top_k: int | None = None,
             top_p: float | None = None, eos_token_id: Any = MODEL_EOS, seed: Any = None) -> GenerationResult:
    """Speculative decoding, blocking: the new tokens (prompt excluded) and :class:`DecodingStats`.

    Guarantee: exact, as :func:`stream` (which it wraps; same arguments and defaults: it stops at the
    target's eos unless ``eos_token_id`` says otherwise).

    Example:
        >>> from speculum.models import MarkovModel
        >>> target = MarkovModel.random(6, seed=0)
        >>> plain = generate(target, [0], max_new_tokens=8, temperature=0)
        >>> fast = generate(target, [0], draft=MarkovModel.random(6, seed=1), max_new_tokens=8, temperature=0)
        >>> fast.tokens == plain.tokens
        True
    """
    tokens: list[int] = []
    stats, stop_reason = DecodingStats(), None
    for chunk in stream(target, prompt_ids, draft=draft, max_new_tokens=max_new_tokens, gamma=gamma,
                        temperature=temperature, top_k=top_k, top_p=top_p, eos_token_id=eos_token_id, seed=seed,
                        target_logprobs=False):
        tokens.extend(chunk.tokens)
        stats, stop_reason = chunk.stats, chunk.stop_reason
    return GenerationResult(tokens, stats, stop_reason)
