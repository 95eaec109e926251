"""Host transfers under pytest-benchmark: gather and scatter of 256 MiB in 64 KiB-2 MiB blocks,
on 1 and 2 threads, next to numpy's single copy of the same bytes (array to array, and into and
out of the pool's own memory). Buffers are page-aligned and written first, as in host_transfer.

Not part of the normal test run; ``pytest benches/test_bench_host.py --benchmark-only``.
``benches/host_transfer.py`` runs the 1 GiB version and prints the README table.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from host_transfer import page_aligned
from kvoffload import HostPool

TOTAL = 256 << 20
BLOCKS = [64 << 10, 256 << 10, 1 << 20, 2 << 20]


@pytest.fixture(scope="module", params=BLOCKS, ids=lambda b: f"{b >> 10}KiB")
def setup(request: pytest.FixtureRequest) -> Iterator[dict[str, Any]]:
    block = int(request.param)
    n = TOTAL // block
    rng = np.random.default_rng(0)
    pool = HostPool(n, block, num_threads=2, register_cuda=False)
    yield {
        "pool": pool,
        "view": pool.view(),
        "src": page_aligned(n, block, 1),
        "dst": page_aligned(n, block),
        "blocks": np.arange(n),
        "chunks": rng.permutation(n),
    }
    pool.close()


def test_numpy_copy(benchmark: Any, setup: dict[str, Any]) -> None:
    benchmark.extra_info["bytes"] = TOTAL
    benchmark(np.copyto, setup["dst"], setup["src"])


def test_numpy_into_pool(benchmark: Any, setup: dict[str, Any]) -> None:
    benchmark.extra_info["bytes"] = TOTAL
    benchmark(np.copyto, setup["view"], setup["src"])


def test_numpy_out_of_pool(benchmark: Any, setup: dict[str, Any]) -> None:
    benchmark.extra_info["bytes"] = TOTAL
    benchmark(np.copyto, setup["dst"], setup["view"])


@pytest.mark.parametrize("threads", [1, 2])
def test_gather(benchmark: Any, setup: dict[str, Any], threads: int) -> None:
    s = setup
    benchmark.extra_info["bytes"] = TOTAL
    benchmark(lambda: s["pool"].gather(s["src"], s["blocks"], s["chunks"], threads=threads))


@pytest.mark.parametrize("threads", [1, 2])
def test_scatter(benchmark: Any, setup: dict[str, Any], threads: int) -> None:
    s = setup
    benchmark.extra_info["bytes"] = TOTAL
    benchmark(lambda: s["pool"].scatter(s["dst"], s["blocks"], s["chunks"], threads=threads))
