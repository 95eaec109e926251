"""FFI-level cost of the manager's calls: Rust, the reference and vLLM 0.33.0, 10^3 to 10^6 chunks.

Not part of the normal test run (``testpaths = ["tests"]``); run with
``pytest benches --benchmark-only``. A round is one operation on 32 keys (see ``cases.py``);
``extra_info["ns_per_key_min"]`` gives the per-key cost, and ``benches/report.py`` prints the same
measurements as a table.
"""

from __future__ import annotations

from typing import Any

import pytest

from cases import IMPLS, KEYS_PER_OP, OPERATIONS, POLICIES, SIZES, CacheRegistry, unavailable

# Timed with the cyclic GC paused, as report.py and the workload replayer do.
pytestmark = pytest.mark.benchmark(disable_gc=True)

ROUNDS = 300
WARMUP_ROUNDS = 10

# Size, then policy, outermost: each implementation fills one cache per (size, policy) only.
CASES = [
    pytest.param(chunks, policy, op, impl, id=f"{op}-{policy}-{chunks}-{impl}")
    for chunks in SIZES
    for policy in POLICIES
    for op in OPERATIONS
    for impl in IMPLS
]


@pytest.fixture(scope="module")
def registry() -> CacheRegistry:
    return CacheRegistry()


@pytest.mark.parametrize(("chunks", "policy", "op", "impl"), CASES)
def test_ffi(
    benchmark: Any, registry: CacheRegistry, chunks: int, policy: str, op: str, impl: str
) -> None:
    reason = unavailable(impl, policy)
    if reason is not None:
        pytest.skip(f"{impl}/{policy}: {reason}")
    cache = registry.get(impl, policy, chunks)
    benchmark.group = f"{op} {policy} {chunks:,} chunks (per {KEYS_PER_OP} keys)"
    benchmark.extra_info.update(
        op=op, policy=policy, chunks=chunks, impl=impl, keys_per_round=KEYS_PER_OP
    )
    benchmark.pedantic(
        cache.targets[op],
        setup=lambda: (cache.prepare(op, 1)[0], {}),
        rounds=ROUNDS,
        warmup_rounds=WARMUP_ROUNDS,
    )
    cache.settle()
    stats = getattr(benchmark.stats, "stats", None)
    if stats is not None:
        benchmark.extra_info["ns_per_key_min"] = stats.min * 1e9 / KEYS_PER_OP
