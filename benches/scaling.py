"""Scaling and memory of the manager: kvoffload (Rust), the reference and vLLM 0.33.0 side by side.

Four measurements, each with the cases of ``cases.py`` (timeit-style, min of ``--repeat`` runs,
GC paused) and written as one JSON document:

- ``sizes``: ns per key of every operation (32-key batches) against the pool size; the Python
  implementations only up to ``--python-max`` chunks (their fill alone takes ~10 µs a key);
  every pool is filled first, then all are timed in ``--rounds`` interleaved rounds (min kept);
- ``pinned``: store with eviction against the fraction of chunks pinned (``prepare_load`` never
  completed, picked at random), at ``--chunks``; timed in interleaved rounds as the sizes are;
- ``batch``: ns per key of store, load and ``lookup_prefix`` against the keys per call;
- ``memory``: bytes per resident chunk, in a fresh subprocess per implementation: the RSS delta of
  filling ``--memory-chunks`` chunks (keys made beforehand, so the key objects are not counted),
  with the C heap's free pages handed back to the system at both ends (glibc's ``malloc_trim``,
  where there is one), so that neither the garbage of making the keys nor that of the fill's
  request states counts; in a second subprocess, what ``tracemalloc`` sees of the same fill
  (Python allocations only: for kvoffload that is the Python objects it makes, not its Rust
  state); and, in a third, the RSS delta once the filled pool has also stored as many fresh keys
  again (each store evicting), which is the state a running cache keeps: ARC's ghost lists
  (the evicted keys it remembers) are full only then.

    python benches/scaling.py --json scaling.json                 # everything, quick sizes
    python benches/scaling.py --only sizes --sizes 1000,10000000 --python-max 100000
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cases import (
    FILL_BATCH,
    IMPLS,
    KEYS_PER_OP,
    OPERATIONS,
    SPARE_KEYS,
    FilledCache,
    make_keys,
    manager_and_context,
    time_op,
    unavailable,
)

PARTS = ("sizes", "pinned", "batch", "memory")
PINNED_FRACTIONS = (0.0, 0.5, 0.9, 0.99)
BATCHES = (1, 4, 16, 32, 128, 512, 1024)
BATCH_OPS = ("store_evict", "load_complete", "lookup_prefix")


def _ints(text: str) -> list[int]:
    return [int(float(part)) for part in text.split(",") if part.strip()]


def _floats(text: str) -> list[float]:
    return [float(part) for part in text.split(",") if part.strip()]


def _names(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _log(text: str) -> None:
    print(f"scaling: {text}", file=sys.stderr, flush=True)


def _impls(names: list[str], policy: str) -> list[str]:
    return [impl for impl in names if unavailable(impl, policy) is None]


def _timed_in_rounds(
    groups: list[Any],
    caches: dict[tuple[Any, str], FilledCache],
    ops: Sequence[str],
    args: argparse.Namespace,
    label: str,
) -> dict[tuple[Any, str], dict[str, float]]:
    """Each cache's minimum ns/key of each of ``ops`` over ``args.rounds`` rounds.

    ``caches`` is keyed by (group, implementation); each round times every cache once, its
    groups in an order that rotates each round, so a slow phase of the host cannot land on one
    group alone. The result keeps the order of ``caches``.
    """
    best: dict[tuple[Any, str], dict[str, float]] = {key: {} for key in caches}
    for r in range(args.rounds):
        started = time.perf_counter()
        for group in groups[r % len(groups) :] + groups[: r % len(groups)]:
            for (at, impl), cache in caches.items():
                if at != group:
                    continue
                row = best[at, impl]
                for op in ops:
                    ns = time_op(cache, op, repeat=args.repeat)
                    row[op] = min(row.get(op, ns), ns)
        took = time.perf_counter() - started
        _log(f"{label} round {r + 1}/{args.rounds} {took:6.1f} s")
    return best


def measure_sizes(args: argparse.Namespace) -> dict[str, Any]:
    """``{policy: {size: {impl: {op: ns/key}}}}`` and which sizes each implementation skipped.

    Every pool of a policy (each size, each implementation) is filled first and kept; then
    ``--rounds`` rounds each time every pool once, sizes in an order that rotates each round,
    and each figure is the minimum over the rounds. So the sizes of one row are timed over the
    same stretch of time, and a slow phase of the host cannot land on one size alone (the
    ratios against 10^3 compare like with like).
    """
    out: dict[str, Any] = {}
    skipped: dict[str, list[int]] = {}
    for policy in args.policies:
        impls = _impls(args.impls, policy)
        caches: dict[tuple[int, str], FilledCache] = {}
        for size in args.sizes:
            keys = make_keys(size + SPARE_KEYS, seed=size)
            for impl in impls:
                if impl != "rust" and size > args.python_max:
                    skipped.setdefault(impl, []).append(size)
                    continue
                started = time.perf_counter()
                caches[size, impl] = FilledCache(impl, policy, size, keys=keys)
                took = time.perf_counter() - started
                _log(f"sizes {policy} {size:>10,} {impl:<9} filled in {took:6.1f} s")
            del keys
        best = _timed_in_rounds(list(args.sizes), caches, OPERATIONS, args, f"sizes {policy}")
        per_size: dict[str, Any] = {}
        for (size, impl), row in best.items():
            per_size.setdefault(str(size), {})[impl] = row
        out[policy] = per_size
        caches.clear()
        gc.collect()
    return {
        "ns_per_key": out,
        "rounds": args.rounds,
        "skipped": {k: sorted(set(v)) for k, v in skipped.items()},
    }


def measure_pinned(args: argparse.Namespace) -> dict[str, Any]:
    """``{policy: {fraction: {impl: store_evict ns/key}}}`` at ``args.chunks``.

    As for the sizes: every pool of a policy (each fraction, each implementation) is filled and
    pinned first; then ``--rounds`` rounds each time every pool once, fractions in an order that
    rotates each round, and each figure is the minimum over the rounds. So the fractions of one
    row, whose last over first is the target, are timed over the same stretch of time.
    """
    fractions = list(args.fractions)
    for fraction in fractions:
        if args.chunks - round(fraction * args.chunks) < KEYS_PER_OP:
            raise ValueError(
                f"{fraction:.0%} of {args.chunks:,} chunks pinned leaves fewer than the "
                f"{KEYS_PER_OP} a store evicts"
            )
    out: dict[str, Any] = {}
    keys = make_keys(args.chunks + SPARE_KEYS, seed=1)
    for policy in args.policies:
        caches: dict[tuple[float, str], FilledCache] = {}
        for fraction in fractions:
            for impl in _impls(args.impls, policy):
                cache = FilledCache(impl, policy, args.chunks, keys=keys)
                pinned = cache.pin(fraction)
                caches[fraction, impl] = cache
                _log(f"pinned {policy} {fraction:.0%} ({pinned:,}) {impl:<9} filled")
        best = _timed_in_rounds(fractions, caches, ("store_evict",), args, f"pinned {policy}")
        for (fraction, impl), row in best.items():
            ns = row["store_evict"]
            out.setdefault(policy, {}).setdefault(str(fraction), {})[impl] = ns
            _log(f"pinned {policy} {fraction:.0%} {impl:<9} {ns:10.1f} ns/key")
        caches.clear()
        gc.collect()
    return {"chunks": args.chunks, "store_evict_ns_per_key": out, "rounds": args.rounds}


def measure_batch(args: argparse.Namespace) -> dict[str, Any]:
    """``{policy: {batch: {impl: {op: ns/key}}}}`` at ``args.chunks``."""
    out: dict[str, Any] = {}
    keys = make_keys(args.chunks + SPARE_KEYS, seed=2)
    for policy in args.policies:
        for impl in _impls(args.impls, policy):
            cache = FilledCache(impl, policy, args.chunks, keys=keys)
            for batch in args.batches:
                cache.batch = batch
                row = {op: time_op(cache, op, repeat=args.repeat) for op in BATCH_OPS}
                out.setdefault(policy, {}).setdefault(str(batch), {})[impl] = row
                _log(f"batch {policy} {batch:>5} {impl:<9} {row}")
            del cache
    return {"chunks": args.chunks, "ns_per_key": out}


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _release_free_heap() -> None:
    """Collect garbage and hand the C heap's free pages back to the system (glibc only).

    Without it the RSS delta counts freed memory that the allocator kept: pages freed before
    the baseline (making the keys) that the fill reuses make the delta smaller, and pages of the
    fill's per-request state, freed with the contexts, make it larger.
    """
    gc.collect()
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6")
        trim = libc.malloc_trim
    except (OSError, AttributeError):  # not glibc (musl has no malloc_trim)
        return
    trim(0)


#: What each process of the memory part measures: the RSS and the Python allocations of a fill,
#: and the RSS after a turnover (the fill, then as many fresh keys stored again).
MEMORY_MODES = ("rss", "tracemalloc", "turnover")
#: The JSON name of the turnover figure (the page's renderer reads it by this name).
TURNOVER = "rss_bytes_per_chunk_turnover"


def memory_child(impl: str, policy: str, chunks: int, mode: str) -> dict[str, float]:
    """Fill a fresh manager with ``chunks`` ready chunks (``turnover``: then store ``chunks``
    fresh keys more, evicting as many); bytes per chunk it holds (one process)."""
    import tracemalloc

    if mode not in MEMORY_MODES:
        raise ValueError(f"unknown memory mode {mode!r}")
    cls, ctx_cls = manager_and_context(impl)
    stored = 2 * chunks if mode == "turnover" else chunks
    # A batch fits in the pool's evictable chunks, so that every store of the turnover lands.
    step = max(1, min(FILL_BATCH, chunks))
    keys = make_keys(stored, seed=3)
    contexts = [ctx_cls(f"fill-{lo}") for lo in range(0, stored, step)]
    _release_free_heap()
    if mode == "tracemalloc":
        tracemalloc.start()
    before = _rss_bytes()
    manager = cls(chunks, cache_policy=policy)
    for ctx, lo in zip(contexts, range(0, stored, step), strict=True):
        batch = keys[lo : lo + step]
        if manager.prepare_store(batch, ctx) is None:
            raise RuntimeError(f"{impl}/{policy}: a store of {len(batch)} keys found no room")
        manager.complete_store(batch, ctx)
    del contexts  # per-request state hangs off the contexts, not the manager
    _release_free_heap()
    if mode == "tracemalloc":
        current, _ = tracemalloc.get_traced_memory()
        tracemalloc.stop()
        return {"tracemalloc_bytes_per_chunk": current / chunks}
    name = TURNOVER if mode == "turnover" else "rss_bytes_per_chunk"
    return {name: (_rss_bytes() - before) / chunks}


def measure_memory(args: argparse.Namespace) -> dict[str, Any]:
    """``{policy: {impl: {rss_bytes_per_chunk, tracemalloc_bytes_per_chunk,
    rss_bytes_per_chunk_turnover}}}``."""
    out: dict[str, Any] = {}
    for policy in args.policies:
        for impl in _impls(args.impls, policy):
            row: dict[str, float] = {}
            for mode in MEMORY_MODES:
                cmd = [
                    sys.executable,
                    __file__,
                    "--memory-child",
                    impl,
                    policy,
                    str(args.memory_chunks),
                    mode,
                ]
                done = subprocess.run(
                    cmd, capture_output=True, text=True, check=True, cwd=Path(__file__).parent
                )
                row.update(json.loads(done.stdout))
            out.setdefault(policy, {})[impl] = row
            _log(f"memory {policy} {impl:<9} {row}")
    return {"chunks": args.memory_chunks, "bytes_per_chunk": out}


def main(argv: list[str] | None = None) -> int:
    """Run the chosen measurements and write them as JSON (stdout or ``--json``)."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", type=_names, default=list(PARTS), help="comma-separated parts")
    parser.add_argument("--policies", type=_names, default=["lru", "arc"])
    parser.add_argument("--impls", type=_names, default=list(IMPLS))
    parser.add_argument("--sizes", type=_ints, default=[10**3, 10**4, 10**5, 10**6, 10**7])
    parser.add_argument("--python-max", type=int, default=10**6, help="largest Python pool")
    parser.add_argument("--chunks", type=int, default=100_000, help="pool of pinned and batch")
    parser.add_argument("--fractions", type=_floats, default=list(PINNED_FRACTIONS))
    parser.add_argument("--batches", type=_ints, default=list(BATCHES))
    parser.add_argument("--memory-chunks", type=int, default=1_000_000)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument(
        "--rounds",
        type=int,
        default=3,
        help="interleaved rounds over the sizes and the pinned fractions (min kept)",
    )
    parser.add_argument("--json", type=Path, metavar="PATH")
    parser.add_argument("--memory-child", nargs=4, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        impl, policy, chunks, mode = args.memory_child
        print(json.dumps(memory_child(impl, policy, int(chunks), mode)))
        return 0
    parts = {"sizes": measure_sizes, "pinned": measure_pinned, "batch": measure_batch}
    parts["memory"] = measure_memory
    doc: dict[str, Any] = {"repeat": args.repeat, "python_max": args.python_max}
    for part in args.only:
        started = time.perf_counter()
        doc[part] = parts[part](args)
        doc[part]["seconds"] = time.perf_counter() - started
    text = json.dumps(doc, indent=2) + "\n"
    if args.json is not None:
        args.json.write_text(text)
    else:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
