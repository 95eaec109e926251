"""pytest-benchmark of the manager's other calls (see ``calls.py``): kvoffload, the reference and
vLLM 0.33.0 (lru and arc, its only built-in policies) at 10^5 chunks, every built-in policy.

Not part of the normal test run; run with ``pytest benches/test_bench_calls.py
--benchmark-only``. Each round's inputs are made by the benchmark's untimed setup, so every call
here is timed one at a time (``calls.py`` times the loop calls as loops).
"""

from __future__ import annotations

from typing import Any

import pytest

from calls import CALLS, ROUNDS, Calls
from cases import IMPLS, POLICIES, unavailable

pytestmark = pytest.mark.benchmark(disable_gc=True)

CHUNKS = 100_000


@pytest.fixture(scope="module")
def benches() -> dict[tuple[str, str], Calls]:
    return {}


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("call", CALLS)
@pytest.mark.parametrize("impl", IMPLS)
def test_call(
    benchmark: Any, benches: dict[tuple[str, str], Calls], impl: str, call: str, policy: str
) -> None:
    reason = unavailable(impl, policy)
    if reason is not None:
        pytest.skip(f"{impl}/{policy}: {reason}")
    if (impl, policy) not in benches:
        benches[impl, policy] = Calls(impl, policy, CHUNKS)
    calls = benches[impl, policy]
    benchmark.group = f"{call} {policy} {CHUNKS:,} chunks"
    benchmark.extra_info.update(call=call, policy=policy, impl=impl, chunks=CHUNKS)
    benchmark.pedantic(
        calls.target(call),
        setup=lambda: (calls.setup(call), {}),
        rounds=min(ROUNDS[call], 200) if call != "reset_cache" else 3,
    )
    calls.after(call)
