"""The admission tracker: how often each key was offered to ``prepare_store`` (bounded).

Used only when ``store_threshold >= 2``; a candidate is stored once its count reaches the threshold.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from kvoffload.reference.policy import require

__all__ = ["AdmissionTracker"]


class AdmissionTracker:
    """At most ``max_size`` keys with their offer counts, least recently offered first."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self._counts: OrderedDict[bytes, int] = OrderedDict()

    def count(self, key: bytes) -> int:
        """Return the key's offer count (0 when untracked)."""
        return self._counts.get(key, 0)

    def count_after_one_offer(self, key: bytes) -> int:
        """Return the count the key would have after an offer listing it once.

        An untracked key ends at 1 or, when the table is full of protected keys, at 0; either is
        below any threshold the tracker is used with (>= 2), so 1 stands for both.
        """
        return self._counts.get(key, 0) + 1

    def count_offer(self, keys: Sequence[bytes]) -> None:
        """Count one offer, in two passes over ``keys`` in order.

        Pass 1 adds 1 per occurrence to every tracked key and moves it to the newest end. Pass 2
        adds every key still untracked with count 1 at the newest end, first dropping the oldest
        entry when the table is full. Keys of this offer are never dropped: they all sit at the
        newest end, so the oldest entry is droppable exactly when some entry is not one of them.
        """
        counts = self._counts
        offered: set[bytes] = set()  # keys of this offer that are tracked
        for key in keys:
            if key in counts:
                counts[key] += 1
                counts.move_to_end(key)
                offered.add(key)
        for key in keys:
            if key in counts:
                continue
            if len(counts) >= self.max_size:
                if len(counts) == len(offered):
                    continue  # only keys of this offer are left: leave this one untracked
                counts.popitem(last=False)
            counts[key] = 1
            offered.add(key)

    def state(self) -> list[tuple[bytes, int]]:
        """``(key, count)`` pairs, oldest first."""
        return list(self._counts.items())

    def __len__(self) -> int:
        return len(self._counts)

    def check_invariants(self) -> None:
        """Check that the table fits its bound and every count is positive."""
        require(
            len(self._counts) <= self.max_size,
            f"tracker holds {len(self._counts)} keys, max {self.max_size}",
        )
        bad = [(k, c) for k, c in self._counts.items() if c < 1]
        require(not bad, f"tracker has non-positive counts {bad!r}")
