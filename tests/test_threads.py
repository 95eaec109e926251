"""Thread stress: 8 threads drive one shared Rust manager (and one HostPool) with mixed legal
calls for a bounded time, with the invariants checked while they run and the chunk accounting
checked once they stop. One thread now and then resets the cache.

Each thread has its own requests and keys, and all threads also offer a set of shared keys. The
only exception allowed is `KeyStateError` from `prepare_load`: between a thread's
`lookup_prefix` and its `prepare_load`, another thread may evict the keys (a legal outcome of a
legal call sequence, which raises and changes nothing), and `KeyStateError` from
`complete_load` when another thread reset the cache since the load was prepared.
`KVOFFLOAD_STRESS_SECONDS` sets the run time of the three manager tests together (default 9).
"""

from __future__ import annotations

import os
import random
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import kvoffload
from kvoffload import HostPool, KeyStateError, ReqContext, make_offload_key

THREADS = 8
SECONDS = float(os.environ.get("KVOFFLOAD_STRESS_SECONDS", "9"))
NUM_CHUNKS = 96
SHARED = [make_offload_key(b"shared-%d" % i, 0) for i in range(24)]


@pytest.fixture(autouse=True)
def fast_switching() -> Iterator[None]:
    """Switch threads every microsecond, so that calls interleave as finely as the GIL allows."""
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    yield
    sys.setswitchinterval(old)


def check_accounting(m: Any) -> None:
    """Once the threads have stopped: every handed-out chunk is free xor resident, never
    twice, and nothing is pinned or pending. (`pool_state` and `resident` are two calls, so
    this is only meaningful while no other thread runs; `check_invariants` is one.)"""
    m.check_invariants()
    fresh, free = m.pool_state()
    resident = m.resident()
    chunks = [c for c, _ in resident.values()]
    assert len(set(free)) == len(free), "a chunk is on the free list twice"
    assert len(set(chunks)) == len(chunks), "a chunk holds two keys"
    assert not set(free) & set(chunks), "a resident chunk is free"
    assert len(free) + len(chunks) == fresh <= m.num_chunks
    # Every load was completed and every store completed or failed: nothing pinned or pending.
    assert all(ref == 0 for _, ref in resident.values()), resident
    _, used, pending, _, _ = m._core.take_stats()
    assert (used, pending) == (0, 0)


class Worker:
    """One thread's request loop; records what it did and any unexpected exception."""

    def __init__(self, m: Any, tid: int, deadline: float, long_prompts: bool = False) -> None:
        self.m, self.tid, self.deadline = m, tid, deadline
        #: Prompts of 128+ keys: those calls release the GIL while the core works.
        self.long_prompts = long_prompts
        self.rng = random.Random(tid)
        self.ops: Counter[str] = Counter()
        self.load_races = 0
        self.reset_races = 0
        self.error: BaseException | None = None

    def keys(self, req: int) -> list[bytes]:
        """A request's prompt: a few shared keys, then own keys (reused across requests)."""
        rng = self.rng
        if self.long_prompts:
            start, n = rng.randrange(400), rng.randrange(130, 200)
            return [make_offload_key(b"t%d-%d" % (self.tid, start + i), 0) for i in range(n)]
        own = [
            make_offload_key(b"t%d-%d" % (self.tid, rng.randrange(40)), g)
            for g in range(2)
            for _ in range(rng.randrange(1, 6))
        ]
        shared = rng.sample(SHARED, rng.randrange(0, 4))
        return list(dict.fromkeys(shared + own))

    def call(self, name: str, fn: Callable[..., Any], *args: Any) -> Any:
        self.ops[name] += 1
        return fn(*args)

    def request(self, req: int) -> None:
        m, rng = self.m, self.rng
        ctx = ReqContext(f"t{self.tid}-{req}")
        keys = self.keys(req)
        for i, key in enumerate(keys):
            if rng.random() < 0.8:
                ctx.set_offload_key_position(key, 16 * (i + 1))
        self.call("on_new_request", m.on_new_request, ctx)
        for key in keys[:2]:
            self.call("lookup", m.lookup, key, ctx)
        hits = self.call("lookup_prefix", m.lookup_prefix, keys, ctx)
        if hits:
            try:
                self.call("prepare_load", m.prepare_load, keys[:hits], ctx)
            except KeyStateError:
                self.load_races += 1  # evicted by another thread since lookup_prefix
            else:
                self.call("touch", m.touch, keys[:hits], ctx)
                try:
                    self.call("complete_load", m.complete_load, keys[:hits], ctx)
                except KeyStateError:
                    self.reset_races += 1  # another thread reset the cache since prepare_load
        out = self.call("prepare_store", m.prepare_store, keys[hits:], ctx)
        if out is not None and out.keys_to_store:
            success = rng.random() < 0.9
            self.call("complete_store", m.complete_store, out.keys_to_store, ctx, success)
        self.call("on_request_finished", m.on_request_finished, ctx)
        if self.tid == 0 and rng.random() < 0.001:
            self.call("reset_cache", m.reset_cache)
        if rng.random() < 0.05:
            self.call("get_stats", m.get_stats)
            self.call("take_events", lambda: list(m.take_events()))

    def run(self) -> None:
        try:
            req = 0
            while time.monotonic() < self.deadline:
                self.request(req)
                req += 1
        except BaseException as e:  # reported by the main thread
            self.error = e


def run_threads(targets: list[Callable[[], None]]) -> None:
    threads = [threading.Thread(target=t) for t in targets]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=SECONDS + 60)
        assert not t.is_alive(), "a thread hung"


@pytest.mark.parametrize(
    ("policy", "long_prompts"), [("lru", False), ("arc", False), ("sieve", False), ("lru", True)]
)
def test_eight_threads_share_one_manager(policy: str, long_prompts: bool) -> None:
    chunks = NUM_CHUNKS * 16 if long_prompts else NUM_CHUNKS
    m = kvoffload.CPUOffloadingManager(chunks, cache_policy=policy, enable_events=True)
    deadline = time.monotonic() + SECONDS / 4
    workers = [Worker(m, tid, deadline, long_prompts) for tid in range(THREADS)]
    checks = 0
    check_error: list[BaseException] = []

    def checker() -> None:
        nonlocal checks
        try:
            while time.monotonic() < deadline:
                m.check_invariants()  # one call, under the manager's lock: a consistent view
                checks += 1
        except BaseException as e:
            check_error.append(e)

    run_threads([w.run for w in workers] + [checker])
    for w in workers:
        if w.error is not None:
            raise w.error
    if check_error:
        raise check_error[0]
    check_accounting(m)
    total: Counter[str] = sum((w.ops for w in workers), Counter())
    calls = sum(total.values())
    print(
        f"\n{policy}: {THREADS} threads, {calls} calls in {SECONDS / 4:.1f}s, {checks} concurrent "
        f"invariant checks, {sum(w.load_races for w in workers)} load and "
        f"{sum(w.reset_races for w in workers)} reset races; {dict(total)}"
    )
    assert checks > 0
    assert all(w.ops["prepare_store"] > 0 for w in workers)


def test_threads_share_one_host_pool() -> None:
    """Jobs and direct copies from 8 threads, each on its own chunks: every byte lands."""
    chunk = 256
    per_thread = 4
    pool = HostPool(THREADS * per_thread, chunk, num_threads=2, register_cuda=False)
    errors: list[BaseException] = []
    deadline = time.monotonic() + min(SECONDS / 2, 2.0)
    rounds = Counter[int]()

    def work(tid: int) -> None:
        rng = np.random.default_rng(tid)
        ids = list(range(tid * per_thread, (tid + 1) * per_thread))
        job = tid << 32
        try:
            while time.monotonic() < deadline:
                src = rng.integers(0, 256, (per_thread, chunk), dtype=np.uint8)
                back = np.zeros_like(src)
                pool.submit_store(job, src, range(per_thread), ids)
                pool.wait([job])
                pool.submit_load(job + 1, back, range(per_thread), ids)
                pool.wait([job + 1])
                assert (back == src).all()
                pool.gather(src[::-1].copy(), range(per_thread), ids)
                pool.scatter(back, range(per_thread), ids)
                assert (back == src[::-1]).all()
                job += 2
                rounds[tid] += 1
        except BaseException as e:
            errors.append(e)

    try:
        run_threads([lambda t=t: work(t) for t in range(THREADS)])
        if errors:
            raise errors[0]
        print(
            f"\nhost pool: {THREADS} threads, {sum(rounds.values())} rounds "
            "(2 jobs, a gather, a scatter)"
        )
        finished = pool.get_finished()
        assert all(ok for _, ok in finished)
        assert len(finished) == 2 * sum(rounds.values())
        assert len({j for j, _ in finished}) == len(finished)
    finally:
        pool.close()
