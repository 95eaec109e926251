"""Simulation speed of ``kvoffload.sim`` beside libCacheSim's on the same classic trace.

Classic mode: a seeded Zipf object trace (``--requests`` over ``--objects`` objects, exponent 0.8)
through kvoffload's manager (each implementation in ``--impls``) and through libCacheSim 0.3.5's
own C simulator (``process_trace``), LRU and ARC, at 1% and 10% of the objects; the best of
``--repeat`` runs (of ``--reference-repeat`` for the pure-Python reference, several times
slower). Serving mode: the default ``kvoffload sim`` workload (chat, 2,000 requests) at
1/8 of its working set. Prints a Markdown table (the README's).

Requests/s is requests over wall time of the replay (libCacheSim's includes reading its trace
file, kvoffload's trace is in memory). Chunk operations are key-level manager operations: a
lookup per request plus a touch per hit or a store and its completion per miss (serving mode:
every key passed to a manager call); libCacheSim's column applies the same count to its own hits
and misses.

    python tools/sim_speed.py --requests 1000000 --objects 100000 --repeat 3
"""

from __future__ import annotations

import argparse
import platform

from kvoffload.sim import (
    GeneratorConfig,
    SimConfig,
    SimResult,
    Workload,
    generate_workload,
    simulate,
    working_set,
    zipf_object_trace,
)
from kvoffload.sim.libcachesim_ref import available, run_libcachesim


def best_of(workload: Workload, cfg: SimConfig, repeat: int) -> SimResult:
    """The fastest of ``repeat`` identical runs."""
    return min((simulate(workload, cfg) for _ in range(repeat)), key=lambda r: r.wall_s)


def row(label: str, r: SimResult) -> tuple[str, str, str, float, float, float]:
    """One table row of a kvoffload run."""
    size = f"{r.num_chunks:,}"
    return (label, r.policy, size, r.miss_ratio, r.requests_per_s, r.chunk_ops_per_s)


def main() -> None:
    """Run the measurements and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--requests", type=int, default=1_000_000)
    parser.add_argument("--objects", type=int, default=100_000)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument(
        "--reference-repeat",
        type=int,
        default=1,
        help="runs of the pure-Python reference (best kept; default 1: it is several times slower)",
    )
    parser.add_argument("--impls", default="rust,reference")
    args = parser.parse_args()
    if min(args.repeat, args.reference_repeat) < 1:
        parser.error("--repeat and --reference-repeat must be at least 1")

    def runs_of(impl: str) -> int:
        runs: int = args.reference_repeat if impl == "reference" else args.repeat
        return runs

    trace = zipf_object_trace(args.requests, args.objects, 0.8, seed=0)
    sizes = [args.objects // 100, args.objects // 10]
    rows = []
    for policy in ("lru", "arc"):
        for size in sizes:
            for impl in args.impls.split(","):
                cfg = SimConfig(num_chunks=size, policy=policy, impl=impl)
                rows.append(row(f"kvoffload classic ({impl})", best_of(trace, cfg, runs_of(impl))))
            if available():
                runs = [run_libcachesim(trace, [size], [policy])[0] for _ in range(args.repeat)]
                run = min(runs, key=lambda r: r.wall_s)
                misses = round(run.miss_ratio * run.requests)
                ops = run.requests + (run.requests - misses) + 2 * misses
                rows.append(
                    (
                        "libCacheSim 0.3.5 (C)",
                        policy,
                        f"{size:,}",
                        run.miss_ratio,
                        run.requests_per_s,
                        ops / run.wall_s,
                    )
                )
    chat = generate_workload("chat", GeneratorConfig())
    size = working_set(chat) // 8
    for impl in args.impls.split(","):
        for policy in ("lru", "arc"):
            cfg = SimConfig(num_chunks=size, policy=policy, impl=impl)
            result = best_of(chat, cfg, runs_of(impl))
            rows.append(row(f"kvoffload serving, chat ({impl})", result))
    print(
        f"classic trace: {args.requests:,} requests over {args.objects:,} objects (Zipf 0.8); "
        f"best of {args.repeat} (the reference: {args.reference_repeat}); "
        f"Python {platform.python_version()}\n"
    )
    print("| simulator | policy | cache size | miss ratio | requests/s | chunk operations/s |")
    print("|---|---|---:|---:|---:|---:|")
    for name, policy, size_s, miss, rps, ops_s in rows:
        print(f"| {name} | {policy} | {size_s} | {miss:.4f} | {rps:,.0f} | {ops_s:,.0f} |")


if __name__ == "__main__":
    main()
