"""Soak run: millions of legal manager calls with churn, watching for leaks.

Example::

    python tools/soak.py --ops 10000000 --policy lru

Requests draw keys from a fixed population of prebuilt ``bytes`` objects (some hot, most cold,
so that the cache churns), look them up, load the hits, store the misses (5% of stores fail),
touch, finish, and drain events and stats; every 200,000 calls (from 150,000 on) the cache is
reset. An operation is one manager call. Reported after the warm-up (10% of the calls) and at
the end: the process RSS, the number of gc-tracked Python objects, the extra references held on
a sample of key objects, and the chunk accounting (pool, residents, ref counts). At the end every
store is complete and every load released, so nothing may be pinned or pending; after a final
``reset_cache`` the sampled keys must be back at their starting reference counts.
"""

from __future__ import annotations

import argparse
import gc
import os
import random
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import kvoffload
from kvoffload import ReqContext, make_offload_key


def rss_bytes() -> int:
    """Resident set size of this process (Linux ``/proc``; 0 elsewhere)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0


@dataclass
class Snapshot:
    """What a leak would show: memory, live objects, extra key references, chunk accounting."""

    ops: int
    rss: int
    gc_objects: int
    key_refs: int
    resident: int
    free: int
    fresh: int


@dataclass
class Report:
    """The soak's results."""

    ops: int = 0
    keys: int = 0
    requests: int = 0
    #: Key objects whose reference counts are followed.
    sampled_keys: int = 0
    seconds: float = 0.0
    warm: Snapshot | None = None
    end: Snapshot | None = None
    #: Sampled keys' reference counts minus their starting counts, after the final reset.
    leaked_refs: int = 0
    snapshots: list[Snapshot] = field(default_factory=list)


def key_refs(keys: Sequence[bytes]) -> list[int]:
    """The reference count of each key object (always counted the same way)."""
    return [sys.getrefcount(k) for k in keys]


def check_chunks(m: Any, *, quiescent: bool) -> tuple[int, int, int]:
    """Assert the chunk accounting; returns (resident, free, handed-out) counts."""
    m.check_invariants()
    fresh, free = m.pool_state()
    resident = m.resident()
    chunks = {c for c, _ in resident.values()}
    assert len(chunks) == len(resident), "a chunk holds two keys"
    assert len(set(free)) == len(free), "a chunk is free twice"
    assert not chunks & set(free), "a resident chunk is free"
    assert len(free) + len(resident) == fresh <= m.num_chunks, "a chunk went missing"
    if quiescent:
        assert all(ref == 0 for _, ref in resident.values()), "a chunk is pinned or pending"
    return len(resident), len(free), fresh


def soak(
    ops: int,
    *,
    policy: str = "lru",
    num_chunks: int = 4096,
    seed: int = 0,
    reset_every: int = 200_000,
    log: bool = False,
) -> Report:
    """Run about ``ops`` manager calls; see the module docstring."""
    rng = random.Random(seed)
    population = [make_offload_key(b"soak-%d" % i, i % 2) for i in range(8 * num_chunks)]
    hot = population[: num_chunks // 4]
    sample = population[:: max(1, len(population) // 64)]
    base_refs = key_refs(sample)
    m = kvoffload.CPUOffloadingManager(num_chunks, cache_policy=policy, enable_events=True)
    report = Report(sampled_keys=len(sample))
    warm_at = ops // 10
    start = time.perf_counter()
    n = 0

    def snapshot() -> Snapshot:
        gc.collect()
        resident, free, fresh = check_chunks(m, quiescent=True)
        refs = sum(key_refs(sample)) - sum(base_refs)
        # Less the snapshots kept so far (gc-tracked dataclasses themselves).
        live = len(gc.get_objects()) - len(report.snapshots)
        snap = Snapshot(n, rss_bytes(), live, refs, resident, free, fresh)
        report.snapshots.append(snap)
        if log:
            print(
                f"{n:>11,} ops  rss {snap.rss / 2**20:8.1f} MiB  gc objects {snap.gc_objects:>8,}"
                f"  sample refs +{refs:<4} resident {resident:>6,} free {free:>6,}",
                flush=True,
            )
        return snap

    next_reset = reset_every * 3 // 4  # off the snapshot points, which then see a full cache
    next_report = max(ops // 20, 1)
    while n < ops:
        ctx = ReqContext(f"r{report.requests}")
        report.requests += 1
        size = rng.randrange(1, 33)
        keys = list(
            dict.fromkeys(
                rng.choice(hot) if rng.random() < 0.5 else rng.choice(population)
                for _ in range(size)
            )
        )
        report.keys += len(keys)
        for i, key in enumerate(keys):
            ctx.set_offload_key_position(key, 16 * (i + 1))
        m.on_new_request(ctx)
        m.lookup(keys[0], ctx)
        hits = m.lookup_prefix(keys, ctx)
        n += 3
        if hits:
            m.prepare_load(keys[:hits], ctx)
            m.touch(keys[:hits], ctx)
            m.complete_load(keys[:hits], ctx)
            n += 3
        out = m.prepare_store(keys[hits:], ctx)
        n += 1
        if out is not None and out.keys_to_store:
            m.complete_store(out.keys_to_store, ctx, rng.random() >= 0.05)
            n += 1
        m.on_request_finished(ctx)
        for _ in m.take_events():
            pass
        m.get_stats()
        n += 3
        if n >= next_reset:
            m.reset_cache()
            n += 1
            next_reset += reset_every
        if report.warm is None and n >= warm_at:
            report.warm = snapshot()
        elif n >= next_report and log:
            snapshot()
        if n >= next_report:
            next_report += max(ops // 20, 1)
    report.ops = n
    report.end = snapshot()
    if report.warm is None:
        report.warm = report.end
    report.seconds = time.perf_counter() - start
    m.reset_cache()
    assert m.resident() == {}
    del out, ctx, keys
    gc.collect()
    report.leaked_refs = sum(key_refs(sample)) - sum(base_refs)
    return report


def main() -> None:
    """Command line: run the soak and print the figures."""
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ops", type=int, default=10_000_000)
    p.add_argument("--policy", default="lru")
    p.add_argument("--chunks", type=int, default=4096)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args()
    r = soak(a.ops, policy=a.policy, num_chunks=a.chunks, seed=a.seed, log=True)
    assert r.warm is not None
    assert r.end is not None
    print(
        f"\n{r.ops:,} calls ({r.keys:,} keys in {r.requests:,} requests, policy {a.policy}, "
        f"{a.chunks} chunks) in {r.seconds:.0f} s\n"
        f"RSS after warm-up {r.warm.rss / 2**20:.1f} MiB, at the end {r.end.rss / 2**20:.1f} MiB"
        f" (drift {(r.end.rss - r.warm.rss) / 2**20:+.2f} MiB)\n"
        f"gc-tracked objects {r.warm.gc_objects:,} -> {r.end.gc_objects:,} "
        f"({r.end.gc_objects - r.warm.gc_objects:+,})\n"
        f"sampled key references after the final reset: {r.leaked_refs:+d}\n"
        f"chunks at the end: {r.end.resident} resident + {r.end.free} free = {r.end.fresh} "
        f"handed out of {a.chunks}"
    )


if __name__ == "__main__":
    main()
