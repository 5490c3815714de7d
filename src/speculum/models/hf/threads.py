"""Threads that follow the free cores: a model's forwards run on the cores other processes leave free.

Why: PyTorch's OpenMP threads meet at the end of every parallel operation, and a decode step of a small
model is hundreds of them. When other CPU-bound processes share the cores, a thread the scheduler took off
its core stalls every meeting while the others spin: on two cores beside two busy processes a two-thread
decode step slows many times more than a one-thread step does (``benchmarks/shared_cores.py``). So at most
every ``interval`` seconds, before a forward, :class:`ThreadGovernor` reads how much CPU time the other
processes took since its last reading (the machine's busy time in ``/proc/stat`` less this process's own)
and sets PyTorch's thread count to the cores they left free: at least one, at most the model's own count
(or the count the user set since, with ``torch.set_num_threads``).

Exactness: the thread count decides only how each operation's work is split. A model's forwards are
governed only when they give bitwise the same rows at one thread and at its full count
(:func:`rows_ignore_threads`, probed once at load); otherwise its thread count stays fixed.
``SPECULUM_THREADS=fixed`` turns the governor off.

Example:
    >>> governor = ThreadGovernor(most=2)
    >>> 1 <= governor.adjust() <= 2
    True
"""
from __future__ import annotations

import os
import time
from typing import Callable

import torch

__all__ = ["ThreadGovernor", "governed_threads", "rows_ignore_threads"]

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
_SLACK = 0.25          # cores of others' use tolerated before a thread is given up (background daemons)


def _busy_seconds() -> float | None:
    """CPU seconds the whole machine has been busy (all cores), from ``/proc/stat``; None where unreadable."""
    try:
        with open("/proc/stat") as stat:
            fields = stat.readline().split()
    except OSError:
        return None
    if not fields or fields[0] != "cpu" or len(fields) < 8:
        return None
    user, nice, system, _idle, _iowait, irq, softirq = (int(v) for v in fields[1:8])
    steal = int(fields[8]) if len(fields) > 8 else 0
    return (user + nice + system + irq + softirq + steal) / _TICKS


def _own_seconds() -> float:
    times = os.times()
    return times.user + times.system


class ThreadGovernor:
    """Sets PyTorch's thread count to the cores other processes leave free (see the module).
    Guarantee: heuristic (speed only), used only where the rows do not depend on the thread count."""

    def __init__(self, most: int, interval: float = 0.5) -> None:
        self.most, self.interval = max(int(most), 1), interval
        self.current = self.most
        self._last: tuple[float, float, float] | None = None      # (wall, machine busy, own) seconds

    def adjust(self) -> int:
        """The thread count to run the next forward on, set in PyTorch where it changed."""
        now = time.monotonic()
        if torch.get_num_threads() != self.current:     # set by the user since: the new most
            self.most = self.current = torch.get_num_threads()
        if self._last is not None and now - self._last[0] < self.interval:
            return self.current
        busy, own = _busy_seconds(), _own_seconds()
        if busy is None:
            return self.current
        if self._last is not None:
            wall = now - self._last[0]
            others = max(busy - self._last[1] - (own - self._last[2]), 0.0) / wall     # cores others used
            wanted = max(1, min(self.most, int(self.most - others + _SLACK)))
            if wanted != self.current:
                self.current = wanted
        self._last = (now, busy, own)
        if torch.get_num_threads() != self.current:
            torch.set_num_threads(self.current)
        return self.current


def governed_threads(most: int, rows: Callable[[], torch.Tensor]) -> ThreadGovernor | None:
    """A governor for a model running ``most`` threads whose ``rows()`` (a small forward) gives bitwise the
    same at one thread as at ``most`` (:func:`rows_ignore_threads`); None where it would not be exact, where
    there is one thread anyway, or where ``SPECULUM_THREADS=fixed``."""
    if most <= 1 or os.environ.get("SPECULUM_THREADS", "").strip().lower() == "fixed":
        return None
    return ThreadGovernor(most) if rows_ignore_threads(most, rows) else None


def rows_ignore_threads(most: int, rows: Callable[[], torch.Tensor]) -> bool:
    """Whether ``rows()`` gives bitwise the same at ``most`` threads and at one (PyTorch's count restored)."""
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(most)
        many = rows()
        torch.set_num_threads(1)
        one = rows()
    finally:
        torch.set_num_threads(before)
    return torch.equal(many, one)
