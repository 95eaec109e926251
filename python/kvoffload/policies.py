"""The cache-policy interface: write an eviction policy in Python and run it in either manager.

`CachePolicy` has exactly vLLM 0.33.0's method set and call protocol, so a policy written for
vLLM (subclassing vLLM's own ``CachePolicy``) runs unchanged here, and one subclassing this class
runs the same way. Name it with ``cache_policy="ClassName"`` plus
``cache_policy_module_path="package.module"``, or register a short name first with
`CachePolicyFactory.register_cache_policy`.

What a manager calls, and when:

- ``insert(key, status, req_context)``: a new, pending chunk (``status.ref_cnt == -1``) for an
  absent key, on behalf of the storing request.
- ``mark_evictable(key)`` right after the key's ref count became 0 (its store completed or its
  last load finished); ``mark_non_evictable(key)`` when it is about to leave 0 (a load pins it).
- ``remove(key)``: a pending key whose store failed (no eviction bookkeeping).
- ``evict(n, protected)``: all or nothing. Remove exactly ``n`` keys whose ``ref_cnt`` is 0
  and that are not in ``protected`` and return them as ``[(key, status)]`` in eviction order,
  or return None and change nothing. Every manager asks whenever it needs chunks and enough
  are ready, as vLLM's does, even when too many of those are in ``protected``.
- ``touch``, ``on_store_miss``, ``on_request_access`` and ``on_request_finished``: observations
  of request traffic (see each method). Keys arrive as lists (vLLM types them as iterables).
- ``clear()``: drop everything (``reset_cache``).

The manager owns the ref counts: it writes ``status.ref_cnt`` and the policy only reads it.

In kvoffload's Rust manager (`kvoffload.CPUOffloadingManager`) the pool, ref counts, key index,
admission and request bookkeeping stay in Rust; the policy is called only for the methods above
(never ``get``: a lookup costs no Python call). When a policy method raises, the exception
reaches the caller unchanged and the manager undoes its own part of the call; see
`kvoffload.CPUOffloadingManager` for the exact guarantees.
"""

from __future__ import annotations

import importlib
import threading
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any, ClassVar, Protocol, TypeVar

from kvoffload.errors import UnsupportedPolicyError

__all__ = ["CachePolicy", "CachePolicyFactory", "ChunkStatus", "RequestContext"]

_T = TypeVar("_T")


class RequestContext(Protocol):
    """What a policy may use of a request context (vLLM's ``ReqContext`` fits)."""

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
        """True once the store completed (the chunk is readable), as in vLLM."""
        return self.ref_cnt >= 0

    @property
    def is_evictable(self) -> bool:
        """True when the chunk is readable and nobody pins it (ref count 0)."""
        return self.ref_cnt == 0

    def __repr__(self) -> str:
        return f"ChunkStatus(chunk_id={self.chunk_id}, ref_cnt={self.ref_cnt})"


class CachePolicy(ABC):
    """Keeps the resident keys' statuses and decides which chunk to evict (vLLM 0.33.0's API)."""

    def __init__(self, cache_capacity: int) -> None:
        self.cache_capacity = cache_capacity

    @abstractmethod
    def get(self, key: bytes) -> Any:
        """Return the status of a resident key, or None when it is absent."""

    @abstractmethod
    def insert(self, key: bytes, chunk: Any, req_context: Any) -> None:
        """Add an absent key with its new, pending status on behalf of the storing request."""

    @abstractmethod
    def remove(self, key: bytes) -> None:
        """Drop a pending key whose store failed."""

    @abstractmethod
    def touch(self, keys: Sequence[bytes], req_context: Any) -> None:
        """Mark keys as recently used (resident or not)."""

    def on_store_miss(self, keys: Sequence[bytes], req_context: Any) -> None:
        """See a request's first offer of absent keys, before they are inserted (default: touch)."""
        self.touch(keys, req_context)

    def on_request_access(  # noqa: B027 (an optional hook: the default does nothing)
        self, keys: Sequence[bytes], req_context: Any
    ) -> None:
        """See the keys a request uses for the first time, in call order (default: nothing)."""

    def on_request_finished(
        self,
        key_groups: Sequence[Sequence[bytes]],
        insertion_only_keys: set[bytes],
        reused_keys: set[bytes],
        req_context: Any,
    ) -> None:
        """See a finished request: its keys per KV group, and which it inserted or reused.

        ``key_groups`` lists each KV group's keys head to tail, in ascending group order. The
        default touches each group in turn.
        """
        del insertion_only_keys, reused_keys
        for keys in key_groups:
            self.touch(keys, req_context)

    @abstractmethod
    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Any]] | None:
        """Remove and return exactly ``n`` evictable keys not in ``protected``, or None."""

    @abstractmethod
    def clear(self) -> None:
        """Forget every key and all ordering and adaptive state."""

    def mark_evictable(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        """The key's ref count just became 0 (default: nothing)."""

    def mark_non_evictable(self, key: bytes) -> None:  # noqa: B027 (optional hook)
        """The key's ref count is leaving 0 (default: nothing)."""


#: The methods a manager calls on a policy.
POLICY_METHODS: tuple[str, ...] = (
    "get",
    "insert",
    "remove",
    "touch",
    "on_store_miss",
    "on_request_access",
    "on_request_finished",
    "evict",
    "clear",
    "mark_evictable",
    "mark_non_evictable",
)


def check_policy_class(cls: object, name: str) -> type:
    """Return ``cls`` if it is a class with every method of `CachePolicy`; raise otherwise."""
    if not isinstance(cls, type):
        raise UnsupportedPolicyError(f"cache policy {name!r} is not a class: {cls!r}")
    missing = [m for m in POLICY_METHODS if not callable(getattr(cls, m, None))]
    if missing:
        raise UnsupportedPolicyError(
            f"cache policy class {cls.__qualname__} lacks {', '.join(missing)} "
            "(subclass kvoffload.policies.CachePolicy or vLLM's CachePolicy)"
        )
    return cls


def status_class_for(cls: type) -> type:
    """The chunk-status class a policy class expects: vLLM's for a vLLM policy, else ours."""
    for base in cls.__mro__:
        if base.__name__ == "CachePolicy" and base.__module__.startswith("vllm."):
            status: type = importlib.import_module(base.__module__).ChunkStatus
            return status
    return ChunkStatus


def _import_policy_module(module_path: object, name: str) -> Any:
    """Import the module ``module_path`` that holds cache policy ``name``.

    Whatever makes that fail is an `UnsupportedPolicyError` (chained to the import's own error,
    whose traceback shows where it failed), saying whether the module was not found or failed
    while it was being imported (its own code raised, or it imports something missing).
    """
    if not isinstance(module_path, str):
        raise UnsupportedPolicyError(
            f"cache policy {name!r}: cache_policy_module_path must be a str (a module path such "
            f"as 'package.module') or None, got {type(module_path).__name__}"
        )
    if not module_path or module_path.startswith("."):
        # importlib's own errors for these (ValueError, TypeError) say less.
        raise UnsupportedPolicyError(
            f"cache policy {name!r}: cache_policy_module_path must be an absolute module path "
            f"such as 'package.module', got {module_path!r}"
        )
    try:
        return importlib.import_module(module_path)
    except ModuleNotFoundError as e:
        if e.name is not None and (module_path == e.name or module_path.startswith(e.name + ".")):
            raise UnsupportedPolicyError(
                f"cache policy {name!r}: cannot import its module {module_path!r}, which was "
                f"not found ({e})"
            ) from e
        raise _failed_import(module_path, name, e) from e
    except Exception as e:
        raise _failed_import(module_path, name, e) from e


def _failed_import(module_path: str, name: str, e: Exception) -> UnsupportedPolicyError:
    """The error for a policy module that was found but raised while it was being imported."""
    return UnsupportedPolicyError(
        f"cache policy {name!r}: cannot import its module {module_path!r}, which failed while "
        f"being imported: {type(e).__name__}: {e}"
    )


class CachePolicyFactory:
    """Policies by name: registered names first, then a class imported from a module path.

    The built-in policies (`kvoffload._common.BUILTIN_POLICIES`) are registered under their
    names with their plain-Python classes from `kvoffload.reference`; the Rust manager runs its
    own Rust versions of those names.
    """

    #: Each registered name's ``(module_path, class_name)``, imported when first used.
    _registry: ClassVar[dict[str, tuple[str, str]]] = {}
    # Makes a registration's check and its entry one step: of two threads registering one name
    # at once, exactly one succeeds (the other is told it is registered), with or without a GIL.
    _registering: ClassVar[threading.Lock] = threading.Lock()

    @classmethod
    def register_cache_policy(cls, name: str, module_path: str, class_name: str) -> None:
        """Register ``module_path.class_name`` under ``name`` (imported when first used)."""
        with cls._registering:
            if name in cls._registry:
                raise UnsupportedPolicyError(f"cache policy {name!r} is already registered")
            cls._registry[name] = (module_path, class_name)

    @classmethod
    def registrations(cls) -> dict[str, tuple[str, str]]:
        """Every registered name's ``(module_path, class_name)``, for another process to use.

        `kvoffload.sim`'s worker processes register the names their parent registered.
        """
        with cls._registering:
            return dict(cls._registry)

    @classmethod
    def register_missing(cls, registrations: dict[str, tuple[str, str]]) -> None:
        """Register each of ``registrations`` (see `registrations`) not registered here yet."""
        with cls._registering:
            for name, source in registrations.items():
                cls._registry.setdefault(name, source)

    @classmethod
    def get_cache_policy_cls(cls, name: str, module_path: str | None = None) -> type:
        """The class registered as ``name``, else class ``name`` of module ``module_path``.

        Raises `UnsupportedPolicyError` when it cannot: an unknown name without a module path, a
        module path that is not an absolute module name, a module that is not found or fails
        while being imported (chained to the import's error), or no such policy class in it.
        A registered name wins: ``module_path`` is then not read.
        """
        if not isinstance(name, str):
            raise UnsupportedPolicyError(f"cache_policy must be a str, got {type(name).__name__}")
        class_name = name
        if name in cls._registry:
            module_path, class_name = cls._registry[name]
        elif module_path is None:
            raise UnsupportedPolicyError(
                f"Unknown cache policy: {name!r}. Supported: {list(cls._registry)}. "
                "For an out-of-tree policy, also set cache_policy_module_path."
            )
        module = _import_policy_module(module_path, name)
        try:
            found = getattr(module, class_name)
        except AttributeError:
            raise UnsupportedPolicyError(
                f"module {module_path!r} has no cache policy class {class_name!r}"
            ) from None
        return check_policy_class(found, name)

    @classmethod
    def registered(cls) -> list[str]:
        """The registered names."""
        return list(cls._registry)


for _name, _module, _cls in (
    ("lru", "kvoffload.reference.lru", "LruPolicy"),
    ("arc", "kvoffload.reference.arc", "ArcPolicy"),
    ("fifo", "kvoffload.reference.fifo", "FifoPolicy"),
    ("sieve", "kvoffload.reference.sieve", "SievePolicy"),
    ("s3fifo", "kvoffload.reference.s3fifo", "S3FifoPolicy"),
    ("2q", "kvoffload.reference.twoq", "TwoQPolicy"),
    ("slru", "kvoffload.reference.slru", "SlruPolicy"),
    ("lfu", "kvoffload.reference.lfu", "LfuPolicy"),
    ("arc-paper", "kvoffload.reference.arc_paper", "LibCacheSimArc"),
):
    CachePolicyFactory.register_cache_policy(_name, _module, _cls)
