"""What-if shadow policies (`kvoffload.shadow`): same traffic, other policies, keys only."""

from __future__ import annotations

import random
import threading

import pytest

from kvoffload import (
    CPUOffloadingManager,
    InvalidArgumentError,
    KeyStateError,
    ReqContext,
    UnsupportedPolicyError,
    make_offload_key,
)
from kvoffload._common import BUILTIN_POLICIES
from kvoffload.shadow import SHADOW_HITS, SHADOW_LOOKUPS, ShadowSet

KEYS = [make_offload_key(i.to_bytes(4, "big"), 0) for i in range(64)]


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
    m = CPUOffloadingManager(12, cache_policy=policy, shadow_policies=[policy])
    drive(m)
    live, shadow = m.shadow_report()
    assert (live.lookups, live.hits) == (shadow.lookups, shadow.hits)
    assert 0 < live.hits < live.lookups
    assert m._shadows.shadows[0].core.policy_state() == m.policy_state()
    m.check_invariants()


def test_shadows_report_per_policy_and_restart_each_report() -> None:
    m = CPUOffloadingManager(12, cache_policy="lru", shadow_policies=["fifo", "s3fifo"])
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
    m = CPUOffloadingManager(4, cache_policy="lru", shadow_policies=["arc"])
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
        CPUOffloadingManager(4, shadow_policies="arc")  # type: ignore[arg-type]
    plain = CPUOffloadingManager(4, shadow_policies=[])
    assert not hasattr(plain, "shadow_report")  # no shadows: the plain manager, no overhead


def test_a_str_of_shadow_policies_is_refused_for_what_it_is() -> None:
    # Not split into letters ("no built-in policy 'a'"): the error says to pass a list.
    with pytest.raises(InvalidArgumentError, match=r"such as \['arc'\], not a str"):
        ShadowSet("lru", "arc", 4, 1, 64)


def test_the_manager_refuses_a_str_of_shadow_policies_for_what_it_is() -> None:
    with pytest.raises(InvalidArgumentError, match="not a str"):
        CPUOffloadingManager(4, shadow_policies="arc")  # type: ignore[arg-type]


def test_counts_from_several_threads_add_up() -> None:
    # Lookups from several threads at once, with reports taken meanwhile: no count is lost, and
    # what the reports took plus what is left adds up to every lookup made.
    m = CPUOffloadingManager(16, cache_policy="lru", shadow_policies=["fifo"])
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
