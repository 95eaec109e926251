"""Serving mode drives the real manager: invariants hold, counts add up, implementations agree."""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.connection
import pickle
import signal
import subprocess
import sys
import threading
import time
import types
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

import pytest

from kvoffload import InvalidArgumentError
from kvoffload.sim import (
    GeneratorConfig,
    ObjectTrace,
    SimConfig,
    SimResult,
    api,
    format_comparison,
    format_curve,
    generate_workload,
    miss_ratio_curve,
    simulate,
    working_set,
    zipf_object_trace,
)
from kvoffload.sim.engine import make_manager, run_serving
from kvoffload.sim.model import SimRequest


def _run(requests: list[SimRequest], **kw: Any) -> tuple[SimResult, Any]:
    cfg = SimConfig(**kw)
    manager = make_manager(cfg)
    return run_serving(requests, cfg, manager=manager), manager


def _assert_settled(manager: Any) -> None:
    manager.check_invariants()
    # Every load and store completed: nothing is pending or pinned at the end.
    assert all(ref == 0 for _, ref in manager.resident().values())


@pytest.mark.parametrize("name", ["chat", "rag", "agent", "zipf"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_counts_add_up(name: str, policy: str) -> None:
    reqs = generate_workload(name, GeneratorConfig(requests=120, seed=2))
    size = working_set(reqs) // 6
    res, manager = _run(reqs, num_chunks=size, policy=policy, store_failure_prob=0.05)
    _assert_settled(manager)
    assert res.requests == len(reqs)
    assert res.lookup_chunks == sum(len(r.keys().prompt) for r in reqs)
    assert 0 < res.hit_chunks < res.lookup_chunks
    assert 0 < res.hit_tokens < res.prompt_tokens
    assert res.evicted_chunks > 0
    stores = res.calls["complete_store"]
    assert stores.keys == res.stored_chunks + res.stores_failed
    # Everything stored is resident, evicted, or was dropped by a failed store.
    assert len(manager.resident()) == res.stored_chunks - res.evicted_chunks
    assert res.calls["prepare_load"].keys == res.hit_chunks == res.calls["complete_load"].keys
    assert res.calls["on_new_request"].calls == res.calls["on_request_finished"].calls == len(reqs)
    assert res.bytes_loaded == res.hit_chunks * res.chunk_bytes
    assert res.sim_time_s >= reqs[-1].arrival
    assert all(res.ns_per_call(k) is not None for k in ("lookup", "prepare_store"))


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_rust_and_reference_agree(policy: str) -> None:
    reqs = generate_workload("chat", GeneratorConfig(requests=150, seed=5, kv_groups=2))
    cfg = SimConfig(num_chunks=working_set(reqs) // 5, policy=policy, store_failure_prob=0.05)
    rust = simulate(reqs, cfg)
    ref = simulate(reqs, cfg, impl="reference")
    fields = ("hit_chunks", "hit_tokens", "stored_chunks", "evicted_chunks", "stores_failed")
    assert [getattr(rust, f) for f in fields] == [getattr(ref, f) for f in fields]
    assert rust.impl == "rust"
    assert ref.impl == "reference"


def test_pending_waits_and_threshold_skips() -> None:
    # A burst on few prefixes: later arrivals find the first one's blocks still being stored.
    reqs = generate_workload("zipf", GeneratorConfig(requests=80, rate=5000.0, alpha=2.0))
    slow = SimConfig(num_chunks=2000, transfer_bytes_per_s=1e8, store_threshold=2)
    res, manager = _run(reqs, **dataclasses.asdict(slow))
    _assert_settled(manager)
    assert res.pending_waits > 0
    assert res.stores_skipped > 0


def test_refused_stores_when_everything_is_pinned() -> None:
    reqs = generate_workload("rag", GeneratorConfig(requests=40, rate=1000.0))
    res, manager = _run(reqs, num_chunks=64, transfer_bytes_per_s=1e8)
    _assert_settled(manager)
    assert res.stores_refused > 0


def test_plugin_policy_runs_on_the_reference_manager() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=60))
    cfg = SimConfig(
        num_chunks=500,
        policy="LibCacheSimArc",
        impl="reference",
        cache_policy_module_path="kvoffload.sim.policies",
    )
    res = simulate(reqs, cfg)
    assert res.hit_chunks > 0
    assert res.policy == "LibCacheSimArc"


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_a_plugin_with_only_vllms_methods_runs_with_invariant_checks(impl: str) -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=60))
    cfg = SimConfig(
        num_chunks=300,
        policy="OldestFirst",
        impl=impl,
        cache_policy_module_path="_helpers",
        check_invariants=True,
    )
    res, manager = _run(reqs, **dataclasses.asdict(cfg))
    assert res.evicted_chunks > 0
    _assert_settled(manager)


def test_config_refuses_bad_names_and_values() -> None:
    for bad in (
        SimConfig(impl="Rust"),
        SimConfig(impl="kvoffload:Nope"),
        SimConfig(policy="MRUPolicy", cache_policy_module_path="kvoffload_test_nope"),
        SimConfig(store_threshold=-1),
        SimConfig(shadow_policies="arc"),  # type: ignore[arg-type]
    ):
        with pytest.raises(InvalidArgumentError):
            bad.validate()
    with pytest.raises(InvalidArgumentError, match="not a str"):
        SimConfig(shadow_policies="arc").validate()  # type: ignore[arg-type]
    SimConfig(store_threshold=0).validate()  # the manager takes 0, as vLLM does


def test_a_workload_that_looks_nothing_up_is_refused() -> None:
    empty_prompts = [SimRequest("r", 0.0, ((),), output_tokens=64)]
    for workload in ([], ObjectTrace.from_ids([]), empty_prompts):
        with pytest.raises(InvalidArgumentError, match="undefined"):
            simulate(workload, num_chunks=8)
        with pytest.raises(InvalidArgumentError, match="undefined"):
            miss_ratio_curve(workload, [8, 16], jobs=2)


UNGUARDED_SCRIPT = """
from kvoffload.sim import GeneratorConfig, generate_workload, miss_ratio_curve

requests = generate_workload("agent", GeneratorConfig(requests=50, seed=1))
print(miss_ratio_curve(requests, [64, 128], ("lru", "arc"), jobs=2))
"""


def test_a_script_without_the_main_guard_fails_instead_of_hanging(tmp_path: Path) -> None:
    # Each spawned worker re-runs the script and dies as it starts the curve again: the curve
    # must raise, not wait for ever on a worker that will never read what it was sent.
    script = tmp_path / "unguarded.py"
    script.write_text(UNGUARDED_SCRIPT)
    run = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode != 0
    assert "BrokenProcessPool" in run.stderr
    assert 'under `if __name__ == "__main__":`' in run.stderr


def test_miss_ratio_curve_is_sane() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=150, seed=1))
    wss = working_set(reqs)
    sizes = [wss // 16, wss // 4, wss]
    results = miss_ratio_curve(reqs, sizes, ("lru", "arc"), jobs=1)
    assert [(r.policy, r.num_chunks) for r in results] == [
        (p, s) for p in ("lru", "arc") for s in sizes
    ]
    for policy in ("lru", "arc"):
        curve = [r.miss_ratio for r in results if r.policy == policy]
        assert curve[0] > curve[2]
        assert curve[0] >= curve[1] >= curve[2]
    # A cache as big as the working set never evicts, so the policy cannot matter there.
    full = [r for r in results if r.num_chunks == wss]
    assert [r.evicted_chunks for r in full] == [0, 0]
    assert full[0].hit_chunks == full[1].hit_chunks
    assert full[0].miss_ratio == full[1].miss_ratio
    table = format_curve(results)
    assert "lru miss" in table
    assert "arc miss" in table
    assert "hit ratio (tokens)" in format_comparison(results[:1])


def test_lru_classic_curve_is_monotonic_in_parallel() -> None:
    # LRU is a stack algorithm: a bigger cache never misses more. Two processes.
    trace = zipf_object_trace(4000, 500, alpha=0.9, seed=7)
    sizes = [10, 40, 80, 160, 320]
    results = miss_ratio_curve(trace, sizes, ("lru",), jobs=2)
    curve = [r.miss_ratio for r in results]
    assert curve == sorted(curve, reverse=True)
    serial = miss_ratio_curve(trace, sizes, ("lru",), jobs=1)
    assert [r.hit_chunks for r in serial] == [r.hit_chunks for r in results]


def test_shadows_report_their_hit_rates_beside_the_live_policy() -> None:
    from kvoffload.sim import SimConfig, simulate
    from kvoffload.sim.traces import zipf_object_trace

    trace = zipf_object_trace(3000, 400, alpha=0.9, seed=5)
    live = simulate(trace, SimConfig(num_chunks=60, policy="lru", shadow_policies=("lru", "arc")))
    assert set(live.shadow_hit_rates) == {"lru", "arc"}
    # Classic mode completes every store at once, as a shadow does: the lru shadow is exact.
    assert live.shadow_hit_rates["lru"] == pytest.approx(live.hit_chunks / live.requests)
    assert "shadow_arc_hit_rate" in live.csv_row()


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_a_registered_name_reaches_the_worker_processes(
    monkeypatch: pytest.MonkeyPatch, impl: str
) -> None:
    # A spawned worker starts with the built-in names only: it used to answer "Unknown cache
    # policy" for a name the parent had registered.
    from kvoffload.policies import CachePolicyFactory

    monkeypatch.setattr(CachePolicyFactory, "_registry", dict(CachePolicyFactory._registry))
    CachePolicyFactory.register_cache_policy("oldest-first-test", "_helpers", "OldestFirst")
    reqs = generate_workload("zipf", GeneratorConfig(requests=60))
    policies = ["oldest-first-test", "lru"]
    cfg = SimConfig(impl=impl)
    spawned = miss_ratio_curve(reqs, [100, 300], policies, cfg, jobs=2)
    here = miss_ratio_curve(reqs, [100, 300], policies, cfg, jobs=1)
    assert [(r.policy, r.num_chunks, r.hit_chunks) for r in spawned] == [
        (r.policy, r.num_chunks, r.hit_chunks) for r in here
    ]
    assert [r.policy for r in spawned] == ["oldest-first-test"] * 2 + ["lru"] * 2


# -- exact small scenarios (mutation round 3) ---------------------------------------------------


def _blocks(tag: str, n: int) -> tuple[bytes, ...]:
    """A prompt of ``n`` chained blocks, as the generators build them."""
    from kvoffload.sim.generators import _extend

    out: list[bytes] = []
    _extend(out, tag.encode(), n)
    return tuple(out)


def test_simulated_time_follows_the_documented_model() -> None:
    # r1 stores a 4-block prompt; r2, the same prompt 100 s later, loads 3 blocks (one token must
    # be computed: the last block is not loaded), prefills 16 tokens, decodes 32 and stores its
    # 2 output blocks. Every step's duration is the documented one.
    prompt = (_blocks("p", 4),)
    reqs = [
        SimRequest("r1", 0.0, prompt),
        SimRequest("r2", 100.0, prompt, output_tokens=32),
    ]
    cfg = SimConfig(
        num_chunks=64,
        chunk_bytes=1000,
        transfer_bytes_per_s=1e4,  # 0.1 s per chunk
        transfer_latency_s=0.5,
        prefill_tokens_per_s=160.0,  # 0.1 s for the 16 computed tokens
        decode_tokens_per_s=8.0,  # 4 s for 32 tokens
    )
    res, _ = _run(reqs, **dataclasses.asdict(cfg))
    load = 0.5 + 3 * 0.1
    prefill = 16 / 160.0
    decode = 32 / 8.0
    store = 0.5 + 2 * 0.1
    assert res.sim_time_s == pytest.approx(100.0 + load + prefill + decode + store)
    assert (res.hit_chunks, res.hit_tokens, res.lookup_chunks) == (3, 48, 8)
    assert res.stored_chunks == 4 + 2


def test_a_whole_prompt_hit_loads_all_but_its_last_block() -> None:
    prompt = (_blocks("p", 3),)
    reqs = [SimRequest("r1", 0.0, prompt), SimRequest("r2", 50.0, prompt)]
    res, manager = _run(reqs, num_chunks=16)
    _assert_settled(manager)
    # r2's lookup finds all 3 blocks; only 2 are loaded (and count as hits).
    assert res.hit_chunks == 2 == res.calls["prepare_load"].keys
    assert res.hit_tokens == 32
    assert res.prompt_tokens == 96
    # r2 offers its last prompt block again (already stored: nothing new to store).
    assert res.calls["prepare_store"].keys == 3 + 1
    assert res.stored_chunks == 3


@pytest.mark.parametrize("retries", [0, 1, 2, 3])
def test_a_request_waits_at_most_max_pending_retries_times(retries: int) -> None:
    # r1's store takes 1,000 s; r2 arrives while it is pending and looks up again every 2 ms, at
    # most `retries` times, then computes its whole prompt.
    prompt = (_blocks("p", 2),)
    reqs = [SimRequest("r1", 0.0, prompt), SimRequest("r2", 1.0, prompt)]
    res, manager = _run(reqs, num_chunks=16, transfer_latency_s=1000.0, max_pending_retries=retries)
    _assert_settled(manager)
    assert res.pending_waits == retries
    assert res.hit_chunks == 0
    assert res.calls["lookup"].calls == 2 * (1 + 1) + 2 * retries


def test_every_timed_call_counts_one_timing_and_chunk_ops_count_keys() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=40, seed=1))
    res, _ = _run(reqs, num_chunks=working_set(reqs) // 4)
    for kind, s in res.calls.items():
        assert s.timings == s.calls, kind
    # One operation per key passed, and one per call passing none (lookups of no key included).
    assert res.chunk_ops == sum(s.keys for s in res.calls.values()) + sum(
        s.calls for k, s in res.calls.items() if k in ("on_new_request", "on_request_finished")
    )


def test_the_seed_draws_the_failed_stores() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=60, seed=1))
    runs = [
        _run(reqs, num_chunks=4000, store_failure_prob=0.5, seed=seed)[0].stores_failed
        for seed in (1, 1, 2)
    ]
    assert runs[0] == runs[1]
    assert runs[0] != runs[2]


def test_failed_stores_count_chunks() -> None:
    prompt = (_blocks("p", 5),)
    res, manager = _run([SimRequest("r1", 0.0, prompt)], num_chunks=16, store_failure_prob=1.0)
    _assert_settled(manager)
    assert (res.stores_failed, res.stored_chunks) == (5, 0)
    assert len(manager.resident()) == 0


def test_progress_counts_each_finished_request_once() -> None:
    from kvoffload.sim.classic import run_classic

    reqs = generate_workload("zipf", GeneratorConfig(requests=30, seed=1))
    ticks: list[int] = []
    run_serving(reqs, SimConfig(num_chunks=500), progress=ticks.append)
    assert ticks == [1] * 30
    # Classic mode reports every 10,000 requests, then the rest.
    trace = zipf_object_trace(25_000, 100, seed=1)
    ticks.clear()
    run_classic(trace, SimConfig(num_chunks=10), progress=ticks.append)
    assert ticks == [10_000, 10_000, 5_000]


def test_a_negative_cache_size_is_refused_before_any_run() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=10))
    done: list[SimResult] = []
    with pytest.raises(InvalidArgumentError, match=r"^cache sizes must be >= 0, got -1$"):
        miss_ratio_curve(reqs, [100, -1], jobs=1, on_result=done.append)
    assert done == []


def test_a_serial_curve_reports_each_result_once_over_distinct_sizes() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=20, seed=3))
    seen: list[tuple[str, int]] = []
    results = miss_ratio_curve(
        reqs,
        [50, 10, 50],
        ("lru", "fifo"),
        jobs=1,
        on_result=lambda r: seen.append((r.policy, r.num_chunks)),
    )
    order = [("lru", 10), ("lru", 50), ("fifo", 10), ("fifo", 50)]
    assert [(r.policy, r.num_chunks) for r in results] == order
    assert seen == order


def test_a_workload_given_by_name_or_path_names_the_result(tmp_path: Path) -> None:
    from kvoffload.sim import write_object_trace

    assert simulate("zipf", num_chunks=50).workload == "zipf"
    path = tmp_path / "objects.txt"
    write_object_trace(zipf_object_trace(100, 10), path, "txt")
    res = simulate(path, num_chunks=5)
    assert (res.workload, res.mode, res.requests) == ("objects.txt", "classic", 100)
    assert simulate(path, name="mine", num_chunks=5).workload == "mine"


def _result(mode: str = "serving", policy: str = "lru", size: int = 10, **kw: Any) -> SimResult:
    return SimResult(mode=mode, workload="w", policy=policy, impl="rust", num_chunks=size, **kw)


def test_result_figures_come_from_their_own_counts() -> None:
    from kvoffload.workload import KindStats

    r = _result(
        chunk_bytes=1000,
        requests=10,
        lookup_chunks=40,
        hit_chunks=10,
        prompt_tokens=640,
        hit_tokens=64,
        stored_chunks=7,
        chunk_ops=100,
        wall_s=2.0,
        timer_overhead_ns=100,
        calls={"lookup": KindStats(calls=2, keys=10, timings=2, ns=1000)},
        shadow_hit_rates={"arc": 0.25},
    )
    assert r.chunk_hit_ratio == 0.25
    assert r.miss_ratio == 0.75
    assert r.token_hit_ratio == 0.1
    assert (r.bytes_loaded, r.bytes_stored) == (10_000, 7_000)
    assert (r.requests_per_s, r.chunk_ops_per_s) == (5.0, 50.0)
    assert r.ns_per_call("lookup") == 400.0  # (1000 - 2 x 100) / 2 calls
    assert r.ns_per_call("touch") is None
    row = r.csv_row()
    assert row["shadow_arc_hit_rate"] == 0.25
    assert "shadow_hit_rates" not in row
    assert row["ns_per_lookup"] == 400.0


def test_tables_print_the_right_figures() -> None:
    from kvoffload.sim.results import _bytes

    assert (_bytes(1023), _bytes(1024), _bytes(3 << 20)) == ("1,023 B", "1.0 KiB", "3.0 MiB")
    a = _result(lookup_chunks=100, hit_chunks=30)
    b = _result(policy="arc", lookup_chunks=100, hit_chunks=45)
    curve = format_curve([a, b])
    assert curve.splitlines()[0].split() == [
        "cache",
        "size",
        "(chunks)",
        "lru",
        "miss",
        "arc",
        "miss",
    ]
    assert curve.splitlines()[2].split() == ["10", "0.7000", "0.5500"]
    # A table mixing the modes counts chunks and keeps the serving rows.
    mixed = format_comparison([a, _result(mode="classic", policy="arc", lookup_chunks=1)])
    assert "cache size (chunks)" in mixed
    assert "hit ratio (tokens)" in mixed


# -- the worker processes: Ctrl-C while they start, results, in-process fallback (mutation round) -


def test_a_parallel_curve_spawns_with_ctrl_c_ignored_and_reports_every_result(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    during_submit: list[Any] = []

    class RecordingPool(ProcessPoolExecutor):
        def submit(self, *args: Any, **kwargs: Any) -> Any:
            during_submit.append(signal.getsignal(signal.SIGINT))
            return super().submit(*args, **kwargs)

    monkeypatch.setattr(api, "ProcessPoolExecutor", RecordingPool)

    def own_handler(signum: int, frame: Any) -> None:
        raise AssertionError("no SIGINT is sent in this test")

    reqs = generate_workload("zipf", GeneratorConfig(requests=30, seed=2))
    seen: list[tuple[str, int]] = []
    previous = signal.signal(signal.SIGINT, own_handler)
    try:
        results = miss_ratio_curve(
            reqs,
            [80, 20],
            ("lru", "fifo"),
            jobs=2,
            on_result=lambda r: seen.append((r.policy, r.num_chunks)),
        )
        assert signal.getsignal(signal.SIGINT) is own_handler  # the caller's, given back
    finally:
        signal.signal(signal.SIGINT, previous)
    # The workers start at the first submit: a Ctrl-C then would end one with a traceback.
    assert during_submit == [signal.SIG_IGN] * 4
    order = [("lru", 20), ("lru", 80), ("fifo", 20), ("fifo", 80)]
    assert [(r.policy, r.num_chunks) for r in results] == order
    assert sorted(seen) == sorted(order)  # each once, as it finished


def test_a_parallel_curve_runs_from_a_thread_other_than_the_main_one() -> None:
    reqs = generate_workload("zipf", GeneratorConfig(requests=30, seed=2))
    outcome: list[object] = []

    def curve() -> None:
        try:
            outcome.append(miss_ratio_curve(reqs, [20, 80], ("lru",), jobs=2))
        except BaseException as e:  # signal.signal outside the main thread: ValueError
            outcome.append(e)

    thread = threading.Thread(target=curve)
    thread.start()
    thread.join(120)
    (results,) = outcome
    assert isinstance(results, list), results
    assert [r.num_chunks for r in results] == [20, 80]


def test_a_program_read_from_stdin_runs_its_curve_in_this_process(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def no_pool(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError("worker processes were started")

    monkeypatch.setattr(api, "ProcessPoolExecutor", no_pool)
    main = types.ModuleType("__main__")
    main.__file__ = "<stdin>"  # what `python - < script.py` has: no file a worker could re-run
    monkeypatch.setitem(sys.modules, "__main__", main)
    reqs = generate_workload("zipf", GeneratorConfig(requests=30, seed=2))
    results = miss_ratio_curve(reqs, [20, 80], ("lru",), jobs=2)
    assert [r.num_chunks for r in results] == [20, 80]
    # A main module without a file (an interactive session) re-runs nothing: workers can start.
    del main.__file__
    with pytest.raises(AssertionError, match="worker processes were started"):
        miss_ratio_curve(reqs, [20, 80], ("lru",), jobs=2)


def test_stopping_the_workers_has_ended_them_when_it_returns() -> None:
    pool = ProcessPoolExecutor(2, multiprocessing.get_context("spawn"))
    try:
        futures = [pool.submit(time.sleep, 60) for _ in range(4)]
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not all(f.running() for f in futures[:2]):
            time.sleep(0.05)
        processes = list(pool._processes.values())
        assert len(processes) == 2
        started = time.monotonic()
        api._stop_workers(pool)
        # Each has exited: its sentinel is ready. (Not `is_alive()`: the pool's own thread joins
        # the workers too, and a process it has reaped but not yet marked reads as alive.)
        sentinels = [p.sentinel for p in processes]
        assert len(multiprocessing.connection.wait(sentinels, timeout=0)) == len(processes)
        assert time.monotonic() - started < 30  # not the sleeps' minute
    finally:
        pool.shutdown(wait=True, cancel_futures=True)


def test_a_worker_ignores_ctrl_c_whatever_handler_it_started_with(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A worker spawned from the main thread inherits SIGINT ignored; one spawned from another
    # thread starts with Python's handler, and only its initialiser then keeps a Ctrl-C (sent to
    # the whole process group) from failing its run.
    trace = zipf_object_trace(50, 10, seed=1)
    path = tmp_path / "workload.pickle"
    path.write_bytes(pickle.dumps(trace))
    monkeypatch.setattr(api, "_WORKER_WORKLOAD", None)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        api._init_worker(str(path), {})
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
    finally:
        signal.signal(signal.SIGINT, previous)
    ran = api._run_in_worker(SimConfig(num_chunks=5), "t")  # on the workload it loaded
    here = simulate(trace, SimConfig(num_chunks=5), name="t")
    assert (ran.workload, ran.requests, ran.hit_chunks) == ("t", 50, here.hit_chunks)
