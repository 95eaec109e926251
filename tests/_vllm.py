"""Shared pieces of the vLLM integration tests: configs built as vLLM's connector builds them,
a manager wrapper that checks every result is of vLLM's own class, and the seeded runs."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import _driver

SPEC_MODULE_PATH = "kvoffload.integrations.vllm"
POLICIES = ("lru", "arc")
THRESHOLDS = (1, 2, 3)
RUST_POLICY = {"lru": "RustLRU", "arc": "RustARC"}
#: The extra-config keys that select kvoffload's spec.
OURS = {"spec_name": "KVOffloadCPUOffloadingSpec", "spec_module_path": SPEC_MODULE_PATH}


def offloading_config(
    oracle: Any, num_chunks: int, extra: dict[str, Any], events: bool = True
) -> Any:
    """vLLM's ``OffloadingConfig`` for a pool of ``num_chunks`` chunks (see vllm_oracle)."""
    return _driver._load_tool("vllm_oracle").offloading_config(oracle, num_chunks, extra, events)


def make_spec(oracle: Any, num_chunks: int, extra: dict[str, Any], events: bool = True) -> Any:
    """The spec vLLM's ``OffloadingSpecFactory`` builds for ``extra``."""
    return oracle.factory.OffloadingSpecFactory.create_spec(
        offloading_config(oracle, num_chunks, extra, events)
    )


def key(i: int, group: int = 0) -> bytes:
    """A 32-byte block hash of ``i`` plus the group index."""
    return i.to_bytes(32, "big") + group.to_bytes(4, "big")


def check_vllm_types(mm: Any, name: str, result: Any) -> None:
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
            check_vllm_types(self._mm, name, result)
            if self._after is not None:
                self._after(self._mgr)
            return result

        return call

    def _events(self, events: Any) -> Iterator[Any]:
        for event in events:
            assert type(event) is self._mm.OffloadingEvent, type(event)
            assert event.medium is self._mm.Medium.CPU
            yield event


def via_spec(
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
        spec = make_spec(oracle, num_chunks, extra, enable_events)
        assert spec.num_chunks == num_chunks
        return wrap(spec.get_manager())

    return make


def vllm_spec_impl(oracle: Any) -> _driver.ImplSpec:
    """vLLM's manager as vLLM's own ``CPUOffloadingSpec`` builds it."""
    make = via_spec(oracle, lambda policy: {"eviction_policy": policy}, lambda m: m)
    return _driver.ImplSpec("vllm", make, oracle.ReqContext, None)


def run_shared(specs: list[_driver.ImplSpec], count: int) -> None:
    """Seeded runs of two managers sharing their request contexts (``_driver.SharedSession``),
    for each ordered pair of vLLM's policies."""
    for policies in [(a, b) for a in POLICIES for b in POLICIES]:
        mismatch = _driver.first_shared_mismatch(specs, policies, count, calls=300)
        if mismatch is not None:
            pytest.fail(mismatch.report(40), pytrace=False)


def run_seeded(specs: list[_driver.ImplSpec], policy: str, threshold: int, count: int) -> None:
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
