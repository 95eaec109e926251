"""Thread stress: N threads share one Rust manager (and a HostPool) for a bounded time.

N threads (8 by default) drive one shared manager, and optionally one shared HostPool, with
mixed legal calls; a further thread checks the manager's invariants in a loop meanwhile, and the
chunk accounting is checked once they stop.

Example::

    python -X gil=0 tools/stress.py --seconds 60           # free-threaded CPython, GIL off
    python tools/stress.py --seconds 300 --policies lru arc sieve --long-prompts

Each thread has its own requests and keys, and all threads also offer a set of shared keys.
Per request: ``on_new_request``, ``lookup`` (two keys), ``lookup_prefix``, ``prepare_load`` /
``touch`` / ``complete_load`` of the hits, ``prepare_store`` / ``complete_store`` (10% failing)
of the rest (and, for a third of the stores that succeed, a copy to another tier:
``prepare_read`` / ``complete_load`` of the stored keys), ``on_request_finished``; now and then
``get_stats`` and ``take_events``, and thread 0 rarely ``reset_cache``. With ``--host`` each
thread also, every few requests, submits a store and a load job on its own HostPool chunks,
waits, gathers and scatters, and checks every byte.
With ``--tier POLICY`` the threads share a second manager too, which every request also uses on
its context before it finishes (``lookup_prefix`` and a store), as a second offloading tier
would: its state replaces the first manager's on the context, so the first manager's next store
makes a fresh one (taking up its LRU rank again).

The only exceptions allowed are ``KeyStateError`` from ``prepare_load`` (another thread evicted
the keys since this thread's ``lookup_prefix``: a legal outcome that changes nothing) or
``prepare_read`` (evicted since the store completed), and from
``complete_load`` (another thread reset the cache since the load was prepared). Anything else,
a thread still running past the deadline (a hang), a broken invariant or a wrong byte is a
failure; the command exits 1 on any. ``tests/test_threads.py`` runs this for a few seconds.
"""

from __future__ import annotations

import argparse
import random
import sys
import threading
import time
import traceback
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import kvoffload
from kvoffload import HostPool, KeyStateError, ReqContext, make_offload_key

NUM_CHUNKS = 96
SHARED = [make_offload_key(b"shared-%d" % i, 0) for i in range(24)]
#: HostPool chunks per thread, and the bytes of each.
HOST_CHUNKS = 4
HOST_CHUNK_BYTES = 256
#: A thread that has not stopped this long after the deadline is reported as hung.
HANG_SECONDS = 60.0


def check_accounting(m: Any) -> None:
    """Assert the chunk accounting once the threads have stopped.

    Every handed-out chunk is free xor resident, never twice, and nothing is pinned or pending.
    (`pool_state` and `resident` are two calls, so this is only meaningful while no other thread
    runs; `check_invariants` is one.)
    """
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


class HostRounds:
    """One thread's HostPool work on its own chunks, every byte checked."""

    def __init__(self, pool: HostPool, tid: int) -> None:
        self.pool, self.tid = pool, tid
        self.rng = np.random.default_rng(tid)
        self.ids = list(range(tid * HOST_CHUNKS, (tid + 1) * HOST_CHUNKS))
        self.job = tid << 32
        self.rounds = 0

    def round(self) -> None:
        """A store job, a load job (each waited for), a gather and a scatter."""
        pool, ids, job = self.pool, self.ids, self.job
        src = self.rng.integers(0, 256, (HOST_CHUNKS, HOST_CHUNK_BYTES), dtype=np.uint8)
        back = np.zeros_like(src)
        pool.submit_store(job, src, range(HOST_CHUNKS), ids)
        pool.wait([job])
        pool.submit_load(job + 1, back, range(HOST_CHUNKS), ids)
        pool.wait([job + 1])
        assert (back == src).all(), "a queued job lost bytes"
        pool.gather(src[::-1].copy(), range(HOST_CHUNKS), ids)
        pool.scatter(back, range(HOST_CHUNKS), ids)
        assert (back == src[::-1]).all(), "a direct copy lost bytes"
        self.job += 2
        self.rounds += 1


class Worker:
    """One thread's request loop; records what it did and any unexpected exception."""

    def __init__(
        self,
        m: Any | None,
        tid: int,
        deadline: float,
        long_prompts: bool = False,
        host: HostRounds | None = None,
        host_every: int = 1,
        tier: Any | None = None,
    ) -> None:
        self.m, self.tid, self.deadline = m, tid, deadline
        #: A second manager every request also uses, on the same context.
        self.tier = tier
        #: Prompts of 128+ keys: those calls release the GIL while the core works.
        self.long_prompts = long_prompts
        self.host, self.host_every = host, host_every
        self.rng = random.Random(tid)
        self.ops: Counter[str] = Counter()
        self.load_races = 0
        self.reset_races = 0
        self.error: BaseException | None = None
        self.trace = ""

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
        """Count and make one call."""
        self.ops[name] += 1
        return fn(*args)

    def request(self, req: int) -> None:
        """One request's calls, start to finish."""
        m, rng = self.m, self.rng
        if m is None:  # run() calls this only with a manager
            raise RuntimeError("Worker.request needs a manager")
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
        self.store(m, keys[hits:], ctx, "")
        if self.tier is not None:
            # The second tier replaces the first's state on the context; the first's next
            # store (a repeat offer: pending or stored keys, or refused ones offered again)
            # makes it a fresh one, which finishes.
            tier_hits = self.call("tier.lookup_prefix", self.tier.lookup_prefix, keys, ctx)
            self.store(self.tier, keys[tier_hits:], ctx, "tier.")
            self.call("tier.on_request_finished", self.tier.on_request_finished, ctx)
            self.store(m, keys[hits:], ctx, "")
        self.call("on_request_finished", m.on_request_finished, ctx)
        if self.tid == 0 and rng.random() < 0.001:
            self.call("reset_cache", m.reset_cache)
        if rng.random() < 0.05:
            self.call("get_stats", m.get_stats)
            self.call("take_events", lambda: list(m.take_events()))

    def store(self, m: Any, keys: list[bytes], ctx: ReqContext, prefix: str) -> None:
        """Offer ``keys`` to ``m`` and complete what it takes (10% as failed writes)."""
        out = self.call(prefix + "prepare_store", m.prepare_store, keys, ctx)
        if out is not None and out.keys_to_store:
            success = self.rng.random() < 0.9
            name = prefix + "complete_store"
            self.call(name, m.complete_store, out.keys_to_store, ctx, success)
            if success and self.rng.random() < 0.3:
                self.copy_out(m, out.keys_to_store, ctx, prefix)

    def copy_out(self, m: Any, keys: list[bytes], ctx: ReqContext, prefix: str) -> None:
        """Another tier's copy of stored keys: a read that records no access, then its end."""
        try:
            self.call(prefix + "prepare_read", m.prepare_read, keys, ctx)
        except KeyStateError:
            self.load_races += 1  # evicted by another thread since the store completed
            return
        try:
            self.call(prefix + "complete_load", m.complete_load, keys, ctx)
        except KeyStateError:
            self.reset_races += 1  # another thread reset the cache since the read

    def run(self) -> None:
        """Requests (and host rounds) until the deadline; an exception ends the thread."""
        try:
            req = 0
            while time.monotonic() < self.deadline:
                if self.m is not None:
                    self.request(req)
                if self.host is not None and req % self.host_every == 0:
                    self.call("host_round", self.host.round)
                req += 1
        except BaseException as e:  # reported by the main thread
            self.error = e
            self.trace = traceback.format_exc()


@dataclass
class Report:
    """What one stress run did and what went wrong."""

    policy: str | None
    threads: int
    seconds: float
    long_prompts: bool
    gil_enabled: bool
    #: Calls per thread, by name.
    ops: list[Counter[str]] = field(default_factory=list)
    load_races: int = 0
    reset_races: int = 0
    #: Concurrent `check_invariants` calls.
    checks: int = 0
    host_rounds: int = 0
    #: One line (or traceback) per failure; empty when the run passed.
    failures: list[str] = field(default_factory=list)
    #: The second tier's policy (None: no second tier).
    tier: str | None = None

    @property
    def calls(self) -> int:
        """Calls made by all threads."""
        return sum(sum(c.values()) for c in self.ops)

    def summary(self) -> str:
        """The run in a few lines: totals, calls per thread, races, failures."""
        total: Counter[str] = sum(self.ops, Counter())
        what = self.policy or "host pool only"
        if self.policy and self.tier:
            what += f" + {self.tier} tier"
        if self.policy and self.long_prompts:
            what += " (long prompts)"
        lines = [
            f"{what}: {self.threads} threads, {self.calls:,} calls in {self.seconds:.1f} s "
            f"(GIL {'on' if self.gil_enabled else 'off'}), {self.checks:,} concurrent invariant "
            f"checks, {self.host_rounds:,} host rounds, {self.load_races} load and "
            f"{self.reset_races} reset races, {len(self.failures)} failures",
            "  calls per thread: " + ", ".join(f"{sum(c.values()):,}" for c in self.ops),
            "  by call: " + ", ".join(f"{k} {v:,}" for k, v in sorted(total.items())),
        ]
        lines += [f"  FAILURE: {f}" for f in self.failures]
        return "\n".join(lines)


def _gil_enabled() -> bool:
    is_enabled = getattr(sys, "_is_gil_enabled", None)
    return True if is_enabled is None else bool(is_enabled())


def run(
    policy: str | None,
    *,
    threads: int = 8,
    seconds: float = 2.0,
    long_prompts: bool = False,
    host: bool = False,
    host_every: int = 8,
    tier: str | None = None,
) -> Report:
    """Run `threads` workers for `seconds` and report; never raises for what it finds.

    The workers share a manager with `policy` (None: no manager), with `tier` a second manager of
    that policy (see the module docs), and with `host` a HostPool (a round every `host_every`
    requests; every request when there is no manager). What went wrong is in `Report.failures`.
    """
    report = Report(policy, threads, seconds, long_prompts, _gil_enabled(), tier=tier)
    m = second = None
    if policy is not None:
        chunks = NUM_CHUNKS * 16 if long_prompts else NUM_CHUNKS
        m = kvoffload.CPUOffloadingManager(chunks, cache_policy=policy, enable_events=True)
        if tier is not None:
            second = kvoffload.CPUOffloadingManager(chunks // 2, cache_policy=tier)
    pool = (
        HostPool(threads * HOST_CHUNKS, HOST_CHUNK_BYTES, num_threads=2, register_cuda=False)
        if host
        else None
    )
    # The window opens once every thread has started (a start can take a scheduler round trip
    # on a busy machine, and the threads started last would otherwise get less of the window).
    deadline = float("inf")
    workers = [
        Worker(
            m,
            tid,
            deadline,
            long_prompts,
            HostRounds(pool, tid) if pool is not None else None,
            host_every if m is not None else 1,
            second,
        )
        for tid in range(threads)
    ]
    check_trace: list[str] = []
    targets: list[Callable[[], None]] = [w.run for w in workers]
    if m is not None:

        def checker() -> None:
            try:
                while time.monotonic() < deadline:
                    m.check_invariants()  # one call, under the manager's lock: a consistent view
                    if second is not None:
                        second.check_invariants()
                    report.checks += 1
            except BaseException:
                check_trace.append(traceback.format_exc())

        targets.append(checker)
    started = threading.Barrier(len(targets) + 1)

    def after_start(target: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            started.wait()
            target()

        return run

    ts = [threading.Thread(target=after_start(t), daemon=True) for t in targets]
    try:
        for t in ts:
            t.start()
        deadline = time.monotonic() + seconds
        for w in workers:
            w.deadline = deadline
        started.wait(timeout=HANG_SECONDS)
        for t in ts:
            t.join(timeout=max(0.0, deadline - time.monotonic()) + HANG_SECONDS)
        hung = [t.name for t in ts if t.is_alive()]
        if hung:
            report.failures.append(f"threads still running {HANG_SECONDS:.0f} s late: {hung}")
        report.failures += [f"thread {w.tid}: {w.trace}" for w in workers if w.error is not None]
        report.failures += [f"invariant checker: {t}" for t in check_trace]
        report.ops = [w.ops for w in workers]
        report.load_races = sum(w.load_races for w in workers)
        report.reset_races = sum(w.reset_races for w in workers)
        if hung:
            return report  # the manager may be mid-call: its accounting is not final
        for name, mgr in (("", m), ("the second tier's ", second)):
            if mgr is None:
                continue
            try:
                check_accounting(mgr)
            except BaseException:
                report.failures.append(f"{name}accounting after the run: {traceback.format_exc()}")
        if pool is not None:
            report.host_rounds = sum(w.host.rounds for w in workers if w.host is not None)
            finished = pool.get_finished()
            if not all(ok for _, ok in finished):
                report.failures.append("a HostPool job failed")
            if len(finished) != 2 * report.host_rounds:
                report.failures.append(
                    f"{len(finished)} jobs reported for {report.host_rounds} rounds (want 2 each)"
                )
            if len({j for j, _ in finished}) != len(finished):
                report.failures.append("a HostPool job was reported twice")
    finally:
        if pool is not None and not any(t.is_alive() for t in ts):
            pool.close()
    return report


def main() -> None:
    """Command line: run each policy in turn and print what happened; exit 1 on a failure."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="per policy (default 60)")
    p.add_argument("--threads", type=int, default=8)
    p.add_argument("--policies", nargs="+", default=["lru"])
    p.add_argument("--long-prompts", action="store_true", help="130-200 keys per request")
    p.add_argument("--tier", help="a second manager of this policy on the same contexts")
    p.add_argument(
        "--host", action=argparse.BooleanOptionalAction, default=True, help="HostPool rounds too"
    )
    a = p.parse_args()
    print(f"{sys.version.split()[0]} {sys.implementation.name}, GIL enabled: {_gil_enabled()}")
    failed = False
    for policy in a.policies:
        r = run(
            policy,
            threads=a.threads,
            seconds=a.seconds,
            long_prompts=a.long_prompts,
            host=a.host,
            tier=a.tier,
        )
        print(r.summary(), flush=True)
        failed |= bool(r.failures)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
