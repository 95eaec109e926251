"""``kvoffload sim``: replay a workload through the real manager for several policies and sizes.

With no arguments it runs the embedded multi-turn chat workload (2,000 requests) under lru and
arc at six cache sizes (1/64 to 1/2 of the working set), in parallel processes, prints the
side-by-side table at the middle size and the miss-ratio table, and writes sim.png, sim.svg,
sim.json and sim.csv into --out. A trace file in libCacheSim's txt, csv or oracleGeneral format
runs in classic mode (one object per request; sizes count objects); --libcachesim adds
libCacheSim's own miss ratios and speed on the same trace.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
from pathlib import Path

from kvoffload._common import BUILTIN_POLICIES, check_distinct
from kvoffload.errors import InvalidArgumentError, KVOffloadError
from kvoffload.sim import libcachesim_ref
from kvoffload.sim.api import check_curve, load_workload, miss_ratio_curve, working_set
from kvoffload.sim.engine import SimConfig, require_lookups
from kvoffload.sim.generators import GENERATORS, GeneratorConfig
from kvoffload.sim.results import SimResult, format_comparison, format_curve, write_csv, write_json
from kvoffload.sim.traces import CsvColumns, ObjectTrace

__all__ = ["add_arguments", "run"]

#: Default cache sizes, as fractions of the working set.
DEFAULT_FRACTIONS = (1 / 64, 1 / 32, 1 / 16, 1 / 8, 1 / 4, 1 / 2)


def _csv_ints(text: str) -> list[int]:
    try:
        return [int(x.replace("_", "")) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected comma-separated integers, got {text!r}"
        ) from None


def _names(option: str, text: str) -> list[str]:
    """The comma-separated names of ``option``, none twice (results share a column by name)."""
    names = [p for p in text.split(",") if p]
    check_distinct(option, names)
    return names


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``kvoffload sim``."""
    sim, gen = SimConfig(), GeneratorConfig()
    add = parser.add_argument
    add(
        "--workload",
        default="chat",
        help=f"{', '.join(GENERATORS)}, zipf-objects (classic) or a trace path (chat)",
    )
    add("--format", choices=("jsonl", "txt", "csv", "oracleGeneral"), help="trace format")
    add(
        "--shadows",
        default="",
        help="comma-separated what-if policies run beside each live one (their hit rates are "
        "in the JSON/CSV results)",
    )
    add(
        "--policies",
        default="lru,arc",
        help=f"comma-separated cache policies (lru,arc); built in: {','.join(BUILTIN_POLICIES)}",
    )
    add("--impl", default=sim.impl, help="rust, reference or module:Class (rust)")
    add(
        "--cache-policy-module-path",
        help="module of an out-of-tree policy class (vLLM's CachePolicy interface); imported "
        "from the current folder too, as with python -m",
    )
    add("--sizes", type=_csv_ints, help="cache sizes in chunks (default: fractions of the WSS)")
    add("--chunks", type=int, help="size of the side-by-side table (default: a middle size)")
    add("--requests", type=int, default=gen.requests, help="generated requests (%(default)s)")
    add("--seed", type=int, default=gen.seed, help="generator seed (%(default)s)")
    add("--kv-groups", type=int, default=gen.kv_groups, help="KV groups (%(default)s)")
    add("--rate", type=float, default=gen.rate, help="arrivals per second (%(default)s)")
    add("--alpha", type=float, default=gen.alpha, help="Zipf exponent, >= 0 (%(default)s)")
    add("--max-running", type=int, default=sim.max_running, help="requests in flight (%(default)s)")
    add(
        "--store-threshold",
        type=int,
        default=sim.store_threshold,
        help="admission: a key is stored at its Nth offer; 0 and 1 store at the first "
        "(%(default)s)",
    )
    add(
        "--store-failure-prob",
        type=float,
        default=sim.store_failure_prob,
        help="probability that a store's transfer fails, 0 to 1 (%(default)s)",
    )
    add("--chunk-bytes", type=int, default=sim.chunk_bytes, help="bytes per chunk (%(default)s)")
    add(
        "--bandwidth",
        type=float,
        default=sim.transfer_bytes_per_s / 1e9,
        help="transfer bandwidth between the tiers, GB/s (%(default)s)",
    )
    add(
        "--prefill-rate",
        type=float,
        default=sim.prefill_tokens_per_s,
        help="prefill speed, tokens/s (%(default)s)",
    )
    add(
        "--decode-rate",
        type=float,
        default=sim.decode_tokens_per_s,
        help="decode speed, tokens/s per request (%(default)s)",
    )
    add("--csv-columns", default="1,2,3", help="CSV time,obj_id,size columns, 1-based, 0=absent")
    add("--csv-header", action="store_true", help="the CSV trace has a header line")
    add(
        "--libcachesim",
        action="store_true",
        help="classic mode: also run libCacheSim (lru, arc, arc-paper, LibCacheSimArc)",
    )
    add("--jobs", type=int, help="parallel processes (default: CPUs, at most 4)")
    add("--out", type=Path, default=Path("kvoffload-sim"), help="output folder (%(default)s)")
    add("--no-plot", action="store_true", help="do not write the plot")
    add("--no-progress", action="store_true", help="no progress bar")


def _csv_columns(args: argparse.Namespace) -> CsvColumns:
    try:
        cols = _csv_ints(args.csv_columns)
    except argparse.ArgumentTypeError:
        cols = []
    if len(cols) != 3 or cols[1] < 1 or min(cols) < 0:
        raise InvalidArgumentError(
            "--csv-columns needs time,obj_id,size numbers (1-based; obj_id >= 1, 0: absent), "
            f"got {args.csv_columns!r}"
        )
    time_col, obj_col, size_col = cols
    return CsvColumns(obj_col, time_col or None, size_col or None, has_header=args.csv_header)


def run(args: argparse.Namespace) -> int:
    """Run ``kvoffload sim``; return the exit status.

    Modules named by ``--cache-policy-module-path`` or ``--impl module:Class`` are imported from
    the current folder too, as ``python -m`` would (the folder goes first on ``sys.path`` for
    the run; the worker processes inherit it).
    """
    cwd = os.getcwd()
    sys.path.insert(0, cwd)
    try:
        return _run(args)
    except (KVOffloadError, OSError) as e:
        print(f"kvoffload sim: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # the worker processes are gone; no output was written
        print("\nkvoffload sim: interrupted", file=sys.stderr)
        return 130
    finally:
        sys.path.remove(cwd)


def _run(args: argparse.Namespace) -> int:
    gen = GeneratorConfig(args.requests, args.seed, args.kv_groups, args.rate, args.alpha)
    workload = load_workload(
        args.workload, fmt=args.format, generator=gen, csv_columns=_csv_columns(args)
    )
    require_lookups(workload)
    name = Path(args.workload).name
    classic = isinstance(workload, ObjectTrace)
    wss = working_set(workload)
    if args.sizes == []:
        raise InvalidArgumentError("--sizes names no size (leave it out for the default sizes)")
    # Ascending and distinct (as the curve reports them), so that the table's default size is
    # the middle one whatever order the sizes were given in.
    sizes = sorted(set(args.sizes or {max(1, int(wss * f)) for f in DEFAULT_FRACTIONS}))
    table_size = args.chunks if args.chunks is not None else sizes[(len(sizes) - 1) // 2]
    if table_size not in sizes:
        sizes = sorted({*sizes, table_size})
    policies = _names("--policies", args.policies)
    config = SimConfig(
        impl=args.impl,
        cache_policy_module_path=args.cache_policy_module_path,
        store_threshold=args.store_threshold,
        shadow_policies=tuple(_names("--shadows", args.shadows)),
        max_running=args.max_running,
        store_failure_prob=args.store_failure_prob,
        chunk_bytes=args.chunk_bytes,
        transfer_bytes_per_s=args.bandwidth * 1e9,
        prefill_tokens_per_s=args.prefill_rate,
        decode_tokens_per_s=args.decode_rate,
    )
    if args.jobs is not None and args.jobs < 0:
        raise InvalidArgumentError(f"--jobs must be >= 1 (0: the default), got {args.jobs}")
    check_curve(workload, sizes, policies, config)  # before the header is printed
    # An unusable output folder fails now, not after the runs.
    args.out.mkdir(parents=True, exist_ok=True)
    if not os.access(args.out, os.W_OK | os.X_OK):
        raise InvalidArgumentError(f"--out {args.out}: the folder is not writable")
    mode = "classic (one object per request)" if classic else "serving"
    unit = "objects" if classic else "chunks"
    print(
        f"kvoffload sim: {name}, {len(workload):,} requests, working set {wss:,} {unit}, "
        f"{mode} mode, impl {args.impl}, policies {', '.join(policies)}, "
        f"sizes {', '.join(f'{s:,}' for s in sizes)}"
    )
    results = miss_ratio_curve(
        workload,
        sizes,
        policies,
        config,
        name=name,
        jobs=args.jobs,
        progress=not args.no_progress,
    )
    at_size = [r for r in results if r.num_chunks == table_size]
    print(f"\n{name} at {table_size:,} {unit}:\n")
    print(format_comparison(at_size))
    print(f"\nmiss ratio ({'requests' if classic else 'chunks'}) by cache size:\n")
    print(format_curve(results))
    speed = _speed_lines(results)
    lcs_runs = []
    if args.libcachesim and isinstance(workload, ObjectTrace):
        lcs_runs = _libcachesim(workload, sizes, policies)
    elif args.libcachesim:
        print(
            "\nnote: --libcachesim compares classic mode only (an object trace: txt, csv, "
            f"oracleGeneral or zipf-objects); {name} ran in serving mode, so nothing was compared"
        )
    if lcs_runs:
        print("\n" + _format_libcachesim(lcs_runs, results))
    print("\n" + speed)
    write_json(
        results,
        args.out / "sim.json",
        workload=name,
        mode="classic" if classic else "serving",
        working_set=wss,
        config=dataclasses.asdict(config),
        libcachesim=[dataclasses.asdict(r) for r in lcs_runs],
    )
    write_csv(results, args.out / "sim.csv")
    written = [args.out / "sim.json", args.out / "sim.csv"]
    if not args.no_plot:
        from kvoffload.sim.plot import plot_curves

        title = f"{name}: miss ratio by cache size ({args.impl} manager)"
        written += plot_curves(results, args.out / "sim", title)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


def _format_libcachesim(
    runs: list[libcachesim_ref.LibCacheSimRun], results: list[SimResult]
) -> str:
    lines = ["libCacheSim 0.3.5 on the same trace (request miss ratio, requests/s):", ""]
    for run in runs:
        ours = next(r for r in results if (r.policy, r.num_chunks) == (run.policy, run.num_objects))
        misses = round(run.miss_ratio * run.requests)
        verdict = "same" if ours.requests - ours.hit_chunks == misses else "differs"
        if verdict == "differs" and run.policy == "arc":
            verdict += ": vLLM's ARC is not libCacheSim's (use arc-paper), see docs/sim.md"
        lines.append(
            f"  {run.policy} at {run.num_objects:,}: libCacheSim {run.miss_ratio:.5f}, "
            f"kvoffload {ours.miss_ratio:.5f} ({verdict}); "
            f"{run.requests_per_s:,.0f} vs {ours.requests_per_s:,.0f} requests/s"
        )
    return "\n".join(lines)


def _speed_lines(results: list[SimResult]) -> str:
    reqs = sum(r.requests for r in results)
    ops = sum(r.chunk_ops for r in results)
    wall = sum(r.wall_s for r in results)
    return (
        f"simulation speed: {reqs / wall:,.0f} requests/s, {ops / wall:,.0f} chunk operations/s "
        f"(per process, over {len(results)} runs)"
        if wall
        else "simulation speed: -"
    )


def _libcachesim(
    workload: ObjectTrace, sizes: list[int], policies: list[str]
) -> list[libcachesim_ref.LibCacheSimRun]:
    known = [p for p in policies if p in libcachesim_ref.LIBCACHESIM_POLICIES]
    unknown = [p for p in policies if p not in known]
    if unknown:
        print(
            f"\nnote: libCacheSim is not compared for {', '.join(unknown)}: it has a counterpart "
            f"only for {', '.join(libcachesim_ref.LIBCACHESIM_POLICIES)}"
        )
    if not libcachesim_ref.available():
        print("libcachesim is not installed (pip install libcachesim); skipping the comparison")
        return []
    return libcachesim_ref.run_libcachesim(workload, sizes, known) if known else []
