"""Edges of the vLLM integration: bad extra-config values, Rust-policy construction and
subclassing, and malformed worker transfer specs (against vLLM's real ``kv_offload`` modules,
see ``test_vllm_spec.py``)."""

from __future__ import annotations

import re
import sys
import types
from typing import Any

import numpy as np
import pytest

from _vllm import OURS, SPEC_MODULE_PATH, key, make_spec
from kvoffload import BlockIndexError, InvalidArgumentError
from test_vllm_worker import cpu, device_caches, gpu, worker_spec

RUST_IN_VLLM = {"eviction_policy": "RustLRU", "cache_policy_module_path": SPEC_MODULE_PATH}


def test_pending_write_timeout_with_a_policy_run_by_vllms_manager_is_refused(
    oracle: Any, vllm_mod: Any
) -> None:
    # vLLM's manager has no write expiry: the key used to be dropped without a word.
    for timeout in (1.0, "x"):
        spec = make_spec(oracle, 8, {**OURS, **RUST_IN_VLLM, "pending_write_timeout": timeout})
        with pytest.raises(InvalidArgumentError, match="pending_write_timeout needs one of"):
            spec.get_manager()
        assert spec._manager is None  # nothing was built
    # Without the key (or with it unset) the policy runs in vLLM's manager as before.
    for extra in (RUST_IN_VLLM, {**RUST_IN_VLLM, "pending_write_timeout": None}):
        manager = make_spec(oracle, 8, {**OURS, **extra}).get_manager()
        assert type(manager) is oracle.manager_module.CPUOffloadingManager


@pytest.mark.parametrize("name", ["store_threshold", "max_tracker_size"])
@pytest.mark.parametrize("value", ["abc", None, [2]])
def test_admission_keys_int_cannot_read_are_refused_from_kvoffloads_tree(
    oracle: Any, vllm_mod: Any, name: str, value: Any
) -> None:
    for extra in (OURS, {**OURS, **RUST_IN_VLLM}):
        spec = make_spec(oracle, 8, {**extra, name: value})
        with pytest.raises(InvalidArgumentError, match=f"{name} must be an int"):
            spec.get_manager()
    # What int() reads, it reads as vLLM's spec does.
    spec = make_spec(oracle, 8, {**OURS, "store_threshold": "2", "max_tracker_size": 5.9})
    manager = spec.get_manager()
    assert (manager.store_threshold, manager.max_tracker_size) == (2, 5)


@pytest.mark.parametrize("name", ["RustLRU", "RustARC", "RustSIEVE"])
@pytest.mark.parametrize("capacity", [-1, 2**32, 2**63, 2**80, "4", 4.0, None, True])
def test_rust_policy_capacity_is_checked(vllm_mod: Any, name: str, capacity: Any) -> None:
    # These raised OverflowError and TypeError (not kvoffload's tree), and True was taken as 1.
    with pytest.raises(InvalidArgumentError, match="cache_capacity must be"):
        getattr(vllm_mod, name)(cache_capacity=capacity)


def test_rust_policy_capacity_bounds_are_accepted(vllm_mod: Any) -> None:
    for capacity in (0, 2**32 - 1):
        assert vllm_mod.RustLRU(cache_capacity=capacity).cache_capacity == capacity


def test_a_subclass_override_of_a_rust_policy_method_runs(oracle: Any, vllm_mod: Any) -> None:
    # The native methods bound on the instance shadowed a subclass's overrides: they never ran.
    status = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].ChunkStatus
    calls: list[tuple[str, Any]] = []

    class Logged(vllm_mod.RustLRU):  # type: ignore[misc]
        def touch(self, keys: Any, req_context: Any) -> None:
            calls.append(("touch", list(keys)))
            super().touch(keys, req_context)

        def evict(self, n: int, protected: Any) -> Any:
            calls.append(("evict", n))
            return super().evict(n, protected)

    policy = Logged(cache_capacity=4)
    ctx = oracle.ReqContext("r")
    for i in range(2):
        chunk = status(i)
        policy.insert(key(i), chunk, ctx)
        chunk.ref_cnt = 0
        policy.mark_evictable(key(i))
    policy.touch([key(0)], ctx)
    victims = policy.evict(1, set())
    assert [k for k, _ in victims] == [key(1)]  # key 0 was touched last
    assert calls == [("touch", [key(0)]), ("evict", 1)]
    # Methods not overridden still go straight to Rust.
    assert type(policy.get).__name__ == "builtin_function_or_method"
    assert type(vllm_mod.RustLRU(4).touch).__name__ == "builtin_function_or_method"


def _two_group_worker(oracle: Any, seed: int) -> Any:
    """A worker over two KV groups of 1,024-byte pages, 4 chunks of 2 blocks."""
    pages = (1024, 1024)
    caches, _ = device_caches(oracle.base, pages, [[0], [1]], 8, seed=seed)
    return worker_spec(oracle, 4, pages, bpc=2).get_worker(caches)


def test_worker_refuses_malformed_group_sizes_and_block_indices(oracle: Any) -> None:
    base = oracle.base
    worker = _two_group_worker(oracle, seed=1)
    try:
        bad = [
            (["a", 0], [0, 0], "group_sizes must be a sequence of ints"),
            ([1.0, 0], [0, 0], "group_sizes must be a sequence of ints"),
            ([1, 0], None, "block_indices must be a sequence of ints"),
            ([1, 0], [0.5, 0], "block_indices must be a sequence of ints"),
        ]
        for job_id, (sizes, starts, match) in enumerate(bad):
            dev = types.SimpleNamespace(block_ids=[0], group_sizes=sizes, block_indices=starts)
            with pytest.raises(InvalidArgumentError, match=match):
                worker.submit_store(job_id, dev, cpu(oracle, [0]))
        # A uint64 id past int64 was wrapped and reported as id -1.
        huge = np.array([2**64 - 1], dtype=np.uint64)
        dev = types.SimpleNamespace(block_ids=huge, group_sizes=[1, 0], block_indices=[0, 0])
        with pytest.raises(BlockIndexError, match="18446744073709551615"):
            worker.submit_store(9, dev, cpu(oracle, [0]))
        assert worker.get_finished() == []  # nothing was queued
        # numpy ints are ints.
        good = gpu(base, [[0, 1], [2]], [0, 0])
        good.group_sizes, good.block_indices = np.array([2, 1]), np.array([0, 0])
        assert worker.submit_store(10, good, cpu(oracle, [0, 1]))
        worker.wait({10})
        assert [r.success for r in worker.get_finished()] == [True]
    finally:
        worker.shutdown()


def test_engines_whose_ids_differ_only_in_unnamable_characters_share_no_pool() -> None:
    from kvoffload.integrations.vllm_worker import _shared_name

    names = {_shared_name(engine_id) for engine_id in ("a:b", "a_b", "a/b", "a b", "a\udcffb")}
    assert len(names) == 5
    assert _shared_name("engine-0.1_x") == "vllm-engine-0.1_x"  # a plain id reads as it is
    long = _shared_name("e" * 300)
    assert len(long) < 200
    assert long != _shared_name("e" * 299)
    for name in (*names, long):
        assert re.fullmatch(r"[A-Za-z0-9_.-]+", name)


def test_worker_reports_an_empty_job_and_refuses_negative_group_sizes(oracle: Any) -> None:
    base = oracle.base
    worker = _two_group_worker(oracle, seed=3)
    try:
        # A job with no block: nothing to copy, reported at once as a success of 0 bytes.
        assert worker.submit_store(1, gpu(base, [[], []], [0, 0]), cpu(oracle, []))
        worker.wait({1})
        assert [(r.job_id, r.success, r.transfer_size) for r in worker.get_finished()] == [
            (1, True, 0)
        ]
        # Sizes that add up to the block count only thanks to a negative one.
        dev = types.SimpleNamespace(block_ids=[0], group_sizes=[2, -1], block_indices=[0, 0])
        with pytest.raises(InvalidArgumentError, match=r"group sizes \[2, -1\] do not add up"):
            worker.submit_store(2, dev, cpu(oracle, [0]))
        assert worker.get_finished() == []
    finally:
        worker.shutdown()
