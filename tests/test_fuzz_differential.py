"""Differential hostile-input fuzzing: the Rust manager against the reference, call by call.

`tests/test_fuzz_api.py` checks that the Rust manager alone survives hostile calls; this file
checks that it answers them exactly as the pure-Python reference does. Two identical worlds are
built (capacity 6, every chunk state present: ready, pinned by an unfinished request, pending,
tracker counts, finished and unfinished requests, one of them with a hand-written context), one
over `kvoffload.CPUOffloadingManager` and one over `kvoffload.reference.CPUOffloadingManager`.
Hypothesis draws ONE call as a *recipe* (plain tuples), and each world builds its own objects
from it, so iterators, contexts and other stateful arguments are never shared between the two.
The call is made on both, then:

- both raised, or both returned; raised: the same class (exactly; a callback's own exception,
  one class per kind of callback, must come through as itself); messages may differ;
- returned: equivalent results (`PrepareStoreOutput`'s keys and chunk ids, a spec's chunk ids,
  lookups, plain values);
- the same `resident`, `policy_state`, `pool_state`, `tracker_state`, events and stats, and the
  invariants hold on both.

A few legal follow-up calls (store, finish, load) on the call's context and on the world's
contexts are then compared the same way: a difference in request state kept on a context (which
no introspection shows) surfaces there.

Hostile inputs: keys of every wrong type, of odd lengths, exact bytes, copies, plain bytes
subclasses, duplicates, empty lists, tuples, generators that raise part way, list and tuple
subclasses (plain, or whose ``__iter__`` yields another sequence), token positions of every
kind (None, int64 edges, beyond them, floats, strings, bools, int subclasses, ``__index__``
objects), contexts that lack a method, whose position lookup, ``get_state`` or ``set_state``
raises, or whose ``get_state`` returns junk, odd ``success`` values, and calls on finished
requests.

Deliberately NOT generated (known, accepted differences):

1. callbacks that re-enter the manager (from ``get_offload_key_position``, ``set_state``,
   ``__hash__`` or ``__eq__``) and ``KeyboardInterrupt``: the reference is not re-entrancy
   safe (the Rust manager alone is fuzzed with them in `tests/test_fuzz_api.py`);
2. bytes subclasses that override ``__hash__``/``__eq__``: the Rust manager compares keys by
   their bytes, the reference through Python's hash and equality. Plain bytes subclasses are
   generated.

The differences that stay, each for its reason, are listed in `KNOWN`, each with a minimal
reproducer (`test_known_difference`, a strict xfail: should one go away it fails, and the entry
must go). `known_difference` recognises them in a fuzzed call, counts them and goes on (an
example whose worlds they made diverge stops there); any other disagreement fails. With
``KVOFFLOAD_DIFF_STRICT=1`` they fail too.

`KVOFFLOAD_DIFF_FUZZ_EXAMPLES` sets the number of inputs (default 5,000, about 20 s here).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

import kvoffload
import kvoffload.reference
from _helpers import FUZZ_CALLS, FUZZ_KEYS, fuzz_world
from kvoffload import KVOffloadError, ReqContext, make_offload_key
from kvoffload.errors import (
    DuplicateKeyError,
    InvalidArgumentError,
    InvalidKeyError,
    KeyStateError,
    RequestFinishedError,
)
from kvoffload.types import CPULoadStoreSpec, PrepareStoreOutput

EXAMPLES = int(os.environ.get("KVOFFLOAD_DIFF_FUZZ_EXAMPLES", "5000"))
KEYS = FUZZ_KEYS
IMPLS: dict[str, Callable[..., Any]] = {
    "rust": kvoffload.CPUOffloadingManager,
    "reference": kvoffload.reference.CPUOffloadingManager,
}

Recipe = tuple[Any, ...]


# --- hostile objects ---------------------------------------------------------------------------


class Injected(Exception):
    """Raised by a hostile callback; each kind of callback raises its own subclass."""


class InjectedIter(Injected):
    """From a keys iterator."""


class InjectedPosition(Injected):
    """From a context's `get_offload_key_position`."""


class InjectedGetState(Injected):
    """From a context's `get_state`."""


class InjectedSetState(Injected):
    """From a context's `set_state`."""


class InjectedIndex(Injected):
    """From a position's `__index__`."""


class InjectedBool(Injected):
    """From a `success` value's `__bool__`."""


class PlainBytes(bytes):
    """A bytes subclass that overrides nothing (hash and equality are bytes')."""


class IntSub(int):
    """An int subclass (a position)."""


class Indexable:
    """Not an int, but has `__index__` (a position)."""

    def __init__(self, value: int) -> None:
        self.value = value

    def __index__(self) -> int:
        return self.value


class IndexRaises:
    """A position whose `__index__` raises."""

    def __index__(self) -> int:
        raise InjectedIndex("hostile __index__")


class BoolRaises:
    """A `success` value whose truth value raises."""

    def __bool__(self) -> bool:
        raise InjectedBool("hostile __bool__")


class RaisePosition:
    """A position marker: an `EvilContext` raises for the key; a plain context returns it."""


class ListIter(list[Any]):
    """A list subclass whose `__iter__` yields `alt` instead of its items (when set)."""

    alt: list[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.alt) if self.alt is not None else super().__iter__()


class TupleIter(tuple[Any, ...]):
    """A tuple subclass whose `__iter__` yields `alt` instead of its items (when set)."""

    alt: list[Any] | None = None

    def __iter__(self) -> Iterator[Any]:
        return iter(self.alt) if self.alt is not None else super().__iter__()


class SubContext(ReqContext):
    """A `ReqContext` subclass: not read through its dicts by the Rust manager, but by calls."""


class EvilContext:
    """A hand-written context; its callbacks behave until the recipe of a call arms them."""

    def __init__(self) -> None:
        self.state: dict[type, Any] = {}
        self.positions: dict[bytes, Any] = {}
        self.default: Any = None
        self.get_state_mode = "ok"
        self.set_state_raises = False

    def get_state(self, cls: type) -> Any:
        mode = self.get_state_mode
        if mode == "ok":
            return self.state.get(cls)
        if mode == "raise":
            raise InjectedGetState("hostile get_state")
        return {"int": 7, "str": "state", "object": object(), "none": None}[mode]

    def set_state(self, val: Any) -> None:
        if self.set_state_raises:
            raise InjectedSetState("hostile set_state")
        self.state[type(val)] = val

    def get_offload_key_position(self, key: bytes) -> Any:
        position = self.positions.get(key, self.default)
        if isinstance(position, RaisePosition):
            raise InjectedPosition("hostile get_offload_key_position")
        return position


def lacking(missing: str) -> Any:
    """A context with vLLM's three methods, except ``missing`` (absent, or not callable)."""
    attrs: dict[str, Any] = {
        "get_state": lambda self, cls: None,
        "set_state": lambda self, val: None,
        "get_offload_key_position": lambda self, key: None,
    }
    name, how = missing.split(":")
    if how == "absent":
        del attrs[name]
    else:
        attrs[name] = 5
    return type("Lacking", (), attrs)()


# --- the worlds --------------------------------------------------------------------------------


@dataclass
class World:
    """One manager and the contexts its set-up used."""

    m: Any
    contexts: dict[str, Any]


def build_world(impl: str, policy: str, threshold: int) -> World:
    """Capacity 6, every chunk state present (see `fuzz_world`); e (an `EvilContext`, behaving)
    then loaded and released KEYS[0], unfinished."""
    m = IMPLS[impl](6, cache_policy=policy, enable_events=True, store_threshold=threshold)
    contexts: dict[str, Any] = dict(fuzz_world(m, threshold))
    e = EvilContext()
    for i, key in enumerate(KEYS):
        e.positions[key] = 8 * (i + 1)
    m.on_new_request(e)
    m.prepare_load(KEYS[0:1], e)
    m.complete_load(KEYS[0:1], e)
    contexts["e"] = e
    return World(m, contexts)


# --- recipes and what each world builds from them ----------------------------------------------

INT64_EDGES = [2**63 - 1, -(2**63 - 1), -(2**63), 2**63, -(2**63) - 1, 2**64, 2**70, -(2**70)]

junk_recipe = st.one_of(
    st.tuples(st.just("none")),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("int"), st.one_of(st.integers(-3, 99), st.sampled_from(INT64_EDGES))),
    st.tuples(st.just("float"), st.floats(allow_nan=True)),
    st.tuples(st.just("str"), st.text(max_size=3)),
    st.tuples(st.just("bytearray"), st.binary(max_size=8)),
    st.tuples(st.just("memoryview"), st.binary(max_size=8)),
    st.tuples(st.just("object")),
)


def build_junk(recipe: Recipe) -> Any:
    kind, *rest = recipe
    if kind == "none":
        return None
    if kind == "bytearray":
        return bytearray(rest[0])
    if kind == "memoryview":
        return memoryview(bytes(rest[0]))
    if kind == "object":
        return object()
    return rest[0]  # bool, int, float, str: immutable


known = st.integers(0, len(KEYS) - 1)
# Keys a context's positions dict may hold (hashable, bytes-like).
position_key_recipe = st.one_of(
    st.tuples(st.just("known"), known),
    st.tuples(st.just("copy"), known),
    st.tuples(st.just("sub"), known),
    st.tuples(st.just("bytes"), st.binary(max_size=40)),
)
key_recipe = st.one_of(
    st.tuples(st.just("known"), known),
    st.tuples(st.just("known"), known),
    st.tuples(st.just("copy"), known),
    st.tuples(st.just("sub"), known),
    st.tuples(st.just("bytes"), st.binary(max_size=40)),
    st.tuples(st.just("long"), st.sampled_from([0, 1, 39, 41, 1 << 12])),
    st.tuples(st.just("junk"), junk_recipe),
)


def build_key(recipe: Recipe) -> Any:
    kind, arg = recipe
    if kind == "known":
        return KEYS[arg]
    if kind == "copy":  # equal to a known key, another object
        return bytes(bytearray(KEYS[arg]))
    if kind == "sub":
        return PlainBytes(KEYS[arg])
    if kind == "bytes":
        return bytes(arg)
    if kind == "long":
        return bytes(arg)
    return build_junk(arg)


key_items = st.lists(key_recipe, max_size=8)
key_list_recipe = st.one_of(
    st.tuples(st.just("list"), key_items),
    st.tuples(st.just("list"), st.lists(st.tuples(st.just("known"), known), max_size=8)),
    st.tuples(st.just("tuple"), key_items),
    st.tuples(st.just("iter"), key_items, st.one_of(st.none(), st.integers(0, 8))),
    st.tuples(st.just("listsub"), key_items),
    st.tuples(st.just("tuplesub"), key_items),
    st.tuples(st.just("listsub-iter"), key_items, key_items),
    st.tuples(st.just("tuplesub-iter"), key_items, key_items),
    st.tuples(st.just("dict"), key_items),
    st.tuples(st.just("dup"), known, st.sampled_from([2, 3, 1000])),
    st.tuples(st.just("many"), st.sampled_from([0, 7, 1000])),
    st.tuples(st.just("single"), key_recipe),
)


def raising_iter(items: list[Any], at: int | None) -> Iterator[Any]:
    for i, item in enumerate(items):
        if i == at:
            raise InjectedIter("hostile iterator")
        yield item


def build_key_list(recipe: Recipe) -> Any:
    kind, *rest = recipe
    if kind == "dup":
        return [KEYS[rest[0]]] * rest[1]
    if kind == "many":
        return [make_offload_key(b"many-%d" % i, 0) for i in range(rest[0])]
    if kind == "single":
        return build_key(rest[0])
    items = [build_key(r) for r in rest[0]]
    if kind == "list":
        return items
    if kind == "tuple":
        return tuple(items)
    if kind == "iter":
        return raising_iter(items, rest[1])
    if kind == "listsub":
        return ListIter(items)
    if kind == "tuplesub":
        return TupleIter(items)
    if kind in ("listsub-iter", "tuplesub-iter"):
        seq = ListIter(items) if kind == "listsub-iter" else TupleIter(items)
        seq.alt = [build_key(r) for r in rest[1]]
        return seq
    assert kind == "dict"
    try:
        return dict.fromkeys(items)
    except TypeError:  # an unhashable junk key: a list instead
        return items


position_recipe = st.one_of(
    st.tuples(st.just("none")),
    st.tuples(st.just("int"), st.integers(-5, 200)),
    st.tuples(st.just("int"), st.sampled_from(INT64_EDGES)),
    st.tuples(st.just("float"), st.sampled_from([0.0, 1.5, -2.0, float("nan"), float("inf")])),
    st.tuples(st.just("str"), st.sampled_from(["", "7", "x"])),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("intsub"), st.one_of(st.integers(-5, 200), st.sampled_from(INT64_EDGES))),
    st.tuples(st.just("index"), st.one_of(st.integers(-5, 200), st.sampled_from(INT64_EDGES))),
    st.tuples(st.just("index-raises")),
    st.tuples(st.just("raise")),
    st.tuples(st.just("object")),
)


def build_position(recipe: Recipe) -> Any:
    kind, *rest = recipe
    if kind == "none":
        return None
    if kind == "intsub":
        return IntSub(rest[0])
    if kind == "index":
        return Indexable(rest[0])
    if kind == "index-raises":
        return IndexRaises()
    if kind == "raise":
        return RaisePosition()
    if kind == "object":
        return object()
    return rest[0]


positions_recipe = st.lists(st.tuples(position_key_recipe, position_recipe), max_size=4)
context_recipe = st.one_of(
    st.tuples(st.sampled_from(["r", "f", "base"]), positions_recipe),
    st.tuples(st.just("fresh"), positions_recipe),
    st.tuples(st.just("subclass"), positions_recipe),
    st.tuples(
        st.sampled_from(["e", "evil"]),
        positions_recipe,
        st.one_of(st.none(), position_recipe),  # the default position (None: keep)
        st.sampled_from(["ok", "ok", "ok", "int", "str", "object", "none", "raise"]),
        st.booleans(),  # set_state raises
    ),
    st.tuples(
        st.just("lacking"),
        st.sampled_from(
            [
                f"{name}:{how}"
                for name in ("get_state", "set_state", "get_offload_key_position")
                for how in ("absent", "number")
            ]
        ),
    ),
    st.tuples(st.just("junk"), junk_recipe),
)


def build_context(recipe: Recipe, world: World) -> Any:
    kind, *rest = recipe
    if kind == "lacking":
        return lacking(rest[0])
    if kind == "junk":
        return build_junk(rest[0])
    ctx: Any
    if kind in ("e", "evil"):
        ctx = world.contexts["e"] if kind == "e" else EvilContext()
        positions, default, get_state_mode, set_state_raises = rest
        for key, position in positions:
            ctx.positions[build_key(key)] = build_position(position)
        if default is not None:
            ctx.default = build_position(default)
        ctx.get_state_mode = get_state_mode
        ctx.set_state_raises = set_state_raises
        return ctx
    if kind == "fresh":
        ctx = ReqContext("fresh")
    elif kind == "subclass":
        ctx = SubContext("subclass")
    else:
        ctx = world.contexts[kind]
    for key, position in rest[0]:
        ctx.set_offload_key_position(build_key(key), build_position(position))
    return ctx


success_recipe = st.one_of(
    st.tuples(st.just("default")),
    st.tuples(st.just("bool"), st.booleans()),
    st.tuples(st.just("raises")),
    st.tuples(st.just("list"), st.integers(0, 2)),
    st.tuples(st.just("array"), st.integers(0, 2)),
    st.tuples(st.just("junk"), junk_recipe),
)


def build_success(recipe: Recipe) -> list[Any]:
    """The `success` argument as a list of zero (the default) or one argument."""
    kind, *rest = recipe
    if kind == "default":
        return []
    if kind == "bool":
        return [rest[0]]
    if kind == "raises":
        return [BoolRaises()]
    if kind == "list":
        return [[1] * rest[0]]
    if kind == "array":  # bool() of an array of 0 or 2 elements raises ValueError
        return [np.ones(rest[0])]
    return [build_junk(rest[0])]


CALLS = [*FUZZ_CALLS, "reset_cache"]


@st.composite
def call_recipe(draw: st.DrawFn) -> Recipe:
    call = draw(st.sampled_from(CALLS))
    if call == "reset_cache":
        return (call,)
    ctx = draw(context_recipe)
    if call in ("lookup", "get_load_source"):
        return (call, ctx, draw(key_recipe))
    if call in ("on_new_request", "on_request_finished"):
        return (call, ctx)
    if call == "complete_store":
        return (call, ctx, draw(key_list_recipe), draw(success_recipe))
    return (call, ctx, draw(key_list_recipe))


def build_call(recipe: Recipe, world: World) -> tuple[Any, tuple[Any, ...]]:
    """The call's context (None for reset_cache) and its arguments, built for ``world``."""
    call, *rest = recipe
    if call == "reset_cache":
        return None, ()
    ctx = build_context(rest[0], world)
    if call in ("lookup", "get_load_source"):
        return ctx, (build_key(rest[1]), ctx)
    if call in ("on_new_request", "on_request_finished"):
        return ctx, (ctx,)
    if call == "complete_store":
        return ctx, (build_key_list(rest[1]), ctx, *build_success(rest[2]))
    return ctx, (build_key_list(rest[1]), ctx)


# --- differences found ------------------------------------------------------------------------

#: Differences this fuzzing found and that stay, each for its reason: a reproducer of each is
#: below (`test_known_difference`, a strict xfail: should one go away, it fails, and the entry
#: must go), and `known_difference` recognises it in a fuzzed call so that the fuzzing goes on
#: past it. ``KVOFFLOAD_DIFF_STRICT=1`` fails on them instead. The fuzzing found six more,
#: since fixed: a failed prepare_load/prepare_store left request state on a context that had
#: none (Rust), a position of -(2**63) passed on_request_finished (Rust), an ``__index__`` that
#: raised became InvalidArgumentError (Rust), a ``success`` whose truth value raised was read
#: per key (the reference), and an empty str or bytearray of keys was taken for no keys (Rust).
KNOWN: dict[str, str] = {
    "lru-unrecorded-positions": "LRU prepare_store: the Rust manager reads and checks the "
    "position of every offered key, the reference (like vLLM) only of the keys it records "
    "(admitted or ready), so a bad or raising position on a pending key, or on one the store "
    "threshold drops, raises in Rust only. Kept: the binding reads all of a call's Python input "
    "before the core runs (no user code mid-change); which keys a call records is known only "
    "inside the core. Calls whose positions are all ints or None are unaffected",
    "lru-forgetful-context": "LRU with a context whose get_state does not give back what "
    "set_state stored (None, or junk): the Rust manager gives the keys one prepare_store "
    "inserts one request rank, the reference (like vLLM) draws a new rank for each key. Kept: "
    "such a context loses every request's state; the Rust manager holds one state per call",
    "first-error": "a call illegal in two ways raises for one of them, and the two managers "
    "check in different orders: the Rust manager reads all of the call's Python input (keys "
    "one by one as the iterator yields them, the context's methods, every position, the "
    "request state) before the core checks the keys' states, duplicates and -(2**63) "
    "positions; the reference lists the keys first, then checks states, then positions; at "
    "finish it reads positions group by group, the Rust manager in first-seen order. Either "
    "way the call raises and changes nothing",
}

STRICT = os.environ.get("KVOFFLOAD_DIFF_STRICT", "") not in ("", "0")


# --- comparing ---------------------------------------------------------------------------------

Outcome = tuple[str, Any]  # ("returned", normalized result) or ("raised", the exception)


def normalize(result: Any) -> Any:
    """A result as plain, comparable data (keys by value: object identity may differ)."""
    if isinstance(result, PrepareStoreOutput):
        spec = result.store_spec
        assert isinstance(spec, CPULoadStoreSpec)
        return (
            "PrepareStoreOutput",
            list(result.keys_to_store),
            list(result.evicted_keys),
            [int(x) for x in spec.block_ids],
            [int(x) for x in spec.chunk_ids],
        )
    if isinstance(result, CPULoadStoreSpec):
        return ("CPULoadStoreSpec", [int(x) for x in result.chunk_ids])
    return (type(result).__name__, result)


def outcome(method: Callable[..., Any], args: tuple[Any, ...]) -> Outcome:
    try:
        return "returned", normalize(method(*args))
    except (KVOffloadError, Injected, ValueError) as e:  # ValueError: bool() of a numpy array
        return "raised", e


def agree(a: Outcome, b: Outcome) -> bool:
    """Both returned equal results, or both raised the same class."""
    if a[0] != b[0]:
        return False
    return type(a[1]) is type(b[1]) if a[0] == "raised" else bool(a[1] == b[1])


def brief(o: Outcome) -> str:
    return "returned" if o[0] == "returned" else type(o[1]).__name__


def raised(o: Outcome, *classes: type[BaseException]) -> bool:
    return o[0] == "raised" and isinstance(o[1], classes)


def known_difference(policy: str, call: str, rust: Outcome, ref: Outcome) -> str | None:
    """The entry of `KNOWN` that explains a disagreement, or None."""
    rust_msg = str(rust[1]) if rust[0] == "raised" else ""
    bad_position = raised(rust, InjectedPosition, InjectedIndex) or (
        raised(rust, InvalidArgumentError) and "token position" in rust_msg
    )
    ref_msg = str(ref[1]) if ref[0] == "raised" else ""
    if (
        policy == "lru"
        and call == "prepare_store"
        and bad_position
        # the reference returned, raised from a callback, or refused a recorded key's position
        # that Rust reached after an unrecorded key's
        and (
            ref[0] == "returned"
            or raised(ref, Injected)
            or (raised(ref, InvalidArgumentError) and ref_msg.startswith("position of key"))
        )
    ):
        return "lru-unrecorded-positions"
    first_error = (
        # an iterator of keys: Rust stops at the first non-bytes key, the reference lists all
        (raised(rust, InvalidKeyError) and raised(ref, InjectedIter))
        # the context's methods before the keys' states
        or (
            rust_msg.startswith("req_context must be")
            and raised(ref, KeyStateError, DuplicateKeyError)
        )
        or (
            raised(rust, InjectedGetState, InjectedSetState)
            and raised(ref, KeyStateError, DuplicateKeyError)
        )
        # positions before the keys' states
        or (bad_position and raised(ref, RequestFinishedError, KeyStateError, DuplicateKeyError))
        # every position read before the core refuses -(2**63)
        or (
            raised(rust, InjectedSetState, InjectedPosition, InjectedIndex)
            and ref_msg.endswith(f"out of range: {-(2**63)}")
        )
        # at finish: first-seen order against group by group
        or (
            call == "on_request_finished"
            and bad_position
            and raised(ref, InvalidArgumentError, InjectedPosition, InjectedIndex)
        )
    )
    return "first-error" if first_error else None


def observe(m: Any) -> tuple[Any, ...]:
    """Everything introspection shows; draining events and stats."""
    events = [(e.removed, e.metadata_only, list(e.keys)) for e in m.take_events()]
    return (
        m.resident(),
        m.policy_state(),
        m.pool_state(),
        m.tracker_state(),
        events,
        m.get_stats().data,
    )


STATS: Counter[str] = Counter()
SECONDS = [0.0]


def forgetful(ctx: Any) -> bool:
    """Whether ``ctx`` is a context whose get_state answers without what set_state stored."""
    return isinstance(ctx, EvilContext) and ctx.get_state_mode not in ("ok", "raise")


def compare(
    label: str,
    worlds: dict[str, World],
    policy: str,
    call: str,
    args: dict[str, Any],
    ctx: Any,
) -> bool:
    """Make the call on both worlds and assert they agree; False when a `KNOWN` difference
    made them diverge (they differ from here on). ``ctx``: the call's context in the Rust
    world."""
    got = {impl: outcome(getattr(w.m, call), args[impl]) for impl, w in worlds.items()}
    rust, ref = got["rust"], got["reference"]
    if label == "call":
        STATS[f"{call}: {'ok' if rust[0] == 'returned' else type(rust[1]).__name__}"] += 1
    if not agree(rust, ref):
        known = known_difference(policy, call, rust, ref)
        assert known is not None, (label, policy, call, got)
        assert not STRICT, (label, policy, call, known, got)
        STATS[f"KNOWN {known}: {brief(rust)} vs {brief(ref)}"] += 1
        if rust[0] != ref[0]:
            for w in worlds.values():
                w.m.check_invariants()
            return False
    views = {impl: observe(w.m) for impl, w in worlds.items()}
    names = ("resident", "policy_state", "pool_state", "tracker_state", "events", "stats")
    for name, a, b in zip(names, views["rust"], views["reference"], strict=True):
        if a != b and name == "policy_state" and policy == "lru" and forgetful(ctx):
            assert not STRICT, (label, policy, call, name, got, a, b)
            STATS["KNOWN lru-forgetful-context: policy_state"] += 1
            return False
        assert a == b, (label, policy, call, name, got, a, b)
    for w in worlds.values():
        w.m.check_invariants()
    return True


#: Legal calls made after the fuzzed one, on its context and on the world's: request state a call
#: left on a context (which no introspection shows) shows in their answers.
FOLLOW_UPS: list[tuple[str, Callable[[Any], tuple[Any, ...]]]] = [
    ("prepare_store", lambda ctx: ([KEYS[5], KEYS[7]], ctx)),
    ("prepare_load", lambda ctx: ([KEYS[0]], ctx)),
    ("on_request_finished", lambda ctx: (ctx,)),
    ("prepare_store", lambda ctx: ([KEYS[2], KEYS[6]], ctx)),
]


def follow_ups(
    worlds: dict[str, World],
    policy: str,
    call: str,
    call_ctxs: dict[str, Any],
) -> None:
    """Make the `FOLLOW_UPS` on the call's context, then on r, e and base; compare each."""
    names = ("r", "e", "base")
    contexts = [
        *([] if call == "reset_cache" else [call_ctxs]),
        *({impl: w.contexts[name] for impl, w in worlds.items()} for name in names),
    ]
    for i, ctxs in enumerate(contexts):
        for step, make in FOLLOW_UPS:
            step_args = {impl: make(ctx) for impl, ctx in ctxs.items()}
            label = f"follow-up {i}"
            if not compare(label, worlds, policy, step, step_args, ctxs["rust"]):
                return


@settings(
    max_examples=EXAMPLES,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    # LRU reads token positions on every recording call (the others only at finish).
    policy=st.sampled_from(
        ["lru", "lru", "lru", "arc", "lfu", "s3fifo", "fifo", "sieve", "2q", "slru", "arc-paper"]
    ),
    threshold=st.sampled_from([1, 2]),
    recipe=call_recipe(),
    follow_up=st.booleans(),
)
# Found by a 25,000-input run (thirty-fifth session): a pending key's raising __index__ (Rust
# reads it) before a recorded key's non-int position (the reference's first error).
@example(
    policy="lru",
    threshold=1,
    recipe=(
        "prepare_store",
        ("fresh", [(("known", 0), ("raise",)), (("known", 6), ("index-raises",))]),
        ("list", [("known", 6), ("known", 0)]),
    ),
    follow_up=False,
)
def test_rust_and_reference_answer_hostile_calls_alike(
    policy: str, threshold: int, recipe: Recipe, follow_up: bool
) -> None:
    started = time.perf_counter()
    worlds = {impl: build_world(impl, policy, threshold) for impl in IMPLS}
    assert observe(worlds["rust"].m) == observe(worlds["reference"].m)  # drains the set-up
    call = recipe[0]
    built = {impl: build_call(recipe, w) for impl, w in worlds.items()}
    STATS["inputs"] += 1
    args = {impl: b[1] for impl, b in built.items()}
    alike = compare("call", worlds, policy, call, args, built["rust"][0])
    if alike and follow_up:
        follow_ups(worlds, policy, call, {impl: b[0] for impl, b in built.items()})
    SECONDS[0] += time.perf_counter() - started


def _finish_int64_min(m: Any) -> Any:
    ctx = ReqContext("x")
    m.prepare_store(KEYS[:1], ctx)
    bad: Any = -(2**63)
    ctx.set_offload_key_position(KEYS[0], bad)
    return m.on_request_finished(ctx)


def _lru_unrecorded_positions(m: Any) -> Any:
    ctx = ReqContext("x")
    m.prepare_store(KEYS[:1], ctx)  # pending: a second offer skips it, recording nothing
    bad: Any = "7"
    ctx.set_offload_key_position(KEYS[0], bad)
    return m.prepare_store(KEYS[:1], ctx)


def _index_error(m: Any) -> Any:
    ctx = ReqContext("x")
    bad: Any = IndexRaises()
    ctx.set_offload_key_position(KEYS[0], bad)
    return m.prepare_store(KEYS[:1], ctx)


def _eager_success(m: Any) -> Any:
    return m.complete_store([], ReqContext("x"), BoolRaises())


def _order_context_first(m: Any) -> Any:
    return m.prepare_load(KEYS[:1], None)  # absent key, and no context


def _state_before_key_checks(m: Any) -> Any:
    ctx = ReqContext("x")
    with pytest.raises(KeyStateError):
        m.prepare_load(KEYS[:1], ctx)  # an absent key: both raise; the Rust one leaves state
    m.on_request_finished(ctx)
    return m.prepare_store(KEYS[1:2], ctx)


def _order_position_first(m: Any) -> Any:
    ctx = ReqContext("x")
    bad: Any = "7"
    ctx.set_offload_key_position(KEYS[0], bad)
    return m.prepare_load(KEYS[:1], ctx)  # an absent key, and a bad position


def _lru_forgetful_context(m: Any) -> Any:
    ctx = EvilContext()
    ctx.get_state_mode = "none"
    ctx.positions = {KEYS[0]: 1, KEYS[1]: 2}
    m.prepare_store(KEYS[:2], ctx)
    return m.policy_state()


def _order_iter_vs_type(m: Any) -> Any:
    return m.lookup_prefix(raising_iter([None, KEYS[0]], 1), ReqContext("x"))


def _int64_min_late(m: Any) -> Any:
    ctx = ReqContext("x")
    bad: Any = -(2**63)
    ctx.set_offload_key_position(KEYS[0], bad)
    with pytest.raises(InvalidArgumentError):
        m.prepare_store(KEYS[:1], ctx)  # both raise; the Rust one leaves request state
    m.on_request_finished(ctx)
    return m.prepare_store(KEYS[1:2], ctx)


def _empty_str_keys(m: Any) -> Any:
    return m.touch("", ReqContext("x"))


def _finish_position_order(m: Any) -> Any:
    ctx = EvilContext()
    m.prepare_store(KEYS[1:2], ctx)  # group 1, seen first
    m.prepare_store(KEYS[0:1], ctx)  # group 0
    ctx.positions = {KEYS[1]: "x", KEYS[0]: RaisePosition()}
    return m.on_request_finished(ctx)


REPRODUCERS: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "lru-unrecorded-positions": ("lru", _lru_unrecorded_positions),
    "lru-forgetful-context": ("lru", _lru_forgetful_context),
    "first-error, position": ("lru", _order_position_first),
    "first-error, iterator": ("lru", _order_iter_vs_type),
    "first-error, finish": ("sieve", _finish_position_order),
    "first-error, context": ("lru", _order_context_first),
}

#: The differences this fuzzing found that are fixed: each reproducer now agrees.
FIXED: dict[str, tuple[str, Callable[[Any], Any]]] = {
    "finish-int64-min": ("arc", _finish_int64_min),
    "state-before-key-checks": ("arc", _state_before_key_checks),
    "int64-min-late": ("lru", _int64_min_late),
    "index-error": ("lru", _index_error),
    "eager-success": ("lru", _eager_success),
    "empty-str-keys": ("lru", _empty_str_keys),
}


def _outcomes(policy: str, scenario: Callable[[Any], Any]) -> dict[str, Outcome]:
    return {impl: outcome(scenario, (cls(4, cache_policy=policy),)) for impl, cls in IMPLS.items()}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(
            name,
            marks=pytest.mark.xfail(
                strict=True, raises=AssertionError, reason="a KNOWN difference (see there)"
            ),
        )
        for name in REPRODUCERS
    ],
)
def test_known_difference(name: str) -> None:
    """The smallest call sequences that show each `KNOWN` difference."""
    got = _outcomes(*REPRODUCERS[name])
    assert agree(got["rust"], got["reference"]), got


@pytest.mark.parametrize("name", list(FIXED))
def test_fixed_difference(name: str) -> None:
    """The smallest call sequence that showed each fixed difference: both now answer alike."""
    got = _outcomes(*FIXED[name])
    assert agree(got["rust"], got["reference"]), got


def test_diff_fuzz_reached_every_call() -> None:
    """The differential fuzz made every call both succeed and (but `reset_cache`, which takes no
    input) be refused: a strategy that stopped reaching one outcome would pass silently. Also
    prints how many inputs ran, what they did and how long they took."""
    print(f"\ndiff fuzz: {SECONDS[0]:.1f} s; {sorted(STATS.items())}")
    if STATS["inputs"] < 1000:
        pytest.skip(f"the differential fuzz ran {STATS['inputs']} inputs here (< 1,000)")
    outcomes: dict[str, set[str]] = {call: set() for call in CALLS}
    for name in STATS:
        call, _, outcome = name.partition(": ")
        if call in outcomes:
            outcomes[call].add(outcome)
    unreached = [call for call, seen in outcomes.items() if "ok" not in seen]
    unrefused = [c for c, seen in outcomes.items() if c != "reset_cache" and seen <= {"ok"}]
    assert (unreached, unrefused) == ([], []), sorted(STATS.items())
