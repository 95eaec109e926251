"""The cache-policy interface the reference manager drives, and the chunk record policies hold.

A policy owns the table of resident keys: it maps each key to the `ChunkStatus` the manager
created for it and decides the eviction order. The manager owns the status *values* (it sets
``ref_cnt``) and tells the policy about every change that matters for eviction. Out-of-tree
policies (``cache_policy`` + ``cache_policy_module_path``) are built as
``cls(cache_capacity=num_chunks)`` and must provide vLLM's method set
(`kvoffload.policies.CachePolicy`); deriving from `CachePolicy` here gives the documented
defaults. ``items()`` is kvoffload's addition to that method set: the manager's
``check_invariants()`` compares what a policy derived from `CachePolicy` lists with its own index
of the resident keys (a policy without ``items`` is checked through ``get`` alone).
"""

from __future__ import annotations

import operator
from abc import abstractmethod
from collections.abc import Callable, Iterator, Sequence, Set

from kvoffload.errors import InvalidArgumentError, InvariantViolation
from kvoffload.policies import CachePolicy as BaseCachePolicy
from kvoffload.policies import ChunkStatus, RequestContext

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


def position_of(req_context: RequestContext, key: bytes) -> int | None:
    """Return the key's token position in the request or None; reject a bad position.

    A position is an int in ``[-(2**63 - 1), 2**63 - 1]``: the int64 range, less its least
    value, whose negation LRU's ranks could not hold.
    """
    position = req_context.get_offload_key_position(key)
    if position is None:
        return None
    try:
        value = operator.index(position)
    except TypeError:
        raise InvalidArgumentError(
            f"position of key {key!r} must be an int, got {type(position).__name__}"
        ) from None
    if not -(2**63) < value < 2**63:
        raise InvalidArgumentError(f"position of key {key!r} is out of range: {value}")
    return value


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


class CachePolicy(BaseCachePolicy):
    """`kvoffload.policies.CachePolicy` plus what the reference manager's introspection needs.

    The reference manager drives any policy with vLLM's method set; ``items()`` (listing the
    resident keys) serves only its ``check_invariants()``, which compares the list with the
    manager's own index, and ``check_invariants()`` lets a policy verify its own structures.
    kvoffload's own policies implement both.
    """

    @abstractmethod
    def get(self, key: bytes) -> ChunkStatus | None:
        """Return the status of a resident key, or None when it is absent."""

    @abstractmethod
    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        """Remove and return ``n`` ready, unprotected keys in eviction order, or None."""

    @abstractmethod
    def items(self) -> Iterator[tuple[bytes, ChunkStatus]]:
        """Iterate over every resident key with its status (any order)."""

    def check_invariants(self) -> None:
        """Raise `kvoffload.errors.InvariantViolation` if internal structures disagree."""


def enough_ready(
    n: int,
    protected: Set[bytes],
    resident: int,
    not_ready: int,
    get: Callable[[bytes], ChunkStatus | None],
) -> bool:
    """Whether ``n`` resident keys are ready and outside ``protected``.

    ``resident`` keys are held, ``not_ready`` of them pending or pinned; ``get`` gives a
    resident key's status. The protected keys are looked at only when they could make the
    difference.
    """
    ready = resident - not_ready
    if ready - len(protected) >= n:
        return True
    for key in protected:
        status = get(key)
        ready -= status is not None and status.is_evictable
    return ready >= n


def require(condition: bool, message: str) -> None:
    """Raise InvariantViolation with ``message`` unless ``condition`` holds."""
    if not condition:
        raise InvariantViolation(message)


class OwnPolicy(CachePolicy):
    """Base of kvoffload's own policies (all but LRU and ARC).

    ``entries`` maps each resident key to its status. A *hit* is a ``touch`` of a resident key
    or a request's first access to one (``on_request_access``), handled by ``_hit``; store misses
    and finished requests change nothing. ``clear`` starts afresh.

    The base also counts the resident keys that are not ready (pending or pinned), which the
    subclasses keep current by calling its ``insert``, ``remove`` and ``mark_evictable``, so that
    an ``evict`` that cannot be met answers None before it changes anything (``_can_evict``):
    vLLM's manager asks a plug-in whenever enough chunks are ready, protected or not.
    """

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.entries: dict[bytes, ChunkStatus] = {}
        self._not_ready = 0

    def insert(self, key: bytes, status: ChunkStatus, req_context: RequestContext) -> None:
        """Record a new (pending) key."""
        self.entries[key] = status
        self._not_ready += 1

    def remove(self, key: bytes) -> None:
        """Forget a failed (pending) store."""
        del self.entries[key]
        self._not_ready -= 1

    def mark_evictable(self, key: bytes) -> None:
        """A key became ready."""
        self._not_ready -= 1

    def mark_non_evictable(self, key: bytes) -> None:
        """A ready key got pinned."""
        self._not_ready += 1

    def _can_evict(self, n: int, protected: Set[bytes]) -> bool:
        """Whether ``n`` ready keys outside ``protected`` are resident."""
        return enough_ready(n, protected, len(self.entries), self._not_ready, self.entries.get)

    def check_invariants(self) -> None:
        """The count of keys not ready matches the statuses."""
        not_ready = sum(not status.is_evictable for status in self.entries.values())
        require(
            not_ready == self._not_ready,
            f"{not_ready} resident keys are not ready, the policy counted {self._not_ready}",
        )

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
