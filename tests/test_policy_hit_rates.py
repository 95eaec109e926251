"""Hit-rate sanity on a seeded Zipf trace: the built-in policies order as the literature says.

Classic cache mode through the public API: each request for an object is a ``lookup``; a hit is
a ``touch``, a miss a ``prepare_store`` + ``complete_store`` of the one key. On skewed (Zipf)
traffic at small cache sizes, S3-FIFO (Yang et al., SOSP 2023), SIEVE (Zhang et al., NSDI 2024)
and ARC (Megiddo and Modha, FAST 2003) miss less than LRU, and FIFO misses more than LRU.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffload import CPUOffloadingManager, ReqContext, make_offload_key
from kvoffload.types import LookupResult

OBJECTS = 5_000
REQUESTS = 40_000


def zipf_trace(alpha: float = 1.0, seed: int = 7) -> list[bytes]:
    """Object keys drawn from a Zipf(alpha) popularity over OBJECTS objects, in random order."""
    rng = np.random.default_rng(seed)
    weights = 1.0 / np.arange(1, OBJECTS + 1) ** alpha
    ranks = rng.choice(OBJECTS, size=REQUESTS, p=weights / weights.sum())
    names = rng.permutation(OBJECTS)  # popularity unrelated to key order
    keys = [make_offload_key(int(i).to_bytes(8, "big"), 0) for i in range(OBJECTS)]
    return [keys[names[r]] for r in ranks]


def miss_ratio(policy: str, size: int, trace: list[bytes]) -> float:
    m = CPUOffloadingManager(size, cache_policy=policy)
    misses = 0
    for key in trace:
        ctx = ReqContext(req_id="")
        if m.lookup(key, ctx) == LookupResult.HIT:
            m.touch([key], ctx)
        else:
            misses += 1
            out = m.prepare_store([key], ctx)
            assert out is not None
            m.complete_store(out.keys_to_store, ctx)
    m.check_invariants()
    return misses / len(trace)


@pytest.mark.parametrize("size", [50, 250])
def test_zipf_ordering_matches_the_literature(size: int) -> None:
    trace = zipf_trace()
    ratios = {p: miss_ratio(p, size, trace) for p in ("lru", "arc", "fifo", "sieve", "s3fifo")}
    assert ratios["s3fifo"] < ratios["lru"], ratios
    assert ratios["sieve"] < ratios["lru"], ratios
    assert ratios["arc"] < ratios["lru"], ratios
    assert ratios["fifo"] > ratios["lru"], ratios
