"""Manager time per scheduler step in vLLM 0.33.0: its Python policy, RustLRU/RustARC, kvoffload.

Three managers, each built by a vLLM spec from ``kv_connector_extra_config`` exactly as vLLM's
connector builds it, run the same seeded workload (``kvoffload.workload``'s scheduler-like
replay, looking keys up one by one as vLLM's connector does, with vLLM's own ``ReqContext``):

- ``vllm``: vLLM's ``CPUOffloadingManager`` with its Python LRU (or ARC);
- ``vllm+rust-policy``: the same manager with ``RustLRU`` (``RustARC``) from
  ``kvoffload.integrations.vllm``, loaded through ``cache_policy_module_path``;
- ``kvoffload``: kvoffload's Rust manager, through ``KVOffloadCPUOffloadingSpec``;
- ``kvoffload (own types)``: the same manager built directly, answering with kvoffload's types
  and reading kvoffload's ``ReqContext`` (what returning vLLM's types costs: the difference).

All must give identical answers (a digest over every answer and the final stats); the
table gives the manager's time per scheduler step (mean, median, 99th percentile, over the steps
of the fastest of ``--repeat`` replays; the managers take turns, one replay each per round),
the nanoseconds per key passed, and the speed-up over vLLM's own manager. Needs vLLM's
sources (``tools/fetch_vllm.py``); not part of the test run.

    python benches/vllm_step.py                          # lru and arc, 2,000 requests
    python benches/vllm_step.py --policies lru --requests 500 --repeat 3 --json out.json
    python benches/vllm_step.py --events --store-threshold 2 --kv-groups 2   # other settings
"""

from __future__ import annotations

import argparse
import functools
import json
import platform
import statistics
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import vllm_oracle  # noqa: E402

from kvoffload import CPUOffloadingManager  # noqa: E402
from kvoffload.workload import ReplayResult, WorkloadConfig, generate, replay  # noqa: E402

MODULE = "kvoffload.integrations.vllm"
RUST_POLICY = {"lru": "RustLRU", "arc": "RustARC"}
OWN_TYPES = "kvoffload (own types)"


def extra_configs(policy: str, store_threshold: int = 0) -> dict[str, dict[str, Any]]:
    """``kv_connector_extra_config`` of each manager (``cpu_bytes_to_use`` is added later);
    ``store_threshold`` 2 or more turns on vLLM's admission threshold in all of them."""
    shared: dict[str, Any] = {"store_threshold": store_threshold} if store_threshold else {}
    return {
        "vllm": {"eviction_policy": policy, **shared},
        "vllm+rust-policy": {
            "eviction_policy": RUST_POLICY[policy],
            "cache_policy_module_path": MODULE,
            **shared,
        },
        "kvoffload": {
            "spec_name": "KVOffloadCPUOffloadingSpec",
            "spec_module_path": MODULE,
            "eviction_policy": policy,
            **shared,
        },
    }


def build(oracle: Any, chunks: int, extra: dict[str, Any], events: bool) -> Callable[[], Any]:
    """A factory of fresh managers, each built through vLLM's OffloadingSpecFactory."""

    def make() -> Any:
        config = vllm_oracle.offloading_config(oracle, chunks, extra, events)
        spec = oracle.factory.OffloadingSpecFactory.create_spec(config)
        return spec.get_manager()

    return make


def run_one(
    oracle: Any, name: str, make: Callable[[], Any], workload: Any, events: bool
) -> ReplayResult:
    """One replay on a fresh manager, in vLLM's types (kvoffload's for the "own types" row)."""
    if name == OWN_TYPES:
        return replay(make(), workload, drain_events=events)
    return replay(
        make(),
        workload,
        drain_events=events,
        lookup_result=oracle.base.LookupResult,
        context_cls=oracle.ReqContext,
    )


def step_us(result: ReplayResult) -> tuple[float, float, float]:
    """Mean, median and 99th percentile of the manager's microseconds per step."""
    return us_stats(result.step_ns)


def us_stats(step_ns: Sequence[float]) -> tuple[float, float, float]:
    """Mean, median and 99th percentile, in microseconds, of per-step nanoseconds."""
    steps = sorted(step_ns)
    p99 = steps[min(len(steps) - 1, round(0.99 * (len(steps) - 1)))]
    return statistics.fmean(steps) / 1e3, statistics.median(steps) / 1e3, p99 / 1e3


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--chunks", type=int, default=8192)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--repeat", type=int, default=3, help="keep the fastest of N replays")
    parser.add_argument("--events", action="store_true", help="kv events on, drained each step")
    parser.add_argument(
        "--store-threshold", type=int, default=0, help="offers a key needs before it is stored"
    )
    parser.add_argument("--kv-groups", type=int, default=1, help="KV cache groups (keys a block)")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)

    reason = vllm_oracle.unavailable_reason()
    if reason is not None:
        print(reason, file=sys.stderr)
        return 2
    oracle = vllm_oracle.load()
    workload = generate(
        WorkloadConfig(
            requests=args.requests, seed=args.seed, lookup_mode="single", kv_groups=args.kv_groups
        )
    )
    print(
        f"vLLM {vllm_oracle.VLLM_VERSION} managers per scheduler step: {args.requests:,} requests "
        f"({workload.num_keys:,} keys, {workload.num_unique_keys:,} distinct), "
        f"{args.chunks:,} chunks, seed {args.seed}, events {'on' if args.events else 'off'}, "
        f"store threshold {args.store_threshold or 'off'}, {args.kv_groups} KV group(s), "
        f"fastest of {args.repeat}; Python {platform.python_version()}"
    )
    header = (
        "| policy | manager | hit rate | steps | µs/step mean | µs/step p50 | µs/step p99 "
        "| ns/key | speed-up |"
    )
    print(f"\n{header}\n|---|---|---:|---:|---:|---:|---:|---:|---:|")
    report: list[dict[str, Any]] = []
    failed = False
    for policy in args.policies.split(","):
        results: dict[str, ReplayResult] = {}
        makers = {
            name: build(oracle, args.chunks, extra, args.events)
            for name, extra in extra_configs(policy, args.store_threshold).items()
        }
        makers[OWN_TYPES] = functools.partial(
            CPUOffloadingManager,
            args.chunks,
            policy,
            enable_events=args.events,
            store_threshold=max(args.store_threshold, 1),
        )
        # The managers take turns, one replay each per round, so every manager's fastest
        # replay is taken over the same stretch of time (a slow phase of the host slows them
        # alike instead of whichever ran then).
        runs: dict[str, list[ReplayResult]] = {name: [] for name in makers}
        for _ in range(args.repeat):
            for name, make in makers.items():
                runs[name].append(run_one(oracle, name, make, workload, args.events))
        for name, done in runs.items():
            results[name] = min(done, key=lambda r: r.total_ns)
        base = results["vllm"]
        for name, result in results.items():
            mean, p50, p99 = step_us(result)
            speedup = base.total_ns / result.total_ns if result.total_ns else float("nan")
            print(
                f"| {policy} | {name} | {result.hit_rate:.2%} | {result.steps:,} | {mean:,.1f} "
                f"| {p50:,.1f} | {p99:,.1f} | {result.total_ns_per_key or 0:,.0f} "
                f"| {speedup:.1f}x |"
            )
            report.append(
                {
                    "policy": policy,
                    "manager": name,
                    "us_per_step_mean": mean,
                    "us_per_step_p50": p50,
                    "us_per_step_p99": p99,
                    "speedup": speedup,
                    **result.to_json(),
                }
            )
        for name, result in results.items():
            if not result.same_answers(base):
                failed = True
                step = result.first_divergent_step(base)
                print(f"MISMATCH: {policy}: {name} differs from vllm from step {step}")
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    if failed:
        return 1
    print("\nall managers gave identical answers (same digest) under every policy")
    return 0


if __name__ == "__main__":
    sys.exit(main())
