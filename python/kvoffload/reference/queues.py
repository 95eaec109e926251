"""A few FIFO/LRU queues of keys with pin-aware parking, for the queue-based policies.

Every resident key belongs to one queue and is either linked in it (oldest first) or *parked*:
taken out because an eviction scan reached it while it was not ready. A parked key still counts
in its queue's length; the policy links it back once it is ready. This mirrors the Rust
``Queues`` of ``kvoffload-core`` step for step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence

from kvoffload.reference.policy import OwnPolicy

__all__ = ["QueuePolicy", "Queues"]


class Queues:
    """Named queues of keys; see the module docs."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = tuple(names)
        self.linked: dict[str, OrderedDict[bytes, None]] = {n: OrderedDict() for n in names}
        self.queue_of: dict[bytes, str] = {}
        self.parked: set[bytes] = set()
        self.lens = dict.fromkeys(names, 0)

    def insert(self, key: bytes, queue: str) -> None:
        """Add a new key at the newest end of ``queue``."""
        self.linked[queue][key] = None
        self.queue_of[key] = queue
        self.lens[queue] += 1

    def remove(self, key: bytes) -> None:
        """Drop a key, linked or parked."""
        queue = self.queue_of.pop(key)
        if key in self.parked:
            self.parked.discard(key)
        else:
            del self.linked[queue][key]
        self.lens[queue] -= 1

    def move_to(self, key: bytes, queue: str, newest: bool = True) -> None:
        """Move a key (linked or parked) to the newest or oldest end of ``queue``."""
        source = self.queue_of[key]
        if key in self.parked:
            self.parked.discard(key)
        else:
            del self.linked[source][key]
        self.lens[source] -= 1
        self.linked[queue][key] = None
        if not newest:
            self.linked[queue].move_to_end(key, last=False)
        self.queue_of[key] = queue
        self.lens[queue] += 1

    def first_candidate(
        self, queue: str, is_evictable: Callable[[bytes], bool], skip: Callable[[bytes], bool]
    ) -> bytes | None:
        """The oldest ready key of ``queue`` not skipped; the not-ready keys before it park."""
        to_park, found = [], None
        for key in self.linked[queue]:
            if not is_evictable(key):
                to_park.append(key)
            elif not skip(key):
                found = key
                break
        for key in to_park:
            del self.linked[queue][key]
            self.parked.add(key)
        return found

    def oldest(self, queue: str) -> bytes | None:
        """The oldest linked key of ``queue``, ready or not."""
        return next(iter(self.linked[queue]), None)

    def state(
        self, freq: Callable[[bytes], int]
    ) -> dict[str, list[tuple[bytes, int]] | list[tuple[bytes, str, int]]]:
        """Each queue as ``[(key, frequency)]`` oldest first; ``parked`` sorted by key."""
        out: dict[str, list[tuple[bytes, int]] | list[tuple[bytes, str, int]]] = {
            name: [(key, freq(key)) for key in self.linked[name]] for name in self.names
        }
        out["parked"] = sorted((key, self.queue_of[key], freq(key)) for key in self.parked)
        return out

    def check(self, residents: set[bytes]) -> bool:
        """Whether links, parked keys and lengths agree with ``residents``."""
        for name in self.names:
            parked = sum(1 for key in self.parked if self.queue_of[key] == name)
            if self.lens[name] != len(self.linked[name]) + parked:
                return False
        linked = {key for name in self.names for key in self.linked[name]}
        return linked | self.parked == residents == set(self.queue_of) and not linked & self.parked


class QueuePolicy(OwnPolicy):
    """Base of the queue-based policies: ``queues`` holds the residents, parked ones included.

    A parked key that is ready again re-enters at its queue's oldest end, where the scan would
    have examined it.
    """

    queues: Queues

    def _ready(self, key: bytes) -> bool:
        return self.entries[key].is_evictable

    def mark_evictable(self, key: bytes) -> None:
        """A parked key that is ready again re-enters at its queue's oldest end."""
        super().mark_evictable(key)
        if key in self.queues.parked:
            self.queues.move_to(key, self.queues.queue_of[key], newest=False)
