"""Regenerate docs/performance.md and its plots (docs/perf-*.png) from one run of every benchmark.

Runs, each in its own process and all in this one invocation (so the ratios are side by side):
``report.py`` (FFI cases, every policy), ``scaling.py`` (size, pins, batch, memory),
``vllm_step.py`` (scheduler-trace replay against vLLM 0.33.0's manager), ``vllm_tiering.py``
(vLLM's tiering manager's time per step with each CPU primary tier), ``calls.py`` (the
other calls), ``kvoffload bench``
(the same replay against the reference, every policy) and, where ``cargo`` is on the path, the
core crate's ``memory_floor`` example (what a lookup's memory accesses alone cost against pool
size) and, where ``valgrind`` is, ``callgrind_ffi.py`` (instructions per key of the FFI cases,
kvoffload and vLLM); then, for the targets against vLLM, two
more runs of the target cases and of the replay, and for the pool-size and pinned targets two
more runs of kvoffload's sizes and pins, each in a fresh process (the page's verdicts take the
median of the three); then writes the markdown and the PNGs.

    python benches/make_report.py --quick     # about 10 minutes: smaller pools and fewer repeats
    python benches/make_report.py --full      # the published figures: 10^7 chunks and more repeats
    python benches/make_report.py --from DIR  # re-render from the JSON of an earlier run
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from cases import POLICIES
from render import render

BENCHES = Path(__file__).resolve().parent
ROOT = BENCHES.parent
#: Every built-in policy, for the tables that cover them all (vLLM has only lru and arc).
ALL_POLICIES = ",".join(POLICIES)

MODES: dict[str, dict[str, list[str]]] = {
    "quick": {
        "report": ["--sizes", "100000", "--repeat", "3"],
        "scaling": [
            *("--sizes", "1000,10000,100000,1000000,10000000", "--python-max", "100000"),
            *("--memory-chunks", "200000", "--repeat", "3", "--batches", "1,4,32,256,1024"),
        ],
        "step": ["--requests", "2000", "--repeat", "3"],
        "bench": ["--requests", "2000", "--repeat", "3"],
        "drop": ["--requests", "1000", "--repeat", "3"],
        "calls": ["--repeat", "3", "--scale", "0.5"],
        "targets": ["--sizes", "100000", "--repeat", "3"],
        "sizes": ["--sizes", "1000,10000,100000,1000000,10000000", "--repeat", "3"],
        "floor": ["1000", "100000", "1000000", "10000000"],
        "callgrind": ["--rounds", "50", "--warmup", "10"],
        "tiering": ["--steps", "150"],
    },
    "full": {
        "report": ["--sizes", "1000,100000,1000000", "--repeat", "7"],
        "scaling": ["--python-max", "1000000", "--memory-chunks", "1000000", "--repeat", "5"],
        "step": ["--requests", "5000", "--repeat", "3"],
        "bench": ["--requests", "5000", "--repeat", "3"],
        "drop": ["--requests", "2000", "--repeat", "5"],
        "calls": ["--repeat", "7"],
        "targets": ["--sizes", "100000", "--repeat", "7"],
        "sizes": ["--repeat", "5"],
        "floor": ["1000", "10000", "100000", "1000000", "10000000"],
        "callgrind": ["--rounds", "200", "--warmup", "50"],
        "tiering": ["--steps", "300", "--repeat", "3"],
    },
}

#: The JSON documents a run leaves, by name (``core``: ``callgrind_core.py``'s counts).
DOCUMENTS = (
    "meta",
    "ffi",
    "scaling",
    "step",
    "tiering",
    "bench",
    "drop",
    "calls",
    "floor",
    "callgrind",
    "core",
    "positions",
    "positions_callgrind",
)
#: Runs of the target cases beyond the main one (``ffi-2.json``, ``step-2.json``, ``sizes-2.json``).
EXTRA_RUNS = (2, 3)
TARGET_OPS = "store_evict,load_complete,lookup,lookup_prefix"


def _run(name: str, cmd: list[str], log: Path) -> float:
    print(f"make_report: {name}: {' '.join(cmd)}", file=sys.stderr, flush=True)
    started = time.perf_counter()
    with log.open("w") as out:
        done = subprocess.run(cmd, cwd=BENCHES, stdout=out, stderr=subprocess.STDOUT, check=False)
    seconds = time.perf_counter() - started
    print(f"make_report: {name}: exit {done.returncode} in {seconds:.0f} s", file=sys.stderr)
    if done.returncode not in (0, 2):  # 2: vLLM's files are not available (vllm_step.py)
        raise SystemExit(f"make_report: {name} failed; see {log}")
    return seconds


def measure(mode: str, out: Path) -> None:
    """Run every benchmark of ``mode`` and leave its JSON (and logs) in ``out``."""
    out.mkdir(parents=True, exist_ok=True)
    py = sys.executable
    opts = MODES[mode]
    seconds: dict[str, float] = {}
    jobs = {
        "report": [py, "report.py", "--policies", ALL_POLICIES, "--json", str(out / "ffi.json")],
        "scaling": [py, "scaling.py", "--json", str(out / "scaling.json")],
        "step": [py, "vllm_step.py", "--json", str(out / "step.json")],
        "tiering": [
            *(py, "vllm_tiering.py", "--setups", "all", "--share"),
            *("--json", str(out / "tiering.json")),
        ],
        "bench": [
            *(py, "-m", "kvoffload.bench", "--policies", ALL_POLICIES, "--no-progress"),
            *("--impls", "reference,rust", "--json", str(out / "bench.json")),
        ],
        "drop": [py, "context_drop.py", "--json", str(out / "drop.json")],
        "calls": [py, "calls.py", "--policies", ALL_POLICIES, "--json", str(out / "calls.json")],
    }
    for k in EXTRA_RUNS:
        jobs[f"report-{k}"] = [
            *(py, "report.py", "--policies", "lru,arc", "--impls", "rust,vllm"),
            *("--ops", TARGET_OPS, "--json", str(out / f"ffi-{k}.json"), *opts["targets"]),
        ]
        jobs[f"step-{k}"] = [py, "vllm_step.py", "--json", str(out / f"step-{k}.json")]
        jobs[f"step-{k}"] += opts["step"]
        # The pool-size and pinned targets are kvoffload's own ratios (10^7 over 10^3, 99%
        # pinned over none): its sizes and pins alone.
        jobs[f"sizes-{k}"] = [
            *(py, "scaling.py", "--only", "sizes,pinned", "--impls", "rust"),
            *("--json", str(out / f"sizes-{k}.json"), *opts["sizes"]),
        ]
    # The target cases with token positions recorded, as vLLM's scheduler records them.
    jobs["positions"] = [
        *(py, "report.py", "--policies", "lru,arc", "--positions"),
        *("--ops", "store_evict,load_complete", "--json", str(out / "positions.json")),
        *opts["targets"],
    ]
    for name in ("report", "scaling", "step", "tiering", "bench", "drop", "calls"):
        jobs[name] += opts[name]
    if shutil.which("cargo") is not None:
        jobs["floor"] = [
            *("cargo", "run", "--release", "--quiet", "-p", "kvoffload-core"),
            *("--example", "memory_floor", "--", "--json", str(out / "floor.json")),
            *opts["floor"],
        ]
    else:
        print("make_report: no cargo on the path: the memory floor is left out", file=sys.stderr)
    if shutil.which("valgrind") is not None:
        jobs["callgrind"] = [
            *(py, "callgrind_ffi.py", "--impls", "rust,vllm", "--policies", "lru,arc"),
            *("--json", str(out / "callgrind.json"), *opts["callgrind"]),
        ]
        jobs["positions_callgrind"] = [
            *(py, "callgrind_ffi.py", "--impls", "rust,vllm", "--policies", "lru"),
            *("--ops", "store_evict,load_complete", "--positions"),
            *("--json", str(out / "positions_callgrind.json"), *opts["callgrind"]),
        ]
        if shutil.which("cargo") is not None:
            jobs["core"] = [py, "callgrind_core.py", "--json", str(out / "core.json")]
    else:
        print("make_report: no valgrind: the instruction counts are left out", file=sys.stderr)
    for name, cmd in jobs.items():
        seconds[name] = _run(name, cmd, out / f"{name}.log")
    meta = {
        "mode": mode,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpus": _cpus(),
        "seconds": seconds,
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "commands": {
            name: ["python" if cmd[0] == py else cmd[0], *(_relative(part) for part in cmd[1:])]
            for name, cmd in jobs.items()
        },
    }
    (out / "meta.json").write_text(json.dumps(meta, indent=2) + "\n")


def _relative(part: str) -> str:
    """A path argument relative to the repository (commands as one would type them)."""
    return part.replace(f"{ROOT}/", "") if part.startswith(str(ROOT)) else part


def _cpus() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load(out: Path) -> dict[str, Any]:
    """The JSON documents of a run, by name (a missing one is absent)."""
    docs: dict[str, Any] = {}
    for name in DOCUMENTS:
        path = out / f"{name}.json"
        if path.is_file():
            docs[name] = json.loads(path.read_text())
    for name in ("ffi", "step", "sizes"):
        more = [out / f"{name}-{k}.json" for k in EXTRA_RUNS]
        docs[f"{name}_more"] = [json.loads(p.read_text()) for p in more if p.is_file()]
    return docs


def main(argv: list[str] | None = None) -> int:
    """Measure (or re-read) and write docs/performance.md with its plots."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--quick", action="store_const", dest="mode", const="quick")
    group.add_argument("--full", action="store_const", dest="mode", const="full")
    group.add_argument("--from", dest="source", type=Path, help="render an earlier run's JSON")
    parser.add_argument("--out", type=Path, default=ROOT / "target" / "perf-report")
    parser.add_argument("--docs", type=Path, default=ROOT / "docs")
    args = parser.parse_args(argv)
    source = args.source
    if source is None:
        source = args.out
        measure(args.mode or "quick", source)
    docs = load(source)
    markdown = render(docs, args.docs)
    (args.docs / "performance.md").write_text(markdown)
    print(f"make_report: wrote {args.docs / 'performance.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
