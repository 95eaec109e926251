"""benches/scaling.py's memory part (a fill, and a turnover that fills ARC's ghost lists) and its
pinned part (timed in interleaved rounds)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

import scaling  # noqa: E402


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_a_turnover_counts_the_ghosts_a_fill_never_makes() -> None:
    filled = scaling.memory_child("rust", "arc", 50_000, "rss")["rss_bytes_per_chunk"]
    turned = scaling.memory_child("rust", "arc", 50_000, "turnover")
    # 50,000 evicted keys remembered: a 64-byte entry each, and their index.
    assert turned["rss_bytes_per_chunk_turnover"] > filled + 40


def test_a_turnover_of_a_pool_smaller_than_a_fill_batch_stores_every_key() -> None:
    # Batches no larger than the pool: each store of the turnover finds room.
    out = scaling.memory_child("rust", "lru", 1_000, "turnover")
    assert set(out) == {"rss_bytes_per_chunk_turnover"}


def test_an_unknown_memory_mode_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown memory mode"):
        scaling.memory_child("rust", "lru", 1_000, "steady")


def test_the_pinned_part_times_every_fraction_in_each_round() -> None:
    args = argparse.Namespace(
        chunks=10_000,
        fractions=[0.0, 0.5, 0.99],
        policies=["lru", "arc"],
        impls=["rust"],
        repeat=1,
        rounds=2,
    )
    out = scaling.measure_pinned(args)
    assert out["rounds"] == 2
    assert out["chunks"] == 10_000
    data = out["store_evict_ns_per_key"]
    assert set(data) == {"lru", "arc"}
    for per_frac in data.values():
        assert list(per_frac) == ["0.0", "0.5", "0.99"]
        assert all(set(row) == {"rust"} and row["rust"] > 0 for row in per_frac.values())


def test_a_pinned_fraction_that_leaves_no_room_for_a_store_is_refused() -> None:
    args = argparse.Namespace(
        chunks=2_000, fractions=[0.0, 0.99], policies=["lru"], impls=["rust"], repeat=1, rounds=1
    )
    with pytest.raises(ValueError, match="99% of 2,000 chunks pinned"):
        scaling.measure_pinned(args)
