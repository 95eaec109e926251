"""Instructions per key of every core call, counted by callgrind, for every built-in policy.

The core alone, without Python around it: ``rust/kvoffload-core/examples/callgrind_ops.rs`` (the
criterion bench's workload: 36-byte keys in batches of 32, a cache full of evictable chunks that
has stored twice its size, each batch stored or loaded by a request new to it) runs each call a
fixed number of batches in its own ``run_*`` function, and callgrind collects only inside those
(``--toggle-collect='*::run_*'``). A function's inclusive count over its keys is the count a key;
``reset_cache`` runs once, over the whole cache, and is counted a chunk. The example also counts
heap allocations a key. Counts are exact and repeatable: they track changes where timings on a
shared machine cannot, but they are not time (a cache miss costs no instruction).

    python benches/callgrind_core.py                         # every policy, 10^3 chunks
    python benches/callgrind_core.py --policies lru,arc --batches 500 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cases import POLICIES
from render import CORE_OPS, core_table
from report import _names

ROOT = Path(__file__).resolve().parent.parent
#: Keys a batch (the example's ``BATCH``).
BATCH = 32
#: A line of ``callgrind_annotate --inclusive=yes``: ``25,312,963 (22.98%)  ???:...::run_store``.
LINE = re.compile(r"^\s*([\d,]+) \(\s*[\d.]+%\)\s+\S*::common::(run_\w+) ")
#: A line of the example's output: ``store    0.094 allocations/key``.
ALLOCS = re.compile(r"^(\w+)\s+([\d.]+) allocations/key$")


def build() -> Path:
    """Build the example (release) and return its executable."""
    cmd = [
        *("cargo", "build", "--release", "--quiet", "-p", "kvoffload-core"),
        *("--example", "callgrind_ops", "--message-format=json"),
    ]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, check=True)
    for line in done.stdout.splitlines():
        msg = json.loads(line)
        built = msg.get("reason") == "compiler-artifact" and msg.get("executable")
        if built and msg["target"]["name"] == "callgrind_ops":
            return Path(msg["executable"])
    raise RuntimeError("cargo built no callgrind_ops executable")


def count(
    exe: Path, policy: str, size: int, batches: int, valgrind: str
) -> list[dict[str, object]]:
    """One callgrind run of the example: a row per call, with its counts a key."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "callgrind.out"
        cmd = [
            valgrind,
            "--tool=callgrind",
            f"--callgrind-out-file={out}",
            "--collect-atstart=no",
            "--toggle-collect=*::run_*",
            str(exe),
            policy,
            str(size),
            str(batches),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if done.returncode != 0 or not out.is_file():
            tail = "\n".join(done.stderr.splitlines()[-15:])
            raise RuntimeError(f"callgrind run of {policy} failed:\n{tail}")
        annotate = shutil.which("callgrind_annotate") or "callgrind_annotate"
        table = subprocess.run(
            [annotate, "--inclusive=yes", "--threshold=100", str(out)],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
    counts: dict[str, int] = {}
    for line in table.splitlines():
        m = LINE.match(line)
        if m is not None:
            counts.setdefault(m.group(2), int(m.group(1).replace(",", "")))
    allocs = {
        m.group(1): float(m.group(2))
        for m in map(ALLOCS.match, done.stdout.splitlines())
        if m is not None
    }
    rows: list[dict[str, object]] = []
    for op in CORE_OPS:
        if op.function not in counts:
            raise RuntimeError(f"{policy}: callgrind counted nothing in {op.function}")
        units = size if op.per_chunk else batches * BATCH
        rows.append(
            {
                "policy": policy,
                "op": op.name,
                "chunks": size,
                "batches": batches,
                "instructions": counts[op.function],
                "per_key": counts[op.function] / units,
                "allocations": allocs.get(op.printed),
            }
        )
    return rows


def main(argv: list[str] | None = None) -> int:
    """Count every call of every asked policy and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--policies", type=_names, default=list(POLICIES))
    parser.add_argument("--chunks", type=int, default=1000, help="cache size (1000)")
    parser.add_argument("--batches", type=int, default=1000, help="batches a call (1000)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the counts")
    args = parser.parse_args(argv)
    for policy in args.policies:
        if policy not in POLICIES:
            print(f"callgrind_core: unknown policy {policy!r} (one of {POLICIES})", file=sys.stderr)
            return 2
    if args.chunks < 2 * BATCH or args.batches < 1:
        print("callgrind_core: --chunks must be 64 or more, --batches 1 or more", file=sys.stderr)
        return 2
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("callgrind_core: valgrind is not installed", file=sys.stderr)
        return 2
    exe = build()
    rows: list[dict[str, object]] = []
    for policy in args.policies:
        rows += count(exe, policy, args.chunks, args.batches, valgrind)
        print(f"callgrind_core: {policy} counted", file=sys.stderr, flush=True)
    print("\n".join(core_table(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps({"commit": _commit(), "rows": rows}, indent=2))
    return 0


def _commit() -> str | None:
    """The checked-out commit (with ``+`` when the Rust sources counted have changes), if git
    can tell."""
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--", "rust", "Cargo.toml", "Cargo.lock"],
            cwd=ROOT,
            capture_output=True,
            text=True,
        )
    except OSError:
        return None
    if head.returncode != 0:
        return None
    return head.stdout.strip() + ("+" if dirty.stdout.strip() else "")


if __name__ == "__main__":
    os.environ.setdefault("CARGO_TERM_COLOR", "never")
    sys.exit(main())
