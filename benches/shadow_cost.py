"""The cost of what-if shadows: the `kvoffload bench` workload with 0, 1, 2 and 4 shadows.

Run: ``python benches/shadow_cost.py [--requests N] [--repeat R]``. Prints, per shadow count,
the manager time per scheduler step (fastest of ``R`` replays, all side by side in one run), the
cost added per shadow, and each policy's hit rate on the same traffic.
"""

from __future__ import annotations

import argparse
import time

from kvoffload import CPUOffloadingManager
from kvoffload.workload import WorkloadConfig, generate, replay

SHADOW_SETS: list[list[str]] = [[], ["arc"], ["arc", "s3fifo"], ["arc", "s3fifo", "sieve", "lfu"]]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    workload = generate(WorkloadConfig(requests=args.requests))
    best: dict[int, float] = {}
    reports = {}
    for _ in range(args.repeat):
        for i, shadows in enumerate(SHADOW_SETS):
            m = CPUOffloadingManager(args.chunks, cache_policy="lru", shadow_policies=shadows)
            started = time.perf_counter()
            result = replay(m, workload)
            _ = time.perf_counter() - started
            per_step = sum(result.step_ns) / max(len(result.step_ns), 1) / 1e3
            best[i] = min(best.get(i, float("inf")), per_step)
            if shadows:
                reports[i] = m.shadow_report()  # type: ignore[attr-defined]
    base = best[0]
    head = f"{args.requests} requests, {args.chunks} chunks, live policy lru"
    print(f"{head} (fastest of {args.repeat})")
    print("| shadows | µs per step | added per shadow |")
    print("|---|---:|---:|")
    for i, shadows in enumerate(SHADOW_SETS):
        added = (best[i] - base) / len(shadows) if shadows else 0.0
        names = ", ".join(shadows) or "(none)"
        print(f"| {names} | {best[i]:,.1f} | {added:,.1f} µs ({added / base:.0%}) |")
    print()
    print("| policy | lookups | hits | hit rate |")
    print("|---|---:|---:|---:|")
    for c in reports[len(SHADOW_SETS) - 1]:
        print(f"| {c.policy} ({c.role}) | {c.lookups:,} | {c.hits:,} | {c.hit_rate:.3f} |")


if __name__ == "__main__":
    main()
