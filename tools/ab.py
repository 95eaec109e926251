"""Time two builds of kvoffload side by side in one process: an A/B test for performance work.

On a shared VM the same benchmark moves by up to half between processes minutes apart (a slow
phase of the host raises every figure), so a change worth a few percent cannot be judged by
running the old build, then the new one. This loads both builds into one interpreter (each its
own copy of the ``kvoffload`` package and its own extension, swapped in and out of
``sys.modules``) and takes turns: each round runs every build once, in an order that rotates,
and each keeps its fastest round. Both builds then see the same phases of the machine.

Two measurements:

- the scheduler replay (default): ``kvoffload.workload``'s seeded workload through a fresh
  manager per round, per call kind (the manager's nanoseconds, as ``benches/vllm_step.py``
  reports them); built through vLLM's spec factory with vLLM's types where its sources are
  cached (``tools/fetch_vllm.sh``), else (or with ``--own-types``) directly, in kvoffload's
  types. Both builds replay the very same workload, and their answer digests must agree;
- ``--ffi OPS``: the FFI cases of ``benches/cases.py`` (32 keys a call against a full pool of
  ``--size`` chunks), ns per key, timed by ``cases.time_op_interleaved``.

A build is ``.`` (this working tree's ``python/kvoffload`` with the extension built into it), a
path to a built extension (``_native.abi3.so``, with this tree's Python package), or a git
revision: checked out into a temporary worktree and built there by cargo, into
``.ab-cache/target`` (its own target directory, so the working tree's build is left alone);
the package is kept in ``.ab-cache/<commit>`` for later runs.

    python tools/ab.py HEAD .                              # replay, lru and arc
    python tools/ab.py HEAD~3 . --policies arc --rounds 10
    python tools/ab.py HEAD . --ffi store_evict,load_complete --size 100000
    python tools/ab.py /tmp/old.so /tmp/new.so --ffi lookup_prefix
"""

from __future__ import annotations

import argparse
import importlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
# The bench modules each build imports its own copy of (OWN).
if str(ROOT / "benches") not in sys.path:
    sys.path.insert(0, str(ROOT / "benches"))
CACHE = ROOT / ".ab-cache"
EXT = "_native.abi3.so"
#: What maturin builds the extension with (pyproject.toml's ``[tool.maturin] features``).
FEATURES = ("--features", "pyo3/extension-module")
#: Modules each build has its own copy of: the package and the bench modules that import it.
OWN = ("kvoffload", "cases", "vllm_step")
#: Call kinds of the replay, in the order shown.
KINDS = (
    "prepare_store",
    "complete_store",
    "prepare_load",
    "complete_load",
    "lookup",
    "touch",
    "finish",
    "events",
)


def _owned(name: str) -> bool:
    return any(name == m or name.startswith(m + ".") for m in OWN)


def _git(*args: str, cwd: Path = ROOT) -> str:
    out = subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True)
    return out.stdout.strip()


def _copy_package(src: Path, dest: Path, ext: Path) -> Path:
    """``dest/kvoffload``: the package at ``src`` with the extension ``ext``; returns ``dest``."""
    pkg = dest / "kvoffload"
    shutil.copytree(src, pkg, ignore=shutil.ignore_patterns("__pycache__", "*.so", "*.pyd"))
    shutil.copy2(ext, pkg / EXT)
    return dest


def _tree_extension() -> Path:
    """The extension built for this working tree.

    In its package (``maturin develop``), or wherever the installed ``kvoffload._native`` lives
    (asked of a fresh interpreter).
    """
    ext = ROOT / "python" / "kvoffload" / EXT
    if ext.is_file():
        return ext
    ask = "import kvoffload._native as m; print(m.__file__)"
    found = subprocess.run([sys.executable, "-c", ask], capture_output=True, text=True)
    if found.returncode != 0 or not found.stdout.strip():
        raise SystemExit("ab: no built extension for this tree: build it first (maturin develop)")
    return Path(found.stdout.strip())


def _build_revision(rev: str) -> Path:
    """The package of git revision ``rev``, built once and kept in ``.ab-cache/<commit>``."""
    try:
        sha = _git("rev-parse", "--verify", f"{rev}^{{commit}}")
    except subprocess.CalledProcessError:
        raise SystemExit(f"ab: {rev!r} is neither '.', an extension file nor a revision") from None
    done = CACHE / sha
    if (done / "kvoffload" / EXT).is_file():
        return done
    CACHE.mkdir(exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f"ab-{sha[:10]}-"))
    target = CACHE / "target"
    print(f"ab: building {rev} ({sha[:10]}) in {work} ...", file=sys.stderr, flush=True)
    try:
        _git("worktree", "add", "--detach", str(work), sha)
        env = {**os.environ, "CARGO_TARGET_DIR": str(target), "PYO3_PYTHON": sys.executable}
        subprocess.run(
            [*("cargo", "build", "--release", "-q", "-p", "kvoffload-py"), *FEATURES],
            cwd=work,
            env=env,
            check=True,
        )
        staged = Path(tempfile.mkdtemp(prefix="stage-", dir=CACHE))
        _copy_package(work / "python" / "kvoffload", staged, target / "release" / "lib_native.so")
        staged.rename(done)
    finally:
        subprocess.run(["git", "worktree", "remove", "--force", str(work)], cwd=ROOT, check=False)
        shutil.rmtree(work, ignore_errors=True)
    return done


def prepare(build: str, scratch: Path, label: str) -> Path:
    """A directory holding the ``kvoffload`` package of ``build`` (see the module docs)."""
    if build == ".":
        return _copy_package(ROOT / "python" / "kvoffload", scratch / label, _tree_extension())
    path = Path(build)
    if path.is_file():
        return _copy_package(ROOT / "python" / "kvoffload", scratch / label, path)
    return _build_revision(build)


class Builds:
    """The builds' module sets; :meth:`use` makes one of them the importable ``kvoffload``."""

    def __init__(self, dirs: dict[str, Path]) -> None:
        self.modules: dict[str, dict[str, ModuleType]] = {}
        for label, d in dirs.items():
            self._clear()
            sys.path.insert(0, str(d))
            try:
                importlib.import_module("kvoffload")
                importlib.import_module("kvoffload.workload")
                native = importlib.import_module("kvoffload._native")
            finally:
                sys.path.remove(str(d))
            if Path(native.__file__ or "").parent.parent != d:
                raise SystemExit(f"ab: build {label} imported {native.__file__}, not from {d}")
            self.modules[label] = {n: m for n, m in sys.modules.items() if _owned(n)}
        self._clear()

    @staticmethod
    def _clear() -> None:
        for name in [n for n in sys.modules if _owned(n)]:
            del sys.modules[name]

    @contextmanager
    def use(self, label: str) -> Iterator[dict[str, ModuleType]]:
        """Build ``label``'s modules in ``sys.modules`` (later imports see them) for the block."""
        self._clear()
        sys.modules.update(self.modules[label])
        try:
            yield self.modules[label]
        finally:
            # Keep what the block imported (a module imported lazily stays with its build).
            self.modules[label].update({n: m for n, m in sys.modules.items() if _owned(n)})
            self._clear()

    def module(self, label: str, name: str) -> ModuleType:
        """``name`` of build ``label``, imported with that build in place if not yet."""
        with self.use(label) as mods:
            return mods.get(name) or importlib.import_module(name)


def _rotations(labels: list[str], rounds: int) -> Iterator[str]:
    for r in range(rounds):
        k = r % len(labels)
        yield from labels[k:] + labels[:k]


def _oracle(own_types: bool) -> Any:
    if own_types:
        return None
    if str(ROOT / "tools") not in sys.path:
        sys.path.insert(0, str(ROOT / "tools"))
    import vllm_oracle

    try:
        return vllm_oracle.load()
    except Exception as e:  # any failure to load it means "not available"
        print(
            f"ab: vLLM's sources unavailable ({e}): replaying in kvoffload's types", file=sys.stderr
        )
        return None


def replay_ab(
    builds: Builds, policy: str, rounds: int, requests: int, chunks: int, oracle: Any
) -> dict[str, dict[str, float]]:
    """Fastest manager milliseconds per call kind (and ``total``) of each build's replays."""
    labels = list(builds.modules)
    first = builds.module(labels[0], "kvoffload.workload")
    workload = first.generate(first.WorkloadConfig(requests=requests, seed=0, lookup_mode="single"))
    best: dict[str, dict[str, float]] = {}
    digests: dict[str, str] = {}
    # Built and replayed as benches/vllm_step.py does, with each build's copy of it.
    steps = {label: builds.module(label, "vllm_step") for label in labels} if oracle else {}
    for label in _rotations(labels, rounds):
        with builds.use(label) as mods:
            if oracle is None:
                manager = mods["kvoffload"].CPUOffloadingManager(chunks, cache_policy=policy)
                result = mods["kvoffload.workload"].replay(manager, workload)
            else:
                vs = steps[label]
                make = vs.build(oracle, chunks, vs.extra_configs(policy)["kvoffload"], False)
                result = vs.run_one(oracle, "kvoffload", make, workload, False)
        ms = {k: s.net_ns(result.timer_overhead_ns) / 1e6 for k, s in result.kinds.items()}
        ms["total"] = sum(ms.values())
        prev = best.get(label)
        best[label] = ms if prev is None else {k: min(prev[k], ms[k]) for k in ms}
        if digests.setdefault(label, result.digest) != result.digest:
            raise SystemExit(f"ab: build {label} answered differently from one replay to the next")
    if len(set(digests.values())) > 1:
        print(f"ab: WARNING: the builds answer differently ({policy}): {digests}", file=sys.stderr)
    return best


def ffi_ab(
    builds: Builds, policy: str, ops: list[str], size: int, rounds: int
) -> dict[str, dict[str, float]]:
    """Fastest ns per key of each FFI case for each build (interleaved runs)."""
    labels = list(builds.modules)
    caches = {}
    for label in labels:
        cases = builds.module(label, "cases")
        with builds.use(label):
            caches[label] = cases.FilledCache("rust", policy, size)
    timer = builds.module(labels[0], "cases").time_op_interleaved
    return {op: timer(caches, op, repeat=rounds) for op in ops}


def _table(title: str, rows: dict[str, dict[str, float]], labels: list[str], unit: str) -> str:
    a, b = labels
    lines = [
        f"**{title}**",
        "",
        f"| | {a} ({unit}) | {b} ({unit}) | {b} / {a} |",
        "|---|---:|---:|---:|",
    ]
    for name, v in rows.items():
        ratio = v[b] / v[a] if v[a] else float("nan")
        lines.append(f"| {name} | {v[a]:,.2f} | {v[b]:,.2f} | {ratio:.3f} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Prepare both builds, time them in turns and print a table per policy."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", help="the baseline build: '.', an extension file or a git revision")
    parser.add_argument("b", help="the build compared with it")
    parser.add_argument("--policies", default="lru,arc")
    parser.add_argument("--rounds", type=int, default=6, help="turns each build takes (6)")
    parser.add_argument("--requests", type=int, default=2000, help="replay requests (2,000)")
    parser.add_argument("--chunks", type=int, default=8192, help="replay pool size (8,192)")
    parser.add_argument("--own-types", action="store_true", help="replay in kvoffload's types")
    parser.add_argument("--ffi", default="", help="FFI cases instead of the replay (comma list)")
    parser.add_argument("--size", type=int, default=100_000, help="FFI pool size (100,000)")
    args = parser.parse_args(argv)
    if args.rounds < 1:
        parser.error("--rounds must be at least 1")
    labels = ["A", "B"]
    with tempfile.TemporaryDirectory(prefix="kvoffload-ab-") as scratch:
        dirs = {
            label: prepare(build, Path(scratch), label)
            for label, build in zip(labels, (args.a, args.b), strict=True)
        }
        builds = Builds(dirs)
        print(f"A = {args.a}, B = {args.b}; fastest of {args.rounds} interleaved rounds\n")
        policies = [p for p in args.policies.split(",") if p]
        if args.ffi:
            ops = [o for o in args.ffi.split(",") if o]
            for policy in policies:
                rows = ffi_ab(builds, policy, ops, args.size, args.rounds)
                title = f"{policy}: FFI cases, {args.size:,} chunks"
                print(_table(title, rows, labels, "ns/key") + "\n", flush=True)
        else:
            oracle = _oracle(args.own_types)
            types = "kvoffload's types" if oracle is None else "vLLM's types"
            for policy in policies:
                best = replay_ab(builds, policy, args.rounds, args.requests, args.chunks, oracle)
                kinds = [k for k in (*KINDS, "total") if any(best[x].get(k) for x in labels)]
                rows = {k: {x: best[x].get(k, 0.0) for x in labels} for k in kinds}
                title = f"{policy}: replay of {args.requests:,} requests ({types}), manager ms"
                print(_table(title, rows, labels, "ms") + "\n", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
