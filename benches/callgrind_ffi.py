"""Instructions per key of the FFI cases, counted by callgrind: a noise-free ratio to track.

Wall-clock ratios on a shared VM move by up to ±50% between runs; instruction counts barely move
(hash randomisation off, numpy's BLAS threads at one, the cyclic GC paused as the timings pause
it). This runs each case of ``cases.py`` (one operation of 32 keys against a full pool, the
arguments picked beforehand) under ``valgrind --tool=callgrind``, in its own process per
implementation, policy and operation, and counts every instruction of the measured rounds: the
interpreter's loop, the call, the manager and the caller's handling of its result, as the
timings of ``report.py`` see them. Instruction counts are not time (a cache miss costs no
instruction, and the interpreter's instructions run at another rate than the Rust core's), so
this tracks changes; the targets are judged on time.

How: the measured rounds run inside one ``functools.reduce`` call, and callgrind collects only
while that C function is on the stack (``--toggle-collect=functools_reduce``); the fill and a
warm-up of ``--warmup`` rounds run before it, uncounted.

    python benches/callgrind_ffi.py                              # kvoffload, lru and arc, 10^3
    python benches/callgrind_ffi.py --impls rust,vllm --ops store_evict,load_complete
    python benches/callgrind_ffi.py --sizes 100000 --rounds 100 --json out.json
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from cases import IMPLS, KEYS_PER_OP, OPERATIONS, POLICIES, FilledCache, unavailable
from render import callgrind_table
from report import _ints, _names

#: What callgrind's summary line says: ``==pid== I   refs:      62,583,234``.
REFS = re.compile(r"I\s+refs:\s+([\d,]+)")
#: The environment of a counted run: hash randomisation off (dict probe counts move with the
#: seed) and numpy's BLAS threads at one (their spinning adds instructions at random).
QUIET_ENV = {"PYTHONHASHSEED": "0", "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1"}


def run_case(
    impl: str, policy: str, op: str, size: int, rounds: int, warmup: int, positions: bool = False
) -> None:
    """The counted process: fill, warm up, then ``rounds`` rounds of ``op`` in one reduce."""
    cache = FilledCache(impl, policy, size, positions=positions)
    target = cache.targets[op]
    for keys, ctx in cache.prepare(op, warmup):
        target(keys, ctx)
    cache.settle()
    args = cache.prepare(op, rounds)
    # The cyclic GC paused, as the timings pause it (a collection would count the whole heap).
    gc.collect()
    gc.disable()
    # functools.reduce is the C function callgrind collects inside: nothing else calls it here.
    functools.reduce(lambda _, a: target(*a), args, None)


def count(
    impl: str,
    policy: str,
    op: str,
    size: int,
    rounds: int,
    warmup: int,
    valgrind: str,
    positions: bool = False,
) -> int:
    """Instructions of ``rounds`` rounds of ``op``, from a callgrind run of :func:`run_case`."""
    with tempfile.TemporaryDirectory() as tmp:
        cmd = [
            valgrind,
            "--tool=callgrind",
            f"--callgrind-out-file={Path(tmp) / 'callgrind.out'}",
            "--collect-atstart=no",
            "--toggle-collect=functools_reduce",
            sys.executable,
            __file__,
            "--child",
            impl,
            policy,
            op,
            str(size),
            str(rounds),
            str(warmup),
            *(["positions"] if positions else []),
        ]
        env = {**os.environ, **QUIET_ENV}
        done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    found = REFS.findall(done.stderr)
    if done.returncode != 0 or not found:
        tail = "\n".join(done.stderr.splitlines()[-15:])
        raise RuntimeError(f"callgrind run of {impl}/{policy}/{op} failed:\n{tail}")
    refs = int(found[-1].replace(",", ""))
    if refs == 0:
        raise RuntimeError(f"{impl}/{policy}/{op}: nothing was counted (no reduce call?)")
    return refs


def main(argv: list[str] | None = None) -> int:
    """Count every asked case and print a markdown table of instructions per key."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        impl, policy, op, size, rounds, warmup = argv[1:7]
        run_case(impl, policy, op, int(size), int(rounds), int(warmup), argv[7:] == ["positions"])
        return 0
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--impls", type=_names, default=["rust"], help="comma-separated (rust)")
    parser.add_argument("--policies", type=_names, default=["lru", "arc"])
    parser.add_argument("--ops", type=_names, default=list(OPERATIONS))
    parser.add_argument("--sizes", type=_ints, default=[1000])
    parser.add_argument("--rounds", type=int, default=200, help="counted rounds (200)")
    parser.add_argument("--warmup", type=int, default=50, help="uncounted rounds first (50)")
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the counts")
    parser.add_argument(
        "--positions", action="store_true", help="token positions recorded (see cases.py)"
    )
    args = parser.parse_args(argv)
    for what, names, known in (
        ("implementation", args.impls, IMPLS),
        ("policy", args.policies, POLICIES),
        ("operation", args.ops, OPERATIONS),
    ):
        for name in names:
            if name not in known:
                print(f"callgrind_ffi: unknown {what} {name!r} (one of {known})", file=sys.stderr)
                return 2
    valgrind = shutil.which("valgrind")
    if valgrind is None:
        print("callgrind_ffi: valgrind is not installed", file=sys.stderr)
        return 2
    rows: list[dict[str, object]] = []
    print(
        f"Instructions per key, {args.rounds} rounds of {KEYS_PER_OP} keys after {args.warmup} "
        f"uncounted (callgrind; Python {sys.version.split()[0]}):\n",
        flush=True,
    )
    for policy in args.policies:
        for op in args.ops:
            for size in args.sizes:
                for impl in args.impls:
                    if unavailable(impl, policy) is not None:
                        continue
                    refs = count(
                        impl, policy, op, size, args.rounds, args.warmup, valgrind, args.positions
                    )
                    per_key = refs / (args.rounds * KEYS_PER_OP)
                    print(
                        f"callgrind_ffi: {impl} {policy} {op} {size:,}: {per_key:,.0f}",
                        file=sys.stderr,
                    )
                    rows.append(
                        {
                            "impl": impl,
                            "policy": policy,
                            "op": op,
                            "chunks": size,
                            "rounds": args.rounds,
                            "warmup": args.warmup,
                            "instructions": refs,
                            "per_key": per_key,
                        }
                    )
    print("\n".join(callgrind_table(rows)))
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
