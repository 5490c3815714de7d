"""The CPU this process runs on, as Linux describes it in ``/proc/cpuinfo``: its model name, its
instruction-set flags, and both together (what a compiled kernel is built for). The package's one reader
of that file; it needs neither torch nor a model.

Example:
    >>> isinstance(cpu_name(), str) and isinstance(cpu_flags(), frozenset)
    True
"""
from __future__ import annotations

import math
import os
import platform
from functools import lru_cache

__all__ = ["cpu_flags", "cpu_identity", "cpu_name", "default_threads", "usable_cpus", "KERNEL_FLAGS"]

# The flags that decide which kernels run (speculum's own and PyTorch's) and which dtypes pay on this CPU.
KERNEL_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_fp16", "amx_tile", "amx_bf16", "amx_int8",
                "avx512bw", "avx512_vnni")


@lru_cache(maxsize=1)
def _cpuinfo_lines() -> tuple[str, ...]:
    """The lines of ``/proc/cpuinfo`` (none where it cannot be read)."""
    try:
        with open("/proc/cpuinfo") as info:
            return tuple(info.read().splitlines())
    except OSError:
        return ()


def cpu_name() -> str:
    """The CPU's model name, else what ``platform`` knows."""
    for line in _cpuinfo_lines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine() or "unknown CPU"


@lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's instruction-set flags (empty where ``/proc/cpuinfo`` cannot be read)."""
    for line in _cpuinfo_lines():
        if line.startswith("flags"):
            return frozenset(line.split(":", 1)[1].split())
    return frozenset()


def cpu_identity() -> str:
    """The CPU's model and flags lines, each once: what a kernel compiled with ``-march=native`` is for."""
    lines = [line for line in _cpuinfo_lines() if line.startswith(("model name", "flags"))]
    return "\n".join(dict.fromkeys(lines)) if lines else platform.processor() or platform.machine()


def usable_cpus() -> int:
    """The CPUs this process may run on: its affinity mask (``taskset``, a container's cpuset), within a
    cgroup's CPU quota (``cpu.max``) where one is set."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        count = os.cpu_count() or 1
    try:
        with open("/sys/fs/cgroup/cpu.max") as limits:
            quota, period = limits.read().split()[:2]
        if quota != "max":
            count = min(count, max(1, math.ceil(int(quota) / int(period))))
    except (OSError, ValueError):
        pass
    return max(count, 1)


def default_threads() -> int:
    """Threads for the CPU kernels of a model loaded without ``threads=``: ``OMP_NUM_THREADS`` where the
    user set it, else :func:`usable_cpus`. More threads than usable CPUs would spin at every barrier waiting
    for a thread that is not running: a process pinned to one core of a shared machine must run one."""
    try:
        requested = int(os.environ.get("OMP_NUM_THREADS", "").split(",")[0])
    except ValueError:
        requested = 0
    return requested if requested > 0 else usable_cpus()
