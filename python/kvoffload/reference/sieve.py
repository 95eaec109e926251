"""SIEVE (Zhang et al., NSDI 2024) with pinned chunks: a FIFO queue, visited bits and a hand.

A hit (a touch of a resident key, or a request's first access to one) sets the key's visited
bit. Eviction moves the hand from the oldest key toward the newest, wrapping around: a visited
key has its bit cleared and is passed, an unvisited one is evicted; the hand stays after the last
victim for the next eviction. New keys enter at the newest end.

Pinning: the hand passes a protected key (one being offered) without clearing its bit. A key
that is not ready when the hand reaches it (pinned, or its store pending) leaves the queue
("parked"), keeping its bit, and re-enters right behind the hand when it becomes ready, so the
current sweep examines it last. The Rust ``SievePolicy`` does exactly this.
"""

from __future__ import annotations

from collections.abc import Sequence, Set
from typing import Any

from kvoffload.reference.policy import ChunkStatus, OwnPolicy, RequestContext, require

__all__ = ["SievePolicy"]


class SievePolicy(OwnPolicy):
    """SIEVE (``"sieve"``); see the module docs."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.visited: dict[bytes, bool] = {}
        self.parked: set[bytes] = set()
        # The queue as a doubly linked list: newer/older neighbour of each queued key.
        self.newer: dict[bytes, bytes | None] = {}
        self.older: dict[bytes, bytes | None] = {}
        self.oldest: bytes | None = None
        self.newest: bytes | None = None
        self.hand: bytes | None = None  # the key examined next; None: start at the oldest

    def _link_before(self, key: bytes, nxt: bytes | None) -> None:
        """Queue ``key`` right before ``nxt`` (toward the oldest end); None: at the newest end."""
        prev = self.newest if nxt is None else self.older[nxt]
        self.older[key], self.newer[key] = prev, nxt
        if prev is None:
            self.oldest = key
        else:
            self.newer[prev] = key
        if nxt is None:
            self.newest = key
        else:
            self.older[nxt] = key

    def _unlink(self, key: bytes) -> None:
        """Take ``key`` out of the queue; the hand moves on if it pointed at it."""
        prev, nxt = self.older.pop(key), self.newer.pop(key)
        if self.hand == key:
            self.hand = nxt
        if prev is None:
            self.oldest = nxt
        else:
            self.newer[prev] = nxt
        if nxt is None:
            self.newest = prev
        else:
            self.older[nxt] = prev

    def _hit(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self.entries:
                self.visited[key] = True

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Queue a new key, unvisited, at the newest end."""
        super().insert(key, status, req_context)
        self.visited[key] = False
        self._link_before(key, None)

    def remove(self, key: bytes) -> None:
        """Drop a failed store."""
        super().remove(key)
        del self.visited[key]
        if key in self.parked:
            self.parked.discard(key)
        else:
            self._unlink(key)

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Sweep the hand until ``n`` unvisited, ready, unprotected keys are found (or None)."""
        if not self._can_evict(n, protected):
            return None  # before the sweep parks a key
        chosen: list[bytes] = []
        chosen_set: set[bytes] = set()
        idle = 0  # steps since the sweep chose a key or cleared a bit
        cur = self.hand
        while len(chosen) < n:
            if cur is None:
                cur = self.oldest
                if cur is None:
                    break
            nxt = self.newer[cur]
            if not self.entries[cur].is_evictable:
                self.hand = nxt
                self._unlink(cur)
                self.parked.add(cur)
            elif cur in chosen_set or cur in protected:
                idle += 1
            elif self.visited[cur]:
                self.visited[cur] = False
                idle = 0
            else:
                chosen.append(cur)
                chosen_set.add(cur)
                idle = 0
            cur = nxt
            if idle > len(self.entries):
                break
        if len(chosen) < n:
            raise AssertionError("sieve: fewer victims than counted")
        self.hand = cur
        victims = []
        for key in chosen:
            self._unlink(key)
            del self.visited[key]
            victims.append((key, self.entries.pop(key)))
        return victims

    def mark_evictable(self, key: bytes) -> None:
        """A parked key that is ready again re-enters right behind the hand."""
        super().mark_evictable(key)
        if key in self.parked:
            self.parked.discard(key)
            self._link_before(key, self.hand)

    def _queue(self) -> list[bytes]:
        keys, key = [], self.oldest
        while key is not None:
            keys.append(key)
            key = self.newer[key]
        return keys

    def state(self) -> dict[str, Any]:
        """The queue oldest first and the parked keys (sorted), as ``(key, visited)``; the hand."""
        return {
            "policy": "sieve",
            "queue": [(key, self.visited[key]) for key in self._queue()],
            "parked": sorted((key, self.visited[key]) for key in self.parked),
            "hand": self.hand,
        }

    def check_invariants(self) -> None:
        """Queue links, parked keys and residency agree."""
        super().check_invariants()
        queue = self._queue()
        require(len(queue) == len(self.newer) == len(self.older), "sieve: queue links broken")
        require(
            set(queue) | self.parked == set(self.entries) and not set(queue) & self.parked,
            "sieve: queued and parked keys do not partition the residents",
        )
        require(self.hand is None or self.hand in self.newer, "sieve: hand outside the queue")
        require(
            all(not self.entries[key].is_evictable for key in self.parked),
            "sieve: a ready key is parked",
        )
