"""The FAST 2003 paper's ARC as libCacheSim 0.3.5 implements it (``"arc-paper"``), on vLLM's ARC.

vLLM's ARC (the manager's ``arc``) and libCacheSim 0.3.5's ARC (``ARC.c``, the FAST'03 paper's
algorithm) differ in exactly three ways; each is a switch here, so that all three on reproduce
libCacheSim's miss ratios and all three off is vLLM's ARC (`ArcPolicy`) unchanged:

1. ``ghost_hit_to_t2``: a key requested while in a ghost list is inserted at T2's newest end
   (paper: case II/III). vLLM inserts every new key into T1.
2. ``paper_replace``: REPLACE evicts T1's oldest key when ``0 < |T1|`` and (``|T1| > p`` or
   ``|T1| == p`` and the request was a B2 ghost hit), or when T2 is empty; otherwise T2's oldest.
   vLLM evicts from T1 whenever ``|T1| >= floor(p)``.
3. ``paper_directory``: on a miss that is not a ghost hit, with ``|T1| + |B1| >= c``, B1's oldest
   key is dropped (or, with B1 empty, T1's oldest is evicted with no ghost); otherwise, with
   ``|T1| + |T2| + |B1| + |B2| >= 2c``, B2's oldest is dropped; then REPLACE. vLLM keeps every
   victim as a ghost and trims B1 and B2 to ``c`` each.

The target ``p`` moves identically in both (``max(1, |B2|/|B1|)`` up on a B1 hit, ``max(1,
|B1|/|B2|)`` down on a B2 hit, real-valued, within ``[0, c]``). ``LibCacheSimArc`` (all three on)
is the built-in ``"arc-paper"`` of both managers; the Rust core's ``ArcPolicy::paper`` does the
same step for step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence, Set
from typing import Any

from kvoffload.reference.arc import ArcPolicy
from kvoffload.reference.policy import ChunkStatus, RequestContext, enough_ready

__all__ = ["LibCacheSimArc", "VllmArcWithSwitches"]


class VllmArcWithSwitches(ArcPolicy):
    """vLLM's ARC with libCacheSim's three differences as switches (all off by default)."""

    ghost_hit_to_t2 = False
    paper_replace = False
    paper_directory = False

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        # The key of the current ghost hit (between on_store_miss and insert), and its list.
        self._ghost_key: bytes | None = None
        self._ghost_in_b2 = False
        # Resident keys that are pending or pinned (not evictable), for all-or-nothing evict.
        self._not_ready = 0

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Ghost hits (as vLLM), remembering the last one for insert and REPLACE."""
        self._ghost_key = None
        for key in reversed(keys):
            if key in self.b1 or key in self.b2:
                self._ghost_key, self._ghost_in_b2 = key, key in self.b2
        super().on_store_miss(keys, req_context)

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Insert into T1, or into T2 after a ghost hit when ``ghost_hit_to_t2``."""
        super().insert(key, status, req_context)
        self._not_ready += 1
        if self.ghost_hit_to_t2 and key == self._ghost_key:
            self.t2[key] = self.t1.pop(key)
        if key == self._ghost_key:
            self._ghost_key = None

    def remove(self, key: bytes) -> None:
        """Drop a failed (pending) store."""
        super().remove(key)
        self._not_ready -= 1

    def mark_evictable(self, key: bytes) -> None:
        """A key became ready."""
        self._not_ready -= 1

    def mark_non_evictable(self, key: bytes) -> None:
        """A ready key got pinned."""
        self._not_ready += 1

    def clear(self) -> None:
        """Forget everything."""
        super().clear()
        self._ghost_key = None
        self._not_ready = 0

    def _oldest(self, lst: OrderedDict[bytes, ChunkStatus], protected: Set[bytes]) -> bytes | None:
        return next((k for k, s in lst.items() if s.is_evictable and k not in protected), None)

    def _replace(self, protected: Set[bytes]) -> tuple[bytes, ChunkStatus] | None:
        """Evict one key into its ghost list by the paper's (or vLLM's) rule."""
        t1_len, p = len(self.t1), self.target_t1_size
        if self.paper_replace:
            in_b2 = self._ghost_key is not None and self._ghost_in_b2
            from_t1 = (t1_len > 0 and (t1_len > p or (t1_len == p and in_b2))) or not self.t2
        else:
            from_t1 = t1_len >= int(p)
        order = (self.t1, self.t2) if from_t1 else (self.t2, self.t1)
        for lst, ghosts in ((o, self.b1 if o is self.t1 else self.b2) for o in order):
            key = self._oldest(lst, protected)
            if key is not None:
                ghosts[key] = None
                return key, lst.pop(key)
        return None

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Evict ``n`` keys, one REPLACE at a time (all or nothing)."""
        if not (self.paper_replace or self.paper_directory):
            return super().evict(n, protected)
        resident = len(self.t1) + len(self.t2)
        if not enough_ready(n, protected, resident, self._not_ready, self.get):
            return None
        victims: list[tuple[bytes, ChunkStatus]] = []
        for _ in range(n):
            victim = self._directory_step(protected) if self.paper_directory else None
            victim = victim or self._replace(protected)
            if victim is None:  # cannot happen: enough keys are ready
                raise AssertionError("no ARC victim")
            victims.append(victim)
        if not self.paper_directory:
            for ghosts in (self.b1, self.b2):
                while len(ghosts) > self.cache_capacity:
                    ghosts.popitem(last=False)
        return victims

    def _directory_step(self, protected: Set[bytes]) -> tuple[bytes, ChunkStatus] | None:
        """The paper's case IV bookkeeping; returns a victim only when it evicts with no ghost."""
        if self._ghost_key is not None:
            return None  # ghost hit: REPLACE only
        c = self.cache_capacity
        if len(self.t1) + len(self.b1) + 1 > c:
            if self.b1:
                self.b1.popitem(last=False)
                return None
            key = self._oldest(self.t1, protected)
            return None if key is None else (key, self.t1.pop(key))
        if len(self.t1) + len(self.b1) + len(self.t2) + len(self.b2) >= 2 * c and self.b2:
            self.b2.popitem(last=False)
        return None


class LibCacheSimArc(VllmArcWithSwitches):
    """libCacheSim 0.3.5's ARC (the paper's): all three switches on; ``"arc-paper"``."""

    ghost_hit_to_t2 = True
    paper_replace = True
    paper_directory = True

    def state(self) -> dict[str, Any]:
        """ARC's lists and target, under this policy's name."""
        return {**super().state(), "policy": "arc-paper"}

    def _check_ghost_bounds(self) -> None:
        # The paper bounds the directory only on misses it can evict for, which pinned chunks
        # can prevent: its ghost lists have no fixed bound.
        pass
