"""Thread stress (tools/stress.py): 8 threads drive one shared Rust manager (and one HostPool)
with mixed legal calls for a bounded time, with the invariants checked while they run and the
chunk accounting checked once they stop. One thread now and then resets the cache.

Each thread has its own requests and keys, and all threads also offer a set of shared keys. The
only exception allowed is `KeyStateError` from `prepare_load`: between a thread's
`lookup_prefix` and its `prepare_load`, another thread may evict the keys (a legal outcome of a
legal call sequence, which raises and changes nothing), and `KeyStateError` from
`complete_load` when another thread reset the cache since the load was prepared.
`KVOFFLOAD_STRESS_SECONDS` sets the run time of the four manager runs together (default 9); for
long runs, and without the GIL, use `tools/stress.py --seconds N` (`tools/freethreaded.sh`).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

import _driver
import kvoffload

stress: Any = _driver._load_tool("stress")

THREADS = 8
SECONDS = float(os.environ.get("KVOFFLOAD_STRESS_SECONDS", "9"))


@pytest.fixture(autouse=True)
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond, so that calls interleave as finely as the GIL allows
    (no effect on a free-threaded build running without the GIL)."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def check(r: Any) -> None:
    print("\n" + r.summary())
    assert not r.failures, r.failures[0]


@pytest.mark.parametrize(
    ("policy", "long_prompts"), [("lru", False), ("arc", False), ("sieve", False), ("lru", True)]
)
def test_eight_threads_share_one_manager(policy: str, long_prompts: bool) -> None:
    r = stress.run(policy, threads=THREADS, seconds=SECONDS / 4, long_prompts=long_prompts)
    check(r)
    assert r.checks > 0
    assert all(ops["prepare_store"] > 0 for ops in r.ops)


@pytest.mark.parametrize("tier", ["arc", "lru"])
def test_eight_threads_share_two_managers_on_each_requests_context(tier: str) -> None:
    r = stress.run("lru", threads=THREADS, seconds=SECONDS / 4, tier=tier)
    check(r)
    assert r.checks > 0
    assert all(ops["tier.prepare_store"] > 0 for ops in r.ops)
    assert all(ops["prepare_store"] > ops["tier.prepare_store"] for ops in r.ops)


def test_threads_share_one_host_pool() -> None:
    """Jobs and direct copies from 8 threads, each on its own chunks: every byte lands."""
    r = stress.run(None, threads=THREADS, seconds=min(SECONDS / 2, 2.0), host=True)
    check(r)
    assert r.host_rounds > 0


def test_threads_mix_manager_and_host_pool_calls() -> None:
    """The manager and the pool from the same 8 threads at once (what tools/stress.py runs)."""
    r = stress.run("lru", threads=THREADS, seconds=min(SECONDS / 9, 1.0), host=True)
    check(r)
    assert r.host_rounds > 0
    assert r.checks > 0


def test_a_key_list_changed_by_another_thread_while_a_call_reads_it() -> None:
    """Another thread appends to and clears the very list a call is reading: each call sees
    some consistent list (it returns, or raises a kvoffload error), and nothing crashes."""
    m = kvoffload.CPUOffloadingManager(64)
    keys = [kvoffload.make_offload_key(b"k%d" % i, 0) for i in range(200)]
    shared: list[bytes] = list(keys)
    deadline = time.monotonic() + min(SECONDS / 9, 1.0)
    stop = threading.Event()
    ctx = kvoffload.ReqContext("r")

    def mutate() -> None:
        while not stop.is_set():
            shared.clear()
            shared.extend(keys)
            del shared[100:]

    t = threading.Thread(target=mutate)
    t.start()
    calls = 0
    try:
        while time.monotonic() < deadline:
            try:
                m.lookup_prefix(shared, ctx)
                m.touch(shared, ctx)
            except kvoffload.KVOffloadError:
                pass
            calls += 1
    finally:
        stop.set()
        t.join()
    m.check_invariants()
    assert calls > 0


def test_a_positions_dict_changed_by_another_thread_while_calls_read_it() -> None:
    """Another thread keeps resizing a request's positions dict (unrelated keys come and go,
    the request's own keys are set again to the same positions) while calls walk it: every
    request reads its keys' positions exactly as without the other thread."""
    keys = [kvoffload.make_offload_key(b"p%d" % i, 0) for i in range(96)]
    others = [kvoffload.make_offload_key(b"o%d" % i, 0) for i in range(300)]
    deadline = time.monotonic() + min(SECONDS / 9, 1.0)

    def one_request(m: Any, ctx: Any) -> None:
        for lo in range(0, len(keys), 24):
            out = m.prepare_store(keys[lo : lo + 24], ctx)
            m.complete_store(out.keys_to_store, ctx)
        m.on_request_finished(ctx)

    def fresh() -> tuple[Any, Any]:
        ctx = kvoffload.ReqContext("r")
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, 16 * (i + 1))
        return kvoffload.CPUOffloadingManager(128), ctx

    m, ctx = fresh()
    one_request(m, ctx)
    expected = m.policy_state()

    stop = threading.Event()
    current: list[Any] = [ctx]

    def mutate() -> None:
        while not stop.is_set():
            positions = current[0]._offload_key_positions
            for k in others:
                positions[k] = 1
            for i, key in enumerate(keys[::7]):
                positions[key] = 16 * (7 * i + 1)  # the same position again
            for k in others:
                positions.pop(k, None)

    t = threading.Thread(target=mutate)
    t.start()
    runs = 0
    try:
        while time.monotonic() < deadline or runs == 0:
            m, ctx = fresh()
            current[0] = ctx
            one_request(m, ctx)
            assert m.policy_state() == expected
            m.check_invariants()
            runs += 1
    finally:
        stop.set()
        t.join()
