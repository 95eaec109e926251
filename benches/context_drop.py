"""What dropping a finished request's context costs: the manager's per-request state going away.

A manager keeps what a request did on the request's context (vLLM's ``ReqContext.set_state``),
so that state is freed when the scheduler drops the context, on the scheduler's thread and
usually long after the request's last call. This benchmark runs ``--requests`` requests through
one manager (each stores ``--batches`` batches of ``--keys`` new keys and finishes), keeps the
contexts, evicts the CPU caches (writes a buffer larger than the last-level cache), then times
dropping the contexts one by one. The key objects stay alive elsewhere, so what is timed is the
per-request state alone. Managers: kvoffload, ``kvoffload.reference`` and, when its sources are
available (``tools/fetch_vllm.py``), vLLM 0.33.0's own manager. Not part of the test run.

    python benches/context_drop.py
    python benches/context_drop.py --policies lru --requests 1000 --repeat 5
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tools"))

import vllm_oracle  # noqa: E402

import kvoffload  # noqa: E402
import vllm_step  # noqa: E402
from kvoffload import reference  # noqa: E402

#: Bytes written to push the managers' state out of the CPU caches before the drops.
EVICT_BYTES = 256 << 20


def key(i: int) -> bytes:
    """A vLLM-shaped key: a 32-byte block hash and a 4-byte group index."""
    return i.to_bytes(32, "little") + b"\0\0\0\0"


def managers(policy: str, chunks: int) -> dict[str, tuple[Callable[[], Any], Callable[[str], Any]]]:
    """Each manager's factory and the request-context class it reads."""
    out: dict[str, tuple[Callable[[], Any], Callable[[str], Any]]] = {
        "kvoffload": (lambda: kvoffload.CPUOffloadingManager(chunks, policy), kvoffload.ReqContext),
        "reference": (
            lambda: reference.CPUOffloadingManager(chunks, policy),
            kvoffload.ReqContext,
        ),
    }
    if vllm_oracle.unavailable_reason() is None:
        oracle = vllm_oracle.load()
        make = vllm_step.build(oracle, chunks, vllm_step.extra_configs(policy)["vllm"], False)
        out["vllm"] = (make, oracle.ReqContext)
    return out


def drop_cost_ns(
    make: Callable[[], Any], context: Callable[[str], Any], requests: int, batches: int, keys: int
) -> float:
    """Nanoseconds to drop one finished request's context (mean over ``requests``)."""
    manager = make()
    contexts = []
    alive = []  # the key objects, kept so that dropping a context frees no key
    n = 0
    for r in range(requests):
        ctx = context(f"req-{r}")
        manager.on_new_request(ctx)
        for _ in range(batches):
            batch = [key(n + j) for j in range(keys)]
            n += keys
            alive.append(batch)
            out = manager.prepare_store(batch, ctx)
            if out is not None and out.keys_to_store:
                manager.complete_store(out.keys_to_store, ctx)
        manager.on_request_finished(ctx)
        contexts.append(ctx)
    buffer = bytearray(EVICT_BYTES)
    buffer[::64] = b"\1" * len(range(0, EVICT_BYTES, 64))
    del buffer
    clock = time.perf_counter_ns
    total = 0
    for i in range(requests):
        t0 = clock()
        contexts[i] = None
        total += clock() - t0
    return total / requests


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--batches", type=int, default=9, help="store calls per request")
    parser.add_argument("--keys", type=int, default=16, help="keys per store call")
    parser.add_argument("--chunks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=3, help="keep the fastest of N runs")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    per_request = args.batches * args.keys
    print(
        f"dropping a finished request's context: {args.requests:,} requests of {per_request} keys "
        f"each, {args.chunks:,} chunks, caches evicted first, fastest of {args.repeat}; "
        f"Python {platform.python_version()}\n"
    )
    print("| policy | manager | µs per context | ns per key | vs kvoffload |")
    print("|---|---|---:|---:|---:|")
    report: list[dict[str, Any]] = []
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for policy in args.policies.split(","):
            made = managers(policy, args.chunks)
            runs: dict[str, list[float]] = {name: [] for name in made}
            # The managers take turns, one run each per round (a slow phase slows them alike).
            for _ in range(args.repeat):
                for name, (make, context) in made.items():
                    runs[name].append(
                        drop_cost_ns(make, context, args.requests, args.batches, args.keys)
                    )
                    gc.collect()
            best = {name: min(r) for name, r in runs.items()}
            for name, ns in best.items():
                print(
                    f"| {policy} | {name} | {ns / 1e3:,.2f} | {ns / per_request:,.1f} "
                    f"| {ns / best['kvoffload']:.2f}x |"
                )
                report.append(
                    {
                        "policy": policy,
                        "manager": name,
                        "ns_per_context": ns,
                        "runs_ns": runs[name],
                        "requests": args.requests,
                        "keys_per_request": per_request,
                        "chunks": args.chunks,
                    }
                )
    finally:
        if gc_was_enabled:
            gc.enable()
    if args.json is not None:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
