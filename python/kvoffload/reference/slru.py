"""Segmented LRU (Karedla, Love and Wherry, IEEE Computer 1994) with pinned chunks.

Two LRU segments: probation for keys not hit since they were stored, protected (at most four
fifths of the capacity) for keys hit at least once. A new key enters probation. A hit (a touch
of a resident key, or a request's first access to one) moves the key to protected's most recent
end; when that overfills protected, its least recent linked keys go back to probation's most
recent end. Eviction takes probation's least recent key, or protected's when probation has none.
Not-ready keys met by a scan park (see ``queues``) and re-enter at their segment's least recent
end once ready; protected keys of the offer are passed over. The Rust ``SlruPolicy`` does exactly
this.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

from kvoffload.reference.policy import ChunkStatus, RequestContext, require
from kvoffload.reference.queues import QueuePolicy, Queues

__all__ = ["SlruPolicy"]


class SlruPolicy(QueuePolicy):
    """Segmented LRU (``"slru"``); see the module docs."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.protected_cap = cache_capacity * 4 // 5
        self.queues = Queues(("probation", "protected"))

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """A new key enters probation."""
        super().insert(key, status, req_context)
        self.queues.insert(key, "probation")

    def remove(self, key: bytes) -> None:
        """Drop a failed store."""
        self.queues.remove(key)
        super().remove(key)

    def _hit(self, keys: Sequence[bytes]) -> None:
        """Hits: see the module docs."""
        for key in keys:
            if key not in self.entries:
                continue
            self.queues.move_to(key, "protected")
            while self.queues.lens["protected"] > self.protected_cap:
                demoted = self.queues.oldest("protected")
                if demoted is None:
                    break  # every protected key is parked
                self.queues.move_to(demoted, "probation")

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Evict ``n`` least recent keys, probation first, or None if ``n`` cannot be found."""
        if not self._can_evict(n, protected):
            return None
        victims = []
        for _ in range(n):
            key = self.queues.first_candidate("probation", self._ready, protected.__contains__)
            if key is None:
                key = self.queues.first_candidate("protected", self._ready, protected.__contains__)
            if key is None:
                raise AssertionError("slru: fewer victims than counted")
            self.queues.remove(key)
            victims.append((key, self.entries.pop(key)))
        return victims

    def state(self) -> dict[str, Any]:
        """Both segments least recent first and parked keys (sorted), as the Rust core reports."""
        return {"policy": "slru", **self.queues.state(lambda key: 0), "ghosts": []}

    def check_invariants(self) -> None:
        """Segments and residency agree."""
        super().check_invariants()
        require(self.queues.check(set(self.entries)), "slru: segments do not match the residents")
