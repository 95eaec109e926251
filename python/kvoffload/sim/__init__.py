"""kvoffload.sim: trace-driven evaluation of cache policies and sizes through the real manager.

``simulate(workload, policy=..., num_chunks=...)`` replays a workload through a fresh manager
(the Rust one unless ``impl="reference"``): a list of `SimRequest` in serving mode (a scheduler
model: arrivals, prefix lookups, loads and stores with transfer latency, several requests in
flight), an `ObjectTrace` in classic mode (one object per request, as libCacheSim). Workloads
come from the seeded generators (``chat``, ``rag``, ``agent``, ``zipf``) or trace files
(`load_workload`). ``miss_ratio_curve`` runs policies x sizes in parallel processes. See
docs/sim.md.
"""

from __future__ import annotations

from kvoffload.sim.api import Workload, load_workload, miss_ratio_curve, simulate, working_set
from kvoffload.sim.engine import SimConfig
from kvoffload.sim.generators import GENERATORS, GeneratorConfig, generate_workload
from kvoffload.sim.model import SimRequest
from kvoffload.sim.results import SimResult, format_comparison, format_curve, write_csv, write_json
from kvoffload.sim.traces import (
    CsvColumns,
    ObjectTrace,
    read_jsonl,
    read_object_trace,
    write_jsonl,
    write_object_trace,
    zipf_object_trace,
)

__all__ = [
    "GENERATORS",
    "CsvColumns",
    "GeneratorConfig",
    "ObjectTrace",
    "SimConfig",
    "SimRequest",
    "SimResult",
    "Workload",
    "format_comparison",
    "format_curve",
    "generate_workload",
    "load_workload",
    "miss_ratio_curve",
    "read_jsonl",
    "read_object_trace",
    "simulate",
    "working_set",
    "write_csv",
    "write_json",
    "write_jsonl",
    "write_object_trace",
    "zipf_object_trace",
]
