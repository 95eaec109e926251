"""Contract tests for the rules of SPEC.md, one or more per rule, run against every implementation.

Expected values are worked out by hand from SPEC.md; comments give the arithmetic where it is not
obvious. LRU ranks are ``(major, minor)``; a context's first recording call that sees a new key
takes a request rank from the same counter as fresh ranks.
"""

from __future__ import annotations

import dataclasses
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
    Medium,
    OffloadPolicy,
    ReqContext,
    RequestFinishedError,
    RequestOffloadingContext,
)


def stats_data(m: Any) -> dict[str, Any]:
    return {name: series[()] for name, series in m.get_stats().data["data"].items()}


def ranks(m: Any) -> dict[bytes, tuple[int, int]]:
    state = m.policy_state()
    assert state["policy"] == "lru"
    return {key: tuple(rank) for key, rank in state["ranks"].items()}


def lru_state(m: Any) -> tuple[dict[bytes, tuple[int, int]], int]:
    return ranks(m), m.policy_state()["next_rank"]


def arc_lists(m: Any) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    state = m.policy_state()
    assert state["policy"] == "arc"
    return (list(state["t1"]), list(state["t2"]), list(state["b1"]), list(state["b2"]))


def target(m: Any) -> float:
    return float(m.policy_state()["target_t1_size"])


def request(req_id: str, positions: dict[bytes, int] | None = None) -> ReqContext:
    ctx = ReqContext(req_id=req_id)
    for key, pos in (positions or {}).items():
        ctx.set_offload_key_position(key, pos)
    return ctx


# === Chunk ids =================================================================================


def test_ids_never_used_first_then_last_freed(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    assert chunk_ids(m.prepare_store(ks(1, 2), ctx)) == [0, 1]
    m.complete_store(ks(1, 2), ctx, success=False)  # frees 0, then 1
    assert m.pool_state() == (2, [0, 1])
    assert chunk_ids(m.prepare_store(ks(3, 4, 5), ctx)) == [2, 3, 1]
    assert m.pool_state() == (4, [0])
    m.check_invariants()


def test_ids_evicted_chunks_reused_by_the_same_store(make_manager: MakeManager) -> None:
    m = make_manager(2)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    out = m.prepare_store(ks(3, 4), ctx)
    assert out.evicted_keys == ks(1, 2)
    assert chunk_ids(out) == [1, 0]

    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    out = m.prepare_store(ks(4, 5, 6), ctx)  # never-used 3, then 1 and 0 (freed 0, 1)
    assert out.evicted_keys == ks(1, 2)
    assert chunk_ids(out) == [3, 1, 0]
    m.check_invariants()


@pytest.mark.parametrize(
    ("fail_order", "freed", "next_ids"), [((1, 2), [0, 1], [1, 0]), ((2, 1), [1, 0], [0, 1])]
)
def test_ids_failed_store_frees_in_given_order(
    make_manager: MakeManager, fail_order: tuple[int, int], freed: list[int], next_ids: list[int]
) -> None:
    m = make_manager(2)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    m.complete_store(ks(*fail_order), ctx, success=False)
    assert m.pool_state() == (2, freed)
    assert chunk_ids(m.prepare_store(ks(3, 4), ctx)) == next_ids
    m.check_invariants()


def test_ids_restart_at_zero_after_reset(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    m.reset_cache()
    assert m.pool_state() == (0, [])
    assert chunk_ids(m.prepare_store(ks(4), ctx)) == [0]
    m.check_invariants()


def test_ids_are_int32_arrays(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    out = store(m, ctx, 1, 2)
    for spec in (
        out.store_spec,
        m.prepare_load(ks(2, 1), ctx),
        m.prepare_store(ks(1), ctx).store_spec,
    ):
        assert isinstance(spec.block_ids, np.ndarray)
        assert spec.block_ids.dtype == np.int32
        assert spec.chunk_ids.dtype == np.int32
        assert np.array_equal(spec.chunk_ids, spec.block_ids)
    assert chunk_ids(m.prepare_store(ks(1), ctx)) == []
    m.check_invariants()


# === lookup, prepare_load, complete_load, touch ===============================================


def test_lookup_reports_each_state(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.prepare_load(ks(2), ctx)
    m.prepare_store(ks(3), ctx)
    assert [m.lookup(x, ctx) for x in ks(1, 2, 3, 4)] == [HIT, HIT, PENDING, MISS]
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_lookup_changes_nothing(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(2, cache_policy=policy, store_threshold=2)
    base = ReqContext(req_id="")
    for _ in range(2):
        m.prepare_store(ks(1, 2), base)
    m.complete_store(ks(1, 2), base)
    for _ in range(2):
        m.prepare_store(ks(3), base)  # evicts 1: a ghost for ARC
    m.get_stats()
    before = (m.policy_state(), m.resident(), m.tracker_state(), m.pool_state())
    req = request("r", {k(i): 16 * i for i in range(1, 6)})
    for key in ks(1, 2, 3, 4, 5, 1, 2):  # 1 is a ghost for ARC, 3 is pending
        m.lookup(key, req)
    assert (m.policy_state(), m.resident(), m.tracker_state(), m.pool_state()) == before
    assert req._state == {}  # no request state
    m.on_request_finished(req)  # nothing was seen, so nothing is re-ranked
    assert m.policy_state() == before[0]
    assert m.get_stats().data["data"][SKIPPED] == {(): 0}
    m.check_invariants()


def test_prepare_load_counts_references(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    assert chunk_ids(m.prepare_load(ks(2, 2), ctx)) == [1, 1]
    assert chunk_ids(m.prepare_load(ks(1, 2), ctx)) == [0, 1]
    assert m.resident() == {k(1): (0, 1), k(2): (1, 3)}
    m.complete_load(ks(2, 2), ctx)
    m.complete_load(ks(1), ctx)
    assert m.resident() == {k(1): (0, 0), k(2): (1, 1)}
    m.complete_load(ks(2), ctx)
    assert m.resident() == {k(1): (0, 0), k(2): (1, 0)}
    m.check_invariants()


def test_prepare_load_raises_rank_of_first_seen_key_only(make_manager: MakeManager) -> None:
    m = make_manager(4)
    store(m, ReqContext(req_id=""), 1)  # base request rank 0; 1 -> (1, 0)
    assert lru_state(m) == ({k(1): (1, 0)}, 2)
    req = request("c", {k(1): 4})
    m.prepare_load(ks(1), req)  # request rank 2; (2, -4) > (1, 0)
    assert lru_state(m) == ({k(1): (2, -4)}, 3)
    m.complete_load(ks(1), req)
    assert lru_state(m) == ({k(1): (2, -4)}, 3)  # complete_load changes no recency
    req.set_offload_key_position(k(1), 2)
    m.prepare_load(ks(1), req)  # not a first sighting: (2, -2) is not applied
    m.complete_load(ks(1), req)
    assert lru_state(m) == ({k(1): (2, -4)}, 3)
    m.check_invariants()


def test_request_access_only_raises_ranks(make_manager: MakeManager) -> None:
    m = make_manager(4)
    base = ReqContext(req_id="")
    store(m, base, 1)  # base rank 0; 1 -> (1, 0)
    req = request("b", {k(1): 8, k(5): 8})
    store(m, req, 5)  # request rank 2; 5 -> (2, -8)
    m.touch(ks(1), base)  # 1 -> (3, 0)
    assert lru_state(m) == ({k(1): (3, 0), k(5): (2, -8)}, 4)
    m.prepare_load(ks(1), req)  # (2, -8) < (3, 0): unchanged
    assert lru_state(m) == ({k(1): (3, 0), k(5): (2, -8)}, 4)
    m.complete_load(ks(1), req)
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_complete_load_changes_no_recency(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(4, cache_policy=policy)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    m.prepare_load(ks(1, 3), ctx)
    before = m.policy_state()
    m.complete_load(ks(3, 1), ctx)
    assert m.policy_state() == before
    m.check_invariants()


def test_touch_allocates_no_request_rank(make_manager: MakeManager) -> None:
    m = make_manager(4)
    store(m, ReqContext(req_id=""), 1)  # base rank 0; 1 -> (1, 0)
    req = ReqContext(req_id="t")
    m.touch(ks(1), req)  # 1 -> (2, 0); no request rank for req
    assert lru_state(m) == ({k(1): (2, 0)}, 3)
    store(m, req, 2)  # req's first access: rank 3; 2 -> (4, 0)
    assert lru_state(m) == ({k(1): (2, 0), k(2): (4, 0)}, 5)
    m.check_invariants()


def test_touch_records_no_access(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1, 2)
    req = ReqContext(req_id="t")
    m.on_new_request(req)
    store(m, req, 3)
    m.on_request_finished(req)
    m.touch(ks(1, 2), req)  # unseen keys after finishing: not an error
    assert arc_lists(m) == (ks(3), ks(2, 1), [], [])
    # touching did not make 1, 2 seen: a finished request may not record them
    with pytest.raises(RequestFinishedError):
        m.prepare_load(ks(1), req)
    m.check_invariants()


def test_lru_touch_ranks_last_to_first(make_manager: MakeManager) -> None:
    m = make_manager(5)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)  # rank 0 for ctx; 1, 2, 3 -> (1..3, 0)
    m.prepare_store(ks(4), ctx)  # 4 pending -> (4, 0)
    m.touch([k(1), k(4), k(9), k(2)], ctx)
    r = ranks(m)
    assert r[k(2)] == (5, 0)  # the last key is touched first
    assert r[k(2)] < r[k(4)] < r[k(1)]  # pending keys get a rank, absent keys are skipped
    assert r[k(3)] == (3, 0)
    assert k(9) not in r
    m.complete_store(ks(4), ctx)
    out = m.prepare_store(ks(6, 7, 8, 10), ctx)  # one free chunk, three evictions
    assert out.evicted_keys == ks(3, 2, 4)
    m.check_invariants()


# === prepare_store ===========================================================================


def test_store_tracker_counts_the_whole_offer(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2)
    ctx = ReqContext(req_id="")
    assert m.prepare_store(ks(1), ctx).keys_to_store == []
    assert m.prepare_store(ks(1), ctx).keys_to_store == ks(1)
    assert m.prepare_store(ks(1), ctx).keys_to_store == []  # pending: counted, skipped
    m.complete_store(ks(1), ctx)
    assert m.prepare_store(ks(1), ctx).keys_to_store == []  # resident: counted
    assert m.tracker_state() == [(k(1), 4)]  # never removed when stored
    m.check_invariants()


def test_store_partitions_the_offer(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    m.prepare_store(ks(2), ctx)
    out = m.prepare_store(ks(5, 1, 2, 3), ctx)
    assert out.keys_to_store == ks(5, 3)
    assert chunk_ids(out) == [2, 3]
    assert out.evicted_keys == []
    m.check_invariants()


def test_store_pending_keys_are_not_recorded(make_manager: MakeManager) -> None:
    m = make_manager(5, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1, 2)
    m.prepare_store(ks(3), base)  # 3 pending
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    assert m.prepare_store(ks(3, 4), req).keys_to_store == ks(4)
    m.on_request_finished(req)
    # 3 was neither seen nor reused: it stays in T1 where it was
    assert arc_lists(m) == (ks(1, 2, 3, 4), [], [], [])
    # still pending: offering it again records nothing, so no error
    assert m.prepare_store(ks(3), req).keys_to_store == []
    m.complete_store(ks(3, 4), base)
    # readable now: offering it records it, and the finished request never saw it
    with pytest.raises(RequestFinishedError):
        m.prepare_store(ks(3), req)
    m.check_invariants()


def test_store_threshold_drops_are_skipped_and_not_recorded(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2)
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    out = m.prepare_store(ks(1, 2), req)
    assert out.keys_to_store == []
    # nothing was recorded: no request rank was taken
    assert lru_state(m) == ({}, 0)
    assert stats_data(m)[SKIPPED] == 2
    m.on_request_finished(req)
    # a dropped, unseen key of a finished request is not recorded, so it is no error
    assert m.prepare_store(ks(3), req).keys_to_store == []
    # 1 now passes the threshold, but the finished request never saw it
    with pytest.raises(RequestFinishedError):
        m.prepare_store(ks(1), req)
    m.check_invariants()


def test_store_records_in_offer_order(make_manager: MakeManager) -> None:
    m = make_manager(4)
    base = ReqContext(req_id="")
    store(m, base, 1)  # base rank 0; 1 -> (1, 0)
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    store(m, req, 5, 1, 6)  # req rank 2; 5 -> (3, 0), 6 -> (4, 0)
    m.on_request_finished(req)  # seen 5, 1, 6: fresh ranks 6, 1, 5
    assert lru_state(m) == ({k(6): (5, 0), k(1): (6, 0), k(5): (7, 0)}, 8)
    m.check_invariants()


@pytest.mark.parametrize("case", ["existing", "pending", "dropped"])
def test_store_without_candidates_returns_empty_output(
    make_manager: MakeManager, case: str
) -> None:
    m = make_manager(2, store_threshold=2)
    ctx = ReqContext(req_id="")
    for _ in range(2):
        m.prepare_store(ks(1, 2), ctx)
    if case == "existing":
        m.complete_store(ks(1, 2), ctx)
    m.get_stats()
    offer = ks(3, 4) if case == "dropped" else ks(1, 2)
    out = m.prepare_store(offer, ctx)
    assert out is not None
    assert (out.keys_to_store, out.evicted_keys, chunk_ids(out)) == ([], [], [])
    assert out.store_spec.block_ids.dtype == np.int32
    assert ALLOC not in stats_data(m)
    m.check_invariants()


def test_store_evicts_exactly_the_shortfall(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 3)
    out = m.prepare_store(ks(4, 5), ctx)
    assert out.evicted_keys == ks(1)
    assert chunk_ids(out) == [3, 0]
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_store_eviction_failure_changes_no_chunk(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(2, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)  # ctx has taken its request rank already
    drain(m)
    before = (m.policy_state(), m.resident(), m.pool_state())
    # 2 evictable chunks cover the shortfall of 2, but 1 is offered, so the policy cannot evict
    assert m.prepare_store(ks(1, 3, 4), ctx) is None
    assert (m.policy_state(), m.resident(), m.pool_state()) == before
    assert drain(m) == []
    assert stats_data(m)[ALLOC] == [2, 2]
    m.check_invariants()


def test_store_eviction_event_comes_first(make_manager: MakeManager) -> None:
    m = make_manager(2, enable_events=True)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    m.complete_store(ks(2), ctx)
    out = m.prepare_store(ks(3), ctx)
    assert out.evicted_keys == ks(2)
    m.complete_store(ks(1, 3), ctx)
    assert drain(m) == [("stored", ks(2)), ("removed", ks(2)), ("stored", ks(1, 3))]
    m.check_invariants()


def test_store_after_none_side_effects_lru(make_manager: MakeManager) -> None:
    m = make_manager(2)
    base = ReqContext(req_id="")
    store(m, base, 1, 2)  # base rank 0; 1 -> (1, 0), 2 -> (2, 0)
    m.prepare_load(ks(1, 2), base)
    req = request("r", {k(1): 16})
    assert m.prepare_store(ks(1, 3), req) is None
    # step 5 happened: 1 was a first sighting, so its rank was raised with req's rank 3
    assert lru_state(m) == ({k(1): (3, -16), k(2): (2, 0)}, 4)
    assert stats_data(m)[ALLOC] == [2, 1]
    m.on_request_finished(req)  # seen 1, 3 (3 lacks a position): 1 gets a fresh rank
    rank = ranks(m)[k(1)]
    assert rank[1] == 0
    assert rank > (3, 0)
    m.complete_load(ks(1, 2), base)
    # 3 was recorded as seen by the None call: a finished request may still store it
    out = m.prepare_store(ks(3), req)
    assert out.keys_to_store == ks(3)
    m.check_invariants()


# === complete_store ==========================================================================


def test_complete_store_ignores_keys_not_pending(make_manager: MakeManager) -> None:
    m = make_manager(6, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.prepare_load(ks(2), ctx)
    m.prepare_store(ks(3, 4, 5), ctx)
    drain(m)
    m.complete_store([k(9), k(5), k(1), k(2), k(3), k(5), k(3)], ctx)
    assert drain(m) == [("stored", ks(5, 3))]
    assert m.resident() == {
        k(1): (0, 0),
        k(2): (1, 1),
        k(3): (2, 0),
        k(4): (3, -1),
        k(5): (4, 0),
    }
    m.complete_store(ks(9, 1, 2, 3), ctx)  # nothing qualifies: no event
    m.complete_store(ks(9, 1, 2, 3), ctx, success=False)
    assert drain(m) == []
    assert len(m.resident()) == 5
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_complete_store_failure_removes_pending_only(
    make_manager: MakeManager, policy: str
) -> None:
    m = make_manager(4, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    m.prepare_store(ks(2, 3), ctx)
    drain(m)
    m.complete_store([k(3), k(1), k(3), k(2)], ctx, success=False)
    assert drain(m) == [("cleanup", ks(3, 2))]
    assert m.resident() == {k(1): (0, 0)}
    assert m.pool_state() == (3, [2, 1])  # each chunk freed once, in the given order
    if policy == "arc":
        assert arc_lists(m) == (ks(1), [], [], [])  # no ghost entry
    else:
        assert set(ranks(m)) == {k(1)}
    m.check_invariants()


def test_failed_store_keeps_request_inserted_keys(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc")
    base = ReqContext(req_id="")
    store(m, base, 1)
    req = ReqContext(req_id="a")
    m.on_new_request(req)
    m.prepare_store(ks(2), req)
    m.complete_store(ks(2), req, success=False)
    store(m, base, 2, 3)
    m.prepare_load(ks(2), req)  # 2 is still among req's inserted keys: not reused
    m.complete_load(ks(2), req)
    m.on_request_finished(req)  # inserted-only: 2 moves to T1's newest end, not to T2
    assert arc_lists(m) == (ks(1, 3, 2), [], [], [])
    m.check_invariants()


# === Events and take_events =================================================================


def test_event_fields(make_manager: MakeManager) -> None:
    m = make_manager(1, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    store(m, ctx, 2)
    m.prepare_store(ks(3), ctx)
    m.complete_store(ks(3), ctx, success=False)
    events = list(m.take_events())
    assert [(e.removed, e.metadata_only, list(e.keys)) for e in events] == [
        (False, False, ks(1)),
        (True, False, ks(1)),
        (False, False, ks(2)),
        (True, False, ks(2)),
        (True, True, ks(3)),
    ]
    for e in events:
        assert e.medium is Medium.CPU
        assert e.locality is None
        assert e.ownership is None
        assert e.removal_expected is False
    m.check_invariants()


def test_events_disabled_queue_nothing(make_manager: MakeManager) -> None:
    m = make_manager(1)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    store(m, ctx, 2)
    m.prepare_store(ks(3), ctx)
    m.complete_store(ks(3), ctx, success=False)
    assert list(m.take_events()) == []
    m.check_invariants()


def test_take_events_detaches_on_first_step(make_manager: MakeManager) -> None:
    m = make_manager(4, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    it = m.take_events()
    store(m, ctx, 2)  # queued before the first step: part of this batch
    assert next(it).keys == ks(1)
    store(m, ctx, 3)  # queued after the batch was detached: next batch
    assert [list(e.keys) for e in it] == [ks(2)]
    assert drain(m) == [("stored", ks(3))]
    assert drain(m) == []
    m.check_invariants()


def test_take_events_filters_cleanup_when_reached(make_manager: MakeManager) -> None:
    m = make_manager(4, enable_events=True)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    m.complete_store(ks(1), ctx)
    m.complete_store(ks(2, 3), ctx, success=False)
    m.prepare_store(ks(4), ctx)
    m.complete_store(ks(4), ctx, success=False)
    it = m.take_events()
    assert list(next(it).keys) == ks(1)
    m.prepare_store(ks(3, 4), ctx)  # resident again before their cleanups are reached
    assert [(e.metadata_only, list(e.keys)) for e in it] == [(True, ks(2))]  # {4} vanished
    m.check_invariants()


def test_take_events_keeps_evictions_of_returned_keys(make_manager: MakeManager) -> None:
    m = make_manager(1, enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    store(m, ctx, 2)
    store(m, ctx, 1)
    assert drain(m) == [
        ("stored", ks(1)),
        ("removed", ks(1)),
        ("stored", ks(2)),
        ("removed", ks(2)),
        ("stored", ks(1)),
    ]
    m.check_invariants()


# === Request state: on_new_request / on_request_finished =====================================


def test_on_new_request_returns_chunk_level(make_manager: MakeManager) -> None:
    m = make_manager(2)
    result = m.on_new_request(ReqContext(req_id="r"))
    assert isinstance(result, RequestOffloadingContext)
    assert result.policy is OffloadPolicy.CHUNK_LEVEL
    m.check_invariants()


def test_finished_request_stays_finished(make_manager: MakeManager) -> None:
    m = make_manager(4)
    req = ReqContext(req_id="r")
    m.on_new_request(req)
    store(m, req, 1)
    m.on_request_finished(req)
    m.on_new_request(req)  # current state: stays finished
    with pytest.raises(RequestFinishedError):
        m.prepare_store(ks(2), req)
    # keys already seen may still be loaded, offered and stored
    m.prepare_load(ks(1), req)
    m.complete_load(ks(1), req)
    assert m.prepare_store(ks(1), req).keys_to_store == []
    m.check_invariants()


def test_finished_request_may_store_seen_keys_again(make_manager: MakeManager) -> None:
    m = make_manager(1)
    req = ReqContext(req_id="r")
    store(m, req, 1)
    m.on_request_finished(req)
    store(m, ReqContext(req_id=""), 2)  # evicts 1
    out = m.prepare_store(ks(1), req)
    assert out.keys_to_store == ks(1)
    assert out.evicted_keys == ks(2)
    m.check_invariants()


def test_finish_only_once(make_manager: MakeManager) -> None:
    m = make_manager(4)
    req = ReqContext(req_id="r")
    store(m, req, 1, 2)  # rank 0; 1 -> (1, 0), 2 -> (2, 0)
    m.on_request_finished(req)  # 2 -> (3, 0), 1 -> (4, 0)
    assert lru_state(m) == ({k(1): (4, 0), k(2): (3, 0)}, 5)
    m.touch(ks(2), req)  # 2 -> (5, 0)
    m.on_request_finished(req)
    assert lru_state(m) == ({k(1): (4, 0), k(2): (5, 0)}, 6)
    m.check_invariants()


def test_finish_without_state_creates_none(make_manager: MakeManager) -> None:
    m = make_manager(4)
    req = ReqContext(req_id="r")
    m.on_request_finished(req)
    assert req._state == {}
    assert m.prepare_store(ks(1), req).keys_to_store == ks(1)  # not finished
    m.check_invariants()


def test_finish_with_stale_state_does_nothing(make_manager: MakeManager) -> None:
    m = make_manager(4)
    req = ReqContext(req_id="a")
    store(m, req, 1)
    m.reset_cache()
    base = ReqContext(req_id="")
    store(m, base, 1, 2)
    before = m.policy_state()
    m.on_request_finished(req)  # stale: 1 is not re-ranked
    assert m.policy_state() == before
    store(m, req, 3)  # fresh, unfinished state
    m.check_invariants()


def test_finish_orders_by_position_within_one_group(make_manager: MakeManager) -> None:
    m = make_manager(8)
    req = request("a", {k(3): 48, k(1): 16, k(2): 32})
    m.on_new_request(req)
    store(m, req, 3, 1, 2)  # rank 0: tails rank older
    assert lru_state(m) == ({k(3): (0, -48), k(1): (0, -16), k(2): (0, -32)}, 1)
    m.on_request_finished(req)  # head-to-tail 1, 2, 3; ranks from the tail
    assert lru_state(m) == ({k(3): (1, 0), k(2): (2, 0), k(1): (3, 0)}, 4)
    m.check_invariants()


def test_finish_keeps_first_seen_order_without_all_positions(make_manager: MakeManager) -> None:
    m = make_manager(8)
    req = request("a", {k(1): 16})
    store(m, req, 3, 1, 2)  # rank 0; 3 -> (1, 0), 1 -> (0, -16), 2 -> (2, 0)
    assert lru_state(m) == ({k(3): (1, 0), k(1): (0, -16), k(2): (2, 0)}, 3)
    m.on_request_finished(req)
    assert lru_state(m) == ({k(2): (3, 0), k(1): (4, 0), k(3): (5, 0)}, 6)
    m.check_invariants()


def test_finish_reads_positions_at_finish_time(make_manager: MakeManager) -> None:
    m = make_manager(8)
    req = ReqContext(req_id="a")
    store(m, req, 3, 1, 2)  # rank 0; 3, 1, 2 -> (1..3, 0)
    for key, pos in ((k(3), 48), (k(1), 16), (k(2), 32)):
        req.set_offload_key_position(key, pos)
    m.on_request_finished(req)
    assert lru_state(m) == ({k(3): (4, 0), k(2): (5, 0), k(1): (6, 0)}, 7)
    m.check_invariants()


def test_finish_groups_all_positions(make_manager: MakeManager) -> None:
    m = make_manager(8)
    a0, b0, a1, b1 = k(1, 0), k(2, 0), k(1, 1), k(2, 1)
    req = request("a", {a0: 32, b0: 16, a1: 32, b1: 16})
    m.prepare_store([a0, a1, b0, b1], req)  # rank 0; pending, left pending
    assert lru_state(m) == ({a0: (0, -32), a1: (0, -32), b0: (0, -16), b1: (0, -16)}, 1)
    # groups [b0, a0] and [b1, a1]; all positioned: stable sort gives b0, b1, a0, a1
    m.on_request_finished(req)
    assert lru_state(m) == ({a1: (1, 0), a0: (2, 0), b1: (3, 0), b0: (4, 0)}, 5)
    m.check_invariants()


def test_finish_groups_partial_positions(make_manager: MakeManager) -> None:
    m = make_manager(8)
    a0, b0, a1, b1 = k(1, 0), k(2, 0), k(1, 1), k(2, 1)
    req = request("a", {a0: 32, b0: 16, a1: 32})
    m.prepare_store([a0, a1, b0, b1], req)  # rank 0; b1 has no position: fresh (1, 0)
    assert lru_state(m) == ({a0: (0, -32), a1: (0, -32), b0: (0, -16), b1: (1, 0)}, 2)
    # group 0 sorted [b0, a0]; group 1 first-seen [a1, b1]; no global sort
    m.on_request_finished(req)
    assert lru_state(m) == ({b1: (2, 0), a1: (3, 0), a0: (4, 0), b0: (5, 0)}, 6)
    m.check_invariants()


def test_arc_finish_uses_the_same_head_to_tail_list(make_manager: MakeManager) -> None:
    m = make_manager(8, cache_policy="arc")
    a0, b0, a1, b1 = k(1, 0), k(2, 0), k(1, 1), k(2, 1)
    req = request("a", {a0: 32, b0: 16, a1: 32, b1: 16})
    out = m.prepare_store([a0, a1, b0, b1], req)
    m.complete_store(out.keys_to_store, req)
    assert arc_lists(m) == ([a0, a1, b0, b1], [], [], [])
    m.on_request_finished(req)  # list b0, b1, a0, a1; inserted-only, walked last to first
    assert arc_lists(m) == ([a1, a0, b1, b0], [], [], [])
    m.check_invariants()


def test_request_state_is_per_manager(make_manager: MakeManager) -> None:
    m1 = make_manager(2)
    m2 = make_manager(2)
    req = ReqContext(req_id="r")
    store(m1, req, 1)
    m1.on_request_finished(req)
    assert m2.prepare_store(ks(2), req).keys_to_store == ks(2)
    m1.check_invariants()
    m2.check_invariants()


def test_vllm_shaped_context(make_manager: MakeManager) -> None:
    class DuckContext:
        """Only the three methods the manager may use; no other attributes."""

        __slots__ = ("_p", "_s")

        def __init__(self, positions: dict[bytes, int]) -> None:
            self._p = positions
            self._s: dict[type, Any] = {}

        def get_state(self, cls: type) -> Any:
            return self._s.get(cls)

        def set_state(self, val: Any) -> None:
            self._s[type(val)] = val

        def get_offload_key_position(self, key: bytes) -> int | None:
            return self._p.get(key)

    m = make_manager(8)
    req = DuckContext({k(3): 48, k(1): 16, k(2): 32})
    m.on_new_request(req)
    store(m, req, 3, 1, 2)
    assert m.lookup(k(1), req) is HIT
    assert m.get_load_source(k(1), req) is CacheHitSource.HOST
    m.prepare_load(ks(1), req)
    m.complete_load(ks(1), req)
    m.touch(ks(2), req)
    m.on_request_finished(req)
    assert sorted(ranks(m), key=ranks(m).__getitem__) == ks(3, 2, 1)
    with pytest.raises(RequestFinishedError):
        m.prepare_store(ks(4), req)
    m.check_invariants()


# === reset_cache =============================================================================


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_reset_drops_chunks_and_policy_state(make_manager: MakeManager, policy: str) -> None:
    m = make_manager(2, cache_policy=policy)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    store(m, ctx, 3)
    m.touch(ks(3), ctx)
    m.prepare_load(ks(3), ctx)
    m.prepare_store(ks(4), ctx)
    if policy == "arc":
        m._debug_set_arc_target(1.5)
    m.reset_cache()
    assert m.resident() == {}
    assert m.pool_state() == (0, [])
    if policy == "arc":
        assert arc_lists(m) == ([], [], [], [])
        assert target(m) == 0.0
    else:
        assert lru_state(m) == ({}, 0)
    d = stats_data(m)
    assert (d[USAGE], d[WRITE], d[READ]) == (0.0, 0.0, 0.0)
    assert m.lookup(k(3), ctx) is MISS
    m.check_invariants()


def test_reset_keeps_events_tracker_and_pending_stats(make_manager: MakeManager) -> None:
    m = make_manager(2, enable_events=True, store_threshold=2)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2), ctx)
    m.prepare_store(ks(1), ctx)
    m.complete_store(ks(1), ctx)
    m.prepare_store(ks(1, 3), ctx)  # 3 skipped; no candidate, no sample
    m.reset_cache()
    assert m.tracker_state() == [(k(2), 1), (k(1), 3), (k(3), 1)]
    assert drain(m) == [("stored", ks(1))]
    d = stats_data(m)
    assert d[SKIPPED] == 3
    assert d[ALLOC] == [1]
    m.check_invariants()


def test_reset_makes_request_ranks_stale(make_manager: MakeManager) -> None:
    m = make_manager(8)
    req = request("a", {k(51): 16})
    store(m, req, 1)  # req rank 0
    m.reset_cache()
    store(m, ReqContext(req_id="x"), 50)  # x rank 0; 50 -> (1, 0)
    store(m, req, 51)  # stale: req takes a fresh rank 2; 51 -> (2, -16)
    assert lru_state(m) == ({k(50): (1, 0), k(51): (2, -16)}, 3)
    m.check_invariants()


@pytest.mark.parametrize("announce", [False, True])
def test_reset_unfinishes_stale_requests(make_manager: MakeManager, announce: bool) -> None:
    m = make_manager(4)
    req = ReqContext(req_id="a")
    store(m, req, 1)
    m.on_request_finished(req)
    m.reset_cache()
    if announce:
        m.on_new_request(req)  # stale state is not current: fresh state
    assert m.prepare_store(ks(2), req).keys_to_store == ks(2)
    m.check_invariants()


# === Stats ===================================================================================


def test_stats_layout_minimal(make_manager: MakeManager) -> None:
    m = make_manager(4)
    data = m.get_stats().data
    assert list(data) == ["types", "data", "info"]
    assert list(data["types"].items()) == [(USAGE, "gauge"), (WRITE, "gauge"), (READ, "gauge")]
    assert list(data["data"]) == [USAGE, WRITE, READ]
    assert all(series == {(): 0.0} for series in data["data"].values())
    assert data["info"] is None
    m.check_invariants()


def test_stats_layout_full(make_manager: MakeManager) -> None:
    m = make_manager(4, store_threshold=2)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    m.prepare_store(ks(1, 2, 3), ctx)
    m.prepare_store(ks(1), ctx)
    m.prepare_store(ks(4, 5), ctx)
    m.prepare_store(ks(4), ctx)
    data = m.get_stats().data
    assert list(data["types"].items()) == [
        (USAGE, "gauge"),
        (ALLOC, "histogram"),
        (WRITE, "gauge"),
        (READ, "gauge"),
        (SKIPPED, "counter"),
    ]
    assert list(data["data"]) == [USAGE, ALLOC, WRITE, READ, SKIPPED]
    assert data["data"][ALLOC] == {(): [3, 1]}
    assert data["data"][SKIPPED] == {(): 5}
    assert data["data"][USAGE] == {(): 1.0}
    assert data["info"] is None
    data = m.get_stats().data
    assert list(data["data"]) == [USAGE, WRITE, READ, SKIPPED]
    assert data["data"][SKIPPED] == {(): 0}
    m.check_invariants()


@pytest.mark.parametrize("threshold", [0, 1])
def test_stats_no_skip_counter_without_tracker(make_manager: MakeManager, threshold: int) -> None:
    m = make_manager(4, store_threshold=threshold)
    m.prepare_store(ks(1), ReqContext(req_id=""))
    assert SKIPPED not in m.get_stats().data["types"]
    assert m.tracker_state() is None
    m.check_invariants()


def test_stats_read_usage_is_a_float_difference(make_manager: MakeManager) -> None:
    assert 3 / 10 - 1 / 10 != 2 / 10  # the case where the difference is not pinned / n
    m = make_manager(10)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.prepare_load(ks(1, 2), ctx)
    m.prepare_store(ks(3), ctx)
    d = stats_data(m)
    assert d[USAGE] == 3 / 10
    assert d[WRITE] == 1 / 10
    assert d[READ] == 3 / 10 - 1 / 10
    m.check_invariants()


def test_stats_histogram_in_observation_order(make_manager: MakeManager) -> None:
    m = make_manager(8)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1, 2, 3), ctx)
    m.prepare_store(ks(4), ctx)
    m.prepare_store(ks(5, 6), ctx)
    assert stats_data(m)[ALLOC] == [3, 1, 2]
    m.prepare_store(ks(7), ctx)
    assert stats_data(m)[ALLOC] == [1]
    m.check_invariants()


# === Small calls =============================================================================


def test_small_calls(make_manager: MakeManager) -> None:
    m = make_manager(4, cache_policy="arc", enable_events=True)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    m.prepare_store(ks(3), ctx)
    with m.lock:
        assert m.lookup(k(1), ctx) is HIT
    with m.lock:
        pass
    assert m.get_load_source(k(1), ctx) is CacheHitSource.HOST
    assert m.medium == Medium.CPU
    before = (m.policy_state(), m.resident(), m.pool_state())
    m.on_schedule_end(ctx)
    m.on_reset_flushed()
    assert m.has_pending_work() is False
    assert (m.policy_state(), m.resident(), m.pool_state()) == before
    assert drain(m) == [("stored", ks(1, 2))]
    m.shutdown()
    m.check_invariants()


def test_config_info(make_manager: MakeManager) -> None:
    @dataclasses.dataclass
    class Info:
        block_size: int = 16
        tier: str | None = None

    assert make_manager(2).config_info() == [{}]
    assert make_manager(2, info=Info()).config_info() == [{"block_size": 16, "tier": "None"}]


def test_registered_policy_wins_over_module_path(make_manager: MakeManager) -> None:
    m = make_manager(2, cache_policy="arc", cache_policy_module_path="no.such.module")
    assert m.policy_state()["policy"] == "arc"
    m.check_invariants()


def test_lookup_prefix(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2, 4)
    m.prepare_load(ks(2), ctx)
    m.prepare_store(ks(5), ctx)
    before = (m.policy_state(), m.resident(), m.pool_state())
    assert m.lookup_prefix([], ctx) == 0
    assert m.lookup_prefix(ks(1, 2, 4), ctx) == 3  # ready and pinned keys are hits
    assert m.lookup_prefix(ks(1, 2, 3, 4), ctx) == 2  # stops at the first miss
    assert m.lookup_prefix(ks(4, 5, 1), ctx) == 1  # a pending key is not a hit
    assert m.lookup_prefix(ks(3, 1), ctx) == 0
    assert (m.policy_state(), m.resident(), m.pool_state()) == before
    m.check_invariants()


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
