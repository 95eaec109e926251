"""LRU with request-ranked recency: each resident chunk has a rank, the lowest is evicted first.

A rank is ``(major, minor)``. One counter issues fresh ranks ``(k, 0)``; a request draws one
request rank ``k`` from the same counter at its first ``on_request_access``, and a key with a token
position ``p`` in that request may get ``(k, -p)`` (tails of a request go before its head).
Eviction takes ready, unprotected chunks in ascending ``(rank, key bytes)`` order.

Ready chunks are indexed by a min-heap of ``(major, minor, key)`` with lazy deletion: an item is
live while its key is resident, ready and still has that rank; anything else is skipped when popped.
"""

from __future__ import annotations

import heapq
from collections.abc import Iterator, Sequence, Set
from dataclasses import dataclass
from typing import Any

from kvoffload.reference.policy import (
    CachePolicy,
    ChunkStatus,
    RequestContext,
    finished_key_order,
    position_of,
    require,
)

__all__ = ["LruPolicy"]

Rank = tuple[int, int]
_HeapItem = tuple[int, int, bytes]


@dataclass(eq=False)
class _RequestRank:
    """The request rank an `LruPolicy` gave a request (kept on the request context)."""

    owner: LruPolicy
    epoch: int
    rank: int


class _Entry:
    """A resident key: the manager's status record and its current rank."""

    __slots__ = ("rank", "status")

    def __init__(self, status: ChunkStatus, rank: Rank) -> None:
        self.status = status
        self.rank = rank


class LruPolicy(CachePolicy):
    """Request-ranked LRU (vLLM's ``"lru"``)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self._entries: dict[bytes, _Entry] = {}
        self._next_rank = 0
        # Bumped by clear(); request ranks drawn in an older epoch are stale.
        self._epoch = 0
        # Holds a live item for every ready key, plus stale items (see module doc).
        self._heap: list[_HeapItem] = []

    # -- ranks -------------------------------------------------------------------------------

    def _fresh_rank(self) -> Rank:
        rank = (self._next_rank, 0)
        self._next_rank += 1
        return rank

    def _request_rank(self, req_context: RequestContext) -> int:
        """Return the request's rank, drawn from the counter the first time it is needed."""
        state = req_context.get_state(_RequestRank)
        if (
            not isinstance(state, _RequestRank)  # none, or not a rank of ours
            or state.owner is not self
            or state.epoch != self._epoch
        ):
            state = _RequestRank(self, self._epoch, self._fresh_rank()[0])
            req_context.set_state(state)
        return state.rank

    def _set_rank(self, key: bytes, entry: _Entry, rank: Rank) -> None:
        entry.rank = rank
        if entry.status.is_evictable:
            self._push(key, entry)

    def _push(self, key: bytes, entry: _Entry) -> None:
        heapq.heappush(self._heap, (entry.rank[0], entry.rank[1], key))
        if len(self._heap) > 2 * len(self._entries) + 64:
            self._rebuild_heap()

    def _rebuild_heap(self) -> None:
        self._heap = [
            (e.rank[0], e.rank[1], key) for key, e in self._entries.items() if e.status.is_evictable
        ]
        heapq.heapify(self._heap)

    def _is_live(self, item: _HeapItem) -> bool:
        entry = self._entries.get(item[2])
        return (
            entry is not None
            and entry.status.is_evictable
            and entry.rank[0] == item[0]
            and entry.rank[1] == item[1]
        )

    # -- CachePolicy ---------------------------------------------------------------------------

    def get(self, key: bytes) -> ChunkStatus | None:
        """Return the status of a resident key, or None."""
        entry = self._entries.get(key)
        return None if entry is None else entry.status

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Rank ``(request rank, -position)`` when the key has a position, else a fresh rank."""
        position = position_of(req_context, key)
        if position is None:
            rank = self._fresh_rank()
        else:
            rank = (self._request_rank(req_context), -position)
        entry = _Entry(status, rank)
        self._entries[key] = entry
        if status.is_evictable:
            self._push(key, entry)

    def remove(self, key: bytes) -> None:
        """Drop the key (its heap items go stale)."""
        del self._entries[key]

    def touch(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Fresh ranks from the last key to the first; absent keys are skipped."""
        for key in reversed(keys):
            entry = self._entries.get(key)
            if entry is not None:
                self._set_rank(key, entry, self._fresh_rank())

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Nothing: the keys are absent."""

    def on_request_access(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Raise resident keys with a position to ``(request rank, -position)`` if that is newer."""
        request_rank = self._request_rank(req_context)
        for key in keys:
            entry = self._entries.get(key)
            if entry is None:
                continue
            position = position_of(req_context, key)
            if position is None:
                continue
            rank = (request_rank, -position)
            if rank > entry.rank:
                self._set_rank(key, entry, rank)

    def on_request_finished(
        self,
        groups: Sequence[Sequence[bytes]],
        inserted_only: Set[bytes],
        reused: Set[bytes],
        req_context: RequestContext,
    ) -> None:
        """Fresh ranks from tail to head over the request's keys, so the head is most recent."""
        for key in reversed(finished_key_order(groups, req_context)):
            entry = self._entries.get(key)
            if entry is not None:
                self._set_rank(key, entry, self._fresh_rank())

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Remove the ``n`` lowest ``(rank, key)`` ready, unprotected keys, or return None."""
        chosen: dict[bytes, _HeapItem] = {}
        set_aside: list[_HeapItem] = []
        while len(chosen) < n and self._heap:
            item = heapq.heappop(self._heap)
            key = item[2]
            if key in chosen or not self._is_live(item):
                continue  # a duplicate or stale item: drop it
            if key in protected:
                set_aside.append(item)
            else:
                chosen[key] = item
        if len(chosen) < n:
            set_aside.extend(chosen.values())  # all-or-nothing: put the choices back too
        for item in set_aside:
            heapq.heappush(self._heap, item)
        if len(chosen) < n:
            return None
        return [(key, self._entries.pop(key).status) for key in chosen]

    def clear(self) -> None:
        """Forget every key, the rank counter and all request ranks."""
        self._entries = {}
        self._heap = []
        self._next_rank = 0
        self._epoch += 1

    def mark_evictable(self, key: bytes) -> None:
        """Index the key in the eviction heap."""
        self._push(key, self._entries[key])

    def items(self) -> Iterator[tuple[bytes, ChunkStatus]]:
        """Iterate over every resident key with its status."""
        return ((key, entry.status) for key, entry in self._entries.items())

    # -- introspection -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """``{"policy": "lru", "ranks": {key: (major, minor)}, "next_rank": int}``."""
        return {
            "policy": "lru",
            "ranks": {key: entry.rank for key, entry in self._entries.items()},
            "next_rank": self._next_rank,
        }

    def check_invariants(self) -> None:
        """Check that ranks were issued by the counter and ready keys have live heap items."""
        live = {item for item in self._heap if self._is_live(item)}
        for key, entry in self._entries.items():
            major, minor = entry.rank
            require(
                0 <= major < self._next_rank,
                f"LRU: rank {entry.rank} of {key!r} was not issued (next rank {self._next_rank})",
            )
            require(
                not entry.status.is_evictable or (major, minor, key) in live,
                f"LRU: ready key {key!r} has no live heap item",
            )
