"""S3-FIFO (Yang et al., SOSP 2023) with pinned chunks: small, main and ghost FIFO queues.

S holds a tenth of the capacity (at least 1), M the rest, G as many ghost keys as M holds.
Each resident key has a frequency of 0 to 3, raised by a hit (a touch of a resident key, or a
request's first access to one). A new key enters S, or M if it is a ghost. To evict one key:
while S holds at least its share, S's oldest key moves to M when its frequency is above 1 (M
evicting one key if that overfills it) and is evicted otherwise, its key becoming a ghost;
otherwise M's oldest key goes back to M's newest end with its frequency lowered by one when it
has any, and is evicted otherwise. Eviction stops as soon as the batch has its count.

Pinning: a key that is not ready when a scan reaches it leaves its queue ("parked", still
counted in the queue's length) and re-enters at the queue's oldest end once ready; a protected
key (being offered) is passed over. The Rust ``S3FifoPolicy`` does exactly this.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence, Set
from typing import Any

from kvoffload.reference.policy import ChunkStatus, OwnPolicy, RequestContext, require

__all__ = ["S3FifoPolicy"]

MAX_FREQ = 3


class S3FifoPolicy(OwnPolicy):
    """S3-FIFO (``"s3fifo"``); see the module docs."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.small_cap = max(cache_capacity // 10, 1)
        self.main_cap = max(cache_capacity - self.small_cap, 0)
        self.freq: dict[bytes, int] = {}
        # Linked entries, oldest first; parked entries map to their queue's name.
        self.small: OrderedDict[bytes, None] = OrderedDict()
        self.main: OrderedDict[bytes, None] = OrderedDict()
        self.parked: dict[bytes, str] = {}
        self.small_len = 0  # parked entries included
        self.main_len = 0
        self.ghosts: OrderedDict[bytes, None] = OrderedDict()

    def _first_candidate(
        self, queue: OrderedDict[bytes, None], name: str, protected: Set[bytes]
    ) -> bytes | None:
        """The oldest ready, unprotected key of ``queue``; keys not ready before it are parked."""
        parked, found = [], None
        for key in queue:
            if not self.entries[key].is_evictable:
                parked.append(key)
            elif key not in protected:
                found = key
                break
        for key in parked:
            del queue[key]
            self.parked[key] = name
        return found

    def _drop(self, key: bytes, victims: list[tuple[bytes, ChunkStatus]]) -> None:
        if key in self.small:
            del self.small[key]
            self.small_len -= 1
            if self.main_cap > 0:
                self.ghosts[key] = None
                self.ghosts.move_to_end(key)
                while len(self.ghosts) > self.main_cap:
                    self.ghosts.popitem(last=False)
        else:
            del self.main[key]
            self.main_len -= 1
        del self.freq[key]
        victims.append((key, self.entries.pop(key)))

    def _evict_main(self, protected: Set[bytes], victims: list[tuple[bytes, ChunkStatus]]) -> bool:
        while (key := self._first_candidate(self.main, "main", protected)) is not None:
            if self.freq[key] > 0:
                self.freq[key] -= 1
                self.main.move_to_end(key)
            else:
                self._drop(key, victims)
                return True
        return False

    def _evict_small(
        self, protected: Set[bytes], victims: list[tuple[bytes, ChunkStatus]], target: int
    ) -> bool:
        before = len(victims)
        while len(victims) < target:
            key = self._first_candidate(self.small, "small", protected)
            if key is None:
                break
            if self.freq[key] > 1:
                del self.small[key]
                self.small_len -= 1
                self.main[key] = None
                self.main_len += 1
                if self.main_len > self.main_cap:
                    self._evict_main(protected, victims)
            else:
                self._drop(key, victims)
                break
        return len(victims) > before

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """A new key enters S, or M when it is a ghost (leaving G)."""
        super().insert(key, status, req_context)
        self.freq[key] = 0
        if self.ghosts.pop(key, 0) is None:
            self.main[key] = None
            self.main_len += 1
        else:
            self.small[key] = None
            self.small_len += 1

    def remove(self, key: bytes) -> None:
        """Drop a failed store (no ghost)."""
        queue = self.parked.pop(key, None)
        if queue is None:
            queue = "small" if key in self.small else "main"
            del (self.small if queue == "small" else self.main)[key]
        if queue == "small":
            self.small_len -= 1
        else:
            self.main_len -= 1
        super().remove(key)
        del self.freq[key]

    def _hit(self, keys: Sequence[bytes]) -> None:
        for key in keys:
            if key in self.entries:
                self.freq[key] = min(self.freq[key] + 1, MAX_FREQ)

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Evict ``n`` keys by the S3-FIFO rule, or None if ``n`` cannot be found."""
        if not self._can_evict(n, protected):
            return None
        victims: list[tuple[bytes, ChunkStatus]] = []
        steps: tuple[Callable[[], bool], Callable[[], bool]]
        while len(victims) < n:
            small = lambda: self._evict_small(protected, victims, n)  # noqa: E731
            main = lambda: self._evict_main(protected, victims)  # noqa: E731
            steps = (small, main) if self.small_len >= self.small_cap else (main, small)
            if not (steps[0]() or steps[1]()):
                raise AssertionError("s3fifo: fewer victims than counted")
        return victims

    def mark_evictable(self, key: bytes) -> None:
        """A parked key that is ready again re-enters at its queue's oldest end."""
        super().mark_evictable(key)
        queue = self.parked.pop(key, None)
        if queue is not None:
            target = self.small if queue == "small" else self.main
            target[key] = None
            target.move_to_end(key, last=False)

    def state(self) -> dict[str, Any]:
        """S and M oldest first and parked keys (sorted) with frequencies; ghosts oldest first."""
        return {
            "policy": "s3fifo",
            "small": [(key, self.freq[key]) for key in self.small],
            "main": [(key, self.freq[key]) for key in self.main],
            "parked": sorted((key, queue, self.freq[key]) for key, queue in self.parked.items()),
            "ghosts": list(self.ghosts),
        }

    def check_invariants(self) -> None:
        """Queue lengths, parked keys and residency agree."""
        super().check_invariants()
        parked_small = sum(1 for q in self.parked.values() if q == "small")
        require(self.small_len == len(self.small) + parked_small, "s3fifo: S length drifted")
        require(
            self.main_len == len(self.main) + len(self.parked) - parked_small,
            "s3fifo: M length drifted",
        )
        require(
            set(self.small) | set(self.main) | set(self.parked) == set(self.entries),
            "s3fifo: queues do not hold exactly the residents",
        )
        require(len(self.ghosts) <= self.main_cap, "s3fifo: ghost queue over its bound")
