"""LFU with aging (LFU-Aging, Arlitt et al., 2000) with pinned chunks.

Each resident key has a count from 1 (its store) to 15, raised by a hit (a touch of a resident
key, or a request's first access to one). Eviction takes the key with the lowest count, the one
that reached it first among equals. When the average count exceeds 4, every count is halved
(rounding down): queues are emptied from count 1 up, each key going to the newest end of its new
queue. Not-ready keys met by a scan park (see ``queues``) and re-enter at their queue's oldest
end once ready; protected keys of the offer are passed over. The Rust ``LfuPolicy`` does exactly
this.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

from kvoffload.reference.policy import ChunkStatus, RequestContext, require
from kvoffload.reference.queues import QueuePolicy, Queues

__all__ = ["LfuPolicy"]

MAX_COUNT = 15
MAX_AVERAGE = 4


class LfuPolicy(QueuePolicy):
    """LFU with aging (``"lfu"``); see the module docs."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.queues = Queues([str(n) for n in range(MAX_COUNT + 1)])
        self.total = 0  # sum of the counts

    def _count(self, key: bytes) -> int:
        return int(self.queues.queue_of[key])

    def _hit(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key not in self.entries:
                continue
            n = self._count(key)
            if n < MAX_COUNT:
                self.queues.move_to(key, str(n + 1))
                self.total += 1
                if self.total > MAX_AVERAGE * len(self.entries):
                    self._age()

    def _age(self) -> None:
        """Halve every count, keeping each queue's order."""
        q = self.queues
        for n in range(1, MAX_COUNT + 1):
            for key in list(q.linked[str(n)]):
                q.move_to(key, str(n // 2))
            for key in [k for k in q.parked if q.queue_of[k] == str(n)]:
                q.lens[str(n)] -= 1
                q.queue_of[key] = str(n // 2)
                q.lens[str(n // 2)] += 1
        self.total = sum(n * q.lens[str(n)] for n in range(MAX_COUNT + 1))

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """A new key starts at count 1."""
        super().insert(key, status, req_context)
        self.queues.insert(key, "1")
        self.total += 1

    def remove(self, key: bytes) -> None:
        """Drop a failed store."""
        super().remove(key)
        self._unqueue(key)

    def _unqueue(self, key: bytes) -> None:
        """Take a key (a failed store, or a victim) out of its queue and the count total."""
        self.total -= self._count(key)
        self.queues.remove(key)

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Evict ``n`` keys, lowest count first, or None if ``n`` cannot be found."""
        if not self._can_evict(n, protected):
            return None
        victims = []
        for _ in range(n):
            found = None
            for count in range(MAX_COUNT + 1):
                found = self.queues.first_candidate(str(count), self._ready, protected.__contains__)
                if found is not None:
                    break
            if found is None:
                raise AssertionError("lfu: fewer victims than counted")
            self._unqueue(found)
            victims.append((found, self.entries.pop(found)))
        return victims

    def state(self) -> dict[str, Any]:
        """One queue per count, oldest first, parked keys (sorted), as the Rust core reports."""
        return {"policy": "lfu", **self.queues.state(self._count), "ghosts": []}

    def check_invariants(self) -> None:
        """Queues, residency and the count total agree."""
        super().check_invariants()
        require(self.queues.check(set(self.entries)), "lfu: queues do not match the residents")
        total = sum(n * self.queues.lens[str(n)] for n in range(MAX_COUNT + 1))
        require(total == self.total, "lfu: count total drifted")
