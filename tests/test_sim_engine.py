"""Serving mode drives the real manager: invariants hold, counts add up, implementations agree."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kvoffload import InvalidArgumentError
from kvoffload.sim import (
    GeneratorConfig,
    ObjectTrace,
    SimConfig,
    SimResult,
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
            simulate(workload, num_chunks=8)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError, match="undefined"):
            miss_ratio_curve(workload, [8, 16], jobs=2)  # type: ignore[arg-type]


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
