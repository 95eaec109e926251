"""Hostile-input fuzzing of the Rust manager's public API (hypothesis).

A manager with every chunk state present (ready, pinned by an unfinished request, pending, an ARC
ghost, tracker counts) gets one call with hostile arguments: wrong types, huge lists, bytes
subclasses, keys of any length, duplicates, negative and overflowing integers, iterators that
raise, and contexts and bytes subclasses whose `get_offload_key_position`, `set_state`,
`__hash__` or `__eq__` re-enter the manager or raise `KeyboardInterrupt`. A call that raises must
raise a `kvoffload.KVOffloadError` subclass or the exception the callback itself raised, and must
change nothing the introspection shows (`resident`, `policy_state`, `pool_state`, `tracker_state`,
events, stats). A call that succeeds was legal: the invariants must hold. Either way the process
must not crash or hang.

`KVOFFLOAD_FUZZ_EXAMPLES` sets the number of inputs (default 2,500, about 30 s here).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvoffload
from _helpers import FUZZ_CALLS, FUZZ_KEYS, fuzz_world
from kvoffload import KVOffloadError, ReqContext, make_offload_key

EXAMPLES = int(os.environ.get("KVOFFLOAD_FUZZ_EXAMPLES", "2500"))
KEYS: Sequence[bytes] = FUZZ_KEYS


class Injected(Exception):
    """The error a hostile callback raises (besides KeyboardInterrupt)."""


class Hostile:
    """What a callback does when called: nothing, raise, or re-enter the manager."""

    def __init__(self, action: str) -> None:
        self.action = action
        self.armed = False
        self.m: Any = None
        self.calls = 0

    def __call__(self) -> None:
        if not self.armed:
            return
        self.calls += 1
        a, m = self.action, self.m
        if a == "interrupt":
            raise KeyboardInterrupt
        if a == "raise":
            raise Injected("hostile callback")
        if a == "read":
            m.lookup(KEYS[0], None)
            m.lookup_prefix(KEYS, None)
            m.check_invariants()
            m.resident()
        elif a == "write":
            self.armed = False  # once, not recursively
            ctx = ReqContext("reentrant")
            out = m.prepare_store([make_offload_key(b"re-%d" % self.calls, 0)], ctx)
            if out is not None:
                m.complete_store(out.keys_to_store, ctx)
            m.on_request_finished(ctx)
            self.armed = True


class EvilKey(bytes):
    """A bytes subclass whose hash and equality run a hostile callback."""

    hostile: Hostile

    def __hash__(self) -> int:
        self.hostile()
        return bytes.__hash__(self)

    def __eq__(self, other: object) -> bool:
        self.hostile()
        return bytes.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        return not self == other


class EvilContext:
    """A vLLM-style context whose `set_state` and position lookup run a hostile callback."""

    def __init__(self, hostile: Hostile, position: Any) -> None:
        self.hostile, self.position = hostile, position
        self.state: dict[type, Any] = {}

    def get_state(self, cls: type) -> Any:
        return self.state.get(cls)

    def set_state(self, val: Any) -> None:
        self.hostile()
        self.state[type(val)] = val

    def get_offload_key_position(self, key: bytes) -> Any:
        self.hostile()
        return self.position


def build_world(policy: str, threshold: int, hostile: Hostile) -> tuple[Any, dict[str, Any]]:
    """Capacity 6, every chunk state present (see `fuzz_world`)."""
    m = kvoffload.CPUOffloadingManager(
        6, cache_policy=policy, enable_events=True, store_threshold=threshold
    )
    hostile.m = m
    return m, fuzz_world(m, threshold)


def snapshot(m: Any) -> tuple[Any, ...]:
    """Everything introspection shows; events and stats are drained (and must be empty)."""
    events = [(list(e.keys), e.removed) for e in m.take_events()]
    stats = m._core.take_stats()
    return (
        m.resident(),
        m.policy_state(),
        m.pool_state(),
        m.tracker_state(),
        events,
        stats[3:],
    )


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([2**31 - 1, 2**31, 2**32, 2**63 - 1, 2**63, -(2**63), 2**64, -1]),
    st.floats(allow_nan=True),
    st.text(max_size=3),
    st.builds(bytearray, st.binary(max_size=8)),
    st.builds(memoryview, st.binary(max_size=8)),  # type: ignore[arg-type]
    st.just(object()),
)


@st.composite
def a_key(draw: st.DrawFn, hostile: Hostile) -> Any:
    kind = draw(st.sampled_from(["known", "known", "bytes", "long", "evil", "evil", "junk"]))
    if kind == "known":
        return draw(st.sampled_from(KEYS))
    if kind == "bytes":
        return draw(st.binary(max_size=64))
    if kind == "long":
        return bytes(draw(st.sampled_from([1 << 10, 1 << 16, 1 << 20])))
    if kind == "evil":
        key = EvilKey(draw(st.sampled_from([*KEYS, b"", b"\x00" * 40])))
        key.hostile = hostile
        return key
    return draw(junk)


def raising_iter(items: list[Any], hostile: Hostile) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i == len(items) // 2:
            hostile()
        yield item


@st.composite
def a_key_list(draw: st.DrawFn, hostile: Hostile) -> Any:
    items = draw(st.lists(a_key(hostile), max_size=8))
    shape = draw(
        st.sampled_from(["list", "list", "tuple", "iter", "huge", "many", "single", "junk"])
    )
    if shape == "tuple":
        return tuple(items)
    if shape == "iter":
        return raising_iter(items, hostile)
    if shape == "huge":  # one key repeated: duplicates, and a long walk
        return [draw(st.sampled_from(KEYS))] * draw(st.sampled_from([1000, 100_000]))
    if shape == "many":  # distinct keys, far more than the cache holds
        return [make_offload_key(b"%d" % i, 0) for i in range(draw(st.sampled_from([7, 5000])))]
    if shape == "single":
        return draw(st.sampled_from(KEYS))
    if shape == "junk":
        return draw(junk)
    return items


@st.composite
def a_context(draw: st.DrawFn, hostile: Hostile, contexts: dict[str, Any]) -> Any:
    kind = draw(st.sampled_from(["r", "f", "base", "fresh", "evil", "evil", "junk"]))
    position = draw(st.one_of(junk, st.integers(-(2**65), 2**65)))
    if kind == "fresh":
        ctx = ReqContext("fresh")
        for key in draw(st.lists(st.sampled_from(KEYS), max_size=4)):
            ctx.set_offload_key_position(key, position)
        return ctx
    if kind == "evil":
        return EvilContext(hostile, position)
    if kind == "junk":
        return draw(junk)
    ctx = contexts[kind]
    if draw(st.booleans()):  # a hostile position for some key, set on the existing context
        ctx.set_offload_key_position(draw(st.sampled_from(KEYS)), position)
    if draw(st.booleans()):  # an evil key in the positions dict: its hash runs on lookups
        evil = EvilKey(draw(st.sampled_from(KEYS)))
        evil.hostile = hostile
        ctx.set_offload_key_position(evil, 1)
    return ctx


CALLS = FUZZ_CALLS

STATS: Counter[str] = Counter()
SECONDS = [0.0]


def check_call(m: Any, hostile: Hostile, action: str, call: str, args: tuple[Any, ...]) -> None:
    """Make the call with the callback armed; check what it raised and that a raise changed
    nothing."""
    method: Callable[..., Any] = getattr(m, call)
    snapshot(m)  # drains the events and stats of the set-up
    before = snapshot(m)
    hostile.armed = True
    error: BaseException | None = None
    try:
        method(*args)
    except (KVOffloadError, KeyboardInterrupt, Injected) as e:
        error = e
    finally:
        hostile.armed = False
    m.check_invariants()
    STATS["inputs"] += 1
    if hostile.calls:
        STATS[f"callback {action}"] += 1
    if error is not None:
        STATS[type(error).__name__] += 1
        if not isinstance(error, KVOffloadError):
            # Only the callback's own exception may come through, and only if it ran.
            assert hostile.calls > 0, repr(error)
            assert isinstance(error, KeyboardInterrupt) == (action == "interrupt"), repr(error)
        if action != "write":  # a re-entrant legal write may have changed the state itself
            assert snapshot(m) == before, (call, args, error)


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    # LRU reads token positions on every call (the others only at finish): more callbacks run.
    policy=st.sampled_from(["lru", "lru", "lru", "arc", "sieve", "fifo", "s3fifo", "2q", "slru"]),
    threshold=st.sampled_from([1, 2]),
    action=st.sampled_from(["none", "interrupt", "raise", "read", "write"]),
    call=st.sampled_from(CALLS),
    data=st.data(),
)
def test_hostile_calls_raise_cleanly_and_change_nothing(
    policy: str, threshold: int, action: str, call: str, data: st.DataObject
) -> None:
    started = time.perf_counter()
    hostile = Hostile(action)
    m, contexts = build_world(policy, threshold, hostile)
    ctx = data.draw(a_context(hostile, contexts), "ctx")
    if call in ("lookup", "get_load_source"):
        args: tuple[Any, ...] = (data.draw(a_key(hostile), "key"), ctx)
    elif call in ("on_new_request", "on_request_finished"):
        args = (ctx,)
    elif call == "complete_store":
        args = (data.draw(a_key_list(hostile), "keys"), ctx, data.draw(junk, "success"))
    else:
        args = (data.draw(a_key_list(hostile), "keys"), ctx)
    check_call(m, hostile, action, call, args)
    SECONDS[0] += time.perf_counter() - started


@settings(
    max_examples=max(EXAMPLES // 5, 50),
    deadline=None,
    database=None,
    suppress_health_check=list(HealthCheck),
)
@given(
    threshold=st.sampled_from([1, 2]),
    action=st.sampled_from(["interrupt", "raise", "read", "write"]),
    call=st.sampled_from(
        ["prepare_load", "prepare_store", "on_new_request", "on_request_finished"]
    ),
    evil_context=st.booleans(),
    data=st.data(),
)
def test_callbacks_reenter_or_interrupt(
    threshold: int, action: str, call: str, evil_context: bool, data: st.DataObject
) -> None:
    """Valid keys (some of them bytes subclasses) with a context whose callbacks always run
    (LRU reads positions on every call): every hostile callback gets exercised."""
    started = time.perf_counter()
    hostile = Hostile(action)
    m, contexts = build_world("lru", threshold, hostile)
    ctx: Any
    if evil_context:
        ctx = EvilContext(hostile, data.draw(st.one_of(st.none(), st.integers(0, 99)), "pos"))
    else:
        ctx = contexts[data.draw(st.sampled_from(["r", "base"]), "ctx")]
    keys = data.draw(st.lists(st.sampled_from(KEYS), max_size=6, unique=True), "keys")
    for i in data.draw(st.sets(st.integers(0, 5)), "evil"):
        if i < len(keys):
            evil = EvilKey(keys[i])
            evil.hostile = hostile
            keys[i] = evil
    if not evil_context:
        for key in keys:
            ctx.set_offload_key_position(key, 7)  # an evil key's hash runs on every lookup
    args: tuple[Any, ...] = (ctx,) if call.startswith("on_") else (keys, ctx)
    check_call(m, hostile, action, call, args)
    SECONDS[0] += time.perf_counter() - started


@settings(max_examples=max(EXAMPLES // 10, 50), deadline=None, database=None)
@given(
    num_chunks=st.one_of(st.integers(-5, 10), junk),
    policy=st.one_of(
        st.sampled_from(["lru", "arc", "sieve", "2q"]),
        st.sampled_from(["LRU", "", "nope", "sieve\x00"]),
        junk,
    ),
    events=junk,
    threshold=st.one_of(st.integers(-3, 3), junk),
    tracker=st.one_of(st.integers(-3, 3), junk),
)
def test_hostile_constructor_arguments(
    num_chunks: Any, policy: Any, events: Any, threshold: Any, tracker: Any
) -> None:
    try:
        m = kvoffload.CPUOffloadingManager(
            num_chunks,
            cache_policy=policy,
            enable_events=events,
            store_threshold=threshold,
            max_tracker_size=tracker,
        )
    except KVOffloadError:
        STATS["constructor raised"] += 1
        return
    STATS["constructor ok"] += 1
    m.check_invariants()
    ctx = ReqContext("r")
    out = m.prepare_store(KEYS[:2], ctx)
    if out is not None:
        m.complete_store(out.keys_to_store, ctx)
    m.check_invariants()


@pytest.mark.parametrize("call", ["prepare_store", "prepare_load"])
def test_interrupt_in_set_state_changes_nothing(call: str) -> None:
    """A context whose `set_state` raises: before the fix, `prepare_store` raised after placing
    the keys, leaving pending chunks that no caller would ever complete."""
    hostile = Hostile("interrupt")
    m, _ = build_world("lru", 1, hostile)
    snapshot(m)
    before = snapshot(m)
    hostile.armed = True
    keys = [make_offload_key(b"new", 0)] if call == "prepare_store" else KEYS[:1]
    with pytest.raises(KeyboardInterrupt):
        getattr(m, call)(keys, EvilContext(hostile, None))
    assert snapshot(m) == before


def test_fuzz_reached_every_kind_of_input() -> None:
    """The fuzz tests above reached each callback action and each common refusal: a change to
    their strategies that stopped generating one would pass them silently. Also prints how many
    inputs ran and how long they took (for docs/reliability.md)."""
    print(f"\nfuzz: {SECONDS[0]:.1f} s in the calls and checks; {dict(STATS)}")
    if STATS["inputs"] < 1000:
        pytest.skip(f"the fuzz tests ran {STATS['inputs']} inputs in this process (< 1,000)")
    wanted = [f"callback {action}" for action in ("none", "read", "write", "raise", "interrupt")]
    wanted += ["Injected", "KeyboardInterrupt", "constructor raised"]
    wanted += ["InvalidKeyError", "KeyStateError", "InvalidArgumentError", "DuplicateKeyError"]
    assert [name for name in wanted if STATS[name] == 0] == [], dict(STATS)
