"""Unit tests of the pure-Python reference: policies, tracker, pool and the manager's rules."""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence, Set
from pathlib import Path
from typing import Any

import pytest

from _helpers import OldestFirst
from kvoffload.errors import (
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidKeyError,
    InvariantViolation,
    KeyStateError,
    KVOffloadError,
    PolicyError,
    RequestFinishedError,
)
from kvoffload.reference import (
    AdmissionTracker,
    ArcPolicy,
    CachePolicy,
    ChunkStatus,
    CPUOffloadingManager,
    LruPolicy,
)
from kvoffload.reference import manager as reference_manager
from kvoffload.reference.lru import _RequestRank
from kvoffload.reference.manager import _RequestState
from kvoffload.types import (
    CPUOffloadingMetrics,
    LookupResult,
    ReqContext,
    make_offload_key,
)


def key(name: str | int, group: int = 0) -> bytes:
    return make_offload_key(str(name).encode(), group)


def keys(*names: str | int) -> list[bytes]:
    return [key(n) for n in names]


def ids(output: Any) -> list[int]:
    return [int(i) for i in output.store_spec.block_ids]


def store(m: CPUOffloadingManager, ks: list[bytes], ctx: ReqContext | None = None) -> Any:
    """prepare_store + complete_store; returns the prepare output."""
    ctx = ctx or ReqContext("r")
    out = m.prepare_store(ks, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    m.check_invariants()
    return out


def stats(m: CPUOffloadingManager) -> dict[str, Any]:
    return dict(m.get_stats().data["data"])


# -- LRU -------------------------------------------------------------------------------------------


def test_lru_fresh_ranks_and_touch_order() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("a")
    store(m, keys(1, 2, 3), ctx)
    # Rank 0 went to the request at its first access; keys without a position get fresh ranks.
    assert m.policy_state() == {
        "policy": "lru",
        "ranks": {key(1): (1, 0), key(2): (2, 0), key(3): (3, 0)},
        "next_rank": 4,
    }
    # touch: last key first, so the first key ends most recent; absent keys take no rank.
    m.touch([key(1), key(9), key(2)], ctx)
    assert m.policy_state()["ranks"] == {key(1): (5, 0), key(2): (4, 0), key(3): (3, 0)}
    assert m.policy_state()["next_rank"] == 6
    out = m.prepare_store(keys(7, 8), ReqContext("b"))
    assert out is not None
    assert out.evicted_keys == [key(3)]  # 2 left free + 1 eviction of the oldest
    m.check_invariants()


def test_lru_positions_rank_tails_before_heads() -> None:
    m = CPUOffloadingManager(4)
    a = ReqContext("a")
    for i, k in enumerate(keys(1, 2, 3)):
        a.set_offload_key_position(k, 16 * (i + 1))
    store(m, keys(1, 2, 3), a)
    b = ReqContext("b")
    store(m, keys(4), b)
    assert m.policy_state() == {
        "policy": "lru",
        "ranks": {key(1): (0, -16), key(2): (0, -32), key(3): (0, -48), key(4): (2, 0)},
        "next_rank": 3,
    }
    out = m.prepare_store(keys(5, 6), ReqContext("c"))
    assert out is not None
    assert out.evicted_keys == [key(3), key(2)]  # the tail of request a goes first
    m.check_invariants()


def test_lru_request_access_only_raises_ranks() -> None:
    m = CPUOffloadingManager(8)
    a = ReqContext("a")
    store(m, keys(1), a)  # a draws request rank 0; key 1 gets (1, 0)
    store(m, keys(2, 3), ReqContext("b"))  # b: rank 2; keys (3, 0), (4, 0)
    m.touch(keys(3), a)  # (5, 0)
    a.set_offload_key_position(key(2), 8)
    a.set_offload_key_position(key(3), 8)
    # First sight of 2 and 3 by a: (0, -8) is older than both current ranks, so nothing changes.
    m.prepare_load(keys(2, 3), a)
    assert m.policy_state()["ranks"] == {key(1): (1, 0), key(2): (3, 0), key(3): (5, 0)}
    # A newer request raises them to (request rank, -position).
    c = ReqContext("c")
    c.set_offload_key_position(key(2), 8)
    m.prepare_load(keys(2, 3), c)  # c draws rank 6; key 3 has no position for c
    assert m.policy_state()["ranks"] == {key(1): (1, 0), key(2): (6, -8), key(3): (5, 0)}
    assert m.policy_state()["next_rank"] == 7
    # Seen keys are not accessed again: no change on a second load.
    m.touch(keys(2), ReqContext("d"))
    m.prepare_load(keys(2), c)
    assert m.policy_state()["ranks"][key(2)] == (7, 0)
    m.check_invariants()


def test_lru_request_rank_drawn_even_without_positions_but_not_by_touch() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("a")
    m.touch(keys(1), ctx)
    assert ctx.get_state(_RequestRank) is None
    m.on_new_request(ctx)
    assert ctx.get_state(_RequestRank) is None
    m.prepare_store([], ctx)  # records nothing new
    assert m.policy_state()["next_rank"] == 0
    store(m, keys(1), ctx)
    assert m.policy_state() == {"policy": "lru", "ranks": {key(1): (1, 0)}, "next_rank": 2}


def test_lru_ties_break_by_key_bytes() -> None:
    m = CPUOffloadingManager(2)
    ctx = ReqContext("a")
    high, low = b"\x02hash" + bytes(4), b"\x01hash" + bytes(4)
    ctx.set_offload_key_position(high, 16)
    ctx.set_offload_key_position(low, 16)
    store(m, [high, low], ctx)
    assert m.policy_state()["ranks"] == {high: (0, -16), low: (0, -16)}
    out = m.prepare_store(keys(9), ReqContext("b"))
    assert out is not None
    assert out.evicted_keys == [low]
    assert ids(out) == [1]


def test_lru_finish_orders_head_most_recent_and_higher_group_older() -> None:
    m = CPUOffloadingManager(8)
    ctx = ReqContext("a")
    a, b, c, d = key("a", 0), key("b", 0), key("c", 1), key("d", 1)
    for k, p in ((a, 16), (b, 32), (c, 16), (d, 32)):
        ctx.set_offload_key_position(k, p)
    store(m, [b, a, d, c], ctx)  # rank 0 for the request, next_rank 1
    m.on_request_finished(ctx)
    # Head to tail: a(16, g0), c(16, g1), b(32), d(32); ranks handed out from the tail.
    assert m.policy_state()["ranks"] == {d: (1, 0), b: (2, 0), c: (3, 0), a: (4, 0)}
    m.on_request_finished(ctx)  # once only
    assert m.policy_state()["next_rank"] == 5


def test_lru_finish_without_all_positions_keeps_first_seen_order_per_group() -> None:
    m = CPUOffloadingManager(8)
    ctx = ReqContext("a")
    a, b, c = key("a", 1), key("b", 0), key("c", 0)
    ctx.set_offload_key_position(a, 16)
    store(m, [a, b, c], ctx)  # a: (0, -16); b, c fresh
    m.on_request_finished(ctx)
    # Groups ascending: [b, c] then [a]; no global sort (b and c lack positions).
    assert m.policy_state()["ranks"] == {a: (3, 0), c: (4, 0), b: (5, 0)}


def test_lru_evict_is_all_or_nothing() -> None:
    lru = LruPolicy(cache_capacity=4)
    ctx = ReqContext("x")
    pinned = ChunkStatus(0, 1)
    ready = ChunkStatus(1, -1)
    lru.insert(key(1), pinned, ctx)
    lru.insert(key(2), ready, ctx)
    ready.ref_cnt = 0
    lru.mark_evictable(key(2))
    before = lru.state()
    assert lru.evict(2, set()) is None
    assert lru.evict(1, {key(2)}) is None
    assert lru.state() == before
    assert lru.evict(1, set()) == [(key(2), ready)]
    lru.check_invariants()


# -- ARC -------------------------------------------------------------------------------------------


def arc_with(
    t1: Sequence[tuple[str, int]] = (),
    t2: Sequence[tuple[str, int]] = (),
    b1: Sequence[str] = (),
    b2: Sequence[str] = (),
    capacity: int = 4,
) -> ArcPolicy:
    arc = ArcPolicy(cache_capacity=capacity)
    for i, (name, ref) in enumerate(t1):
        arc.t1[key(name)] = ChunkStatus(i, ref)
    for i, (name, ref) in enumerate(t2):
        arc.t2[key(name)] = ChunkStatus(len(t1) + i, ref)
    arc.b1.update((key(n), None) for n in b1)
    arc.b2.update((key(n), None) for n in b2)
    arc.check_invariants()
    return arc


def test_arc_ghost_hit_arithmetic() -> None:
    ctx = ReqContext("x")
    arc = arc_with(b1=["g"], b2=["h", "i", "j"], capacity=8)
    arc.touch([key("g")], ctx)  # B1 hit: += max(1, 3 / 1)
    assert arc.target_t1_size == 3.0
    arc.touch([key("h")], ctx)  # B2 hit: -= max(1, 1 / 3)
    assert arc.target_t1_size == 2.0
    arc = arc_with(b1=["g", "k"], b2=["h", "i", "j"], capacity=8)
    arc.on_store_miss([key("g"), key("zz")], ctx)  # += 3 / 2; not a ghost: nothing
    assert arc.target_t1_size == 1.5
    assert arc.state()["b1"] == [key("k"), key("g")]  # the hit moves to the newest end
    arc.target_t1_size = 7.5
    arc.touch([key("k")], ctx)
    assert arc.target_t1_size == 8.0  # capped at capacity
    arc.target_t1_size = 0.5
    arc.touch([key("i")], ctx)
    assert arc.target_t1_size == 0.0  # floored at 0
    assert isinstance(arc.state()["target_t1_size"], float)


def test_arc_touch_promotes_readable_and_refreshes_pending() -> None:
    ctx = ReqContext("x")
    arc = arc_with(t1=[("p", -1), ("r", 0), ("s", 2)], t2=[("t", 0), ("u", 0)], capacity=8)
    arc.touch(keys("r", "p", "t", "s"), ctx)  # processed s, t, p, r
    state = arc.state()
    assert state["t1"] == keys("p")
    assert state["t2"] == keys("u", "s", "t", "r")


def test_arc_evict_uses_virtual_t1_size_and_int_of_target() -> None:
    def fresh() -> ArcPolicy:
        return arc_with(t1=[("a", 1), ("b", 0)], t2=[("c", 0), ("d", 0)])

    arc = fresh()
    arc.target_t1_size = 2.9  # int() -> 2; |T1| = 2 (pinned a counts) so T1 goes first
    victims = arc.evict(2, set())
    assert victims is not None
    assert [k for k, _ in victims] == keys("b", "c")  # then virtual |T1| = 1 < 2: T2
    assert arc.state()["b1"] == keys("b")
    assert arc.state()["b2"] == keys("c")

    arc = fresh()
    arc.target_t1_size = 3.0
    victims = arc.evict(3, set())
    assert victims is not None
    assert [k for k, _ in victims] == keys("c", "d", "b")  # T2 first; T1 as the last resort

    arc = fresh()
    before = arc.state()
    assert arc.evict(1, {key("b"), key("c"), key("d")}) is None
    assert arc.evict(4, set()) is None
    assert arc.state() == before


def test_arc_ghost_lists_trimmed_to_capacity() -> None:
    m = CPUOffloadingManager(2, cache_policy="arc")
    for i in range(20):
        store(m, keys(i))
        state = m.policy_state()
        assert len(state["b1"]) <= 2
        assert len(state["b2"]) <= 2
    assert m.policy_state()["b1"] == keys(16, 17)
    assert m.policy_state()["t1"] == keys(18, 19)


def test_arc_store_miss_ghost_hit_and_failed_store_leaves_no_ghost() -> None:
    m = CPUOffloadingManager(2, cache_policy="arc")
    store(m, keys(1, 2))
    store(m, keys(3))  # evicts 1 into B1
    assert m.policy_state()["b1"] == keys(1)
    out = m.prepare_store(keys(1), ReqContext("b"))  # ghost hit: target 1.0, evicts 2
    assert out is not None
    assert out.evicted_keys == keys(2)
    assert m.policy_state()["target_t1_size"] == 1.0
    m.complete_store(keys(1), ReqContext("b"), success=False)
    state = m.policy_state()
    assert state["t1"] == keys(3)
    assert state["b1"] == keys(2)  # 1 left B1 on insert and got no ghost on failure
    m.check_invariants()


def test_arc_finish_moves_reused_to_t2_and_inserted_to_newest() -> None:
    m = CPUOffloadingManager(8, cache_policy="arc")
    store(m, keys(1, 2, 3))
    ctx = ReqContext("r")
    m.prepare_load(keys(1), ctx)  # reused (pinned)
    m.complete_load(keys(1), ctx)
    out = m.prepare_store(keys(4, 5, 2), ctx)  # 4, 5 inserted (pending); 2 existing -> reused
    assert out is not None
    m.touch(keys(3), ReqContext("other"))  # 3 -> T2; ctx never saw 3
    assert m.policy_state()["t1"] == keys(1, 2, 4, 5)
    m.on_request_finished(ctx)
    state = m.policy_state()
    # Head to tail: 1, 4, 5, 2 (first-seen). Walked tail first: 2 -> T2, 5, 4 -> T1 newest,
    # 1 -> T2 newest, so the head ends up most recent.
    assert state["t1"] == keys(5, 4)
    assert state["t2"] == keys(3, 2, 1)
    m.check_invariants()


def test_arc_debug_target_only_for_arc() -> None:
    m = CPUOffloadingManager(4, cache_policy="arc")
    m._debug_set_arc_target(2.5)
    assert m.policy_state()["target_t1_size"] == 2.5
    with pytest.raises(InvalidArgumentError):
        CPUOffloadingManager(4)._debug_set_arc_target(1.0)


# -- admission tracker -----------------------------------------------------------------------------


def test_tracker_two_pass_protection() -> None:
    t = AdmissionTracker(3)
    t.count_offer(keys("a", "b", "c"))
    t.count_offer(keys("d"))
    assert t.state() == [(key("b"), 1), (key("c"), 1), (key("d"), 1)]  # a dropped
    # All tracked keys are part of the offer: e finds nothing to drop and stays untracked.
    t.count_offer(keys("e", "b", "c", "d"))
    assert t.state() == [(key("b"), 2), (key("c"), 2), (key("d"), 2)]
    assert t.count(key("e")) == 0
    # b is counted in pass 1 (moved newest) and protected; c is the oldest unprotected entry.
    t.count_offer(keys("f", "b"))
    assert t.state() == [(key("d"), 2), (key("b"), 3), (key("f"), 1)]
    t.count_offer(keys("d", "d"))  # +1 per occurrence
    assert t.state() == [(key("b"), 3), (key("f"), 1), (key("d"), 4)]
    t.check_invariants()


def test_tracker_threshold_in_manager() -> None:
    m = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=3)
    ctx = ReqContext("r")
    out = m.prepare_store(keys(1, 2, 3), ctx)
    assert out is not None
    assert out.keys_to_store == []
    assert ids(out) == []
    assert out.evicted_keys == []
    assert stats(m)[CPUOffloadingMetrics.STORES_SKIPPED] == {(): 3}
    assert stats(m)[CPUOffloadingMetrics.STORES_SKIPPED] == {(): 0}
    out = m.prepare_store(keys(2, 4), ctx)
    assert out is not None
    assert out.keys_to_store == keys(2)
    assert m.tracker_state() == [(key(3), 1), (key(2), 2), (key(4), 1)]
    assert CPUOffloadingManager(4).tracker_state() is None


# -- chunk ids -------------------------------------------------------------------------------------


def test_chunk_ids_reuse_evicted_last_freed_first() -> None:
    m = CPUOffloadingManager(2)
    assert ids(store(m, keys(1, 2))) == [0, 1]
    out = store(m, keys(3, 4))
    assert out.evicted_keys == keys(1, 2)
    assert ids(out) == [1, 0]

    m = CPUOffloadingManager(4)
    store(m, keys(1, 2, 3))
    out = store(m, keys(4, 5, 6))
    assert out.evicted_keys == keys(1, 2)
    assert ids(out) == [3, 1, 0]  # the never-used id first
    assert m.pool_state() == (4, [])


def test_chunk_ids_failed_store_frees_in_completion_order_and_reset() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    m.prepare_store(keys(1, 2, 3), ctx)
    m.complete_store(keys(3, 9, 1, 3), ctx, success=False)
    assert m.pool_state() == (3, [2, 0])
    assert ids(store(m, keys(4, 5))) == [3, 0]
    m.reset_cache()
    assert m.pool_state() == (0, [])
    assert m.resident() == {}
    assert ids(store(m, keys(6))) == [0]


# -- request state ---------------------------------------------------------------------------------


def test_finished_request_may_reuse_seen_keys_only() -> None:
    m = CPUOffloadingManager(4, store_threshold=2)
    ctx = ReqContext("r")
    store(m, keys(1), ReqContext("other"))  # threshold: nothing stored
    store(m, keys(1), ReqContext("other"))  # second offer: stored
    m.prepare_load(keys(1), ctx)
    m.complete_load(keys(1), ctx)
    m.on_request_finished(ctx)
    m.prepare_load(keys(1), ctx)  # seen: fine
    m.complete_load(keys(1), ctx)
    # 2 is a candidate dropped by the threshold: it is not recorded, so it is legal.
    out = m.prepare_store(keys(1, 2), ctx)
    assert out is not None
    assert out.keys_to_store == []
    with pytest.raises(RequestFinishedError):
        m.prepare_store(keys(2), ctx)  # now 2 reaches the threshold and would be recorded
    m.reset_cache()
    out = m.prepare_store(keys(2), ctx)  # stale state: a fresh, unfinished one
    assert out is not None
    assert out.keys_to_store == keys(2)
    state = ctx.get_state(_RequestState)
    assert state is not None
    assert not state.finished


def test_on_request_finished_without_state_creates_nothing() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    m.on_request_finished(ctx)
    assert ctx.get_state(_RequestState) is None
    m.on_new_request(ctx)
    m.on_request_finished(ctx)
    m.on_new_request(ctx)  # a current finished state stays finished
    state = ctx.get_state(_RequestState)
    assert state is not None
    assert state.finished


def test_prepare_store_skips_pending_and_counts_existing_as_reused() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    m.prepare_store(keys(1), ReqContext("other"))  # 1 pending
    store(m, keys(2), ReqContext("other"))
    out = m.prepare_store(keys(1, 2, 3), ctx)
    assert out is not None
    assert out.keys_to_store == keys(3)
    state = ctx.get_state(_RequestState)
    assert state is not None
    assert list(state.seen) == keys(2, 3)
    assert state.reused == {key(2)}
    assert state.inserted == {key(3)}
    assert state.store_misses_reported == {key(3)}


def test_prepare_store_none_keeps_its_side_effects() -> None:
    m = CPUOffloadingManager(2, cache_policy="arc")
    store(m, keys(1))
    store(m, keys(2))
    store(m, keys(3))  # 1 -> B1
    m.prepare_load(keys(2, 3), ReqContext("loader"))  # nothing evictable now
    ctx = ReqContext("r")
    assert m.prepare_store(keys(1, 2), ctx) is None
    assert m.policy_state()["target_t1_size"] == 1.0  # on_store_miss ghost hit
    state = ctx.get_state(_RequestState)
    assert state is not None
    assert list(state.seen) == keys(1, 2)
    assert state.reused == {key(2)}
    assert state.inserted == set()
    assert stats(m)[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE] == {(): [1, 1, 1, 1]}
    # The store miss is reported once per request: no second ghost hit.
    assert m.prepare_store(keys(1), ctx) is None
    assert m.policy_state()["target_t1_size"] == 1.0
    assert m.prepare_store(keys(1), ReqContext("other")) is None
    assert m.policy_state()["target_t1_size"] == 2.0


def test_reset_keeps_events_tracker_samples_and_skips() -> None:
    m = CPUOffloadingManager(4, enable_events=True, store_threshold=2)
    ctx = ReqContext("r")
    for _ in range(2):
        m.prepare_store(keys(1, 2), ctx)
    m.complete_store(keys(1, 2), ctx)
    m.prepare_store(keys(3), ctx)  # skipped
    m.reset_cache()
    assert m.resident() == {}
    assert m.policy_state() == {"policy": "lru", "ranks": {}, "next_rank": 0}
    assert m.tracker_state() == [(key(1), 2), (key(2), 2), (key(3), 1)]
    events = list(m.take_events())
    assert [e.keys for e in events] == [keys(1, 2)]
    data = stats(m)
    assert data[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE] == {(): [2]}
    assert data[CPUOffloadingMetrics.STORES_SKIPPED] == {(): 3}
    m.check_invariants()


# -- events ----------------------------------------------------------------------------------------


def test_take_events_is_lazy() -> None:
    m = CPUOffloadingManager(4, enable_events=True)
    ctx = ReqContext("r")
    store(m, keys(1))
    it = m.take_events()
    store(m, keys(2))  # queued before the first step: same batch
    first = next(it)
    store(m, keys(3))  # after the batch was detached: next batch
    assert [first.keys, *(e.keys for e in it)] == [keys(1), keys(2)]
    assert [e.keys for e in m.take_events()] == [keys(3)]
    m.take_events()  # never stepped: detaches nothing
    store(m, keys(4), ctx)
    assert [e.keys for e in m.take_events()] == [keys(4)]


def test_metadata_only_events_filtered_when_reached() -> None:
    m = CPUOffloadingManager(4, enable_events=True)
    ctx = ReqContext("r")
    store(m, keys(9))
    m.prepare_store(keys(1, 2), ctx)
    m.complete_store(keys(1, 2), ctx, success=False)
    m.prepare_store(keys(3), ctx)
    m.complete_store(keys(3), ctx, success=False)
    it = m.take_events()
    stored = next(it)
    assert stored.keys == keys(9)
    assert not stored.removed
    m.prepare_store(keys(1, 3), ctx)  # resident (pending) again before the events are reached
    rest = list(it)
    assert len(rest) == 1
    assert rest[0].keys == keys(2)
    assert rest[0].removed
    assert rest[0].metadata_only
    assert list(CPUOffloadingManager(4).take_events()) == []


def test_eviction_event_precedes_and_disabled_events_queue_nothing() -> None:
    m = CPUOffloadingManager(1, enable_events=True)
    store(m, keys(1))
    store(m, keys(2))
    events = list(m.take_events())
    assert [(e.removed, e.metadata_only, e.keys) for e in events] == [
        (False, False, keys(1)),
        (True, False, keys(1)),
        (False, False, keys(2)),
    ]
    m = CPUOffloadingManager(1)
    store(m, keys(1))
    store(m, keys(2))
    assert list(m.take_events()) == []


# -- stats -----------------------------------------------------------------------------------------


def test_usage_gauges() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    m.prepare_store(keys(1, 2), ctx)
    store(m, keys(3))
    m.prepare_load(keys(3), ctx)
    data = stats(m)
    assert data[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC] == {(): 0.75}
    assert data[CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC] == {(): 0.5}
    assert data[CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC] == {(): 0.25}
    assert data[CPUOffloadingMetrics.CPU_ALLOCATION_SIZE] == {(): [2, 1]}
    assert CPUOffloadingMetrics.STORES_SKIPPED not in data
    assert CPUOffloadingMetrics.CPU_ALLOCATION_SIZE not in stats(m)
    assert stats(CPUOffloadingManager(0))[CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC] == {(): 0.0}


# -- policies: resolution and the base class defaults ----------------------------------------------


class _Recorder(CachePolicy):
    """Minimal policy that records touches (for the base-class defaults)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.touches: list[list[bytes]] = []

    def get(self, key: bytes) -> ChunkStatus | None:
        return None

    def insert(self, key: bytes, status: ChunkStatus, req_context: Any) -> None:
        raise AssertionError

    def remove(self, key: bytes) -> None:
        raise AssertionError

    def touch(self, keys: Sequence[bytes], req_context: Any) -> None:
        self.touches.append(list(keys))

    def evict(self, n: int, protected: Set[bytes]) -> list[tuple[bytes, ChunkStatus]] | None:
        return None

    def clear(self) -> None:
        self.touches = []

    def items(self) -> Any:
        return iter(())


def test_policy_base_defaults() -> None:
    p = _Recorder(cache_capacity=4)
    ctx = ReqContext("r")
    p.on_store_miss(keys(1, 2), ctx)
    p.on_request_access(keys(3), ctx)
    p.on_request_finished([keys(4, 5), keys(6)], {key(4)}, set(), ctx)
    assert p.touches == [keys(1, 2), keys(4, 5), keys(6)]


def test_policy_resolution() -> None:
    m = CPUOffloadingManager(
        4, cache_policy="LruPolicy", cache_policy_module_path="kvoffload.reference.lru"
    )
    assert m.policy_state() == {"policy": "LruPolicy"}
    assert ids(store(m, keys(1))) == [0]
    with pytest.raises(InvalidArgumentError):
        m._debug_set_arc_target(1.0)
    m = CPUOffloadingManager(4, cache_policy="arc", cache_policy_module_path="no.such.module")
    assert m.policy_state()["policy"] == "arc"
    with pytest.raises(ValueError, match="lru"):
        CPUOffloadingManager(4, cache_policy="mru")


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_chunks": -1},
        {"num_chunks": 4, "store_threshold": -1},
        {"num_chunks": 4, "store_threshold": 2, "max_tracker_size": 0},
        {"num_chunks": 1.5},
    ],
)
def test_constructor_rejects(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        CPUOffloadingManager(**kwargs)


# -- illegal calls change nothing ------------------------------------------------------------------


def request_snapshot(ctx: ReqContext) -> Any:
    state = ctx.get_state(_RequestState)
    rank = ctx.get_state(_RequestRank)
    if state is None:
        return None, rank and rank.rank
    return (
        state.generation,
        state.finished,
        list(state.seen),
        sorted(state.inserted),
        sorted(state.reused),
        sorted(state.store_misses_reported),
        rank and rank.rank,
    )


def snapshot(m: CPUOffloadingManager, ctx: ReqContext) -> Any:
    return (
        m.policy_state(),
        m.resident(),
        m.tracker_state(),
        m.pool_state(),
        request_snapshot(ctx),
        [(e.keys, e.removed) for e in m._events or []],
        list(m._allocation_sizes),
        m._stores_skipped,
    )


def populated(policy: str) -> tuple[CPUOffloadingManager, ReqContext]:
    """4 chunks: 1 pinned once, 2 ready, 3 pending; ctx saw 1, 2, 3, then finished."""
    m = CPUOffloadingManager(4, cache_policy=policy, enable_events=True, store_threshold=2)
    ctx = ReqContext("r")
    for _ in range(2):
        m.prepare_store(keys(1, 2), ctx)
    m.complete_store(keys(1, 2), ctx)
    m.prepare_store(keys(3), ctx)
    m.prepare_store(keys(3), ctx)
    m.prepare_load(keys(1), ctx)
    m.on_request_finished(ctx)
    m.prepare_store(keys(4), ReqContext("o"))  # 4 counted once: a second offer admits it
    m.check_invariants()
    return m, ctx


def _bad_position(m: CPUOffloadingManager, ctx: ReqContext) -> None:
    fresh = ReqContext("p")
    fresh.set_offload_key_position(key(2), "16")  # type: ignore[arg-type]
    try:
        m.prepare_load(keys(2), fresh)
    finally:
        assert fresh.get_state(_RequestState) is None


def _bad_position_in_store(m: CPUOffloadingManager, ctx: ReqContext) -> None:
    fresh = ReqContext("p")
    fresh.set_offload_key_position(key(4), 1.5)  # type: ignore[arg-type]
    m.prepare_store(keys(4), fresh)


ILLEGAL: list[
    tuple[str, Callable[[CPUOffloadingManager, ReqContext], Any], type[KVOffloadError]]
] = [
    ("lookup str key", lambda m, c: m.lookup("k", c), InvalidKeyError),  # type: ignore[arg-type]
    ("prepare_load int keys", lambda m, c: m.prepare_load(5, c), InvalidKeyError),  # type: ignore[arg-type]
    ("prepare_load str key", lambda m, c: m.prepare_load([key(1), "k"], c), InvalidKeyError),  # type: ignore[list-item]
    ("prepare_load bytes", lambda m, c: m.prepare_load(key(1), c), InvalidKeyError),  # type: ignore[arg-type]
    ("prepare_load absent", lambda m, c: m.prepare_load([key(1), key(9)], c), KeyStateError),
    ("prepare_load pending", lambda m, c: m.prepare_load([key(2), key(3)], c), KeyStateError),
    ("complete_load ready", lambda m, c: m.complete_load([key(1), key(2)], c), KeyStateError),
    ("complete_load twice", lambda m, c: m.complete_load([key(1), key(1)], c), KeyStateError),
    ("complete_load pending", lambda m, c: m.complete_load([key(3)], c), KeyStateError),
    ("complete_load None", lambda m, c: m.complete_load([None], c), InvalidKeyError),  # type: ignore[list-item]
    (
        "prepare_store dup",
        lambda m, c: m.prepare_store(keys(7, 8, 7), ReqContext("x")),
        DuplicateKeyError,
    ),
    ("prepare_store None", lambda m, c: m.prepare_store(None, c), InvalidKeyError),  # type: ignore[arg-type]
    ("prepare_store bytearray", lambda m, c: m.prepare_store([bytearray(8)], c), InvalidKeyError),  # type: ignore[list-item]
    ("complete_store int", lambda m, c: m.complete_store([key(3), 1], c), InvalidKeyError),  # type: ignore[list-item]
    ("touch str", lambda m, c: m.touch(["a"], c), InvalidKeyError),  # type: ignore[list-item]
    ("finished store of unseen", lambda m, c: m.prepare_store(keys(2, 4), c), RequestFinishedError),
    ("bad position", _bad_position, InvalidArgumentError),
    ("bad position in store", _bad_position_in_store, InvalidArgumentError),
]


#: The cases for each policy: only LRU reads positions before a request finishes.
ILLEGAL_BY_POLICY = [
    pytest.param(policy, *case, id=f"{case[0]}-{policy}")
    for case in ILLEGAL
    for policy in ("lru", "arc")
    if policy == "lru" or not case[0].startswith("bad position")
]


@pytest.mark.parametrize(("policy", "name", "call", "error"), ILLEGAL_BY_POLICY)
def test_illegal_call_changes_nothing(
    policy: str,
    name: str,
    call: Callable[[CPUOffloadingManager, ReqContext], Any],
    error: type[KVOffloadError],
) -> None:
    m, ctx = populated(policy)
    before = snapshot(m, ctx)
    with pytest.raises(error):
        call(m, ctx)
    assert snapshot(m, ctx) == before
    m.check_invariants()


def test_finished_request_load_of_unseen_readable_key() -> None:
    m, ctx = populated("lru")
    store(m, keys(4), ReqContext("o"))
    before = snapshot(m, ctx)
    with pytest.raises(RequestFinishedError):
        m.prepare_load(keys(1, 4), ctx)
    assert snapshot(m, ctx) == before


def test_bad_position_at_finish_leaves_request_unfinished() -> None:
    m, _ = populated("lru")
    ctx = ReqContext("p")
    m.prepare_load(keys(2), ctx)
    before = snapshot(m, ctx)
    ctx.set_offload_key_position(key(2), 1.5)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError):
        m.on_request_finished(ctx)
    assert snapshot(m, ctx) == before
    ctx.set_offload_key_position(key(2), 16)
    m.on_request_finished(ctx)
    assert request_snapshot(ctx)[1] is True


def test_legal_repeats_and_any_key_length() -> None:
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    odd = [b"", b"\x01", b"long" * 10]
    store(m, odd, ctx)
    spec = m.prepare_load([odd[1], odd[1], odd[0]], ctx)
    assert [int(i) for i in spec.block_ids] == [1, 1, 0]
    assert m.resident()[odd[1]] == (1, 2)
    m.complete_load([odd[1], odd[1], odd[0]], ctx)
    assert m.resident()[odd[1]] == (1, 0)
    assert m.lookup(odd[2], ctx) is LookupResult.HIT
    assert m.lookup_prefix([odd[0], odd[1], key(7), odd[2]], ctx) == 2
    m.check_invariants()


#: The Rust core's sources, read for the limit and the message the reference must match.
RUST_CORE = Path(__file__).resolve().parent.parent / "rust" / "kvoffload-core" / "src"


def test_a_key_too_long_to_store_is_refused_as_by_the_rust_manager(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A key of 4 GiB is too big for a test: the limit and the message are read from the Rust
    # source (whose format's {i} and {MAX_KEY_LEN} are str.format's too), and a lower limit
    # makes small keys too long.
    table = (RUST_CORE / "table.rs").read_text()
    assert "pub const MAX_KEY_LEN: usize = u32::MAX as usize;" in table
    assert reference_manager.MAX_KEY_LEN == 2**32 - 1
    source = (RUST_CORE / "manager.rs").read_text()
    found = re.search(r'fn check_key_lengths.*?format!\(\s*"([^"]*)"', source, re.DOTALL)
    assert found is not None
    template = found.group(1)
    monkeypatch.setattr(reference_manager, "MAX_KEY_LEN", 8)
    m, ctx = populated("lru")
    before = snapshot(m, ctx)
    fresh = ReqContext("p")
    long = b"L" * 9
    # The first too long key is named, before any repeat is looked for (as in the Rust manager).
    for offer, i in [([long], 0), ([b"s" * 8, b"", long, long], 2)]:
        with pytest.raises(InvalidArgumentError) as info:
            m.prepare_store(offer, fresh)
        assert str(info.value) == template.format(i=i, MAX_KEY_LEN=8)
        assert snapshot(m, ctx) == before
        assert fresh.get_state(_RequestState) is None
        m.check_invariants()
    # A key of the limit's length is stored.
    m = CPUOffloadingManager(4)
    out = m.prepare_store([b"s" * 8, b""], fresh)
    assert out is not None
    assert out.keys_to_store == [b"s" * 8, b""]
    m.check_invariants()


def _corruptible(policy: str) -> tuple[CPUOffloadingManager, list[bytes]]:
    """Four ready keys in eight chunks, the second pinned by a load."""
    m = CPUOffloadingManager(8, cache_policy=policy)
    ctx = ReqContext(req_id="r")
    keys = [bytes([i]) * 8 for i in range(4)]
    m.prepare_store(keys, ctx)
    m.complete_store(keys, ctx)
    m.prepare_load(keys[1:2], ctx)
    m.check_invariants()
    return m, keys


CORRUPTIONS: dict[str, tuple[Callable[[Any, list[bytes]], None], str]] = {
    "a used chunk also free": (lambda m, ks: m._pool.free_ids.append(0), "also free"),
    "a repeat on the free list": (
        lambda m, ks: m._pool.free_ids.extend([7, 7]),
        "repeats",
    ),
    "a ref count below -1": (lambda m, ks: setattr(m._policy.get(ks[0]), "ref_cnt", -2), "-2"),
    "a ready chunk counted as pinned": (
        lambda m, ks: setattr(m._policy.get(ks[0]), "ref_cnt", 1),
        "evictable chunks",
    ),
    "two keys on one chunk": (
        lambda m, ks: setattr(m._policy.get(ks[2]), "chunk_id", 3),
        "held by both",
    ),
}


@pytest.mark.parametrize("what", list(CORRUPTIONS))
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_check_invariants_finds_each_broken_invariant(policy: str, what: str) -> None:
    m, keys = _corruptible(policy)
    corrupt, says = CORRUPTIONS[what]
    corrupt(m, keys)
    with pytest.raises(InvariantViolation, match=says):
        m.check_invariants()


# -- a plug-in policy with vLLM's method set only ------------------------------------------------


@pytest.fixture
def plain() -> Callable[..., CPUOffloadingManager]:
    """``plain(num_chunks, **kwargs)``: a reference manager driving an `OldestFirst` policy."""

    def make(num_chunks: int, **kwargs: Any) -> CPUOffloadingManager:
        return CPUOffloadingManager(
            num_chunks, cache_policy="OldestFirst", cache_policy_module_path="_helpers", **kwargs
        )

    return make


def test_check_invariants_and_resident_work_with_any_policy(
    plain: Callable[..., CPUOffloadingManager],
) -> None:
    m = plain(3)
    ctx = ReqContext("r")
    store(m, keys(1, 2, 3), ctx)  # check_invariants, with nothing but vLLM's methods to go by
    m.prepare_load(keys(2), ctx)
    out = m.prepare_store(keys(4), ctx)  # evicts 1, the oldest unpinned
    assert out is not None
    assert out.evicted_keys == keys(1)
    m.check_invariants()
    assert m.resident() == {key(2): (1, 1), key(3): (2, 0), key(4): (0, -1)}
    m.complete_store(keys(4), ctx, success=False)
    m.check_invariants()
    assert set(m.resident()) == set(keys(2, 3))
    m.reset_cache()
    m.check_invariants()
    assert m.resident() == {}


def test_check_invariants_finds_a_policy_that_lost_a_key(
    plain: Callable[..., CPUOffloadingManager],
) -> None:
    m = plain(3)
    store(m, keys(1, 2))
    del m.policy.chunks[key(2)]  # type: ignore[attr-defined]
    with pytest.raises(InvariantViolation, match="get"):
        m.check_invariants()


def _raising_evict(p: OldestFirst, n: int, protected: Any) -> Any:
    raise RuntimeError("policy failed in evict")


@pytest.mark.parametrize("admission", ["tracker", "tinylfu"])
@pytest.mark.parametrize(
    ("answer", "error"),
    [
        pytest.param(lambda p, n, prot: [], PolicyError, id="none"),
        pytest.param(lambda p, n, prot: list(p.chunks.items()), PolicyError, id="all"),
        pytest.param(lambda p, n, prot: [(key(9), ChunkStatus(0))], PolicyError, id="not held"),
        pytest.param(
            lambda p, n, prot: [(k, c) for k, c in p.chunks.items() if k in prot],
            PolicyError,
            id="protected",
        ),
        pytest.param(_raising_evict, RuntimeError, id="raises"),
    ],
)
def test_a_failed_eviction_leaves_the_offer_uncounted_and_unrecorded(
    plain: Callable[..., CPUOffloadingManager],
    admission: str,
    answer: Callable[[OldestFirst, int, Any], Any],
    error: type[Exception],
) -> None:
    # As in the Rust manager: the policy hears of the store misses and the access, but the
    # manager counts the offer, records the request's access and samples the allocation only
    # once the eviction succeeded or declined.
    m = plain(3, store_threshold=2, admission=admission, enable_events=True)
    for req in ("a", "b"):  # the second request's offer reaches the threshold
        m.prepare_store(keys(1, 2, 3), ReqContext(req))
    m.complete_store(keys(1, 2, 3), ReqContext("b"))
    m.prepare_store(keys(4, 1), ReqContext("o"))  # 4 counted once: admitted next time
    ctx = ReqContext("r")
    m.prepare_load(keys(1), ctx)
    m.complete_load(keys(1), ctx)
    sketch = m._sketch

    def counts() -> Any:
        return None if sketch is None else (bytes(sketch.table), sketch.samples)

    before = (snapshot(m, ctx), counts())
    m.policy.answer = answer  # type: ignore[attr-defined]
    with pytest.raises(error):
        m.prepare_store(keys(4, 1), ctx)
    assert (snapshot(m, ctx), counts()) == before
    m.check_invariants()
    m.policy.answer = None  # type: ignore[attr-defined]
    out = m.prepare_store(keys(4, 1), ctx)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys) == (keys(4), keys(2))
    m.check_invariants()
