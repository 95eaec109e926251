"""libCacheSim (the ``libcachesim`` package, optional) on the same object trace, for comparison."""

from __future__ import annotations

import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvoffload.errors import InvalidArgumentError
from kvoffload.sim.traces import ObjectTrace, write_object_trace

__all__ = ["LIBCACHESIM_POLICIES", "LibCacheSimRun", "available", "run_libcachesim"]

#: Our policy name -> libcachesim class name.
LIBCACHESIM_POLICIES = {"lru": "LRU", "arc": "ARC", "arc-paper": "ARC", "LibCacheSimArc": "ARC"}


@dataclass(frozen=True)
class LibCacheSimRun:
    """libCacheSim's request miss ratio for one policy and size, and its wall time."""

    policy: str
    num_objects: int
    miss_ratio: float
    wall_s: float
    requests: int

    @property
    def requests_per_s(self) -> float:
        """Requests per second of wall time (trace reading included, as process_trace does)."""
        return self.requests / self.wall_s if self.wall_s else 0.0


def available() -> bool:
    """Tell whether ``libcachesim`` can be imported."""
    try:
        import libcachesim  # type: ignore[import-untyped, unused-ignore]  # noqa: F401
    except ImportError:
        return False
    return True


def run_libcachesim(
    trace: ObjectTrace, sizes: Sequence[int], policies: Sequence[str] = ("lru", "arc")
) -> list[LibCacheSimRun]:
    """Run libCacheSim's own simulator on ``trace`` (unit sizes, sizes in objects)."""
    import libcachesim as lcs  # type: ignore[import-untyped, unused-ignore]

    unknown = [p for p in policies if p not in LIBCACHESIM_POLICIES]
    if unknown:
        raise InvalidArgumentError(f"no libCacheSim counterpart for {unknown}")
    runs = []
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.oracleGeneral"
        write_object_trace(trace, path, "oracleGeneral")
        for policy in policies:
            cls: Any = getattr(lcs, LIBCACHESIM_POLICIES[policy])
            for size in sizes:
                reader = lcs.TraceReader(
                    trace=str(path),
                    trace_type=lcs.TraceType.ORACLE_GENERAL_TRACE,
                    reader_init_params=lcs.ReaderInitParam(ignore_obj_size=True),
                )
                cache = cls(cache_size=size)
                started = time.perf_counter()
                miss_ratio, _ = cache.process_trace(reader)
                wall = time.perf_counter() - started
                runs.append(LibCacheSimRun(policy, size, float(miss_ratio), wall, len(trace)))
    return runs
