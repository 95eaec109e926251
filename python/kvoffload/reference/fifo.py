"""FIFO: keys leave in the order they were stored; hits change nothing.

A pinned or pending key is skipped by eviction and keeps its place, so it leaves once it is
ready again and every older key has gone (the one deviation pinning forces).
"""

from __future__ import annotations

from collections.abc import Set
from typing import Any

from kvoffload.reference.policy import ChunkStatus, OwnPolicy, RequestContext

__all__ = ["FifoPolicy"]


class FifoPolicy(OwnPolicy):
    """First in, first out (``"fifo"``)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.entries: dict[bytes, ChunkStatus] = {}  # insertion order, oldest first

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Append a new key at the newest end."""
        super().insert(key, status, req_context)

    def remove(self, key: bytes) -> None:
        """Drop a failed store."""
        super().remove(key)

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """The ``n`` oldest ready, unprotected keys, or None if there are fewer."""
        victims: list[bytes] = []
        for key, status in self.entries.items():
            if len(victims) == n:
                break
            if status.is_evictable and key not in protected:
                victims.append(key)
        if len(victims) < n:
            return None
        return [(key, self.entries.pop(key)) for key in victims]

    def state(self) -> dict[str, Any]:
        """The queue oldest first as ``(key, visited)`` (never visited), as SIEVE reports it."""
        return {
            "policy": "fifo",
            "queue": [(key, False) for key in self.entries],
            "parked": [],
            "hand": None,
        }
