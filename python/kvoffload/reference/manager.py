"""The scheduler-side CPU offloading manager of vLLM 0.33.0, in plain Python.

State: a `ChunkPool` of host slots, the cache policy (which holds every resident key with its
`ChunkStatus`), the manager's own index of the same statuses (vLLM has none; it serves only
``resident()``, ``check_invariants()`` and the checks of the policy's ``evict`` answers, so that
these work for any policy with vLLM's method set), counters of pending and ready chunks, the
optional `AdmissionTracker`, the event queue, stats since the last report, and per-request state
kept on each request context.

Every public call validates its whole input before it changes anything, so an illegal call raises
a `kvoffload.errors` exception and leaves the manager (and the request context) as it was.
That includes token positions, read where they are used: with LRU, which ranks keys by position
as it inserts and touches them, a recording call checks the position of every key it records;
with every policy, ``on_request_finished`` checks the position of every key the request saw.
"""

from __future__ import annotations

import contextlib
import dataclasses
import operator
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from typing import Any

from kvoffload._common import (
    arc_target,
    build_stats,
    check_admission,
    check_constructor_args,
    check_context,
    config_info_of,
    removed_event,
    resolve_policy,
    stored_event,
)
from kvoffload._liveness import (
    add_liveness_stats,
    check_clock,
    check_pending_write_timeout,
    read_clock,
    timeout_for,
)
from kvoffload.errors import (
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidKeyError,
    KeyStateError,
    PolicyError,
    RequestFinishedError,
)
from kvoffload.reference.admission import AdmissionTracker
from kvoffload.reference.arc import ArcPolicy
from kvoffload.reference.arc_paper import LibCacheSimArc
from kvoffload.reference.fifo import FifoPolicy
from kvoffload.reference.lfu import LfuPolicy
from kvoffload.reference.liveness import PendingWrites
from kvoffload.reference.lru import LruPolicy
from kvoffload.reference.policy import (
    CachePolicy,
    ChunkStatus,
    RequestContext,
    position_of,
    require,
    sorted_by_position,
)
from kvoffload.reference.s3fifo import S3FifoPolicy
from kvoffload.reference.sieve import SievePolicy
from kvoffload.reference.sketch import FrequencySketch, sketch_hash
from kvoffload.reference.slru import SlruPolicy
from kvoffload.reference.twoq import TwoQPolicy
from kvoffload.types import (
    CacheHitSource,
    CPULoadStoreSpec,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingStats,
    OffloadPolicy,
    PrepareStoreOutput,
    RequestOffloadingContext,
    get_offload_group_idx,
)

__all__ = ["MAX_KEY_LEN", "CPUOffloadingManager", "ChunkPool"]

#: The longest key ``prepare_store`` takes, in bytes: the Rust manager keeps a chunk's key length
#: in 32 bits (``MAX_KEY_LEN`` in rust/kvoffload-core/src/table.rs), and the reference refuses
#: what it refuses. Read at each call, so a test may lower it.
MAX_KEY_LEN = 2**32 - 1


#: The built-in policies by name (kvoffload._common.BUILTIN_POLICIES lists the same names).
_BUILTIN: dict[str, type[CachePolicy]] = {
    "lru": LruPolicy,
    "arc": ArcPolicy,
    "fifo": FifoPolicy,
    "sieve": SievePolicy,
    "s3fifo": S3FifoPolicy,
    "2q": TwoQPolicy,
    "slru": SlruPolicy,
    "lfu": LfuPolicy,
    "arc-paper": LibCacheSimArc,
}


class ChunkPool:
    """Host slots ``0..num_chunks-1``: never-used ids first (ascending), then last-freed-first."""

    def __init__(self, num_chunks: int) -> None:
        self.num_chunks = num_chunks
        self.num_handed_out = 0  # ids below this were handed out at least once
        self.free_ids: list[int] = []  # freed ids; the last one is reused first

    @property
    def num_free(self) -> int:
        """Ids an allocation can hand out now."""
        return self.num_chunks - self.num_handed_out + len(self.free_ids)

    def allocate(self, n: int) -> list[int]:
        """``n`` ids (the caller checked ``n <= num_free``)."""
        fresh = min(n, self.num_chunks - self.num_handed_out)
        ids = list(range(self.num_handed_out, self.num_handed_out + fresh))
        self.num_handed_out += fresh
        ids.extend(self.free_ids.pop() for _ in range(n - fresh))
        return ids

    def undo_allocate(self, ids: list[int], handed_out_before: int) -> None:
        """Take back what `allocate` answered (``ids``), leaving the pool as it was before."""
        fresh = self.num_handed_out - handed_out_before
        self.num_handed_out = handed_out_before
        self.free_ids.extend(reversed(ids[fresh:]))

    def free(self, chunk_id: int) -> None:
        """Return one id."""
        self.free_ids.append(chunk_id)

    def reset(self) -> None:
        """Forget every id: the next allocation starts at 0."""
        self.num_handed_out = 0
        self.free_ids = []


@dataclasses.dataclass(eq=False)
class _RequestState:
    """What one request did with one manager, in one cache generation."""

    owner: CPUOffloadingManager
    generation: int
    finished: bool = False
    seen: dict[bytes, None] = dataclasses.field(default_factory=dict)  # first-seen order
    inserted: set[bytes] = dataclasses.field(default_factory=set)
    reused: set[bytes] = dataclasses.field(default_factory=set)
    store_misses_reported: set[bytes] = dataclasses.field(default_factory=set)
    counted: set[bytes] = dataclasses.field(default_factory=set)  # in the TinyLFU sketch


def _as_key(key: object) -> bytes:
    if not isinstance(key, bytes):
        raise InvalidKeyError(f"a key must be bytes, got {type(key).__name__}")
    return key


def _as_keys(keys: object) -> list[bytes]:
    """Return a call's keys as a list; anything but an iterable of bytes is an InvalidKeyError."""
    if isinstance(keys, (bytes, bytearray, str)):
        raise InvalidKeyError(f"keys must be an iterable of bytes, got {type(keys).__name__}")
    try:
        key_list: list[bytes] = list(keys)  # type: ignore[call-overload]
    except TypeError:
        raise InvalidKeyError(
            f"keys must be an iterable of bytes, got {type(keys).__name__}"
        ) from None
    for key in key_list:
        _as_key(key)
    return key_list


def _check_key_lengths(keys: list[bytes]) -> None:
    """Refuse an offer with a key longer than `MAX_KEY_LEN`, naming the first such key's index."""
    if keys and max(map(len, keys)) > MAX_KEY_LEN:  # one C-level pass: no cost per key
        i = next(i for i, key in enumerate(keys) if len(key) > MAX_KEY_LEN)
        raise InvalidArgumentError(f"key {i} is too long to store ({MAX_KEY_LEN} bytes at most)")


def _repeats(keys: list[bytes]) -> list[bytes]:
    seen: set[bytes] = set()
    repeats = []
    for key in keys:
        if key in seen:
            repeats.append(key)
        seen.add(key)
    return repeats


class CPUOffloadingManager:
    """vLLM 0.33.0's ``CPUOffloadingManager`` (scheduler side), the readable reference.

    Beyond vLLM: ``oldest_pending_write()`` and ``num_pending_writes()`` report pending writes;
    with ``pending_write_timeout`` set (seconds; None, the default, is vLLM's behaviour), a write
    older than that expires as ``complete_store(keys, success=False)`` would, at the start of each
    ``prepare_store`` and on ``expire_pending_writes()``. ``clock`` (default ``time.monotonic``)
    gives the time, in seconds (see ``kvoffload._liveness``).

    A policy method that raises is handled as by the Rust manager (whose ``Manager::with_policy``
    documents it), the method being taken not to have changed the policy: ``prepare_load`` pins
    nothing (the pins already reported are reported released, last first) and records nothing;
    ``prepare_store`` counts and records nothing, and evicts nothing unless ``insert`` raised
    (the keys inserted before it are removed again, the evictions stand); ``complete_load``,
    ``complete_store`` (and so the expiry of writes), ``touch``, ``on_request_finished`` and
    ``reset_cache`` complete. Each raises the policy's first exception. An ``evict`` answer that
    breaks the contract raises `kvoffload.errors.PolicyError`, and nothing was evicted.
    """

    medium = Medium.CPU

    def __init__(
        self,
        num_chunks: int,
        cache_policy: str = "lru",
        cache_policy_module_path: str | None = None,
        enable_events: bool = False,
        store_threshold: int = 1,
        max_tracker_size: int = 64_000,
        info: object = None,
        admission: str = "tracker",
        pending_write_timeout: float | None = None,
        clock: Callable[[], float] | None = None,
    ) -> None:
        check_constructor_args(num_chunks, store_threshold, max_tracker_size)
        check_admission(admission, store_threshold, max_tracker_size)
        self._pending_write_timeout = check_pending_write_timeout(pending_write_timeout)
        check_clock(clock)
        self._clock: Callable[[], float] = time.monotonic if clock is None else clock
        resolved = resolve_policy(cache_policy, cache_policy_module_path)
        self.num_chunks = num_chunks
        self._builtin_policy = isinstance(resolved, str)
        # Only LRU reads token positions before a request finishes (vLLM's ARC and kvoffload's
        # other policies order a request's keys by position only at its finish).
        self._reads_positions = resolved == "lru"
        self._policy: CachePolicy
        if isinstance(resolved, str):
            self._policy = _BUILTIN[resolved](cache_capacity=num_chunks)
        else:
            assert isinstance(resolved, type)
            self._policy = resolved(cache_capacity=num_chunks)
        self._pool = ChunkPool(num_chunks)
        # Every resident key's status, the very object the policy was given with it.
        self._statuses: dict[bytes, ChunkStatus] = {}
        self._num_pending = 0  # chunks with ref_cnt -1
        self._num_evictable = 0  # chunks with ref_cnt 0
        self._store_threshold = store_threshold
        counting = store_threshold >= 2
        self._tracker = (
            AdmissionTracker(max_tracker_size) if counting and admission == "tracker" else None
        )
        self._sketch = (
            FrequencySketch(store_threshold, max_tracker_size)
            if counting and admission == "tinylfu"
            else None
        )
        self._events: list[OffloadingEvent] | None = [] if enable_events else None
        self._allocation_sizes: list[int] = []  # histogram samples since the last report
        self._stores_skipped = 0  # since the last report
        self._generation = 0  # bumped by reset_cache; older request state is stale
        self._config_info = config_info_of(info)
        self._lock = threading.Lock()
        self._writes = PendingWrites(self._statuses.get)

    @property
    def lock(self) -> threading.Lock:
        """A lock callers may hold around a sequence of calls (the manager never takes it)."""
        return self._lock

    # -- request state ---------------------------------------------------------------------------

    def _current_state(self, req_context: RequestContext) -> _RequestState | None:
        check_context(req_context)
        state = req_context.get_state(_RequestState)
        if (
            not isinstance(state, _RequestState)  # none, or not a state of ours
            or state.owner is not self
            or state.generation != self._generation
        ):
            return None
        return state

    def _recording_state(self, req_context: RequestContext) -> _RequestState:
        """Return the request's current state, created afresh if it has none or a stale one."""
        state = self._current_state(req_context)
        if state is None:
            state = _RequestState(self, self._generation)
            req_context.set_state(state)
        return state

    def _check_recordable(self, req_context: RequestContext, keys: list[bytes]) -> None:
        """Reject a recording a finished request may not make; validate the positions LRU reads."""
        state = self._current_state(req_context)
        if state is not None and state.finished:
            unseen = [key for key in keys if key not in state.seen]
            if unseen:
                raise RequestFinishedError(
                    f"request finished; it cannot record keys it has not seen: {unseen!r}"
                )
        if self._reads_positions:
            for key in keys:
                position_of(req_context, key)

    def _record_load(
        self, state: _RequestState, req_context: RequestContext, keys: list[bytes]
    ) -> None:
        """Record a load's accesses (reuses) in order; report new keys to the policy.

        If the policy raises, nothing is recorded (the new keys are unseen again).
        """
        new_keys = []
        seen = state.seen
        for key in keys:
            if key not in seen:
                seen[key] = None
                new_keys.append(key)
        if new_keys:
            try:
                self._policy.on_request_access(new_keys, req_context)
            except BaseException:
                for key in new_keys:  # the last ones added to ``seen``: it is as it was
                    del seen[key]
                raise
        inserted, reused = state.inserted, state.reused
        for key in keys:
            if key not in inserted:
                reused.add(key)

    def on_new_request(self, req_context: RequestContext) -> RequestOffloadingContext:
        """Give the request state unless it has current state already."""
        self._recording_state(req_context)
        return RequestOffloadingContext(policy=OffloadPolicy.CHUNK_LEVEL)

    def on_request_finished(self, req_context: RequestContext) -> None:
        """Report the request's keys to the policy, once; then it may record no new keys."""
        state = self._current_state(req_context)
        if state is None or state.finished:
            return
        by_group: dict[int, list[bytes]] = {}
        for key in state.seen:
            by_group.setdefault(get_offload_group_idx(key), []).append(key)
        groups = [sorted_by_position(by_group[g], req_context) for g in sorted(by_group)]
        # Every position was read (and validated) above: nothing below can raise on bad input.
        state.finished = True
        self._policy.on_request_finished(
            groups, state.inserted - state.reused, set(state.reused), req_context
        )

    # -- lookups -----------------------------------------------------------------------------------

    def lookup(self, key: bytes, req_context: RequestContext) -> LookupResult:
        """MISS (absent), HIT_PENDING (store in flight) or HIT (readable); changes nothing."""
        status = self._policy.get(_as_key(key))
        if status is None:
            return LookupResult.MISS
        return LookupResult.HIT if status.is_ready else LookupResult.HIT_PENDING

    def lookup_prefix(self, keys: Iterable[bytes], req_context: RequestContext) -> int:
        """How many leading keys are HIT."""
        hits = 0
        for key in _as_keys(keys):
            status = self._policy.get(key)
            if status is None or not status.is_ready:
                break
            hits += 1
        return hits

    def get_load_source(self, key: bytes, req_context: RequestContext) -> CacheHitSource:
        """Return HOST: every hit of this manager is in host memory."""
        _as_key(key)
        return CacheHitSource.HOST

    # -- loads -------------------------------------------------------------------------------------

    def prepare_load(self, keys: Iterable[bytes], req_context: RequestContext) -> CPULoadStoreSpec:
        """Pin readable keys (a repeated key is pinned twice); their ids line up with ``keys``."""
        key_list = _as_keys(keys)
        statuses = self._readable(key_list, "load")
        self._check_recordable(req_context, key_list)
        # The state first: a context whose set_state raises leaves nothing pinned.
        state = self._recording_state(req_context)
        self._pin(key_list, statuses)
        try:
            self._record_load(state, req_context, key_list)
        except BaseException:
            self._undo_pins(key_list, statuses)
            raise
        return CPULoadStoreSpec([status.chunk_id for status in statuses])

    def prepare_read(
        self, keys: Iterable[bytes], req_context: RequestContext | None = None
    ) -> CPULoadStoreSpec:
        """Pin readable keys for a copy to another tier: `prepare_load` recording no access.

        The context is not read; `complete_load` releases the pins.
        """
        key_list = _as_keys(keys)
        statuses = self._readable(key_list, "read")
        self._pin(key_list, statuses)
        return CPULoadStoreSpec([status.chunk_id for status in statuses])

    def _readable(self, key_list: list[bytes], verb: str) -> list[ChunkStatus]:
        """Each key's status, all of them readable (else `KeyStateError`: cannot ``verb``)."""
        statuses = []
        for key in key_list:
            status = self._policy.get(key)
            if status is None or not status.is_ready:
                what = "absent" if status is None else "pending"
                raise KeyStateError(f"cannot {verb} key {key!r}: it is {what}")
            statuses.append(status)
        return statuses

    def _pin(self, key_list: list[bytes], statuses: list[ChunkStatus]) -> None:
        """Pin each key once more; a key's first pin is reported to the policy."""
        # If the policy raises, the pins are taken back (the Rust manager's undo, step by step).
        try:
            for key, status in zip(key_list, statuses, strict=True):
                status.ref_cnt += 1
                if status.ref_cnt == 1:
                    self._num_evictable -= 1
                    self._policy.mark_non_evictable(key)
        except BaseException:
            # Only a key's first occurrence in the call reports a pin (its count was 0), so the
            # failure was there. Its pin, unreported, goes silently; the earlier ones are undone.
            n = key_list.index(key)
            statuses[n].ref_cnt -= 1
            self._num_evictable += 1
            self._undo_pins(key_list[:n], statuses[:n])
            raise

    def _undo_pins(self, keys: list[bytes], statuses: list[ChunkStatus]) -> None:
        """Release one pin of each key, last first, reporting those back at 0 as evictable.

        This undoes a `prepare_load` whose policy raised; as in the Rust manager, the reports'
        own failures are ignored (the call raises the policy's first exception).
        """
        for key, status in zip(reversed(keys), reversed(statuses), strict=True):
            status.ref_cnt -= 1
            if status.ref_cnt == 0:
                self._num_evictable += 1
                with contextlib.suppress(BaseException):
                    self._policy.mark_evictable(key)

    def complete_load(self, keys: Iterable[bytes], req_context: RequestContext) -> None:
        """Unpin keys, once per occurrence; no recency change.

        If the policy raises, every key is still unpinned and reported (a report that fails is
        taken to have changed nothing); the first exception is raised at the end.
        """
        key_list = _as_keys(keys)
        loads = Counter(key_list)
        statuses = {}
        for key, n in loads.items():
            status = self._policy.get(key)
            if status is None or status.ref_cnt < n:
                ref = "absent" if status is None else f"ref count {status.ref_cnt}"
                raise KeyStateError(f"cannot complete {n} load(s) of key {key!r}: {ref}")
            statuses[key] = status
        error: BaseException | None = None
        for key in key_list:
            status = statuses[key]
            status.ref_cnt -= 1
            if status.ref_cnt == 0:
                self._num_evictable += 1
                try:
                    self._policy.mark_evictable(key)
                except BaseException as exc:
                    error = exc if error is None else error
        if error is not None:
            raise error

    def touch(self, keys: Iterable[bytes], req_context: RequestContext) -> None:
        """Forward to the policy (records no request access)."""
        self._policy.touch(_as_keys(keys), req_context)

    # -- stores ------------------------------------------------------------------------------------

    def prepare_store(
        self, keys: Iterable[bytes], req_context: RequestContext
    ) -> PrepareStoreOutput | None:
        """Pick the keys to store and give them chunks, evicting if needed (None if impossible).

        First of all the clock is read and, with ``pending_write_timeout`` set, overdue writes
        expire (that stands even if the call then raises). A key longer than `MAX_KEY_LEN` bytes
        is refused (`InvalidArgumentError`), as by the Rust manager.
        """
        self._writes.set_now(read_clock(self._clock))
        if self._pending_write_timeout is not None:
            self._expire(self._pending_write_timeout)
        key_list = _as_keys(keys)
        # Before the repeats, as in the Rust manager (and a repeated key of 4 GiB would take
        # 16 GiB to show in that error).
        _check_key_lengths(key_list)
        offered = set(key_list)
        if len(offered) != len(key_list):
            raise DuplicateKeyError(f"prepare_store got repeated keys: {_repeats(key_list)!r}")

        # Partition the offer: absent keys are candidates, readable keys "existing", pending
        # keys are skipped. Then decide the threshold up front (the count after this offer is
        # the count before plus one), so the whole call can be checked before anything changes.
        candidates: list[bytes] = []
        existing: set[bytes] = set()
        for key in key_list:
            status = self._policy.get(key)
            if status is None:
                candidates.append(key)
            elif status.is_ready:
                existing.add(key)
        tracker, sketch = self._tracker, self._sketch
        if tracker is not None:
            threshold = self._store_threshold
            to_store = [k for k in candidates if tracker.count_after_one_offer(k) >= threshold]
        elif sketch is not None:
            current = self._current_state(req_context)
            counted = current.counted if current is not None else set()
            to_store = [
                k for k in candidates if sketch.would_admit_next(sketch_hash(k), k not in counted)
            ]
        else:
            to_store = candidates
        admitted = set(to_store)
        recorded = [k for k in key_list if k in admitted or k in existing]
        self._check_recordable(req_context, recorded)
        # The state first: a context whose set_state raises leaves the offer uncounted.
        state = self._recording_state(req_context)

        # vLLM's steps, numbered as in its prepare_store. The policy is called in vLLM's order
        # (4, 5, 8, 9), but the manager's own part of steps 1 to 7 (offer counts, request
        # state, stats) is made only once the inserts have succeeded or the eviction declined: a
        # policy method that raises, or an evict answer that breaks the contract, leaves the
        # offer uncounted and unrecorded, as in the Rust manager.
        # 4: first-time store misses of this request go to the policy.
        misses = [k for k in to_store if k not in state.store_misses_reported]
        if misses:
            self._policy.on_store_miss(misses, req_context)
        # 5: the keys this request sees for the first time go to the policy.
        new_keys = [k for k in recorded if k not in state.seen]
        if new_keys:
            self._policy.on_request_access(new_keys, req_context)
        # 8, 9: make room, then allocate and insert as pending (undone if an insert raises).
        evicted_keys = self._make_room(len(to_store), offered) if to_store else []
        placed = None
        if to_store and evicted_keys is not None:
            placed = self._place(to_store, req_context)  # chunk ids and statuses

        # 1, 3: count the offer; drop candidates below the threshold.
        if tracker is not None:
            tracker.count_offer(key_list)
            self._stores_skipped += len(candidates) - len(to_store)
        elif sketch is not None:
            # Each key once per request, after a reset that is due.
            sketch.age_if_due()
            counted = state.counted
            for key in key_list:
                if key not in counted:
                    counted.add(key)
                    sketch.increment(sketch_hash(key))
            self._stores_skipped += len(candidates) - len(to_store)
        # 4, 5: record the store misses and the access (existing keys count as reused).
        state.store_misses_reported.update(misses)
        for key in recorded:
            state.seen[key] = None
            if key in existing and key not in state.inserted:
                state.reused.add(key)
        # 6
        if not to_store:
            return PrepareStoreOutput(
                keys_to_store=[], store_spec=CPULoadStoreSpec([]), evicted_keys=[]
            )
        # 7
        self._allocation_sizes.append(len(to_store))
        if evicted_keys is None or placed is None:
            return None
        chunk_ids, statuses = placed
        writes = []
        for key, status in zip(to_store, statuses, strict=True):
            self._statuses[key] = status
            writes.append((key, status))
            state.inserted.add(key)
        self._num_pending += len(to_store)
        self._writes.started(writes, self._num_pending)
        return PrepareStoreOutput(
            keys_to_store=to_store,
            store_spec=CPULoadStoreSpec(chunk_ids),
            evicted_keys=evicted_keys,
        )

    def _place(
        self, keys: list[bytes], req_context: RequestContext
    ) -> tuple[list[int], list[ChunkStatus]]:
        """Allocate chunks for ``keys`` and insert them into the policy, pending.

        If an insert raises, the keys inserted before it are removed again (their removals'
        errors dropped), the pool is left as it was and the insert's error propagates: the
        evictions made for the call stand, as in the Rust manager.
        """
        handed_out_before = self._pool.num_handed_out
        chunk_ids = self._pool.allocate(len(keys))
        statuses: list[ChunkStatus] = []
        try:
            for key, chunk_id in zip(keys, chunk_ids, strict=True):
                status = ChunkStatus(chunk_id, -1)
                self._policy.insert(key, status, req_context)
                statuses.append(status)
        except BaseException:
            for key in reversed(keys[: len(statuses)]):
                with contextlib.suppress(BaseException):
                    self._policy.remove(key)
            self._pool.undo_allocate(chunk_ids, handed_out_before)
            raise
        return chunk_ids, statuses

    def _make_room(self, n: int, offered: set[bytes]) -> list[bytes] | None:
        """Evict what the policy chooses so that ``n`` chunks are free; the evicted keys.

        None when that many cannot be evicted. An ``evict`` answer that breaks the contract
        raises `kvoffload.errors.PolicyError` and evicts nothing.
        """
        shortfall = n - self._pool.num_free
        if shortfall <= 0:
            return []
        if shortfall > self._num_evictable:
            return None
        if self._builtin_policy:
            # Fewer ready, unprotected chunks than needed: no policy could evict enough. A
            # plug-in is asked all the same, as vLLM asks it, and must answer None.
            protected_ready = 0
            for key in offered:
                status = self._policy.get(key)
                protected_ready += status is not None and status.ref_cnt == 0
            if shortfall > self._num_evictable - protected_ready:
                return None
        answer = self._policy.evict(shortfall, offered)
        if answer is None:
            return None
        # Only a plug-in's answer is checked: the built-in policies are trusted, as the Rust
        # manager trusts its own (no per-victim check on the baseline's eviction path).
        victims = answer if self._builtin_policy else self._victims(shortfall, answer, offered)
        for key, status in victims:
            self._pool.free(status.chunk_id)
            del self._statuses[key]
        self._num_evictable -= len(victims)
        evicted_keys = [key for key, _ in victims]
        self._emit(removed_event(list(evicted_keys), metadata_only=False))
        return evicted_keys

    def _victims(
        self, n: int, answer: object, offered: set[bytes]
    ) -> list[tuple[bytes, ChunkStatus]]:
        """Check the policy's answer to ``evict(n, offered)`` as the Rust manager does.

        It must list exactly ``n`` distinct ``(key, status)`` pairs of resident keys, each
        status giving the key's chunk id, none offered in this call, all with ref count 0.
        Returns them with the manager's own statuses; raises PolicyError otherwise.
        """
        try:
            items = iter(answer)  # type: ignore[call-overload]
        except TypeError:
            raise PolicyError(
                "evict must return a list of (key, status) pairs or None, "
                f"got {type(answer).__name__}"
            ) from None
        victims: list[tuple[bytes, ChunkStatus]] = []
        for item in items:
            if not (isinstance(item, tuple) and len(item) == 2):
                raise PolicyError(
                    f"evict must return (key, status) pairs, got {type(item).__name__}"
                )
            key, status = item
            if not isinstance(key, bytes):
                raise PolicyError(f"evict returned a key of type {type(key).__name__}")
            try:
                chunk_id = operator.index(status.chunk_id)
            except (AttributeError, TypeError):
                raise PolicyError(f"evict returned {key!r} with no int chunk_id") from None
            held = self._statuses.get(key)
            if held is None or held.chunk_id != chunk_id:
                raise PolicyError(
                    f"evict returned {key!r} with chunk {chunk_id}, which does not hold that key"
                )
            victims.append((key, held))

        def broken(why: str) -> PolicyError:
            return PolicyError(
                f"the policy's evict({n}) broke its contract: {why}; nothing was evicted"
            )

        if len(victims) != n:
            raise broken(f"it returned {len(victims)} chunks")
        seen: set[bytes] = set()
        for key, held in victims:
            if key in seen:
                raise broken(f"it returned {key!r} twice")
            seen.add(key)
            if key in offered:
                raise broken(f"{key!r} is protected (offered in this call)")
            if held.ref_cnt != 0:
                raise broken(f"{key!r} is not evictable (ref count {held.ref_cnt})")
        return victims

    def complete_store(
        self, keys: Iterable[bytes], req_context: RequestContext, success: bool = True
    ) -> None:
        """Pending keys become ready (or, on failure, are dropped); other keys are ignored.

        If the policy raises, the call still completes (every key, the event); the first
        exception is raised at the end.
        """
        ok = bool(success)  # first, as vLLM reads it: a truth value that raises changes nothing
        self._end_stores(_as_keys(keys), ok)

    def _end_stores(self, key_list: list[bytes], success: bool) -> None:
        done = []
        error: BaseException | None = None
        for key in key_list:
            status = self._policy.get(key)
            if status is None or status.ref_cnt != -1:
                continue  # absent, readable, or repeated in this call
            # The key is completed even if the policy raises (its method is then taken to have
            # changed nothing), as in the Rust manager; the first exception is raised at the end.
            try:
                if success:
                    status.ref_cnt = 0
                    self._num_evictable += 1
                    self._policy.mark_evictable(key)
                else:
                    self._policy.remove(key)
            except BaseException as exc:
                error = exc if error is None else error
            if not success:
                self._pool.free(status.chunk_id)
                del self._statuses[key]
            self._num_pending -= 1
            done.append(key)
        if done:
            self._emit(stored_event(done) if success else removed_event(done, metadata_only=True))
        if error is not None:
            raise error

    # -- events, stats, lifecycle ------------------------------------------------------------------

    def _emit(self, event: OffloadingEvent) -> None:
        if self._events is not None:
            self._events.append(event)

    def take_events(self) -> Iterator[OffloadingEvent]:
        """Lazily drain the queued events; the batch is detached at the first step.

        A metadata-only event (cleanup of a failed store) is filtered when reached: keys that are
        resident again are dropped, and an event left empty is skipped.
        """
        if self._events is None or not self._events:
            return
        batch, self._events = self._events, []
        for event in batch:
            if event.metadata_only:
                keys = [key for key in event.keys if self._policy.get(key) is None]
                if not keys:
                    continue
                event = dataclasses.replace(event, keys=keys)
            yield event

    def get_stats(self) -> OffloadingStats:
        """Usage gauges now, plus histogram samples and skipped stores since the last call."""
        num_used = self.num_chunks - self._pool.num_free - self._num_evictable
        stats = build_stats(
            self.num_chunks,
            num_used,
            self._num_pending,
            self._allocation_sizes,
            self._stores_skipped if self._tracker is not None or self._sketch is not None else None,
        )
        self._allocation_sizes = []
        self._stores_skipped = 0
        if self._pending_write_timeout is not None:
            self._writes.set_now(read_clock(self._clock))
            expired, self._writes.expired = self._writes.expired, 0
            add_liveness_stats(stats, self._num_pending, self._writes.oldest_age(), expired)
        return stats

    # -- liveness of pending writes ----------------------------------------------------------------

    def _expire(self, timeout: float) -> list[bytes]:
        overdue = self._writes.take_overdue(timeout)
        if overdue:
            self._end_stores(overdue, success=False)
        return overdue

    def oldest_pending_write(self) -> float | None:
        """The age in seconds of the oldest pending write; None when no write is pending."""
        self._writes.set_now(read_clock(self._clock))
        return self._writes.oldest_age()

    def num_pending_writes(self) -> int:
        """Writes pending now (prepared, not yet completed)."""
        return self._num_pending

    def expire_pending_writes(self, timeout: float | None = None) -> list[bytes]:
        """End the writes older than ``timeout`` seconds (default: ``pending_write_timeout``).

        Each ends exactly as ``complete_store(keys, success=False)`` ends it: chunk freed, one
        metadata-only removal event for all of them. Returns their keys, oldest first; a later
        ``complete_store`` of one of them does nothing (unless the key was stored again).
        """
        seconds = timeout_for(timeout, self._pending_write_timeout)
        self._writes.set_now(read_clock(self._clock))
        return self._expire(seconds)

    def config_info(self) -> list[dict[str, Any]]:
        """One mapping of the ``info`` fields (``[{}]`` without info)."""
        return [dict(self._config_info)]

    def reset_cache(self) -> None:
        """Drop every chunk and the policy state; make all request state stale.

        Undrained events, tracker counts, histogram samples and the skipped count are kept.
        If the policy's ``clear`` raises, the reset still completes, then the exception is raised.
        """
        try:
            self._policy.clear()
        finally:
            self._statuses.clear()
            self._pool.reset()
            self._writes.clear()
            self._num_pending = 0
            self._num_evictable = 0
            self._generation += 1

    def on_schedule_end(self, context: object = None) -> None:
        """Nothing to do."""

    def on_reset_flushed(self) -> None:
        """Nothing to do."""

    def shutdown(self) -> None:
        """Nothing to do."""

    def has_pending_work(self) -> bool:
        """Never: this manager does no background work."""
        return False

    # -- introspection -----------------------------------------------------------------------------

    def policy_state(self) -> dict[str, Any]:
        """LRU ranks, ARC lists and target, or just the class name of an out-of-tree policy."""
        policy = self._policy
        if self._builtin_policy and isinstance(policy, tuple(_BUILTIN.values())):
            state: dict[str, Any] = policy.state()  # type: ignore[attr-defined]
            return state
        return {"policy": type(policy).__name__}

    @property
    def policy(self) -> CachePolicy:
        """The policy object this manager drives."""
        return self._policy

    def resident(self) -> dict[bytes, tuple[int, int]]:
        """``key -> (chunk_id, ref_cnt)`` for every resident key (ref -1: pending)."""
        return {key: (status.chunk_id, status.ref_cnt) for key, status in self._statuses.items()}

    def tracker_state(self) -> list[tuple[bytes, int]] | None:
        """Return the tracker's ``(key, count)`` pairs, oldest first; None when it is off."""
        return None if self._tracker is None else self._tracker.state()

    def pool_state(self) -> tuple[int, list[int]]:
        """(never-used ids handed out so far, free list with the next id to reuse last)."""
        return self._pool.num_handed_out, list(self._pool.free_ids)

    def _debug_set_arc_target(self, value: float) -> None:
        """Force the ARC target size of T1 (tests only)."""
        if not (self._builtin_policy and isinstance(self._policy, ArcPolicy)):
            raise InvalidArgumentError("the cache policy is not ARC")
        self._policy.target_t1_size = arc_target(value, self.num_chunks)

    def check_invariants(self) -> None:
        """Raise `kvoffload.errors.InvariantViolation` if any internal invariant is broken.

        Any policy with vLLM's method set can be checked: its ``get`` must give every resident
        key's status. One derived from `kvoffload.reference.CachePolicy` must also list exactly
        the resident keys (``items``); a policy's own ``check_invariants``, if any, runs last.
        """
        pool = self._pool
        require(
            0 <= pool.num_handed_out <= self.num_chunks,
            f"pool handed out {pool.num_handed_out} of {self.num_chunks} ids",
        )
        free = set(pool.free_ids)
        require(len(free) == len(pool.free_ids), f"free list has repeats: {pool.free_ids}")
        require(
            all(0 <= i < pool.num_handed_out for i in free),
            f"free list {pool.free_ids} holds ids never handed out ({pool.num_handed_out})",
        )
        used: dict[int, bytes] = {}
        num_pending = num_ready = 0
        policy = self._policy
        for key, status in self._statuses.items():
            chunk_id, ref = status.chunk_id, status.ref_cnt
            require(ref >= -1, f"key {key!r} has ref count {ref}")
            require(
                0 <= chunk_id < pool.num_handed_out,
                f"key {key!r} holds chunk {chunk_id}, not handed out ({pool.num_handed_out})",
            )
            require(chunk_id not in free, f"chunk {chunk_id} of key {key!r} is also free")
            require(
                chunk_id not in used,
                f"chunk {chunk_id} is held by both {used.get(chunk_id)!r} and {key!r}",
            )
            require(
                policy.get(key) is status,
                f"the policy's get({key!r}) is not the status the manager gave it with the key",
            )
            used[chunk_id] = key
            num_pending += ref == -1
            num_ready += ref == 0
        if isinstance(policy, CachePolicy):
            # kvoffload's policies also list what they hold (``items``, not vLLM's interface).
            listed = dict(policy.items())
            require(
                listed.keys() == self._statuses.keys(),
                f"the policy holds {len(listed)} keys, the manager {len(self._statuses)}",
            )
        require(
            len(used) + len(free) == pool.num_handed_out,
            f"{pool.num_handed_out} ids handed out but {len(used)} used + {len(free)} free",
        )
        require(
            num_pending == self._num_pending,
            f"{num_pending} pending chunks, counter says {self._num_pending}",
        )
        require(
            num_ready == self._num_evictable,
            f"{num_ready} evictable chunks, counter says {self._num_evictable}",
        )
        if self._tracker is not None:
            self._tracker.check_invariants()
        self._writes.check_invariants(self._num_pending)
        check_policy = getattr(self._policy, "check_invariants", None)
        if callable(check_policy):  # an out-of-tree policy may have none
            check_policy()
