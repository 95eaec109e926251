"""The performance page's sections, rendered from the JSON of runs (benches/render.py)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"


@pytest.fixture(scope="module")
def render() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHES))
    try:
        yield importlib.import_module("render")
    finally:
        sys.path.remove(str(BENCHES))


def _floor(pointer: bool) -> dict[str, Any]:
    fl: dict[str, Any] = {
        "window": 32,
        "layout": "adjacent",
        "sizes": [1_000, 10_000_000],
        "minimal_ns": [10.0, 40.0],
        "table_ns": [20.0, 60.0],
    }
    if pointer:
        fl |= {
            "pointer_ns": [12.0, 50.0],
            "single_minimal_ns": [20.0, 200.0],
            "single_pointer_ns": [25.0, 320.0],
        }
    return fl


def test_pointer_model_gets_its_table_and_difference(render: ModuleType) -> None:
    text = "\n".join(render._floor(_floor(pointer=True), None))
    assert "| chunks | minimal | pointer | ratio | one key | one key, pointer | ratio |" in text
    assert "| 10,000,000 | 40.0 | 50.0 | 1.25x | 200 | 320 | 1.60x |" in text
    assert "costs 10.0 ns more a key in a window of 32 and 120 ns more a lookup of one key" in text
    # The pointer paragraph ends before the floor's own conclusion starts a new one.
    assert "lookup of one key.\n\nAt 10,000,000 chunks the accesses alone add 30.0 ns" in text


def test_a_run_without_the_pointer_model_renders_as_before(render: ModuleType) -> None:
    text = "\n".join(render._floor(_floor(pointer=False), None))
    assert "pointer" not in text
    assert "| 10,000,000 | 40.0 | 4.00x | 60.0 | 3.00x |" in text


def _counts(impl: str, op: str, per_key: float) -> dict[str, Any]:
    return {
        "impl": impl,
        "policy": "lru",
        "op": op,
        "chunks": 1000,
        "rounds": 200,
        "warmup": 50,
        "instructions": int(per_key * 200 * 32),
        "per_key": per_key,
    }


def test_instruction_counts_get_a_table_with_ratios(render: ModuleType) -> None:
    rows = [
        _counts("rust", "store_evict", 2000.0),
        _counts("vllm", "store_evict", 40000.0),
        _counts("rust", "lookup", 600.0),  # vLLM's count missing: a dash, not a ratio
    ]
    text = "\n".join(render._callgrind(rows))
    assert "## Instructions per key of the FFI cases (callgrind)" in text
    assert "(200 after 50 uncounted)" in text
    assert (
        "| policy | operation | chunks | kvoffload | vLLM 0.33.0 | vLLM 0.33.0 / kvoffload |"
        in text
    )
    store = render.LABELS["store_evict"]
    assert f"| lru | {store} | 1,000 | 2,000 | 40,000 | 20.0x |" in text
    assert f"| lru | {render.LABELS['lookup']} | 1,000 | 611 | - | - |" not in text
    assert f"| lru | {render.LABELS['lookup']} | 1,000 | 600 | - | - |" in text


def test_the_page_has_the_counts_only_when_the_run_made_them(
    render: ModuleType, tmp_path: Path
) -> None:
    meta = {"mode": "quick", "date": "today"}
    without = render.render({"meta": meta}, tmp_path)
    assert "FFI cases (callgrind)" not in without
    with_counts = render.render(
        {"meta": meta, "callgrind": [_counts("rust", "touch", 400.0)]}, tmp_path
    )
    assert "FFI cases (callgrind)" in with_counts
    assert "in the core (callgrind)" not in with_counts
    both = render.render(
        {
            "meta": meta,
            "callgrind": [_counts("rust", "touch", 400.0)],
            "core": {"commit": "abc1234", "rows": [_core("lru", "touch", 350.0, 0.0)]},
        },
        tmp_path,
    )
    # The core's counts follow the FFI cases' counts.
    assert both.index("FFI cases (callgrind)") < both.index(
        "## Instructions per key in the core (callgrind)"
    )
    assert "`benches/callgrind_core.py`, measured on abc1234:" in both


def _core(policy: str, op: str, per_key: float, allocations: float | None) -> dict[str, Any]:
    return {
        "policy": policy,
        "op": op,
        "chunks": 1000,
        "batches": 1000,
        "instructions": int(per_key * 32_000),
        "per_key": per_key,
        "allocations": allocations,
    }


def test_core_counts_get_a_row_per_call_and_a_column_per_policy(render: ModuleType) -> None:
    rows = [
        _core("lru", "store_evict", 1582.0, 0.094),
        _core("arc", "store_evict", 2046.0, 0.125),
        _core("lru", "reset_cache", 17.0, 0.0),
        # ARC's reset missing: a dash in its column
    ]
    text = "\n".join(render.core_table(rows))
    assert "| call (a key) | lru | arc | allocations a key |" in text
    assert "| store with eviction (prepare + complete) | 1,582 | 2,046 | 0.125 |" in text
    assert "| reset_cache (a chunk) | 17.0 | - | 0.000 |" in text
    # Calls no policy counted have no row.
    assert "lookup_prefix" not in text


def _sizes(store_large: float) -> dict[str, Any]:
    ops = ("store_evict", "load_complete", "lookup", "lookup_prefix", "touch")
    small = dict.fromkeys(ops, 100.0)
    large = dict.fromkeys(ops, 400.0) | {"store_evict": store_large}
    return {
        "sizes": {
            "ns_per_key": {"lru": {"1000": {"rust": small}, "10000000": {"rust": large}}},
            "rounds": 3,
        }
    }


def test_pool_size_targets_take_the_median_of_the_runs(render: ModuleType, tmp_path: Path) -> None:
    targets: list[list[str]] = []
    more = [_sizes(store_large=120.0), _sizes(store_large=140.0), {"sizes": {}}]
    render._scaling(_sizes(store_large=180.0), tmp_path, targets, None, more)
    store = next(t for t in targets if t[0].startswith("lru store_evict"))
    # 1.8x in the first run, 1.2x and 1.4x in the others (a run without sizes is skipped).
    assert store[1:] == ["1.40x (runs: 1.80x, 1.20x, 1.40x)", "**met**"]
    load = next(t for t in targets if t[0].startswith("lru load_complete"))
    assert load[1:] == ["4.00x (runs: 4.00x, 4.00x, 4.00x)", "**not met**"]


def test_a_single_size_run_is_judged_alone(render: ModuleType, tmp_path: Path) -> None:
    targets: list[list[str]] = []
    render._scaling(_sizes(store_large=180.0), tmp_path, targets, None)
    store = next(t for t in targets if t[0].startswith("lru store_evict"))
    assert store[1:] == ["1.80x", "**not met**"]


def _pinned(most: float, rounds: int | None = 3) -> dict[str, Any]:
    per = {"0.0": {"rust": 100.0, "reference": 1000.0}, "0.99": {"rust": most, "reference": 9e4}}
    pinned: dict[str, Any] = {"chunks": 100_000, "store_evict_ns_per_key": {"arc": per}}
    if rounds is not None:
        pinned["rounds"] = rounds
    return {"pinned": pinned}


def test_the_pinned_target_takes_the_median_of_the_runs(render: ModuleType, tmp_path: Path) -> None:
    targets: list[list[str]] = []
    more = [_pinned(90.0), _pinned(110.0), {"sizes": {}}]
    text = "\n".join(render._scaling(_pinned(160.0), tmp_path, targets, None, more))
    pinned = next(t for t in targets if "pinned" in t[0])
    # 1.6x in the first run, 0.9x and 1.1x in the others (a run without pins is skipped).
    assert pinned == ["arc: eviction with 99% pinned within 1.5x of 0%", *pinned[1:]]
    assert pinned[1:] == ["1.10x (runs: 1.60x, 0.90x, 1.10x)", "**met**"]
    assert "timed in 3 rounds" in text
    # The reference's ratio is a row of the table, never a target.
    assert len([t for t in targets if "pinned" in t[0]]) == 1


def test_a_single_pinned_run_is_judged_alone(render: ModuleType, tmp_path: Path) -> None:
    targets: list[list[str]] = []
    text = "\n".join(render._scaling(_pinned(160.0, rounds=None), tmp_path, targets, None))
    pinned = next(t for t in targets if "pinned" in t[0])
    assert pinned[1:] == ["1.60x", "**not met**"]
    assert "rounds" not in text


def _drop(manager: str, ns: float, policy: str = "lru") -> dict[str, Any]:
    return {
        "policy": policy,
        "manager": manager,
        "ns_per_context": ns,
        "runs_ns": [ns],
        "requests": 1000,
        "keys_per_request": 100,
        "chunks": 100_000,
    }


def test_context_drops_get_a_section_when_the_run_made_them(
    render: ModuleType, tmp_path: Path
) -> None:
    meta = {"mode": "quick", "date": "today"}
    assert "Dropping a finished request's context" not in render.render({"meta": meta}, tmp_path)
    rows = [_drop("kvoffload", 2_000.0), _drop("reference", 5_000.0), _drop("vllm", 7_000.0)]
    text = render.render({"meta": meta, "drop": rows}, tmp_path)
    assert "## Dropping a finished request's context" in text
    assert "| lru | kvoffload | 2.00 | 20.0 | 1.00x |" in text
    assert "| lru | reference | 5.00 | 50.0 | 2.50x |" in text
    assert "| lru | vLLM 0.33.0 | 7.00 | 70.0 | 3.50x |" in text


def _memory(turnover: dict[str, float] | None) -> dict[str, Any]:
    def row(filled: float, impl: str) -> dict[str, float]:
        r = {"rss_bytes_per_chunk": filled, "tracemalloc_bytes_per_chunk": 0.0}
        if turnover is not None:
            r["rss_bytes_per_chunk_turnover"] = turnover[impl]
        return r

    return {
        "chunks": 1_000_000,
        "bytes_per_chunk": {"arc": {"rust": row(60.0, "rust"), "vllm": row(236.0, "vllm")}},
    }


def test_memory_target_takes_the_larger_of_fill_and_turnover(
    render: ModuleType, tmp_path: Path
) -> None:
    targets: list[list[str]] = []
    text = "\n".join(render._memory(_memory({"rust": 90.0, "vllm": 440.0}), tmp_path, targets))
    assert "after a turnover |" in text
    assert "| arc | vLLM 0.33.0 | 236 | 0 | 440 |" in text
    # 60 bytes after the fill meets 64, but the running cache's 90 does not.
    assert targets == [
        [
            "arc: manager state <= 64 bytes per chunk",
            "60 bytes (RSS), 90 after a turnover",
            "**not met**",
        ]
    ]
    assert (tmp_path / "perf-memory.png").stat().st_size > 0


def test_memory_without_a_turnover_renders_as_before(render: ModuleType, tmp_path: Path) -> None:
    targets: list[list[str]] = []
    text = "\n".join(render._memory(_memory(None), tmp_path, targets))
    assert "turnover" not in text
    assert targets == [["arc: manager state <= 64 bytes per chunk", "60 bytes (RSS)", "**met**"]]


def test_the_cases_with_positions_get_a_section_and_their_own_target_rows(
    render: ModuleType, tmp_path: Path
) -> None:
    meta = {"mode": "quick", "date": "today"}
    assert "token positions recorded" not in render.render({"meta": meta}, tmp_path)
    by_size = {
        "store_evict": {"100000": {"rust": 300.0, "reference": 6000.0, "vllm": 9300.0}},
        "load_complete": {"100000": {"rust": 200.0, "reference": 3000.0, "vllm": 3000.0}},
    }
    doc = {"positions": True, "ns_per_key": {"lru": by_size}}
    counts = [_counts("rust", "load_complete", 1500.0)]
    text = render.render({"meta": meta, "positions": doc, "positions_callgrind": counts}, tmp_path)
    assert "## FFI level with token positions recorded" in text
    target = "| vs vLLM, lru, 10^5 chunks, 32 keys, token positions recorded (one run): "
    assert f"{target}store with eviction >= 30x | 31.0x | **met** |" in text
    assert f"{target}load >= 20x | 15.0x | **not met** |" in text
    assert (
        f"| {render.LABELS['store_evict']} | 100,000 | 300 | 6,000 | 9,300 | 20.0x | 31.0x |"
        in (text)
    )
    assert f"| lru | {render.LABELS['load_complete']} | 1,000 | 1,500 |" in text


def _tiering_row(setup: str, share: bool) -> dict[str, Any]:
    row: dict[str, Any] = {"policy": "lru", "setup": setup, "chunks": 2000, "steps": 300}
    for name, mean in (("vllm", 1_500.0), ("kvoffload", 600.0)):
        row |= {
            f"{name}_us_per_step_mean": mean,
            f"{name}_us_per_step_p50": mean / 2,
            f"{name}_us_per_step_p99": mean * 4,
        }
    row["speedup"] = 2.5
    if share:
        row |= {"vllm_primary_share": 0.6, "kvoffload_primary_share": 0.25}
    return row


def test_the_tiering_runs_get_a_section_and_a_plot(render: ModuleType, tmp_path: Path) -> None:
    meta = {"mode": "quick", "date": "today"}
    assert "Inside vLLM's tiering" not in render.render({"meta": meta}, tmp_path)
    rows = [_tiering_row("example", True), _tiering_row("serving", True)]
    text = render.render({"meta": meta, "tiering": rows}, tmp_path)
    assert "## Inside vLLM's tiering: the CPU primary tier" in text
    assert "| lru | example | 300 | 1,500 | 600 | 750 / 300 | 2.50x | 60% / 25% |" in text
    assert "![perf-tiering.png](perf-tiering.png)" in text
    assert (tmp_path / "perf-tiering.png").stat().st_size > 0
    # A run without the shares: the table says so, and there is no plot.
    (tmp_path / "perf-tiering.png").unlink()
    text = render.render({"meta": meta, "tiering": [_tiering_row("example", False)]}, tmp_path)
    assert "| lru | example | 300 | 1,500 | 600 | 750 / 300 | 2.50x | - |" in text
    assert "perf-tiering.png" not in text
    assert not (tmp_path / "perf-tiering.png").exists()
