"""``kvoffload bench``: the Rust manager and the pure-Python reference, side by side.

Both run the same seeded workload (``kvoffload.workload``) in the same process, for each policy;
the table gives the hit rate and the manager's nanoseconds per key for each call kind, and the
speed-up of every implementation over the reference. Behaviour is exact, so every implementation
must get the same answers (same digest): if one does not, the bench says so loudly and fails.

``vllm`` (vLLM 0.33.0's own manager, lru and arc) joins the table when its files are available:
an installed ``vllm``, or, in a source checkout, the sources ``tools/fetch_vllm.py`` caches
(loaded by ``tools/vllm_oracle.py``). vLLM has no ``lookup_prefix``, so it runs only with
``--lookup single`` (one ``lookup`` per key, as its connector does); then the table adds the
speed-up of the Rust manager over vLLM's.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import importlib
import importlib.util
import json
import platform
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload._common import check_distinct, resolve_policy
from kvoffload.errors import KVOffloadError
from kvoffload.types import ReqContext, make_offload_key
from kvoffload.workload import CALL_KINDS, ReplayResult, Workload, WorkloadConfig, generate, replay

__all__ = [
    "IMPLEMENTATIONS",
    "POLICIES",
    "BenchRun",
    "add_arguments",
    "format_table",
    "load_implementation",
    "main",
    "run",
]

#: Implementations by name: "module:attribute" of the manager class. The reference is the baseline
#: of every speed-up; any other "module:attribute" can also be passed to ``--impls``.
IMPLEMENTATIONS: dict[str, str] = {
    "reference": "kvoffload.reference:CPUOffloadingManager",
    "rust": "kvoffload:CPUOffloadingManager",
}
BASELINE = "reference"
POLICIES: tuple[str, ...] = ("lru", "arc")
#: vLLM 0.33.0's own manager: the name, and the policies it has built in.
VLLM = "vllm"
VLLM_POLICIES: tuple[str, ...] = ("lru", "arc")
#: How a replay digest starts when the implementation answered differently in two replays.
NONDETERMINISTIC = "nondeterministic:"

#: The call kinds shown in the table (``events`` only when ``--events`` is on).
TABLE_KINDS: tuple[str, ...] = tuple(k for k in CALL_KINDS if k != "events")


@dataclass
class BenchRun:
    """One implementation under one policy: the best of its repeats."""

    policy: str
    impl: str
    result: ReplayResult

    def to_json(self) -> dict[str, Any]:
        """Return the run as a JSON-ready mapping."""
        return {"policy": self.policy, "impl": self.impl, **self.result.to_json()}


@dataclass(frozen=True)
class VllmManager:
    """vLLM 0.33.0's manager class and the types it answers and reads."""

    cls: type
    lookup_result: Any
    context_cls: type


def load_vllm() -> VllmManager:
    """Load vLLM 0.33.0's manager: an installed ``vllm``, else the checkout's oracle loader."""
    try:
        base = importlib.import_module("vllm.v1.kv_offload.base")
        manager = importlib.import_module("vllm.v1.kv_offload.cpu.manager")
        return VllmManager(manager.CPUOffloadingManager, base.LookupResult, base.ReqContext)
    except ImportError:
        pass
    tools = Path(__file__).resolve().parent.parent.parent / "tools" / "vllm_oracle.py"
    if not tools.is_file():
        raise ImportError("vllm is not installed and this is not a source checkout")
    spec = importlib.util.spec_from_file_location("vllm_oracle", tools)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {tools}")
    oracle_module = sys.modules.get("vllm_oracle") or importlib.util.module_from_spec(spec)
    if "vllm_oracle" not in sys.modules:
        sys.modules["vllm_oracle"] = oracle_module
        spec.loader.exec_module(oracle_module)
    reason = oracle_module.unavailable_reason()
    if reason is not None:
        raise ImportError(reason)
    oracle = oracle_module.load()
    return VllmManager(oracle.CPUOffloadingManager, oracle.base.LookupResult, oracle.ReqContext)


def load_implementation(name: str) -> type:
    """Import the manager class named ``name`` (a key of IMPLEMENTATIONS or "module:attr")."""
    if name == VLLM:
        return load_vllm().cls
    target = IMPLEMENTATIONS.get(name, name)
    module_name, sep, attr = target.partition(":")
    if not sep:
        raise ValueError(f"unknown implementation {name!r}: use one of {list(IMPLEMENTATIONS)}")
    cls = getattr(importlib.import_module(module_name), attr)
    if not isinstance(cls, type):
        raise TypeError(f"{target} is not a class")
    return cls


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Declare the options of ``kvoffload bench``."""
    defaults = WorkloadConfig()
    parser.add_argument(
        "--requests", type=int, default=defaults.requests, help="requests to replay (%(default)s)"
    )
    parser.add_argument(
        "--chunks", type=int, default=8192, help="host-pool size in chunks (%(default)s)"
    )
    parser.add_argument(
        "--seed", type=int, default=defaults.seed, help="workload seed (%(default)s)"
    )
    parser.add_argument(
        "--kv-groups", type=int, default=defaults.kv_groups, help="KV-cache groups (%(default)s)"
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=defaults.concurrency,
        help="requests running at once (%(default)s)",
    )
    parser.add_argument(
        "--lookup",
        choices=("prefix", "single"),
        default=defaults.lookup_mode,
        help="prefix: lookup_prefix per request; single: lookup per key, as vLLM (%(default)s)",
    )
    parser.add_argument(
        "--policies", type=_csv, default=list(POLICIES), help="comma-separated (lru,arc)"
    )
    parser.add_argument(
        "--impls",
        type=_csv,
        default=[*IMPLEMENTATIONS, VLLM],
        help="comma-separated names or module:Class (reference,rust,vllm; vllm when available)",
    )
    parser.add_argument(
        "--repeat", type=int, default=1, help="replays per implementation; the fastest is kept (1)"
    )
    parser.add_argument(
        "--events", action="store_true", help="enable events and drain them every step"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="write the results as JSON")
    parser.add_argument(
        "--plot", type=Path, metavar="PATH", help="bar chart of ns/key (needs matplotlib)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _csv(text: str) -> list[str]:
    return [part.strip() for part in text.split(",") if part.strip()]


def _refusal(args: argparse.Namespace) -> str | None:
    """What is wrong with the options (None: nothing), checked before anything runs."""
    if args.repeat < 1 or args.chunks < 0:
        return "--repeat must be >= 1 and --chunks >= 0"
    if args.requests < 0 or args.kv_groups < 1 or args.concurrency < 1:
        return (
            "--requests must be >= 0, --kv-groups and --concurrency >= 1, got "
            f"{args.requests}, {args.kv_groups}, {args.concurrency}"
        )
    for option, names in (("--policies", args.policies), ("--impls", args.impls)):
        if not names:
            return f"{option} names nothing"
    try:
        check_distinct("--policies", args.policies)
        check_distinct("--impls", args.impls)
        for policy in args.policies:
            resolve_policy(policy, None)
    except KVOffloadError as e:
        return str(e)
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        # Found out now, not after the replays: a folder in the way, or no folder to write in.
        if path is not None and (path.is_dir() or not path.parent.is_dir()):
            return f"{option} {path}: cannot write a file there"
    return None


def run(args: argparse.Namespace) -> int:
    """Run ``kvoffload bench``; return the exit status (1 when implementations disagree)."""
    refusal = _refusal(args)
    if refusal is not None:
        print(f"kvoffload bench: error: {refusal}", file=sys.stderr)
        return 2
    config = WorkloadConfig(
        requests=args.requests,
        seed=args.seed,
        kv_groups=args.kv_groups,
        concurrency=args.concurrency,
        lookup_mode=args.lookup,
    )
    classes: dict[str, type] = {}
    for name in args.impls:
        if name == VLLM and args.lookup != "single":
            print(
                "kvoffload bench: vllm has no lookup_prefix: add --lookup single to compare it",
                file=sys.stderr,
            )
            continue
        try:
            classes[name] = load_implementation(name)
        except Exception as exc:  # any import failure only skips that implementation
            print(f"kvoffload bench: skipping {name}: {type(exc).__name__}: {exc}", file=sys.stderr)
    if not classes:
        print("kvoffload bench: error: no implementation could be loaded", file=sys.stderr)
        return 2

    workload = generate(config)
    runs = _run_all(workload, classes, args)
    identical = _check_identical(runs)
    print(_describe(workload, args))
    print()
    print(format_table(runs, events=args.events))
    speedups = _speedups(runs)
    print()
    for policy, ok in identical.items():
        impls = [r.impl for r in runs if r.policy == policy]
        digest = next(r.result.digest for r in runs if r.policy == policy)
        if ok and len(impls) == 1:
            print(
                f"{policy}: answers from {impls[0]} alone, compared with nothing (digest {digest})"
            )
        elif ok:
            print(f"{policy}: identical answers from {', '.join(impls)} (digest {digest})")
        else:
            print(f"{policy}: MISMATCH, see stderr")
            print(_divergence_report(policy, runs), file=sys.stderr)
    try:
        if args.json is not None:
            _write_json(args.json, workload, args, runs, speedups, identical)
        if args.plot is not None:
            _plot(args.plot, runs)
    except OSError as e:
        print(f"kvoffload bench: error: {e}", file=sys.stderr)
        return 2
    return 0 if all(identical.values()) else 1


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point for ``python -m kvoffload.bench``."""
    parser = argparse.ArgumentParser(prog="kvoffload bench", description=__doc__)
    add_arguments(parser)
    return run(parser.parse_args(argv))


def _run_all(
    workload: Workload, classes: dict[str, type], args: argparse.Namespace
) -> list[BenchRun]:
    """Replay every (policy, implementation), ``args.repeat`` times each, interleaved."""
    best: dict[tuple[str, str], ReplayResult] = {}
    digests: dict[tuple[str, str], str] = {}  # of each one's first replay
    unstable: set[tuple[str, str]] = set()
    tqdm = _tqdm_class()
    types: dict[str, Any] = {}
    if VLLM in classes:
        vllm = load_vllm()
        types = {"lookup_result": vllm.lookup_result, "context_cls": vllm.context_cls}
    for policy in args.policies:
        for _ in range(args.repeat):
            for name, cls in classes.items():
                if name == VLLM and policy not in VLLM_POLICIES:
                    continue
                manager = cls(args.chunks, cache_policy=policy, enable_events=args.events)
                with tqdm(
                    total=len(workload.requests),
                    desc=f"{policy}/{name}",
                    unit="req",
                    file=sys.stderr,
                    disable=args.no_progress,
                    leave=False,
                ) as bar:
                    result = replay(
                        manager,
                        workload,
                        drain_events=args.events,
                        progress=bar.update,
                        **(types if name == VLLM else {}),
                    )
                context_cls = types["context_cls"] if name == VLLM else ReqContext
                result.digest += "+" + _eviction_order(manager, args.chunks, context_cls)
                del manager
                first = digests.setdefault((policy, name), result.digest)
                if result.digest != first and (policy, name) not in unstable:
                    print(f"kvoffload bench: {policy}/{name} is not deterministic", file=sys.stderr)
                    unstable.add((policy, name))
                previous = best.get((policy, name))
                if previous is None or result.total_ns < previous.total_ns:
                    best[(policy, name)] = result
    for key in unstable:  # whichever replay was kept
        best[key].digest = f"{NONDETERMINISTIC}{best[key].digest}"
    return [BenchRun(policy, impl, result) for (policy, impl), result in best.items()]


def _eviction_order(manager: Any, chunks: int, context_cls: Any) -> str:
    """A digest of the order in which the policy would evict what the pool holds at the end.

    Untimed, after a replay: as many fresh keys stored as the pool has chunks, in batches of 32,
    so that the policies' state at the end is compared too, not only what the replay's answers
    showed of it.
    """
    digest = hashlib.blake2b(digest_size=8)
    ctx = context_cls("kvoffload-bench-eviction-order")
    manager.on_new_request(ctx)
    for lo in range(0, chunks, 32):
        keys = [
            make_offload_key(hashlib.blake2b(b"order-%d" % i, digest_size=32).digest(), 0)
            for i in range(lo, min(lo + 32, chunks))
        ]
        out = manager.prepare_store(keys, ctx)
        if out is None:
            digest.update(b"N;")
            continue
        digest.update(b"".join(out.evicted_keys) + b";")
        manager.complete_store(out.keys_to_store, ctx)
    manager.on_request_finished(ctx)
    return digest.hexdigest()


def _tqdm_class() -> Any:
    from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

    return tqdm


def _check_identical(runs: list[BenchRun]) -> dict[str, bool]:
    """Per policy: every implementation got the first one's answers, each in all its replays."""
    first: dict[str, ReplayResult] = {}
    out: dict[str, bool] = {}
    for r in runs:
        base = first.setdefault(r.policy, r.result)
        same = base.same_answers(r.result) and not r.result.digest.startswith(NONDETERMINISTIC)
        out[r.policy] = out.get(r.policy, True) and same
    return out


def _divergence_report(policy: str, runs: list[BenchRun]) -> str:
    group = [r for r in runs if r.policy == policy]
    lines = ["", "!" * 78, f"!! MISMATCH ({policy}): the implementations gave different answers."]
    for r in group:
        lines.append(
            f"!!   {r.impl:<12} hit rate {r.result.hit_rate:.6f}  digest {r.result.digest}"
        )
    for r in group[1:]:
        step = group[0].result.first_divergent_step(r.result)
        lines.append(f"!!   {group[0].impl} vs {r.impl}: first different step {step}")
    lines.append("!! Behaviour must be identical; this is a bug in one of them.")
    lines.append("!" * 78)
    return "\n".join(lines)


def _speedups(
    runs: list[BenchRun], baseline: str = BASELINE
) -> dict[str, dict[str, dict[str, float | None]]]:
    """``{policy: {impl: {kind or "total": baseline's time / impl's time}}}``."""
    out: dict[str, dict[str, dict[str, float | None]]] = {}
    base = {r.policy: r.result for r in runs if r.impl == baseline}
    for r in runs:
        ref = base.get(r.policy)
        if r.impl in (BASELINE, VLLM) or ref is None:
            continue
        ratios: dict[str, float | None] = {}
        for kind in CALL_KINDS:
            a, b = ref.ns_per_key(kind), r.result.ns_per_key(kind)
            ratios[kind] = a / b if a is not None and b else None
        ratios["total"] = ref.total_ns / r.result.total_ns if r.result.total_ns else None
        out.setdefault(r.policy, {})[r.impl] = ratios
    return out


def _describe(workload: Workload, args: argparse.Namespace) -> str:
    cfg = workload.config
    return (
        f"kvoffload bench: {len(workload.requests):,} requests "
        f"({workload.num_keys:,} keys, {workload.num_unique_keys:,} distinct), "
        f"{args.chunks:,} chunks, {cfg.kv_groups} KV group(s), concurrency {cfg.concurrency}, "
        f"lookup={cfg.lookup_mode}, seed {cfg.seed}\n"
        "ns/key of manager time per call kind (finish = on_new_request + on_request_finished, "
        "per key of the request; the timer's own cost is subtracted)"
    )


def format_table(runs: list[BenchRun], *, events: bool = False) -> str:
    """Render the runs as a plain-text table with a speed-up row per policy and implementation."""
    kinds = [*TABLE_KINDS, "events"] if events else list(TABLE_KINDS)
    header = ["policy", "impl", "hit rate", *kinds, "total"]
    rows: list[list[str]] = []
    speedups = _speedups(runs)
    over_vllm = _speedups(runs, VLLM)
    for policy in dict.fromkeys(r.policy for r in runs):
        for r in (r for r in runs if r.policy == policy):
            res = r.result
            rows.append(
                [
                    policy,
                    r.impl,
                    f"{res.hit_rate:.2%}",
                    *(_ns(res.ns_per_key(k)) for k in kinds),
                    _ns(res.total_ns_per_key),
                ]
            )
        for impl, ratios in speedups.get(policy, {}).items():
            rows.append(
                [
                    policy,
                    f"{impl} speed-up",
                    "",
                    *(_ratio(ratios[k]) for k in kinds),
                    _ratio(ratios["total"]),
                ]
            )
        for impl, ratios in over_vllm.get(policy, {}).items():
            rows.append(
                [
                    policy,
                    f"{impl} vs vllm",
                    "",
                    *(_ratio(ratios[k]) for k in kinds),
                    _ratio(ratios["total"]),
                ]
            )
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]

    def line(cells: list[str]) -> str:
        left = [c.ljust(w) for c, w in zip(cells[:2], widths[:2], strict=True)]
        right = [c.rjust(w) for c, w in zip(cells[2:], widths[2:], strict=True)]
        return "  ".join(left + right).rstrip()

    rule = "  ".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(row) for row in rows)])


def _ns(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}"


def _ratio(value: float | None) -> str:
    return "-" if value is None else f"{value:,.1f}x"


def _write_json(
    path: Path,
    workload: Workload,
    args: argparse.Namespace,
    runs: list[BenchRun],
    speedups: dict[str, dict[str, dict[str, float | None]]],
    identical: dict[str, bool],
) -> None:
    from kvoffload import __version__

    doc = {
        "kvoffload_version": __version__,
        "python": sys.version,
        "platform": platform.platform(),
        "machine": platform.machine(),
        "workload": {
            **dataclasses.asdict(workload.config),
            "num_keys": workload.num_keys,
            "num_unique_keys": workload.num_unique_keys,
        },
        "chunks": args.chunks,
        "events": args.events,
        "repeat": args.repeat,
        "runs": [r.to_json() for r in runs],
        "speedups": speedups,
        "speedups_over_vllm": _speedups(runs, VLLM),
        "identical": identical,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")


def _plot(path: Path, runs: list[BenchRun]) -> None:
    """Draw ns/key per call kind (log scale), one panel per policy; skip without matplotlib."""
    try:
        matplotlib = importlib.import_module("matplotlib")
    except ImportError:
        print(
            "kvoffload bench: --plot needs matplotlib (pip install 'kvoffload[bench]')",
            file=sys.stderr,
        )
        return
    matplotlib.use("Agg")
    plt = importlib.import_module("matplotlib.pyplot")
    policies = list(dict.fromkeys(r.policy for r in runs))
    impls = list(dict.fromkeys(r.impl for r in runs))
    kinds = [*TABLE_KINDS, "total"]
    fig, axes = plt.subplots(
        1, len(policies), figsize=(6.5 * len(policies), 4.5), squeeze=False, sharey=True
    )
    try:
        width = 0.8 / max(1, len(impls))
        for ax, policy in zip(axes[0], policies, strict=True):
            for i, impl in enumerate(impls):
                res = next((r.result for r in runs if r.policy == policy and r.impl == impl), None)
                if res is None:
                    continue
                values = [
                    res.ns_per_key(k) if k != "total" else res.total_ns_per_key for k in kinds
                ]
                xs = [x + (i - (len(impls) - 1) / 2) * width for x in range(len(kinds))]
                ax.bar(xs, [v or 0.0 for v in values], width, label=impl)
            ax.set_yscale("log")
            ax.set_title(f"{policy}: ns per key")
            ax.set_xticks(range(len(kinds)))
            ax.set_xticklabels(kinds, rotation=35, ha="right")
            ax.grid(axis="y", which="both", alpha=0.3)
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=120)
    finally:
        plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
