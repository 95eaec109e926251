"""kvoffload's spec and manager inside vLLM 0.33.0's own code (``kvoffload.integrations.vllm``).

Against vLLM's real ``kv_offload`` modules from its PyPI wheel, imported without torch or a GPU
(``tools/vllm_oracle.py``; ``tools/fetch_vllm.py`` fetches them, and ``scripts/test`` runs it
first and then requires these tests to run):

- the spec loads through vLLM's ``OffloadingSpecFactory`` and every extra-config key keeps its
  meaning (the worker side: ``test_vllm_worker.py``);
- kvoffload's manager, built by the spec, runs seeded random call sequences side by side with the
  manager vLLM's own ``CPUOffloadingSpec`` builds, every result checked to be of vLLM's classes.

Without the vLLM sources these tests skip with the command that fetches them.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import threading
from typing import Any

import pytest

import _driver
from _vllm import (
    OURS,
    POLICIES,
    SPEC_MODULE_PATH,
    THRESHOLDS,
    Checked,
    key,
    make_spec,
    offloading_config,
    run_seeded,
    run_shared,
    via_spec,
    vllm_spec_impl,
)

# --- importing ---


@pytest.mark.skipif(
    importlib.util.find_spec("vllm") is not None, reason="a real vLLM is installed here"
)
def test_module_imports_without_vllm() -> None:
    code = (
        "import sys, kvoffload.integrations.vllm as v\n"
        "assert 'vllm' not in sys.modules\n"
        "try:\n"
        "    v.RustLRU\n"
        "except ImportError as e:\n"
        "    print(e)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True
    ).stdout
    assert "needs vLLM 0.33.0" in out


# --- the spec ---


def _managers_got_at_once(spec: Any, n: int) -> list[Any]:
    """What ``spec.get_manager()`` returns to ``n`` threads calling it first at once."""
    start = threading.Barrier(n)
    got: list[Any] = []

    def get() -> None:
        start.wait()
        got.append(spec.get_manager())

    threads = [threading.Thread(target=get) for _ in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return got


def test_first_get_manager_from_several_threads_builds_one(oracle: Any) -> None:
    for _ in range(10):
        got = _managers_got_at_once(make_spec(oracle, 12, OURS), 6)
        assert len(got) == 6
        assert all(m is got[0] for m in got)


def test_spec_loads_through_vllms_factory(oracle: Any, vllm_mod: Any) -> None:
    factory = oracle.factory.OffloadingSpecFactory
    cls = factory.get_spec_cls(OURS)
    assert cls is vllm_mod.KVOffloadCPUOffloadingSpec
    assert issubclass(cls, oracle.cpu_spec.CPUOffloadingSpec)
    assert cls.__module__ == SPEC_MODULE_PATH
    assert cls.__name__ == vllm_mod.SPEC_NAME

    ours, theirs = make_spec(oracle, 12, OURS), make_spec(oracle, 12, {})
    assert type(ours) is cls
    assert type(theirs) is oracle.cpu_spec.CPUOffloadingSpec
    assert ours.num_chunks == theirs.num_chunks == 12
    assert ours.kv_bytes_per_chunk == theirs.kv_bytes_per_chunk
    manager = ours.get_manager()
    assert manager is ours.get_manager()
    assert isinstance(manager, oracle.base.OffloadingManager)
    assert type(manager) is vllm_mod.KVOffloadCPUOffloadingManager
    assert manager.num_chunks == 12
    assert manager.config_info() == theirs.get_manager().config_info()
    for extra in ({}, {"store_threshold": 2}):
        assert cls.build_metric_definitions(extra).keys() == (
            oracle.cpu_spec.CPUOffloadingSpec.build_metric_definitions(extra).keys()
        )


def test_spec_needs_cpu_bytes_to_use_like_vllms(oracle: Any) -> None:
    config = offloading_config(oracle, 4, OURS)
    extra = dict(config.extra_config)
    del extra["cpu_bytes_to_use"]
    bare = type(config)(**{**config.__dict__, "extra_config": extra})
    with pytest.raises(Exception, match="cpu_bytes_to_use must be specified"):
        oracle.factory.OffloadingSpecFactory.create_spec(bare)


def _kind(manager: Any) -> tuple[str, str | None, bool]:
    """(which manager, its policy, whether it counts offers), read from either manager."""
    if hasattr(manager, "policy_state"):
        return ("kvoffload", manager.policy_state()["policy"], manager.tracker_state() is not None)
    policy = type(manager._policy).__name__
    return ("vllm", policy, manager.counts is not None)


@pytest.mark.parametrize(
    ("extra", "expected"),
    [
        ({}, ("kvoffload", "lru", False)),
        ({"eviction_policy": "arc"}, ("kvoffload", "arc", False)),
        ({"store_threshold": 2}, ("kvoffload", "lru", True)),
        ({"store_threshold": 1}, ("kvoffload", "lru", False)),
        # A registered name wins over a module path, as in vLLM's CachePolicyFactory.
        ({"eviction_policy": "lru", "cache_policy_module_path": "no.such.module"},
         ("kvoffload", "lru", False)),
        # An out-of-tree policy runs in vLLM's own manager, as CPUOffloadingSpec would run it.
        ({"eviction_policy": "RustLRU", "cache_policy_module_path": SPEC_MODULE_PATH},
         ("vllm", "RustLRU", False)),
        ({"eviction_policy": "RustARC", "cache_policy_module_path": SPEC_MODULE_PATH,
          "store_threshold": 3}, ("vllm", "RustARC", True)),
    ],
)  # fmt: skip
def test_extra_config_keys_keep_their_meaning(
    oracle: Any, extra: dict[str, Any], expected: tuple[str, str, bool]
) -> None:
    assert _kind(make_spec(oracle, 8, {**OURS, **extra}).get_manager()) == expected
    # vLLM's own spec reads the same keys the same way.
    vllm_names = {"lru": "LRUCachePolicy", "arc": "ARCCachePolicy"}
    _, policy, counts = expected
    assert _kind(make_spec(oracle, 8, extra).get_manager()) == (
        "vllm",
        vllm_names.get(policy, policy),
        counts,
    )


def test_max_tracker_size_and_store_threshold_behave_as_in_vllm(oracle: Any) -> None:
    extra = {"store_threshold": 3, "max_tracker_size": 2}
    ours = make_spec(oracle, 8, {**OURS, **extra}).get_manager()
    theirs = make_spec(oracle, 8, extra).get_manager()
    for mgr in (ours, theirs):
        ctx = oracle.ReqContext("r")
        mgr.on_new_request(ctx)
        stored = []
        for k in (1, 2, 1, 3, 1, 2, 1):  # key 3 pushes key 2 out of a tracker of 2
            out = mgr.prepare_store([key(k)], ctx)
            stored.append(list(out.keys_to_store))
        assert stored == [[], [], [], [], [key(1)], [], []]
    assert ours.tracker_state() == list(theirs.counts.items())


def test_events_follow_enable_kv_cache_events(oracle: Any) -> None:
    for events in (True, False):
        mgr = make_spec(oracle, 4, OURS, events=events).get_manager()
        ctx = oracle.ReqContext("r")
        mgr.on_new_request(ctx)
        mgr.complete_store(mgr.prepare_store([key(1)], ctx).keys_to_store, ctx)
        assert len(list(mgr.take_events())) == (1 if events else 0)


# --- kvoffload's manager speaks vLLM's types ---


def _ours_impl(oracle: Any) -> _driver.ImplSpec:
    """kvoffload's manager as vLLM's connector builds it (through the spec, vLLM's types)."""
    mm = oracle.manager_module
    ours = via_spec(
        oracle,
        lambda policy: {**OURS, "eviction_policy": policy},
        lambda m: Checked(m, mm, lambda m: m.check_invariants()),
    )
    return _driver.ImplSpec("kvoffload", ours, oracle.ReqContext, None)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_kvoffload_manager_through_vllm_types_matches_vllm(
    oracle: Any, policy: str, threshold: int
) -> None:
    run_seeded([vllm_spec_impl(oracle), _ours_impl(oracle)], policy, threshold, count=15)


def test_kvoffload_managers_sharing_contexts_through_vllm_types_match_vllm(oracle: Any) -> None:
    # Two tiers of kvoffload's manager on one set of vLLM's request contexts, against two of
    # vLLM's: each replaces the other's request state; an LRU request rank outlives that.
    run_shared([vllm_spec_impl(oracle), _ours_impl(oracle)], count=15)


def test_a_scenario_in_vllms_types(oracle: Any, vllm_mod: Any) -> None:
    mm = oracle.manager_module
    mgr = make_spec(oracle, 3, OURS).get_manager()
    ctx = oracle.ReqContext("r1")
    keys = [key(i) for i in range(5)]
    for i, k in enumerate(keys):
        ctx.set_offload_key_position(k, 16 * (i + 1))
    assert mgr.on_new_request(ctx) == mm.RequestOffloadingContext()
    out = mgr.prepare_store(keys[:3], ctx)
    assert out == mm.PrepareStoreOutput(keys[:3], out.store_spec, [])
    assert out.store_spec.block_ids.tolist() == [0, 1, 2]
    assert mgr.lookup(keys[0], ctx) is mm.LookupResult.HIT_PENDING
    mgr.complete_store(keys[:3], ctx)
    assert mgr.lookup(keys[0], ctx) is mm.LookupResult.HIT
    assert mgr.lookup(keys[4], ctx) is mm.LookupResult.MISS
    spec = mgr.prepare_load(keys[:1], ctx)
    assert isinstance(spec, oracle.base.BlockIDsLoadStoreSpec)
    assert spec.chunk_ids.tolist() == [0]
    out = mgr.prepare_store(keys[3:5], ctx)  # key 0 is pinned: keys 2 and 1 go (tail first)
    assert out.evicted_keys == [keys[2], keys[1]]
    events = list(mgr.take_events())
    assert [(e.removed, e.keys) for e in events] == [
        (False, keys[:3]),
        (True, [keys[2], keys[1]]),
    ]
    assert events == [
        mm.OffloadingEvent(keys=keys[:3], medium=mm.Medium.CPU, removed=False),
        mm.OffloadingEvent(keys=[keys[2], keys[1]], medium=mm.Medium.CPU, removed=True),
    ]
    assert [list(vars(e)) for e in events] == [list(vars(events[0]))] * 2
    assert list(vars(events[0])) == list(vars(mm.OffloadingEvent([], mm.Medium.CPU, False)))
    stats = mgr.get_stats()
    assert isinstance(stats, mm.OffloadingConnectorStats)
    usage = stats.data["data"][mm.CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC][()]
    assert usage == 1.0  # one pinned chunk and two pending of three
    assert mgr.get_load_source(keys[0], ctx) is mm.CacheHitSource.HOST


def test_stats_go_through_vllms_metrics_code(oracle: Any, vllm_mod: Any) -> None:
    # What vLLM's scheduler does with a manager's stats: aggregate them into the connector's own
    # payload (which asserts the class), add the config info once, reduce for the log line.
    stats_cls = oracle.manager_module.OffloadingConnectorStats
    payloads = []
    for extra in (OURS, {}):
        mgr = make_spec(oracle, 3, {**extra, "store_threshold": 2}).get_manager()
        ctx = oracle.ReqContext("r")
        mgr.on_new_request(ctx)
        for batch in ([key(1), key(2)], [key(1), key(2), key(3)], [key(3), key(4), key(5)]):
            out = mgr.prepare_store(batch, ctx)
            if out is not None:
                mgr.complete_store(out.keys_to_store, ctx)
        connector = stats_cls()
        connector.increase_counter("vllm:kv_offload_transfer_ops", 2)
        manager_stats = mgr.get_stats()
        assert type(manager_stats) is stats_cls
        merged = connector.aggregate(manager_stats)
        merged.set_info(mgr.config_info())
        payloads.append((merged.data, merged.reduce(), merged.is_empty()))
    assert payloads[0] == payloads[1]
    assert payloads[0][1]["vllm:kv_offload_stores_skipped"] == 5  # 1, 2; 3; 4, 5


def test_write_expiry_keeps_vllms_stats_payload(oracle: Any, vllm_mod: Any) -> None:
    # With vLLM's classes the liveness gauges stay out of get_stats (vLLM's Prometheus code
    # knows only the metric names its spec declares); the expiry itself still works.
    now = [0.0]
    ours = vllm_mod.KVOffloadCPUOffloadingManager(
        4, enable_events=True, pending_write_timeout=1.0, clock=lambda: now[0]
    )
    theirs = oracle.manager_module.CPUOffloadingManager(4, enable_events=True)
    for mgr in (ours, theirs):
        ctx = oracle.ReqContext("r")
        mgr.on_new_request(ctx)
        mgr.prepare_store([key(1), key(2)], ctx)
    now[0] = 2.0
    assert ours.expire_pending_writes() == [key(1), key(2)]
    for mgr in (ours, theirs):
        mgr.complete_store([key(1), key(2)], oracle.ReqContext("r"), success=False)
    assert [(e.keys, e.metadata_only) for e in ours.take_events()] == [
        (e.keys, e.metadata_only) for e in theirs.take_events()
    ]
    assert ours.get_stats().data == theirs.get_stats().data


def test_pending_write_timeout_from_extra_config(oracle: Any, vllm_mod: Any) -> None:
    spec = make_spec(oracle, 8, {**OURS, "pending_write_timeout": 0.0})
    mgr = spec.get_manager()
    ctx = oracle.ReqContext("r")
    mgr.on_new_request(ctx)
    mgr.prepare_store([key(1)], ctx)
    assert mgr.num_pending_writes() == 1
    assert mgr.expire_pending_writes() == [key(1)]
    assert make_spec(oracle, 8, OURS).get_manager()._pending_write_timeout is None


def test_context_class_registration(oracle: Any, vllm_mod: Any) -> None:
    from kvoffload import InvalidArgumentError, _native

    vllm_mod.vllm_types()  # registers vLLM's ReqContext
    _native.register_context_type(oracle.ReqContext)  # again: a no-op
    with pytest.raises(InvalidArgumentError, match="already registered"):
        _native.register_context_type(dict)


def test_another_vllm_version_is_warned_about(monkeypatch: pytest.MonkeyPatch) -> None:
    import types

    import kvoffload.integrations.vllm as integration

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.34.0"))
    monkeypatch.setattr(integration, "_built", {})
    monkeypatch.setattr(integration, "_BUILDERS", {"RustLRU": lambda: int})
    with pytest.warns(RuntimeWarning, match="tested against vLLM 0.33.0; this is vLLM 0.34.0"):
        assert integration.RustLRU is int


def test_the_admission_settings_read_as_vllms_attributes(oracle: Any, vllm_mod: Any) -> None:
    kwargs = {"store_threshold": 2, "max_tracker_size": 10}
    ours = vllm_mod.KVOffloadCPUOffloadingManager(4, **kwargs)
    theirs = oracle.manager_module.CPUOffloadingManager(4, **kwargs)
    for name in kwargs:
        assert getattr(ours, name) == getattr(theirs, name) == kwargs[name]
        with pytest.raises(AttributeError):
            setattr(ours, name, 3)  # read-only: the core keeps the setting


def test_admission_defaults_are_vllms_spec_defaults(oracle: Any) -> None:
    ours = make_spec(oracle, 8, OURS).get_manager()
    theirs = make_spec(oracle, 8, {}).get_manager()
    for name, default in (("store_threshold", 0), ("max_tracker_size", 64_000)):
        assert getattr(ours, name) == getattr(theirs, name) == default
