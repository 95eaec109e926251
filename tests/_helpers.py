"""Helpers shared by the contract tests (scenarios and spec rules): keys, stores, event drains."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from kvoffload import CPUOffloadingMetrics, LookupResult, ReqContext, make_offload_key

MakeManager = Callable[..., Any]

HIT = LookupResult.HIT
MISS = LookupResult.MISS
PENDING = LookupResult.HIT_PENDING

USAGE = CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
WRITE = CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC
READ = CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC
ALLOC = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
SKIPPED = CPUOffloadingMetrics.STORES_SKIPPED


def k(i: int, group: int = 0) -> bytes:
    """The key of block ``i`` in KV group ``group``, as vLLM's tests build it."""
    return make_offload_key(str(i).encode(), group)


def ks(*ids: int) -> list[bytes]:
    """Keys of group 0 for ``ids``, in order."""
    return [k(i) for i in ids]


def chunk_ids(output: Any) -> list[int]:
    """The chunk ids of a PrepareStoreOutput or a load spec, as a plain list."""
    spec = output.store_spec if hasattr(output, "store_spec") else output
    return [int(x) for x in spec.block_ids]


def drain(m: Any) -> list[tuple[str, list[bytes]]]:
    """Drain the events as (kind, keys); kind is stored, removed or cleanup (metadata-only)."""
    out = []
    for e in m.take_events():
        kind = ("cleanup" if e.metadata_only else "removed") if e.removed else "stored"
        out.append((kind, list(e.keys)))
    return out


def store(m: Any, ctx: Any, *ids: int) -> Any:
    """Prepare and complete a store of ``ids``; the prepare must succeed."""
    out = m.prepare_store(ks(*ids), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return out


def stats_data(m: Any) -> dict[str, Any]:
    """This report's metrics as ``{name: value}``."""
    return {name: series[()] for name, series in m.get_stats().data["data"].items()}


def ranks(m: Any) -> dict[bytes, tuple[int, int]]:
    """LRU ranks by key."""
    state = m.policy_state()
    assert state["policy"] == "lru"
    return {key: tuple(rank) for key, rank in state["ranks"].items()}


def lru_state(m: Any) -> tuple[dict[bytes, tuple[int, int]], int]:
    """LRU ranks and the next rank to issue."""
    return ranks(m), m.policy_state()["next_rank"]


def arc_lists(m: Any) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    """ARC's T1, T2, B1 and B2, oldest first."""
    state = m.policy_state()
    assert state["policy"] == "arc"
    return (list(state["t1"]), list(state["t2"]), list(state["b1"]), list(state["b2"]))


def target(m: Any) -> float:
    """ARC's target size of T1."""
    return float(m.policy_state()["target_t1_size"])


def request(req_id: str, positions: dict[bytes, int] | None = None) -> ReqContext:
    """A context with the given token positions."""
    ctx = ReqContext(req_id=req_id)
    for key, pos in (positions or {}).items():
        ctx.set_offload_key_position(key, pos)
    return ctx
