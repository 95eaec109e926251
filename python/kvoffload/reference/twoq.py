"""2Q (Johnson and Shasha, VLDB 1994), full version, with pinned chunks.

A1in is a FIFO for keys seen once (a quarter of the capacity), Am an LRU for the rest, A1out a
ghost FIFO of keys evicted from A1in (half the capacity). A new key enters A1in, or Am if it is a
ghost. A hit (a touch of a resident key, or a request's first access to one) moves an Am key to
Am's most recent end; a hit in A1in changes nothing. Eviction takes A1in's oldest key (its key
becoming a ghost) while A1in holds more than its share, else Am's least recent; when the
preferred queue has no candidate, the other gives the victim. Not-ready keys met by a scan park
(see ``queues``) and re-enter at their queue's oldest end once ready; protected keys are passed
over; a hit on a parked Am key links it at Am's most recent end. The Rust ``TwoQPolicy`` does
exactly this.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set
from typing import Any

from kvoffload.reference.policy import ChunkStatus, RequestContext, require
from kvoffload.reference.queues import QueuePolicy, Queues

__all__ = ["TwoQPolicy"]


class TwoQPolicy(QueuePolicy):
    """2Q (``"2q"``); see the module docs."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.kin = max(cache_capacity // 4, 1)
        self.kout = max(cache_capacity // 2, 1)
        self.queues = Queues(("a1in", "am"))
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """A new key enters A1in, or Am when it is a ghost (leaving A1out)."""
        super().insert(key, status, req_context)
        if key in self.ghosts:
            del self.ghosts[key]
            self.queues.insert(key, "am")
        else:
            self.queues.insert(key, "a1in")

    def remove(self, key: bytes) -> None:
        """Drop a failed store (no ghost)."""
        self.queues.remove(key)
        super().remove(key)

    def _hit(self, keys: Sequence[bytes]) -> None:
        """Hits: see the module docs."""
        for key in keys:
            if self.queues.queue_of.get(key) == "am":
                self.queues.move_to(key, "am")

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Evict ``n`` keys by the 2Q rule, or None if ``n`` cannot be found."""
        if not self._can_evict(n, protected):
            return None
        victims = []
        for _ in range(n):
            order = ("a1in", "am") if self.queues.lens["a1in"] > self.kin else ("am", "a1in")
            found = None
            for queue in order:
                key = self.queues.first_candidate(queue, self._ready, protected.__contains__)
                if key is not None:
                    found = (queue, key)
                    break
            if found is None:
                raise AssertionError("2q: fewer victims than counted")
            queue, key = found
            self.queues.remove(key)
            if queue == "a1in":
                self.ghosts[key] = None
                while len(self.ghosts) > self.kout:
                    self.ghosts.popitem(last=False)
            victims.append((key, self.entries.pop(key)))
        return victims

    def state(self) -> dict[str, Any]:
        """A1in and Am oldest first, parked keys (sorted) and ghosts, as the Rust core reports."""
        return {
            "policy": "2q",
            **self.queues.state(lambda key: 0),
            "ghosts": list(self.ghosts),
        }

    def check_invariants(self) -> None:
        """Queues and residency agree; A1out within its bound."""
        super().check_invariants()
        require(self.queues.check(set(self.entries)), "2q: queues do not match the residents")
        require(len(self.ghosts) <= self.kout, "2q: A1out over its bound")
