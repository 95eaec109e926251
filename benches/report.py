"""Print the FFI benchmark as a markdown table for the README (no pytest needed).

Runs the same cases as ``test_bench_ffi.py`` (see ``cases.py``) timeit-style: each operation is
timed as a run of rounds (at least ~20 ms, GC paused) and the minimum over ``--repeat`` runs is
kept, the implementations' runs interleaved (each pool filled first), so that every ratio
compares minimums taken over the same stretch of time. Rows: operation x pool size; columns:
ns/key per implementation and the speed-up over the reference and over vLLM 0.33.0's own manager
(lru and arc only; its ``lookup_prefix`` row is 32 single lookups, see ``cases.py``). Then, per
implementation, how its per-key cost grows from the smallest to the largest pool (1.0x means
flat).

    python benches/report.py                       # lru, 10^3 / 10^5 / 10^6 chunks
    python benches/report.py --policies lru,arc,fifo,sieve,s3fifo,2q,slru --sizes 100000
    python benches/report.py --policies lru,arc --sizes 1000,100000 --json out.json
    python benches/report.py --policies lru,arc --sizes 100000 --positions  # token positions set
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

from cases import (
    IMPLS,
    LABELS,
    OPERATIONS,
    SIZES,
    VLLM,
    CacheRegistry,
    FilledCache,
    time_op_interleaved,
    unavailable,
)

BASELINE = "reference"
SUBJECT = "rust"
#: What each speed-up column compares: kvoffload's Rust manager against each of these.
BASELINES = (BASELINE, VLLM)


def _ints(text: str) -> list[int]:
    return [int(part) for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", type=_ints, default=list(SIZES), help="pool sizes in chunks")
    parser.add_argument("--policies", type=_names, default=["lru"], help="comma-separated (lru)")
    parser.add_argument("--impls", type=_names, default=list(IMPLS), help="comma-separated")
    parser.add_argument("--ops", type=_names, default=list(OPERATIONS), help="comma-separated")
    parser.add_argument("--repeat", type=int, default=7, help="runs per case; min kept (7)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers as JSON")
    parser.add_argument(
        "--positions",
        action="store_true",
        help="record each key's token position on the context, as vLLM's scheduler does",
    )
    args = parser.parse_args(argv)

    impls = []
    for impl in args.impls:
        reason = unavailable(impl)
        if reason is None:
            impls.append(impl)
        else:
            print(f"report: skipping {impl} ({reason})", file=sys.stderr)
    if not impls:
        print("report: no implementation could be loaded", file=sys.stderr)
        return 2

    # results[policy][op][size][impl] = ns per key
    results: dict[str, dict[str, dict[int, dict[str, float]]]] = {}
    fills: dict[str, float] = {}
    registry = CacheRegistry()
    for policy in args.policies:
        per_op = results.setdefault(policy, {op: {} for op in args.ops})
        for size in args.sizes:
            caches: dict[str, FilledCache] = {}
            for impl in impls:
                reason = unavailable(impl, policy)
                if reason is not None:
                    if impl != VLLM or policy in ("lru", "arc"):
                        print(f"report: skipping {impl}/{policy} ({reason})", file=sys.stderr)
                    continue
                started = time.perf_counter()
                caches[impl] = registry.get(impl, policy, size, positions=args.positions)
                fills[f"{policy}/{size}/{impl}"] = caches[impl].fill_s
                print(
                    f"report: {policy} {size:>9,} chunks {impl:<10} filled in "
                    f"{time.perf_counter() - started:.1f} s",
                    file=sys.stderr,
                )
            # Every implementation's runs of an operation interleaved (see time_op_interleaved).
            for op in args.ops:
                by_impl = time_op_interleaved(caches, op, repeat=args.repeat)
                per_op[op].setdefault(size, {}).update(by_impl)
                shown = "  ".join(f"{i} {ns:,.1f}" for i, ns in by_impl.items())
                print(f"report:   {op:<14} ns/key: {shown}", file=sys.stderr)
            caches.clear()

    print(_markdown(results, impls, args))
    if args.json is not None:
        doc = {
            "python": sys.version,
            "platform": platform.platform(),
            "repeat": args.repeat,
            "positions": args.positions,
            "fill_s": fills,
            "ns_per_key": {
                policy: {op: {str(s): v for s, v in sizes.items()} for op, sizes in ops.items()}
                for policy, ops in results.items()
            },
        }
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


def _markdown(
    results: dict[str, dict[str, dict[int, dict[str, float]]]],
    impls: list[str],
    args: argparse.Namespace,
) -> str:
    lines: list[str] = []
    for policy, per_op in results.items():
        present = {i for sizes in per_op.values() for by_impl in sizes.values() for i in by_impl}
        shown = [i for i in impls if i in present]
        bases = [b for b in BASELINES if b in present and SUBJECT in present]
        header = ["operation (32 keys)", "chunks", *(f"{i} ns/key" for i in shown)]
        header += [f"{SUBJECT} vs {b}" for b in bases]
        lines += [
            f"**{policy}** policy, ns per key (min of {args.repeat} runs)",
            "",
            "| " + " | ".join(header) + " |",
            "|" + "|".join(["---", "---:"] + ["---:"] * (len(header) - 2)) + "|",
        ]
        for op, sizes in per_op.items():
            for size, by_impl in sizes.items():
                cells = [LABELS[op], f"{size:,}", *(f"{by_impl[i]:,.1f}" for i in shown)]
                cells += [f"{by_impl[b] / by_impl[SUBJECT]:,.1f}x" for b in bases]
                lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
        if VLLM in shown:
            lines += [
                f"{VLLM} has no `lookup_prefix`: its row is 32 single `lookup`s, as its connector "
                "does.",
                "",
            ]
        small, large = min(args.sizes), max(args.sizes)
        if small != large:
            lines.append(f"Per-key cost at {large:,} vs {small:,} chunks ({policy}):")
            lines.append("")
            for impl in shown:
                ratios = ", ".join(
                    f"{op} {sizes[large][impl] / sizes[small][impl]:.2f}x"
                    for op, sizes in per_op.items()
                )
                lines.append(f"- {impl}: {ratios}")
            lines.append("")
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.exit(main())
