"""Liveness of pending writes: the oldest one's age, and the optional expiry (both managers).

Time comes from an injected clock, so nothing sleeps. The scenario tests run against each
manager; the seeded random sequences run both side by side and compare every result.
"""

from __future__ import annotations

import math
import random
import types
from typing import Any

import pytest

import kvoffload
from _helpers import MakeManager, chunk_ids, drain, k, ks, stats_data
from kvoffload import (
    CPUOffloadingManager,
    DuplicateKeyError,
    InvalidArgumentError,
    ReqContext,
)
from kvoffload._liveness import EXPIRED_WRITES, OLDEST_PENDING_WRITE_AGE, PENDING_WRITES
from kvoffload.reference import CPUOffloadingManager as ReferenceManager

LIVENESS_METRICS = {PENDING_WRITES, OLDEST_PENDING_WRITE_AGE, EXPIRED_WRITES}


class Clock:
    """A clock the test sets; counts its readings."""

    def __init__(self, now: float = 0.0) -> None:
        self.now = now
        self.readings = 0

    def __call__(self) -> float:
        self.readings += 1
        return self.now


def started(make_manager: MakeManager, n: int = 8, **kwargs: Any) -> tuple[Any, Clock, ReqContext]:
    clock = Clock()
    m = make_manager(n, enable_events=True, clock=clock, **kwargs)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    return m, clock, ctx


# --- the metric ---


def test_oldest_pending_write_is_the_age_of_the_oldest_store_in_flight(
    make_manager: MakeManager,
) -> None:
    m, clock, ctx = started(make_manager)
    assert m.oldest_pending_write() is None
    assert m.num_pending_writes() == 0
    clock.now = 10.0
    m.prepare_store(ks(1, 2), ctx)
    clock.now = 12.0
    m.prepare_store(ks(3), ctx)
    clock.now = 15.5
    assert m.oldest_pending_write() == 5.5
    assert m.num_pending_writes() == 3
    m.complete_store(ks(2), ctx)  # not the oldest write: nothing changes
    assert m.oldest_pending_write() == 5.5
    m.complete_store(ks(1), ctx, success=False)
    assert m.oldest_pending_write() == 3.5  # now key 3's
    m.complete_store(ks(3), ctx)
    assert m.oldest_pending_write() is None
    assert m.num_pending_writes() == 0
    m.check_invariants()


def test_a_key_stored_again_is_aged_from_its_new_store(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager)
    m.prepare_store(ks(1), ctx)
    m.complete_store(ks(1), ctx, success=False)
    clock.now = 7.0
    m.prepare_store(ks(1), ctx)
    clock.now = 8.0
    assert m.oldest_pending_write() == 1.0


def test_reset_cache_ends_every_pending_write(make_manager: MakeManager) -> None:
    m, _, ctx = started(make_manager)
    m.prepare_store(ks(1, 2), ctx)
    m.reset_cache()
    assert m.oldest_pending_write() is None
    assert m.num_pending_writes() == 0
    m.check_invariants()


def test_a_clock_that_goes_back_counts_as_standing_still(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager)
    clock.now = 5.0
    m.prepare_store(ks(1), ctx)
    clock.now = 3.0
    m.prepare_store(ks(2), ctx)  # starts at 5.0, not 3.0
    assert m.oldest_pending_write() == 0.0
    clock.now = 6.0
    m.complete_store(ks(1), ctx)
    assert m.oldest_pending_write() == 1.0
    m.check_invariants()


def test_the_default_clock_is_monotonic_seconds(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext("r")
    m.prepare_store(ks(1), ctx)
    age = m.oldest_pending_write()
    assert age is not None
    assert 0.0 <= age < 60.0


# --- expiry off (the default): vLLM's behaviour ---


def test_without_a_timeout_nothing_expires_and_stats_are_vllms(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager)
    m.prepare_store(ks(1), ctx)
    clock.now = 1e9
    m.prepare_store(ks(2), ctx)
    assert m.num_pending_writes() == 2
    assert not LIVENESS_METRICS & set(stats_data(m))
    with pytest.raises(InvalidArgumentError, match="no timeout"):
        m.expire_pending_writes()
    assert m.num_pending_writes() == 2
    assert m.expire_pending_writes(10.0) == ks(1)  # an explicit expiry still works
    assert not LIVENESS_METRICS & set(stats_data(m))


# --- expiry on ---


def test_overdue_writes_expire_as_failed_stores_at_the_next_prepare_store(
    make_manager: MakeManager,
) -> None:
    m, clock, ctx = started(make_manager, 3, pending_write_timeout=5.0)
    first = m.prepare_store(ks(1, 2), ctx)
    assert chunk_ids(first) == [0, 1]
    clock.now = 3.0
    m.prepare_store(ks(3), ctx)
    drain(m)
    clock.now = 5.0
    m.prepare_store([], ctx)  # age exactly 5: not older than the timeout
    assert m.num_pending_writes() == 3
    clock.now = 5.5
    out = m.prepare_store(ks(4), ctx)
    # Keys 1 and 2 expired first: the full pool has their chunks free, the last freed first.
    assert out.keys_to_store == ks(4)
    assert chunk_ids(out) == [1]
    assert drain(m) == [("cleanup", ks(1, 2))]
    assert set(m.resident()) == set(ks(3, 4))
    assert m.num_pending_writes() == 2
    assert m.oldest_pending_write() == 2.5
    data = stats_data(m)
    assert data[EXPIRED_WRITES] == 2
    assert data[PENDING_WRITES] == 2
    assert data[OLDEST_PENDING_WRITE_AGE] == 2.5
    assert stats_data(m)[EXPIRED_WRITES] == 0  # a counter since the last report
    m.check_invariants()


def test_a_late_completion_of_an_expired_write_does_nothing(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager, 4, pending_write_timeout=1.0)
    m.prepare_store(ks(1, 2), ctx)
    clock.now = 2.0
    assert m.expire_pending_writes() == ks(1, 2)
    drain(m)
    before = (m.resident(), m.pool_state(), m.policy_state())
    m.complete_store(ks(1, 2), ctx)
    m.complete_store(ks(1), ctx, success=False)
    assert (m.resident(), m.pool_state(), m.policy_state()) == before
    assert drain(m) == []
    m.check_invariants()


def test_an_expiry_stands_when_the_prepare_store_then_raises(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager, 4, pending_write_timeout=1.0)
    m.prepare_store(ks(1), ctx)
    clock.now = 2.0
    with pytest.raises(DuplicateKeyError):
        m.prepare_store(ks(2, 2), ctx)
    assert m.num_pending_writes() == 0
    assert drain(m) == [("cleanup", ks(1))]


def test_an_explicit_timeout_overrides_the_managers(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager, pending_write_timeout=100.0)
    m.prepare_store(ks(1), ctx)
    clock.now = 1.0
    m.prepare_store(ks(2), ctx)
    clock.now = 2.0
    assert m.expire_pending_writes() == []
    assert m.expire_pending_writes(1.5) == ks(1)
    assert m.expire_pending_writes(0) == ks(2)
    assert m.oldest_pending_write() is None


def test_a_ready_or_pinned_key_never_expires(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager, pending_write_timeout=1.0)
    m.prepare_store(ks(1, 2), ctx)
    m.complete_store(ks(1, 2), ctx)
    m.prepare_load(ks(2), ctx)
    clock.now = 100.0
    assert m.expire_pending_writes() == []
    m.prepare_store(ks(3), ctx)
    assert set(m.resident()) == set(ks(1, 2, 3))


def test_an_infinite_timeout_reports_but_never_expires(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager, pending_write_timeout=math.inf)
    m.prepare_store(ks(1), ctx)
    clock.now = 1e300
    m.prepare_store(ks(2), ctx)
    assert m.num_pending_writes() == 2
    data = stats_data(m)
    assert data[PENDING_WRITES] == 2
    assert data[OLDEST_PENDING_WRITE_AGE] == 1e300
    assert data[EXPIRED_WRITES] == 0


def test_the_clock_is_read_once_per_call_that_needs_it(make_manager: MakeManager) -> None:
    m, clock, ctx = started(make_manager, pending_write_timeout=1.0)
    m.prepare_store(ks(1), ctx)
    m.lookup(k(1), ctx)
    m.complete_store(ks(1), ctx)
    assert clock.readings == 1
    m.get_stats()
    m.oldest_pending_write()
    m.expire_pending_writes()
    assert clock.readings == 4


def test_the_shadowed_manager_takes_the_liveness_arguments() -> None:
    clock = Clock()
    m = CPUOffloadingManager(4, shadow_policies=["fifo"], pending_write_timeout=1.0, clock=clock)
    ctx = ReqContext("r")
    m.prepare_store(ks(1), ctx)
    clock.now = 2.0
    assert m.expire_pending_writes() == ks(1)


def test_with_other_result_types_the_stats_stay_vllms() -> None:
    # As with vLLM's classes (the vLLM integration): its metrics code knows only its own names.
    namespace = types.SimpleNamespace(
        **{name: getattr(kvoffload.types, name) for name in dir(kvoffload.types)}
    )
    cls = type("OtherTypesManager", (CPUOffloadingManager,), {"_types": namespace})
    m = cls(4, pending_write_timeout=1.0, clock=Clock())
    m.prepare_store(ks(1), ReqContext("r"))
    assert not LIVENESS_METRICS & set(stats_data(m))


# --- bad arguments ---


@pytest.mark.parametrize("timeout", [-1, -0.5, math.nan, -math.inf, True, "1", [1], -(10**400)])
def test_bad_timeouts_are_refused(make_manager: MakeManager, timeout: object) -> None:
    with pytest.raises(InvalidArgumentError, match="pending_write_timeout"):
        make_manager(4, pending_write_timeout=timeout)
    m = make_manager(4)
    with pytest.raises(InvalidArgumentError, match="timeout"):
        m.expire_pending_writes(timeout)


def test_a_huge_timeout_is_infinite(make_manager: MakeManager) -> None:
    m = make_manager(4, pending_write_timeout=10**400)
    assert m.expire_pending_writes() == []


def test_a_clock_that_is_not_callable_is_refused(make_manager: MakeManager) -> None:
    with pytest.raises(InvalidArgumentError, match="clock"):
        make_manager(4, clock=3.0)


@pytest.mark.parametrize("reading", [math.nan, math.inf, True, "1", None, 10**400])
def test_a_bad_clock_reading_raises_before_any_change(
    make_manager: MakeManager, reading: object
) -> None:
    m, clock, ctx = started(make_manager, pending_write_timeout=1.0)
    m.prepare_store(ks(1), ctx)
    clock.now = reading  # type: ignore[assignment]
    before = (m.resident(), m.pool_state(), m.policy_state())
    for call in (
        lambda: m.prepare_store(ks(2), ctx),
        m.oldest_pending_write,
        m.expire_pending_writes,
        m.get_stats,
    ):
        with pytest.raises(InvalidArgumentError, match="clock must return"):
            call()
    assert (m.resident(), m.pool_state(), m.policy_state()) == before


def test_a_clock_that_raises_propagates(make_manager: MakeManager) -> None:
    def broken() -> float:
        raise KeyboardInterrupt

    m = make_manager(4, clock=broken)
    with pytest.raises(KeyboardInterrupt):
        m.prepare_store(ks(1), ReqContext("r"))
    assert m.resident() == {}


# --- both managers side by side, seeded random sequences ---

POLICIES = ("lru", "arc", "fifo", "s3fifo")


def observe(m: Any) -> Any:
    """Everything a call may have changed."""
    return (
        m.resident(),
        m.pool_state(),
        m.policy_state(),
        [(e.removed, e.metadata_only, list(e.keys)) for e in m.take_events()],
    )


def canon(result: Any) -> Any:
    """A call's result in a form both managers' results compare in."""
    if isinstance(result, kvoffload.OffloadingStats):
        return result.data
    if isinstance(result, kvoffload.PrepareStoreOutput):
        return (result.keys_to_store, chunk_ids(result), result.evicted_keys)
    return result


class Pair:
    """The Rust manager and the reference on one clock each, set alike."""

    def __init__(self, rng: random.Random, policy: str, timeout: float) -> None:
        self.clocks = (Clock(), Clock())
        num_chunks, threshold = rng.randint(2, 10), rng.randint(1, 2)
        self.managers = [
            cls(
                num_chunks,
                cache_policy=policy,
                enable_events=True,
                store_threshold=threshold,
                pending_write_timeout=timeout,
                clock=clock,
            )
            for cls, clock in zip(
                (CPUOffloadingManager, ReferenceManager), self.clocks, strict=True
            )
        ]
        self.contexts = [ReqContext("r0"), ReqContext("r0")]

    @property
    def now(self) -> float:
        return self.clocks[0].now

    def advance(self, seconds: float) -> None:
        for clock in self.clocks:
            clock.now += seconds

    def new_request(self) -> None:
        name = f"r{self.clocks[0].readings}"
        self.contexts = [ReqContext(name), ReqContext(name)]

    def call(self, name: str, *args: Any, **kwargs: Any) -> tuple[str, Any]:
        """Call ``name`` on both (``ctx=True``: with the request); assert they agree."""
        results = []
        with_ctx = kwargs.pop("ctx", False) or name.endswith("_store")
        for m, ctx in zip(self.managers, self.contexts, strict=True):
            full = (*args, ctx) if with_ctx else args
            try:
                results.append(("ok", canon(getattr(m, name)(*full, **kwargs))))
            except kvoffload.KVOffloadError as e:
                results.append(("raised", type(e)))
        assert results[0] == results[1], (name, results)
        assert observe(self.managers[0]) == observe(self.managers[1])
        for m in self.managers:
            m.check_invariants()
        return results[0]


def run_pair(seed: int, policy: str, steps: int) -> int:
    """Drive both managers alike; assert they agree and the timeout holds. Returns expiries."""
    rng = random.Random(seed)
    timeout = rng.choice([0.0, 1.0, 2.5, 4.0])
    pair = Pair(rng, policy, timeout)
    started_at: dict[bytes, float] = {}  # the test's own model of the pending writes
    expired = 0
    for _ in range(steps):
        if rng.random() < 0.3:
            pair.advance(rng.choice([0.5, 1.0, 2.0]))
        now = pair.now
        keys = [k(rng.randrange(16)) for _ in range(rng.randint(0, 4))]
        op = rng.random()
        if op < 0.4:
            if rng.random() < 0.2:
                pair.new_request()
            # The expiry comes first, even when the call then raises (repeated keys).
            overdue = [key for key, t in started_at.items() if now - t > timeout]
            status, out = pair.call("prepare_store", keys)
            for key in overdue:
                del started_at[key]
            expired += len(overdue)
            if status == "ok" and out is not None:
                started_at.update((key, now) for key in out[0])
        elif op < 0.75:
            pair.call("complete_store", keys, success=rng.random() < 0.8)
            for key in keys:
                started_at.pop(key, None)
        elif op < 0.85:
            overdue = [key for key, t in started_at.items() if now - t > timeout]
            _, out = pair.call("expire_pending_writes")
            assert out == overdue  # oldest first
            for key in out:
                del started_at[key]
            expired += len(out)
        elif op < 0.95:
            pair.call("get_stats")
        elif op < 0.97:
            pair.call("reset_cache")
            started_at.clear()
        else:
            pair.call("oldest_pending_write")
        want = max((now - t for t in started_at.values()), default=None)
        for m in pair.managers:
            assert m.num_pending_writes() == len(started_at)
            assert m.oldest_pending_write() == want
        if op < 0.4 or 0.75 <= op < 0.85:
            assert want is None or want <= timeout  # no write outlives an expiry point
    return expired


@pytest.mark.parametrize("policy", POLICIES)
def test_random_sequences_agree_and_no_write_outlives_the_timeout(policy: str) -> None:
    expired = sum(run_pair(seed, policy, 150) for seed in range(12))
    assert expired > 0
