"""Tests added by a mutation-testing audit: each one kills a mutant that the rest of the suite let
through (see the audit report). They run against the Rust manager through the Python binding.
"""

from __future__ import annotations

import sys
import threading
import types
from collections.abc import Iterator, Sequence

import pytest

from kvoffload import CPUOffloadingManager, ReqContext
from kvoffload.reference.lru import LruPolicy
from kvoffload.reference.policy import RequestContext


def key(i: int) -> bytes:
    return f"k{i}".encode() + (0).to_bytes(4, "big")


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
    a, b, c = key(1), key(2), key(3)
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
