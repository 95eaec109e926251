"""The reference manager: vLLM 0.33.0's ``CPUOffloadingManager`` in plain, readable Python.

The Rust-backed ``kvoffload.CPUOffloadingManager`` is tested and benchmarked against it. It does not
need the native extension.
"""

from __future__ import annotations

from kvoffload.reference.admission import AdmissionTracker
from kvoffload.reference.arc import ArcPolicy
from kvoffload.reference.fifo import FifoPolicy
from kvoffload.reference.lfu import LfuPolicy
from kvoffload.reference.lru import LruPolicy
from kvoffload.reference.manager import ChunkPool, CPUOffloadingManager
from kvoffload.reference.policy import CachePolicy, ChunkStatus, RequestContext
from kvoffload.reference.s3fifo import S3FifoPolicy
from kvoffload.reference.sieve import SievePolicy
from kvoffload.reference.slru import SlruPolicy
from kvoffload.reference.twoq import TwoQPolicy

__all__ = [
    "AdmissionTracker",
    "ArcPolicy",
    "CPUOffloadingManager",
    "CachePolicy",
    "ChunkPool",
    "ChunkStatus",
    "FifoPolicy",
    "LfuPolicy",
    "LruPolicy",
    "RequestContext",
    "S3FifoPolicy",
    "SievePolicy",
    "SlruPolicy",
    "TwoQPolicy",
]
