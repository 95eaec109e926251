"""benches/scaling.py's memory part: a fill, and a turnover that fills ARC's ghost lists."""

from __future__ import annotations

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
