"""Tests added by a mutation-testing audit: each one kills a mutant that the rest of the suite let
through (docs/reliability.md, "Mutation testing of the suite"). They run through the Python API.
"""

from __future__ import annotations

import contextlib
import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence
from typing import Any

import pytest

from _helpers import OldestFirst, k
from kvoffload import CPUOffloadingManager, LookupResult, ReqContext, _native
from kvoffload.errors import InvalidArgumentError, InvalidKeyError, KeyStateError
from kvoffload.manager import _ShadowedManager
from kvoffload.policies import ChunkStatus
from kvoffload.reference import CPUOffloadingManager as ReferenceManager
from kvoffload.reference.lru import LruPolicy
from kvoffload.reference.policy import RequestContext
from kvoffload.reference.sketch import FrequencySketch, sketch_hash
from kvoffload.shadow import SHADOW_HITS, SHADOW_LOOKUPS


class _BlockingTouchLru(LruPolicy):
    """LRU whose ``touch`` waits (the manager's lock held) until the test lets it go on."""

    inside = threading.Event()
    release = threading.Event()

    def touch(self, keys: Sequence[bytes], req_context: RequestContext) -> None:
        type(self).inside.set()
        type(self).release.wait(10)
        super().touch(keys, req_context)


@contextlib.contextmanager
def _as_plugin(cls: type) -> Iterator[dict[str, Any]]:
    """The manager arguments that load ``cls`` (under its name without leading underscores) as
    a plug-in policy by module path, while the block runs (the module exists only in
    ``sys.modules``)."""
    policy = cls.__name__.lstrip("_")
    name = f"kvoffload_mutation_gaps_{policy.lower()}"
    module = types.ModuleType(name)
    setattr(module, policy, cls)
    sys.modules[name] = module
    try:
        yield {"cache_policy": policy, "cache_policy_module_path": name}
    finally:
        del sys.modules[name]


@pytest.fixture
def blocking_policy_module() -> Iterator[str]:
    _BlockingTouchLru.inside.clear()
    _BlockingTouchLru.release.clear()
    with _as_plugin(_BlockingTouchLru) as kwargs:
        try:
            yield kwargs["cache_policy_module_path"]
        finally:
            _BlockingTouchLru.release.set()


def test_contended_lookup_prefix_counts_hits_only(blocking_policy_module: str) -> None:
    """``lookup_prefix`` answered while another thread holds the manager (its lock-free path)
    counts leading HITs, as the locked path does: a pending key ends the prefix.

    Kills the mutant that counts ``Probe::Pending`` as a hit in ``ChunkTable::lookup_prefix``
    (the uncontended path, the only one the rest of the suite exercises, was right).
    """
    m = CPUOffloadingManager(
        8, cache_policy="BlockingTouchLru", cache_policy_module_path=blocking_policy_module
    )
    ctx = ReqContext("r")
    a, b, c = k(1), k(2), k(3)
    out = m.prepare_store([a, b, c], ctx)
    assert out is not None
    assert list(out.keys_to_store) == [a, b, c]
    m.complete_store([a, c], ctx)  # b stays pending
    uncontended = m.lookup_prefix([a, b, c], ctx)
    assert uncontended == 1

    holder = threading.Thread(target=m.touch, args=([a], ctx))
    holder.start()
    try:
        assert _BlockingTouchLru.inside.wait(10), "the policy's touch was never called"
        # The holder now waits inside the manager's call, holding its lock.
        answers = [
            m.lookup_prefix([a, b, c], ctx),
            m.lookup_prefix([b], ctx),
            m.lookup_prefix([a, c, b], ctx),
        ]
    finally:
        _BlockingTouchLru.release.set()
        holder.join(10)
    assert not holder.is_alive()
    assert answers == [1, 0, 2]
    assert m.lookup_prefix([a, c, b], ctx) == 2


def test_contended_complete_load_is_all_or_nothing() -> None:
    """``complete_load`` while another thread holds the manager (a built-in policy's call of 128+
    keys runs detached from the interpreter, its lock held): the lock-free release gives way to
    the lock for a key it cannot release (absent, or longer than a slot holds inline), and the
    call stays all or nothing, as it is uncontended.

    Kills the mutants that keep the pins a failed lock-free release already dropped
    (``ChunkTable::release_counted``) and that take that release's ``Unsure`` for done (the
    binding's ``complete_load``).
    """
    m = CPUOffloadingManager(16)
    ctx = ReqContext("r")
    a, long_key, absent = k(1), b"L" * 64, k(2)
    out = m.prepare_store([a, long_key], ctx)
    assert out is not None
    m.complete_store([a, long_key], ctx)
    pins = 300
    for _ in range(pins):
        m.prepare_load([a, long_key], ctx)
    big = [k(i) for i in range(100, 400_100)]  # touched, never stored
    stop = threading.Event()

    def hold() -> None:
        while not stop.is_set():
            m.touch(big, None)

    holder = threading.Thread(target=hold)
    holder.start()
    rounds = waited = 0
    try:
        deadline = time.monotonic() + 5.0
        while rounds < pins and (waited < 5 or rounds < 50) and time.monotonic() < deadline:
            rounds += 1
            time.sleep(0.0005)  # lets the holder take the GIL, and from it the lock
            t0 = time.perf_counter()
            with pytest.raises(KeyStateError):
                m.complete_load([a, absent], None)
            # A call that waited for the holder's (milliseconds) found the lock taken.
            waited += time.perf_counter() - t0 > 1e-3
            m.complete_load([a, long_key], None)
    finally:
        stop.set()
        holder.join(30)
    assert not holder.is_alive()
    assert waited > 0, "no call found the manager's lock taken"
    # Each of the rounds dropped one pin of each key, no more: the rest are all there.
    for _ in range(pins - rounds):
        m.complete_load([a, long_key], None)
    for one in (a, long_key):
        with pytest.raises(KeyStateError):
            m.complete_load([one], None)


def test_lookup_of_a_long_key_asks_the_writer() -> None:
    """A key longer than a slot holds inline (40 bytes) is answered by the locked manager: the
    lock-free probe cannot compare it, and must not answer MISS for it.

    Kills the mutant that answers the probe's ``Unsure`` with MISS in the binding's single-key
    ``lookup`` (every other test's keys fit inline: vLLM's are 36 bytes).
    """
    m = CPUOffloadingManager(4)
    ctx = ReqContext("r")
    long_key, other = b"L" * 64, b"L" * 63 + b"M"
    out = m.prepare_store([long_key], ctx)
    assert out is not None
    assert m.lookup(long_key, ctx) is LookupResult.HIT_PENDING
    m.complete_store([long_key], ctx)
    assert m.lookup(long_key, ctx) is LookupResult.HIT
    assert m.lookup(other, ctx) is LookupResult.MISS


def test_shadow_counts_are_the_scheduler_s_lookups_and_hits() -> None:
    """Shadow counts are exact, not only equal between twins: a prefix lookup counts the single
    lookups a scheduler makes (its hits, and the miss that ends it), a live HIT_PENDING is no hit
    (a shadow's stores complete at once, so there it hits), and a stats report restarts the hits
    as well as the lookups.

    Kills three mutants of ``kvoffload/shadow.py`` that ``test_shadow.py`` let through, as its
    checks compare the live policy with its shadows, which count alike: a prefix that hits every
    key counted one lookup too many, a live HIT_PENDING counted as a hit, and ``add_stats``
    restarting the lookups only.
    """
    m = CPUOffloadingManager(8, cache_policy="lru", shadow_policies=["fifo"])
    assert isinstance(m, _ShadowedManager)
    ctx = ReqContext(req_id="r")
    a, b, c = k(1), k(2), k(3)
    out = m.prepare_store([a, b], ctx)
    assert out is not None
    m.complete_store([a, b], ctx)
    assert m.lookup_prefix([a, b], ctx) == 2  # 2 lookups, 2 hits
    assert m.lookup_prefix([a, c, b], ctx) == 1  # 2 lookups (a, then c), 1 hit
    live, shadow = m.shadow_report()
    assert (live.lookups, live.hits) == (shadow.lookups, shadow.hits) == (4, 3)
    m.prepare_store([c], ctx)  # pending live, stored at once in the shadow
    assert m.lookup(c, ctx) is LookupResult.HIT_PENDING
    live, shadow = m.shadow_report()
    assert ((live.lookups, live.hits), (shadow.lookups, shadow.hits)) == ((5, 3), (5, 4))
    data = m.get_stats().data["data"]
    assert data[SHADOW_LOOKUPS] == {("live", "lru"): 5, ("shadow", "fifo"): 5}
    assert data[SHADOW_HITS] == {("live", "lru"): 3, ("shadow", "fifo"): 4}
    again = m.get_stats().data["data"]
    assert set(again[SHADOW_LOOKUPS].values()) == set(again[SHADOW_HITS].values()) == {0}


def test_reference_sketch_resets_halve_the_sample_count() -> None:
    """The reference sketch's reset falls due at ten counts per counter (the width rounded up to
    a power of two, at least 16) and halves the sample count, as the Rust sketch's does.

    Kills the mutant that zeroes the count instead (due again only after a full sample: a
    reset every 10 * width counts, not every 5 * width after the first).
    """
    for width, due in [(3, 160), (16, 160), (17, 320)]:
        s = FrequencySketch(threshold=2, width=width)
        h = sketch_hash(b"b")
        for _ in range(due - 1):
            s.increment(h)
        s.age_if_due()
        assert (s.samples, s.estimate(h)) == (due - 1, 15)
        s.increment(h)
        s.age_if_due()
        assert (s.samples, s.estimate(h)) == (due // 2, 7)
        for _ in range(due // 2):
            s.increment(h)
        s.age_if_due()  # due again after half a sample
        assert (s.samples, s.estimate(h)) == (due // 2, 7)


class _RecordingFifo(OldestFirst):
    """`OldestFirst` recording what the manager reports to it, whose ``evict`` raises while
    ``fail_evict`` is set and answers ``None`` while ``decline_evict`` is."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.fail_evict = False
        self.decline_evict = False
        self.misses: list[list[bytes]] = []
        self.finished: list[tuple[set[bytes], set[bytes]]] = []
        self.given: list[tuple[str, list[bytes]]] = []  # each call's key objects

    def insert(self, key: bytes, chunk: Any, req_context: Any) -> None:
        self.given.append(("insert", [key]))
        super().insert(key, chunk, req_context)

    def touch(self, keys: Any, req_context: Any) -> None:
        self.given.append(("touch", list(keys)))

    def on_store_miss(self, keys: Any, req_context: Any) -> None:
        self.given.append(("on_store_miss", list(keys)))
        self.misses.append(list(keys))

    def on_request_access(self, keys: Any, req_context: Any) -> None:
        self.given.append(("on_request_access", list(keys)))

    def on_request_finished(self, groups: Any, inserted: Any, reused: Any, ctx: Any) -> None:
        self.finished.append((set(inserted), set(reused)))

    def evict(self, n: int, protected: set[bytes]) -> Any:
        if self.fail_evict:
            raise RuntimeError("evict failed")
        if self.decline_evict:
            return None
        return super().evict(n, protected)


@pytest.fixture
def recording_fifo() -> Iterator[dict[str, Any]]:
    """Manager arguments that run `_RecordingFifo` as a plug-in policy."""
    with _as_plugin(_RecordingFifo) as kwargs:
        yield kwargs


@pytest.mark.parametrize("manager_cls", [CPUOffloadingManager, ReferenceManager])
def test_an_offer_whose_evict_raises_marks_no_key_reused(
    recording_fifo: dict[str, Any], manager_cls: Any
) -> None:
    """A ``prepare_store`` that fails in the policy's ``evict`` records nothing: a key the
    request had seen and now offers while readable does not become reused, so the request's
    finish reports it as neither inserted nor reused.

    Kills the mutant that marks the readable keys reused before making room
    (``mark_reused`` moved ahead of ``make_room_and_place`` in ``Manager::prepare_store``).
    """
    m = manager_cls(2, **recording_fifo)
    writer, reader = ReqContext("writer"), ReqContext("reader")
    x, y, a, b = k(1), k(2), k(3), k(4)
    assert m.prepare_store([x, y], writer) is not None  # pending: nothing is evictable
    assert m.prepare_store([a], reader) is None  # reader has now seen a, absent, not inserted
    m.complete_store([x, y], writer)
    out = m.prepare_store([a], writer)  # evicts x
    assert out is not None
    assert (list(out.keys_to_store), list(out.evicted_keys)) == ([a], [x])
    m.complete_store([a], writer)
    m.policy.fail_evict = True
    with pytest.raises(RuntimeError, match="evict failed"):
        m.prepare_store([a, b], reader)  # a readable; b needs y evicted: the policy raises
    m.policy.fail_evict = False
    m.on_request_finished(reader)
    assert m.policy.finished == [(set(), set())]


def test_a_completion_of_an_evicted_key_leaves_the_key_in_its_chunk_alone() -> None:
    """Completing a store or a load of a key object whose chunk has since gone to another key
    changes nothing: the other key stays pending, or pinned. The binding remembers the chunk
    each key object went to, and may skip checking that guess only while the chunk still keeps
    that very object.

    Kills the mutant that vouches for every remembered guess (``Core::guesses``), which then
    completes the other key's store or releases its pin.
    """
    m = CPUOffloadingManager(1, enable_events=True)
    writer, other = ReqContext("writer"), ReqContext("other")
    x, y = k(1), k(2)
    assert m.prepare_store([x], writer) is not None
    m.complete_store([x], writer)
    out = m.prepare_store([y], other)  # evicts x; y takes x's chunk, pending
    assert out is not None
    assert list(out.evicted_keys) == [x]
    list(m.take_events())
    m.complete_store([x], writer)  # x is absent: ignored
    assert m.lookup(y, other) is LookupResult.HIT_PENDING
    assert list(m.take_events()) == []
    m.complete_store([y], other)
    assert m.lookup(y, other) is LookupResult.HIT
    # The same for a load: x was loaded from the chunk that y now holds, pinned.
    m.prepare_store([x], writer)  # evicts y
    m.complete_store([x], writer)
    m.prepare_load([x], writer)
    m.complete_load([x], writer)
    assert m.prepare_store([y], other) is not None  # evicts x again
    m.complete_store([y], other)
    m.prepare_load([y], other)
    with pytest.raises(KeyStateError):
        m.complete_load([x], writer)
    assert m.resident() == {y: (0, 1)}
    m.complete_load([y], other)
    assert m.resident() == {y: (0, 0)}


class _PinFailingFifo(_RecordingFifo):
    """`_RecordingFifo` whose pin report of key ``fail_pin_of`` raises, and whose unpin reports
    raise while ``fail_unpin`` is set."""

    fail_pin_of: bytes | None = None
    fail_unpin = False

    def mark_non_evictable(self, key: bytes) -> None:
        if key == self.fail_pin_of:
            raise KeyError("first: pin")

    def mark_evictable(self, key: bytes) -> None:
        if self.fail_unpin:
            raise ValueError("second: unpin")


@pytest.mark.parametrize("manager_cls", [CPUOffloadingManager, ReferenceManager])
def test_a_call_whose_policy_raises_twice_raises_the_first_exception(
    manager_cls: Any,
) -> None:
    """A load whose second pin report raises undoes the first pin, and that report raises too:
    the call raises the policy's first exception, and nothing stays pinned.

    Kills the mutant that keeps the last exception of a call instead of the first
    (``PythonPolicy::fail``).
    """
    with _as_plugin(_PinFailingFifo) as kwargs:
        m = manager_cls(4, **kwargs)
    ctx = ReqContext("r")
    a, b = k(1), k(2)
    assert m.prepare_store([a, b], ctx) is not None
    m.complete_store([a, b], ctx)
    m.policy.fail_pin_of = b
    m.policy.fail_unpin = True
    with pytest.raises(KeyError, match="first: pin"):
        m.prepare_load([a, b], ctx)
    assert m.resident() == {a: (0, 0), b: (1, 0)}


def test_a_policy_core_gives_a_request_a_new_rank_after_clear() -> None:
    """A ``PolicyCore`` (LRU) hands a request a request rank at its first access; after
    ``clear`` that rank is stale, and the request's next access takes a fresh one from the
    restarted counter, which its positioned insert then carries.

    Kills the mutant that accepts a rank of an earlier generation (``Inner::current_rank``).
    """
    core = _native.PolicyCore("lru", 8)
    plain = ReqContext("plain")
    for i in range(4):
        core.insert(k(i), ChunkStatus(i), plain)  # fresh ranks 0 to 3
    ctx = ReqContext("r")
    a, b = k(10), k(11)
    ctx.set_offload_key_position(a, 10)
    core.on_request_access([a], ctx)  # the request's rank: 4
    assert core.policy_state()["next_rank"] == 5
    core.clear()
    core.insert(b, ChunkStatus(0), plain)  # fresh rank 0
    core.on_request_access([a], ctx)  # stale rank: a new one, 1
    core.insert(a, ChunkStatus(1), ctx)
    state = core.policy_state()
    assert state["ranks"] == {b: (0, 0), a: (1, -10)}
    assert state["next_rank"] == 2


def test_a_plugin_policy_receives_the_callers_key_objects(recording_fifo: dict[str, Any]) -> None:
    """A plug-in policy gets the very key objects the caller passed (as vLLM's manager hands
    them on), not equal copies, in every call that names the call's keys.

    Kills the mutant that never finds a key among the call's objects
    (``PythonPolicy::key_obj`` building new ``bytes`` for each).
    """
    m = CPUOffloadingManager(4, **recording_fifo)
    ctx = ReqContext("r")
    keys = [k(1), k(2)]
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(keys, ctx)
    m.touch(keys, ctx)
    given = m.policy.given
    assert [name for name, _ in given] == [
        "on_store_miss",
        "on_request_access",
        "insert",
        "insert",
        "touch",
    ]
    assert [[id(x) for x in objs] for _, objs in given] == [
        [id(keys[0]), id(keys[1])],
        [id(keys[0]), id(keys[1])],
        [id(keys[0])],
        [id(keys[1])],
        [id(keys[0]), id(keys[1])],
    ]


@pytest.mark.parametrize("manager_cls", [CPUOffloadingManager, ReferenceManager])
@pytest.mark.parametrize("key", [b"", k(1)], ids=["empty", "key"])
@pytest.mark.parametrize(
    "call",
    ["prepare_store", "prepare_load", "complete_store", "complete_load", "touch", "lookup_prefix"],
)
def test_a_single_bytes_key_is_never_taken_for_a_collection_of_keys(
    manager_cls: Any, key: bytes, call: str
) -> None:
    """A call that takes a collection of keys refuses one ``bytes`` object given in its place,
    the empty one included (iterated, it would be an empty collection), and changes nothing.

    Kills the mutant that drops the binding's check for a single ``bytes`` key
    (``Keys::extract``): a key of one byte or more is then refused only for its items being
    ints, and ``b""`` is taken for no keys at all.
    """
    m = manager_cls(4)
    ctx = ReqContext("r")
    with pytest.raises(InvalidKeyError):
        getattr(m, call)(key, ctx)
    assert m.resident() == {}
    m.on_request_finished(ctx)  # no state was made: nothing to finish


class _DuckContext:
    """A request context of vLLM's shape (its three methods), not a ``ReqContext``."""

    def __init__(self) -> None:
        self.states: dict[type, Any] = {}

    def get_state(self, cls: type) -> Any:
        return self.states.get(cls)

    def set_state(self, val: Any) -> None:
        self.states[type(val)] = val

    def get_offload_key_position(self, key: bytes) -> int | None:
        return None


@pytest.mark.parametrize("manager_cls", [CPUOffloadingManager, ReferenceManager])
@pytest.mark.parametrize("method", ["get_state", "set_state", "get_offload_key_position"])
def test_a_context_whose_method_is_not_callable_is_refused(manager_cls: Any, method: str) -> None:
    """A context with one of vLLM's context methods set to something that cannot be called is
    refused as lacking it, before anything changes.

    Kills the mutant that takes any attribute of the method's name for the method
    (``Context::new`` checking ``getattr`` only): the call then fails later with a
    ``TypeError`` from calling the attribute.
    """
    m = manager_cls(4)
    ctx = _DuckContext()
    setattr(ctx, method, None)
    with pytest.raises(InvalidArgumentError, match=f"lacks {method}"):
        m.prepare_store([k(1)], ctx)
    assert m.resident() == {}


@pytest.mark.parametrize("manager_cls", [CPUOffloadingManager, ReferenceManager])
def test_an_evict_that_declines_makes_the_offer_return_none(
    recording_fifo: dict[str, Any], manager_cls: Any
) -> None:
    """A plug-in policy's ``evict`` may answer ``None`` (it cannot evict), even with evictable
    chunks: the offer then returns ``None``, evicts nothing and raises nothing.

    Kills the mutant that takes a ``None`` answer for an eviction of no keys
    (``PythonPolicy::evict``), which the contract check then refuses as a ``PolicyError``.
    """
    m = manager_cls(1, enable_events=True, **recording_fifo)
    ctx = ReqContext("r")
    a, b = k(1), k(2)
    assert m.prepare_store([a], ctx) is not None
    m.complete_store([a], ctx)
    list(m.take_events())
    m.policy.decline_evict = True
    assert m.prepare_store([b], ctx) is None
    assert m.resident() == {a: (0, 0)}
    assert list(m.take_events()) == []
    m.policy.decline_evict = False
    out = m.prepare_store([b], ctx)
    assert out is not None
    assert list(out.evicted_keys) == [a]
