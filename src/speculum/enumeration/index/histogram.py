"""Count histograms over quantised information: the coarse level of the exact enumeration index.

Each complete sequence gets the bucket ``floor(-log2 p / width)`` of its *exact total* information, so the
bucket order is a coarsening of the exact order: every sequence in a lower bucket is strictly more probable
than every sequence in a higher one. The bucket is taken of the exact total, not summed from per-step
floored buckets (a sum that can land up to ``L`` buckets away from the total's), so the coarsening is
strict and no band of neighbouring buckets has to be widened for soundness.

``BucketIndex`` keeps the members of each bucket contiguous with cumulative counts: a rank is located by
bisecting the cumulative counts; only the one bucket (the *band*) holding it needs an exact sort.

Example:
    >>> import numpy as np
    >>> index = BucketIndex(np.log([0.5, 0.25, 0.25, 0.125]), width_bits=1 / 64)
    >>> index.locate(2)          # rank 2 falls in the bucket of the two 0.25s, at offset 1
    (1, 1)
    >>> index.count_before(1)    # sequences strictly more probable than that bucket
    1
"""
from __future__ import annotations

import math

import numpy as np

from ...validation import check_number

__all__ = ["DEFAULT_WIDTH_BITS", "bucket_of", "BucketIndex"]

DEFAULT_WIDTH_BITS = 1.0 / 256.0
_LN2 = math.log(2.0)


def bucket_of(logprob: np.ndarray | float, width_bits: float) -> np.ndarray:
    """Bucket ``floor(-log2 p / width_bits)`` of exact log-probs (monotone: higher log-prob, lower bucket)."""
    return np.floor(-np.asarray(logprob, dtype=np.float64) / (_LN2 * width_bits)).astype(np.int64)


class BucketIndex:
    """Sequences grouped by bucket of exact information, with cumulative counts (exact integers).

    Args:
        logprob: ``(n,)`` exact log-probs of the indexed sequences (finite).
        width_bits: bucket width in bits of information.
    """

    def __init__(self, logprob: np.ndarray, *, width_bits: float = DEFAULT_WIDTH_BITS) -> None:
        self.width_bits = check_number(width_bits, "width_bits", above=0)
        buckets = bucket_of(logprob, self.width_bits)                   # (n,)
        # Stable: within a bucket, members keep their input order (the exact sort happens per band).
        self.members = np.argsort(buckets, kind="stable").astype(np.int32)  # (n,) sequence ids, bucket-major
        self.buckets, counts = np.unique(buckets[self.members], return_counts=True)  # (b,), (b,)
        self.cumulative = np.concatenate([[0], np.cumsum(counts)])      # (b + 1,) int64, exact
        self.total = int(self.cumulative[-1])

    def __len__(self) -> int:
        return self.total

    def locate(self, rank: int) -> tuple[int, int]:
        """``(band, offset)`` of the ``rank``-th most probable member (0-based): the band is a bucket slot."""
        if not 0 <= rank < self.total:
            raise IndexError(f"rank {rank} outside [0, {self.total})")
        band = int(np.searchsorted(self.cumulative, rank, side="right")) - 1
        return band, rank - int(self.cumulative[band])

    def band_of(self, logprob: float) -> tuple[int, bool]:
        """``(band, present)``: the slot of the bucket of ``logprob`` (or where it would be inserted)."""
        if logprob == -math.inf:     # below every bucket
            return len(self.buckets), False
        if logprob > 0.0:            # above every bucket (no sequence is more probable than certain)
            return 0, False
        bucket = int(bucket_of(logprob, self.width_bits))
        band = int(np.searchsorted(self.buckets, bucket, side="left"))
        return band, band < len(self.buckets) and int(self.buckets[band]) == bucket

    def band_members(self, band: int) -> np.ndarray:
        """``(m,)`` sequence ids in one band, in input order (not yet exactly sorted)."""
        return self.members[self.cumulative[band]:self.cumulative[band + 1]]

    def count_before(self, band: int) -> int:
        """Number of members in bands strictly more probable than ``band``."""
        return int(self.cumulative[band])

    def nbytes(self) -> int:
        return self.members.nbytes + self.buckets.nbytes + self.cumulative.nbytes
