"""Differential test run: seeded random legal call sequences, Rust vs reference (vs vLLM 0.33.0).

Example::

    python tools/difftest.py --sequences 1000 --calls 1000 --policies lru arc \
        --thresholds 1 2 3 --vllm --jobs 8

Every sequence runs on each implementation side by side (``tests/_driver.py``); results, events and
stats are compared after every call and, for kvoffload's managers, the introspected state too. The
first mismatch of each configuration is shrunk to a short call sequence and printed with a Python
repro. Exits 1 when any sequence mismatched.

With ``--plug-ins`` each manager drives a Python policy instead (the policies ``mru`` and
``random``, which record every call made of them): after every call the managers must have made
the same calls of it, in the same order, with the same arguments::

    python tools/difftest.py --plug-ins --sequences 200 --vllm --jobs 2

With ``--shared`` each sequence drives two managers per implementation that share every request
context (each ordered pair of ``--policies``, ``lru+arc`` say): a call of one replaces the other's
request state on the context, and an LRU request rank must outlive that exactly as vLLM's does
(with ``--plug-ins`` too: the calls made of each manager's plug-in must match)::

    python tools/difftest.py --shared --sequences 300 --vllm --jobs 2

With ``--tiering`` each run drives vLLM's ``TieringOffloadingManager`` twice through a seeded
scheduler (``tests/_tiering.py``): once around vLLM's own CPU primary tier, once around
kvoffload's (``KVOffloadTieringOffloadingSpec``), for each ``--policies`` x ``--setups`` (the
secondary tiers) x ``--chunks``, ``--steps`` steps a run; every answer, and after each step both
primary tiers' state and the secondary tiers' contents, must match (needs the vLLM sources)::

    python tools/difftest.py --tiering --sequences 100 --steps 200 --jobs 2
"""

from __future__ import annotations

import argparse
import multiprocessing
import sys
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.append(str(ROOT / "python"))  # an installed kvoffload wins over the source tree

from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]  # noqa: E402

import _driver  # noqa: E402  (tests/ is not a package)
from kvoffload._common import BUILTIN_POLICIES  # noqa: E402


@dataclass(frozen=True)
class Outcome:
    """What a worker reports for one sequence (plain data: it crosses process boundaries)."""

    policy: str
    threshold: int
    seed: int
    calls: int
    seconds: float
    mismatch: str | None  # the report, when the sequence mismatched


_specs: list[_driver.ImplSpec] = []
_options: dict[str, object] = {}


def _make_specs(impls: list[str], plugins: bool) -> list[_driver.ImplSpec]:
    specs = [_driver.impl_spec(name) for name in impls]
    if plugins:
        module = _driver.install_plugins(vllm=any(n.startswith("vllm") for n in impls))
        specs = [_driver.plugin_spec(spec, module) for spec in specs]
    return specs


def _init_worker(
    impls: list[str], calls: int, introspect: bool, context: int, plugins: bool
) -> None:
    if impls:
        _specs[:] = _make_specs(impls, plugins)
    _options.update(calls=calls, introspect=introspect, context=context)


def _run_tiering(task: tuple[str, int, int]) -> Outcome:
    # "policy@setup", the pool size and the seed; calls are scheduler steps here.
    import _tiering

    config, chunks, seed = task
    policy, setup = config.split("@")
    steps = int(str(_options["calls"]))
    oracle = _driver._load_tool("vllm_oracle").load()
    start = time.perf_counter()
    extra = {"eviction_policy": policy, "secondary_tiers": _tiering.SETUPS[setup]()}
    report = None
    try:
        _tiering.run_pair(oracle, seed, steps, chunks, extra)
    except _tiering.TieringMismatch as e:
        report = str(e)
    return Outcome(config, chunks, seed, steps, time.perf_counter() - start, report)


def _run_one(task: tuple[str, int, int]) -> Outcome:
    policy, threshold, seed = task
    if "@" in policy:
        return _run_tiering(task)
    start = time.perf_counter()
    calls, introspect = int(str(_options["calls"])), bool(_options["introspect"])
    if "+" in policy:  # --shared: two managers sharing their request contexts
        first, second = policy.split("+")
        pair = (first, second)
        result = _driver.run_shared_sequence(_specs, pair, threshold, seed, calls, introspect)
    else:
        result = _driver.run_sequence(_specs, policy, threshold, seed, calls, introspect)
    report = None
    if result.mismatch is not None:
        report = result.mismatch.report(int(str(_options["context"])))
    return Outcome(policy, threshold, seed, result.calls, time.perf_counter() - start, report)


def _parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sequences", type=int, default=100, help="sequences per configuration")
    parser.add_argument("--calls", type=int, default=1000, help="calls per sequence")
    parser.add_argument(
        "--policies",
        nargs="+",
        choices=[*BUILTIN_POLICIES, *_driver.PLUGIN_CLASSES],
        help="default: lru arc (with --plug-ins: mru random, the only choices there)",
    )
    parser.add_argument("--thresholds", nargs="+", type=int, default=[1, 2, 3])
    parser.add_argument("--seed", type=int, default=0, help="first seed; sequence i uses seed+i")
    parser.add_argument(
        "--impls",
        nargs="+",
        default=["rust", "reference"],
        choices=_driver.IMPL_NAMES,
        help="implementations compared (the first one's results drive the model)",
    )
    parser.add_argument("--vllm", action="store_true", help="also run vLLM 0.33.0's own manager")
    parser.add_argument(
        "--vllm-state",
        action="store_true",
        help="with --vllm: also compare vLLM's internal state (a debugging aid)",
    )
    parser.add_argument("--no-state", action="store_true", help="skip introspection checks")
    parser.add_argument("--jobs", type=int, default=1, help="worker processes")
    parser.add_argument("--no-shrink", action="store_true", help="do not shrink mismatches")
    parser.add_argument("--shrink-seconds", type=float, default=120.0)
    parser.add_argument("--context", type=int, default=40, help="history lines per report")
    parser.add_argument(
        "--plug-ins",
        action="store_true",
        help="drive recording Python plug-in policies and compare the calls made of them",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="drive two managers (each ordered pair of --policies) sharing request contexts",
    )
    parser.add_argument(
        "--tiering",
        action="store_true",
        help="drive vLLM's tiering manager around vLLM's and kvoffload's primary tiers",
    )
    parser.add_argument(
        "--setups", nargs="+", help="with --tiering: secondary tiers (tests/_tiering.py SETUPS)"
    )
    parser.add_argument(
        "--chunks", nargs="+", type=int, default=[6, 16, 40], help="with --tiering: pool sizes"
    )
    parser.add_argument("--steps", type=int, default=200, help="with --tiering: steps a run")
    args = parser.parse_args(argv)
    if args.tiering:
        import _tiering

        args.setups = args.setups or sorted(_tiering.SETUPS)
        if not set(args.setups) <= set(_tiering.SETUPS):
            parser.error(f"--setups: choose from {', '.join(sorted(_tiering.SETUPS))}")
        if args.plug_ins or args.shared:
            parser.error("--tiering runs the built-in policies, one manager each")
    allowed = list(_driver.PLUGIN_CLASSES) if args.plug_ins else list(BUILTIN_POLICIES)
    if args.policies is None:
        args.policies = allowed if args.plug_ins else ["lru", "arc"]
    elif not set(args.policies) <= set(allowed):
        parser.error(f"--policies: choose from {', '.join(allowed)}")
    if args.plug_ins and args.vllm_state:
        parser.error("--vllm-state reads vLLM's built-in policies; not with --plug-ins")
    return args


def main(argv: list[str] | None = None) -> int:
    """Run the configured sequences; print mismatches and one summary line per configuration."""
    args = _parse(argv)
    if args.tiering:
        return _main_tiering(args)
    impls = list(args.impls)
    if args.vllm:
        reason = _driver.vllm_unavailable_reason()
        if reason is not None:
            print(f"difftest: --vllm: {reason}", file=sys.stderr)
            return 2
        impls.append("vllm-deep" if args.vllm_state else "vllm")
    introspect = not args.no_state
    policies = list(args.policies)
    if args.shared:
        policies = [f"{a}+{b}" for a in policies for b in policies]
    tasks = [
        (policy, threshold, args.seed + i)
        for policy in policies
        for threshold in args.thresholds
        for i in range(args.sequences)
    ]
    print(f"difftest: {' vs '.join(impls)}; {len(tasks)} sequences x {args.calls} calls")
    init_args = (impls, args.calls, introspect, args.context, args.plug_ins)
    outcomes, bad, wall = _run_all(tasks, init_args, args.jobs)
    by_config: dict[tuple[str, int], list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_config[(outcome.policy, outcome.threshold)].append(outcome)
    specs = _make_specs(impls, args.plug_ins)
    for _config, group in sorted(by_config.items()):
        failed = sorted((o for o in group if o.mismatch), key=lambda o: o.seed)
        if failed:
            _explain(failed[0], specs, introspect, args)
    _summary(by_config, ("threshold", "sequences", "calls"), len(outcomes), bad, wall)
    return 1 if bad else 0


def _main_tiering(args: argparse.Namespace) -> int:
    """``--tiering``: vLLM's tiering manager around each primary tier (no shrinking)."""
    reason = _driver.vllm_unavailable_reason()
    if reason is not None:
        print(f"difftest: --tiering: {reason}", file=sys.stderr)
        return 2
    tasks = [
        (f"{policy}@{setup}", chunks, args.seed + i)
        for policy in args.policies
        for setup in args.setups
        for chunks in args.chunks
        for i in range(args.sequences)
    ]
    print(
        f"difftest: tiering, vLLM's primary tier vs kvoffload's; "
        f"{len(tasks)} runs x {args.steps} steps"
    )
    outcomes, bad, wall = _run_all(tasks, ([], args.steps, True, args.context, False), args.jobs)
    by_config: dict[tuple[str, int], list[Outcome]] = defaultdict(list)
    for outcome in outcomes:
        by_config[(outcome.policy, outcome.threshold)].append(outcome)
    for (config, chunks), group in sorted(by_config.items()):
        failed = sorted((o for o in group if o.mismatch), key=lambda o: o.seed)
        if failed:
            print(f"\n=== {config} chunks={chunks} seed={failed[0].seed} ===")
            print(failed[0].mismatch)
    _summary(by_config, ("chunks", "runs", "steps"), len(outcomes), bad, wall)
    return 1 if bad else 0


def _run_all(
    tasks: list[tuple[str, int, int]],
    init_args: tuple[list[str], int, bool, int, bool],
    jobs: int,
) -> tuple[list[Outcome], int, float]:
    """Run ``tasks`` (in ``jobs`` processes); the outcomes, the mismatches and the wall time."""
    outcomes: list[Outcome] = []
    bad = 0
    start = time.perf_counter()
    with tqdm(total=len(tasks), unit="seq", dynamic_ncols=True) as bar:
        if jobs > 1:
            with multiprocessing.Pool(jobs, _init_worker, init_args) as pool:
                results = pool.imap_unordered(_run_one, tasks, chunksize=4)
                for outcome in results:
                    outcomes.append(outcome)
                    bad += outcome.mismatch is not None
                    bar.set_postfix(mismatches=bad)
                    bar.update()
        else:
            _init_worker(*init_args)
            for task in tasks:
                outcome = _run_one(task)
                outcomes.append(outcome)
                bad += outcome.mismatch is not None
                bar.set_postfix(mismatches=bad)
                bar.update()
    return outcomes, bad, time.perf_counter() - start


def _summary(
    by_config: dict[tuple[str, int], list[Outcome]],
    words: tuple[str, str, str],
    runs: int,
    bad: int,
    wall: float,
) -> None:
    """Print one line per configuration, then the total.

    ``words`` name a configuration's number, a run and a step.
    """
    label, run, step = words
    print()
    for (policy, threshold), group in sorted(by_config.items()):
        failed_seeds = [o.seed for o in group if o.mismatch]
        calls = sum(o.calls for o in group)
        cpu = sum(o.seconds for o in group)
        seeds = f" (seeds {', '.join(map(str, sorted(failed_seeds)[:10]))})" if failed_seeds else ""
        print(
            f"{policy} {label}={threshold}: {len(group)} {run}, {calls:,} {step}, "
            f"{len(failed_seeds)} mismatches{seeds}, {cpu:.1f} s"
        )
    print(f"total: {runs} {run}, {bad} mismatches, {wall:.1f} s wall")


def _explain(
    outcome: Outcome, specs: list[_driver.ImplSpec], introspect: bool, args: argparse.Namespace
) -> None:
    """Print the first mismatch of a configuration, shrunk, with a repro script."""
    print(f"\n=== {outcome.policy} threshold={outcome.threshold} seed={outcome.seed} ===")
    print(outcome.mismatch)
    if args.no_shrink:
        return
    if "+" in outcome.policy:  # not shrunk: the report holds both managers' calls in order
        if args.plug_ins:
            return  # the repro would name the driver's policies, not the plug-ins
        first, second = outcome.policy.split("+")
        shared = _driver.run_shared_sequence(
            specs, (first, second), outcome.threshold, outcome.seed, args.calls, introspect
        )
        if shared.mismatch is not None:
            print("\n--- repro ---")
            print(shared.mismatch.repro())
        return
    result = _driver.run_sequence(
        specs, outcome.policy, outcome.threshold, outcome.seed, args.calls, introspect
    )
    small = None
    if result.mismatch is not None:
        small = _driver.shrink(
            result.config, result.ops, specs, introspect, budget_s=args.shrink_seconds
        )
    if small is None:
        print("(the mismatch did not reproduce in this process; nothing to shrink)")
        return
    print(f"\n--- shrunk to {len(small.history)} calls ---")
    print(small.report(None))
    if args.plug_ins:
        return  # the repro would name the driver's policy, not the plug-in
    print("\n--- repro ---")
    print(small.repro())


if __name__ == "__main__":
    sys.exit(main())
