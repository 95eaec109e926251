"""Scheduler time per step of vLLM 0.33.0's tiering offloading, with each CPU primary tier.

vLLM's ``TieringOffloadingManager`` orchestrates a CPU primary tier and secondary tiers in
Python; kvoffload can be that primary tier (``KVOffloadTieringOffloadingSpec``). This script
builds both managers through vLLM's ``OffloadingSpecFactory`` (vLLM's ``TieringOffloadingSpec``
and kvoffload's), each with the same secondary tiers (``tests/_tiering.py``'s setups), and
drives them side by side, call by call, through the same seeded scheduler
(``tests/_tiering.py``'s ``TieringRun``: arrivals, a lookup per key up to the first miss, loads
and touches of the hit prefix, batched stores completed a step later, finishes, cascades to the
secondary tiers and promotions back). Every answer is compared as it comes. Each call is timed
alone (``time.perf_counter_ns``, the cyclic GC paused); the table gives the whole tiering
manager's time per step, what the scheduler pays, so the secondary tiers' and the
orchestration's own Python cost is in both columns. ``--repeat`` runs each case that many times
and keeps each manager's fastest mean.

With ``--share`` a second run of each case times every call the tiering manager makes of its
primary tier as well (each wrapped, so both columns carry a wrapper's cost): the primary tier's
share of a step. Needs vLLM's sources (``tools/fetch_vllm.py``; exit status 2 without them);
not part of the test run.

    python benches/vllm_tiering.py                       # lru and arc, the example tier
    python benches/vllm_tiering.py --setups slow-failing request-level --steps 400
    python benches/vllm_tiering.py --setups all --share --json tiering.json
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import vllm_oracle  # noqa: E402

import _tiering  # noqa: E402  (tests/ is not a package)
from vllm_step import us_stats  # noqa: E402

#: The calls vLLM's tiering manager makes of its primary tier (timed with ``--share``).
PRIMARY_CALLS = (
    "lookup",
    "get_load_source",
    "prepare_load",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_request_finished",
    "prepare_read",
    "complete_read",
    "prepare_write",
    "complete_write",
    "take_events",
    "get_stats",
    "config_info",
    "reset_cache",
)

NAMES = ("vllm", "kvoffload")
#: The setups ``--setups all`` times: all but ``fs``, whose settled tier (tests/_tiering.py) waits
#: inside the step for its disk transfers to finish, which says nothing of either primary tier.
ALL_SETUPS = [setup for setup in sorted(_tiering.SETUPS) if setup != "fs"]


def _time_primary(manager: Any, spent: list[int], i: int) -> None:
    """Wrap the primary tier's calls so that their time adds to ``spent[i]`` (the outermost
    call only, where one calls another)."""
    primary = manager.primary_tier
    depth = [0]
    clock = time.perf_counter_ns

    def timed(call: Callable[..., Any]) -> Callable[..., Any]:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            depth[0] += 1
            t0 = clock()
            try:
                return call(*args, **kwargs)
            finally:
                depth[0] -= 1
                if not depth[0]:
                    spent[i] += clock() - t0

        return wrapper

    for name in PRIMARY_CALLS:
        setattr(primary, name, timed(getattr(primary, name)))


def run(
    policy: str, setup: str, chunks: int, steps: int, seed: int, share: bool = False
) -> tuple[list[list[int]], list[int]]:
    """Each step's nanoseconds in each manager (vLLM's primary tier first) and, with ``share``,
    the nanoseconds each manager's primary tier took in all (else zeros)."""
    oracle = vllm_oracle.load()
    extra = {"eviction_policy": policy, "secondary_tiers": _tiering.SETUPS[setup]()}
    managers = [_tiering.build(oracle, name, chunks, extra) for name in NAMES]
    primary = [0] * len(managers)
    if share:
        for i, m in enumerate(managers):
            _time_primary(m, primary, i)
    driver = _tiering.TieringRun(
        oracle,
        managers,
        NAMES,
        seed,
        docs=24,
        doc_keys=(8, 96),
        arrivals=(0, 1, 2, 3),
        batch=(16, 32),
        inspect=False,
    )
    gc.collect()
    gc.disable()
    try:
        driver.run(steps)
    finally:
        gc.enable()
    return driver.step_ns, primary


def measure(
    policy: str, setup: str, chunks: int, steps: int, seed: int, repeat: int, share: bool
) -> dict[str, Any]:
    """One case's row: per manager the fastest mean µs a step over ``repeat`` runs (with its
    run's p50 and p99), the speed-up, and with ``share`` each primary tier's share."""
    runs = [run(policy, setup, chunks, steps, seed)[0] for _ in range(repeat)]
    row: dict[str, Any] = {"policy": policy, "setup": setup, "chunks": chunks, "steps": steps}
    for i, name in enumerate(NAMES):
        ns = min(([s[i] for s in step_ns] for step_ns in runs), key=statistics.fmean)
        mean, p50, p99 = us_stats(ns)
        row[f"{name}_us_per_step_mean"] = mean
        row[f"{name}_us_per_step_p50"] = p50
        row[f"{name}_us_per_step_p99"] = p99
    row["speedup"] = row["vllm_us_per_step_mean"] / row["kvoffload_us_per_step_mean"]
    if share:
        step_ns, primary = run(policy, setup, chunks, steps, seed, share=True)
        for i, name in enumerate(NAMES):
            total = sum(s[i] for s in step_ns)
            row[f"{name}_primary_share"] = primary[i] / total if total else 0.0
    return row


def main(argv: list[str] | None = None) -> int:
    """Print the per-step table (and write it as JSON with ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["lru", "arc"], choices=["lru", "arc"])
    parser.add_argument(
        "--setups",
        nargs="+",
        default=["example"],
        choices=["all", *sorted(_tiering.SETUPS)],
        help="secondary tier setups (tests/_tiering.py), or all (all but fs)",
    )
    parser.add_argument("--chunks", type=int, default=2000, help="primary tier chunks")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeat", type=int, default=1, help="keep the fastest of N runs")
    parser.add_argument("--share", action="store_true", help="time the primary tiers' calls")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.chunks < 1 or args.steps < 1 or args.repeat < 1:
        parser.error("--chunks, --steps and --repeat must be at least 1")
    reason = vllm_oracle.unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    setups = ALL_SETUPS if "all" in args.setups else args.setups
    logging.disable(logging.WARNING)  # vLLM's "out-of-tree spec" notice, once per manager
    header = (
        "| policy | secondary tiers | steps | vLLM primary µs/step | kvoffload primary µs/step "
        "| p50 vLLM | p50 kvoffload | speed-up |"
    )
    columns = "|---|---|---:|---:|---:|---:|---:|---:|"
    if args.share:
        header += " primary share vLLM | primary share kvoffload |"
        columns += "---:|---:|"
    print(f"{header}\n{columns}")
    rows = []
    for policy in args.policies:
        for setup in setups:
            r = measure(policy, setup, args.chunks, args.steps, args.seed, args.repeat, args.share)
            rows.append(r)
            line = (
                f"| {policy} | {setup} | {r['steps']} | {r['vllm_us_per_step_mean']:,.1f} | "
                f"{r['kvoffload_us_per_step_mean']:,.1f} | {r['vllm_us_per_step_p50']:,.1f} | "
                f"{r['kvoffload_us_per_step_p50']:,.1f} | {r['speedup']:.2f}x |"
            )
            if args.share:
                line += f" {r['vllm_primary_share']:.0%} | {r['kvoffload_primary_share']:.0%} |"
            print(line, flush=True)
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
