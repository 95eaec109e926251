"""ARC: resident lists T1 (seen once) and T2 (reused), ghost lists B1/B2 of evicted keys.

Every list is ordered oldest to newest. ``target`` is the real-valued target size of T1
(0 to capacity), moved by ghost hits; eviction prefers T1 while T1 is at least ``int(target)``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence, Set
from itertools import chain
from typing import Any

from kvoffload.reference.policy import (
    CachePolicy,
    ChunkStatus,
    RequestContext,
    finished_key_order,
    require,
)

__all__ = ["ArcPolicy"]


class ArcPolicy(CachePolicy):
    """Adaptive replacement cache (vLLM's ``"arc"``); the capacity is the pool size."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.t1: OrderedDict[bytes, ChunkStatus] = OrderedDict()
        self.t2: OrderedDict[bytes, ChunkStatus] = OrderedDict()
        self.b1: OrderedDict[bytes, None] = OrderedDict()
        self.b2: OrderedDict[bytes, None] = OrderedDict()
        self.target_t1_size = 0.0

    def _ghost_hit(self, key: bytes) -> None:
        """Adapt the target to a request for an evicted key; nothing if it is not a ghost."""
        if key in self.b1:
            delta = max(1, len(self.b2) / len(self.b1))
            self.target_t1_size = float(min(self.target_t1_size + delta, self.cache_capacity))
            self.b1.move_to_end(key)
        elif key in self.b2:
            delta = max(1, len(self.b1) / len(self.b2))
            self.target_t1_size = float(max(self.target_t1_size - delta, 0))
            self.b2.move_to_end(key)

    def get(self, key: bytes) -> ChunkStatus | None:
        """Return the status of a key in T1 or T2, or None."""
        status = self.t1.get(key)
        return status if status is not None else self.t2.get(key)

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Put a new key at T1's newest end and out of the ghost lists."""
        self.t1[key] = status
        self.b1.pop(key, None)
        self.b2.pop(key, None)

    def remove(self, key: bytes) -> None:
        """Drop a failed store from T1/T2 without leaving a ghost."""
        if self.t1.pop(key, None) is None:
            del self.t2[key]

    def touch(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Last to first: readable T1 keys are promoted to T2, others move to their newest end."""
        for key in reversed(keys):
            status = self.t1.get(key)
            if status is not None:
                if status.is_ready:
                    del self.t1[key]
                    self.t2[key] = status
                else:
                    self.t1.move_to_end(key)
            elif key in self.t2:
                self.t2.move_to_end(key)
            else:
                self._ghost_hit(key)

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Ghost hits for the offered absent keys, last to first."""
        for key in reversed(keys):
            self._ghost_hit(key)

    def on_request_finished(
        self,
        groups: Sequence[Sequence[bytes]],
        inserted_only: Set[bytes],
        reused: Set[bytes],
        req_context: RequestContext,
    ) -> None:
        """Tail to head: reused keys go to T2's newest end, inserted-only keys to their list's."""
        for key in reversed(finished_key_order(groups, req_context)):
            if key in reused:
                status = self.t1.pop(key, None)
                if status is not None:
                    self.t2[key] = status
                elif key in self.t2:
                    self.t2.move_to_end(key)
            elif key in inserted_only:
                if key in self.t1:
                    self.t1.move_to_end(key)
                elif key in self.t2:
                    self.t2.move_to_end(key)

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Choose ``n`` victims by the ARC rule, then move them to the ghost lists (or None)."""

        def candidates(lst: OrderedDict[bytes, ChunkStatus]) -> Iterator[bytes]:
            # Oldest first; a key skipped once stays ineligible for this call, so each list is
            # walked at most once however many victims are taken.
            return (k for k, s in lst.items() if s.is_evictable and k not in protected)

        t1_candidates, t2_candidates = candidates(self.t1), candidates(self.t2)
        virtual_t1_size = len(self.t1)
        victims: list[tuple[bytes, bool]] = []  # (key, came from T1)
        for _ in range(n):
            key, from_t1 = None, False
            if virtual_t1_size >= int(self.target_t1_size):
                key = next(t1_candidates, None)
                from_t1 = key is not None
            if key is None:
                key = next(t2_candidates, None)
            if key is None:
                key = next(t1_candidates, None)
                from_t1 = key is not None
            if key is None:
                return None
            if from_t1:
                virtual_t1_size -= 1
            victims.append((key, from_t1))

        evicted = []
        for key, from_t1 in victims:
            if from_t1:
                evicted.append((key, self.t1.pop(key)))
                self.b1[key] = None
            else:
                evicted.append((key, self.t2.pop(key)))
                self.b2[key] = None
        for ghosts in (self.b1, self.b2):
            while len(ghosts) > self.cache_capacity:
                ghosts.popitem(last=False)
        return evicted

    def clear(self) -> None:
        """Empty every list and reset the target to 0."""
        self.t1.clear()
        self.t2.clear()
        self.b1.clear()
        self.b2.clear()
        self.target_t1_size = 0.0

    def items(self) -> Iterator[tuple[bytes, ChunkStatus]]:
        """Every key of T1 and T2 with its status."""
        return chain(self.t1.items(), self.t2.items())

    # -- introspection -------------------------------------------------------------------------

    def state(self) -> dict[str, Any]:
        """Return the four lists (oldest to newest) and the target size of T1."""
        return {
            "policy": "arc",
            "t1": list(self.t1),
            "t2": list(self.t2),
            "b1": list(self.b1),
            "b2": list(self.b2),
            "target_t1_size": float(self.target_t1_size),
        }

    def _check_ghost_bounds(self) -> None:
        cap = self.cache_capacity
        require(len(self.b1) <= cap, f"ARC: B1 has {len(self.b1)} keys, capacity {cap}")
        require(len(self.b2) <= cap, f"ARC: B2 has {len(self.b2)} keys, capacity {cap}")

    def check_invariants(self) -> None:
        """Check that the four lists are disjoint and fit the capacity."""
        cap = self.cache_capacity
        require(len(self.t1) + len(self.t2) <= cap, "ARC: T1 and T2 hold more than the capacity")
        self._check_ghost_bounds()
        t1, t2, b1, b2 = (lst.keys() for lst in (self.t1, self.t2, self.b1, self.b2))
        for name, overlap in (
            ("T1/T2", t1 & t2),
            ("B1/B2", b1 & b2),
            ("T1/B1", t1 & b1),
            ("T1/B2", t1 & b2),
            ("T2/B1", t2 & b1),
            ("T2/B2", t2 & b2),
        ):
            require(not overlap, f"ARC: {name} share keys {sorted(overlap)!r}")
        require(isinstance(self.target_t1_size, float), "ARC: target size is not a float")
