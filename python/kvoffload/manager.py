"""`CPUOffloadingManager`: vLLM 0.33.0's manager API over the Rust core (`kvoffload._native`).

Every call crosses into Rust once; key bytes, request state and token positions are read there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, ClassVar

from kvoffload import _forks, _native, types
from kvoffload._common import (
    arc_target,
    build_stats,
    check_admission,
    check_constructor_args,
    config_info_of,
    resolve_policy,
)
from kvoffload._liveness import (
    add_liveness_stats,
    check_clock,
    check_pending_write_timeout,
    timeout_for,
)
from kvoffload.errors import InvalidArgumentError, InvalidKeyError
from kvoffload.policies import status_class_for
from kvoffload.shadow import HitCounts, ShadowSet, as_key_list
from kvoffload.types import (
    CacheHitSource,
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingStats,
    PrepareStoreOutput,
    RequestOffloadingContext,
)

__all__ = ["CPUOffloadingManager"]

#: The calls whose methods below state the API, answered by the core's methods of the same
#: name and signature (see ``CPUOffloadingManager.__init__``).
_DIRECT_CALLS = (
    "lookup",
    "lookup_prefix",
    "prepare_load",
    "prepare_read",
    "complete_load",
    "touch",
    "prepare_store",
    "complete_store",
)


class CPUOffloadingManager:
    """Scheduler-side manager of a host pool of ``num_chunks`` KV chunks (Rust core).

    A drop-in for vLLM 0.33.0's ``CPUOffloadingManager``: same constructor, calls, results,
    events and stats. Illegal calls raise a :class:`kvoffload.KVOffloadError` and change nothing.

    ``cache_policy`` names a built-in policy (run in Rust), a name registered with
    `kvoffload.policies.CachePolicyFactory`, or (with ``cache_policy_module_path``) a class
    with vLLM's ``CachePolicy`` interface. Such a Python policy is called exactly where vLLM's
    manager calls it, except ``get``, which is never needed. When one of its methods raises, the
    exception propagates unchanged, the method is taken not to have changed the policy, and:

    - ``prepare_load`` and ``prepare_store`` change nothing of the manager's state (pins,
      request state, admission counts, stats), with one exception: if the policy's ``insert``
      raises after its ``evict`` succeeded, the evicted keys stay evicted (the policy dropped
      them) and their removal event is queued;
    - ``complete_load``, ``complete_store``, ``touch``, ``on_request_finished`` and
      ``reset_cache`` complete, and every later policy method of the call is still made; the
      first exception is then raised. ``remove`` and ``clear`` are notifications the manager
      cannot take back: a policy that raises from one must have dropped the key (all keys)
      first, or it goes on holding keys the manager no longer has (its later ``evict``
      answers naming them are refused with `kvoffload.PolicyError`);
    - an ``evict`` answer that breaks the contract raises `kvoffload.PolicyError`;
    - a policy method that calls back into its manager gets `kvoffload.ReentrantCallError`
      (``lookup`` and ``lookup_prefix`` excepted: they read the slot table without the lock).

    Beyond vLLM: ``admission`` picks what ``store_threshold`` counts with: ``"tracker"`` (the
    default, vLLM's bounded table of offer counts) or ``"tinylfu"`` (a TinyLFU count-min sketch
    with aging, which never forgets a key to make room; ``max_tracker_size`` is then its
    counters per row, at most ``2**30``, its table's pages taken only as counts land in them).
    ``oldest_pending_write()`` and ``num_pending_writes()`` report pending writes;
    with ``pending_write_timeout`` set (seconds; None, the default, is vLLM's behaviour), a write
    older than that expires as ``complete_store(keys, success=False)`` would, at the start of each
    ``prepare_store`` (even one that then raises) and on ``expire_pending_writes()``, and
    ``get_stats()`` adds the gauges ``kvoffload:pending_writes`` and
    ``kvoffload:oldest_pending_write_age_seconds`` and the counter ``kvoffload:expired_writes``
    (not with vLLM's result types, whose metrics code knows only vLLM's names). ``clock``
    (default: a monotonic clock in Rust) gives the time in seconds, for tests.
    """

    #: Where the result classes come from (``LookupResult``, ``PrepareStoreOutput``,
    #: ``CPULoadStoreSpec``, ``OffloadingEvent``, ``Medium``, ``OffloadingStats``,
    #: ``RequestOffloadingContext``, ``CacheHitSource``): kvoffload's own types here; the vLLM
    #: integration puts vLLM's classes under the same names.
    _types: ClassVar[Any] = types

    def __new__(cls, *args: Any, **kwargs: Any) -> CPUOffloadingManager:
        """A shadowed manager (see `kvoffload.shadow`) when ``shadow_policies`` names any."""
        if kwargs.get("shadow_policies") and cls is CPUOffloadingManager:
            cls = _ShadowedManager
        return super().__new__(cls)

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
        shadow_policies: Sequence[str] | None = None,
        admission: str = "tracker",
        pending_write_timeout: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        check_constructor_args(num_chunks, store_threshold, max_tracker_size)
        check_admission(admission, store_threshold, max_tracker_size)
        timeout = check_pending_write_timeout(pending_write_timeout)
        check_clock(clock)
        resolved = resolve_policy(cache_policy, cache_policy_module_path)
        policy: Any = resolved
        status_class: type | None = None
        if not isinstance(resolved, str):
            policy = resolved(cache_capacity=num_chunks)
            status_class = status_class_for(resolved)
        if shadow_policies and type(self) is not _ShadowedManager:
            raise InvalidArgumentError("shadow_policies is not supported by this manager class")
        self.medium: Medium = self._types.Medium.CPU
        # Enum members read once: each read of one through its class costs more than the call.
        self._host: CacheHitSource = self._types.CacheHitSource.HOST
        self._events_on = bool(enable_events)
        self._core = _native.ManagerCore(
            num_chunks,
            policy,
            bool(enable_events),
            store_threshold,
            max_tracker_size,
            None if self._types is types else self._types,
            admission,
            status_class,
            timeout,
            clock,
        )
        _forks.track(self._core)
        self._pending_write_timeout = timeout
        self._liveness_stats = timeout is not None and self._types is types
        self._num_chunks = num_chunks
        self._store_threshold = store_threshold
        self._max_tracker_size = max_tracker_size
        self._config_info = config_info_of(info)
        self._lock = threading.Lock()
        # The hot calls go straight to the core: each method below that this class does not
        # override is shadowed by the core's bound method, which takes the same arguments, so a
        # call costs one crossing into Rust and no Python frame. `lookup`, made once per key,
        # is the core's builtin that skips PyO3's method wrapper (same answers and errors).
        cls = type(self)
        for name in _DIRECT_CALLS:
            if getattr(cls, name) is getattr(CPUOffloadingManager, name):
                call = self._core.fast_lookup() if name == "lookup" else getattr(self._core, name)
                setattr(self, name, call)

    @property
    def policy(self) -> Any:
        """The Python policy object this manager drives (None for a built-in policy)."""
        return self._core.python_policy

    @property
    def lock(self) -> threading.Lock:
        """A lock a caller may hold across several calls (the manager never takes it itself)."""
        return self._lock

    @property
    def num_chunks(self) -> int:
        """Slots of the host pool."""
        return self._num_chunks

    @property
    def store_threshold(self) -> int:
        """Offers a key needs before a store admits it (as vLLM's manager's attribute)."""
        return self._store_threshold

    @property
    def max_tracker_size(self) -> int:
        """Bound of the admission tracker (as vLLM's manager's attribute)."""
        return self._max_tracker_size

    # --- lookups ---

    def lookup(self, key: bytes, req_context: Any) -> LookupResult:
        """MISS (absent), HIT_PENDING (store in flight) or HIT (readable); changes nothing."""
        return self._core.lookup(key)

    def lookup_prefix(self, keys: Iterable[bytes], req_context: Any) -> int:
        """The number of leading keys that are HIT, in one call."""
        return self._core.lookup_prefix(keys)

    def get_load_source(self, key: bytes, req_context: Any) -> CacheHitSource:
        """Where a hit comes from: always host memory."""
        if not isinstance(key, bytes):
            raise InvalidKeyError(f"a key must be bytes, got {type(key).__name__}")
        return self._host

    # --- loads ---

    def prepare_load(self, keys: Iterable[bytes], req_context: Any) -> CPULoadStoreSpec:
        """Pin readable keys for loading; the spec's ids line up with ``keys``."""
        return self._core.prepare_load(keys, req_context)

    def prepare_read(self, keys: Iterable[bytes], req_context: Any = None) -> CPULoadStoreSpec:
        """Pin readable keys for a copy out of the cache that is no request's access.

        vLLM's tiering reads a chunk this way to cascade it to a secondary tier
        (``prepare_read`` of its primary tier). As `prepare_load`, with the same errors, but the
        context is not read and no request records the keys; `complete_load` releases the pins.
        """
        return self._core.prepare_read(keys, req_context)

    def touch(self, keys: Iterable[bytes], req_context: Any) -> None:
        """Mark keys as recently used (forwarded to the policy)."""
        self._core.touch(keys, req_context)

    def complete_load(self, keys: Iterable[bytes], req_context: Any) -> None:
        """Release the pins of finished loads."""
        self._core.complete_load(keys)

    # --- stores ---

    def prepare_store(self, keys: Iterable[bytes], req_context: Any) -> PrepareStoreOutput | None:
        """Choose, place and (if needed) make room for the keys to store; None if impossible."""
        return self._core.prepare_store(keys, req_context)

    def complete_store(self, keys: Iterable[bytes], req_context: Any, success: bool = True) -> None:
        """Make pending keys readable, or drop them when the store failed."""
        self._core.complete_store(keys, req_context, success)

    # --- requests ---

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        """Give the request current state; it is offloaded chunk by chunk."""
        self._core.on_new_request(req_context)
        context: RequestOffloadingContext = self._types.RequestOffloadingContext()
        return context

    def on_request_finished(self, req_context: Any) -> None:
        """Hand the request's accesses, head to tail, to the policy (once per request)."""
        self._core.on_request_finished(req_context)

    # --- whole cache ---

    def reset_cache(self) -> None:
        """Drop every chunk and the policy state; keep events, tracker and pending stats."""
        self._core.reset_cache()

    def take_events(self) -> Iterator[OffloadingEvent]:
        """Yield the queued events; the batch is detached at the first step."""
        if not self._events_on:
            return
        cls, medium = self._types.OffloadingEvent, self.medium
        new = cls.__new__
        for keys, removed, metadata_only in self._core.take_events():
            if metadata_only:
                # Keys stored again since the failed store are no longer removed.
                keys = self._core.absent_keys(keys)
                if not keys:
                    continue
                removed = True
            # What the dataclass's ``__init__`` makes (every field, in declared order), on a
            # bare ``cls.__new__(cls)`` without the call: half the time a drained event costs
            # through the constructor.
            event: OffloadingEvent = new(cls)
            event.keys = keys
            event.medium = medium
            event.removed = removed
            event.locality = None
            event.ownership = None
            event.removal_expected = False
            event.metadata_only = metadata_only
            yield event

    def get_stats(self) -> OffloadingStats:
        """Usage gauges, allocation-size samples and skipped stores since the last call."""
        num_chunks, used, pending, sizes, skipped = self._core.take_stats()
        stats = build_stats(num_chunks, used, pending, sizes, skipped, self._types.OffloadingStats)
        if self._liveness_stats:
            add_liveness_stats(stats, *self._core.take_liveness_stats())
        return stats

    def config_info(self) -> Sequence[dict[str, Any]]:
        """One mapping of the ``info`` fields given at construction (``[{}]`` without one)."""
        return [dict(self._config_info)]

    def on_schedule_end(self, context: Any) -> None:
        """Nothing is deferred to the end of a step."""

    def on_reset_flushed(self) -> None:
        """Nothing waits for flushed resets."""

    def has_pending_work(self) -> bool:
        """The manager never needs extra steps."""
        return False

    def shutdown(self) -> None:
        """Nothing to release."""

    # --- checks and introspection ---

    def check_invariants(self) -> None:
        """Raise :class:`kvoffload.InvariantViolation` if any internal invariant is broken."""
        self._core.check_invariants()

    def policy_state(self) -> dict[str, Any]:
        """The policy's internal order, in keys of its own (``"policy"`` names the policy).

        LRU's ranks, ARC's T1/T2/B1/B2 lists and target, FIFO's queue, and so on.
        """
        return self._core.policy_state()

    def resident(self) -> dict[bytes, tuple[int, int]]:
        """``{key: (chunk_id, ref_cnt)}`` of every resident key (-1 = pending)."""
        return self._core.resident()

    def tracker_state(self) -> list[tuple[bytes, int]] | None:
        """The admission tracker's ``(key, count)`` pairs, oldest first; None without one."""
        return self._core.tracker_state()

    def pool_state(self) -> tuple[int, list[int]]:
        """(never-used ids handed out, free list with the next-popped id last)."""
        return self._core.pool_state()

    def _debug_set_arc_target(self, value: float) -> None:
        """Set ARC's target size (tests only)."""
        self._core.set_arc_target(arc_target(value, self._num_chunks))

    # --- liveness of pending writes ---

    def oldest_pending_write(self) -> float | None:
        """The age in seconds of the oldest pending write; None when no write is pending."""
        return self._core.oldest_pending_write()

    def num_pending_writes(self) -> int:
        """Writes pending now (prepared, not yet completed)."""
        return self._core.num_pending_writes()

    def expire_pending_writes(self, timeout: float | None = None) -> list[bytes]:
        """End the writes older than ``timeout`` seconds (default: ``pending_write_timeout``).

        Each ends exactly as ``complete_store(keys, success=False)`` ends it: chunk freed, one
        metadata-only removal event for all of them. Returns their keys, oldest first; a later
        ``complete_store`` of one of them does nothing (unless the key was stored again).
        """
        return self._core.expire_pending_writes(timeout_for(timeout, self._pending_write_timeout))


class _ShadowedManager(CPUOffloadingManager):
    """A `CPUOffloadingManager` with what-if shadow policies (see `kvoffload.shadow`)."""

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: Any = None,
        shadow_policies: Sequence[str] | None = None,
        admission: str = "tracker",
        pending_write_timeout: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        super().__init__(
            num_chunks,
            cache_policy,
            cache_policy_module_path,
            enable_events,
            store_threshold,
            max_tracker_size,
            info,
            shadow_policies,
            admission,
            pending_write_timeout,
            clock,
        )
        # A str reaches ShadowSet whole, which refuses it (a list of it would be its letters).
        names = shadow_policies if isinstance(shadow_policies, str) else list(shadow_policies or ())
        self._shadows = ShadowSet(
            cache_policy, names, num_chunks, store_threshold, max_tracker_size
        )

    def lookup(self, key: bytes, req_context: Any) -> LookupResult:
        """Look up in the live cache; count the lookup live and in every shadow."""
        result = super().lookup(key, req_context)
        self._shadows.lookup(key, result)
        return result

    def lookup_prefix(self, keys: Iterable[bytes], req_context: Any) -> int:
        """Leading hits in the live cache; counted live and in every shadow."""
        key_list = as_key_list(keys)
        hits = super().lookup_prefix(key_list, req_context)
        self._shadows.lookup_prefix(key_list, hits)
        return hits

    def prepare_load(self, keys: Iterable[bytes], req_context: Any) -> CPULoadStoreSpec:
        """Pin for loading; each shadow loads the keys it holds."""
        key_list = as_key_list(keys)
        spec = super().prepare_load(key_list, req_context)
        self._shadows.prepare_load(key_list, req_context)
        return spec

    def touch(self, keys: Iterable[bytes], req_context: Any) -> None:
        """Touch live and in every shadow."""
        key_list = as_key_list(keys)
        super().touch(key_list, req_context)
        self._shadows.touch(key_list)

    def prepare_store(self, keys: Iterable[bytes], req_context: Any) -> PrepareStoreOutput | None:
        """Offer live and to every shadow."""
        key_list = as_key_list(keys)
        out = super().prepare_store(key_list, req_context)
        self._shadows.prepare_store(key_list, req_context)
        return out

    def on_new_request(self, req_context: Any) -> RequestOffloadingContext:
        """Start the request live and in every shadow."""
        context = super().on_new_request(req_context)
        self._shadows.on_new_request(req_context)
        return context

    def on_request_finished(self, req_context: Any) -> None:
        """Finish the request live and in every shadow."""
        super().on_request_finished(req_context)
        self._shadows.on_request_finished(req_context)

    def reset_cache(self) -> None:
        """Empty the live cache and every shadow."""
        super().reset_cache()
        self._shadows.reset_cache()

    def get_stats(self) -> OffloadingStats:
        """VLLM's stats, plus lookups and hits per policy since the last report."""
        stats = super().get_stats()
        self._shadows.add_stats(stats)
        return stats

    def shadow_report(self) -> list[HitCounts]:
        """Lookups, hits and hit rate since construction: the live policy, then each shadow."""
        return self._shadows.report()
