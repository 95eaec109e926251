"""kvoffload: vLLM's scheduler-side CPU offloading manager with a Rust core.

``CPUOffloadingManager`` is the Rust-backed manager; ``kvoffload.reference`` holds the same
manager in plain Python, the baseline it is tested and benchmarked against.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffload.errors import (
    BlockIndexError,
    CudaRegistrationError,
    DuplicateKeyError,
    ForkedWhileBusyError,
    HostMemoryError,
    InvalidArgumentError,
    InvalidKeyError,
    InvariantViolation,
    KeyStateError,
    KVOffloadError,
    PageLockError,
    PolicyError,
    PoolClosedError,
    ReentrantCallError,
    RequestFinishedError,
    SharedRegionError,
    TraceFormatError,
    UnsupportedPolicyError,
)
from kvoffload.types import (
    CacheHitSource,
    CPULoadStoreSpec,
    CPUOffloadingMetrics,
    LoadStoreSpec,
    Locality,
    LookupResult,
    Medium,
    OffloadingEvent,
    OffloadingStats,
    OffloadKey,
    OffloadPolicy,
    PrepareStoreOutput,
    ReqContext,
    RequestOffloadingContext,
    get_offload_block_hash,
    get_offload_group_idx,
    make_offload_key,
)

if TYPE_CHECKING:
    from kvoffload.manager import CPUOffloadingManager
    from kvoffload.memory import HostPool, HostPoolStats

__version__ = "0.1.0"

__all__ = [
    "BlockIndexError",
    "CPULoadStoreSpec",
    "CPUOffloadingManager",
    "CPUOffloadingMetrics",
    "CacheHitSource",
    "CudaRegistrationError",
    "DuplicateKeyError",
    "ForkedWhileBusyError",
    "HostMemoryError",
    "HostPool",
    "HostPoolStats",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvariantViolation",
    "KVOffloadError",
    "KeyStateError",
    "LoadStoreSpec",
    "Locality",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingStats",
    "PageLockError",
    "PolicyError",
    "PoolClosedError",
    "PrepareStoreOutput",
    "ReentrantCallError",
    "ReqContext",
    "RequestFinishedError",
    "RequestOffloadingContext",
    "SharedRegionError",
    "TraceFormatError",
    "UnsupportedPolicyError",
    "__version__",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]


def __getattr__(name: str) -> Any:
    # The native extension loads on first use, so `kvoffload.reference` and the types stay
    # importable (and cheap) without it.
    if name == "CPUOffloadingManager":
        from kvoffload.manager import CPUOffloadingManager

        return CPUOffloadingManager
    if name in ("HostPool", "HostPoolStats"):
        from kvoffload import memory

        return getattr(memory, name)
    raise AttributeError(f"module 'kvoffload' has no attribute {name!r}")
