"""The Python API: load a workload, simulate one policy and size, or a miss-ratio curve."""

from __future__ import annotations

import contextlib
import dataclasses
import multiprocessing
import os
import pickle
import signal
import sys
import tempfile
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor, as_completed
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any, Union

from tqdm import tqdm  # type: ignore[import-untyped, unused-ignore]

from kvoffload.errors import InvalidArgumentError
from kvoffload.policies import CachePolicyFactory
from kvoffload.sim.classic import run_classic
from kvoffload.sim.engine import SimConfig, require_lookups, run_serving
from kvoffload.sim.generators import GENERATORS, GeneratorConfig, generate_workload
from kvoffload.sim.model import DEFAULT_BLOCK_TOKENS, SimRequest
from kvoffload.sim.results import SimResult
from kvoffload.sim.traces import (
    CsvColumns,
    ObjectTrace,
    detect_format,
    read_jsonl,
    zipf_object_trace,
)
from kvoffload.sim.traces import read_object_trace as _read_object_trace

__all__ = ["Workload", "load_workload", "miss_ratio_curve", "simulate", "working_set"]

#: A serving workload (requests) or an object trace (classic mode).
Workload = Union[Sequence[SimRequest], ObjectTrace]  # noqa: UP007 (a runtime alias on 3.10)


def load_workload(
    spec: str | Path,
    *,
    fmt: str | None = None,
    generator: GeneratorConfig | None = None,
    csv_columns: CsvColumns | None = None,
) -> Workload:
    """Generate (chat, rag, agent, zipf) or read a trace (jsonl, txt, csv, oracleGeneral).

    ``zipf-objects`` is a seeded Zipf object trace for classic mode (`zipf_object_trace`):
    ``generator.requests`` requests over a tenth as many objects, exponent ``generator.alpha``.
    """
    if spec == "zipf-objects" and fmt is None:
        g = generator or GeneratorConfig()
        return zipf_object_trace(g.requests, max(1, g.requests // 10), g.alpha, g.seed)
    if isinstance(spec, str) and spec in GENERATORS and fmt is None:
        return generate_workload(spec, generator)
    fmt = fmt or detect_format(spec)
    if fmt == "jsonl":
        return read_jsonl(spec)
    return _read_object_trace(spec, fmt, csv_columns)


def working_set(workload: Workload, block_tokens: int = DEFAULT_BLOCK_TOKENS) -> int:
    """Distinct chunks (keys, prompts and outputs) or distinct objects of a workload."""
    if isinstance(workload, ObjectTrace):
        return workload.num_objects
    keys: set[bytes] = set()
    for r in workload:
        k = r.keys(block_tokens)
        keys.update(k.prompt)
        keys.update(k.output)
    return len(keys)


def simulate(
    workload: Workload | str | Path,
    config: SimConfig | None = None,
    *,
    name: str = "custom",
    progress: bool = False,
    **overrides: Any,
) -> SimResult:
    """Run one policy at one size: serving mode for requests, classic mode for an object trace.

    ``workload`` may also be a generator name or a trace path (`load_workload`, defaults).
    ``overrides`` replace fields of ``config`` (e.g. ``policy="arc", num_chunks=4096``).
    """
    if isinstance(workload, str | Path):
        name = name if name != "custom" else Path(workload).name
        workload = load_workload(workload)
    cfg = dataclasses.replace(config or SimConfig(), **overrides)
    if not progress:
        # No tqdm at all: even a disabled one makes a multiprocessing lock, which a worker
        # process that is terminated (an interrupted miss_ratio_curve) leaves to the resource
        # tracker, who then warns of a leaked semaphore.
        if isinstance(workload, ObjectTrace):
            return run_classic(workload, cfg, workload=name)
        return run_serving(workload, cfg, workload=name)
    with tqdm(total=len(workload), unit="req", desc=cfg.policy) as bar:
        if isinstance(workload, ObjectTrace):
            return run_classic(workload, cfg, workload=name, progress=bar.update)
        return run_serving(workload, cfg, workload=name, progress=bar.update)


_WORKER_WORKLOAD: Workload | None = None


def _init_worker(workload_file: str, policies: dict[str, tuple[str, str]]) -> None:
    global _WORKER_WORKLOAD  # one workload per worker process
    # A Ctrl-C reaches the whole process group: the parent alone handles it (it ends the
    # workers), so that no worker turns it into a failed run and goes on to the next.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with open(workload_file, "rb") as f:
        _WORKER_WORKLOAD = pickle.load(f)
    # The names registered in the parent (a spawned worker starts with the built-in ones only).
    CachePolicyFactory.register_missing(policies)


@contextlib.contextmanager
def _sigint_ignored_while_spawning() -> Iterator[None]:
    """Ignore SIGINT while worker processes are started (from the main thread only).

    A spawned worker inherits the ignored signal and keeps it through its start-up, where a
    Ctrl-C would otherwise end it with a traceback before `_init_worker` could ignore it.
    """
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


def _children_can_start() -> bool:
    """Spawned children re-run ``__main__`` from its file; a script read from stdin has none."""
    main_file = getattr(sys.modules.get("__main__"), "__file__", None)
    return main_file is None or os.path.exists(main_file)


def _run_in_worker(cfg: SimConfig, name: str) -> SimResult:
    assert _WORKER_WORKLOAD is not None
    return simulate(_WORKER_WORKLOAD, cfg, name=name)


def check_curve(
    workload: Workload,
    sizes: Sequence[int],
    policies: Sequence[str],
    config: SimConfig,
    jobs: int | None = None,
) -> None:
    """Refuse what `miss_ratio_curve` would refuse, before any run or worker starts."""
    if not sizes or not policies:
        raise InvalidArgumentError("a miss-ratio curve needs at least one policy and one size")
    if min(sizes) < 0:
        raise InvalidArgumentError(f"cache sizes must be >= 0, got {min(sizes)}")
    if jobs is not None and jobs < 0:
        raise InvalidArgumentError(f"jobs must be >= 1 (0 or None: the default), got {jobs}")
    for policy in dict.fromkeys(policies):  # at the largest size, the one a pool may not reach
        dataclasses.replace(config, policy=policy, num_chunks=max(sizes)).validate()
    require_lookups(workload)


def miss_ratio_curve(
    workload: Workload,
    sizes: Iterable[int],
    policies: Sequence[str] = ("lru", "arc"),
    config: SimConfig | None = None,
    *,
    name: str = "custom",
    jobs: int | None = None,
    progress: bool = False,
    on_result: Callable[[SimResult], object] | None = None,
) -> list[SimResult]:
    """Simulate every policy at every size, in ``jobs`` processes (default: CPUs, at most 4).

    Results come back ordered by policy, then size. ``jobs=1`` runs in this process, and so does
    a program read from stdin (spawned worker processes could not re-import it). Worker processes
    re-run the main script as they start, so a script must call this under
    ``if __name__ == "__main__":``; a worker that dies raises BrokenProcessPool.
    """
    base = config or SimConfig()
    sizes = sorted(set(sizes))
    check_curve(workload, sizes, policies, base, jobs)
    tasks = [dataclasses.replace(base, policy=p, num_chunks=s) for p in policies for s in sizes]
    jobs = jobs or min(4, os.cpu_count() or 1, len(tasks))
    if not _children_can_start():
        jobs = 1
    results: dict[int, SimResult] = {}
    with tqdm(total=len(tasks), disable=not progress, unit="run", desc="miss-ratio curve") as bar:
        if jobs <= 1:
            for i, cfg in enumerate(tasks):
                results[i] = simulate(workload, cfg, name=name)
                bar.update(1)
                if on_result is not None:
                    on_result(results[i])
        else:
            ctx = multiprocessing.get_context("spawn")
            # The workload reaches the workers through a file, not in the pickle each worker is
            # started with: that pickle is written into a pipe the worker reads as it starts,
            # and a worker that dies before reading it all (a script without the __main__
            # guard) would block this process for ever.
            with tempfile.TemporaryDirectory(prefix="kvoffload-sim-") as tmp:
                workload_file = os.path.join(tmp, "workload.pickle")
                with open(workload_file, "wb") as f:
                    pickle.dump(workload, f, protocol=pickle.HIGHEST_PROTOCOL)
                try:
                    registered = CachePolicyFactory.registrations()
                    init = (workload_file, registered)
                    with ProcessPoolExecutor(jobs, ctx, _init_worker, init) as pool:
                        try:  # from the first submit, which starts the workers
                            with _sigint_ignored_while_spawning():
                                futures = {
                                    pool.submit(_run_in_worker, cfg, name): i
                                    for i, cfg in enumerate(tasks)
                                }
                            for fut in as_completed(futures):
                                results[futures[fut]] = fut.result()
                                bar.update(1)
                                if on_result is not None:
                                    on_result(results[futures[fut]])
                        except BaseException:
                            _stop_workers(pool)
                            raise
                except BrokenProcessPool as e:
                    raise BrokenProcessPool(_worker_died(len(results))) from e
    return [results[i] for i in range(len(tasks))]


def _stop_workers(pool: ProcessPoolExecutor) -> None:
    """Drop the runs not started and end the workers now (a KeyboardInterrupt, a failed run).

    Leaving the ``with`` block would otherwise wait for every run left, each in a worker that
    a Ctrl-C (which reaches the workers too) does not stop: they go on to the next run.
    """
    processes = dict(getattr(pool, "_processes", None) or {})  # private, but there since 3.2
    pool.shutdown(wait=False, cancel_futures=True)
    for process in processes.values():
        if process.is_alive():
            process.terminate()
    for process in processes.values():
        process.join(timeout=5)


def _worker_died(done: int) -> str:
    """What to say when a worker process died, ``done`` results in."""
    if done:
        return f"a worker process died after {done} run(s) of the miss-ratio curve"
    return (
        "a worker process died before any run of the miss-ratio curve finished; its error is "
        "above. Worker processes re-run the main script as they start: a script that calls "
        'miss_ratio_curve (jobs > 1) must do so under `if __name__ == "__main__":`, or pass '
        "jobs=1"
    )
