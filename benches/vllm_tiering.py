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
orchestration's own Python cost is in both columns. Needs vLLM's sources
(``tools/fetch_vllm.py``); not part of the test run.

    python benches/vllm_tiering.py                       # lru and arc, the example tier
    python benches/vllm_tiering.py --setups slow-failing request-level --steps 400
"""

from __future__ import annotations

import argparse
import gc
import logging
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))
sys.path.insert(0, str(ROOT / "tests"))

import vllm_oracle  # noqa: E402

import _tiering  # noqa: E402  (tests/ is not a package)


def run(policy: str, setup: str, chunks: int, steps: int, seed: int) -> list[list[int]]:
    """Each step's nanoseconds in each manager (vLLM's primary tier first)."""
    oracle = vllm_oracle.load()
    extra = {"eviction_policy": policy, "secondary_tiers": _tiering.SETUPS[setup]()}
    names = ("vllm", "kvoffload")
    managers = [_tiering.build(oracle, name, chunks, extra) for name in names]
    driver = _tiering.TieringRun(
        oracle,
        managers,
        names,
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
    return driver.step_ns


def main(argv: list[str] | None = None) -> int:
    """Print the per-step table."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", nargs="+", default=["lru", "arc"], choices=["lru", "arc"])
    parser.add_argument("--setups", nargs="+", default=["example"], choices=sorted(_tiering.SETUPS))
    parser.add_argument("--chunks", type=int, default=2000, help="primary tier chunks")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    logging.disable(logging.WARNING)  # vLLM's "out-of-tree spec" notice, once per manager
    print(
        "| policy | secondary tiers | steps | vLLM primary µs/step | kvoffload primary "
        "µs/step | p50 vLLM | p50 kvoffload | speed-up |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|")
    for policy in args.policies:
        for setup in args.setups:
            steps = run(policy, setup, args.chunks, args.steps, args.seed)
            theirs = [s[0] / 1000 for s in steps]
            ours = [s[1] / 1000 for s in steps]
            mean_t, mean_o = statistics.fmean(theirs), statistics.fmean(ours)
            print(
                f"| {policy} | {setup} | {len(steps)} | {mean_t:,.1f} | {mean_o:,.1f} | "
                f"{statistics.median(theirs):,.1f} | {statistics.median(ours):,.1f} | "
                f"{mean_t / mean_o:.2f}x |"
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
