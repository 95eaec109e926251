"""Classic mode against libCacheSim 0.3.5: LRU and ARC miss ratios equal on a seeded Zipf trace.

LRU is the manager's built-in ``lru`` (Rust). vLLM's ARC (the built-in ``arc``) is not
libCacheSim's ARC: `kvoffload.reference.arc_paper` names the three differences, and the built-in
``arc-paper`` (vLLM's ARC with the three switched to the paper's rules; Rust core and reference)
is libCacheSim's ARC. The tests show both halves of that account: ``arc-paper`` equals
libCacheSim on the Rust manager, and the twin with the switches off equals the built-in ``arc``.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload.sim import (
    ObjectTrace,
    SimConfig,
    format_comparison,
    format_curve,
    simulate,
    write_object_trace,
    zipf_object_trace,
)
from kvoffload.sim import policies as sim_policies

SIZES = (25, 100, 250, 600)
PLUGIN = "kvoffload.sim.policies"


@pytest.fixture(scope="module")
def zipf_trace() -> ObjectTrace:
    trace = zipf_object_trace(12_000, 2000, alpha=0.8, seed=2024)
    # Seeded: the same arguments give the same trace.
    assert trace.obj_ids.tolist() == zipf_object_trace(12_000, 2000, 0.8, 2024).obj_ids.tolist()
    return trace


@pytest.fixture(scope="module")
def libcachesim_misses(
    zipf_trace: ObjectTrace, tmp_path_factory: pytest.TempPathFactory
) -> dict[tuple[str, int], int]:
    lcs = pytest.importorskip("libcachesim")
    assert lcs.__version__ == "0.3.5"
    path = Path(tmp_path_factory.mktemp("lcs")) / "zipf.oracleGeneral"
    write_object_trace(zipf_trace, path, "oracleGeneral")
    misses: dict[tuple[str, int], int] = {}
    for name, cls in (("lru", lcs.LRU), ("arc", lcs.ARC)):
        for size in SIZES:
            reader = lcs.TraceReader(
                trace=str(path),
                trace_type=lcs.TraceType.ORACLE_GENERAL_TRACE,
                reader_init_params=lcs.ReaderInitParam(ignore_obj_size=True),
            )
            miss_ratio, _ = cls(cache_size=size).process_trace(reader)
            count = round(miss_ratio * len(zipf_trace))
            assert count / len(zipf_trace) == pytest.approx(miss_ratio, abs=1e-12)
            misses[name, size] = count
    return misses


def _misses(trace: ObjectTrace, size: int, policy: str, impl: str = "rust") -> int:
    module = None if policy in ("lru", "arc", "arc-paper") else PLUGIN
    cfg = SimConfig(num_chunks=size, policy=policy, impl=impl, cache_policy_module_path=module)
    res = simulate(trace, cfg)
    assert res.requests == len(trace)
    return res.requests - res.hit_chunks


@pytest.mark.parametrize("size", SIZES)
def test_lru_equals_libcachesim(
    zipf_trace: ObjectTrace, libcachesim_misses: dict[tuple[str, int], int], size: int
) -> None:
    assert _misses(zipf_trace, size, "lru") == libcachesim_misses["lru", size]


@pytest.mark.parametrize("size", SIZES)
def test_builtin_arc_paper_equals_libcachesim_on_the_rust_manager(
    zipf_trace: ObjectTrace, libcachesim_misses: dict[tuple[str, int], int], size: int
) -> None:
    assert _misses(zipf_trace, size, "arc-paper") == libcachesim_misses["arc", size]


@pytest.mark.parametrize("size", SIZES)
def test_arc_plugin_equals_libcachesim(
    zipf_trace: ObjectTrace, libcachesim_misses: dict[tuple[str, int], int], size: int
) -> None:
    assert (
        _misses(zipf_trace, size, "LibCacheSimArc", "reference") == libcachesim_misses["arc", size]
    )


@pytest.mark.parametrize("size", SIZES)
def test_builtin_arc_is_vllm_arc_not_libcachesims(
    zipf_trace: ObjectTrace, libcachesim_misses: dict[tuple[str, int], int], size: int
) -> None:
    builtin = _misses(zipf_trace, size, "arc")
    # The plug-in with all three switches off is vLLM's ARC: equal to the built-in arc ...
    assert _misses(zipf_trace, size, "VllmArcWithSwitches", "reference") == builtin
    # ... which is not libCacheSim's ARC on this trace.
    assert builtin != libcachesim_misses["arc", size]


class _GhostToT2(sim_policies.VllmArcWithSwitches):
    ghost_hit_to_t2 = True


class _PaperReplace(sim_policies.VllmArcWithSwitches):
    paper_replace = True


class _PaperDirectory(sim_policies.VllmArcWithSwitches):
    paper_directory = True


@pytest.mark.parametrize("switch", [_GhostToT2, _PaperReplace, _PaperDirectory])
def test_each_arc_difference_matters(
    zipf_trace: ObjectTrace, switch: type, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each switch alone moves the miss count away from vLLM's ARC at some size.
    monkeypatch.setattr(sim_policies, switch.__name__, switch, raising=False)
    assert any(
        _misses(zipf_trace, s, switch.__name__, "reference") != _misses(zipf_trace, s, "arc")
        for s in SIZES
    )


def test_classic_rust_and_reference_agree(zipf_trace: ObjectTrace) -> None:
    for policy in ("lru", "arc"):
        assert _misses(zipf_trace, 100, policy) == _misses(zipf_trace, 100, policy, "reference")


def test_classic_counts(zipf_trace: ObjectTrace) -> None:
    res = simulate(zipf_trace, SimConfig(num_chunks=100))
    misses = res.requests - res.hit_chunks
    assert res.stored_chunks == misses
    assert res.evicted_chunks == misses - 100  # the cache filled once, then one out per miss
    assert res.token_hit_ratio is None
    assert res.chunk_ops == res.requests + res.hit_chunks + 2 * misses


def test_classic_counts_with_an_admission_threshold(zipf_trace: ObjectTrace) -> None:
    # With store_threshold=2 a first miss of an object is offered and skipped, not stored.
    res = simulate(zipf_trace, SimConfig(num_chunks=100, store_threshold=2))
    misses = res.requests - res.hit_chunks
    assert res.stores_skipped > 0
    assert res.stored_chunks + res.stores_skipped == misses
    assert res.evicted_chunks == res.stored_chunks - 100
    assert (
        res.chunk_ops == res.requests + res.hit_chunks + 2 * res.stored_chunks + res.stores_skipped
    )


def test_classic_tables_count_objects(zipf_trace: ObjectTrace) -> None:
    results = [simulate(zipf_trace, SimConfig(num_chunks=n)) for n in (10, 100)]
    table = format_comparison(results[1:])
    assert "cache size (objects)" in table
    assert "hit ratio (requests)" in table
    assert "objects stored" in table
    for serving_only in ("chunk", "token", "bytes", "pending"):
        assert serving_only not in table
    assert format_curve(results).splitlines()[0].startswith("cache size (objects)")


def test_a_hit_refreshes_lru_recency() -> None:
    from kvoffload.sim.classic import run_classic

    # Cache of 2: 1 and 2 miss, 1 hits (and becomes the most recent), 3 evicts 2, 1 hits again.
    res = run_classic([1, 2, 1, 3, 1], SimConfig(num_chunks=2))
    assert (res.hit_chunks, res.stored_chunks, res.evicted_chunks) == (2, 3, 1)
    assert res.chunk_ops == 5 + 2 + 2 * 3
    assert res.calls == {}  # classic mode times no call
