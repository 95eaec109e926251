"""kvoffload inside vLLM 0.33.0's own code (``kvoffload.integrations.vllm``).

Against vLLM's real ``kv_offload`` modules from its PyPI wheel, imported without torch or a GPU
(``tools/vllm_oracle.py``; ``tools/fetch_vllm.py`` fetches them, and ``scripts/test`` runs it
first and then requires these tests to run):

- the spec loads through vLLM's ``OffloadingSpecFactory`` and every extra-config key keeps its
  meaning;
- kvoffload's manager, built by the spec, runs seeded random call sequences side by side with the
  manager vLLM's own ``CPUOffloadingSpec`` builds, every result checked to be of vLLM's classes;
- vLLM's manager running ``RustLRU``/``RustARC`` gives the same results as with its own LRU/ARC
  (seeded random sequences at the manager level, and random ``CachePolicy`` call sequences).

Without the vLLM sources these tests skip with the command that fetches them.
"""

from __future__ import annotations

import ctypes
import importlib.util
import random
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import _driver

SPEC_MODULE_PATH = "kvoffload.integrations.vllm"
POLICIES = ("lru", "arc")
THRESHOLDS = (1, 2, 3)
RUST_POLICY = {"lru": "RustLRU", "arc": "RustARC"}


@pytest.fixture(scope="module")
def oracle() -> Any:
    _driver.require_vllm()
    return _driver._load_tool("vllm_oracle").load()


@pytest.fixture(scope="module")
def vllm_mod(oracle: Any) -> Any:
    import kvoffload.integrations.vllm as integration

    return integration


def _config(oracle: Any, num_chunks: int, extra: dict[str, Any], events: bool = True) -> Any:
    return _driver._load_tool("vllm_oracle").offloading_config(oracle, num_chunks, extra, events)


def _spec(oracle: Any, num_chunks: int, extra: dict[str, Any], events: bool = True) -> Any:
    return oracle.factory.OffloadingSpecFactory.create_spec(
        _config(oracle, num_chunks, extra, events)
    )


OURS = {"spec_name": "KVOffloadCPUOffloadingSpec", "spec_module_path": SPEC_MODULE_PATH}


def _key(i: int, group: int = 0) -> bytes:
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


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


def test_spec_loads_through_vllms_factory(oracle: Any, vllm_mod: Any) -> None:
    factory = oracle.factory.OffloadingSpecFactory
    cls = factory.get_spec_cls(OURS)
    assert cls is vllm_mod.KVOffloadCPUOffloadingSpec
    assert issubclass(cls, oracle.cpu_spec.CPUOffloadingSpec)
    assert cls.__module__ == SPEC_MODULE_PATH
    assert cls.__name__ == vllm_mod.SPEC_NAME

    ours, theirs = _spec(oracle, 12, OURS), _spec(oracle, 12, {})
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


def test_worker_side_is_vllms(oracle: Any, vllm_mod: Any) -> None:
    spec = _spec(oracle, 4, OURS)
    assert type(spec).get_worker is oracle.cpu_spec.CPUOffloadingSpec.get_worker
    # Without a GPU (the stand-in platform reports none), vLLM's own worker refuses to start.
    with pytest.raises(Exception, match="only supported on CUDA-alike"):
        spec.get_worker(None)


def test_spec_needs_cpu_bytes_to_use_like_vllms(oracle: Any) -> None:
    config = _config(oracle, 4, OURS)
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
    assert _kind(_spec(oracle, 8, {**OURS, **extra}).get_manager()) == expected
    # vLLM's own spec reads the same keys the same way.
    vllm_names = {"lru": "LRUCachePolicy", "arc": "ARCCachePolicy"}
    _, policy, counts = expected
    assert _kind(_spec(oracle, 8, extra).get_manager()) == (
        "vllm",
        vllm_names.get(policy, policy),
        counts,
    )


def test_max_tracker_size_and_store_threshold_behave_as_in_vllm(oracle: Any) -> None:
    extra = {"store_threshold": 3, "max_tracker_size": 2}
    ours = _spec(oracle, 8, {**OURS, **extra}).get_manager()
    theirs = _spec(oracle, 8, extra).get_manager()
    for mgr in (ours, theirs):
        ctx = oracle.ReqContext("r")
        mgr.on_new_request(ctx)
        stored = []
        for k in (1, 2, 1, 3, 1, 2, 1):  # key 3 pushes key 2 out of a tracker of 2
            out = mgr.prepare_store([_key(k)], ctx)
            stored.append(list(out.keys_to_store))
        assert stored == [[], [], [], [], [_key(1)], [], []]
    assert ours.tracker_state() == list(theirs.counts.items())


def test_events_follow_enable_kv_cache_events(oracle: Any) -> None:
    for events in (True, False):
        mgr = _spec(oracle, 4, OURS, events=events).get_manager()
        ctx = oracle.ReqContext("r")
        mgr.on_new_request(ctx)
        mgr.complete_store(mgr.prepare_store([_key(1)], ctx).keys_to_store, ctx)
        assert len(list(mgr.take_events())) == (1 if events else 0)


# --- kvoffload's manager speaks vLLM's types ---


def _check_vllm_types(mm: Any, name: str, result: Any) -> None:
    """Assert that ``result`` of manager method ``name`` is an instance of vLLM's own class."""
    if name == "lookup":
        assert type(result) is mm.LookupResult, type(result)
    elif name == "prepare_store" and result is not None:
        assert type(result) is mm.PrepareStoreOutput, type(result)
        assert type(result.store_spec) is mm.CPULoadStoreSpec, type(result.store_spec)
        assert result.store_spec.block_ids.dtype == np.int32
        assert type(result.keys_to_store) is list
        assert type(result.evicted_keys) is list
    elif name == "prepare_load":
        assert type(result) is mm.CPULoadStoreSpec, type(result)
        assert result.block_ids.dtype == np.int32
    elif name == "get_stats":
        assert type(result) is mm.OffloadingConnectorStats, type(result)
    elif name == "on_new_request":
        assert type(result) is mm.RequestOffloadingContext, type(result)
        assert result.policy is mm.RequestOffloadingContext().policy
    elif name == "get_load_source":
        assert result is mm.CacheHitSource.HOST


class Checked:
    """A manager whose results are checked to be vLLM's classes; ``after`` runs after each call."""

    def __init__(self, mgr: Any, mm: Any, after: Callable[[Any], None] | None = None) -> None:
        self._mgr, self._mm, self._after = mgr, mm, after

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._mgr, name)
        if not callable(attr):
            return attr

        def call(*args: Any, **kwargs: Any) -> Any:
            result = attr(*args, **kwargs)
            if name == "take_events":
                return self._events(result)
            _check_vllm_types(self._mm, name, result)
            if self._after is not None:
                self._after(self._mgr)
            return result

        return call

    def _events(self, events: Any) -> Iterator[Any]:
        for event in events:
            assert type(event) is self._mm.OffloadingEvent, type(event)
            assert event.medium is self._mm.Medium.CPU
            yield event


def _via_spec(
    oracle: Any, extra_of: Callable[[str], dict[str, Any]], wrap: Callable[[Any], Any]
) -> Callable[..., Any]:
    """A manager factory taking the driver's constructor arguments, building through a spec."""

    def make(
        num_chunks: int,
        cache_policy: str,
        enable_events: bool,
        store_threshold: int,
        max_tracker_size: int,
    ) -> Any:
        extra = {
            **extra_of(cache_policy),
            "store_threshold": store_threshold,
            "max_tracker_size": max_tracker_size,
        }
        spec = _spec(oracle, num_chunks, extra, enable_events)
        assert spec.num_chunks == num_chunks
        return wrap(spec.get_manager())

    return make


def _vllm_spec_impl(oracle: Any) -> _driver.ImplSpec:
    """vLLM's manager as vLLM's own ``CPUOffloadingSpec`` builds it."""
    make = _via_spec(oracle, lambda policy: {"eviction_policy": policy}, lambda m: m)
    return _driver.ImplSpec("vllm", make, oracle.ReqContext, None)  # type: ignore[arg-type]


def _run_seeded(specs: list[_driver.ImplSpec], policy: str, threshold: int, count: int) -> None:
    for seed in range(count):
        result = _driver.run_sequence(specs, policy, threshold, seed, calls=300)
        if result.mismatch is not None:
            small = (
                _driver.shrink(result.config, result.ops, specs, budget_s=30.0) or result.mismatch
            )
            pytest.fail(
                f"{result.mismatch.report(20)}\n\nshrunk:\n{small.report(None)}",
                pytrace=False,
            )


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_kvoffload_manager_through_vllm_types_matches_vllm(
    oracle: Any, policy: str, threshold: int
) -> None:
    mm = oracle.manager_module
    ours = _via_spec(
        oracle,
        lambda policy: {**OURS, "eviction_policy": policy},
        lambda m: Checked(m, mm, lambda m: m.check_invariants()),
    )
    specs = [_vllm_spec_impl(oracle), _driver.ImplSpec("kvoffload", ours, oracle.ReqContext, None)]  # type: ignore[arg-type]
    _run_seeded(specs, policy, threshold, count=15)


def test_a_scenario_in_vllms_types(oracle: Any, vllm_mod: Any) -> None:
    mm = oracle.manager_module
    mgr = _spec(oracle, 3, OURS).get_manager()
    ctx = oracle.ReqContext("r1")
    keys = [_key(i) for i in range(5)]
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
    stats = mgr.get_stats()
    assert isinstance(stats, mm.OffloadingConnectorStats)
    usage = stats.data["data"][mm.CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC][()]
    assert usage == 1.0  # one pinned chunk and two pending of three
    assert mgr.get_load_source(keys[0], ctx) is mm.CacheHitSource.HOST


# --- the Rust policies inside vLLM's manager ---


def _rust_policy_impl(oracle: Any) -> _driver.ImplSpec:
    def extra(policy: str) -> dict[str, Any]:
        return {
            "eviction_policy": RUST_POLICY[policy],
            "cache_policy_module_path": SPEC_MODULE_PATH,
        }

    def check(m: Any) -> None:
        m._policy.check_invariants()

    make = _via_spec(oracle, extra, lambda m: Checked(m, oracle.manager_module, check))
    return _driver.ImplSpec("vllm+rust-policy", make, oracle.ReqContext, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_rust_policy_in_vllms_manager_matches_vllms_policy(
    oracle: Any, policy: str, threshold: int
) -> None:
    _run_seeded([_vllm_spec_impl(oracle), _rust_policy_impl(oracle)], policy, threshold, count=15)


def test_rust_policies_load_through_cache_policy_module_path(oracle: Any, vllm_mod: Any) -> None:
    factory = oracle.manager_module.CachePolicyFactory
    base = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].CachePolicy
    for name in ("RustLRU", "RustARC"):
        cls = factory.get_cache_policy_cls(name, SPEC_MODULE_PATH)
        assert cls is getattr(vllm_mod, name)
        assert issubclass(cls, base)
        policy = cls(cache_capacity=4)
        # vLLM's manager calls reach Rust directly: bound native methods, no Python frame.
        assert type(policy.get).__name__ == "builtin_function_or_method"


class PolicyDriver:
    """Random ``CachePolicy`` calls, legal as vLLM's manager would make them, on two policies."""

    def __init__(self, oracle: Any, policies: list[Any], rng: random.Random, capacity: int) -> None:
        self.status = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].ChunkStatus
        self.oracle, self.policies, self.rng, self.capacity = oracle, policies, rng, capacity
        self.chunks: list[dict[bytes, Any]] = [{} for _ in policies]  # key -> ChunkStatus
        self.ctxs: list[list[Any]] = [[] for _ in policies]
        self.next_id = 0

    def new_request(self) -> None:
        positions = {
            _key(self.rng.randrange(40), self.rng.choice((0, 1))): 16 * self.rng.randrange(1, 9)
            for _ in range(self.rng.randrange(0, 12))
        }
        for ctxs in self.ctxs:
            ctx = self.oracle.ReqContext(f"r{len(ctxs)}")
            for k, p in positions.items():
                ctx.set_offload_key_position(k, p)
            ctxs.append(ctx)

    def step(self) -> tuple[str, list[Any], list[Any]] | None:
        """One random call on every policy: ``(kind, results, get() of some keys)``."""
        rng = self.rng
        resident = sorted(self.chunks[0])
        some = [_key(rng.randrange(40), rng.choice((0, 1))) for _ in range(rng.randrange(1, 6))]
        kind = rng.choice(
            ["insert"] * 5 + ["ready", "pin", "unpin", "touch", "access", "miss", "finish"] * 2
            + ["evict"] * 3 + ["remove", "new", "clear"]
        )  # fmt: skip
        new = [k for k in dict.fromkeys(some) if k not in self.chunks[0]]
        if kind == "insert" and len(resident) + len(new) > self.capacity:
            return None
        if kind == "new":
            self.new_request()
            return None
        inserted = {k for k in some if rng.random() < 0.5}
        n = rng.randrange(0, 4)
        results = [self._call(i, kind, some, new, resident, inserted, n) for i in range(2)]
        if kind == "insert":
            self.next_id += len(new)
        gets = [
            [(k, None if (c := p.get(k)) is None else (c.chunk_id, c.ref_cnt)) for k in some]
            for p in self.policies
        ]
        return kind, results, gets

    def _call(
        self,
        i: int,
        kind: str,
        some: list[bytes],
        new: list[bytes],
        resident: list[bytes],
        inserted: set[bytes],
        n: int,
    ) -> Any:
        policy, chunks, ctx = self.policies[i], self.chunks[i], self.ctxs[i][-1]
        if kind == "insert":
            for j, k in enumerate(new):
                chunks[k] = self.status(self.next_id + j)
                policy.insert(k, chunks[k], ctx)
            return new
        if kind == "ready":
            pending = [k for k in resident if chunks[k].ref_cnt == -1][:3]
            for k in pending:
                chunks[k].ref_cnt = 0
                policy.mark_evictable(k)
            return pending
        if kind == "pin":
            ready = [k for k in resident if chunks[k].ref_cnt >= 0][:2]
            for k in ready:
                if chunks[k].ref_cnt == 0:
                    policy.mark_non_evictable(k)
                chunks[k].ref_cnt += 1
            return ready
        if kind == "unpin":
            pinned = [k for k in resident if chunks[k].ref_cnt > 0][:2]
            for k in pinned:
                chunks[k].ref_cnt -= 1
                if chunks[k].ref_cnt == 0:
                    policy.mark_evictable(k)
            return pinned
        if kind == "touch":
            return policy.touch(some, ctx)
        if kind == "access":
            return policy.on_request_access(some, ctx)
        if kind == "miss":
            return policy.on_store_miss(some, ctx)
        if kind == "finish":
            groups = (tuple(k for k in some if k[-1] == 0), tuple(k for k in some if k[-1]))
            return policy.on_request_finished(groups, inserted, set(some) - inserted, ctx)
        if kind == "evict":
            out = policy.evict(n, set(some))
            if out is None:
                return None
            for k, chunk in out:
                assert chunk is chunks.pop(k)  # the very object that was inserted
            return [(k, c.chunk_id) for k, c in out]
        if kind == "remove":
            pending = [k for k in resident if chunks[k].ref_cnt == -1][:1]
            for k in pending:
                policy.remove(k)
                del chunks[k]
            return pending
        assert kind == "clear"
        policy.clear()
        chunks.clear()
        return None


def _order_of(policy: Any) -> dict[str, Any]:
    """A policy's eviction order: LRU ranks (issued from 0), or ARC's lists and target."""
    if hasattr(policy, "_core"):
        state: dict[str, Any] = policy._core.policy_state()
        if state["policy"] == "lru":
            return {"ranks": state["ranks"]}
        return {k: state[k] for k in ("t1", "t2", "b1", "b2", "target_t1_size")}
    if hasattr(policy, "_ranks"):  # vLLM's first rank is 1
        return {"ranks": {k: (major - 1, minor) for k, (major, minor) in policy._ranks.items()}}
    return {
        "t1": list(policy.t1),
        "t2": list(policy.t2),
        "b1": list(policy.b1),
        "b2": list(policy.b2),
        "target_t1_size": float(policy.target_t1_size),
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_rust_policy_calls_match_vllms_policy(oracle: Any, vllm_mod: Any, policy: str) -> None:
    factory = oracle.manager_module.CachePolicyFactory
    for seed in range(40):
        rng = random.Random(f"{policy}/{seed}")
        capacity = rng.randrange(1, 24)
        policies = [
            factory.get_cache_policy_cls(policy)(cache_capacity=capacity),
            getattr(vllm_mod, RUST_POLICY[policy])(cache_capacity=capacity),
        ]
        driver = PolicyDriver(oracle, policies, rng, capacity)
        driver.new_request()
        for step in range(300):
            got = driver.step()
            if got is None:
                continue
            kind, results, gets = got
            assert results[0] == results[1], (seed, step, kind, results)
            assert gets[0] == gets[1], (seed, step, kind, gets)
            policies[1].check_invariants()
            assert _order_of(policies[0]) == _order_of(policies[1]), (seed, step, kind)


def test_rust_policy_evict_is_all_or_nothing(oracle: Any, vllm_mod: Any) -> None:
    status = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].ChunkStatus
    policy = vllm_mod.RustLRU(cache_capacity=4)
    ctx = oracle.ReqContext("r")
    chunks = {_key(i): status(i) for i in range(3)}
    for k, c in chunks.items():
        policy.insert(k, c, ctx)
        c.ref_cnt = 0
        policy.mark_evictable(k)
    assert policy.evict(3, {_key(0)}) is None  # only two unprotected
    assert len(policy) == 3
    evicted = policy.evict(2, {_key(0)})
    assert [(k, c) for k, c in evicted] == [(_key(1), chunks[_key(1)]), (_key(2), chunks[_key(2)])]
    assert policy.get(_key(0)) is chunks[_key(0)]
    assert isinstance(chunks[_key(0)], ctypes.Structure)


# --- the native policy core's own contract (no vLLM needed) ---


class _Chunk:
    def __init__(self, chunk_id: int, ref_cnt: int = -1) -> None:
        self.chunk_id, self.ref_cnt = chunk_id, ref_cnt


def test_policy_core_rejects_calls_vllms_manager_never_makes() -> None:
    from kvoffload import (
        InvalidKeyError,
        KeyStateError,
        ReqContext,
        UnsupportedPolicyError,
        _native,
    )

    with pytest.raises(UnsupportedPolicyError):
        _native.PolicyCore("fifo", 4)
    core = _native.PolicyCore("lru", 4)
    ctx = ReqContext("r")
    core.insert(_key(1), _Chunk(0), ctx)
    with pytest.raises(KeyStateError, match="already resident"):
        core.insert(_key(1), _Chunk(1), ctx)
    with pytest.raises(KeyStateError):
        core.mark_non_evictable(_key(1))  # pending, not evictable
    core.mark_evictable(_key(1))
    with pytest.raises(KeyStateError, match="already evictable"):
        core.mark_evictable(_key(1))
    with pytest.raises(KeyStateError, match="only a pending chunk"):
        core.remove(_key(1))
    with pytest.raises(KeyStateError, match="absent"):
        core.mark_evictable(_key(2))
    with pytest.raises(InvalidKeyError):
        core.get("not bytes")  # type: ignore[arg-type]
    core.remove(_key(2))  # absent: ignored, as vLLM's ARC does
    core.check_invariants()
    assert len(core) == 1


def test_context_class_registration(oracle: Any, vllm_mod: Any) -> None:
    from kvoffload import InvalidArgumentError, _native

    vllm_mod.vllm_types()  # registers vLLM's ReqContext
    _native.register_context_type(oracle.ReqContext)  # again: a no-op
    with pytest.raises(InvalidArgumentError, match="already registered"):
        _native.register_context_type(dict)
