"""A seeded synthetic serving workload, and a replayer that drives any manager through it.

The workload is a list of requests in arrival order. Requests share prefixes the way real traffic
does: every conversation starts with one of a few system prompts (Zipf-popular), and a follow-up
turn repeats the whole earlier conversation (prompt and output) before its new user message. Keys
are 32-byte blake2b prefix-chain hashes of block contents, one key per block and KV group, so
requests that share a prefix share keys.

The replayer is a small scheduler: up to ``concurrency`` requests run at once, and each step it

1. completes the loads and stores issued in the previous step (a few stores fail);
2. admits queued requests: ``on_new_request``, a prefix lookup, and for the hit prefix
   ``prepare_load`` and ``touch`` (a request whose next key is still being stored waits a step or
   two, as vLLM's scheduler does);
3. lets every running request compute one batch of blocks and offer its keys with
   ``prepare_store`` (16 to 32 keys per call by default); a request whose blocks are all offered
   calls ``on_request_finished`` (its last stores complete in the next step, after it finished).

What happens depends on the manager's answers (hit lengths, stores refused), so the replay runs
live rather than from a fixed trace; every random choice is drawn up front, so two managers that
answer alike make exactly the same calls. Everything a call needs (keys, contexts, positions) is
built before the timed loop, each call is timed alone with ``time.perf_counter_ns`` (with the
cyclic GC paused), and every answer is folded into a digest that tells two implementations apart.
"""

from __future__ import annotations

import gc
import hashlib
import random
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvoffload.types import LookupResult, ReqContext, make_offload_key

__all__ = [
    "BLOCK_TOKENS",
    "CALL_KINDS",
    "KindStats",
    "Manager",
    "ReplayResult",
    "RequestSpec",
    "Workload",
    "WorkloadConfig",
    "generate",
    "replay",
    "timer_overhead_ns",
]

#: Tokens per block; a key's position is the end token of its block.
BLOCK_TOKENS = 16

#: The call kinds the replayer times, in table order. ``finish`` covers both ``on_new_request``
#: and ``on_request_finished``; its keys are the keys of the finished requests.
CALL_KINDS: tuple[str, ...] = (
    "lookup",
    "prepare_load",
    "complete_load",
    "prepare_store",
    "complete_store",
    "touch",
    "finish",
    "events",
)


class Manager(Protocol):
    """The part of the manager API the replayer calls (both implementations provide it)."""

    def lookup(self, key: bytes, req_context: ReqContext, /) -> LookupResult:
        """Return MISS, HIT_PENDING or HIT for one key."""

    def lookup_prefix(self, keys: Sequence[bytes], req_context: ReqContext, /) -> int:
        """Return how many leading keys are HIT."""

    def prepare_load(self, keys: Sequence[bytes], req_context: ReqContext, /) -> Any:
        """Pin readable keys for a load and return their spec."""

    def complete_load(self, keys: Sequence[bytes], req_context: ReqContext, /) -> None:
        """Unpin keys after a load."""

    def touch(self, keys: Sequence[bytes], req_context: ReqContext, /) -> None:
        """Mark keys as recently used."""

    def prepare_store(self, keys: Sequence[bytes], req_context: ReqContext, /) -> Any:
        """Allocate chunks for the absent keys of an offer, or return None."""

    def complete_store(
        self, keys: Sequence[bytes], req_context: ReqContext, /, success: bool = True
    ) -> None:
        """Finish (or, with ``success=False``, abandon) stores."""

    def on_new_request(self, req_context: ReqContext, /) -> Any:
        """Start tracking a request."""

    def on_request_finished(self, req_context: ReqContext, /) -> None:
        """Report a request's accesses to the policy."""

    def take_events(self) -> Iterable[Any]:
        """Drain the queued events."""

    def get_stats(self) -> Any:
        """Return the stats since the last call."""


@dataclass(frozen=True)
class WorkloadConfig:
    """Knobs of the synthetic workload; the defaults give a cache-churning chat mix."""

    requests: int = 2000
    seed: int = 0
    kv_groups: int = 1
    concurrency: int = 16
    system_prompts: int = 24
    system_prompt_blocks: tuple[int, int] = (8, 96)
    user_blocks: tuple[int, int] = (2, 48)
    output_blocks: tuple[int, int] = (1, 24)
    #: Chance that an arrival is the next turn of a live conversation rather than a new one.
    followup_prob: float = 0.6
    #: Chance that a conversation stays live for another turn after each turn.
    continue_prob: float = 0.75
    max_turns: int = 8
    #: Live conversations beyond this are abandoned (oldest first).
    max_live_conversations: int = 96
    #: Keys per ``prepare_store`` call (rounded down to whole blocks).
    store_batch_keys: tuple[int, int] = (16, 32)
    store_failure_prob: float = 0.02
    #: Steps a request waits when the key after its hit prefix is still being stored.
    max_pending_retries: int = 2
    #: "prefix": one ``lookup_prefix`` plus one ``lookup`` of the first key that is not a hit;
    #: "single": ``lookup`` key by key until the first key that is not a hit (vLLM's connector).
    lookup_mode: str = "prefix"


@dataclass(frozen=True)
class RequestSpec:
    """One request: its keys (block-major, one per KV group) and its pre-drawn choices."""

    req_id: str
    #: ``blocks * kv_groups`` keys; block ``b`` of group ``g`` is ``keys[b * kv_groups + g]``.
    keys: tuple[bytes, ...]
    blocks: int
    prompt_blocks: int
    #: Index of the request that must finish before this one arrives (the previous turn).
    after: int | None
    #: Blocks computed per step, consumed in order from the first block not loaded.
    batch_blocks: tuple[int, ...]
    #: Whether the n-th store the request issues fails.
    store_fails: tuple[bool, ...]


@dataclass
class Workload:
    """Generated requests plus the config that made them."""

    config: WorkloadConfig
    requests: list[RequestSpec]

    @property
    def num_keys(self) -> int:
        """Keys over all requests (a key shared by two requests counts twice)."""
        return sum(len(r.keys) for r in self.requests)

    @property
    def num_unique_keys(self) -> int:
        """Distinct keys over all requests: the working set."""
        return len({k for r in self.requests for k in r.keys})

    def make_contexts(self, context_cls: Callable[[str], Any] = ReqContext) -> list[Any]:
        """Fresh request contexts, one per request, with every key's end-token position set.

        ``context_cls`` builds them from the request id: kvoffload's ``ReqContext``, or vLLM's.
        """
        groups = self.config.kv_groups
        contexts = []
        for spec in self.requests:
            ctx = context_cls(spec.req_id)
            for i, key in enumerate(spec.keys):
                ctx.set_offload_key_position(key, (i // groups + 1) * BLOCK_TOKENS)
            contexts.append(ctx)
        return contexts


# -- generation -------------------------------------------------------------------------------

_ROOT = bytes(32)


def _chain(parent: bytes, content: bytes) -> bytes:
    """Hash a block: blake2b over the parent block's hash and this block's content."""
    return hashlib.blake2b(parent + content, digest_size=32).digest()


@dataclass
class _Conversation:
    """A conversation between turns: the block hashes so far and its last request."""

    hashes: list[bytes]
    turns: int = 0
    last_request: int = -1


def _check_config(config: WorkloadConfig) -> None:
    ranges = {
        "system_prompt_blocks": config.system_prompt_blocks,
        "user_blocks": config.user_blocks,
        "output_blocks": config.output_blocks,
        "store_batch_keys": config.store_batch_keys,
    }
    for name, (lo, hi) in ranges.items():
        if not 0 <= lo <= hi:
            raise ValueError(f"{name} must be a range 0 <= lo <= hi, got {(lo, hi)}")
    if config.user_blocks[0] < 1:
        raise ValueError("user_blocks must start at 1 or more (every prompt needs a new block)")
    if config.requests < 0 or config.kv_groups < 1 or config.concurrency < 1:
        raise ValueError("requests must be >= 0, kv_groups and concurrency >= 1")
    if config.system_prompts < 1 or config.max_turns < 1 or config.max_live_conversations < 1:
        raise ValueError("system_prompts, max_turns and max_live_conversations must be >= 1")
    if config.lookup_mode not in ("prefix", "single"):
        raise ValueError(f"lookup_mode must be 'prefix' or 'single', got {config.lookup_mode!r}")


def generate(config: WorkloadConfig) -> Workload:
    """Draw the requests of ``config``; the same config always gives the same workload."""
    _check_config(config)
    rng = random.Random(config.seed)
    groups = config.kv_groups
    # Keys are interned per block hash, so requests that share a block share the key objects.
    keys_of: dict[bytes, tuple[bytes, ...]] = {}

    def block_keys(block_hash: bytes) -> tuple[bytes, ...]:
        keys = keys_of.get(block_hash)
        if keys is None:
            keys = tuple(make_offload_key(block_hash, g) for g in range(groups))
            keys_of[block_hash] = keys
        return keys

    def extend(hashes: list[bytes], blocks: int) -> None:
        parent = hashes[-1] if hashes else _ROOT
        for _ in range(blocks):
            parent = _chain(parent, rng.randbytes(16))
            hashes.append(parent)

    system_prompts: list[list[bytes]] = []
    for p in range(config.system_prompts):
        parent, hashes = _ROOT, []
        for i in range(rng.randint(*config.system_prompt_blocks)):
            parent = _chain(parent, b"system-prompt/%d/%d" % (p, i))
            hashes.append(parent)
        system_prompts.append(hashes)
    popularity = [1.0 / (p + 1) for p in range(config.system_prompts)]  # Zipf, s = 1

    live: list[_Conversation] = []
    requests: list[RequestSpec] = []
    for idx in range(config.requests):
        if live and rng.random() < config.followup_prob:
            conv = live.pop(rng.randrange(len(live)))
        else:
            (prompt,) = rng.choices(system_prompts, weights=popularity)
            conv = _Conversation(list(prompt))
        after = conv.last_request if conv.last_request >= 0 else None
        extend(conv.hashes, rng.randint(*config.user_blocks))
        prompt_blocks = len(conv.hashes)
        extend(conv.hashes, rng.randint(*config.output_blocks))
        blocks = len(conv.hashes)
        batch_blocks: list[int] = []
        while sum(batch_blocks) < blocks:
            batch_blocks.append(max(1, rng.randint(*config.store_batch_keys) // groups))
        store_fails = tuple(rng.random() < config.store_failure_prob for _ in batch_blocks)
        requests.append(
            RequestSpec(
                req_id=f"req-{idx}",
                keys=tuple(k for h in conv.hashes for k in block_keys(h)),
                blocks=blocks,
                prompt_blocks=prompt_blocks,
                after=after,
                batch_blocks=tuple(batch_blocks),
                store_fails=store_fails,
            )
        )
        conv.turns += 1
        conv.last_request = idx
        if conv.turns < config.max_turns and rng.random() < config.continue_prob:
            live.append(conv)
            if len(live) > config.max_live_conversations:
                live.pop(0)
    return Workload(config, requests)


# -- replay -----------------------------------------------------------------------------------


@dataclass
class KindStats:
    """What one call kind cost: calls, keys passed, timed regions and nanoseconds."""

    calls: int = 0
    keys: int = 0
    timings: int = 0
    ns: int = 0

    def net_ns(self, overhead_ns: int) -> int:
        """Nanoseconds less the timer's own cost per timed region (never below 0)."""
        return max(0, self.ns - self.timings * overhead_ns)


@dataclass
class ReplayResult:
    """Timings, counts and the answer digest of one replay."""

    kinds: dict[str, KindStats]
    timer_overhead_ns: int
    lookup_keys: int = 0
    hit_keys: int = 0
    loaded_keys: int = 0
    stored_keys: int = 0
    evicted_keys: int = 0
    refused_stores: int = 0
    failed_stores: int = 0
    pending_waits: int = 0
    steps: int = 0
    wall_s: float = 0.0
    digest: str = ""
    #: The running digest after each step, to find the first step where two replays differ.
    step_digests: list[bytes] = field(default_factory=list, repr=False)
    #: Manager nanoseconds in each step (all timed calls of the step; timer cost included).
    step_ns: list[int] = field(default_factory=list, repr=False)

    @property
    def hit_rate(self) -> float:
        """HIT keys over looked-up keys, over the final lookup of every request."""
        return self.hit_keys / self.lookup_keys if self.lookup_keys else 0.0

    def ns_per_key(self, kind: str) -> float | None:
        """Net nanoseconds per key of one call kind (None when it passed no keys)."""
        s = self.kinds[kind]
        return s.net_ns(self.timer_overhead_ns) / s.keys if s.keys else None

    @property
    def total_ns(self) -> int:
        """Net nanoseconds spent in the manager over all call kinds."""
        return sum(s.net_ns(self.timer_overhead_ns) for s in self.kinds.values())

    @property
    def total_keys(self) -> int:
        """Keys passed over all call kinds."""
        return sum(s.keys for s in self.kinds.values())

    @property
    def total_ns_per_key(self) -> float | None:
        """Net manager nanoseconds per key passed, over all call kinds."""
        return self.total_ns / self.total_keys if self.total_keys else None

    def to_json(self) -> dict[str, Any]:
        """Return a JSON-ready summary (no per-step digests)."""
        return {
            "hit_rate": self.hit_rate,
            "lookup_keys": self.lookup_keys,
            "hit_keys": self.hit_keys,
            "loaded_keys": self.loaded_keys,
            "stored_keys": self.stored_keys,
            "evicted_keys": self.evicted_keys,
            "refused_stores": self.refused_stores,
            "failed_stores": self.failed_stores,
            "pending_waits": self.pending_waits,
            "steps": self.steps,
            "wall_s": self.wall_s,
            "timer_overhead_ns": self.timer_overhead_ns,
            "total_ns": self.total_ns,
            "total_keys": self.total_keys,
            "total_ns_per_key": self.total_ns_per_key,
            "digest": self.digest,
            "kinds": {
                kind: {
                    "calls": s.calls,
                    "keys": s.keys,
                    "ns": s.net_ns(self.timer_overhead_ns),
                    "ns_per_key": self.ns_per_key(kind),
                }
                for kind, s in self.kinds.items()
            },
        }

    def same_answers(self, other: ReplayResult) -> bool:
        """Tell whether both replays got the same answers to the same calls."""
        return self.digest == other.digest and self.hit_keys == other.hit_keys

    def first_divergent_step(self, other: ReplayResult) -> int | None:
        """Return the first step after which the two replays' digests differ, or None."""
        for step, (a, b) in enumerate(zip(self.step_digests, other.step_digests, strict=False)):
            if a != b:
                return step
        if len(self.step_digests) != len(other.step_digests):
            return min(len(self.step_digests), len(other.step_digests))
        return None


def timer_overhead_ns(samples: int = 20_000) -> int:
    """Measure one empty ``perf_counter_ns`` pair (median), the cost of a timed region."""
    clock = time.perf_counter_ns
    deltas = []
    for _ in range(samples):
        t0 = clock()
        t1 = clock()
        deltas.append(t1 - t0)
    deltas.sort()
    return deltas[len(deltas) // 2]


@dataclass
class _Running:
    """A request between admission and finish."""

    idx: int
    spec: RequestSpec
    ctx: ReqContext
    retries: int = 0
    next_block: int = 0
    batch: int = 0
    #: The step whose completions include this request's load; it computes from the step after.
    load_step: int = -1


def replay(
    manager: Manager,
    workload: Workload,
    *,
    drain_events: bool = False,
    progress: Callable[[int], object] | None = None,
    lookup_result: Any = LookupResult,
    context_cls: Callable[[str], Any] = ReqContext,
) -> ReplayResult:
    """Drive ``manager`` through ``workload``, timing each call; see the module docstring.

    ``drain_events`` calls ``take_events`` once per step (for managers built with events on).
    ``progress`` is called with the number of requests finished in each step. ``lookup_result``
    is the enum the manager answers lookups with and ``context_cls`` builds the request contexts
    (kvoffload's by default; vLLM's to drive a manager inside vLLM's types).
    """
    cfg = workload.config
    specs = workload.requests
    groups = cfg.kv_groups
    contexts = workload.make_contexts(context_cls)
    kinds = {kind: KindStats() for kind in CALL_KINDS}
    s_lookup, s_pload, s_cload = kinds["lookup"], kinds["prepare_load"], kinds["complete_load"]
    s_pstore, s_cstore, s_touch = kinds["prepare_store"], kinds["complete_store"], kinds["touch"]
    s_finish, s_events = kinds["finish"], kinds["events"]
    result = ReplayResult(kinds=kinds, timer_overhead_ns=timer_overhead_ns())
    digest = hashlib.blake2b(digest_size=16)

    clock = time.perf_counter_ns
    # vLLM's own manager has no lookup_prefix; "single" lookup mode never calls it.
    lookup, lookup_prefix = manager.lookup, getattr(manager, "lookup_prefix", None)
    prepare_load, complete_load = manager.prepare_load, manager.complete_load
    prepare_store, complete_store = manager.prepare_store, manager.complete_store
    touch, take_events = manager.touch, manager.take_events
    on_new_request, on_request_finished = manager.on_new_request, manager.on_request_finished
    hit, hit_pending = lookup_result.HIT, lookup_result.HIT_PENDING
    all_kinds = tuple(kinds.values())
    single = cfg.lookup_mode == "single"

    queue = deque(range(len(specs)))
    finished = [False] * len(specs)
    waiting: list[_Running] = []
    running: list[_Running] = []
    loads_due: list[tuple[Any, tuple[bytes, ...]]] = []
    stores_due: list[tuple[Any, list[bytes], bool]] = []

    def admit(run: _Running, step: int) -> None:
        """Look up the prompt; load and touch its hit prefix, or wait on a pending key."""
        keys = run.spec.keys[: run.spec.prompt_blocks * groups]
        ctx = run.ctx
        if single:
            n_hit = 0
            answer = hit
            t0 = clock()
            for key in keys:
                answer = lookup(key, ctx)
                if answer is not hit:
                    break
                n_hit += 1
            t1 = clock()
            looked = n_hit + (n_hit < len(keys))
            s_lookup.calls += looked
            s_lookup.keys += looked
        else:
            assert lookup_prefix is not None, "lookup_mode='prefix' needs a lookup_prefix method"
            t0 = clock()
            n_hit = lookup_prefix(keys, ctx)
            answer = hit
            if n_hit < len(keys):
                answer = lookup(keys[n_hit], ctx)
            t1 = clock()
            s_lookup.calls += 1 + (n_hit < len(keys))
            s_lookup.keys += len(keys) + (n_hit < len(keys))
        s_lookup.ns += t1 - t0
        s_lookup.timings += 1
        digest.update(b"L%d:%s;" % (n_hit, answer.name.encode()))
        if answer is hit_pending and run.retries < cfg.max_pending_retries:
            run.retries += 1
            result.pending_waits += 1
            waiting.append(run)
            return
        result.lookup_keys += len(keys)
        result.hit_keys += n_hit
        hit_blocks = min(n_hit // groups, run.spec.prompt_blocks - 1)
        if hit_blocks > 0:
            load_keys = keys[: hit_blocks * groups]
            t0 = clock()
            spec = prepare_load(load_keys, ctx)
            t1 = clock()
            touch(load_keys, ctx)
            t2 = clock()
            s_pload.ns += t1 - t0
            s_touch.ns += t2 - t1
            for s in (s_pload, s_touch):
                s.calls += 1
                s.keys += len(load_keys)
                s.timings += 1
            digest.update(spec.block_ids.tobytes())
            loads_due.append((ctx, load_keys))
            result.loaded_keys += len(load_keys)
            run.load_step = step
        run.next_block = hit_blocks
        running.append(run)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    started = time.perf_counter()
    step = 0
    try:
        while queue or waiting or running or loads_due or stores_due:
            step_start_ns = sum(k.ns for k in all_kinds)
            # 1. Completions of the transfers issued in the previous step, in issue order.
            for ctx, keys in loads_due:
                t0 = clock()
                complete_load(keys, ctx)
                s_cload.ns += clock() - t0
                s_cload.calls += 1
                s_cload.keys += len(keys)
                s_cload.timings += 1
            for ctx, store_keys, ok in stores_due:
                if ok:
                    t0 = clock()
                    complete_store(store_keys, ctx)
                    t1 = clock()
                else:
                    t0 = clock()
                    complete_store(store_keys, ctx, success=False)
                    t1 = clock()
                    result.failed_stores += 1
                s_cstore.ns += t1 - t0
                s_cstore.calls += 1
                s_cstore.keys += len(store_keys)
                s_cstore.timings += 1
            loads_due.clear()
            stores_due.clear()

            # 2. Admissions: requests waiting on a pending key first, then new arrivals.
            retry, waiting = waiting, []
            for run in retry:
                admit(run, step)
            scan = 0
            while len(running) + len(waiting) < cfg.concurrency and scan < len(queue):
                idx = queue[scan]
                after = specs[idx].after
                if after is not None and not finished[after]:
                    scan += 1  # its previous turn has not finished yet
                    continue
                del queue[scan]
                run = _Running(idx, specs[idx], contexts[idx])
                t0 = clock()
                on_new_request(run.ctx)
                s_finish.ns += clock() - t0
                s_finish.calls += 1
                s_finish.timings += 1
                admit(run, step)

            # 3. Compute: every running request offers one batch of blocks.
            still_running = []
            done = 0
            for run in running:
                if run.load_step == step:
                    still_running.append(run)  # computes once its load has completed
                    continue
                spec, ctx = run.spec, run.ctx
                lo = run.next_block
                hi = min(lo + spec.batch_blocks[run.batch], spec.blocks)
                batch = spec.keys[lo * groups : hi * groups]
                t0 = clock()
                out = prepare_store(batch, ctx)
                s_pstore.ns += clock() - t0
                s_pstore.calls += 1
                s_pstore.keys += len(batch)
                s_pstore.timings += 1
                if out is None:
                    result.refused_stores += 1
                    digest.update(b"N;")
                else:
                    to_store, evicted = out.keys_to_store, out.evicted_keys
                    digest.update(b"S%d:%d;" % (len(to_store), len(evicted)))
                    digest.update(b"".join(to_store))
                    digest.update(b"".join(evicted))
                    digest.update(out.store_spec.block_ids.tobytes())
                    result.evicted_keys += len(evicted)
                    if to_store:
                        stores_due.append((ctx, to_store, not spec.store_fails[run.batch]))
                        result.stored_keys += len(to_store)
                run.batch += 1
                run.next_block = hi
                if hi < spec.blocks:
                    still_running.append(run)
                    continue
                t0 = clock()
                on_request_finished(ctx)
                s_finish.ns += clock() - t0
                s_finish.calls += 1
                s_finish.keys += len(spec.keys)
                s_finish.timings += 1
                finished[run.idx] = True
                done += 1
            running = still_running

            if drain_events:
                t0 = clock()
                events = list(take_events())
                s_events.ns += clock() - t0
                s_events.calls += 1
                s_events.timings += 1
                for ev in events:
                    s_events.keys += len(ev.keys)
                    digest.update(b"E%d%d%d;" % (ev.removed, ev.metadata_only, len(ev.keys)))
                    digest.update(b"".join(ev.keys))
            result.step_digests.append(digest.digest())
            result.step_ns.append(sum(k.ns for k in all_kinds) - step_start_ns)
            step += 1
            if progress is not None and done:
                progress(done)
    finally:
        result.wall_s = time.perf_counter() - started
        if gc_was_enabled:
            gc.enable()
    digest.update(repr(manager.get_stats().data).encode())
    result.steps = step
    result.digest = digest.hexdigest()
    return result
