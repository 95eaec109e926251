"""Tests added by a mutation-testing audit: each one kills a mutant that the rest of the suite let
through (docs/reliability.md, "Mutation testing of the suite"). They run through the Python API.
"""

from __future__ import annotations

import sys
import threading
import time
import types
from collections.abc import Iterator, Sequence

import pytest

from _helpers import k
from kvoffload import CPUOffloadingManager, LookupResult, ReqContext
from kvoffload.errors import KeyStateError
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


@pytest.fixture
def blocking_policy_module() -> Iterator[str]:
    name = "kvoffload_mutation_gaps_policies"
    module = types.ModuleType(name)
    module.BlockingTouchLru = _BlockingTouchLru  # type: ignore[attr-defined]
    sys.modules[name] = module
    _BlockingTouchLru.inside.clear()
    _BlockingTouchLru.release.clear()
    try:
        yield name
    finally:
        _BlockingTouchLru.release.set()
        del sys.modules[name]


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
            m.touch(big)

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
                m.complete_load([a, absent])
            # A call that waited for the holder's (milliseconds) found the lock taken.
            waited += time.perf_counter() - t0 > 1e-3
            m.complete_load([a, long_key])
    finally:
        stop.set()
        holder.join(30)
    assert not holder.is_alive()
    assert waited > 0, "no call found the manager's lock taken"
    # Each of the rounds dropped one pin of each key, no more: the rest are all there.
    for _ in range(pins - rounds):
        m.complete_load([a, long_key])
    for one in (a, long_key):
        with pytest.raises(KeyStateError):
            m.complete_load([one])


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
