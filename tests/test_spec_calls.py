"""SPEC.md rules for chunk ids, lookups, loads, touches and stores, against every implementation.

Expected values are worked out by hand from SPEC.md; comments give the arithmetic where it is not
obvious. LRU ranks are ``(major, minor)``; a context's first recording call that sees a new key
takes a request rank from the same counter as fresh ranks.
"""

from __future__ import annotations

import enum
import types
from collections.abc import Callable, Iterable

import numpy as np
import pytest

import kvoffload
import kvoffload.types
from _helpers import (
    ALLOC,
    HIT,
    MISS,
    PENDING,
    SKIPPED,
    MakeManager,
    arc_lists,
    chunk_ids,
    drain,
    k,
    ks,
    lru_state,
    ranks,
    request,
    stats_data,
    store,
)
from kvoffload import (
    InvalidKeyError,
    KeyStateError,
    LookupResult,
    ReqContext,
    RequestFinishedError,
)

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


def test_completions_of_jobs_from_before_a_reset(make_manager: MakeManager) -> None:
    # The engine never delivers them (SPEC.md); if one comes anyway it is a completion like any
    # other: of a key no longer pending or pinned it changes nothing (a load's raises), and of
    # a key prepared again since the reset it completes the new job, which it cannot tell apart.
    m = make_manager(4)
    a = ReqContext(req_id="a")
    m.prepare_store(ks(1, 2), a)
    m.complete_store(ks(1), a)
    m.prepare_load(ks(1), a)  # 1 pinned, 2 pending
    m.reset_cache()
    empty = (m.resident(), m.pool_state(), m.policy_state())
    m.complete_store(ks(2), a)
    m.complete_store(ks(2), a, success=False)
    with pytest.raises(KeyStateError):
        m.complete_load(ks(1), a)
    assert (m.resident(), m.pool_state(), m.policy_state()) == empty
    m.check_invariants()
    b = ReqContext(req_id="b")
    assert chunk_ids(m.prepare_store(ks(2), b)) == [0]
    m.complete_store(ks(2), a, success=False)  # the old job's failure ends b's store
    assert m.resident() == {}
    assert m.pool_state() == (1, [0])
    store(m, b, 1)
    m.prepare_load(ks(1), b)
    m.complete_load(ks(1), a)  # the old load's completion releases b's pin
    assert list(m.resident().values()) == [(1, 0)]  # never-used ids first: chunk 1
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


def test_prepare_read_pins_as_a_load_does(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    assert chunk_ids(m.prepare_read(ks(2, 1, 2), ctx)) == [1, 0, 1]
    assert chunk_ids(m.prepare_read(ks(1))) == [0]  # the context may be left out
    assert m.resident() == {k(1): (0, 2), k(2): (1, 2)}
    m.complete_load(ks(2, 1, 2, 1), ctx)  # a load's completion releases a read's pins
    assert m.resident() == {k(1): (0, 0), k(2): (1, 0)}
    m.check_invariants()


def test_prepare_read_of_an_absent_or_pending_key_changes_nothing(
    make_manager: MakeManager,
) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    m.prepare_store(ks(2), ctx)  # 2 pending
    before = (m.resident(), m.policy_state())
    for bad in (2, 3):
        with pytest.raises(KeyStateError, match="cannot read"):
            m.prepare_read(ks(1, bad), ctx)
        assert (m.resident(), m.policy_state()) == before
    m.check_invariants()


def test_prepare_read_records_no_request_access(make_manager: MakeManager) -> None:
    # vLLM's tiering reads a chunk to copy it to another tier: no request's access, so no rank
    # (LRU) and nothing a finished request may not record.
    m = make_manager(4)
    store(m, ReqContext(req_id=""), 1)  # base request rank 0; 1 -> (1, 0)
    req = request("c", {k(1): 4, k(5): 4})
    m.prepare_read(ks(1), req)  # a load would take request rank 2 and raise 1 to (2, -4)
    assert lru_state(m) == ({k(1): (1, 0)}, 2)
    m.complete_load(ks(1), req)
    store(m, req, 5)  # the request's first access: rank 2; 5 -> (2, -4)
    m.on_request_finished(req)
    m.prepare_read(ks(1), req)  # a finished request that never saw the key: still a read
    m.complete_load(ks(1), req)
    with pytest.raises(RequestFinishedError):
        m.prepare_load(ks(1), req)  # the reads did not make the key the request's
    # The same calls without the reads leave the same ranks (the finish re-ranks 5 alone).
    twin = make_manager(4)
    store(twin, ReqContext(req_id=""), 1)
    twin_req = request("c", {k(1): 4, k(5): 4})
    store(twin, twin_req, 5)
    twin.on_request_finished(twin_req)
    assert lru_state(m) == lru_state(twin) == ({k(1): (1, 0), k(5): (3, 0)}, 4)
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


class _Key(bytes):
    """A bytes subclass, so that identity and type of returned keys can be told apart."""


_CONTAINERS: dict[str, Callable[[list[bytes]], Iterable[bytes]]] = {
    "list": list,
    "tuple": tuple,
    "subclass keys": lambda keys: [_Key(key) for key in keys],
    "one subclass key last": lambda keys: [*keys[:-1], _Key(keys[-1])],
    "generator": lambda keys: (key for key in keys),
}


@pytest.mark.parametrize("container", list(_CONTAINERS))
@pytest.mark.parametrize("n", [1, 127, 128, 200])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_completions_take_any_container_and_size(
    make_manager: MakeManager, policy: str, n: int, container: str
) -> None:
    # complete_store, touch and complete_load have a path that borrows the caller's keys (exact
    # bytes in a list or tuple, few enough keys, the lock free) and one that keeps its own
    # references; both must give the same results and the same errors.
    wrap = _CONTAINERS[container]
    m = make_manager(n + 1, cache_policy=policy)
    ctx = ReqContext(req_id="")
    keys = ks(*range(n))
    out = m.prepare_store(keys, ctx)
    assert out is not None
    assert out.keys_to_store == keys
    m.complete_store(wrap(keys), ctx)
    assert [m.lookup(key, ctx) for key in keys] == [HIT] * n
    assert chunk_ids(m.prepare_load(keys, ctx)) == list(range(n))
    m.touch(wrap(keys[::-1]), ctx)
    before = (m.policy_state(), m.resident())
    with pytest.raises(KeyStateError):
        m.complete_load(wrap([*keys, k(n)]), ctx)  # the last key is not loaded: nothing changes
    assert (m.policy_state(), m.resident()) == before
    assert all(ref == 1 for _, ref in m.resident().values())
    m.complete_load(wrap(keys), ctx)
    assert all(ref == 0 for _, ref in m.resident().values())
    m.check_invariants()
    # A failed store through the same container frees its chunks.
    out = m.prepare_store(ks(n, n + 1), ctx)
    assert out is not None
    m.complete_store(wrap(out.keys_to_store), ctx, success=False)
    assert m.lookup(k(n), ctx) == MISS
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_evicted_keys_are_the_stored_objects(make_manager: MakeManager, policy: str) -> None:
    # vLLM's policy keeps the stored key objects as dict keys and evicts those very objects.
    m = make_manager(2, cache_policy=policy)
    ctx = ReqContext(req_id="")
    stored = [_Key(key) for key in ks(1, 2)]
    m.complete_store(m.prepare_store(stored, ctx).keys_to_store, ctx)
    # Equal keys offered again as plain bytes change nothing about which object is kept.
    m.prepare_store(ks(1, 2), ctx)
    out = m.prepare_store(ks(3, 4), ReqContext(req_id="other"))
    assert sorted(out.evicted_keys) == ks(1, 2)
    assert {id(key) for key in out.evicted_keys} == {id(key) for key in stored}
    m.complete_store(out.keys_to_store, ctx, success=False)  # the failed store drops 3 and 4
    out = m.prepare_store(ks(5, 6), ctx)
    assert out.evicted_keys == []
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


# === Call shape ================================================================================


def test_calls_take_vllm_keyword_names(make_manager: MakeManager) -> None:
    m = make_manager(4, enable_events=True)
    ctx = ReqContext(req_id="")
    out = m.prepare_store(keys=ks(1, 2), req_context=ctx)
    assert out.keys_to_store == ks(1, 2)
    m.complete_store(keys=ks(1, 2), req_context=ctx, success=True)
    assert m.lookup(key=k(1), req_context=ctx) == HIT
    assert m.lookup_prefix(keys=ks(1, 2, 3), req_context=ctx) == 2
    assert chunk_ids(m.prepare_load(keys=ks(2), req_context=ctx)) == [1]
    m.complete_load(keys=ks(2), req_context=ctx)
    m.touch(keys=ks(1), req_context=ctx)
    assert m.resident() == {k(1): (0, 0), k(2): (1, 0)}
    m.check_invariants()


@pytest.mark.parametrize(("success", "kept"), [(0, False), ("", False), (1, True), ("yes", True)])
def test_complete_store_reads_success_as_a_condition(
    make_manager: MakeManager, success: object, kept: bool
) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="")
    m.prepare_store(ks(1), ctx)
    m.complete_store(ks(1), ctx, success)
    assert m.lookup(k(1), ctx) == (HIT if kept else MISS)
    m.check_invariants()


def test_hot_calls_cross_into_rust_directly() -> None:
    from kvoffload import CPUOffloadingManager
    from kvoffload.manager import _DIRECT_CALLS

    class Counting(CPUOffloadingManager):
        looked_up = 0

        def lookup(self, key: bytes, req_context: object) -> LookupResult:
            Counting.looked_up += 1
            return super().lookup(key, req_context)

    plain, counting = CPUOffloadingManager(4), Counting(4)
    for name in _DIRECT_CALLS:
        # The core's own method (lookup: its builtin bound to the core, which skips PyO3's
        # method wrapper): no Python frame between the caller and Rust.
        call = getattr(plain, name)
        if name == "lookup":
            assert call.__self__ is plain._core
            assert call.__name__ == "lookup"
        else:
            assert call == getattr(plain._core, name)
        assert type(call).__name__ == "builtin_function_or_method"
    # A subclass's override is kept; the calls it does not override still go straight in.
    ctx = ReqContext(req_id="")
    assert counting.lookup(k(1), ctx) == MISS
    assert Counting.looked_up == 1
    assert counting.prepare_store == counting._core.prepare_store


def test_fast_lookup_takes_arguments_as_the_method_does() -> None:
    """The lookup builtin answers exactly as the core's method for every way of calling it,
    and refuses bad calls with the method's own errors, changing nothing."""
    import inspect

    from kvoffload import CPUOffloadingManager, KVOffloadError

    m = CPUOffloadingManager(4)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1)
    fast: Callable[..., LookupResult] = m.lookup
    method: Callable[..., LookupResult] = m._core.lookup
    assert fast is not method
    assert str(inspect.signature(fast)) == str(inspect.signature(method))
    calls: list[tuple[tuple[object, ...], dict[str, object]]] = [
        ((k(1),), {}),
        ((k(1), ctx), {}),
        ((k(2), None), {}),
        ((), {"key": k(1)}),
        ((k(1),), {"req_context": ctx}),
        ((), {"req_context": ctx, "key": k(2)}),
        ((), {}),
        ((k(1), ctx, ctx), {}),
        ((k(1),), {"key": k(1)}),
        ((k(1),), {"other": 1}),
        (("a str",), {}),
        ((None, ctx), {}),
        ((bytearray(b"x"),), {}),
    ]
    for args, kwargs in calls:
        outcomes: list[tuple[str, object]] = []
        for f in (fast, method):
            try:
                outcomes.append(("ok", f(*args, **kwargs)))
            except (TypeError, KVOffloadError) as e:
                outcomes.append((type(e).__name__, str(e)))
        assert outcomes[0] == outcomes[1], (args, kwargs, outcomes)
    assert (fast(k(1), ctx), fast(k(2), ctx)) == (HIT, MISS)
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_completions_by_prepared_objects_copies_or_stale_ones(
    make_manager: MakeManager, policy: str
) -> None:
    # The Rust manager remembers which chunk each object it just stored or loaded went to and
    # checks that guess against the chunk's key, or, when the chunk keeps that very object,
    # takes it as is: the same objects, equal copies, and objects whose chunk has since gone
    # to another key must all complete (and touch) exactly as vLLM's would.
    m = make_manager(2, cache_policy=policy)
    ctx = ReqContext(req_id="")
    first = ks(1, 2)
    m.complete_store(m.prepare_store(first, ctx).keys_to_store, ctx)  # the very objects
    m.complete_store([bytes(bytearray(key)) for key in first], ctx)  # no longer pending: ignored
    out = m.prepare_store(ks(3, 4), ReqContext(req_id="other"))  # evicts 1 and 2
    assert sorted(out.evicted_keys) == ks(1, 2)
    # 1 and 2 are gone and 3 and 4 now hold their chunks: a guess from 1 and 2 must not hit.
    m.complete_store(first, ctx)
    assert [m.lookup(key, ctx) for key in ks(3, 4)] == [PENDING, PENDING]
    m.complete_store([bytes(bytearray(key)) for key in ks(3, 4)], ctx)  # copies complete them
    assert [m.lookup(key, ctx) for key in ks(3, 4)] == [HIT, HIT]
    loaded = ks(3, 4)
    m.prepare_load(loaded, ctx)

    def resident_order() -> dict[str, object]:
        state = m.policy_state()
        return {name: state[name] for name in ("ranks", "t1", "t2") if name in state}

    resident = resident_order()
    with pytest.raises(KeyStateError):
        m.complete_load(first, ctx)  # stale objects: not being loaded, nothing released
    # Nor do they touch the keys now at their chunks. (ARC's touch of an evicted key adapts its
    # target and ghosts, as vLLM's does; the resident keys' order must not change.)
    m.touch(first, ctx)
    assert resident_order() == resident
    assert all(ref == 1 for _, ref in m.resident().values())
    m.complete_load([bytes(bytearray(key)) for key in loaded], ctx)
    with pytest.raises(KeyStateError):
        m.complete_load(loaded, ctx)  # every pin already released
    m.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_completions_of_batches_larger_than_the_chunk_memo(
    make_manager: MakeManager, policy: str
) -> None:
    # The Rust manager's memo of where each object went has 4,096 entries, so a batch of 5,000
    # objects loses some of its guesses to others of the batch: those keys are looked up, while
    # the others are still taken at their guesses. Every key must complete all the same.
    m = make_manager(5_000, cache_policy=policy)
    ctx = ReqContext(req_id="")
    keys = ks(*range(5_000))
    m.complete_store(m.prepare_store(keys, ctx).keys_to_store, ctx)
    assert all(ref == 0 for _, ref in m.resident().values())
    m.prepare_load(keys, ctx)
    assert all(ref == 1 for _, ref in m.resident().values())
    m.touch(keys, ctx)
    m.complete_load(keys, ctx)
    assert all(ref == 0 for _, ref in m.resident().values())
    with pytest.raises(KeyStateError):
        m.complete_load(keys[::-1], ctx)  # every pin already released: nothing changes
    resident = m.resident()
    assert len(resident) == 5_000
    assert all(ref == 0 for _, ref in resident.values())
    m.check_invariants()


# === Key collections ===========================================================================
# The native manager reads lists and tuples 32 items at a time, with a fast path for batches of
# exact ``bytes``; these pin down that every shape and mix reads the same.


def _keys_as(shape: str, keys: list[bytes]) -> object:
    if shape == "list":
        return list(keys)
    if shape == "tuple":
        return tuple(keys)
    return iter(keys)


@pytest.mark.parametrize("shape", ["list", "tuple", "iterator"])
def test_key_collections_read_alike_past_one_batch(make_manager: MakeManager, shape: str) -> None:
    m = make_manager(80)
    ctx = ReqContext(req_id="")
    keys = ks(*range(70))
    keys[40] = _Key(keys[40])  # a subclass in the second batch of 32
    out = m.prepare_store(_keys_as(shape, keys), ctx)
    assert out.keys_to_store == keys
    assert out.keys_to_store[40] is keys[40]
    assert chunk_ids(out) == list(range(70))
    m.complete_store(_keys_as(shape, out.keys_to_store), ctx)
    assert m.lookup_prefix(_keys_as(shape, keys), ctx) == 70
    assert chunk_ids(m.prepare_load(_keys_as(shape, keys[::-1]), ctx)) == list(range(69, -1, -1))
    m.complete_load(_keys_as(shape, keys), ctx)
    m.check_invariants()


@pytest.mark.parametrize("shape", ["list", "tuple"])
@pytest.mark.parametrize("bad_at", [0, 31, 32, 45])
def test_bad_item_in_any_batch_changes_nothing(
    make_manager: MakeManager, shape: str, bad_at: int
) -> None:
    m = make_manager(80)
    ctx = ReqContext(req_id="")
    store(m, ctx, 1, 2)
    before = (m.policy_state(), m.resident(), m.pool_state())
    keys: list[object] = list(ks(*range(10, 60)))
    keys[bad_at] = "not bytes"
    with pytest.raises(InvalidKeyError, match="must be bytes, got str"):
        m.prepare_store(_keys_as(shape, keys), ctx)  # type: ignore[arg-type]
    with pytest.raises(InvalidKeyError):
        m.lookup_prefix(_keys_as(shape, keys), ctx)  # type: ignore[arg-type]
    assert (m.policy_state(), m.resident(), m.pool_state()) == before
    m.check_invariants()


def test_positions_of_any_int_type_read_alike(make_manager: MakeManager) -> None:
    # Plain ints take the native manager's fast path; bool, numpy and IntEnum values the general
    # one. Both must rank alike.
    class Pos(enum.IntEnum):
        ONE = 1
        FIVE = 5

    states = []
    for one, five in [(1, 5), (True, np.int64(5)), (Pos.ONE, Pos.FIVE)]:
        m = make_manager(4)
        ctx = ReqContext(req_id="")
        ctx.set_offload_key_position(k(1), one)
        ctx.set_offload_key_position(k(2), five)
        store(m, ctx, 1, 2, 3)
        m.on_request_finished(ctx)
        states.append(lru_state(m))
    assert states[0] == states[1] == states[2]


def test_result_classes_with_their_own_new_are_built_through_it() -> None:
    # The native manager makes bare result instances by object's own allocation when a class
    # keeps object.__new__; a class with a __new__ of its own must still have it called.
    made: list[type] = []

    class Output(kvoffload.types.PrepareStoreOutput):
        def __new__(cls, *args: object, **kwargs: object) -> Output:
            made.append(cls)
            return super().__new__(cls)

    namespace = types.SimpleNamespace(
        **{name: getattr(kvoffload.types, name) for name in dir(kvoffload.types)}
    )
    namespace.PrepareStoreOutput = Output
    cls = type("OwnNewManager", (kvoffload.CPUOffloadingManager,), {"_types": namespace})
    m = cls(4)
    out = m.prepare_store(ks(1, 2), ReqContext(req_id=""))
    assert type(out) is Output
    assert made == [Output]
    assert (out.keys_to_store, out.evicted_keys, chunk_ids(out)) == (ks(1, 2), [], [0, 1])
    assert type(out.store_spec) is kvoffload.types.CPULoadStoreSpec
