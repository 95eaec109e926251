"""The value types of the manager API, shaped like vLLM 0.33.0's so either can be passed around.

Keys are ``bytes``: a block hash followed by the KV-group index as 4 big-endian bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import Enum, auto
from typing import Any, NewType, TypeVar

import numpy as np
import numpy.typing as npt

__all__ = [
    "CPULoadStoreSpec",
    "CacheHitSource",
    "LoadStoreSpec",
    "Locality",
    "LookupResult",
    "Medium",
    "OffloadKey",
    "OffloadPolicy",
    "OffloadingEvent",
    "OffloadingStats",
    "PrepareStoreOutput",
    "ReqContext",
    "RequestOffloadingContext",
    "get_offload_block_hash",
    "get_offload_group_idx",
    "make_offload_key",
]

OffloadKey = NewType("OffloadKey", bytes)

_T = TypeVar("_T")


def make_offload_key(block_hash: bytes, group_idx: int) -> OffloadKey:
    """Pack a block hash and a KV-group index into one key."""
    return OffloadKey(bytes(block_hash) + group_idx.to_bytes(4, "big", signed=False))


def get_offload_block_hash(key: bytes) -> bytes:
    """Return the block-hash part of a key."""
    return key[:-4]


def get_offload_group_idx(key: bytes) -> int:
    """Return the KV-group index of a key (its last 4 bytes, big-endian)."""
    return int.from_bytes(key[-4:], "big", signed=False)


class Medium(Enum):
    """Storage medium of an offloading tier."""

    CPU = "CPU"
    STORAGE = "STORAGE"


class Locality(Enum):
    """Where a tier's storage sits relative to the publishing instance."""

    LOCAL = "LOCAL"
    REMOTE = "REMOTE"


class LookupResult(Enum):
    """Result of ``lookup``: MISS (absent), HIT (readable), HIT_PENDING (store in flight)."""

    MISS = auto()
    HIT = auto()
    HIT_PENDING = auto()
    RETRY = auto()


class CacheHitSource(str, Enum):
    """The tier that supplied a hit; this manager always answers HOST."""

    DEVICE = "device"
    HOST = "host"
    P2P = "p2p"
    DISK = "disk"
    EXTERNAL_UNSPECIFIED = "external_unspecified"


class OffloadPolicy(Enum):
    """How a request's blocks are offloaded."""

    CHUNK_LEVEL = "chunk_level"
    REQUEST_LEVEL = "request_level"


@dataclass
class RequestOffloadingContext:
    """What ``on_new_request`` returns."""

    policy: OffloadPolicy = OffloadPolicy.CHUNK_LEVEL


@dataclass
class ReqContext:
    """Per-request context: scratch state by type, and the end-token position of each key."""

    req_id: str
    kv_transfer_params: dict[str, Any] | None = None
    kv_hints: Any = None
    load_tier_filter: Any = None
    _state: dict[type, Any] = field(default_factory=dict, repr=False, init=False)
    _offload_key_positions: dict[bytes, int] = field(default_factory=dict, repr=False, init=False)

    def set_state(self, val: Any) -> None:
        """Store ``val`` under its own type, replacing any earlier value of that type."""
        self._state[type(val)] = val

    def get_state(self, cls: type[_T]) -> _T | None:
        """Return the value stored under ``cls``, or None."""
        return self._state.get(cls)

    def set_offload_key_position(self, key: bytes, end_token: int) -> None:
        """Record the end-token position of ``key`` in this request."""
        self._offload_key_positions[key] = end_token

    def get_offload_key_position(self, key: bytes) -> int | None:
        """Return the recorded end-token position of ``key``, or None."""
        return self._offload_key_positions.get(key)


class LoadStoreSpec:
    """Base of the specs that tell a worker where blocks live."""


class CPULoadStoreSpec(LoadStoreSpec):
    """Chunk ids of the host pool, as an int32 array lined up with the keys of the call."""

    __slots__ = ("block_ids",)

    def __init__(self, block_ids: npt.ArrayLike) -> None:
        self.block_ids: npt.NDArray[np.int32] = np.array(block_ids, dtype=np.int32)

    @property
    def chunk_ids(self) -> npt.NDArray[np.int32]:
        """The same array as ``block_ids`` (the name the tiering layer uses)."""
        return self.block_ids

    def __repr__(self) -> str:
        return repr(self.block_ids)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, CPULoadStoreSpec):
            return NotImplemented
        return bool(np.array_equal(self.block_ids, other.block_ids))

    __hash__ = None  # type: ignore[assignment]


@dataclass(slots=True)
class PrepareStoreOutput:
    """What ``prepare_store`` returns when the offer can be placed."""

    keys_to_store: list[bytes]
    store_spec: LoadStoreSpec
    evicted_keys: list[bytes]


@dataclass
class OffloadingEvent:
    """Keys stored into (``removed=False``) or removed from (``removed=True``) the host tier."""

    keys: list[bytes]
    medium: Medium
    removed: bool
    locality: Locality | None = None
    ownership: str | None = None
    removal_expected: bool = False
    metadata_only: bool = False


class OffloadingStats:
    """Metrics since the last ``get_stats`` call, in vLLM's self-describing payload layout.

    ``data == {"types": {name: kind}, "data": {name: {(): value}}, "info": None}``; a histogram's
    value is the list of its samples in observation order.
    """

    __slots__ = ("data",)

    def __init__(self, data: dict[str, Any] | None = None) -> None:
        self.data: dict[str, Any] = (
            data if data is not None else {"types": {}, "data": {}, "info": None}
        )

    def set_gauge(self, name: str, value: float, labelvalues: tuple[str, ...] = ()) -> None:
        """Set a gauge's current value."""
        self.data["types"].setdefault(name, "gauge")
        self.data["data"].setdefault(name, {})[labelvalues] = value

    def increase_counter(
        self, name: str, value: float = 1, labelvalues: tuple[str, ...] = ()
    ) -> None:
        """Add to a counter."""
        self.data["types"].setdefault(name, "counter")
        series = self.data["data"].setdefault(name, {})
        series[labelvalues] = series.get(labelvalues, 0) + value

    def observe_histogram(self, name: str, value: float, labelvalues: tuple[str, ...] = ()) -> None:
        """Append one sample to a histogram."""
        self.data["types"].setdefault(name, "histogram")
        self.data["data"].setdefault(name, {}).setdefault(labelvalues, []).append(value)

    def is_empty(self) -> bool:
        """True when no metric and no info is present."""
        return not self.data["data"] and self.data["info"] is None

    def reduce(self) -> dict[str, float]:
        """Summarise: gauges and counters as they are, histograms as ``_count`` and ``_sum``."""
        out: dict[str, float] = {}
        for name, series in self.data["data"].items():
            kind = self.data["types"][name]
            for labels, value in series.items():
                label = f"{name}:{labels}" if labels else name
                if kind == "histogram":
                    out[f"{label}_count"] = len(value)
                    out[f"{label}_sum"] = sum(value)
                else:
                    out[label] = value
        return out

    def __repr__(self) -> str:
        return f"OffloadingStats({self.data!r})"


ConfigInfoMapping = Mapping[str, "str | int | float | bool"]


class CPUOffloadingMetrics:
    """The metric names the manager reports."""

    STORES_SKIPPED = "vllm:kv_offload_stores_skipped"
    CPU_CACHE_USAGE_PERC = "vllm:kv_offload_cpu_cache_usage_perc"
    CPU_ALLOCATION_SIZE = "vllm:kv_offload_cpu_allocation_size"
    CPU_CACHE_WRITE_USAGE_PERC = "vllm:kv_offload_cpu_cache_write_usage_perc"
    CPU_CACHE_READ_USAGE_PERC = "vllm:kv_offload_cpu_cache_read_usage_perc"
