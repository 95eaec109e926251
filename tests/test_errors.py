"""Illegal calls: each raises its kvoffload exception and changes nothing.

"Changes nothing" is checked against a twin: two managers get the same history, only one makes
the illegal call, and then both must agree on every introspection view, the stats, the events,
and a probe sequence that exposes hidden request state (ghost reports, seen keys, reuse).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvoffload import (
    CPUOffloadingManager,
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidKeyError,
    KeyStateError,
    KVOffloadError,
    ReqContext,
    RequestFinishedError,
    UnsupportedPolicyError,
    make_offload_key,
)

MakeManager = Callable[..., Any]

CAPACITY = 5


def k(i: int, group: int = 0) -> bytes:
    return make_offload_key(str(i).encode(), group)


def ks(*ids: int) -> list[bytes]:
    return [k(i) for i in ids]


@dataclass
class World:
    """A manager with every chunk state present, and the request contexts that built it."""

    m: Any
    threshold: int
    base: ReqContext = field(default_factory=lambda: ReqContext(req_id=""))
    r: ReqContext = field(default_factory=lambda: ReqContext(req_id="r"))
    f: ReqContext = field(default_factory=lambda: ReqContext(req_id="f"))

    def offer(self, keys: list[bytes], ctx: ReqContext) -> Any:
        """Offer keys, twice when the tracker needs a second sighting."""
        if self.threshold >= 2:
            self.m.prepare_store(keys, ctx)
        return self.m.prepare_store(keys, ctx)


def build(make_manager: MakeManager, policy: str, threshold: int) -> World:
    """Capacity 5: 1 evicted (an ARC ghost), 2 4 5 ready, 3 pinned once by r, 6 pending.

    r (positions 16 * i, unfinished) loaded 2 and holds 3; f loaded 5 and finished. With the
    tracker on, 7 and 8 have been offered once.
    """
    m = make_manager(CAPACITY, cache_policy=policy, store_threshold=threshold, enable_events=True)
    w = World(m, threshold)
    for i in range(1, 30):
        w.r.set_offload_key_position(k(i), 16 * i)
    if threshold >= 2:  # one sighting each, so that 7 and 8 pass the threshold when offered
        assert m.prepare_store(ks(7, 8), w.base).keys_to_store == []
    out = w.offer(ks(1, 2, 3, 4, 5), w.base)
    m.complete_store(out.keys_to_store, w.base)
    assert w.offer(ks(6), w.base).evicted_keys == ks(1)
    m.on_new_request(w.r)
    m.prepare_load(ks(2), w.r)
    m.complete_load(ks(2), w.r)
    m.prepare_load(ks(3), w.r)
    m.touch(ks(4), w.base)
    m.on_new_request(w.f)
    m.prepare_load(ks(5), w.f)
    m.complete_load(ks(5), w.f)
    m.on_request_finished(w.f)
    assert {key: ref for key, (_, ref) in m.resident().items()} == {
        k(2): 0,
        k(3): 1,
        k(4): 0,
        k(5): 0,
        k(6): -1,
    }
    return w


def views(m: Any) -> tuple[Any, ...]:
    return (m.policy_state(), m.resident(), m.tracker_state(), m.pool_state())


def event_list(m: Any) -> list[tuple[bool, bool, list[bytes]]]:
    return [(e.removed, e.metadata_only, list(e.keys)) for e in m.take_events()]


def store_result(out: Any) -> Any:
    if out is None:
        return None
    return (out.keys_to_store, out.evicted_keys, [int(x) for x in out.store_spec.block_ids])


def assert_same(bad: World, good: World) -> None:
    """The world that made the illegal call matches its twin, now and under a probe."""
    bad.m.check_invariants()
    assert views(bad.m) == views(good.m)
    assert bad.m.get_stats().data == good.m.get_stats().data
    assert event_list(bad.m) == event_list(good.m)
    for w in (bad, good):
        with pytest.raises(RequestFinishedError):  # f is still finished, and never saw 4
            w.m.prepare_load(ks(4), w.f)
        w.m.complete_load(ks(3), w.r)  # finish the pinned load; r offers the ghost 1 and 7
    assert store_result(bad.offer(ks(1, 7), bad.r)) == store_result(good.offer(ks(1, 7), good.r))
    assert views(bad.m) == views(good.m)
    for w in (bad, good):
        w.m.complete_store(ks(1, 6, 7), w.base)
    assert views(bad.m) == views(good.m)
    for name in ("r", "base"):  # each finish exposes that request's seen and reused keys
        for w in (bad, good):
            w.m.on_request_finished(getattr(w, name))
        assert views(bad.m) == views(good.m)
    fresh = [k(100 + i) for i in range(CAPACITY)]  # evicts everything, in policy order
    out_bad = bad.offer(fresh, ReqContext(req_id="probe"))
    out_good = good.offer(fresh, ReqContext(req_id="probe"))
    assert store_result(out_bad) == store_result(out_good)
    assert views(bad.m) == views(good.m)
    assert bad.m.get_stats().data == good.m.get_stats().data
    assert event_list(bad.m) == event_list(good.m)
    bad.m.check_invariants()


@dataclass(frozen=True)
class Case:
    """An illegal call on a built world, its exception and the built-in that one derives from."""

    call: Callable[[World], Any]
    exc: type[KVOffloadError]
    builtin: type[Exception] | None
    policies: tuple[str, ...] = ("lru", "arc")  # ARC reads positions only when finishing


def _with_position(
    ctx_name: str, key: bytes, position: object, call: Callable[[World], Any]
) -> Callable[[World], Any]:
    """A call made while ``ctx``'s position for ``key`` is not an int (restored afterwards)."""

    def run(w: World) -> Any:
        ctx = getattr(w, ctx_name)
        good = ctx.get_offload_key_position(key)
        ctx.set_offload_key_position(key, position)
        try:
            return call(w)
        finally:
            ctx._offload_key_positions.pop(key, None)
            if good is not None:
                ctx.set_offload_key_position(key, good)

    return run


CASES: dict[str, Case] = {
    # prepare_load of an absent or pending key (the readable key before it is not pinned)
    "load-absent": Case(lambda w: w.m.prepare_load(ks(2, 1), w.r), KeyStateError, KeyError),
    "load-never-stored": Case(lambda w: w.m.prepare_load(ks(4, 99), w.r), KeyStateError, KeyError),
    "load-pending": Case(lambda w: w.m.prepare_load(ks(2, 6), w.r), KeyStateError, KeyError),
    # prepare_read of an absent or pending key
    "read-absent": Case(lambda w: w.m.prepare_read(ks(2, 1), w.r), KeyStateError, KeyError),
    "read-pending": Case(lambda w: w.m.prepare_read(ks(2, 6)), KeyStateError, KeyError),
    "read-str": Case(lambda w: w.m.prepare_read([k(2), "4"], w.r), InvalidKeyError, TypeError),
    # complete_load of a key that is not pinned
    "complete-load-ready": Case(
        lambda w: w.m.complete_load(ks(3, 2), w.r), KeyStateError, KeyError
    ),
    "complete-load-absent": Case(
        lambda w: w.m.complete_load(ks(3, 1), w.r), KeyStateError, KeyError
    ),
    "complete-load-pending": Case(
        lambda w: w.m.complete_load(ks(3, 6), w.r), KeyStateError, KeyError
    ),
    "complete-load-ref1-twice": Case(
        lambda w: w.m.complete_load(ks(3, 3), w.r), KeyStateError, KeyError
    ),
    # a key repeated within one prepare_store
    "store-dup-absent": Case(
        lambda w: w.m.prepare_store(ks(7, 8, 7), w.r), DuplicateKeyError, ValueError
    ),
    "store-dup-ready": Case(
        lambda w: w.m.prepare_store(ks(7, 2, 2), w.r), DuplicateKeyError, ValueError
    ),
    "store-dup-pending": Case(
        lambda w: w.m.prepare_store(ks(6, 6), w.r), DuplicateKeyError, ValueError
    ),
    "store-dup-ghost": Case(
        lambda w: w.m.prepare_store(ks(1, 1), w.r), DuplicateKeyError, ValueError
    ),
    # keys that are not bytes
    "lookup-str": Case(lambda w: w.m.lookup("2", w.r), InvalidKeyError, TypeError),
    "lookup-int": Case(lambda w: w.m.lookup(2, w.r), InvalidKeyError, TypeError),
    "lookup-prefix-str": Case(
        lambda w: w.m.lookup_prefix([k(2), "4"], w.r), InvalidKeyError, TypeError
    ),
    "load-source-int": Case(lambda w: w.m.get_load_source(2, w.r), InvalidKeyError, TypeError),
    "store-one-key-not-a-list": Case(
        lambda w: w.m.prepare_store(k(7), w.r), InvalidKeyError, TypeError
    ),
    "load-str": Case(lambda w: w.m.prepare_load([k(2), "4"], w.r), InvalidKeyError, TypeError),
    "complete-load-int": Case(
        lambda w: w.m.complete_load([k(3), 3], w.r), InvalidKeyError, TypeError
    ),
    "touch-str": Case(lambda w: w.m.touch([k(2), "5"], w.r), InvalidKeyError, TypeError),
    "touch-ghost-none": Case(lambda w: w.m.touch([k(1), None], w.r), InvalidKeyError, TypeError),
    "touch-empty-str": Case(lambda w: w.m.touch("", w.r), InvalidKeyError, TypeError),
    "load-empty-bytearray": Case(
        lambda w: w.m.prepare_load(bytearray(), w.r), InvalidKeyError, TypeError
    ),
    "store-bytearray": Case(
        lambda w: w.m.prepare_store([k(7), bytearray(k(8))], w.r), InvalidKeyError, TypeError
    ),
    "store-ghost-str": Case(
        lambda w: w.m.prepare_store([k(1), "x"], w.r), InvalidKeyError, TypeError
    ),
    "complete-store-none": Case(
        lambda w: w.m.complete_store([k(6), None], w.base), InvalidKeyError, TypeError
    ),
    "fail-store-int": Case(
        lambda w: w.m.complete_store([k(6), 6], w.base, success=False), InvalidKeyError, TypeError
    ),
    # new keys recorded after on_request_finished
    "finished-store-new": Case(
        lambda w: w.m.prepare_store(ks(5, 7), w.f), RequestFinishedError, None
    ),
    "finished-store-ghost": Case(
        lambda w: w.m.prepare_store(ks(1), w.f), RequestFinishedError, None
    ),
    "finished-store-unseen-ready": Case(
        lambda w: w.m.prepare_store(ks(5, 2), w.f), RequestFinishedError, None
    ),
    "finished-load-new": Case(
        lambda w: w.m.prepare_load(ks(5, 2), w.f), RequestFinishedError, None
    ),
    # positions that are not ints, where the call reads them
    "position-float-store": Case(
        _with_position("r", k(7), 1.5, lambda w: w.m.prepare_store(ks(7), w.r)),
        InvalidArgumentError,
        ValueError,
        policies=("lru",),
    ),
    "position-str-load": Case(
        _with_position("r", k(4), "64", lambda w: w.m.prepare_load(ks(4), w.r)),
        InvalidArgumentError,
        ValueError,
        policies=("lru",),
    ),
    "position-str-finish": Case(
        _with_position("r", k(2), "32", lambda w: w.m.on_request_finished(w.r)),
        InvalidArgumentError,
        ValueError,
    ),
    # ints outside [-(2**63 - 1), 2**63 - 1]
    "position-past-int64-store": Case(
        _with_position("r", k(7), 2**63, lambda w: w.m.prepare_store(ks(7), w.r)),
        InvalidArgumentError,
        ValueError,
        policies=("lru",),
    ),
    "position-int64-min-load": Case(
        _with_position("r", k(4), -(2**63), lambda w: w.m.prepare_load(ks(4), w.r)),
        InvalidArgumentError,
        ValueError,
        policies=("lru",),
    ),
    "position-int64-min-finish": Case(
        _with_position("r", k(3), -(2**63), lambda w: w.m.on_request_finished(w.r)),
        InvalidArgumentError,
        ValueError,
    ),
    "position-huge-finish": Case(
        _with_position("r", k(2), -(2**70), lambda w: w.m.on_request_finished(w.r)),
        InvalidArgumentError,
        ValueError,
    ),
}


@pytest.mark.parametrize("threshold", [1, 2])
@pytest.mark.parametrize(
    ("name", "policy"), [(name, policy) for name, case in CASES.items() for policy in case.policies]
)
def test_illegal_call_raises_and_changes_nothing(
    make_manager: MakeManager, name: str, policy: str, threshold: int
) -> None:
    case = CASES[name]
    bad = build(make_manager, policy, threshold)
    good = build(make_manager, policy, threshold)
    assert views(bad.m) == views(good.m)
    with pytest.raises(case.exc) as info:
        case.call(bad)
    assert isinstance(info.value, KVOffloadError)
    if case.builtin is not None:
        assert isinstance(info.value, case.builtin)
    assert str(info.value)  # a message, not a bare exception
    assert_same(bad, good)


@pytest.mark.parametrize("policy", ["arc", "lfu", "s3fifo"])
def test_positions_read_only_at_finish_without_lru(make_manager: MakeManager, policy: str) -> None:
    # As in vLLM, only LRU reads positions as keys are stored and loaded: with any other policy
    # a bad position passes those calls and is reported by on_request_finished, which changes
    # nothing; once mended, the request finishes.
    m = make_manager(4, cache_policy=policy)
    ctx = ReqContext(req_id="r")
    m.on_new_request(ctx)
    ctx.set_offload_key_position(k(1), 1.5)  # type: ignore[arg-type]
    ctx.set_offload_key_position(k(2), 2**63)
    out = m.prepare_store(ks(1, 2), ctx)
    assert out is not None
    assert out.keys_to_store == ks(1, 2)
    m.complete_store(ks(1, 2), ctx)
    m.prepare_load(ks(1, 2), ctx)
    m.complete_load(ks(1, 2), ctx)
    before = views(m)
    with pytest.raises(InvalidArgumentError):
        m.on_request_finished(ctx)
    assert views(m) == before
    ctx.set_offload_key_position(k(1), 16)
    ctx.set_offload_key_position(k(2), 2**63 - 1)
    m.on_request_finished(ctx)
    m.check_invariants()


class IndexRaises:
    """A position whose ``__index__`` raises."""

    def __index__(self) -> int:
        raise LookupError("no index")


class TruthRaises:
    """A ``success`` whose truth value raises."""

    def __bool__(self) -> bool:
        raise LookupError("no truth")


@pytest.mark.parametrize("threshold", [1, 2])
def test_callback_exceptions_propagate_and_change_nothing(
    make_manager: MakeManager, threshold: int
) -> None:
    # A position's __index__ and success's __bool__ are the caller's code: what they raise comes
    # through as itself (a TypeError or OverflowError from __index__ is an InvalidArgumentError).
    bad = build(make_manager, "lru", threshold)
    good = build(make_manager, "lru", threshold)
    with pytest.raises(LookupError, match="no index"):
        _with_position("r", k(7), IndexRaises(), lambda w: w.m.prepare_store(ks(7), w.r))(bad)
    with pytest.raises(LookupError, match="no truth"):  # read first, as vLLM does
        bad.m.complete_store(ks(6), bad.base, TruthRaises())
    with pytest.raises(LookupError, match="no truth"):  # even with no key to complete
        bad.m.complete_store([], bad.base, TruthRaises())
    assert_same(bad, good)


def test_illegal_call_leaves_the_request_without_state(make_manager: MakeManager) -> None:
    # A request whose first call was refused has no state: finishing it does nothing, and it
    # may go on recording.
    m = make_manager(4, cache_policy="arc")
    ctx = ReqContext(req_id="x")
    with pytest.raises(KeyStateError):
        m.prepare_load(ks(1), ctx)
    with pytest.raises(DuplicateKeyError):
        m.prepare_store(ks(2, 2), ctx)
    m.on_request_finished(ctx)
    assert m.prepare_store(ks(2), ctx).keys_to_store == ks(2)
    m.check_invariants()


class _HalfContext:
    """A context with vLLM's ``get_state`` only."""

    def get_state(self) -> None:
        return None


@pytest.mark.parametrize(
    ("context", "missing"),
    [
        (object(), "object lacks get_state, set_state, get_offload_key_position"),
        (_HalfContext(), "_HalfContext lacks set_state, get_offload_key_position"),
    ],
)
def test_a_context_without_vllms_methods_is_refused_naming_each_missing_one(
    make_manager: MakeManager, context: object, missing: str
) -> None:
    m = make_manager(4)
    with pytest.raises(InvalidArgumentError) as info:
        m.on_new_request(context)
    assert str(info.value) == (
        "req_context must be a ReqContext (or have get_state, set_state, "
        f"get_offload_key_position); {missing}"
    )
    m.check_invariants()


def test_extreme_positions_are_legal(make_manager: MakeManager) -> None:
    m = make_manager(4)
    ctx = ReqContext(req_id="r")
    ctx.set_offload_key_position(k(1), -(2**63) + 1)
    ctx.set_offload_key_position(k(2), 2**63 - 1)
    assert m.prepare_store(ks(1, 2), ctx).keys_to_store == ks(1, 2)
    m.complete_store(ks(1, 2), ctx)
    m.on_request_finished(ctx)
    m.check_invariants()


def test_legal_neighbours_of_illegal_calls(make_manager: MakeManager) -> None:
    """The calls next to the illegal ones above are legal and do what SPEC.md says."""
    w = build(make_manager, "lru", 1)
    m = w.m
    m.prepare_load(ks(3), w.r)  # ref 2: completing it twice in one call is fine
    m.complete_load(ks(3, 3), w.r)
    assert m.resident()[k(3)][1] == 0
    m.prepare_load(ks(2, 2), w.r)  # a key may be loaded twice in one call
    assert m.resident()[k(2)][1] == 2
    m.complete_load(ks(2, 2), w.r)
    m.prepare_load(ks(5), w.f)  # a finished request may load and offer keys it saw
    m.complete_load(ks(5), w.f)
    assert m.prepare_store(ks(5), w.f).keys_to_store == []
    m.touch(ks(2, 9), w.f)  # touching records nothing, so it is legal after finishing
    m.complete_store([k(6), k(6)], w.base)  # a repeated key in complete_store is ignored
    assert m.resident()[k(6)][1] == 0
    m.check_invariants()


# --- constructor and policy checks --------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_chunks": -1},
        {"num_chunks": 4, "store_threshold": -1},
        {"num_chunks": 4, "store_threshold": 2, "max_tracker_size": 0},
        {"num_chunks": 4, "store_threshold": 3, "max_tracker_size": -5},
        {"num_chunks": 4, "store_threshold": 0, "max_tracker_size": 2**63},
        {"num_chunks": 4, "store_threshold": 0, "max_tracker_size": -(2**70)},
        {"num_chunks": 4, "store_threshold": 2**63},
    ],
    ids=[
        "negative-chunks",
        "negative-threshold",
        "zero-tracker",
        "negative-tracker",
        "tracker-past-int64",
        "tracker-below-int64",
        "threshold-past-int64",
    ],
)
def test_invalid_constructor_arguments(make_manager: MakeManager, kwargs: dict[str, int]) -> None:
    args = dict(kwargs)  # the parameter dict is shared by both implementations' runs
    num_chunks = args.pop("num_chunks")
    with pytest.raises(InvalidArgumentError) as info:
        make_manager(num_chunks, **args)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVOffloadError)


@pytest.mark.parametrize(("threshold", "size"), [(0, 0), (1, 0), (1, -1), (2, 1)])
def test_tracker_size_only_checked_with_tracker(
    make_manager: MakeManager, threshold: int, size: int
) -> None:
    m = make_manager(0, store_threshold=threshold, max_tracker_size=size)
    m.check_invariants()


@pytest.mark.parametrize("size", [2**30 + 1, 2**36, 2**40, 2**62])
def test_tinylfu_sketch_too_wide(make_manager: MakeManager, size: int) -> None:
    # A sketch row of max_tracker_size counters: past 2**30 a clear error, never an attempt to
    # allocate (which once aborted the process) or an overflow.
    with pytest.raises(InvalidArgumentError, match="2\\*\\*30"):
        make_manager(4, store_threshold=2, max_tracker_size=size, admission="tinylfu")
    # The tracker keeps its table by use, so the same size is fine there; and with no
    # counting (threshold 1) the size is not read.
    make_manager(4, store_threshold=2, max_tracker_size=size).check_invariants()
    make_manager(4, max_tracker_size=size, admission="tinylfu").check_invariants()


def test_tinylfu_widest_sketch_builds_lazily() -> None:
    # The Rust sketch's table is anonymous memory: 4 GiB of counters cost only the pages that
    # counts land in. (The reference's is a bytearray, zeroed at once: not run here.)
    m = CPUOffloadingManager(4, store_threshold=2, max_tracker_size=2**30, admission="tinylfu")
    assert m.prepare_store([b"k"], ReqContext(req_id="r")) is not None


def test_unknown_policy(make_manager: MakeManager) -> None:
    with pytest.raises(UnsupportedPolicyError) as info:
        make_manager(4, cache_policy="mru")
    assert isinstance(info.value, InvalidArgumentError)
    assert isinstance(info.value, ValueError)
    assert isinstance(info.value, KVOffloadError)
    message = str(info.value)
    assert "lru" in message
    assert "arc" in message
    assert "sieve" in message


def test_exception_tree() -> None:
    expected = {
        InvalidKeyError: TypeError,
        KeyStateError: KeyError,
        DuplicateKeyError: ValueError,
        InvalidArgumentError: ValueError,
        UnsupportedPolicyError: ValueError,
        RequestFinishedError: KVOffloadError,
    }
    for cls, builtin in expected.items():
        assert issubclass(cls, KVOffloadError)
        assert issubclass(cls, builtin)
