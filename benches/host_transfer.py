"""Host transfer throughput: HostPool gather/scatter vs a plain numpy copy of the same bytes.

For each block size, a fresh pool of ``total / block`` chunks of one block is created (its
pre-fault rate is recorded, and that of the same pool pre-faulted on one thread). Then
``--repeat`` rounds. In each, every transfer runs back to back with its two baselines (the three
in a fresh random order), the groups themselves in a fresh random order, so that a transfer and
the numpy copies it is compared with see the same moment of a shared machine:

- numpy: ``np.copyto(dst, src)``, one contiguous copy between two numpy arrays (numpy's best
  case: both arrays on transparent huge pages, which numpy asks for);
- numpy in / numpy out: the same single copy into the pool's own memory (``pool.view()``, the
  gather's destination) and out of it into the scatter's destination: the like-for-like
  baselines, same source, same destination pages, same faulted-in state;
- numpy rows: ``dst[chunk_order] = src``, the same block permutation done by numpy (context);
- gather: every block of ``src``, in a random block order, into the pool in a random chunk order;
- scatter: every chunk, in a random chunk order, back into a random block order of ``back``
  (both sides scattered, as with real block tables).

Every buffer is page-aligned and written before timing. Page alignment matters for the baseline:
glibc's ``memmove`` (what numpy's copy is) drops to about a third of its speed when the
destination sits 16-64 bytes past the source modulo 4 KiB (measured here), which a page-aligned
pool and a ``malloc``-ed array would otherwise produce for the "numpy out" copy.

Throughputs are the best run. Ratios are baseline time / kvoffload time within each group (the
transfer and the baseline copy measured back to back), the median over rounds (1.0 = as fast as
numpy's single copy): ``_ratio`` against the same-memory copy (numpy in for gather, numpy out for
scatter: the same bytes into the same destination pages), ``_ratio_arrays`` against the
array-to-array copy.

    python benches/host_transfer.py                      # 1 GiB, 64 KiB .. 2 MiB, threads 1 2
    python benches/host_transfer.py --total-mib 256 --markdown
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload import HostPool

PAGE = 4096


def page_aligned(rows: int, cols: int, fill: int = 0) -> npt.NDArray[np.uint8]:
    """A ``uint8[rows, cols]`` array starting on a page boundary, every byte written."""
    raw = np.empty(rows * cols + PAGE, np.uint8)
    start = -raw.ctypes.data % PAGE
    arr = raw[start : start + rows * cols].reshape(rows, cols)  # .base keeps `raw` alive
    arr.fill(fill)  # written, so every page is faulted in before timing
    return arr


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def measure(
    total: int, block: int, threads: list[int], repeat: int, huge_pages: bool
) -> dict[str, Any]:
    n = total // block
    src = page_aligned(n, block)
    src[:] = ((np.arange(n) * 7 + 1) % 251).astype(np.uint8)[:, None]  # a byte per block
    dst = page_aligned(n, block)
    back = page_aligned(n, block)
    rng = np.random.default_rng(0)
    chunk_order = rng.permutation(n)
    block_order = rng.permutation(n)
    with HostPool(n, block, num_threads=1, huge_pages=huge_pages, register_cuda=False) as one:
        prefault_1t = one.stats().prefault_gb_per_s  # the same pre-fault on one thread
    t0 = time.perf_counter()
    pool = HostPool(n, block, num_threads=max(threads), huge_pages=huge_pages, register_cuda=False)
    create_s = time.perf_counter() - t0
    view = pool.view()
    stats = pool.stats()
    row: dict[str, Any] = {
        "block_bytes": block,
        "blocks": n,
        "bytes": n * block,
        "huge_pages": huge_pages,
        "prefault_method": stats.prefault_method,
        "prefault_gb_s": stats.prefault_gb_per_s,
        "prefault_1t_gb_s": prefault_1t,
        "create_s": create_s,
        "load_avg_1m": os.getloadavg()[0],
    }
    ops: dict[str, Callable[[], object]] = {
        "numpy": lambda: np.copyto(dst, src),
        "numpy_in": lambda: np.copyto(view, src),
        "numpy_out": lambda: np.copyto(back, view),
        "numpy_rows": lambda: dst.__setitem__(chunk_order, src),
    }
    # Each transfer runs back to back with its two baselines, in a fresh random order: the
    # like-for-like copy into the same destination memory and the array-to-array copy.
    groups: list[list[str]] = [["numpy_rows"]]
    for t in threads:

        def gather(t: int = t) -> None:
            pool.gather(src, block_order, chunk_order, threads=t)

        def scatter(t: int = t) -> None:
            pool.scatter(back, block_order, chunk_order, threads=t)

        ops[f"gather_t{t}"] = gather
        ops[f"scatter_t{t}"] = scatter
        groups += [[f"gather_t{t}", "numpy_in", "numpy"], [f"scatter_t{t}", "numpy_out", "numpy"]]
    timings: dict[str, list[float]] = {name: [] for name in ops}
    ratios: dict[str, list[float]] = {}
    for _ in range(repeat):
        for g in rng.permutation(len(groups)):
            group = groups[g]
            times = {group[i]: timed(ops[group[i]]) for i in rng.permutation(len(group))}
            for name, ts in times.items():
                timings[name].append(ts)
            op, *baselines = group
            for base, suffix in zip(baselines, ("_ratio", "_ratio_arrays"), strict=False):
                ratios.setdefault(op + suffix, []).append(times[base] / times[op])
    back.fill(0)
    pool.gather(src, block_order, chunk_order, threads=1)
    assert (view[chunk_order] == src[block_order]).all()
    pool.scatter(back, block_order, chunk_order, threads=1)
    assert (back == src).all()
    pool.close()
    for name, runs in timings.items():
        row[f"{name}_s"] = min(runs)
        row[f"{name}_gb_s"] = n * block / min(runs) / 1e9
    for name, rs in ratios.items():
        row[name] = statistics.median(rs)
    return row


def table(rows: list[dict[str, Any]], threads: list[int]) -> str:
    cols = ["block", "numpy copy GB/s", "numpy in / out of pool GB/s", "numpy rows GB/s"]
    for t in threads:
        cols += [f"gather {t}T GB/s (ratios)", f"scatter {t}T GB/s (ratios)"]
    cols += [f"pre-fault GB/s 1T / {max(threads)}T (pool creation)"]
    lines = ["| " + " | ".join(cols) + " |", "|---|" + "---:|" * (len(cols) - 1)]
    for r in rows:
        kib = r["block_bytes"] // 1024
        cells = [
            f"{kib} KiB" if kib < 1024 else f"{kib // 1024} MiB",
            f"{r['numpy_gb_s']:.1f}",
            f"{r['numpy_in_gb_s']:.1f} / {r['numpy_out_gb_s']:.1f}",
            f"{r['numpy_rows_gb_s']:.1f}",
        ]
        for t in threads:
            for op in ("gather", "scatter"):
                p = f"{op}_t{t}"
                cells.append(
                    f"{r[f'{p}_gb_s']:.1f} ({r[f'{p}_ratio']:.2f} / {r[f'{p}_ratio_arrays']:.2f})"
                )
        cells.append(
            f"{r['prefault_1t_gb_s']:.1f} / {r['prefault_gb_s']:.1f} ({r['create_s']:.2f} s)"
        )
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--total-mib", type=int, default=1024)
    p.add_argument("--block-kib", type=int, nargs="+", default=[64, 256, 1024, 2048])
    p.add_argument("--threads", type=int, nargs="+", default=[1, 2])
    p.add_argument("--repeat", type=int, default=11)
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
