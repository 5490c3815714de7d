"""keep_freed_memory: glibc's large allocations served from the heap and reused (values unchanged)."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_large_buffers_are_reused_instead_of_faulted_in_again():
    """In a fresh process: after the call, freeing and reallocating 100 MB blocks costs few page faults."""
    script = """
import resource, numpy as np
from speculum.models.memory.allocator import keep_freed_memory

def faults(n=20):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(n):
        block = np.ones(100 * 2**20 // 8)
        del block
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before

plain = faults()
assert keep_freed_memory() and keep_freed_memory()      # idempotent
faults(1)                                                # the heap grows once
tuned = faults()
print(plain, tuned)
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True).stdout
    plain, tuned = map(int, out.split())
    assert plain >= 20                  # each 100 MB block faulted in again (4 kB or 2 MB pages)
    assert tuned < plain / 10
