"""The cost of a Python cache policy inside the Rust manager.

Run: ``python benches/python_policy_cost.py [--requests N] [--chunks C] [--repeat R]``.

Replays the `kvoffload bench` scheduler workload, side by side in one run, through:

- ``reference``: the plain-Python manager running the policy's plain-Python class (the baseline a
  researcher's policy runs on without kvoffload's Rust core);
- ``rust+python``: the Rust manager driving that same Python class as a plug-in
  (``cache_policy_module_path``), so only the policy's own methods run in Python;
- ``rust``: the Rust manager with the policy built in (where kvoffload has one).

Prints the manager time per scheduler step (fastest of ``R`` replays) and the speed-up of the
plug-in path over the reference manager, and checks that the three replays agree call for call
(their digests).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from kvoffload import CPUOffloadingManager
from kvoffload.reference import CPUOffloadingManager as ReferenceManager
from kvoffload.workload import WorkloadConfig, generate, replay

#: Policies measured: built-in name -> its plain-Python class (module, class).
POLICIES: dict[str, tuple[str, str]] = {
    "lru": ("kvoffload.reference.lru", "LruPolicy"),
    "arc": ("kvoffload.reference.arc", "ArcPolicy"),
    "s3fifo": ("kvoffload.reference.s3fifo", "S3FifoPolicy"),
}


def managers(policy: str, chunks: int) -> dict[str, Any]:
    """The three managers for ``policy``, by label."""
    module, cls = POLICIES[policy]
    return {
        "reference": ReferenceManager(chunks, cache_policy=policy),
        "rust+python": CPUOffloadingManager(
            chunks, cache_policy=cls, cache_policy_module_path=module
        ),
        "rust": CPUOffloadingManager(chunks, cache_policy=policy),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=1500)
    parser.add_argument("--chunks", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    workload = generate(WorkloadConfig(requests=args.requests))
    print(f"{args.requests} requests, {args.chunks} chunks (fastest of {args.repeat} replays)")
    print("| policy | reference µs/step | rust+python µs/step | rust µs/step | plug-in speed-up |")
    print("|---|---:|---:|---:|---:|")
    for policy in POLICIES:
        best: dict[str, float] = {}
        hits: dict[str, str] = {}
        for _ in range(args.repeat):
            for label, m in managers(policy, args.chunks).items():
                started = time.perf_counter()
                result = replay(m, workload)
                _ = time.perf_counter() - started
                per_step = sum(result.step_ns) / max(len(result.step_ns), 1) / 1e3
                best[label] = min(best.get(label, float("inf")), per_step)
                hits[label] = result.digest
        if len(set(hits.values())) != 1:
            raise SystemExit(f"{policy}: the managers' replays differ: {hits}")
        ref, plug, rust = best["reference"], best["rust+python"], best["rust"]
        print(f"| {policy} | {ref:,.1f} | {plug:,.1f} | {rust:,.1f} | {ref / plug:.2f}x |")


if __name__ == "__main__":
    main()
