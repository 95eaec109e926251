"""Pieces both managers share: policy-name resolution, stats assembly, config info, events."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from kvoffload.errors import InvalidArgumentError, UnsupportedPolicyError
from kvoffload.policies import CachePolicyFactory
from kvoffload.types import CPUOffloadingMetrics, Medium, OffloadingEvent, OffloadingStats

#: The policies built into kvoffload; a registered name wins over a module path.
BUILTIN_POLICIES: tuple[str, ...] = (
    "lru",
    "arc",
    "fifo",
    "sieve",
    "s3fifo",
    "2q",
    "slru",
    "lfu",
    "arc-paper",
)


def resolve_policy(name: str, module_path: str | None) -> str | type:
    """Return a built-in policy name, or the policy class `CachePolicyFactory` resolves."""
    if not isinstance(name, str):
        raise UnsupportedPolicyError(f"cache_policy must be a str, got {type(name).__name__}")
    if name in BUILTIN_POLICIES:
        return name
    return CachePolicyFactory.get_cache_policy_cls(name, module_path)


#: What can count offers for ``store_threshold``: vLLM's bounded tracker, or a TinyLFU sketch.
ADMISSIONS: tuple[str, ...] = ("tracker", "tinylfu")


MAX_SKETCH_WIDTH = 2**30
"""The most counters a TinyLFU sketch row may have (``max_tracker_size`` with ``tinylfu``)."""


def check_admission(admission: object, store_threshold: int, max_tracker_size: int) -> None:
    """Reject an ``admission`` that is not one of ADMISSIONS, or a TinyLFU sketch too wide."""
    if admission not in ADMISSIONS:
        raise InvalidArgumentError(
            f"admission must be one of {list(ADMISSIONS)}, got {admission!r}"
        )
    if admission == "tinylfu" and store_threshold >= 2 and max_tracker_size > MAX_SKETCH_WIDTH:
        raise InvalidArgumentError(
            "a TinyLFU sketch has at most 2**30 counters per row (max_tracker_size), "
            f"got {max_tracker_size}"
        )


def check_constructor_args(
    num_chunks: object, store_threshold: object, max_tracker_size: object
) -> None:
    """Reject the constructor values kvoffload treats as illegal (vLLM accepts them silently)."""
    for label, value in (
        ("num_chunks", num_chunks),
        ("store_threshold", store_threshold),
        ("max_tracker_size", max_tracker_size),
    ):
        if isinstance(value, bool) or not isinstance(value, int):
            raise InvalidArgumentError(f"{label} must be an int, got {type(value).__name__}")
    assert isinstance(num_chunks, int)
    assert isinstance(store_threshold, int)
    assert isinstance(max_tracker_size, int)
    if num_chunks < 0:
        raise InvalidArgumentError(f"num_chunks must be >= 0, got {num_chunks}")
    if num_chunks > 2**31 - 1:
        raise InvalidArgumentError(f"num_chunks must fit an int32 chunk id, got {num_chunks}")
    if store_threshold < 0:
        raise InvalidArgumentError(f"store_threshold must be >= 0, got {store_threshold}")
    for label, value in (
        ("store_threshold", store_threshold),
        ("max_tracker_size", max_tracker_size),
    ):
        if not -(2**63) <= value < 2**63:
            raise InvalidArgumentError(f"{label} must fit a signed 64-bit int, got {value}")
    if store_threshold >= 2 and max_tracker_size < 1:
        raise InvalidArgumentError(
            f"max_tracker_size must be >= 1 when store_threshold >= 2, got {max_tracker_size}"
        )


CONTEXT_METHODS = ("get_state", "set_state", "get_offload_key_position")


def check_context(req_context: object) -> None:
    """Reject a request context that lacks the methods of vLLM's ``ReqContext``."""
    missing = [name for name in CONTEXT_METHODS if not callable(getattr(req_context, name, None))]
    if missing:
        raise InvalidArgumentError(
            f"req_context must be a ReqContext (or have {', '.join(CONTEXT_METHODS)}); "
            f"{type(req_context).__name__} lacks {', '.join(missing)}"
        )


def check_distinct(option: str, names: Sequence[str]) -> None:
    """Refuse ``names`` (of command-line ``option``) naming one thing twice."""
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise InvalidArgumentError(f"{option} names {', '.join(repeated)} more than once")


def arc_target(value: object, num_chunks: int) -> float:
    """A target size for ARC's T1 (``_debug_set_arc_target``): a number in ``[0, num_chunks]``."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        raise InvalidArgumentError(f"ARC target must be a number, got {type(value).__name__}")
    target = float(value)
    if not 0.0 <= target <= num_chunks:  # NaN fails too
        raise InvalidArgumentError(f"ARC target must lie in [0, {num_chunks}], got {value!r}")
    return target


def config_info_of(info: object) -> dict[str, Any]:
    """One mapping of ``info``'s fields, with None values shown as the string "None"."""
    if info is None:
        return {}
    if hasattr(info, "as_config_info"):
        return dict(info.as_config_info())
    if dataclasses.is_dataclass(info) and not isinstance(info, type):
        items = {f.name: getattr(info, f.name) for f in dataclasses.fields(info)}
    elif isinstance(info, Mapping):
        items = dict(info)
    else:
        raise InvalidArgumentError(
            f"info must be a dataclass, a mapping or have as_config_info(), "
            f"got {type(info).__name__}"
        )
    return {k: "None" if v is None else v for k, v in items.items()}


def build_stats(
    num_chunks: int,
    num_used: int,
    num_pending: int,
    allocation_sizes: list[int],
    stores_skipped: int | None,
    stats_cls: Callable[[], OffloadingStats] = OffloadingStats,
) -> OffloadingStats:
    """Assemble the stats payload in vLLM's metric order from the manager's raw counters.

    ``stats_cls`` builds the payload: kvoffload's ``OffloadingStats``, or vLLM's
    ``OffloadingConnectorStats`` (the same ``set_gauge``/``observe_histogram``/
    ``increase_counter`` calls).
    """
    usage = num_used / num_chunks if num_chunks > 0 else 0.0
    write_usage = num_pending / num_chunks if num_chunks > 0 else 0.0
    read_usage = max(usage - write_usage, 0.0)
    if stats_cls is OffloadingStats:
        return _own_stats(usage, allocation_sizes, write_usage, read_usage, stores_skipped)
    stats = stats_cls()
    stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC, usage)
    for size in allocation_sizes:
        stats.observe_histogram(CPUOffloadingMetrics.CPU_ALLOCATION_SIZE, size)
    stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC, write_usage)
    stats.set_gauge(CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC, read_usage)
    if stores_skipped is not None:
        stats.increase_counter(CPUOffloadingMetrics.STORES_SKIPPED, stores_skipped)
    return stats


_USAGE = CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
_ALLOC = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
_WRITE = CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC
_READ = CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC
_SKIPPED = CPUOffloadingMetrics.STORES_SKIPPED
#: The ``types`` entry of kvoffload's own payload, by (histogram samples?, skip counter?).
_KINDS: dict[tuple[bool, bool], dict[str, str]] = {
    (samples, counter): {
        _USAGE: "gauge",
        **({_ALLOC: "histogram"} if samples else {}),
        _WRITE: "gauge",
        _READ: "gauge",
        **({_SKIPPED: "counter"} if counter else {}),
    }
    for samples in (False, True)
    for counter in (False, True)
}


def _own_stats(
    usage: float,
    allocation_sizes: list[int],
    write_usage: float,
    read_usage: float,
    stores_skipped: int | None,
) -> OffloadingStats:
    """:func:`build_stats` for kvoffload's own ``OffloadingStats``.

    The payload its metric calls make (same entries, same order), written out at once instead of
    call by call, which took most of a ``get_stats``.
    """
    counter = stores_skipped is not None
    if allocation_sizes:
        data = {
            _USAGE: {(): usage},
            _ALLOC: {(): list(allocation_sizes)},
            _WRITE: {(): write_usage},
            _READ: {(): read_usage},
        }
    else:
        data = {_USAGE: {(): usage}, _WRITE: {(): write_usage}, _READ: {(): read_usage}}
    if counter:
        data[_SKIPPED] = {(): stores_skipped}
    kinds = _KINDS[bool(allocation_sizes), counter].copy()
    return OffloadingStats({"types": kinds, "data": data, "info": None})


def stored_event(keys: list[bytes]) -> OffloadingEvent:
    """A "stored" event for ``keys``."""
    return OffloadingEvent(keys=keys, medium=Medium.CPU, removed=False)


def removed_event(keys: list[bytes], *, metadata_only: bool) -> OffloadingEvent:
    """A removal event for ``keys`` (``metadata_only`` for the cleanup of a failed store)."""
    return OffloadingEvent(keys=keys, medium=Medium.CPU, removed=True, metadata_only=metadata_only)
