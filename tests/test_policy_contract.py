"""The cache-policy contract, checked as properties for every built-in policy and both managers.

Whatever a policy's order, through the manager it must: evict exactly the shortfall, never a
pinned, pending or offered chunk; return ``None`` only when fewer ready, unprotected chunks exist
than needed, and then change no chunk; keep a hit readable; forget everything on
``reset_cache``. Seeded random traffic with loads held in flight drives each policy; the checks
use only the public API and introspection (``resident()``).
"""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any, Protocol, cast

import pytest

from kvoffload import LookupResult, ReqContext, make_offload_key
from kvoffload._common import BUILTIN_POLICIES
from kvoffload.policies import ChunkStatus
from kvoffload.reference.manager import _BUILTIN

KEYS: list[bytes] = [make_offload_key(i.to_bytes(2, "big"), 0) for i in range(48)]


class _Inspectable(Protocol):
    """What every built-in reference policy has beyond ``CachePolicy``."""

    def state(self) -> dict[str, Any]: ...


def snapshot(m: Any) -> tuple[Any, ...]:
    # A refused offer is still recorded (a request rank, hits on its readable keys), as in
    # vLLM: the chunks and the pool are what must not change.
    return (m.resident(), m.pool_state())


def check_store(m: Any, capacity: int, keys: list[bytes], ctx: Any) -> Any:
    before = m.resident()
    free = capacity - len(before)
    out = m.prepare_store(keys, ctx)
    after = m.resident()
    offered = set(keys)
    absent = [k for k in keys if k not in before]
    if out is None:
        # Only when the ready, unprotected chunks cannot cover the shortfall.
        ready = [k for k, (_, ref) in before.items() if ref == 0 and k not in offered]
        assert len(ready) < len(absent) - free
        assert set(after) == set(before)
        return None
    evicted = list(out.evicted_keys)
    assert len(set(evicted)) == len(evicted)
    for k in evicted:
        assert before[k][1] == 0, "evicted a pinned or pending chunk"
        assert k not in offered, "evicted a chunk of the offer"
        assert k not in after
    assert len(evicted) == max(len(out.keys_to_store) - free, 0), "not exactly the shortfall"
    for k in out.keys_to_store:
        assert after[k][1] == -1
    return out


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_policy_contract_under_random_traffic(
    make_manager: Callable[..., Any], policy: str
) -> None:
    rng = random.Random(f"contract/{policy}")
    m = make_manager(12, cache_policy=policy)
    in_flight: list[tuple[list[bytes], Any]] = []  # loads not completed yet
    pending: list[tuple[list[bytes], Any]] = []  # stores not completed yet
    for step in range(600):
        ctx = ReqContext(req_id=f"r{step}")
        op = rng.random()
        if op < 0.45:
            start = rng.randrange(len(KEYS) - 6)
            keys = KEYS[start : start + rng.randint(1, 6)]
            out = check_store(m, 12, keys, ctx)
            if out is not None and out.keys_to_store:
                pending.append((list(out.keys_to_store), ctx))
        elif op < 0.65:
            ready = [k for k, (_, ref) in m.resident().items() if ref >= 0]
            if ready:
                keys = rng.sample(ready, min(len(ready), rng.randint(1, 3)))
                m.prepare_load(keys, ctx)
                for k in keys:
                    assert m.lookup(k, ctx) is LookupResult.HIT
                in_flight.append((keys, ctx))
        elif op < 0.75:
            m.touch(rng.sample(KEYS, 3), ctx)
        elif op < 0.9 and pending:
            keys, sctx = pending.pop(rng.randrange(len(pending)))
            m.complete_store(keys, sctx, success=rng.random() > 0.1)
        elif in_flight:
            keys, lctx = in_flight.pop(rng.randrange(len(in_flight)))
            m.complete_load(keys, lctx)
        m.check_invariants()
    m.reset_cache()
    assert m.resident() == {}
    assert all(m.lookup(k, ReqContext(req_id="")) is LookupResult.MISS for k in KEYS)
    m.check_invariants()


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_refused_eviction_changes_nothing(make_manager: Callable[..., Any], policy: str) -> None:
    m = make_manager(3, cache_policy=policy)
    ctx = ReqContext(req_id="a")
    out = m.prepare_store(KEYS[:3], ctx)
    m.complete_store(out.keys_to_store, ctx)
    m.prepare_load(KEYS[:1], ctx)  # pinned
    before = snapshot(m)
    # Two evictions needed, one offered key is resident (protected), one chunk pinned: refused.
    assert m.prepare_store([KEYS[1], KEYS[10], KEYS[11]], ReqContext(req_id="b")) is None
    assert snapshot(m) == before
    m.complete_load(KEYS[:1], ctx)
    m.check_invariants()


@pytest.mark.parametrize("policy", BUILTIN_POLICIES)
def test_a_reference_policy_refuses_what_it_cannot_evict_and_changes_nothing(policy: str) -> None:
    """Asked directly, as vLLM's manager asks a plug-in: a ready chunk, but too few unprotected."""
    p = _BUILTIN[policy](8)
    ctx = ReqContext(req_id="a")
    statuses = [ChunkStatus(i) for i in range(6)]
    for key, status in zip(KEYS, statuses, strict=False):
        p.insert(key, status, ctx)
    for key, status in zip(KEYS[:5], statuses, strict=False):  # the last stays pending
        status.ref_cnt = 0
        p.mark_evictable(key)
    p.mark_non_evictable(KEYS[0])  # the oldest is pinned
    statuses[0].ref_cnt = 1
    p.touch(KEYS[2:4], ctx)
    before = cast(_Inspectable, p).state()
    # Ready: KEYS[1:5]; protected: two of them.
    assert p.evict(3, {KEYS[1], KEYS[4]}) is None
    assert cast(_Inspectable, p).state() == before
    p.check_invariants()
    victims = p.evict(2, {KEYS[1], KEYS[4]})
    assert victims is not None
    assert sorted(key for key, _ in victims) == sorted(KEYS[2:4])
    p.check_invariants()
