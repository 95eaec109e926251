"""What-if shadow policies: the live traffic replayed through other policies, keys only.

``CPUOffloadingManager(..., shadow_policies=["arc", "s3fifo"])`` runs one extra Rust manager per
named policy beside the live one. A shadow holds keys and ordering only (no memory is behind its
chunks) and sees every call the live manager completes without error:

- ``lookup`` / ``lookup_prefix``: the shadow answers for itself and counts its hits; the live
  manager's answers are counted the same way. A ``lookup_prefix`` of *n* keys that hits *h*
  counts as the ``h + 1`` single lookups a scheduler would make (``h`` when all hit);
- ``prepare_load``: the keys resident in the shadow are loaded there, and the load completes at
  once (a shadow has no transfers, so nothing stays pinned);
- ``touch``, ``on_new_request``, ``on_request_finished``, ``reset_cache``: passed on;
- ``prepare_store``: offered to the shadow, whose store completes at once.

Shadows observe: they never change the outcome of a live call. A call reaches the shadows only
after the live manager completed it, and whatever a shadow raises while following it is caught
there: the shadow skips the call (a refused call changes nothing in it) and counts it in its
``skipped_calls`` (``shadow_report()``), and the live call returns its own answer. A shadow
refuses what the live manager accepted when its cache, and so its request bookkeeping, differs (a
finished request loads or stores a key that its shadow request never recorded, because the
shadow did not hold the key when the live request used it), or when only its policy reads a
token position during the call (an ``lru`` shadow of an ``arc`` manager, given a float position:
the live manager refuses that where ARC reads it, at ``on_request_finished``, as it would without
shadows). With no call skipped a shadow's counts are exactly the what-if of the traffic; each
skipped call makes it that much less faithful.

So a shadow answers "what would the hit rate have been under policy X on the same requests", with
transfers taken as instantaneous. ``get_stats()`` reports, per policy, the keys looked up and the
keys that hit since the last report (counters ``kvoffload:shadow_lookup_keys`` and
``kvoffload:shadow_hit_keys``, labelled ``("live", policy)`` or ``("shadow", policy)``);
``shadow_report()`` gives the totals since construction. Each shadow costs about one more manager
call per call, in Rust; requests carry one extra context per shadow.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from kvoffload import _forks, _native
from kvoffload.errors import InvalidArgumentError
from kvoffload.types import LookupResult, OffloadingStats, ReqContext

__all__ = ["SHADOW_HITS", "SHADOW_LOOKUPS", "HitCounts", "ShadowSet"]

SHADOW_LOOKUPS = "kvoffload:shadow_lookup_keys"
SHADOW_HITS = "kvoffload:shadow_hit_keys"


@dataclass
class HitCounts:
    """Keys looked up and keys that hit, for one policy."""

    policy: str
    role: str  # "live" or "shadow"
    lookups: int = 0
    hits: int = 0
    #: Calls this shadow could not follow and skipped (see `kvoffload.shadow`); 0 for "live".
    skipped_calls: int = 0

    @property
    def hit_rate(self) -> float:
        """Hits per lookup (0.0 before any lookup)."""
        return self.hits / self.lookups if self.lookups else 0.0


class _ShadowContexts:
    """The shadow request contexts of one live request, kept on the live context."""

    __slots__ = ("contexts",)

    def __init__(self) -> None:
        self.contexts: dict[int, ReqContext] = {}


class _Shadow:
    def __init__(
        self, policy: str, num_chunks: int, store_threshold: int, max_tracker_size: int
    ) -> None:
        self.core = _native.ManagerCore(
            num_chunks, policy, False, store_threshold, max_tracker_size
        )
        _forks.track(self.core)
        self.total = HitCounts(policy, "shadow")
        self.since_report = HitCounts(policy, "shadow")

    def count(self, lookups: int, hits: int) -> None:
        for c in (self.total, self.since_report):
            c.lookups += lookups
            c.hits += hits


def _prefix_lookups(num_keys: int, hits: int) -> int:
    """Single lookups a scheduler makes for a prefix of ``num_keys`` keys with ``hits`` hits."""
    return hits if hits == num_keys else hits + 1


class ShadowSet:
    """The shadows of one live manager; see the module docs."""

    def __init__(
        self,
        live_policy: str,
        policies: Sequence[str],
        num_chunks: int,
        store_threshold: int,
        max_tracker_size: int,
    ) -> None:
        if isinstance(policies, str):
            raise InvalidArgumentError(
                f"shadow_policies must be a list of policy names, such as [{policies!r}], not a str"
            )
        if not all(isinstance(p, str) for p in policies):
            raise InvalidArgumentError("shadow_policies must be a list of policy names")
        self.shadows = [_Shadow(p, num_chunks, store_threshold, max_tracker_size) for p in policies]
        self.live_total = HitCounts(live_policy, "live")
        self.live_since_report = HitCounts(live_policy, "live")
        # Guards the counts and the making of shadow contexts: a manager may be called from
        # several threads, and without the GIL (or between two bytecodes with it) an unguarded
        # `+=` loses counts and a report could see hits counted before their lookups.
        self._lock = threading.Lock()

    def _contexts(self, live: Any) -> list[ReqContext]:
        """Each shadow's context for the live request context ``live`` (made on first use)."""
        with self._lock:
            holder = live.get_state(_ShadowContexts)
            if not isinstance(holder, _ShadowContexts):  # none, or not ours
                holder = _ShadowContexts()
                live.set_state(holder)
            out = []
            for i in range(len(self.shadows)):
                ctx = holder.contexts.get(i)
                if ctx is None:
                    ctx = ReqContext(req_id=str(getattr(live, "req_id", "")))
                    positions = getattr(live, "_offload_key_positions", None)
                    if isinstance(positions, dict):
                        ctx._offload_key_positions = positions  # the live request's positions
                    holder.contexts[i] = ctx
                out.append(ctx)
            return out

    def _count(self, live: tuple[int, int], shadows: Sequence[tuple[int, int] | None]) -> None:
        """Count ``(lookups, hits)`` for the live policy and for each shadow, at once.

        A shadow's None is a lookup it could not follow: counted as skipped, not as a lookup.
        """
        with self._lock:
            for c in (self.live_total, self.live_since_report):
                c.lookups += live[0]
                c.hits += live[1]
            for s, counts in zip(self.shadows, shadows, strict=True):
                if counts is None:
                    s.total.skipped_calls += 1
                else:
                    s.count(*counts)

    def _skip(self, shadows: Iterable[_Shadow]) -> None:
        """Count a call that each of ``shadows`` could not follow (it changed nothing there)."""
        with self._lock:
            for s in shadows:
                s.total.skipped_calls += 1

    def _follow(self, live_ctx: Any) -> list[ReqContext] | None:
        """The shadow contexts of ``live_ctx``; None (every shadow skips the call) if unreadable.

        The live call has just used the context, so this fails only for a context that fails
        now where it worked a moment ago; the live answer stands either way.
        """
        try:
            return self._contexts(live_ctx)
        except Exception:
            self._skip(self.shadows)
            return None

    # Every replay below catches what a shadow raises (any Exception: a shadow must not change
    # the outcome of the live call, which is done) and counts the call as skipped there. A
    # refused call changes nothing in a shadow, as in any manager.

    def lookup(self, key: bytes, live_result: Any) -> None:
        """Count a single lookup, live and in every shadow."""
        shadows: list[tuple[int, int] | None] = []
        for s in self.shadows:
            try:
                shadows.append((1, int(s.core.lookup(key) is LookupResult.HIT)))
            except Exception:
                shadows.append(None)
        self._count((1, int(live_result.name == "HIT")), shadows)

    def lookup_prefix(self, keys: Sequence[bytes], live_hits: int) -> None:
        """Count a prefix lookup, live and in every shadow."""
        shadows: list[tuple[int, int] | None] = []
        for s in self.shadows:
            try:
                hits = s.core.lookup_prefix(keys)
            except Exception:
                shadows.append(None)
                continue
            shadows.append((_prefix_lookups(len(keys), hits), hits))
        self._count((_prefix_lookups(len(keys), live_hits), live_hits), shadows)

    def _replay(
        self, call: Callable[[_Shadow, Any], object], contexts: Sequence[Any] | None = None
    ) -> None:
        """``call(shadow, context)`` in each shadow; one that raises skips the call.

        ``contexts`` holds each shadow's context (None: the call takes none; a None context: that
        shadow has no part in the call).
        """
        for i, s in enumerate(self.shadows):
            ctx = None if contexts is None else contexts[i]
            if contexts is not None and ctx is None:
                continue
            try:
                call(s, ctx)
            except Exception:
                self._skip((s,))

    def prepare_load(self, keys: Sequence[bytes], live_ctx: Any) -> None:
        """Load (and at once complete) the keys each shadow holds."""

        def load(s: _Shadow, ctx: ReqContext) -> None:
            present = s.core.resident_keys(keys)
            if present:
                # Refused (nothing pinned) when a finished request loads a key its shadow
                # request never recorded: the shadow lacked it when the live request did not.
                s.core.prepare_load(present, ctx)
                s.core.complete_load(present)

        contexts = self._follow(live_ctx)
        if contexts is not None:
            self._replay(load, contexts)

    def touch(self, keys: Sequence[bytes]) -> None:
        """Pass a touch on."""
        self._replay(lambda s, _: s.core.touch(keys))

    def prepare_store(self, keys: Sequence[bytes], live_ctx: Any) -> None:
        """Offer the keys to every shadow; its store completes at once."""

        def store(s: _Shadow, ctx: ReqContext) -> None:
            # Refused (nothing placed or evicted) for a finished request's key its shadow
            # request never recorded, or a token position only the shadow's policy reads.
            out = s.core.prepare_store(keys, ctx)
            if out is not None and out.keys_to_store:
                s.core.complete_store(out.keys_to_store, success=True)

        contexts = self._follow(live_ctx)
        if contexts is not None:
            self._replay(store, contexts)

    def on_new_request(self, live_ctx: Any) -> None:
        """Give each shadow's context its request state."""
        contexts = self._follow(live_ctx)
        if contexts is not None:
            self._replay(lambda s, ctx: s.core.on_new_request(ctx), contexts)

    def on_request_finished(self, live_ctx: Any) -> None:
        """Finish the request in every shadow that has its context."""
        try:
            holder = live_ctx.get_state(_ShadowContexts)
        except Exception:
            self._skip(self.shadows)
            return
        if isinstance(holder, _ShadowContexts):
            contexts = [holder.contexts.get(i) for i in range(len(self.shadows))]
            self._replay(lambda s, ctx: s.core.on_request_finished(ctx), contexts)

    def reset_cache(self) -> None:
        """Empty every shadow."""
        self._replay(lambda s, _: s.core.reset_cache())

    def add_stats(self, stats: OffloadingStats) -> None:
        """Add the counts since the last report to ``stats`` and restart them."""
        with self._lock:
            rows = [self.live_since_report] + [s.since_report for s in self.shadows]
            taken = [replace(c) for c in rows]
            for c in rows:
                c.lookups = c.hits = 0
        for c in taken:
            labels = (c.role, c.policy)
            stats.increase_counter(SHADOW_LOOKUPS, c.lookups, labels)
            stats.increase_counter(SHADOW_HITS, c.hits, labels)

    def report(self) -> list[HitCounts]:
        """Totals since construction (copies): the live policy first, then each shadow."""
        with self._lock:
            return [replace(c) for c in [self.live_total] + [s.total for s in self.shadows]]


def as_key_list(keys: Iterable[bytes]) -> Any:
    """``keys`` as a list, so that the shadows see what the live manager read.

    An iterator can be read once; anything that is not iterable is returned as is, for the live
    manager to reject with its own error.
    """
    if isinstance(keys, (list, tuple)):
        return keys
    try:
        return list(keys)
    except TypeError:
        return keys
