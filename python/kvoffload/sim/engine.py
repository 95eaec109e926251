"""Serving mode: a discrete-event model of a scheduler driving the real manager.

Simulated time only orders events; the manager runs for real. A request's life:

1. **arrive**: it joins the waiting queue; up to ``max_running`` requests are in flight.
2. **admit**: ``on_new_request``, ``lookup_prefix`` over the prompt's keys and ``lookup`` of the
   first key that is not a hit. If that key is still being stored (HIT_PENDING) the request waits
   ``pending_retry_s`` and looks up again (at most ``max_pending_retries`` times), as vLLM's
   scheduler waits for an in-flight store. Otherwise the hit prefix, rounded down to whole token
   positions of every KV group and short of the prompt's last block (one token must be computed),
   is pinned with ``prepare_load`` and ``touch``-ed.
3. **load done** after the transfer latency: ``complete_load``; prefill starts.
4. **prefill done** after ``new tokens / prefill_tokens_per_s``: the computed prompt blocks are
   offered with ``prepare_store`` in batches of ``store_batch_keys`` keys; each store completes
   (``complete_store``, failing with probability ``store_failure_prob``) after its transfer
   latency, so its chunks stay pending meanwhile.
5. **decode done** after ``output_tokens / decode_tokens_per_s``: the full output blocks are
   offered the same way, then ``on_request_finished``; its stores may complete after it finished.

A transfer of ``n`` chunks takes ``transfer_latency_s + n * chunk_bytes / transfer_bytes_per_s``;
transfers do not contend. Every manager call is timed alone (``perf_counter_ns``, GC paused).
"""

from __future__ import annotations

import gc
import heapq
import math
import random
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvoffload._common import BUILTIN_POLICIES, resolve_policy
from kvoffload.errors import InvalidArgumentError, UnsupportedPolicyError
from kvoffload.sim.model import DEFAULT_BLOCK_TOKENS, RequestKeys, SimRequest
from kvoffload.sim.results import SIM_CALL_KINDS, SimResult
from kvoffload.sim.traces import ObjectTrace
from kvoffload.types import LookupResult, ReqContext
from kvoffload.workload import KindStats, timer_overhead_ns

__all__ = ["SimConfig", "make_manager", "manager_class", "require_lookups", "run_serving"]

#: The most chunks kvoffload's managers hold (chunk ids are int32).
MAX_CHUNKS = 2**31 - 1

#: The manager calls both modes make (serving mode also makes ``lookup_prefix``, the loads and
#: ``get_stats``); an ``impl`` class without them is refused up front.
MANAGER_CALLS: tuple[str, ...] = (
    "on_new_request",
    "lookup",
    "touch",
    "prepare_store",
    "complete_store",
    "on_request_finished",
)


@dataclass(frozen=True)
class SimConfig:
    """The manager and the scheduler model (defaults: a Llama-3-8B-like model over PCIe)."""

    num_chunks: int = 8192
    policy: str = "lru"
    impl: str = "rust"
    cache_policy_module_path: str | None = None
    store_threshold: int = 1
    block_tokens: int = DEFAULT_BLOCK_TOKENS
    max_running: int = 32
    #: Bytes of one chunk: 16 tokens x 128 KiB of KV per token (32 layers, 8 KV heads, fp16).
    chunk_bytes: int = 16 * 128 * 1024
    transfer_bytes_per_s: float = 25e9
    transfer_latency_s: float = 20e-6
    prefill_tokens_per_s: float = 20_000.0
    decode_tokens_per_s: float = 50.0
    store_batch_keys: int = 32
    store_failure_prob: float = 0.0
    pending_retry_s: float = 0.002
    max_pending_retries: int = 2
    seed: int = 0
    check_invariants: bool = True
    #: What-if policies run beside the live one on the same traffic (kvoffload's Rust manager).
    shadow_policies: tuple[str, ...] = ()

    def validate(self) -> None:
        """Raise InvalidArgumentError on a value the model cannot run with.

        The manager class ``impl`` names is imported, and with kvoffload's managers the policy
        is resolved (its module imported), so that a bad name fails here, not in a worker.
        """
        if self.num_chunks < 0 or self.max_running < 1 or self.block_tokens < 1:
            raise InvalidArgumentError("num_chunks >= 0, max_running >= 1, block_tokens >= 1")
        if self.store_threshold < 0:
            raise InvalidArgumentError(
                "store_threshold must be >= 0 (0 and 1 store every offer), "
                f"got {self.store_threshold}"
            )
        if self.store_batch_keys < 1 or not 0.0 <= self.store_failure_prob <= 1.0:
            raise InvalidArgumentError("store_batch_keys >= 1, 0 <= store_failure_prob <= 1")
        rates = (self.transfer_bytes_per_s, self.prefill_tokens_per_s, self.decode_tokens_per_s)
        if not all(rate > 0 for rate in rates):  # NaN is not > 0 either
            raise InvalidArgumentError(
                f"transfer, prefill and decode rates must be > 0, got {', '.join(map(str, rates))}"
            )
        if self.chunk_bytes < 1:
            raise InvalidArgumentError(f"chunk_bytes must be >= 1, got {self.chunk_bytes}")
        delays = (self.transfer_latency_s, self.pending_retry_s)
        if not all(math.isfinite(d) and d >= 0 for d in delays):
            raise InvalidArgumentError(
                "transfer_latency_s and pending_retry_s must be finite and >= 0, got "
                f"{', '.join(map(str, delays))}"
            )
        if self.max_pending_retries < 0:
            raise InvalidArgumentError(
                f"max_pending_retries must be >= 0, got {self.max_pending_retries}"
            )
        if isinstance(self.shadow_policies, str):
            raise InvalidArgumentError(
                "shadow_policies must be a tuple of policy names, such as ('arc',), not a str"
            )
        from kvoffload.manager import CPUOffloadingManager
        from kvoffload.reference import CPUOffloadingManager as ReferenceManager

        cls = manager_class(self.impl)
        if self.shadow_policies and not issubclass(cls, CPUOffloadingManager):
            raise InvalidArgumentError(
                "what-if shadows run beside kvoffload's Rust manager only (impl 'rust'), "
                f"not {self.impl!r}"
            )
        unknown = [p for p in self.shadow_policies if p not in BUILTIN_POLICIES]
        if unknown:
            raise InvalidArgumentError(
                f"shadow policies must be built in ({', '.join(BUILTIN_POLICIES)}), got "
                f"{', '.join(map(repr, unknown))}"
            )
        if issubclass(cls, CPUOffloadingManager | ReferenceManager):
            if self.num_chunks > MAX_CHUNKS:
                raise InvalidArgumentError(
                    f"num_chunks must fit an int32 chunk id (<= {MAX_CHUNKS:,}), "
                    f"got {self.num_chunks:,}"
                )
            try:
                resolve_policy(self.policy, self.cache_policy_module_path)
            except UnsupportedPolicyError as e:
                if not isinstance(e.__cause__, ModuleNotFoundError):
                    raise
                raise UnsupportedPolicyError(
                    f"{e}; kvoffload sim looks for it in the current folder and on the Python path"
                ) from e.__cause__


def manager_class(impl: str) -> type:
    """The manager class ``impl`` names: ``rust``, ``reference`` or ``module:Class``.

    Raises InvalidArgumentError when it cannot be imported or lacks a call the simulator makes.
    """
    from kvoffload.bench import load_implementation  # the names of ``kvoffload bench --impls``

    try:
        cls = load_implementation(impl)
    except ImportError as e:
        raise InvalidArgumentError(f"impl {impl!r}: cannot import it ({e})") from None
    except ValueError as e:
        raise InvalidArgumentError(f"{e}, or module:Class") from None
    except (AttributeError, TypeError) as e:
        raise InvalidArgumentError(f"impl {impl!r}: {e}") from None
    missing = [name for name in MANAGER_CALLS if not callable(getattr(cls, name, None))]
    if missing:
        raise InvalidArgumentError(
            f"impl {impl!r}: {cls.__qualname__} is not a manager class (it lacks "
            f"{', '.join(missing)})"
        )
    return cls


def require_lookups(workload: Sequence[SimRequest] | ObjectTrace) -> None:
    """Refuse a workload that looks nothing up: its hit and miss ratios would be 0 / 0.

    That is an empty trace or ``requests=0``, an object trace whose records all have size 0
    (skipped when read), or requests whose prompts have no block.
    """
    if not len(workload):
        skipped = (
            " (oracleGeneral records of size 0 are skipped)"
            if isinstance(workload, ObjectTrace)
            else ""
        )
        raise InvalidArgumentError(
            f"the workload has no requests{skipped}: hit and miss ratios over no lookup are "
            "undefined"
        )
    if not isinstance(workload, ObjectTrace) and not any(r.prompt_blocks() for r in workload):
        raise InvalidArgumentError(
            "no request of the workload has a prompt block: hit and miss ratios over no lookup "
            "are undefined"
        )


def make_manager(cfg: SimConfig) -> Any:
    """Build the manager ``cfg`` names (impl ``rust``, ``reference`` or ``module:Class``)."""
    cls = manager_class(cfg.impl)
    extra: dict[str, Any] = {}
    if cfg.shadow_policies:
        extra["shadow_policies"] = list(cfg.shadow_policies)
    return cls(
        cfg.num_chunks,
        cache_policy=cfg.policy,
        cache_policy_module_path=cfg.cache_policy_module_path,
        store_threshold=cfg.store_threshold,
        **extra,
    )


def shadow_hit_rates(manager: Any) -> dict[str, float]:
    """Each shadow policy's hit rate on the run's traffic (empty without shadows)."""
    report = getattr(manager, "shadow_report", None)
    if report is None:
        return {}
    return {c.policy: c.hit_rate for c in report() if c.role == "shadow"}


@dataclass
class _Req:
    """A request in flight."""

    spec: SimRequest
    keys: RequestKeys
    ctx: ReqContext
    retries: int = 0
    hit_tokens: int = 0
    loaded: tuple[bytes, ...] = ()


# Event kinds, in the order they run at equal times (then by sequence number).
_ARRIVE, _LOAD_DONE, _STORE_DONE, _PREFILL_DONE, _DECODE_DONE, _RETRY = range(6)


def run_serving(
    requests: Sequence[SimRequest],
    config: SimConfig | None = None,
    *,
    workload: str = "custom",
    progress: Callable[[int], object] | None = None,
    manager: Any = None,
) -> SimResult:
    """Replay ``requests`` through a fresh manager built from ``config``; see the module doc.

    ``manager`` replaces the fresh manager (its own policy and size rule); ``progress`` is called
    with 1 per finished request.
    """
    cfg = config or SimConfig()
    cfg.validate()
    require_lookups(requests)
    if manager is None:
        manager = make_manager(cfg)
    rng = random.Random(cfg.seed)
    bt = cfg.block_tokens
    calls = {kind: KindStats() for kind in SIM_CALL_KINDS}
    res = SimResult(
        mode="serving",
        workload=workload,
        policy=cfg.policy,
        impl=cfg.impl,
        num_chunks=cfg.num_chunks,
        chunk_bytes=cfg.chunk_bytes,
        calls=calls,
        timer_overhead_ns=timer_overhead_ns(5000),
    )
    clock = time.perf_counter_ns
    events: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(at: float, kind: int, payload: Any) -> None:
        nonlocal seq
        heapq.heappush(events, (at, kind, seq, payload))
        seq += 1

    def timed(kind: str, n_keys: int, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        t0 = clock()
        out = fn(*args, **kw)
        s = calls[kind]
        s.ns += clock() - t0
        s.calls += 1
        s.keys += n_keys
        s.timings += 1
        res.chunk_ops += max(n_keys, 1)
        return out

    def transfer_s(n: int) -> float:
        return cfg.transfer_latency_s + n * cfg.chunk_bytes / cfg.transfer_bytes_per_s

    def offer(r: _Req, keys: tuple[bytes, ...], now: float) -> None:
        for lo in range(0, len(keys), cfg.store_batch_keys):
            batch = keys[lo : lo + cfg.store_batch_keys]
            out = timed("prepare_store", len(batch), manager.prepare_store, batch, r.ctx)
            if out is None:
                res.stores_refused += 1
                continue
            res.evicted_chunks += len(out.evicted_keys)
            if out.keys_to_store:
                ok = rng.random() >= cfg.store_failure_prob
                push(
                    now + transfer_s(len(out.keys_to_store)),
                    _STORE_DONE,
                    (r, out.keys_to_store, ok),
                )

    waiting: deque[_Req] = deque()
    running = 0

    def admit(r: _Req, now: float) -> None:
        prompt = r.keys.prompt
        n_hit = timed("lookup", len(prompt), manager.lookup_prefix, prompt, r.ctx)
        if n_hit < len(prompt):
            answer = timed("lookup", 1, manager.lookup, prompt[n_hit], r.ctx)
            if answer is LookupResult.HIT_PENDING and r.retries < cfg.max_pending_retries:
                r.retries += 1
                res.pending_waits += 1
                push(now + cfg.pending_retry_s, _RETRY, r)
                return
        positions = r.keys.prompt_positions
        # Whole positions only: every key at a position below the first miss is a hit.
        hit_tokens = positions[n_hit] - bt if n_hit < len(prompt) else r.keys.prompt_tokens
        hit_tokens = min(hit_tokens, r.keys.prompt_tokens - bt)
        n_load = 0
        while n_load < len(prompt) and positions[n_load] <= hit_tokens:
            n_load += 1
        r.hit_tokens = max(hit_tokens, 0) if n_load else 0
        res.requests += 1
        res.lookup_chunks += len(prompt)
        res.prompt_tokens += r.keys.prompt_tokens
        res.hit_chunks += n_load
        res.hit_tokens += r.hit_tokens
        if n_load:
            r.loaded = prompt[:n_load]
            timed("prepare_load", n_load, manager.prepare_load, r.loaded, r.ctx)
            timed("touch", n_load, manager.touch, r.loaded, r.ctx)
            push(now + transfer_s(n_load), _LOAD_DONE, r)
        else:
            start_prefill(r, now)

    def start_prefill(r: _Req, now: float) -> None:
        new_tokens = r.keys.prompt_tokens - r.hit_tokens
        push(now + new_tokens / cfg.prefill_tokens_per_s, _PREFILL_DONE, r)

    def start_next(now: float) -> None:
        nonlocal running
        while waiting and running < cfg.max_running:
            r = waiting.popleft()
            running += 1
            timed("on_new_request", 0, manager.on_new_request, r.ctx)
            admit(r, now)

    for spec in requests:
        push(spec.arrival, _ARRIVE, spec)

    gc_was_enabled = gc.isenabled()
    gc.disable()
    started = time.perf_counter()
    now = 0.0
    try:
        while events:
            now, kind, _, payload = heapq.heappop(events)
            if kind == _ARRIVE:
                keys = payload.keys(bt)
                ctx = ReqContext(payload.req_id)
                for key, pos in zip(keys.prompt, keys.prompt_positions, strict=True):
                    ctx.set_offload_key_position(key, pos)
                for key, pos in zip(keys.output, keys.output_positions, strict=True):
                    ctx.set_offload_key_position(key, pos)
                waiting.append(_Req(payload, keys, ctx))
                start_next(now)
            elif kind == _RETRY:
                admit(payload, now)
            elif kind == _LOAD_DONE:
                r = payload
                timed("complete_load", len(r.loaded), manager.complete_load, r.loaded, r.ctx)
                start_prefill(r, now)
            elif kind == _PREFILL_DONE:
                r = payload
                loaded = len(r.loaded)
                offer(r, r.keys.prompt[loaded:], now)
                decode_s = r.spec.output_tokens / cfg.decode_tokens_per_s
                push(now + decode_s, _DECODE_DONE, r)
            elif kind == _DECODE_DONE:
                r = payload
                offer(r, r.keys.output, now)
                timed("on_request_finished", 0, manager.on_request_finished, r.ctx)
                running -= 1
                if progress is not None:
                    progress(1)
                start_next(now)
            else:  # _STORE_DONE
                r, keys, ok = payload
                timed("complete_store", len(keys), manager.complete_store, keys, r.ctx, success=ok)
                if ok:
                    res.stored_chunks += len(keys)
                else:
                    res.stores_failed += len(keys)
    finally:
        res.wall_s = time.perf_counter() - started
        if gc_was_enabled:
            gc.enable()
    res.sim_time_s = now
    stats = manager.get_stats().data["data"]
    skipped = stats.get("vllm:kv_offload_stores_skipped")
    res.stores_skipped = int(skipped[()]) if skipped else 0
    res.shadow_hit_rates = shadow_hit_rates(manager)
    if cfg.check_invariants and hasattr(manager, "check_invariants"):
        manager.check_invariants()
    return res
