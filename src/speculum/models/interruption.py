"""Forwards that stop between two layers when their caller asks (:class:`Interruption`), and the error that
says so (:class:`Interrupted`).

Why: a server scores long prompts (OpenAI's ``echo``) in rounds, and a generation that arrives waits for
the round in progress. Each round is a forward, and every forward reads every weight once: short rounds
keep that wait short but pay the read again and again. A round whose forward stops between two layers as
soon as a generation arrives can be long (few reads of the weights) while the generation waits at most
one layer. The stopped round's work is lost and done again later.

Two parties, one per side of the model: the caller *requests* it (:meth:`Interruption.requested`, with a
check called between layers), and the model *arms* it around the forwards whose state it can put back
(:meth:`Interruption.armed`); a forward stops only where both hold on its thread. Nothing else changes: a
forward that is not stopped computes exactly what it computes without either.

Example:
    >>> interruption = Interruption()
    >>> with interruption.requested(lambda: True):
    ...     interruption.between_layers()          # not armed: nothing stops
    ...     with interruption.armed():
    ...         interruption.between_layers()
    Traceback (most recent call last):
    ...
    speculum.models.interruption.Interrupted: the forward was asked to stop between two layers
"""
from __future__ import annotations

import contextlib
import threading
from typing import Callable, Iterator

__all__ = ["Interrupted", "Interruption"]


class Interrupted(Exception):
    """A forward stopped between two layers because its caller's check asked it to. The model that raises
    it has put back what the forward changed: its sessions hold what they held before the call."""


class Interruption:
    """Per thread, whether the forwards running there stop between two layers: where a caller requested
    it (a check, called between layers) and the model armed it (it can undo the forward's writes)."""

    def __init__(self) -> None:
        self._local = threading.local()

    @contextlib.contextmanager
    def requested(self, check: Callable[[], bool]) -> Iterator[None]:
        """Within the block, armed forwards on this thread stop between two layers once ``check()`` is
        True (it is called before each layer: keep it cheap)."""
        with self._set("check", check):
            yield

    @contextlib.contextmanager
    def armed(self) -> Iterator[None]:
        """Within the block, forwards on this thread may stop where a caller requested it: the model
        undoes their writes when :class:`Interrupted` leaves the block."""
        with self._set("armed", True):
            yield

    def between_layers(self) -> None:
        """Called by a forward before each layer: raises :class:`Interrupted` where armed and requested and
        the caller's check says so."""
        if self.stoppable() and self._local.check():
            raise Interrupted("the forward was asked to stop between two layers")

    def stoppable(self) -> bool:
        """Whether forwards on this thread may stop between layers now (armed and requested): a forward that
        runs its layers without :meth:`between_layers` must not run then."""
        local = self._local
        return bool(getattr(local, "armed", False)) and getattr(local, "check", None) is not None

    @contextlib.contextmanager
    def _set(self, name: str, value: object) -> Iterator[None]:
        previous = getattr(self._local, name, None)
        setattr(self._local, name, value)
        try:
            yield
        finally:
            setattr(self._local, name, previous)
