"""SPEC.md rules for events, request state, reset_cache, stats and the small calls.

Expected values are worked out by hand from SPEC.md, as in test_spec_calls.py.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from _helpers import (
    ALLOC,
    HIT,
    MISS,
    READ,
    SKIPPED,
    USAGE,
    WRITE,
    MakeManager,
    arc_lists,
    drain,
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
    CacheHitSource,
    InvalidArgumentError,
    Medium,
    OffloadingEvent,
    OffloadPolicy,
    ReqContext,
    RequestFinishedError,
    RequestOffloadingContext,
)

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
        assert type(e) is OffloadingEvent
        made = OffloadingEvent(
            keys=list(e.keys), medium=Medium.CPU, removed=e.removed, metadata_only=e.metadata_only
        )
        assert e == made
        # The same attributes, set in the fields' order, as the constructor sets them.
        assert list(vars(e).items()) == list(vars(made).items())
        assert list(vars(e)) == [f.name for f in dataclasses.fields(OffloadingEvent)]
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


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_event_keys_are_vllms_objects(make_manager: MakeManager, policy: str) -> None:
    # vLLM's events hold key objects, not copies: a completion's event the keys of that call,
    # an eviction's the keys its policy gives back, which the store's output returns too.
    m = make_manager(2, cache_policy=policy, enable_events=True)
    ctx = ReqContext(req_id="")
    completed = [bytes(bytearray(key)) for key in ks(1, 2)]
    m.prepare_store(ks(1, 2), ctx)
    m.complete_store(completed, ctx)
    out = m.prepare_store(ks(3, 4), ReqContext(req_id="other"))
    failed = [bytes(bytearray(key)) for key in out.keys_to_store]
    m.complete_store(failed, ctx, success=False)
    stored, evicted, cleanup = list(m.take_events())
    assert [id(key) for key in stored.keys] == [id(key) for key in completed]
    assert [id(key) for key in evicted.keys] == [id(key) for key in out.evicted_keys]
    assert [id(key) for key in cleanup.keys] == [id(key) for key in failed]
    m.check_invariants()


def test_events_of_long_calls_keep_their_order(make_manager: MakeManager) -> None:
    # Calls of many keys (which the Rust manager runs with the GIL released) queue their
    # events in order with the others.
    m = make_manager(300, enable_events=True)
    ctx = ReqContext(req_id="")
    first, second, third = range(0, 200), range(200, 210), range(210, 410)
    store(m, ctx, *first)
    store(m, ctx, *second)
    out = m.prepare_store(ks(*third), ctx)
    m.complete_store(out.keys_to_store[:150], ctx)
    m.complete_store(out.keys_to_store[150:], ctx, success=False)
    evicted = ks(*first)[:110]
    assert drain(m) == [
        ("stored", ks(*first)),
        ("stored", ks(*second)),
        ("removed", evicted),
        ("stored", ks(*third)[:150]),
        ("cleanup", ks(*third)[150:]),
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


def test_an_lru_rank_outlives_another_managers_state_on_the_context(
    make_manager: MakeManager,
) -> None:
    # Managers sharing a context replace each other's request state on it, but LRU keeps the
    # request's rank apart (as vLLM's does): the LRU manager takes its rank up again instead of
    # drawing a new one. A rank another LRU manager drew since is not taken up.
    lru = make_manager(8)
    req = request("a", {k(1): 16, k(2): 32, k(4): 48})
    store(lru, req, 1)  # req rank 0; 1 -> (0, -16)
    store(lru, ReqContext(req_id="x"), 50)  # x rank 1; 50 -> (2, 0)
    store(make_manager(8, cache_policy="arc"), req, 9)  # its state replaces lru's on req
    store(lru, req, 2)  # fresh state, rank 0 again: 2 -> (0, -32)
    assert lru_state(lru) == ({k(1): (0, -16), k(50): (2, 0), k(2): (0, -32)}, 3)
    store(make_manager(8), req, 3)  # another LRU manager's state and rank
    store(lru, req, 4)  # req rank 3: 4 -> (3, -48)
    assert lru_state(lru)[0][k(4)] == (3, -48)
    lru.check_invariants()


class DuckContext:
    """Only the three methods the manager may use; no other attributes. The keys it is asked
    positions for are appended to ``asked`` when one is given."""

    __slots__ = ("_asked", "_p", "_s")

    def __init__(self, positions: dict[bytes, int], asked: list[bytes] | None = None) -> None:
        self._p = positions
        self._asked = asked
        self._s: dict[type, Any] = {}

    def get_state(self, cls: type) -> Any:
        return self._s.get(cls)

    def set_state(self, val: Any) -> None:
        self._s[type(val)] = val

    def get_offload_key_position(self, key: bytes) -> int | None:
        if self._asked is not None:
            self._asked.append(key)
        return self._p.get(key)


def test_vllm_shaped_context(make_manager: MakeManager) -> None:
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


def test_a_context_method_set_on_the_instance_is_called(make_manager: MakeManager) -> None:
    # kvoffload's own ReqContext is read through its dicts; a method set on the instance in
    # place of its class's was skipped (the Rust manager ranked without these positions).
    m = make_manager(4)
    req = ReqContext("r")
    req.get_offload_key_position = {k(1): 10, k(2): 20}.get  # type: ignore[method-assign,assignment]
    store(m, req, 1, 2)
    assert m.policy_state()["ranks"] == {k(1): (0, -10), k(2): (0, -20)}
    bad = ReqContext("bad")
    bad.get_offload_key_position = lambda key: 1.5  # type: ignore[method-assign,assignment,return-value]
    before = m.policy_state()
    with pytest.raises(InvalidArgumentError, match="position"):
        m.prepare_store(ks(3), bad)
    assert m.policy_state() == before
    m.check_invariants()


def test_finish_asks_positions_with_the_first_offered_keys(make_manager: MakeManager) -> None:
    """As vLLM does: the objects a request first offered each key as, not copies."""
    asked: list[bytes] = []
    m = make_manager(8)
    req = DuckContext({}, asked)
    first = ks(1, 2, 3)

    def copy(key: bytes) -> bytes:
        return bytes(bytearray(key))  # an equal object, not the same one

    out = m.prepare_store(first[:2], req)
    m.complete_store(out.keys_to_store, req)
    m.prepare_load([copy(x) for x in first[:2]], req)  # equal copies: already seen
    m.complete_load(first[:2], req)
    m.prepare_store([copy(first[0]), first[2]], req)
    asked.clear()
    m.on_request_finished(req)
    assert {id(a) for a in asked} == {id(f) for f in first}  # the very objects, each asked
    m.check_invariants()


class StatelessContext(DuckContext):
    """A context that cannot keep state: ``set_state`` raises."""

    __slots__ = ()

    def set_state(self, val: Any) -> None:
        raise RuntimeError("no state here")


@pytest.mark.parametrize("threshold", [1, 2])
def test_context_refusing_state_changes_nothing(make_manager: MakeManager, threshold: int) -> None:
    m = make_manager(4, store_threshold=threshold)
    ready = ReqContext(req_id="w")
    for _ in range(threshold):
        out = m.prepare_store(ks(1, 2), ready)
    m.complete_store(out.keys_to_store, ready)
    m.get_stats()  # the report so far; the next shows what happened since
    before = (m.resident(), m.tracker_state(), m.policy_state())
    quiet = make_manager(4, store_threshold=threshold).get_stats().data
    bad = StatelessContext({k(1): 16, k(3): 48})
    with pytest.raises(RuntimeError, match="no state here"):
        m.prepare_load(ks(1), bad)  # pins nothing
    with pytest.raises(RuntimeError, match="no state here"):
        m.prepare_store(ks(3), bad)  # counts no offer
    assert (m.resident(), m.tracker_state(), m.policy_state()) == before
    assert m.get_stats().data == quiet
    m.check_invariants()


class JunkStateContext(DuckContext):
    """A context whose ``get_state`` hands back something other than what it was given."""

    __slots__ = ("junk",)
    junk: object

    def get_state(self, cls: type) -> Any:
        return self.junk


def _finish_after_stores(make_manager: MakeManager, req: Any) -> tuple[Any, Any]:
    """ARC's state before and after ``req`` finishes, having stored keys 1 and 2 (and another
    request key 3 after them)."""
    m = make_manager(4, cache_policy="arc")
    assert m.prepare_store(ks(1, 2), req).keys_to_store == ks(1, 2)
    m.complete_store(ks(1, 2), req)
    other = DuckContext({})
    m.prepare_store(ks(3), other)
    m.complete_store(ks(3), other)
    before = m.policy_state()
    m.on_request_finished(req)
    m.check_invariants()
    return before, m.policy_state()


@pytest.mark.parametrize("junk", [5, "state", object()])
def test_context_state_of_another_kind_is_no_state(make_manager: MakeManager, junk: Any) -> None:
    # What is not this manager's state counts as none: each call makes a fresh state, and the
    # finish finds none to report.
    req = JunkStateContext({})
    req.junk = junk
    before, after = _finish_after_stores(make_manager, req)
    assert before["t1"] == ks(1, 2, 3)
    assert after == before
    # With its state kept, the finish reports the keys the request stored and never reused:
    # ARC moves them to T1's newest end.
    before, after = _finish_after_stores(make_manager, DuckContext({}))
    assert before["t1"] == ks(1, 2, 3)
    assert after["t1"] != before["t1"]
    assert after["t1"][0] == k(3)


class BytesKey(bytes):
    """A key type the manager accepts whose hash and equality are its own."""

    def __hash__(self) -> int:
        return 7

    def __eq__(self, other: object) -> bool:
        return bytes.__eq__(self, other)


class Int(int):
    """A position of a type other than exactly int."""


#: How the context's positions dict is laid out against the order the keys are offered in;
#: each maps the keys (in offered order) with their positions to the dict's items.
DICT_LAYOUTS: dict[str, Any] = {
    "offered order": lambda items: items,
    "reversed": lambda items: items[::-1],
    "unrelated keys between": lambda items: [
        x for i, item in enumerate(items) for x in (item, (k(900 + i), 10 * i))
    ],
    "five unrelated keys first": lambda items: [(k(950 + i), i) for i in range(5)] + items,
    "equal copies as keys": lambda items: [(bytes(bytearray(key)), p) for key, p in items],
    "every other key missing": lambda items: items[::2],
    "values of other types": lambda items: [
        (key, (True, p, Int(p), None)[i % 4]) for i, (key, p) in enumerate(items)
    ],
}


@pytest.mark.parametrize("layout", sorted(DICT_LAYOUTS))
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_positions_read_alike_whatever_the_dict_holds(
    make_manager: MakeManager, layout: str, policy: str
) -> None:
    """kvoffload's own contexts are read through their dicts, following the dict's order when it
    matches the keys offered; every layout, and changes between calls, must read exactly as a
    context asked key by key does."""
    keys = ks(*range(1, 13))
    keys[7] = BytesKey(keys[7])
    items = DICT_LAYOUTS[layout]([(key, 16 * (i + 1)) for i, key in enumerate(keys)])

    def run(ctx_of: Any) -> Any:
        m = make_manager(16, cache_policy=policy)
        first, second = ctx_of("a"), ctx_of("b")
        for key, p in items:
            first.set_offload_key_position(key, p)
            second.set_offload_key_position(key, p)
        for ids in (keys[:3], keys[3:6]):
            out = m.prepare_store(ids, first)
            m.complete_store(out.keys_to_store, first)
            first.set_offload_key_position(keys[4], 1000)  # read already, or not yet
        m.on_request_finished(first)
        m.prepare_load(keys[:6], second)
        m.complete_load(keys[:6], second)
        positions = second._offload_key_positions
        positions.pop(keys[8], None)
        positions[keys[8]] = 5  # the same key at the dict's end
        out = m.prepare_store(keys[6:], second)
        m.complete_store(out.keys_to_store, second)
        m.on_request_finished(second)
        m.check_invariants()
        return m.policy_state()

    class Asked(DuckContext):
        def __init__(self, req_id: str) -> None:
            super().__init__({})
            self._offload_key_positions = self._p

        def set_offload_key_position(self, key: bytes, p: int) -> None:
            self._p[key] = p

    assert run(lambda rid: ReqContext(req_id=rid)) == run(Asked)


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


@pytest.mark.parametrize("sizes", [[], [3], [3, 1, 2]])
@pytest.mark.parametrize("skipped", [None, 0, 7])
@pytest.mark.parametrize(("chunks", "used", "pending"), [(0, 0, 0), (10, 3, 1), (4, 4, 4)])
def test_own_stats_are_built_as_the_metric_calls_build_them(
    sizes: list[int], skipped: int | None, chunks: int, used: int, pending: int
) -> None:
    # kvoffload's own payload is written out at once; any other class (here a subclass, as
    # vLLM's) gets the set_gauge / observe_histogram / increase_counter calls. Same payload.
    from kvoffload._common import build_stats
    from kvoffload.types import OffloadingStats

    class Called(OffloadingStats):
        __slots__ = ()

    own = build_stats(chunks, used, pending, list(sizes), skipped)
    called = build_stats(chunks, used, pending, list(sizes), skipped, Called)
    assert type(own) is OffloadingStats
    assert type(called) is Called
    assert repr(own.data) == repr(called.data)  # entries, their order and their value types
    assert own.data == called.data


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


class BackwardList(list):  # type: ignore[type-arg]
    """A list whose iteration runs backward: what a loop over it sees is what it holds."""

    def __iter__(self) -> Any:
        return reversed(tuple(list.__iter__(self)))


class FirstTwo(tuple):  # type: ignore[type-arg]
    """A tuple whose iteration stops after two items."""

    def __iter__(self) -> Any:
        return iter(tuple.__getitem__(self, slice(0, 2)))


def test_key_collections_are_iterated_as_python_would(make_manager: MakeManager) -> None:
    # vLLM loops over the keys it is given, so a list or tuple subclass holds what its own
    # __iter__ yields; both managers read it that way.
    m = make_manager(8)
    ctx = ReqContext(req_id="r")
    out = m.prepare_store(BackwardList(ks(1, 2, 3)), ctx)
    assert out.keys_to_store == ks(3, 2, 1)
    m.complete_store(FirstTwo(ks(3, 2, 1)), ctx)
    assert {key: ref for key, (_, ref) in m.resident().items()} == {k(1): -1, k(2): 0, k(3): 0}
    assert m.lookup_prefix(BackwardList(ks(1, 2, 3)), ctx) == 2  # 3 and 2 ready, then 1 pending
    spec = m.prepare_load(FirstTwo(ks(2, 3, 1)), ctx)  # loads 2 and 3 only
    assert len(spec.chunk_ids) == 2
    m.complete_load(BackwardList(ks(3, 2)), ctx)
    m.touch(FirstTwo(ks(3, 2, 9)), ctx)
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
