"""What both managers share about pending-write liveness: argument checks, clock readings, stats.

A write is pending from ``prepare_store`` until ``complete_store``. Both managers keep the
pending writes oldest first, report the oldest one's age, and with ``pending_write_timeout`` set
end each write older than that (``now - start > timeout``) as ``complete_store(keys,
success=False)`` would, at the start of every ``prepare_store`` and on
``expire_pending_writes()``. Times are seconds on a monotonic clock (``time.monotonic`` or the
Rust manager's ``Instant``), or on an injected ``clock``; a reading earlier than the latest one
counts as the latest one.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable

from kvoffload.errors import InvalidArgumentError
from kvoffload.types import OffloadingStats

#: Gauges and counter ``get_stats()`` adds when ``pending_write_timeout`` is set (kvoffload's
#: types only: vLLM's Prometheus code declares only its own metric names).
PENDING_WRITES = "kvoffload:pending_writes"
OLDEST_PENDING_WRITE_AGE = "kvoffload:oldest_pending_write_age_seconds"
EXPIRED_WRITES = "kvoffload:expired_writes"


def _seconds(value: object, label: str) -> float:
    """``value`` (an int or float, not a bool) as a float >= 0; a huge int is infinite."""
    if not isinstance(value, (int, float)) or isinstance(value, bool):
        raise InvalidArgumentError(f"{label} must be a number, got {type(value).__name__}")
    try:
        seconds = float(value)
    except OverflowError:
        seconds = math.inf if value > 0 else -math.inf
    if not seconds >= 0.0:
        raise InvalidArgumentError(f"{label} must be >= 0, got {seconds}")
    return seconds


def check_pending_write_timeout(timeout: object) -> float | None:
    """``timeout`` as a float: None (no expiry), or a number >= 0 (``math.inf``: never)."""
    return None if timeout is None else _seconds(timeout, "pending_write_timeout")


def check_clock(clock: object) -> None:
    """Reject a ``clock`` that is neither None nor callable."""
    if clock is not None and not callable(clock):
        raise InvalidArgumentError(
            f"clock must be a callable returning seconds, got {type(clock).__name__}"
        )


def read_clock(clock: Callable[[], float]) -> float:
    """One reading of ``clock``, which must be a finite int or float."""
    value = clock()
    seconds = math.nan
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        with contextlib.suppress(OverflowError):
            seconds = float(value)
    if not math.isfinite(seconds):
        raise InvalidArgumentError(f"clock must return a finite int or float, got {value!r}")
    return seconds


def timeout_for(timeout: object, configured: float | None) -> float:
    """The timeout of an explicit expiry: ``timeout`` if given, else the manager's."""
    if timeout is not None:
        return _seconds(timeout, "timeout")
    if configured is None:
        raise InvalidArgumentError(
            "no timeout: pass one, or build the manager with pending_write_timeout"
        )
    return configured


def add_liveness_stats(
    stats: OffloadingStats, pending: int, oldest_age: float | None, expired: int
) -> None:
    """Add the pending-write gauges (age 0.0 when none is pending) and the expired counter."""
    stats.set_gauge(PENDING_WRITES, pending)
    stats.set_gauge(OLDEST_PENDING_WRITE_AGE, 0.0 if oldest_age is None else oldest_age)
    stats.increase_counter(EXPIRED_WRITES, expired)
