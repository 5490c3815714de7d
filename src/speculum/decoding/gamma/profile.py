"""What ``gamma="auto"`` learns about a draft model, kept for the draft's life: :class:`DraftProfile`.

A draft's profile belongs to the draft object (:func:`profile_of`: one per object, dropped with it), so
every generation drafting with that object, one after another or at the same time, shares it. A lock
guards it, and what concurrent generations learn is merged, never overwritten.

Only timed policies use a profile: a seeded sampler's γ sequence, hence its draws, must not depend on
earlier calls (:class:`~speculum.decoding.gamma.controller.GammaPolicy`).
"""
from __future__ import annotations

import threading
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .controller import AcceptanceCounts

__all__ = ["DraftProfile", "profile_of"]


class DraftProfile:
    """A draft model's timings and acceptance statistics, shared by the generations that use it.

    ``timings()``: the trial's (draft step seconds, marginal read seconds per token), so that later
    generations decide whether the draft can pay without a trial; concurrent trials keep the lower of
    each (interference only ever adds time).

    ``acceptance()``: the pooled acceptance statistics and probe back-off that a generation left
    (:meth:`~speculum.decoding.gamma.controller.GammaController.remembered`), so that a draft that rarely agrees
    is not re-probed from scratch each time, with a version. A generation publishes its statistics when it
    ends, with the version it started from: they continue what it recalled, so they replace the stored
    ones, unless another generation published meanwhile; the two are then merged.

    Example:
        >>> profile = DraftProfile()
        >>> profile.record_timings(0.002, 0.0005); profile.record_timings(0.003, 0.0004)
        >>> profile.timings()
        (0.002, 0.0004)
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._timings: tuple[float, float] | None = None
        self._acceptance: "AcceptanceCounts | None" = None
        self._version = 0

    def timings(self) -> tuple[float, float] | None:
        with self._lock:
            return self._timings

    def record_timings(self, step_seconds: float, read_seconds_per_token: float) -> None:
        with self._lock:
            if self._timings is None:
                self._timings = (step_seconds, read_seconds_per_token)
            else:
                self._timings = (min(self._timings[0], step_seconds), min(self._timings[1], read_seconds_per_token))

    def acceptance(self) -> "tuple[AcceptanceCounts | None, int]":
        """The stored statistics (never modified once stored: a reader may keep them) and their version."""
        with self._lock:
            return self._acceptance, self._version

    def publish(self, acceptance: "AcceptanceCounts | None", *, since: int) -> None:
        """Store a generation's statistics; ``since``: the version it recalled when it started."""
        if acceptance is None:
            return
        with self._lock:
            if self._acceptance is None or self._version == since:
                self._acceptance = acceptance
            else:
                self._acceptance = self._acceptance.merged(acceptance)
            self._version += 1


_PROFILES: "weakref.WeakKeyDictionary[Any, DraftProfile]" = weakref.WeakKeyDictionary()
_PROFILES_LOCK = threading.Lock()


def profile_of(draft: Any) -> DraftProfile | None:
    """``draft``'s profile (created empty on first use, dropped with the object), or None when the object
    cannot key a weak dictionary (not weak-referenceable or not hashable): it is then timed and learnt
    afresh by each generation."""
    with _PROFILES_LOCK:
        try:
            return _PROFILES.setdefault(draft, DraftProfile())
        except TypeError:
            return None
