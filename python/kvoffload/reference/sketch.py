"""The TinyLFU frequency sketch, counter for counter as the Rust core's ``FrequencySketch``.

A count-min sketch of four rows of saturating 4-bit counters; a key's estimate is the least of
its counters; after ``10 * width`` counts every counter is halved at the start of the next
offer. ``sketch_hash`` folds the key's length and 8-byte little-endian words through splitmix64,
the same function the Rust side uses, so both managers index the same counters.
"""

from __future__ import annotations

__all__ = ["FrequencySketch", "sketch_hash"]

_MASK = (1 << 64) - 1
_SEEDS = (0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0x85EBCA77C2B2AE63)
_MAX_COUNT = 15
_SAMPLES_PER_COUNTER = 10


def _mix(z: int) -> int:
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK
    return z ^ (z >> 31)


def sketch_hash(key: bytes) -> int:
    """The sketch's 64-bit hash of ``key``."""
    h = _mix(len(key))
    for i in range(0, len(key), 8):
        h = _mix(h ^ int.from_bytes(key[i : i + 8].ljust(8, b"\0"), "little"))
    return h


class FrequencySketch:
    """Estimated offer counts with aging; ``width`` rounds up to a power of two (>= 16)."""

    def __init__(self, threshold: int, width: int) -> None:
        width = 1 << (max(width, 16) - 1).bit_length()
        self.threshold = threshold
        self.width = width
        self.table = bytearray(len(_SEEDS) * width)
        self.samples = 0
        self.sample_size = _SAMPLES_PER_COUNTER * width

    def _slots(self, h: int) -> list[int]:
        return [
            r * self.width + (_mix(h ^ seed) & (self.width - 1)) for r, seed in enumerate(_SEEDS)
        ]

    def estimate(self, h: int) -> int:
        """The least of the key's counters."""
        return min(self.table[i] for i in self._slots(h))

    def would_admit_next(self, h: int, counted_now: bool) -> bool:
        """Whether the next offer admits the key.

        Its estimate after a reset that is due, plus one if that offer counts it, must reach the
        threshold.
        """
        estimate = self.estimate(h)
        if self.samples >= self.sample_size:
            estimate >>= 1
        return estimate + int(counted_now) >= self.threshold

    def increment(self, h: int) -> None:
        """Count one occurrence (counters saturate at 15)."""
        for i in self._slots(h):
            if self.table[i] < _MAX_COUNT:
                self.table[i] += 1
        self.samples += 1

    def age_if_due(self) -> None:
        """Halve every counter once enough counts have accumulated."""
        if self.samples >= self.sample_size:
            self.table = bytearray(c >> 1 for c in self.table)
            self.samples //= 2
