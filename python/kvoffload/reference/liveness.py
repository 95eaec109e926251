"""`PendingWrites`: the pending stores in the order they started, with their start times.

The twin of kvoffload-core's ``liveness.rs``: a FIFO with lazy deletion. Completing or failing a
store never touches the queue; an entry is live while its key still maps to the very
``ChunkStatus`` object the entry was made with and that status is pending (ref count -1). Dead
entries are dropped when they reach the front; when a batch of writes would bring the queue to
``2 * pending + SLACK`` entries, the dead ones at the front go, and if that is not enough the
whole queue is compacted. So it stays O(pending writes), at O(1) amortised per write.

The clock only moves forward: a reading below the latest one (or below 0 at the start) counts as
the latest one, so start times never decrease along the queue.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvoffload.reference.policy import ChunkStatus, require

#: Dead entries tolerated beyond the live ones before a compaction.
SLACK = 64

#: ``(start, key, status)`` of one write.
_Entry = tuple[float, bytes, ChunkStatus]


class PendingWrites:
    """Start times of the pending writes, oldest first (see the module docstring)."""

    def __init__(self, lookup: Callable[[bytes], ChunkStatus | None]) -> None:
        self._lookup = lookup  # the policy's ``get``: a resident key's status
        self._queue: deque[_Entry] = deque()
        self.now = 0.0  # the latest clock reading, in seconds
        self.expired = 0  # writes expired since the last report

    def set_now(self, now: float) -> None:
        """Move the clock to ``now`` if that is later."""
        if now > self.now:
            self.now = now

    def _is_live(self, entry: _Entry) -> bool:
        _, key, status = entry
        return status.ref_cnt == -1 and self._lookup(key) is status

    def started(self, writes: list[tuple[bytes, ChunkStatus]], num_pending: int) -> None:
        """The ``(key, status)`` writes started now (``num_pending``: pending, these included)."""
        bound = 2 * num_pending + SLACK
        if len(self._queue) + len(writes) >= bound:
            self._prune_front()  # writes mostly end in the order they started
            if len(self._queue) + len(writes) >= bound:
                self._queue = deque(e for e in self._queue if self._is_live(e))
        self._queue.extend((self.now, key, status) for key, status in writes)

    def _prune_front(self) -> None:
        while self._queue and not self._is_live(self._queue[0]):
            self._queue.popleft()

    def oldest_age(self) -> float | None:
        """The age of the oldest pending write now, or None."""
        self._prune_front()
        return self.now - self._queue[0][0] if self._queue else None

    def take_overdue(self, timeout: float) -> list[bytes]:
        """Keys of the writes older than ``timeout`` now, oldest first; counted as expired."""
        overdue = []
        self._prune_front()
        while self._queue and self.now - self._queue[0][0] > timeout:
            overdue.append(self._queue.popleft()[1])
            self._prune_front()
        self.expired += len(overdue)
        return overdue

    def clear(self) -> None:
        """Forget every write (the cache was reset); the clock and the expired count stay."""
        self._queue.clear()

    def check_invariants(self, num_pending: int) -> None:
        """One live entry per pending write, start times in order and not after the clock."""
        starts = [start for start, _, _ in self._queue]
        require(starts == sorted(starts), "pending writes out of start order")
        require(all(s <= self.now for s in starts), "a pending write starts after the clock")
        live = sum(map(self._is_live, self._queue))
        require(live == num_pending, f"{live} live entries for {num_pending} pending writes")
