"""The cache-policy interface the reference manager drives, and the chunk record policies hold.

A policy owns the table of resident keys: it maps each key to the `ChunkStatus` the manager
created for it and decides the eviction order. The manager owns the status *values* (it sets
``ref_cnt``) and tells the policy about every change that matters for eviction. Out-of-tree
policies (``cache_policy`` + ``cache_policy_module_path``) are built as
``cls(cache_capacity=num_chunks)`` and must provide the same methods as `CachePolicy`; deriving
from it gives the documented defaults. ``items()`` is kvoffload's addition to vLLM's method set:
the manager's ``resident()`` and ``check_invariants()`` enumerate residents through it.
"""

from __future__ import annotations

import operator
from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence, Set
from typing import Any, Protocol, TypeVar

from kvoffload.errors import InvalidArgumentError, InvariantViolation

__all__ = [
    "CachePolicy",
    "ChunkStatus",
    "OwnPolicy",
    "RequestContext",
    "finished_key_order",
    "position_of",
    "require",
    "sorted_by_position",
]

_T = TypeVar("_T")


class RequestContext(Protocol):
    """What the manager and the policies use of a request context (vLLM's ``ReqContext`` fits)."""

    def get_state(self, cls: type[_T]) -> _T | None:
        """Return the value stored under ``cls``, or None."""

    def set_state(self, val: Any) -> None:
        """Store ``val`` under its own type."""

    def get_offload_key_position(self, key: bytes) -> int | None:
        """Return the end-token position of ``key`` in this request, or None."""


class ChunkStatus:
    """One resident chunk: its pool slot and its ref count (-1 pending, 0 ready, n > 0 pinned)."""

    __slots__ = ("chunk_id", "ref_cnt")

    def __init__(self, chunk_id: int, ref_cnt: int = -1) -> None:
        self.chunk_id = chunk_id
        self.ref_cnt = ref_cnt

    @property
    def is_ready(self) -> bool:
        """True when the chunk is readable and nobody pins it, i.e. it may be evicted."""
        return self.ref_cnt == 0

    @property
    def is_readable(self) -> bool:
        """True once the store completed (ready or pinned)."""
        return self.ref_cnt >= 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


def position_of(req_context: RequestContext, key: bytes) -> int | None:
    """Return the key's token position in the request or None; reject a non-int position."""
    position = req_context.get_offload_key_position(key)
    if position is None:
        return None
    try:
        return operator.index(position)
    except TypeError:
        raise InvalidArgumentError(
            f"position of key {key!r} must be an int, got {type(position).__name__}"
        ) from None


def sorted_by_position(keys: list[bytes], req_context: RequestContext) -> list[bytes]:
    """Sort keys stably by token position when every key has one; else keep their order."""
    positions = [position_of(req_context, key) for key in keys]
    known = [p for p in positions if p is not None]
    if len(known) < len(keys):
        return keys
    return [key for _, key in sorted(zip(known, keys, strict=True), key=lambda pk: pk[0])]


def finished_key_order(
    groups: Sequence[Sequence[bytes]], req_context: RequestContext
) -> list[bytes]:
    """Return a finished request's keys from head to tail, as LRU and ARC walk them.

    The groups (in ascending group order) are concatenated; when every key has a position the
    whole list is stably sorted by position, so at equal positions the lower group comes first.
    """
    return sorted_by_position([key for group in groups for key in group], req_context)


class CachePolicy(ABC):
    """Decides which resident chunks to evict. Method names and roles follow vLLM 0.33.0.

    Call protocol of the manager:

    - ``insert`` a key as pending (``ref_cnt == -1``); the key is absent before.
    - ``mark_evictable(key)`` right after its ``ref_cnt`` became 0 (store completed, or the last
      load finished); ``mark_non_evictable(key)`` right after it went from 0 to 1.
    - ``remove`` a pending key whose store failed (no eviction bookkeeping, e.g. no ARC ghost).
    - ``evict(n, protected)`` is all-or-nothing: it removes and returns exactly ``n`` ready keys
      not in ``protected``, in eviction order, or returns None and changes nothing.
    - ``clear`` drops everything (``reset_cache``).
    - ``items`` lists the resident keys; the manager uses it only for introspection and
      ``check_invariants``.
    """

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: bytes) -> ChunkStatus | None:
        """Return the status of a resident key, or None when it is absent."""

    @abstractmethod
    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Add an absent key (pending) on behalf of ``req_context``."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Drop a key whose store failed."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Mark keys as recently used; the first key is the most recent."""

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Handle a request offering absent keys for the first time (default: a touch)."""
        self.touch(keys, req_context)

    def on_request_access(  # noqa: B027 (an optional hook: the default does nothing)
        self, keys: Sequence[bytes], req_context: RequestContext
    ) -> None:
        """Handle a request recording keys it had not seen before, in call order (default: none)."""

    def on_request_finished(
        self,
        groups: Sequence[Sequence[bytes]],
        inserted_only: Set[bytes],
        reused: Set[bytes],
        req_context: RequestContext,
    ) -> None:
        """Handle a finished request: its keys per KV group, and which it inserted or reused.

        The default touches each group in turn, in ascending group order.
        """
        for group in groups:
            self.touch(group, req_context)

    @abstractmethod
    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Remove and return ``n`` ready, unprotected keys in eviction order, or None."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all ordering state."""

    def mark_evictable(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        """Note that the key's ref count just became 0 (default: nothing)."""

    def mark_non_evictable(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        """Note that the key's ref count just went from 0 to 1 (default: nothing)."""

    @abstractmethod
    def items(self) -> Iterator[tuple[bytes, ChunkStatus]]:
        """Iterate over every resident key with its status (any order)."""

    def check_invariants(self) -> None:  # noqa: B027 (optional hook)
        """Raise `kvoffload.errors.InvariantViolation` if internal structures disagree."""


def require(condition: bool, message: str) -> None:
    """Raise InvariantViolation with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InvariantViolation(message)


class OwnPolicy(CachePolicy):
    """Base of kvoffload's own policies (all but LRU and ARC).

    ``entries`` maps each resident key to its status. A *hit* is a ``touch`` of a resident key
    or a request's first access to one (``on_request_access``), handled by ``_hit``; store misses
    and finished requests change nothing. ``clear`` starts afresh.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.entries: dict[bytes, ChunkStatus] = {}

    def _hit(self, keys: Sequence[bytes]) -> None:
        """Hits on ``keys`` (absent keys among them are ignored); default: nothing."""

    def get(self, key: bytes) -> ChunkStatus | None:
        """Return the status of a resident key, or None."""
        return self.entries.get(key)

    def touch(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Hits."""
        self._hit(keys)

    def on_request_access(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Hits: a request's first access to resident keys."""
        self._hit(keys)

    def on_store_miss(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        """Nothing (the base class would touch)."""

    def on_request_finished(
        self,
        groups: Sequence[Sequence[bytes]],
        inserted_only: Set[bytes],
        reused: Set[bytes],
        req_context: RequestContext,
    ) -> None:
        """Nothing: the request's hits were counted when they happened."""

    def clear(self) -> None:
        """Forget everything."""
        self.__init__(self.cache_capacity)  # type: ignore[misc]

    def items(self) -> Iterator[tuple[bytes, ChunkStatus]]:
        """Every resident key with its status."""
        return iter(list(self.entries.items()))
