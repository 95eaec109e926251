"""The manager's other calls, side by side: kvoffload, the reference and vLLM 0.33.0.

``report.py`` times the calls that move keys (stores, loads, lookups, touch). This times every
other call of the manager against a pool full of ready chunks (10^5 by default), each call's
inputs made, untimed, before it:

- ``new_request``: ``on_new_request`` of a fresh context;
- ``finish``: ``on_request_finished`` of a request that loaded and touched 32 resident keys at
  known token positions (as a scheduler's request ends);
- ``store_fail``: ``complete_store(success=False)`` of the 32 keys a ``prepare_store`` placed
  (evicting 32);
- ``get_stats``: ``get_stats`` after one store with eviction of 32 keys;
- ``take_events``: events on, draining the events of one store with eviction of 32 keys (a
  "stored" and a "removed" event of 32 keys each);
- ``store_events``: events on, that store with eviction and the drain together. vLLM builds each
  event object inside the store calls, kvoffload when it is drained, so ``take_events`` alone
  does not compare like with like; this does;
- ``get_load_source``: of a resident key;
- ``reset_cache``: of the full pool (filled again, untimed, after each).

The implementations' runs interleave (their order rotating) and each keeps its fastest, as in
``report.py``, so the ratios are side by side. Calls whose inputs can all be made first are timed
as one loop; the others (``get_stats``, ``take_events``, ``reset_cache``: each needs the manager
changed in between) one call at a time, less the cost of an empty timed region.

    python benches/calls.py                                # lru and arc, 10^5 chunks
    python benches/calls.py --policies fifo,lfu            # any built-in policy (vLLM: lru, arc)
    python benches/calls.py --impls rust,vllm --chunks 1000000 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from cases import IMPLS, KEYS_PER_OP, FilledCache, unavailable
from kvoffload.workload import BLOCK_TOKENS, timer_overhead_ns
from render import IMPL_NAMES, IMPL_ORDER
from report import _names

CALLS = (
    "new_request",
    "finish",
    "store_fail",
    "get_stats",
    "take_events",
    "store_events",
    "get_load_source",
    "reset_cache",
)
LABELS = {
    "new_request": "on_new_request",
    "finish": "on_request_finished (a request of 32 keys)",
    "store_fail": "complete_store(success=False) of 32",
    "get_stats": "get_stats (after a store of 32)",
    "take_events": "take_events (2 events of 32 keys)",
    "store_events": "store with eviction of 32 + take_events",
    "get_load_source": "get_load_source",
    "reset_cache": "reset_cache (full pool)",
}
#: Calls timed one at a time: each needs the manager changed (untimed) before it.
ONE_AT_A_TIME = frozenset({"get_stats", "take_events", "reset_cache"})
#: Calls a run makes of each (the pool is filled again after every ``reset_cache``).
ROUNDS = {
    "new_request": 2_000,
    "finish": 200,
    "store_fail": 200,
    "get_stats": 300,
    "take_events": 300,
    "store_events": 300,
    "get_load_source": 4_000,
    "reset_cache": 1,
}


class Calls:
    """One implementation's managers under one policy: a filled pool, and one with events on
    (made when ``take_events`` is first timed)."""

    def __init__(self, impl: str, policy: str, num_chunks: int) -> None:
        self.impl, self.policy, self.num_chunks = impl, policy, num_chunks
        self.cache = FilledCache(impl, policy, num_chunks)
        self._events: FilledCache | None = None
        self._seq = 0
        self._failed: list[tuple[Any, Any]] = []

    @property
    def events(self) -> FilledCache:
        """The pool with events on (its fill's events drained)."""
        if self._events is None:
            self._events = FilledCache(self.impl, self.policy, self.num_chunks, events=True)
            for _ in self._events.manager.take_events():
                pass
        return self._events

    def _name(self, what: str) -> str:
        self._seq += 1
        return f"{what}-{self._seq}"

    def setup(self, call: str) -> tuple[Any, ...]:
        """The arguments of one ``call``, after the untimed steps it needs."""
        cache, m = self.cache, self.cache.manager
        if call == "new_request":
            return (cache.context_cls(self._name("new")),)
        if call == "finish":
            keys = cache.window()
            ctx = cache.context_cls(self._name("finish"))
            for i, key in enumerate(keys):
                ctx.set_offload_key_position(key, (i + 1) * BLOCK_TOKENS)
            m.on_new_request(ctx)
            m.prepare_load(keys, ctx)
            m.touch(keys, ctx)
            m.complete_load(keys, ctx)
            return (ctx,)
        if call == "store_fail":
            ((keys, ctx),) = cache.prepare("store_evict", 1)
            out = m.prepare_store(keys, ctx)
            if out is None or len(out.keys_to_store) != KEYS_PER_OP:
                raise RuntimeError(f"{self.impl}/{self.policy}: a store was refused")
            self._failed.append((out, ctx))
            return (out.keys_to_store, ctx, False)
        if call in ("get_stats", "take_events"):
            target = cache if call == "get_stats" else self.events
            ((keys, ctx),) = target.prepare("store_evict", 1)
            target.targets["store_evict"](keys, ctx)
            return ()
        if call == "store_events":
            ((keys, ctx),) = self.events.prepare("store_evict", 1)
            return (keys, ctx)
        if call == "get_load_source":
            return (cache.window()[0], cache.context_cls("source"))
        if call == "reset_cache":
            return ()
        raise ValueError(f"unknown call {call!r}")

    def target(self, call: str) -> Callable[..., Any]:
        """The timed call."""
        # The manager is untyped (Any): kvoffload's, the reference's or vLLM's, loaded at runtime.
        m = self.cache.manager
        if call == "finish":
            return cast(Callable[..., Any], m.on_request_finished)
        if call == "new_request":
            return cast(Callable[..., Any], m.on_new_request)
        if call == "store_fail":
            return cast(Callable[..., Any], m.complete_store)
        if call in ("take_events", "store_events"):
            events = self.events.manager

            def drain() -> None:
                for _ in events.take_events():
                    pass

            if call == "take_events":
                return drain
            store = self.events.targets["store_evict"]

            def store_and_drain(keys: list[bytes], ctx: Any) -> None:
                store(keys, ctx)
                drain()

            return store_and_drain
        return cast(Callable[..., Any], getattr(m, call))

    def after(self, call: str) -> None:
        """Untimed bookkeeping after a run of ``call``."""
        cache = self.cache
        if call == "store_fail":
            for out, _ctx in self._failed:
                for key in out.evicted_keys:
                    del cache.resident[key]
                    cache.absent.append(key)
                cache.absent.extend(out.keys_to_store)
            self._failed.clear()
            cache.top_up()
        elif call == "reset_cache":
            cache.restore()
        elif call == "get_stats":
            cache.settle()
            cache.manager.get_stats()
        elif call in ("take_events", "store_events"):
            self.events.settle()

    def run(self, call: str, n: int, overhead_ns: int) -> float:
        """Net nanoseconds per call over ``n`` calls."""
        if call == "get_stats":
            self.cache.manager.get_stats()  # samples of earlier calls are not this run's
        target = self.target(call)
        clock = time.perf_counter_ns
        gc_was_enabled = gc.isenabled()
        try:
            if call in ONE_AT_A_TIME:
                total = 0
                for _ in range(n):
                    args = self.setup(call)
                    gc.disable()
                    t0 = clock()
                    target(*args)
                    total += clock() - t0 - overhead_ns
                    if gc_was_enabled:
                        gc.enable()
            else:
                inputs = [self.setup(call) for _ in range(n)]
                gc.disable()
                t0 = clock()
                for args in inputs:
                    target(*args)
                total = clock() - t0
        finally:
            if gc_was_enabled:
                gc.enable()
        self.after(call)
        return max(total, 0) / n


def measure(
    policies: list[str],
    impls: list[str],
    calls: list[str],
    num_chunks: int,
    repeat: int,
    scale: float = 1.0,
) -> list[dict[str, Any]]:
    """ns per call of every ``calls`` x ``impls`` under each policy (interleaved, fastest)."""
    overhead = timer_overhead_ns()
    rows: list[dict[str, Any]] = []
    for policy in policies:
        present = [i for i in impls if unavailable(i, policy) is None]
        for impl in impls:
            if impl not in present:
                print(
                    f"calls: {impl}/{policy} skipped: {unavailable(impl, policy)}", file=sys.stderr
                )
        benches: dict[str, Calls] = {}
        for impl in present:
            benches[impl] = Calls(impl, policy, num_chunks)
        for call in calls:
            n = max(1, round(ROUNDS[call] * scale))
            best: dict[str, float] = {}
            for r in range(repeat):
                for impl in present[r % len(present) :] + present[: r % len(present)]:
                    ns = benches[impl].run(call, n, overhead)
                    best[impl] = min(best.get(impl, ns), ns)
            shown = "  ".join(f"{impl} {best[impl]:,.0f}" for impl in present)
            print(f"calls: {policy} {call:16s} ns/call: {shown}", file=sys.stderr, flush=True)
            rows += [
                {"policy": policy, "call": call, "impl": impl, "ns_per_call": best[impl]}
                for impl in present
            ]
        benches.clear()
    return rows


def table(rows: list[dict[str, Any]], policy: str) -> list[str]:
    """A markdown table of one policy's rows: ns per call and kvoffload's ratios."""
    by = {(r["call"], r["impl"]): r["ns_per_call"] for r in rows if r["policy"] == policy}
    impls = [i for i in IMPL_ORDER if any(imp == i for _c, imp in by)]
    names = IMPL_NAMES
    head = ["call", *(f"{names[i]} ns" for i in impls)]
    head += [f"kvoffload vs {names[i]}" for i in impls if i != "rust" and "rust" in impls]
    out = ["| " + " | ".join(head) + " |", "|---|" + "---:|" * (len(head) - 1)]
    for call in CALLS:
        if not any((call, i) in by for i in impls):
            continue
        cells = [LABELS[call]]
        cells += [f"{by[call, i]:,.0f}" if (call, i) in by else "-" for i in impls]
        rust = by.get((call, "rust"))
        for i in impls:
            if i == "rust" or "rust" not in impls:
                continue
            other = by.get((call, i))
            cells.append(f"{other / rust:.2f}x" if other and rust else "-")
        out.append("| " + " | ".join(cells) + " |")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--policies", type=_names, default=["lru", "arc"])
    parser.add_argument("--impls", type=_names, default=list(IMPLS), help="comma-separated")
    parser.add_argument("--calls", type=_names, default=list(CALLS), help="comma-separated")
    parser.add_argument("--chunks", type=int, default=100_000, help="pool size (100000)")
    parser.add_argument("--repeat", type=int, default=5, help="runs per call; fastest kept (5)")
    parser.add_argument(
        "--scale", type=float, default=1.0, help="calls a run, as a factor of the defaults"
    )
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write the numbers as JSON")
    args = parser.parse_args(argv)
    for what, names, known in (("call", args.calls, CALLS), ("implementation", args.impls, IMPLS)):
        for name in names:
            if name not in known:
                print(f"calls: unknown {what} {name!r} (one of {known})", file=sys.stderr)
                return 2
    if args.chunks < 2 * KEYS_PER_OP or args.repeat < 1 or args.scale <= 0:
        print(
            f"calls: need --chunks >= {2 * KEYS_PER_OP}, --repeat >= 1, --scale > 0",
            file=sys.stderr,
        )
        return 2
    rows = measure(args.policies, args.impls, args.calls, args.chunks, args.repeat, args.scale)
    for policy in args.policies:
        what = f"{args.chunks:,} chunks, ns per call (fastest of {args.repeat})"
        print(f"\n**{policy}** policy, {what}\n")
        print("\n".join(table(rows, policy)))
    if args.json:
        doc = {"chunks": args.chunks, "repeat": args.repeat, "rows": rows}
        args.json.write_text(json.dumps(doc, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
