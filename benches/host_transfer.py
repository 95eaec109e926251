"""Host transfer throughput: HostPool gather/scatter vs a plain numpy copy of the same bytes.

For each block size, a fresh pool of ``total / block`` chunks of one block is created (its
pre-fault rate is recorded), then, interleaved and best of ``--repeat``:

- numpy: ``np.copyto(dst, src)``, one contiguous copy of all the bytes (the baseline);
- numpy rows: ``dst[chunk_order] = src``, the same block permutation done by numpy (for context);
- gather: every block of ``src``, in a random block order, into the pool in a random chunk order;
- scatter: every chunk, in a random chunk order, back into a random block order of a second
  buffer (both sides scattered, as with real block tables).

Throughputs are the best round; the ratio is numpy time / kvoffload time within each round, the
median over rounds (1.0 = as fast as numpy's single copy).

    python benches/host_transfer.py                      # 1 GiB, 64 KiB .. 2 MiB, threads 1 2
    python benches/host_transfer.py --total-mib 256 --markdown
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from kvoffload import HostPool


def best(fn: Callable[[], None], repeat: int) -> float:
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def measure(
    total: int, block: int, threads: list[int], repeat: int, huge_pages: bool
) -> dict[str, Any]:
    n = total // block
    src = np.ones((n, block), np.uint8)  # written, so every page is faulted in
    dst = np.zeros_like(src)
    back = np.zeros_like(src)
    rng = np.random.default_rng(0)
    chunk_order = rng.permutation(n)
    block_order = rng.permutation(n)
    t0 = time.perf_counter()
    pool = HostPool(n, block, num_threads=max(threads), huge_pages=huge_pages, register_cuda=False)
    create_s = time.perf_counter() - t0
    stats = pool.stats()
    row: dict[str, Any] = {
        "block_bytes": block,
        "blocks": n,
        "bytes": n * block,
        "prefault_method": stats.prefault_method,
        "prefault_gb_s": stats.prefault_gb_per_s,
        "create_s": create_s,
    }
    timings: dict[str, list[float]] = {"numpy": [], "numpy_rows": []}
    for t in threads:
        timings[f"gather_t{t}"] = []
        timings[f"scatter_t{t}"] = []
    for _ in range(repeat):  # interleaved, so drift on a shared machine hits all alike
        timings["numpy"].append(best(lambda: np.copyto(dst, src), 1))
        timings["numpy_rows"].append(best(lambda: dst.__setitem__(chunk_order, src), 1))
        for t in threads:
            timings[f"gather_t{t}"].append(
                best(lambda t=t: pool.gather(src, block_order, chunk_order, threads=t), 1)
            )
            timings[f"scatter_t{t}"].append(
                best(lambda t=t: pool.scatter(back, block_order, chunk_order, threads=t), 1)
            )
    assert (back == src).all()
    for name, ts in timings.items():
        s = min(ts)
        row[f"{name}_s"] = s
        row[f"{name}_gb_s"] = n * block / s / 1e9
    for t in threads:
        for op in ("gather", "scatter"):
            # Paired per round (measured seconds apart), then the median: steadier than a ratio
            # of two bests on a machine shared with other work.
            pairs = zip(timings["numpy"], timings[f"{op}_t{t}"], strict=True)
            row[f"{op}_t{t}_ratio"] = statistics.median(a / b for a, b in pairs)
    pool.close()
    return row


def table(rows: list[dict[str, Any]], threads: list[int]) -> str:
    cols = ["block", "numpy copy GB/s", "numpy rows GB/s"]
    for t in threads:
        cols += [f"gather {t}T GB/s (ratio)", f"scatter {t}T GB/s (ratio)"]
    cols += ["pre-fault GB/s"]
    lines = ["| " + " | ".join(cols) + " |", "|" + "---:|" * len(cols)]
    for r in rows:
        kib = r["block_bytes"] // 1024
        cells = [
            f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB",
            f"{r['numpy_gb_s']:.2f}",
            f"{r['numpy_rows_gb_s']:.2f}",
        ]
        for t in threads:
            for op in ("gather", "scatter"):
                cells.append(f"{r[f'{op}_t{t}_gb_s']:.2f} ({r[f'{op}_t{t}_ratio']:.2f})")
        cells.append(f"{r['prefault_gb_s']:.2f}")
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--block-kib", type=int, nargs="+", default=[64, 256, 1024, 2048])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--huge-pages", action="store_true", help="pools with MADV_HUGEPAGE")
    p.add_argument("--json", help="write the rows here")
    p.add_argument("--markdown", action="store_true", help="print a markdown table only")
    args = p.parse_args()
    rows = []
    for kib in args.block_kib:
        row = measure(args.total_mib << 20, kib << 10, args.threads, args.repeat, args.huge_pages)
        rows.append(row)
        if not args.markdown:
            print(json.dumps(row), flush=True)
    print(table(rows, args.threads))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
