"""What-if shadow policies (`kvoffload.shadow`): same traffic, other policies, keys only."""

from __future__ import annotations

import functools
import random
import threading
from collections.abc import Callable
from typing import Any

import pytest

import _driver
from kvoffload import (
    CPUOffloadingManager,
    InvalidArgumentError,
    KeyStateError,
    ReqContext,
    UnsupportedPolicyError,
    make_offload_key,
)
from kvoffload._common import BUILTIN_POLICIES
from kvoffload.manager import _ShadowedManager
from kvoffload.shadow import SHADOW_HITS, SHADOW_LOOKUPS, ShadowSet

KEYS = [make_offload_key(i.to_bytes(4, "big"), 0) for i in range(64)]


def _shadowed(m: CPUOffloadingManager) -> _ShadowedManager:
    """``m``, made with shadow policies: the shadowed manager class."""
    assert isinstance(m, _ShadowedManager)
    return m


def drive(m: CPUOffloadingManager, steps: int = 400, seed: int = 3) -> None:
    """Requests with skewed, position-carrying prefixes; stores and loads complete at once."""
    rng = random.Random(seed)
    for step in range(steps):
        ctx = ReqContext(req_id=f"r{step}")
        start = min(int(rng.expovariate(0.15)), 56)
        keys = KEYS[start : start + rng.randint(1, 8)]
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, 16 * (start + i + 1))
        m.on_new_request(ctx)
        hits = m.lookup_prefix(iter(keys), ctx)  # an iterator: read once, seen by every shadow
        if hits:
            m.prepare_load(keys[:hits], ctx)
            m.complete_load(keys[:hits], ctx)
            m.touch(keys[:hits], ctx)
        if hits < len(keys):
            m.lookup(keys[hits], ctx)
            out = m.prepare_store(keys[hits:], ctx)
            if out is not None:
                m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_a_shadow_of_the_live_policy_matches_it(policy: str) -> None:
    # Transfers complete at once here, as in a shadow: the twin must agree call for call.
    m = _shadowed(CPUOffloadingManager(12, cache_policy=policy, shadow_policies=[policy]))
    drive(m)
    live, shadow = m.shadow_report()
    assert (live.lookups, live.hits) == (shadow.lookups, shadow.hits)
    assert 0 < live.hits < live.lookups
    assert m._shadows.shadows[0].core.policy_state() == m.policy_state()
    m.check_invariants()


def test_shadows_report_per_policy_and_restart_each_report() -> None:
    m = _shadowed(CPUOffloadingManager(12, cache_policy="lru", shadow_policies=["fifo", "s3fifo"]))
    drive(m)
    report = {(c.role, c.policy): c for c in m.shadow_report()}
    assert set(report) == {("live", "lru"), ("shadow", "fifo"), ("shadow", "s3fifo")}
    assert (
        len({c.lookups for c in report.values()}) > 1 or len({c.hits for c in report.values()}) > 1
    )
    data = m.get_stats().data
    assert data["types"][SHADOW_LOOKUPS] == "counter"
    assert {k: v for k, v in data["data"][SHADOW_HITS].items()} == {
        k: c.hits for k, c in report.items()
    }
    again = m.get_stats().data["data"][SHADOW_LOOKUPS]
    assert set(again.values()) == {0}
    drive(m, steps=10, seed=9)
    assert sum(m.get_stats().data["data"][SHADOW_LOOKUPS].values()) > 0


def test_failed_live_calls_do_not_reach_the_shadows() -> None:
    m = _shadowed(CPUOffloadingManager(4, cache_policy="lru", shadow_policies=["arc"]))
    ctx = ReqContext(req_id="x")
    out = m.prepare_store(KEYS[:2], ctx)
    assert out is not None
    shadow = m._shadows.shadows[0].core
    before = shadow.resident()
    with pytest.raises(KeyStateError):
        m.prepare_load(KEYS[:2], ctx)  # the live stores are still pending
    assert shadow.resident() == before
    m.complete_store(out.keys_to_store, ctx)
    m.check_invariants()


def test_bad_shadow_arguments_raise() -> None:
    with pytest.raises(UnsupportedPolicyError):
        CPUOffloadingManager(4, shadow_policies=["mru"])
    with pytest.raises(InvalidArgumentError):
        CPUOffloadingManager(4, shadow_policies="arc")
    plain = CPUOffloadingManager(4, shadow_policies=[])
    assert not hasattr(plain, "shadow_report")  # no shadows: the plain manager, no overhead


def test_a_str_of_shadow_policies_is_refused_for_what_it_is() -> None:
    # Not split into letters ("no built-in policy 'a'"): the error says to pass a list.
    with pytest.raises(InvalidArgumentError, match=r"such as \['arc'\], not a str"):
        ShadowSet("lru", "arc", 4, 1, 64)


def test_the_manager_refuses_a_str_of_shadow_policies_for_what_it_is() -> None:
    with pytest.raises(InvalidArgumentError, match="not a str"):
        CPUOffloadingManager(4, shadow_policies="arc")


def test_counts_from_several_threads_add_up() -> None:
    # Lookups from several threads at once, with reports taken meanwhile: no count is lost, and
    # what the reports took plus what is left adds up to every lookup made.
    m = _shadowed(CPUOffloadingManager(16, cache_policy="lru", shadow_policies=["fifo"]))
    ctx = ReqContext(req_id="r")
    out = m.prepare_store(KEYS[:8], ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    n_threads, rounds = 6, 3_000
    start = threading.Barrier(n_threads + 1)
    reported: list[dict[tuple[str, str], int]] = []

    def look(t: int) -> None:
        start.wait()
        for i in range(rounds):
            m.lookup(KEYS[(t + i) % 16], ctx)  # the first 8 keys hit

    workers = [threading.Thread(target=look, args=(t,)) for t in range(n_threads)]
    for w in workers:
        w.start()
    start.wait()
    while any(w.is_alive() for w in workers):
        reported.append(m.get_stats().data["data"].get(SHADOW_LOOKUPS, {}))
    for w in workers:
        w.join()
    reported.append(m.get_stats().data["data"][SHADOW_LOOKUPS])
    total = n_threads * rounds
    hits = sum((t + i) % 16 < 8 for t in range(n_threads) for i in range(rounds))
    for c in m.shadow_report():
        assert (c.lookups, c.hits) == (total, hits)
        assert sum(r.get((c.role, c.policy), 0) for r in reported) == total


# --- shadows observe: they never change the outcome of a live call ---


def _state(m: CPUOffloadingManager) -> dict[str, Any]:
    """The live manager's state: what a plain manager and its shadowed twin must agree on."""
    m.check_invariants()
    return {
        "resident": m.resident(),
        "policy_state": m.policy_state(),
        "pool_state": m.pool_state(),
        "tracker_state": m.tracker_state(),
        "pending": m.num_pending_writes(),
    }


def _store(m: CPUOffloadingManager, keys: list[bytes], ctx: ReqContext) -> None:
    out = m.prepare_store(keys, ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)


def _finished_request_saw_a_key_its_shadow_lacked(m: CPUOffloadingManager) -> ReqContext:
    """Under LRU with a FIFO shadow: request "r" loads A, which the shadow had evicted, and ends.

    Its shadow request never records A (a shadow loads only the keys it holds), so the shadow
    refuses the finished request's later, legal, loads and stores of A.
    """
    a, b, c = KEYS[:3]
    s = ReqContext(req_id="s")
    _store(m, [a, b], s)
    m.touch([a], s)  # LRU: A most recent; FIFO: unchanged
    _store(m, [c], s)  # live {A, C}; the FIFO shadow evicted A: {B, C}
    r = ReqContext(req_id="r")
    m.on_new_request(r)
    m.prepare_load([a], r)
    m.complete_load([a], r)
    m.on_request_finished(r)
    return r


def _last_call_as_without_shadows(
    make: Callable[..., CPUOffloadingManager],
    setup: Callable[[CPUOffloadingManager], ReqContext],
    last: Callable[[CPUOffloadingManager, ReqContext], Any],
    shadow_policy: str,
) -> tuple[CPUOffloadingManager, _ShadowedManager, list[Any]]:
    """``setup`` then ``last`` on a plain manager and on its twin with one shadow.

    The last call must return the same answer on both and leave the same live state, and the
    shadow that cannot follow it must skip it (unchanged, counted once). Returns both managers
    and each one's context from ``setup``.
    """
    plain, shadowed = make(), _shadowed(make(shadow_policies=[shadow_policy]))
    contexts = [setup(plain), setup(shadowed)]
    assert _state(plain) == _state(shadowed)
    shadow = shadowed._shadows.shadows[0].core
    before = shadow.resident(), shadow.policy_state(), shadow.pool_state()
    answers = [last(plain, contexts[0]), last(shadowed, contexts[1])]
    assert answers[0] == answers[1]
    assert _state(plain) == _state(shadowed)
    assert (shadow.resident(), shadow.policy_state(), shadow.pool_state()) == before
    shadow.check_invariants()
    skipped = {(c.role, c.policy): c.skipped_calls for c in shadowed.shadow_report()}
    assert skipped == {("live", plain.policy_state()["policy"]): 0, ("shadow", shadow_policy): 1}
    return plain, shadowed, contexts


def test_a_finished_requests_load_its_shadow_refuses_is_answered_as_without_shadows() -> None:
    # The load is legal (r saw A before it finished); the shadow, holding A again by then, would
    # have r record A anew and raised RequestFinishedError after the live manager pinned A.
    a = KEYS[0]

    def setup(m: CPUOffloadingManager) -> ReqContext:
        r = _finished_request_saw_a_key_its_shadow_lacked(m)
        _store(m, [a], ReqContext(req_id="t"))  # the shadow holds A again
        return r

    def load(m: CPUOffloadingManager, r: ReqContext) -> Any:
        return m.prepare_load([a], r)

    make = functools.partial(CPUOffloadingManager, 2, cache_policy="lru")
    plain, shadowed, (r0, r1) = _last_call_as_without_shadows(make, setup, load, "fifo")
    assert shadowed.resident()[a] == (0, 1)  # pinned live, and the spec was returned
    plain.complete_load([a], r0)
    shadowed.complete_load([a], r1)
    assert _state(plain) == _state(shadowed)
    assert shadowed.lookup(a, r1).name == "HIT"  # the shadow follows the calls after it
    assert [(c.lookups, c.hits) for c in shadowed.shadow_report()] == [(1, 1), (1, 1)]


def test_a_finished_requests_store_its_shadow_refuses_is_answered_as_without_shadows() -> None:
    # The store is legal (r saw A); the shadow raised after the live manager had evicted E and
    # placed A pending, so the caller never learned the keys to store.
    a, e, f = KEYS[0], KEYS[4], KEYS[5]

    def setup(m: CPUOffloadingManager) -> ReqContext:
        r = _finished_request_saw_a_key_its_shadow_lacked(m)
        _store(m, [e, f], ReqContext(req_id="u"))  # A leaves the live cache
        return r

    def store(m: CPUOffloadingManager, r: ReqContext) -> Any:
        return m.prepare_store([a], r)

    make = functools.partial(CPUOffloadingManager, 2, cache_policy="lru", enable_events=True)
    plain, shadowed, (r0, r1) = _last_call_as_without_shadows(make, setup, store, "fifo")
    assert shadowed.resident()[a] == (0, -1)  # pending live: the caller has its keys to store
    for m, r in ((plain, r0), (shadowed, r1)):
        m.complete_store([a], r)
    assert _state(plain) == _state(shadowed)
    assert list(plain.take_events()) == list(shadowed.take_events())


def test_a_position_only_a_shadow_reads_leaves_the_live_call_as_without_shadows() -> None:
    # ARC reads no token position while storing (it reads them at the finish), an LRU shadow
    # does: its refusal of a float came after the live store had been placed. The live call
    # stands; the bad position is refused where the live policy reads it, as without shadows.
    key = KEYS[0]

    def setup(m: CPUOffloadingManager) -> ReqContext:
        ctx = ReqContext(req_id="r")
        ctx.set_offload_key_position(key, 1.5)  # type: ignore[arg-type]
        return ctx

    def store(m: CPUOffloadingManager, ctx: ReqContext) -> Any:
        return m.prepare_store([key], ctx)

    make = functools.partial(CPUOffloadingManager, 4, cache_policy="arc")
    plain, shadowed, contexts = _last_call_as_without_shadows(make, setup, store, "lru")
    for m, ctx in zip((plain, shadowed), contexts, strict=True):
        m.complete_store([key], ctx)
        with pytest.raises(InvalidArgumentError, match="token position must be an int"):
            m.on_request_finished(ctx)
    assert _state(plain) == _state(shadowed)


def _without_shadow_counters(m: CPUOffloadingManager) -> CPUOffloadingManager:
    """``m`` with its ``get_stats`` leaving out the shadows' counters (all else is the live's)."""
    get_stats = m.get_stats

    def stats() -> Any:
        out = get_stats()
        for part in ("types", "data"):
            for name in (SHADOW_LOOKUPS, SHADOW_HITS):
                out.data[part].pop(name, None)
        return out

    m.get_stats = stats  # type: ignore[method-assign]
    return m


@pytest.mark.parametrize("policy", ["lru", "arc", "fifo", "s3fifo"])
def test_shadows_never_change_what_a_legal_call_does(policy: str) -> None:
    # The differential driver's legal sequences (finished requests' late loads and stores
    # included) on a plain manager and on one shadowed by every other built-in policy: every
    # answer, event, stats payload and state must be the same. The shadows, whose caches
    # differ, cannot follow some calls; those they skip.
    made: list[_ShadowedManager] = []

    def make(**kwargs: Any) -> CPUOffloadingManager:
        others = [p for p in BUILTIN_POLICIES if p != policy]
        made.append(
            _shadowed(
                _without_shadow_counters(CPUOffloadingManager(**kwargs, shadow_policies=others))
            )
        )
        return made[-1]

    plain = _driver.impl_spec("rust")
    specs = [plain, _driver.ImplSpec("rust+shadows", make, ReqContext, plain.state)]
    # 60 sequences: a skip is rare (under ARC the first comes at seed 48).
    for seed in range(60):
        result = _driver.run_sequence(specs, policy, 1 + seed % 2, seed, calls=250)
        if result.mismatch is not None:
            pytest.fail(result.mismatch.report(20), pytrace=False)
    report = [c for m in made for c in m.shadow_report()]
    assert all(c.skipped_calls == 0 for c in report if c.role == "live")
    assert sum(c.lookups for c in report if c.role == "shadow") > 0
    assert sum(c.skipped_calls for c in report) > 0  # the sequences reach the calls in question
