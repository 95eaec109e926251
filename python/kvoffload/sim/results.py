"""What a simulation run measured (`SimResult`), and its JSON, CSV and table forms."""

from __future__ import annotations

import csv
import json
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvoffload.workload import KindStats

__all__ = [
    "SIM_CALL_KINDS",
    "SimResult",
    "format_comparison",
    "format_curve",
    "write_csv",
    "write_json",
]

#: Manager calls timed in serving mode, in table order.
SIM_CALL_KINDS: tuple[str, ...] = (
    "on_new_request",
    "lookup",
    "prepare_load",
    "complete_load",
    "touch",
    "prepare_store",
    "complete_store",
    "on_request_finished",
)


@dataclass
class SimResult:
    """Counts of one run of one policy at one cache size.

    A *chunk* is one block of one KV group. Hit ratios are taken over the prompts: a chunk (or
    token) is a hit when it is loaded from the CPU tier instead of computed. In classic mode each
    request is one object (one chunk) and tokens are not counted.
    """

    mode: str
    workload: str
    policy: str
    impl: str
    num_chunks: int
    chunk_bytes: int = 0
    requests: int = 0
    lookup_chunks: int = 0
    hit_chunks: int = 0
    prompt_tokens: int = 0
    hit_tokens: int = 0
    stored_chunks: int = 0
    evicted_chunks: int = 0
    #: Candidates dropped by the admission threshold (``store_threshold >= 2``).
    stores_skipped: int = 0
    #: ``prepare_store`` calls answered with None (no room: everything evictable was protected).
    stores_refused: int = 0
    #: Stores whose transfer failed (``complete_store(success=False)``), in chunks.
    stores_failed: int = 0
    #: Admissions delayed because the next key was still being stored (HIT_PENDING).
    pending_waits: int = 0
    #: Key-level manager operations (one per key passed to a call; one per lookup).
    chunk_ops: int = 0
    #: Lookup hit rate each what-if shadow policy had on the same traffic (`kvoffload.shadow`).
    shadow_hit_rates: dict[str, float] = field(default_factory=dict)
    sim_time_s: float = 0.0
    wall_s: float = 0.0
    timer_overhead_ns: int = 0
    calls: dict[str, KindStats] = field(default_factory=dict)

    @property
    def chunk_hit_ratio(self) -> float:
        """Hit chunks over looked-up prompt chunks."""
        return self.hit_chunks / self.lookup_chunks if self.lookup_chunks else 0.0

    @property
    def miss_ratio(self) -> float:
        """1 - the chunk hit ratio (classic mode: misses over requests, libCacheSim's figure)."""
        return 1.0 - self.chunk_hit_ratio if self.lookup_chunks else 0.0

    @property
    def token_hit_ratio(self) -> float | None:
        """Hit prompt tokens over prompt tokens (None in classic mode)."""
        return self.hit_tokens / self.prompt_tokens if self.prompt_tokens else None

    @property
    def bytes_loaded(self) -> int:
        """Bytes copied from the CPU tier (hit chunks x chunk size)."""
        return self.hit_chunks * self.chunk_bytes

    @property
    def bytes_stored(self) -> int:
        """Bytes copied into the CPU tier by stores that completed."""
        return self.stored_chunks * self.chunk_bytes

    @property
    def requests_per_s(self) -> float:
        """Simulated requests per second of wall time."""
        return self.requests / self.wall_s if self.wall_s else 0.0

    @property
    def chunk_ops_per_s(self) -> float:
        """Key-level manager operations per second of wall time."""
        return self.chunk_ops / self.wall_s if self.wall_s else 0.0

    def ns_per_call(self, kind: str) -> float | None:
        """Manager nanoseconds per call of one kind, timer cost subtracted (None if no call)."""
        s = self.calls.get(kind)
        return s.net_ns(self.timer_overhead_ns) / s.calls if s and s.calls else None

    @property
    def manager_ns(self) -> int:
        """Nanoseconds spent inside the manager over all timed calls."""
        return sum(s.net_ns(self.timer_overhead_ns) for s in self.calls.values())

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready mapping of every count and derived figure."""
        out: dict[str, Any] = {
            k: v for k, v in self.__dict__.items() if k not in ("calls", "timer_overhead_ns")
        }
        out.update(
            chunk_hit_ratio=self.chunk_hit_ratio,
            miss_ratio=self.miss_ratio,
            token_hit_ratio=self.token_hit_ratio,
            bytes_loaded=self.bytes_loaded,
            bytes_stored=self.bytes_stored,
            requests_per_s=self.requests_per_s,
            chunk_ops_per_s=self.chunk_ops_per_s,
            manager_ns=self.manager_ns,
            calls={
                kind: {"calls": s.calls, "keys": s.keys, "ns_per_call": self.ns_per_call(kind)}
                for kind, s in self.calls.items()
            },
        )
        return out

    def csv_row(self) -> dict[str, Any]:
        """The flat part of `to_json` (one CSV row)."""
        row = self.to_json()
        row.pop("calls")
        for policy, rate in row.pop("shadow_hit_rates").items():
            row[f"shadow_{policy}_hit_rate"] = rate
        for kind in SIM_CALL_KINDS:
            row[f"ns_per_{kind}"] = self.ns_per_call(kind)
        return row


def write_json(results: Sequence[SimResult], path: str | Path, **meta: Any) -> None:
    """Write the results (and ``meta``) as one JSON document."""
    doc = {**meta, "results": [r.to_json() for r in results]}
    Path(path).write_text(json.dumps(doc, indent=2) + "\n")


def write_csv(results: Sequence[SimResult], path: str | Path) -> None:
    """Write one CSV row per result."""
    rows = [r.csv_row() for r in results]
    with open(path, "w", newline="", encoding="utf-8") as f:
        if rows:
            writer = csv.DictWriter(f, fieldnames=list(rows[0]))
            writer.writeheader()
            writer.writerows(rows)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.2f}%"


def _num(x: float | None, digits: int = 0) -> str:
    return "-" if x is None else f"{x:,.{digits}f}"


def _bytes(n: int) -> str:
    value, unit = float(n), "B"
    for bigger in ("KiB", "MiB", "GiB", "TiB"):
        if value < 1024:
            break
        value, unit = value / 1024, bigger
    return f"{n:,} B" if unit == "B" else f"{value:,.1f} {unit}"


def _table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(r[i]) for r in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(r, widths, strict=True))
        )
        for r in [header, ["-" * w for w in widths], *rows]
    ]
    return "\n".join(line.rstrip() for line in lines)


def format_comparison(results: Sequence[SimResult]) -> str:
    """One side-by-side table: a column per result (policy), a row per measure.

    Classic-mode results count objects (one a request) and leave out the serving rows that
    have nothing to count there (tokens, bytes, failed stores, pending waits).
    """
    classic = _classic(results)
    unit = "objects" if classic else "chunks"
    header = ["", *(f"{r.policy}" for r in results)]
    rows: list[list[str]] = [
        [f"cache size ({unit})", *(f"{r.num_chunks:,}" for r in results)],
        [
            "hit ratio (requests)" if classic else "hit ratio (chunks)",
            *(_pct(r.chunk_hit_ratio) for r in results),
        ],
    ]
    if not classic:
        rows += [
            ["hit ratio (tokens)", *(_pct(r.token_hit_ratio) for r in results)],
            ["bytes loaded", *(_bytes(r.bytes_loaded) for r in results)],
            ["bytes stored", *(_bytes(r.bytes_stored) for r in results)],
        ]
    rows += [
        [f"{unit} stored", *(f"{r.stored_chunks:,}" for r in results)],
        [f"evictions ({unit})", *(f"{r.evicted_chunks:,}" for r in results)],
        ["stores skipped (threshold)", *(f"{r.stores_skipped:,}" for r in results)],
        ["stores refused (no room)", *(f"{r.stores_refused:,}" for r in results)],
    ]
    if not classic:
        rows += [
            ["stores failed (chunks)", *(f"{r.stores_failed:,}" for r in results)],
            ["pending waits", *(f"{r.pending_waits:,}" for r in results)],
        ]
    kinds = [k for k in SIM_CALL_KINDS if any(r.ns_per_call(k) is not None for r in results)]
    rows += [[f"ns/call {k}", *(_num(r.ns_per_call(k)) for r in results)] for k in kinds]
    rows.append(["wall time (s)", *(_num(r.wall_s, 2) for r in results)])
    return _table(header, rows)


def _classic(results: Sequence[SimResult]) -> bool:
    """Whether the results are classic mode's (a table mixing the two modes counts chunks)."""
    return bool(results) and all(r.mode == "classic" for r in results)


def format_curve(results: Sequence[SimResult]) -> str:
    """A miss-ratio table: a row per cache size, a column per policy (chunk miss ratio).

    Classic-mode results give misses over requests, by cache size in objects.
    """
    policies = list(dict.fromkeys(r.policy for r in results))
    sizes = sorted({r.num_chunks for r in results})
    by_key = {(r.policy, r.num_chunks): r for r in results}
    unit = "objects" if _classic(results) else "chunks"
    header = [f"cache size ({unit})", *(f"{p} miss" for p in policies)]
    rows = []
    for size in sizes:
        row = [f"{size:,}"]
        for p in policies:
            r = by_key.get((p, size))
            row.append("-" if r is None else f"{r.miss_ratio:.4f}")
        rows.append(row)
    return _table(header, rows)
