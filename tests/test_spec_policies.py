"""SPEC.md rules for the LRU and ARC policies and the admission tracker.

Expected values are worked out by hand from SPEC.md, as in test_spec_calls.py.
"""

from __future__ import annotations

from fractions import Fraction
from typing import Any

import numpy as np
import pytest

from _helpers import (
    PENDING,
    SKIPPED,
    MakeManager,
    arc_lists,
    chunk_ids,
    k,
    ks,
    lru_state,
    ranks,
    request,
    stats_data,
    store,
    target,
)
from kvoffload import (
    InvalidArgumentError,
    ReqContext,
)

# === LRU =====================================================================================


def test_lru_insert_rank_with_position_can_be_older(make_manager: MakeManager) -> None:
    m = make_manager(4)
    x = ReqContext(req_id="x")
    a = request("a", {k(1): 16, k(2): 32})
    store(m, x, 100)  # x rank 0; 100 -> (1, 0)
    store(m, a, 1)  # a rank 2; 1 -> (2, -16)
    store(m, x, 101)  # 101 -> (3, 0)
    store(m, a, 2)  # 2 -> (2, -32), older than 101
    assert lru_state(m) == ({k(100): (1, 0), k(1): (2, -16), k(101): (3, 0), k(2): (2, -32)}, 4)
    out = m.prepare_store(ks(5, 6, 7, 8), x)
    assert out.evicted_keys == ks(100, 2, 1, 101)
    m.check_invariants()


def test_lru_request_rank_taken_without_positions(make_manager: MakeManager) -> None:
    m = make_manager(4)
    store(m, ReqContext(req_id="x"), 1)  # rank 0 even with no position: 1 -> (1, 0)
    assert lru_state(m) == ({k(1): (1, 0)}, 2)
    req = ReqContext(req_id="y")
    m.prepare_load(ks(1), req)  # a first sighting of a resident key: rank 2 is taken
    m.complete_load(ks(1), req)
    store(m, req, 2)  # no new rank for req: 2 -> (3, 0)
    assert lru_state(m) == ({k(1): (1, 0), k(2): (3, 0)}, 4)
    m.check_invariants()


def test_lru_tie_break_by_key_bytes(make_manager: MakeManager) -> None:
    m = make_manager(2)
    req = request("a", {k(9): 16, k(10): 16})
    store(m, req, 9, 10)
    assert ranks(m)[k(9)] == ranks(m)[k(10)]
    out = m.prepare_store(ks(1), ReqContext(req_id=""))
    assert out.evicted_keys == ks(10)  # b"10..." < b"9..."
    assert chunk_ids(out) == [1]
    m.check_invariants()


def test_lru_evict_is_all_or_nothing(make_manager: MakeManager) -> None:
    m = make_manager(3)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    before = m.policy_state()
    assert m.prepare_store(ks(3, 2, 4, 5), ctx) is None
    assert m.policy_state() == before
    assert len(m.resident()) == 3
    m.check_invariants()


# === ARC =====================================================================================


def test_arc_touch_rules(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.prepare_store(ks(3, 4), ctx)
    m.prepare_load(ks(2), ctx)
    m.touch(ks(3), ctx)  # T1 pending: T1's newest end
    assert arc_lists(m) == (ks(1, 2, 4, 3), [], [], [])
    m.touch(ks(1), ctx)  # T1 ready: T2
    m.touch(ks(2), ctx)  # T1 pinned: T2
    assert arc_lists(m) == (ks(4, 3), ks(1, 2), [], [])
    m.touch(ks(1), ctx)  # T2: T2's newest end
    m.touch(ks(9), ctx)  # neither resident nor ghost: nothing
    assert arc_lists(m) == (ks(4, 3), ks(2, 1), [], [])
    assert target(m) == 0.0
    m.check_invariants()


def test_arc_insert_removes_ghost(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    store(m, ctx, 3)  # evicts 1 to B1
    out = store(m, ReqContext(req_id="o"), 1)  # ghost hit: target 1.0; 1 <= |T1| 2: evicts 2
    assert out.evicted_keys == ks(2)
    assert arc_lists(m) == (ks(3, 1), [], ks(2), [])
    assert target(m) == 1.0


def test_arc_store_miss_remembers_keys_the_request_stored(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)  # 1 and 2 reported to on_store_miss by ctx
    store(m, ctx, 3)  # evicts 1 to B1
    out = store(m, ctx, 1)  # ctx reported 1 already: no ghost hit, but 1 leaves B1
    assert out.evicted_keys == ks(2)
    assert arc_lists(m) == (ks(3, 1), [], ks(2), [])
    assert target(m) == 0.0
    m.check_invariants()


@pytest.mark.parametrize("bad", [-1, 4.5, float("nan"), float("inf"), "1", True, None])
def test_arc_debug_target_is_a_number_within_the_cache(make_manager: MakeManager, bad: Any) -> None:
    # A test-only setter, refused alike by both managers (the Rust one took 100 on a 4-chunk
    # cache and then failed its own check; the reference took NaN and -1).
    m = make_manager(4, cache_policy="arc")
    m._debug_set_arc_target(4)
    with pytest.raises(InvalidArgumentError, match="ARC target must"):
        m._debug_set_arc_target(bad)
    m.check_invariants()


@pytest.mark.parametrize("value", [np.int64(3), np.float32(2.5), Fraction(1, 2)])
def test_arc_debug_target_takes_any_real_number(make_manager: MakeManager, value: Any) -> None:
    m = make_manager(4, cache_policy="arc")
    m._debug_set_arc_target(value)
    assert target(m) == float(value)
    m.check_invariants()


def test_arc_ghost_hit_arithmetic(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3, 4)
    m.touch(ks(1, 2, 3, 4), ctx)  # T2 = 4, 3, 2, 1
    m._debug_set_arc_target(4.0)
    out = store(m, ctx, 5, 6, 7)  # |T1| 0 < 4: victims from T2
    assert out.evicted_keys == ks(4, 3, 2)
    assert chunk_ids(out) == [1, 2, 3]
    m._debug_set_arc_target(0.0)
    out = store(m, ctx, 8, 9)
    assert out.evicted_keys == ks(5, 6)
    assert arc_lists(m) == (ks(7, 8, 9), ks(1), ks(5, 6), ks(4, 3, 2))
    m.touch(ks(5), ctx)  # B1 hit: += max(1, 3 / 2)
    assert target(m) == 1.5
    assert arc_lists(m)[2] == ks(6, 5)
    m.touch(ks(4), ctx)  # B2 hit: -= max(1, 2 / 3)
    assert target(m) == 0.5
    assert arc_lists(m)[3] == ks(3, 2, 4)
    m.touch(ks(6), ctx)
    assert target(m) == 2.0
    m._debug_set_arc_target(3.0)
    m.touch(ks(5), ctx)  # 4.5, capped at capacity
    assert target(m) == 4.0
    m._debug_set_arc_target(0.5)
    m.touch(ks(3), ctx)  # -0.5, floored at 0
    assert target(m) == 0.0
    assert arc_lists(m) == (ks(7, 8, 9), ks(1), ks(6, 5), ks(2, 4, 3))
    m.check_invariants()


def _arc_two_ghosts_all_busy(make_manager: MakeManager) -> tuple[Any, ReqContext]:
    """Capacity 2, B1 = 1, 2, both chunks pinned: every store returns None."""
    m = make_manager(2, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1, 2)
    store(m, base, 3)
    store(m, base, 4)
    m.prepare_load(ks(3, 4), base)
    assert arc_lists(m) == (ks(3, 4), [], ks(1, 2), [])
    return m, base


def test_arc_store_miss_ghost_hits_last_to_first(make_manager: MakeManager) -> None:
    m, _ = _arc_two_ghosts_all_busy(make_manager)
    req = ReqContext(req_id="r")
    assert m.prepare_store(ks(1, 2), req) is None
    assert target(m) == 2.0
    assert arc_lists(m)[2] == ks(2, 1)
    m.check_invariants()


def test_arc_store_miss_once_per_request(make_manager: MakeManager) -> None:
    m, _ = _arc_two_ghosts_all_busy(make_manager)
    req = ReqContext(req_id="r")
    assert m.prepare_store(ks(1), req) is None
    assert target(m) == 1.0
    assert m.prepare_store(ks(1), req) is None  # already reported by req
    assert m.prepare_store(ks(2, 1), req) is None  # only 2 is new to req
    assert target(m) == 2.0
    m._debug_set_arc_target(0.0)
    assert m.prepare_store(ks(2, 1), req) is None
    assert target(m) == 0.0
    other = ReqContext(req_id="o")
    assert m.prepare_store(ks(1), other) is None
    assert target(m) == 1.0
    m.check_invariants()


def test_arc_evict_virtual_t1_counts_busy_entries(make_manager: MakeManager) -> None:
    m = make_manager(5, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3, 4, 5)
    m.touch(ks(5), ctx)
    m.touch(ks(4), ctx)
    m.prepare_load(ks(1), ctx)  # T1 = 1 (pinned), 2, 3; T2 = 5, 4
    m._debug_set_arc_target(2.0)
    out = m.prepare_store(ks(6, 7), ctx)  # virtual |T1| 3 >= 2: 2; 2 >= 2: 3
    assert out.evicted_keys == ks(2, 3)
    assert arc_lists(m) == (ks(1, 6, 7), ks(5, 4), ks(2, 3), [])
    m.check_invariants()


def test_arc_evict_mixes_lists_in_choice_order(make_manager: MakeManager) -> None:
    m = make_manager(5, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3, 4, 5)
    m.touch(ks(5), ctx)
    m.touch(ks(4), ctx)  # T1 = 1, 2, 3; T2 = 5, 4
    m._debug_set_arc_target(2.0)
    out = m.prepare_store(ks(6, 7, 8), ctx)  # 3 >= 2: 1; 2 >= 2: 2; 1 < 2: T2's 5
    assert out.evicted_keys == ks(1, 2, 5)
    assert chunk_ids(out) == [4, 1, 0]
    assert arc_lists(m) == (ks(3, 6, 7, 8), ks(4), ks(1, 2), ks(5))
    m.check_invariants()


def test_arc_evict_uses_floor_of_target(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.touch(ks(2), ctx)  # T1 = 1; T2 = 2
    m._debug_set_arc_target(1.5)
    assert store(m, ctx, 3).evicted_keys == ks(1)  # |T1| 1 >= floor(1.5)
    m.check_invariants()


def test_arc_evict_falls_back_to_t1(make_manager: MakeManager) -> None:
    m = make_manager(3, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    m.touch(ks(3), ctx)
    m.prepare_load(ks(3), ctx)
    m._debug_set_arc_target(3.0)
    out = m.prepare_store(ks(4), ctx)  # |T1| 2 < 3, T2 has nothing evictable: T1's oldest
    assert out.evicted_keys == ks(1)
    assert arc_lists(m)[2] == ks(1)
    m.check_invariants()


def test_arc_evict_failure_changes_nothing(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    store(m, ctx, 3)
    before = m.policy_state()
    assert m.prepare_store(ks(2, 4, 5), ctx) is None  # 2 evictable, but 2 is protected
    assert m.policy_state() == before
    m.check_invariants()


def test_arc_ghost_lists_trimmed_each_to_capacity(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.touch(ks(1, 2), ctx)  # T2 = 2, 1
    assert store(m, ctx, 3).evicted_keys == ks(2)
    assert store(m, ctx, 4).evicted_keys == ks(3)
    m.touch(ks(4), ctx)
    assert store(m, ctx, 5).evicted_keys == ks(1)
    assert store(m, ctx, 6).evicted_keys == ks(5)
    assert arc_lists(m) == (ks(6), ks(4), ks(3, 5), ks(2, 1))  # four ghosts, capacity 2
    m.touch(ks(6), ctx)
    assert store(m, ctx, 7).evicted_keys == ks(4)
    assert arc_lists(m) == (ks(7), ks(6), ks(3, 5), ks(1, 4))
    assert target(m) == 0.0
    m.check_invariants()


def test_arc_finish_inserted_and_reused(make_manager: MakeManager) -> None:
    m = make_manager(8, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1, 2, 3)
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    m.prepare_load(ks(1), req)
    m.complete_load(ks(1), req)
    store(m, req, 4)
    m.touch(ks(4), base)
    m.touch(ks(2), base)
    assert m.prepare_store(ks(2), req).keys_to_store == []  # offered while readable: reused
    assert arc_lists(m) == (ks(1, 3), ks(4, 2), [], [])
    m.on_request_finished(req)  # seen 1, 4, 2; walked 2 (T2), 4 (inserted, T2), 1 (to T2)
    assert arc_lists(m) == (ks(3), ks(2, 4, 1), [], [])
    m.check_invariants()


def test_arc_finish_moves_pending_reused_key_to_t2(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1)
    req = ReqContext(req_id="r")
    m.prepare_load(ks(1), req)  # reused
    m.complete_load(ks(1), req)
    store(m, base, 2)
    assert store(m, base, 3).evicted_keys == ks(1)
    out = m.prepare_store(ks(1), req)  # ghost hit: target 1; floor 1 <= |T1| 2: evicts 2
    assert out.evicted_keys == ks(2)
    assert arc_lists(m) == (ks(3, 1), [], ks(2), [])
    m.on_request_finished(req)  # 1 is inserted and reused: to T2 while pending
    assert arc_lists(m) == (ks(3), ks(1), ks(2), [])
    assert m.lookup(k(1), req) is PENDING
    m.complete_store(ks(1), req)
    m.check_invariants()


def test_arc_finish_leaves_other_seen_keys(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1, 2, 3)
    m.prepare_load(ks(1, 2, 3), base)
    req = ReqContext(req_id="r")
    assert m.prepare_store(ks(4, 5), req) is None  # 4, 5 seen by req, never inserted
    m.complete_load(ks(1, 2, 3), base)
    store(m, base, 4)
    store(m, base, 6)
    assert arc_lists(m) == (ks(2, 3, 4, 6), [], ks(1), [])
    m.on_request_finished(req)
    assert arc_lists(m) == (ks(2, 3, 4, 6), [], ks(1), [])
    m.check_invariants()


# === Admission tracker =======================================================================


def test_tracker_pass_two_protects_keys_it_added(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2, max_tracker_size=2)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    assert m.tracker_state() == [(k(1), 1), (k(2), 1)]
    assert stats_data(m)[SKIPPED] == 3
    m.check_invariants()


def test_tracker_pass_one_moves_to_newest_in_offer_order(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2, max_tracker_size=3)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    out = m.prepare_store(ks(4, 2), ctx)  # pass 1: 2 newest; pass 2: 1 dropped for 4
    assert out.keys_to_store == ks(2)
    assert m.tracker_state() == [(k(3), 1), (k(2), 2), (k(4), 1)]
    m.prepare_store(ks(3, 4), ctx)
    assert m.tracker_state() == [(k(2), 2), (k(3), 2), (k(4), 2)]
    m.check_invariants()


def test_tracker_size_one(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2, max_tracker_size=1)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    assert m.tracker_state() == [(k(1), 1)]
    assert m.prepare_store(ks(2, 1), ctx).keys_to_store == ks(1)
    assert m.tracker_state() == [(k(1), 2)]
    m.check_invariants()


def test_tracker_off_below_threshold_two(make_manager: MakeManager) -> None:
    for threshold, size in ((0, 0), (1, 0), (1, 64_000)):
        m = make_manager(4, store_threshold=threshold, max_tracker_size=size)
        assert m.tracker_state() is None
        assert m.prepare_store(ks(1), ReqContext(req_id="")).keys_to_store == ks(1)
        m.check_invariants()
