"""A scaled-down soak (tools/soak.py, ~10^5 calls with churn and resets): no chunk goes missing,
nothing stays pinned or pending, and no key object or other Python object is leaked."""

from __future__ import annotations

from typing import Any

import pytest

import _driver

soak_tool: Any = _driver._load_tool("soak")


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_soak_leaks_nothing(policy: str) -> None:
    r = soak_tool.soak(100_000, policy=policy, num_chunks=512, seed=1, reset_every=40_000)
    assert r.ops >= 100_000
    # The chunk accounting was asserted at every snapshot; the last one, quiescent:
    assert r.end.resident + r.end.free == r.end.fresh <= 512
    assert r.end.resident > 0
    # Extra references on sampled keys are exactly those of resident keys, and none once reset.
    assert r.leaked_refs == 0
    assert 0 <= r.end.key_refs <= r.sampled_keys  # one per resident sampled key at most
    # Live Python objects do not grow with the number of calls.
    assert r.end.gc_objects - r.warm.gc_objects < 100, (r.warm, r.end)
