"""Scenario tests: the behaviours vLLM's own manager tests check, as vLLM 0.33.0 shows them.

Each test names the SCENARIOS.md section it comes from. Keys are the decimal string of a small
integer plus a KV-group index, and one shared request context (``req_id=""``) is used where the
original tests do so. Every test runs against both implementations (the ``make_manager`` fixture).
"""

from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import pytest

from _helpers import (
    ALLOC,
    HIT,
    MISS,
    PENDING,
    READ,
    SKIPPED,
    USAGE,
    WRITE,
    MakeManager,
    chunk_ids,
    drain,
    k,
    ks,
    store,
)
from kvoffload import (
    CacheHitSource,
    LookupResult,
    Medium,
    OffloadingEvent,
    ReqContext,
)


def lookups(m: Any, ctx: Any, *ids: int) -> list[LookupResult]:
    return [m.lookup(x, ctx) for x in ks(*ids)]


def gauges(m: Any) -> dict[str, Any]:
    """One get_stats() call, flattened to {name: value}."""
    stats = m.get_stats()
    assert stats is not None
    return {name: series[()] for name, series in stats.data["data"].items()}


def evictable(m: Any) -> int:
    """Resident chunks with ref count 0 (the private evictable counter, seen from outside)."""
    return sum(1 for _, ref in m.resident().values() if ref == 0)


def arc_lists(m: Any) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    state = m.policy_state()
    assert state["policy"] == "arc"
    return (list(state["t1"]), list(state["t2"]), list(state["b1"]), list(state["b2"]))


# --- 1. Store, complete, lookup basics -------------------------------------------------------


def test_s1_store_complete_lookup_basics(make_manager: MakeManager) -> None:
    m = make_manager(4, enable_events=True)
    ctx = ReqContext(req_id="")
    out = m.prepare_store(ks(1, 2), ctx)
    assert out is not None
    assert out.keys_to_store == ks(1, 2)
    assert chunk_ids(out) == [0, 1]
    assert out.evicted_keys == []
    # prepared but not completed: not readable
    assert lookups(m, ctx, 1, 2) == [PENDING, PENDING]
    assert drain(m) == []
    m.complete_store(ks(1, 2), ctx)
    assert lookups(m, ctx, 1, 2) == [HIT, HIT]
    assert drain(m) == [("stored", ks(1, 2))]
    assert m.lookup(k(3), ctx) is MISS
    m.check_invariants()


# --- 2. LRU eviction walk-through (4 chunks) -------------------------------------------------


def test_s2_lru_walkthrough(make_manager: MakeManager) -> None:
    m = make_manager(4, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    assert drain(m) == [("stored", ks(1, 2))]

    out = m.prepare_store(ks(2, 3, 4, 5), ctx)
    assert out is not None
    assert out.keys_to_store == ks(3, 4, 5)
    assert out.evicted_keys == ks(1)
    assert chunk_ids(out) == [2, 3, 0]
    assert drain(m) == [("removed", ks(1))]

    # 3, 4, 5 are being written, so only 2 could be evicted: cannot store two keys
    assert m.prepare_store(ks(1, 6), ctx) is None
    m.complete_store(ks(3, 4, 5), ctx)
    assert lookups(m, ctx, 1, 0) == [MISS, MISS]
    assert lookups(m, ctx, 2, 3, 4, 5) == [HIT] * 4

    load = m.prepare_load(ks(2, 3), ctx)
    assert chunk_ids(load) == [1, 2]
    assert m.prepare_store(ks(6, 7, 8), ctx) is None
    m.complete_load(ks(2, 3), ctx)

    # completing the load does not refresh recency: 2, 3, 4 go, ids last-freed first
    out = m.prepare_store(ks(6, 7, 8), ctx)
    assert out is not None
    assert out.keys_to_store == ks(6, 7, 8)
    assert out.evicted_keys == ks(2, 3, 4)
    assert chunk_ids(out) == [3, 2, 1]
    m.complete_store(ks(6, 7, 8), ctx)

    m.touch(ks(5, 6, 7), ctx)
    out = m.prepare_store(ks(9), ctx)
    assert out is not None
    assert out.evicted_keys == ks(8)
    assert chunk_ids(out) == [1]

    m.complete_store(ks(7, 9), ctx, success=False)
    assert lookups(m, ctx, 7, 9) == [HIT, MISS]

    assert drain(m) == [
        ("stored", ks(3, 4, 5)),
        ("removed", ks(2, 3, 4)),
        ("stored", ks(6, 7, 8)),
        ("removed", ks(8)),
        ("cleanup", ks(9)),  # 0.33.0: the failed store of 9 emits a metadata-only removal
    ]
    m.check_invariants()


# --- 3. Already-stored keys of an offer are protected ---------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_s3_offered_existing_key_is_not_evicted(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(4, cache_policy=policy)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.touch(ks(1), ctx)  # 2 is now the eviction candidate, but it is offered below
    out = m.prepare_store(ks(2, 3, 4, 5), ctx)
    assert out is not None
    assert out.keys_to_store == ks(3, 4, 5)
    assert chunk_ids(out) == [2, 3, 0]
    assert out.evicted_keys == ks(1)
    m.complete_store(out.keys_to_store, ctx)
    assert m.lookup(k(2), ctx) is HIT
    m.check_invariants()


# --- 4. prepare_load ordering ----------------------------------------------------------------


@pytest.mark.parametrize("order", list(itertools.permutations(range(3))))
def test_s4_load_ids_line_up_with_keys(make_manager: MakeManager, order: tuple[int, ...]) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 10, 11, 12)  # ids 0, 1, 2
    keys = [k(10 + i) for i in order]
    spec = m.prepare_load(keys, ctx)
    assert chunk_ids(spec) == list(order)
    m.complete_load(keys, ctx)
    # the same keys load again after complete_load
    spec = m.prepare_load(keys, ctx)
    assert chunk_ids(spec) == list(order)
    m.complete_load(keys, ctx)
    assert all(ref == 0 for _, ref in m.resident().values())
    m.check_invariants()


# --- 5. ARC policy ---------------------------------------------------------------------------


def test_s5_arc_completed_chunks_sit_in_t1(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    assert arc_lists(m) == (ks(1, 2), [], [], [])
    m.check_invariants()


def test_s5_arc_touch_moves_ready_t1_chunk_to_t2(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.touch(ks(1), ctx)
    assert arc_lists(m) == (ks(2), ks(1), [], [])
    m.check_invariants()


def test_s5_arc_store_fails_while_loads_pin_chunks(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3, 4)
    m.prepare_load(ks(1, 2), ctx)
    assert m.prepare_store(ks(5, 6, 7), ctx) is None
    m.complete_load(ks(1, 2), ctx)
    out = m.prepare_store(ks(5, 6, 7), ctx)
    assert out is not None
    assert out.evicted_keys == ks(1, 2, 3)
    assert chunk_ids(out) == [2, 1, 0]
    m.check_invariants()


def test_s5_arc_ghost_hit_raises_target(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    out = store(m, ctx, 3)
    assert out.evicted_keys == ks(1)
    assert arc_lists(m)[2] == ks(1)
    assert m.policy_state()["target_t1_size"] == 0.0
    m.touch(ks(1), ctx)  # a miss that hits ghost list B1
    assert m.policy_state()["target_t1_size"] == 1.0
    m.check_invariants()


def _arc_t1_12_t2_34(make_manager: MakeManager) -> tuple[Any, ReqContext]:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3, 4)
    m.touch(ks(3), ctx)
    m.touch(ks(4), ctx)
    assert arc_lists(m) == (ks(1, 2), ks(3, 4), [], [])
    return m, ctx


def test_s5_arc_target_one_evicts_t1_lru_end(make_manager: MakeManager) -> None:
    m, ctx = _arc_t1_12_t2_34(make_manager)
    m._debug_set_arc_target(1.0)
    out = m.prepare_store(ks(5), ctx)
    assert out is not None
    assert out.evicted_keys == ks(1)
    assert chunk_ids(out) == [0]
    t1, _, b1, _ = arc_lists(m)
    assert b1 == ks(1)
    assert t1 == ks(2, 5)
    m.check_invariants()


def test_s5_arc_ghost_lists_bounded_by_capacity(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    for i in range(3, 20):  # 17 more single-key stores
        store(m, ctx, i)
        _, _, b1, b2 = arc_lists(m)
        assert len(b1) <= 2
        assert len(b2) <= 2
    assert arc_lists(m) == (ks(18, 19), [], ks(16, 17), [])
    m.check_invariants()


def test_s5_arc_touch_first_key_is_most_recent(make_manager: MakeManager) -> None:
    m, ctx = _arc_t1_12_t2_34(make_manager)
    m.touch(ks(1, 3, 4), ctx)
    t1, t2, _, _ = arc_lists(m)
    assert t1 == ks(2)
    # 0.33.0 walks a touch list from last to first: 1 ends up most recent
    assert t2 == ks(4, 3, 1)
    out = m.prepare_store(ks(5), ctx)
    assert out is not None
    assert out.evicted_keys == ks(2)
    assert chunk_ids(out) == [1]
    m.check_invariants()


def test_s5_arc_failed_store_keeps_eviction(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3, 4)
    out = m.prepare_store(ks(5), ctx)
    assert out is not None
    assert out.evicted_keys == ks(1)
    m.complete_store(ks(5), ctx, success=False)
    assert m.lookup(k(5), ctx) is MISS
    t1, t2, b1, b2 = arc_lists(m)
    assert k(5) not in t1 + t2 + b1 + b2
    assert b1 == ks(1)
    assert m.lookup(k(1), ctx) is MISS
    m.check_invariants()


def test_s5_arc_full_scenario(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc", enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    out = store(m, ctx, 3, 4, 5)
    assert len(out.evicted_keys) == 1
    m.touch(ks(2, 3), ctx)
    t1, t2, _, _ = arc_lists(m)
    assert set(t1) == set(ks(4, 5))
    assert set(t2) == set(ks(2, 3))
    out = store(m, ctx, 6)
    assert out.evicted_keys == ks(4)
    assert lookups(m, ctx, 2, 3) == [HIT, HIT]
    assert drain(m) == [
        ("stored", ks(1, 2)),
        ("removed", ks(1)),
        ("stored", ks(3, 4, 5)),
        ("removed", ks(4)),
        ("stored", ks(6)),
    ]
    m.check_invariants()


# --- 6. Store threshold ----------------------------------------------------------------------


def test_s6_first_sighting_only_counts(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2, max_tracker_size=3)
    ctx = ReqContext(req_id="")
    out = m.prepare_store(ks(1, 2), ctx)
    assert out is not None  # an empty result, not "cannot store"
    assert out.keys_to_store == []
    assert out.evicted_keys == []
    assert chunk_ids(out) == []
    assert m.resident() == {}
    m.check_invariants()


def test_s6_lookups_do_not_count_as_sightings(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2, max_tracker_size=3)
    ctx = ReqContext(req_id="")
    assert m.prepare_store(ks(1, 2), ctx).keys_to_store == []
    m.lookup(k(1), ctx)
    m.lookup(k(1), ctx)
    m.lookup(k(3), ctx)
    m.lookup(k(3), ctx)
    # 0.33.0: only offers count, so the second offer of [1, 2] stores both
    out = m.prepare_store(ks(1, 2), ctx)
    assert out.keys_to_store == ks(1, 2)
    # 3 was only looked up: its first offer is its first sighting
    assert m.prepare_store(ks(3), ctx).keys_to_store == []
    m.check_invariants()


def test_s6_tracker_overflow_drops_oldest(make_manager: MakeManager) -> None:
    m = make_manager(8, store_threshold=2, max_tracker_size=3)
    ctx = ReqContext(req_id="")
    for i in (1, 2, 3):
        assert m.prepare_store(ks(i), ctx).keys_to_store == []
    assert m.tracker_state() == [(k(1), 1), (k(2), 1), (k(3), 1)]
    assert m.prepare_store(ks(4), ctx).keys_to_store == []  # pushes 1 out
    assert m.prepare_store(ks(5), ctx).keys_to_store == []  # pushes 2 out
    assert m.tracker_state() == [(k(3), 1), (k(4), 1), (k(5), 1)]
    # 2 starts again from a count of 1 and is filtered again
    assert m.prepare_store(ks(2), ctx).keys_to_store == []
    assert m.tracker_state() == [(k(4), 1), (k(5), 1), (k(2), 1)]
    # a tracked key reaches the threshold and moves to the newest end
    assert m.prepare_store(ks(5), ctx).keys_to_store == ks(5)
    assert m.tracker_state() == [(k(4), 1), (k(2), 1), (k(5), 2)]
    m.check_invariants()


def test_s6_tracker_full_of_offered_keys_tracks_no_new_key(make_manager: MakeManager) -> None:
    m = make_manager(8, store_threshold=2, max_tracker_size=3)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    out = m.prepare_store(ks(1, 2, 3, 4), ctx)
    assert out.keys_to_store == ks(1, 2, 3)
    assert m.tracker_state() == [(k(1), 2), (k(2), 2), (k(3), 2)]
    m.check_invariants()


def test_s6_skipped_counter_reports_once(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2)
    ctx = ReqContext(req_id="")
    out = m.prepare_store(ks(1, 2, 3), ctx)
    assert out is not None
    assert out.keys_to_store == []
    assert gauges(m)[SKIPPED] == 3
    assert gauges(m)[SKIPPED] == 0
    m.check_invariants()


# --- 7. Stats and gauges ---------------------------------------------------------------------


def test_s7_zero_capacity(make_manager: MakeManager) -> None:
    m = make_manager(0)
    ctx = ReqContext(req_id="")
    assert gauges(m)[USAGE] == 0.0
    assert m.prepare_store(ks(1), ctx) is None
    g = gauges(m)
    assert (g[USAGE], g[WRITE], g[READ]) == (0.0, 0.0, 0.0)
    assert g[ALLOC] == [1]
    m.check_invariants()


def test_s7_usage_counts_pending_then_drops_on_completion(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    assert gauges(m)[USAGE] == 0.0
    m.prepare_store(ks(1, 2), ctx)
    assert gauges(m)[USAGE] == 0.5
    m.prepare_store(ks(3, 4), ctx)
    assert gauges(m)[USAGE] == 1.0
    m.complete_store(ks(1, 2), ctx)
    assert gauges(m)[USAGE] == 0.5
    m.complete_store(ks(3, 4), ctx)
    assert gauges(m)[USAGE] == 0.0  # idle, evictable chunks do not count
    m.check_invariants()


def test_s7_allocation_size_histogram(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.prepare_store(ks(1, 2, 3), ctx)  # only 3 is new
    reduced = m.get_stats().reduce()
    assert reduced[f"{ALLOC}_count"] == 2
    assert reduced[f"{ALLOC}_sum"] == 3
    assert ALLOC not in m.get_stats().data["data"]
    m.check_invariants()


def test_s7_allocation_sample_kept_when_eviction_fails(make_manager: MakeManager) -> None:
    # SCENARIOS also checks the sample survives a failing allocator (by monkeypatching a
    # private method); the black-box equivalent is a prepare_store that returns None.
    m = make_manager(1)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1), ctx)
    m.get_stats()
    assert m.prepare_store(ks(2), ctx) is None
    reduced = m.get_stats().reduce()
    assert reduced[f"{ALLOC}_count"] == 1
    assert reduced[f"{ALLOC}_sum"] == 1
    m.check_invariants()


def test_s7_write_and_read_usage_split(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    g = gauges(m)
    assert (g[WRITE], g[READ], g[USAGE]) == (0.5, 0.0, 0.5)
    m.complete_store(ks(1, 2), ctx)
    g = gauges(m)
    assert (g[WRITE], g[READ], g[USAGE]) == (0.0, 0.0, 0.0)
    m.prepare_load(ks(1), ctx)
    g = gauges(m)
    assert (g[WRITE], g[READ], g[USAGE]) == (0.0, 0.25, 0.25)
    m.prepare_store(ks(3, 4), ctx)
    g = gauges(m)
    assert (g[WRITE], g[READ], g[USAGE]) == (0.5, 0.25, 0.75)
    m.check_invariants()


def test_s7_failed_store_clears_write_usage(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    assert gauges(m)[WRITE] == 0.5
    m.complete_store(ks(1, 2), ctx, success=False)
    g = gauges(m)
    assert (g[WRITE], g[READ], g[USAGE]) == (0.0, 0.0, 0.0)
    m.check_invariants()


@pytest.mark.parametrize("threshold", [1, 2])
def test_s7_stats_never_none(make_manager: MakeManager, threshold: int) -> None:
    m = make_manager(4, store_threshold=threshold)
    for _ in range(2):
        stats = m.get_stats()
        assert stats is not None
        assert not stats.is_empty()
        assert {USAGE, WRITE, READ} <= set(stats.data["data"])
    m.check_invariants()


# --- 8. Accounting of evictable chunks -------------------------------------------------------


def test_s8_evictable_follows_store_and_loads(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    assert evictable(m) == 0
    assert gauges(m)[USAGE] == 0.75
    m.complete_store(ks(1, 2, 3), ctx)
    assert evictable(m) == 3
    assert gauges(m)[USAGE] == 0.0
    m.prepare_load(ks(1), ctx)
    assert evictable(m) == 2
    m.prepare_load(ks(1), ctx)  # a second, concurrent load of the same key
    assert evictable(m) == 2
    assert gauges(m)[READ] == 0.25
    m.complete_load(ks(1), ctx)
    assert evictable(m) == 2
    m.complete_load(ks(1), ctx)
    assert evictable(m) == 3
    assert gauges(m)[USAGE] == 0.0
    m.check_invariants()


def test_s8_evictable_after_eviction_and_failed_stores(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    out = m.prepare_store(ks(4, 5, 6), ctx)  # 1 free chunk, 2 evictions
    assert out is not None
    assert len(out.evicted_keys) == 2
    assert evictable(m) == 1
    m.complete_store(ks(4, 5, 6), ctx, success=False)
    assert evictable(m) == 1
    assert gauges(m)[USAGE] == 0.0
    m.check_invariants()


def test_s8_reset_zeroes_evictable(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    m.prepare_load(ks(1), ctx)
    m.prepare_store(ks(4), ctx)
    m.reset_cache()
    assert evictable(m) == 0
    assert m.resident() == {}
    g = gauges(m)
    assert (g[USAGE], g[WRITE], g[READ]) == (0.0, 0.0, 0.0)
    m.check_invariants()


def test_s8_store_needing_eviction_fails_while_all_loaded(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    m.prepare_load(ks(1, 2, 3), ctx)
    assert evictable(m) == 0
    assert m.prepare_store(ks(4, 5), ctx) is None
    assert m.resident().keys() == set(ks(1, 2, 3))
    m.complete_load(ks(1, 2, 3), ctx)
    assert evictable(m) == 3
    out = m.prepare_store(ks(4, 5), ctx)
    assert out is not None
    assert out.evicted_keys == ks(1)
    assert evictable(m) == 2
    m.complete_store(ks(4, 5), ctx)
    assert evictable(m) == 4
    m.check_invariants()


# --- 9. Miscellaneous ------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_s9_touch_leaves_the_context_unchanged(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(4, cache_policy=policy)
    ctx = ReqContext(req_id="r")
    ctx.set_offload_key_position(k(1), 16)
    store(m, ReqContext(req_id=""), 1, 2)
    m.touch(ks(1, 2, 3), ctx)
    assert ctx._state == {}
    assert ctx.get_offload_key_position(k(1)) == 16
    # the context may be used afterwards as a fresh request
    m.on_new_request(ctx)
    assert m.prepare_store(ks(3), ctx) is not None
    m.check_invariants()


RECORDING_POLICY = """
from kvoffload.reference.policy import CachePolicy


class RecordingPolicy(CachePolicy):
    calls = []

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.table = {}

    def get(self, key):
        return self.table.get(key)

    def insert(self, key, status, req_context):
        self.table[key] = status

    def remove(self, key):
        del self.table[key]

    def touch(self, keys, req_context):
        RecordingPolicy.calls.append(("touch", list(keys), req_context))

    def on_store_miss(self, keys, req_context):
        RecordingPolicy.calls.append(("on_store_miss", list(keys), req_context))

    def on_request_access(self, keys, req_context):
        RecordingPolicy.calls.append(("on_request_access", list(keys), req_context))

    def evict(self, n, protected):
        victims = [(k, s) for k, s in self.table.items() if s.ref_cnt == 0 and k not in protected]
        if len(victims) < n:
            return None
        for key, _ in victims[:n]:
            del self.table[key]
        return victims[:n]

    def clear(self):
        self.table.clear()

    def items(self):
        return iter(list(self.table.items()))
"""


def test_s9_touch_passes_the_context_to_the_policy(
    make_manager: MakeManager, tmp_path: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "kvoffload_recording_policy.py").write_text(RECORDING_POLICY)
    monkeypatch.syspath_prepend(str(tmp_path))
    m = make_manager(
        4, cache_policy="RecordingPolicy", cache_policy_module_path="kvoffload_recording_policy"
    )
    import kvoffload_recording_policy  # type: ignore[import-not-found]

    calls = kvoffload_recording_policy.RecordingPolicy.calls
    calls.clear()
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    other = ReqContext(req_id="o")
    m.touch(ks(2, 1, 7), other)
    assert m.prepare_store(ks(3, 1, 4), ctx).keys_to_store == ks(3, 4)
    assert [(name, keys) for name, keys, _ in calls] == [
        ("on_store_miss", ks(1, 2)),
        ("on_request_access", ks(1, 2)),
        ("touch", ks(2, 1, 7)),  # unchanged: order and absent keys are the policy's business
        ("on_store_miss", ks(3, 4)),  # candidates, once, in one call
        ("on_request_access", ks(3, 4)),
    ]
    passed = [c for _, _, c in calls]
    assert all(c is want for c, want in zip(passed, [ctx, ctx, other, ctx, ctx], strict=True))
    m.check_invariants()


def test_s9_eviction_event_precedes_store_event(make_manager: MakeManager) -> None:
    m = make_manager(2, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    store(m, ctx, 3)
    assert drain(m) == [("stored", ks(1, 2)), ("removed", ks(1)), ("stored", ks(3))]
    m.check_invariants()


def test_s9_event_medium_is_cpu(make_manager: MakeManager) -> None:
    m = make_manager(2, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    store(m, ctx, 3)
    m.prepare_store(ks(4), ctx)
    m.complete_store(ks(4), ctx, success=False)
    events = list(m.take_events())
    assert len(events) == 5
    for e in events:
        assert isinstance(e, OffloadingEvent)
        assert e.medium is Medium.CPU
    m.check_invariants()


# --- 11. 0.33.0 behaviours the upstream tests do not cover -----------------------------------


def test_s11_request_lifecycle_lru_positions_and_groups(make_manager: MakeManager) -> None:
    """A request with positions over two KV groups; its finish re-ranks head over tail."""
    m = make_manager(8)
    req = ReqContext(req_id="req-1")
    assert m.on_new_request(req) is not None
    heads = [k(1, 0), k(1, 1)]
    tails = [k(2, 0), k(2, 1)]
    for key in heads:
        req.set_offload_key_position(key, 16)
    for key in tails:
        req.set_offload_key_position(key, 32)
    out = m.prepare_store(heads + tails, req)
    assert out is not None
    m.complete_store(out.keys_to_store, req)
    # before finishing, tails rank older than heads: they are evicted first
    other = ReqContext(req_id="other")
    store(m, other, 3, 4, 5, 6)
    out = m.prepare_store(ks(7), other)
    assert out is not None
    assert out.evicted_keys == [k(2, 0)]  # equal rank with (2, 1): key bytes decide
    m.complete_store(ks(7), other)
    m.on_request_finished(req)
    # after finishing, the request's keys are the most recent: evicting everything takes the
    # other request's keys first, then the request's tail, then its heads (higher group older)
    out = m.prepare_store(ks(*range(8, 16)), other)
    assert out is not None
    assert out.evicted_keys == [*ks(3, 4, 5, 6, 7), k(2, 1), k(1, 1), k(1, 0)]
    m.check_invariants()


def test_s11_request_lifecycle_arc_insert_versus_reuse(make_manager: MakeManager) -> None:
    m = make_manager(8, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1, 2)
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    store(m, req, 3)
    m.prepare_load(ks(1), req)  # reuse by loading
    m.complete_load(ks(1), req)
    out = m.prepare_store(ks(2, 4), req)  # reuse by offering a readable key
    assert out is not None
    assert out.keys_to_store == ks(4)
    assert arc_lists(m) == (ks(1, 2, 3, 4), [], [], [])
    m.on_request_finished(req)
    # seen order 3, 1, 2, 4; walked last to first: 4 (pending, inserted) to T1's newest end,
    # 2 and 1 to T2, 3 to T1's newest end
    assert arc_lists(m) == (ks(4, 3), ks(2, 1), [], [])
    m.complete_store(ks(4), req)
    m.check_invariants()


def test_s11_failed_store_cleanup_is_filtered_when_key_returns(make_manager: MakeManager) -> None:
    m = make_manager(4, enable_events=True)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    m.complete_store(ks(1, 2), ctx, success=False)
    m.prepare_store(ks(1), ctx)  # 1 is resident again before the drain
    assert drain(m) == [("cleanup", ks(2))]
    m.check_invariants()


def test_s11_reset_keeps_events_tracker_and_makes_requests_stale(
    make_manager: MakeManager,
) -> None:
    m = make_manager(4, enable_events=True, store_threshold=2)
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    assert m.prepare_store(ks(1), req).keys_to_store == []
    store(m, req, 1)
    m.on_request_finished(req)
    tracker = m.tracker_state()
    assert tracker == [(k(1), 2)]
    m.reset_cache()
    assert m.tracker_state() == tracker
    assert m.resident() == {}
    assert drain(m) == [("stored", ks(1))]
    other = ReqContext(req_id="o")
    assert m.prepare_store(ks(3), other).keys_to_store == []
    store(m, other, 3)
    # the finished request's state is stale: loading a key it never saw starts fresh state
    m.prepare_load(ks(3), req)
    m.complete_load(ks(3), req)
    g = gauges(m)
    assert g[SKIPPED] == 2
    assert g[ALLOC] == [1, 1]
    m.check_invariants()


def test_s11_side_effects_of_a_none_store(make_manager: MakeManager) -> None:
    m = make_manager(1, store_threshold=2)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(9), ctx)
    m.prepare_store(ks(9), ctx)  # stored, pending: nothing can be evicted
    m.prepare_store(ks(2), ctx)
    assert m.prepare_store(ks(2, 3), ctx) is None
    # the None call still counted the offer, skipped 3 and sampled one candidate
    assert m.tracker_state() == [(k(9), 2), (k(2), 2), (k(3), 1)]
    g = gauges(m)
    assert g[SKIPPED] == 3  # first sightings of 9, 2 and 3
    assert g[ALLOC] == [1, 1]
    m.check_invariants()


def test_s11_pending_keys_in_an_offer_are_skipped(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1), ctx)
    out = m.prepare_store(ks(1, 2), ctx)
    assert out is not None
    assert out.keys_to_store == ks(2)
    assert chunk_ids(out) == [1]
    assert m.resident() == {k(1): (0, -1), k(2): (1, -1)}
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_s11_multiple_groups_are_independent_keys(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(4, cache_policy=policy)
    ctx = ReqContext(req_id="")
    out = m.prepare_store([k(1, 0), k(1, 1), k(1, 2)], ctx)
    assert out is not None
    assert chunk_ids(out) == [0, 1, 2]
    m.complete_store([k(1, 1)], ctx)
    assert [m.lookup(k(1, g), ctx) for g in range(4)] == [PENDING, HIT, PENDING, MISS]
    m.check_invariants()


def test_s11_load_source_is_host(make_manager: MakeManager) -> None:
    m = make_manager(2)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    assert m.get_load_source(k(1), ctx) is CacheHitSource.HOST
    spec = m.prepare_load(ks(1), ctx)
    assert spec.block_ids.dtype == np.int32
    m.complete_load(ks(1), ctx)
    m.check_invariants()
