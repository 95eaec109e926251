"""kvoffload's manager as the CPU primary tier of vLLM 0.33.0's tiering offloading.

``KVOffloadTieringOffloadingSpec`` is vLLM's ``TieringOffloadingSpec`` with kvoffload's manager
(``KVOffloadCPUPrimaryTier``) in place of vLLM's ``CPUPrimaryTierOffloadingManager``; the
secondary tiers and vLLM's ``TieringOffloadingManager`` between them are vLLM's own. The
differential runs (``tests/_tiering.py``) drive a tiering manager of each spec side by side
through a seeded scheduler, with vLLM's example tier and a scripted one that is slow, fails,
forgets, and asks for request-level offloading, and compare every answer and, after each step,
both primary tiers' state and the secondary tiers' contents.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any

import pytest

import _driver
import _tiering
from kvoffload import InvalidArgumentError

#: A non-kvoffload policy: the tiering spec hands it to vLLM's own primary tier.
VLLMS_POLICY = {
    "eviction_policy": "RustLRU",
    "cache_policy_module_path": "kvoffload.integrations.vllm",
}


def _count_promotions(manager: Any) -> list[Any]:
    """The keys promoted into ``manager``'s primary tier from now on (its ``prepare_write``
    calls), as a list that grows as they come."""
    promoted: list[Any] = []
    write = manager.primary_tier.prepare_write

    def counting_write(keys: Any, req_context: Any) -> Any:
        promoted.extend(keys)
        return write(keys, req_context)

    manager.primary_tier.prepare_write = counting_write
    return promoted


@pytest.mark.parametrize("setup", sorted(_tiering.SETUPS))
@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("num_chunks", [6, 16, 40])
def test_tiering_with_kvoffloads_primary_tier_matches_vllms(
    oracle: Any, setup: str, policy: str, num_chunks: int
) -> None:
    for seed in range(3):
        extra = {"eviction_policy": policy, "secondary_tiers": _tiering.SETUPS[setup]()}
        paths = _tiering.run_pair(oracle, seed, 60, num_chunks, extra)
        assert not any(map(os.path.exists, paths))  # each manager removed its region


def test_the_fs_setup_runs_vllms_file_system_tier_on_real_files(oracle: Any) -> None:
    # vLLM's FileSystemTierManager, settled (tests/_tiering.py): each manager's tier writes one
    # file per stored key under a folder of its own, the same names for both, and the lockstep
    # run compares them and checks every load's bytes (read back from those files after a
    # promotion). Shutdown removes the folders.
    extra = {"eviction_policy": "lru", "secondary_tiers": _tiering.SETUPS["fs"]()}
    names = ("vllm", "kvoffload")
    managers = [_tiering.build(oracle, name, 8, extra) for name in names]
    tiers = [m.secondary_tiers[0] for m in managers]
    for t in tiers:
        assert type(t).__name__ == "SettledFileSystemTier"
        assert "FileSystemTierManager" in [c.__name__ for c in type(t).__mro__]
    roots = [t.root_dir for t in tiers]
    assert [os.path.basename(r) for r in roots] == list(names)
    assert len({os.path.dirname(r) for r in roots}) == 1
    promoted = _count_promotions(managers[1])
    run = _tiering.TieringRun(oracle, managers, names, seed=3)
    run.run(40)
    assert run.check_data  # every load's bytes were checked
    assert promoted  # some keys came back from the files
    assert not any(map(os.path.exists, roots))
    assert not os.path.exists(os.path.dirname(roots[0]))


@pytest.mark.parametrize("impl", ["vllm", "kvoffload"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_vllms_file_system_tier_on_its_own_threads_keeps_the_primary_tier_sound(
    oracle: Any, impl: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    # vLLM's file system tier unsettled (LiveFileSystemTier): its lookup thread answers when it
    # gets to it and its I/O threads finish transfers when the disk does, so a lookup stays
    # RETRY for a step or several and a completion lands whenever a poll finds it, as in vLLM.
    # That makes the run nondeterministic: one manager, checked each step (the primary tier's
    # invariants, and every load's bytes, promoted ones read back from the tier's files).
    # The scheduler sleeps a little between steps, as the model would run, so that the
    # threads catch up some of the time. With vLLM's own primary tier the run must pass too.
    extra = {"eviction_policy": policy, "secondary_tiers": [_tiering.fs_tier(settled=False)]}
    manager = _tiering.build(oracle, impl, 8, extra)
    tier = manager.secondary_tiers[0]
    assert type(tier).__name__ == "LiveFileSystemTier"
    assert tier._lookup_manager._thread.is_alive()  # vLLM's lookup thread, not replaced
    path = manager.primary_tier._mmap_region.mmap_path
    seen: collections.Counter[str] = collections.Counter()
    lookup = tier.lookup

    def counting_lookup(key: Any, req_context: Any) -> Any:
        result = lookup(key, req_context)
        seen[result.name] += 1
        return result

    tier.lookup = counting_lookup
    promoted = _count_promotions(manager)
    run = _tiering.TieringRun(oracle, [manager], [impl], seed=11, pause=0.002)
    assert run.check_data
    caplog.clear()  # the build's notes on out-of-tree code
    with caplog.at_level(logging.WARNING, logger="vllm"):
        run.run(150)
    assert not tier._lookup_manager._thread.is_alive()
    assert not os.path.exists(path)
    assert not os.path.exists(tier.root_dir)
    assert seen["RETRY"]  # answers came late,
    assert seen["HIT"]  # then came
    assert promoted  # keys came back from the files, their bytes checked
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


@pytest.mark.parametrize("impl", ["vllm", "kvoffload"])
@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_the_tier_poll_thread_enters_the_primary_tier_between_steps(
    oracle: Any, impl: str, policy: str, caplog: pytest.LogCaptureFixture
) -> None:
    # A tier that asks to be polled off-thread: vLLM's tiering manager then runs a thread that,
    # holding the manager's lock between the scheduler's steps, collects finished jobs
    # (complete_read / complete_write of the primary tier) and lets the tier serve its peers
    # (lookups, promotions and prepare_read through the parent manager). The scheduler holds
    # the lock through each step. Every step checks the primary tier's invariants (and the
    # bytes each load finds in its chunks); the thread must have served and logged nothing.
    # With vLLM's own primary tier the run must pass as well, or the scenario is wrong.
    tier = _tiering.scripted_tier(polled=True, serve_every=2, delay=1, fail_every=7, capacity=40)
    extra = {
        "eviction_policy": policy,
        "secondary_tiers": [tier],
        "tier_poll_interval_s": 0.0002,
    }
    manager = _tiering.build(oracle, impl, 16, extra)
    thread = manager._tier_poll_thread
    assert thread is not None
    assert thread.is_alive()
    polled = manager.secondary_tiers[0]
    path = manager.primary_tier._mmap_region.mmap_path
    run = _tiering.TieringRun(oracle, [manager], [impl], seed=7, locked=True, pause=0.0005)
    caplog.clear()  # the build's notes on out-of-tree code
    with caplog.at_level(logging.WARNING, logger="vllm"):
        run.run(200)
    assert not thread.is_alive()  # shutdown stopped and joined it
    assert not os.path.exists(path)
    assert polled.serving_threads[thread.ident] > 0
    assert sum(polled.serving_threads.values()) > polled.serving_threads[thread.ident]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def test_the_spec_builds_vllms_tiering_manager_around_kvoffloads_primary_tier(
    oracle: Any, vllm_mod: Any
) -> None:
    spec = _tiering.make_spec(oracle, "kvoffload", 8, {})
    assert type(spec) is vllm_mod.KVOffloadTieringOffloadingSpec
    manager = spec.get_manager()
    try:
        assert manager is spec.get_manager()
        assert type(manager).__name__ == "TieringOffloadingManager"
        primary = manager.primary_tier
        assert type(primary) is vllm_mod.KVOffloadCPUPrimaryTier
        assert isinstance(primary, vllm_mod.KVOffloadCPUOffloadingManager)
        # The secondary tiers' names for the calls are the core's own methods.
        assert primary.complete_read == primary._core.complete_load
        assert primary.prepare_write == primary._core.prepare_store
        assert primary.complete_write == primary._core.complete_store
        assert primary.prepare_read == primary._core.prepare_read
        view = primary.get_kv_memoryview()
        assert view.shape is not None
        assert view.shape[0] == 8
        # vLLM's own spec reports the same config.
        theirs = _tiering.make_spec(oracle, "vllm", 8, {})
        assert type(theirs).__name__ == "TieringOffloadingSpec"
        their_manager = theirs.get_manager()
        try:
            assert manager.config_info() == their_manager.config_info()
        finally:
            their_manager.shutdown()
    finally:
        manager.shutdown()


def test_a_policy_kvoffload_does_not_run_gets_vllms_primary_tier(oracle: Any) -> None:
    manager = _tiering.build(oracle, "kvoffload", 8, VLLMS_POLICY)
    try:
        assert type(manager.primary_tier).__name__ == "CPUPrimaryTierOffloadingManager"
    finally:
        manager.shutdown()


def test_pending_write_timeout_reaches_kvoffloads_primary_tier(oracle: Any) -> None:
    manager = _tiering.build(oracle, "kvoffload", 8, {"pending_write_timeout": 30})
    try:
        assert manager.primary_tier._pending_write_timeout == 30
    finally:
        manager.shutdown()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        ({"store_threshold": 2}, "store_threshold"),
        ({"pending_write_timeout": 30, **VLLMS_POLICY}, "pending_write_timeout"),
    ],
)
def test_keys_the_tiering_primary_tier_cannot_honour_are_refused(
    oracle: Any, extra: dict[str, Any], says: str
) -> None:
    spec = _tiering.make_spec(oracle, "kvoffload", 8, extra)
    with pytest.raises(InvalidArgumentError, match=says):
        spec.get_manager()
    # vLLM's spec refuses the threshold too, as a ValueError (InvalidArgumentError is one).
    if "store_threshold" in extra:
        theirs = _tiering.make_spec(oracle, "vllm", 8, extra)
        with pytest.raises(ValueError, match="store_threshold"):
            theirs.get_manager()


def test_a_failed_build_releases_the_region_and_the_primary_tier(oracle: Any) -> None:
    extra = {"secondary_tiers": [{"type": "no-such-tier"}]}
    spec = _tiering.make_spec(oracle, "kvoffload", 8, extra)
    with pytest.raises(ValueError, match="no-such-tier"):
        spec.get_manager()
    assert not os.path.exists(f"/dev/shm/vllm_offload_{spec.config.engine_id}.mmap")
    assert spec._scheduler_mmap is None
    # A later call tries again (and fails the same way), as vLLM's spec would.
    with pytest.raises(ValueError, match="no-such-tier"):
        spec.get_manager()


def test_difftest_tiering_mode_finds_a_primary_tier_that_records_its_reads(
    oracle: Any,
    vllm_mod: Any,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    difftest = _driver._load_tool("difftest")
    argv = ["--tiering", "--policies", "lru", "--setups", "request-level", "--chunks", "16"]
    argv += ["--sequences", "4", "--steps", "60"]
    assert difftest.main(argv) == 0
    assert "lru@request-level chunks=16: 4 runs, 240 steps, 0 mismatches" in (
        capsys.readouterr().out
    )
    # A read made as a load records the keys for the request: a request-level tier's cascade
    # of keys the request did not store then re-ranks them, which vLLM's primary tier does not.
    primary = vllm_mod.KVOffloadCPUPrimaryTier

    def recording_read(self: Any, keys: Any, req_context: Any = None) -> Any:
        return self.prepare_load(keys, req_context)

    monkeypatch.setattr(primary, "prepare_read", recording_read, raising=False)
    assert difftest.main(argv) == 1
    out = capsys.readouterr().out
    assert "primary tier state differs (vllm vs kvoffload): ['policy_state']" in out


def test_the_tiering_benchmark_times_both_primary_tiers_and_their_share(
    oracle: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    benches = str(Path(__file__).resolve().parent.parent / "benches")
    if benches not in sys.path:
        sys.path.insert(0, benches)
    import vllm_tiering

    out = tmp_path / "tiering.json"
    argv = ["--policies", "lru", "--setups", "all", "--steps", "12", "--chunks", "64"]
    assert vllm_tiering.main([*argv, "--repeat", "2", "--share", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())
    assert [r["setup"] for r in rows] == sorted(set(_tiering.SETUPS) - {"fs"})
    for r in rows:
        assert r["policy"] == "lru"
        assert r["steps"] == 12
        assert r["speedup"] == pytest.approx(
            r["vllm_us_per_step_mean"] / r["kvoffload_us_per_step_mean"]
        )
        for name in ("vllm", "kvoffload"):
            assert 0 < r[f"{name}_us_per_step_p50"] <= r[f"{name}_us_per_step_p99"]
            assert 0 < r[f"{name}_primary_share"] < 1
    assert "| lru | serving | 12 |" in capsys.readouterr().out
    with pytest.raises(SystemExit):
        vllm_tiering.main(["--steps", "0"])
