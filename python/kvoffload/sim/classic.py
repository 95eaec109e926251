"""Classic mode: an object trace through the manager, one object per request, as libCacheSim does.

Each request is a new request context: ``on_new_request``, ``lookup`` of the object's key; on a
hit ``touch`` (the engine's recency update), on a miss ``prepare_store`` then ``complete_store``
(the insert; the pool evicts one chunk when full), then ``on_request_finished``. Objects have unit
size and the cache size counts objects (libCacheSim with ``ignore_obj_size=True``). The miss ratio
is misses over requests, libCacheSim's request miss ratio.

With ``lru`` this is exactly libCacheSim's LRU. The built-in ``arc`` is vLLM's ARC, which differs
from libCacheSim's; `kvoffload.sim.policies.LibCacheSimArc` is libCacheSim's ARC as a plug-in
policy (see docs/sim.md, "Classic mode and libCacheSim").
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvoffload.sim.engine import SimConfig, make_manager, require_lookups, shadow_hit_rates
from kvoffload.sim.results import SimResult
from kvoffload.sim.traces import ObjectTrace
from kvoffload.types import LookupResult, ReqContext, make_offload_key

__all__ = ["run_classic"]

_PROGRESS_EVERY = 10_000


def run_classic(
    trace: ObjectTrace | Sequence[int],
    config: SimConfig | None = None,
    *,
    workload: str = "trace",
    progress: Callable[[int], object] | None = None,
    manager: Any = None,
) -> SimResult:
    """Replay an object trace in classic mode (see the module docstring).

    ``manager`` replaces the fresh manager ``config`` would build (its policy and size rule).
    """
    cfg = config or SimConfig()
    cfg.validate()
    if not isinstance(trace, ObjectTrace):
        trace = ObjectTrace.from_ids(np.asarray(trace, dtype=np.uint64))
    require_lookups(trace)
    ids: list[int] = trace.obj_ids.tolist()
    if manager is None:
        manager = make_manager(cfg)
    res = SimResult(
        mode="classic",
        workload=workload,
        policy=cfg.policy,
        impl=cfg.impl,
        num_chunks=cfg.num_chunks,
    )
    keys: dict[int, bytes] = {}
    lookup, touch = manager.lookup, manager.touch
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    on_new_request, on_request_finished = manager.on_new_request, manager.on_request_finished
    hit = LookupResult.HIT
    hits = stored = evicted = refused = skipped = 0
    started = time.perf_counter()
    for i, obj in enumerate(ids):
        key = keys.get(obj)
        if key is None:
            key = keys[obj] = make_offload_key(obj.to_bytes(8, "big"), 0)
        ctx = ReqContext("c")
        on_new_request(ctx)
        if lookup(key, ctx) is hit:
            touch((key,), ctx)
            hits += 1
        else:
            out = prepare_store((key,), ctx)
            if out is None:
                refused += 1
            elif out.keys_to_store:
                evicted += len(out.evicted_keys)
                complete_store(out.keys_to_store, ctx)
                stored += 1
            else:  # below the admission threshold (store_threshold >= 2)
                skipped += 1
        on_request_finished(ctx)
        if progress is not None and (i + 1) % _PROGRESS_EVERY == 0:
            progress(_PROGRESS_EVERY)
    res.wall_s = time.perf_counter() - started
    if progress is not None and len(ids) % _PROGRESS_EVERY:
        progress(len(ids) % _PROGRESS_EVERY)
    n = len(ids)
    res.requests = res.lookup_chunks = n
    res.hit_chunks = hits
    res.stored_chunks = stored
    res.evicted_chunks = evicted
    res.stores_refused = refused
    res.stores_skipped = skipped
    # Key-level operations: a lookup per request, then a touch (hit) or an offer to store, and
    # the completion of an offer taken.
    res.chunk_ops = n + hits + 2 * stored + skipped + refused
    res.shadow_hit_rates = shadow_hit_rates(manager)
    if cfg.check_invariants and hasattr(manager, "check_invariants"):
        manager.check_invariants()
    return res
