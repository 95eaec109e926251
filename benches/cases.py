"""FFI-level benchmark cases, shared by the pytest-benchmark suite and ``report.py``.

A case is one operation on 32 keys against a manager whose pool is full of ready (evictable)
chunks, at a given size. Everything an operation needs (keys, contexts) is picked before the
timed call; the Python-side view of which keys are resident is updated after it, untimed.

Operations (one round each):
- ``store_evict``: ``prepare_store`` of 32 absent keys (evicting 32) + ``complete_store``;
- ``load_complete``: ``prepare_load`` + ``complete_load`` of 32 resident keys;
- ``lookup``: 32 single ``lookup`` calls on resident keys;
- ``lookup_prefix``: one ``lookup_prefix`` of 32 resident keys;
- ``touch``: ``touch`` of 32 resident keys.

A request context serves ``ROUNDS_PER_REQUEST`` rounds, as a request offers a few batches over
its life; absent keys are recycled first-in first-out, so a context never sees a key twice.
By default no token positions are recorded, so LRU ranks every chunk by recency alone; with
``positions=True`` (``report.py --positions``) each round records its keys' end-token positions
on the context first, as vLLM's scheduler does, and LRU ranks the chunks a request stores or
loads by request and position (its re-ranking on a load, a tree insertion for a chunk whose
rank falls inside the order, and reading the positions cost kvoffload more than they cost vLLM).

Implementations: ``rust`` (kvoffload), ``reference`` (kvoffload's pure Python) and ``vllm``
(vLLM 0.33.0's own ``CPUOffloadingManager``, from ``tools/vllm_oracle.py``, with vLLM's own
``ReqContext``; lru and arc only, and only where ``tools/fetch_vllm.py`` has cached its files).
vLLM has no ``lookup_prefix``: its ``lookup_prefix`` case is what its connector does instead,
one ``lookup`` per key until the first miss (all 32 hit here).
"""

from __future__ import annotations

import gc
import random
import sys
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvoffload import ReqContext, make_offload_key
from kvoffload.bench import IMPLEMENTATIONS, load_implementation

KEYS_PER_OP = 32
SIZES = (1_000, 100_000, 1_000_000)
POLICIES = ("lru", "arc", "fifo", "sieve", "s3fifo", "2q", "slru", "lfu", "arc-paper")
VLLM = "vllm"
VLLM_POLICIES = ("lru", "arc")  # vLLM 0.33.0's built-in policies
IMPLS = (*IMPLEMENTATIONS, VLLM)  # ("reference", "rust", "vllm")
OPERATIONS = ("store_evict", "load_complete", "lookup", "lookup_prefix", "touch")
ROUNDS_PER_REQUEST = 8
BLOCK_TOKENS = 16  # tokens a key stands for, for the token positions of ``positions=True``
FILL_BATCH = 8192
KEY_PIECE = 1 << 22
# Absent keys kept for stores: 4,096 rounds prepared at once, so that a run of kvoffload's
# stores (about 8 µs a round) lasts the ~20 ms a timed run is meant to (1,024 rounds were 8 ms).
SPARE_KEYS = 131_072

LABELS = {
    "store_evict": "store with eviction (prepare_store + complete_store)",
    "load_complete": "load (prepare_load + complete_load)",
    "lookup": "lookup x32 (single keys)",
    "lookup_prefix": "lookup_prefix of 32",
    "touch": "touch 32",
}


def _vllm_oracle_on_path() -> None:
    """Make ``import vllm_oracle`` (in tools/) work."""
    tools = str(Path(__file__).resolve().parent.parent / "tools")
    if tools not in sys.path:
        sys.path.insert(0, tools)


def unavailable(impl: str, policy: str | None = None) -> str | None:
    """Why ``impl`` (under ``policy``, when given) cannot be loaded, or None when it can."""
    if impl == VLLM:
        if policy is not None and policy not in VLLM_POLICIES:
            return f"vLLM 0.33.0 has no {policy!r} policy"
        _vllm_oracle_on_path()
        import vllm_oracle

        return vllm_oracle.unavailable_reason()
    try:
        load_implementation(impl)
    except Exception as exc:  # an extension that is not built yet, typically
        return f"{type(exc).__name__}: {exc}"
    return None


def manager_and_context(impl: str) -> tuple[type, type]:
    """The manager class of ``impl`` and the ``ReqContext`` class it reads."""
    if impl == VLLM:
        _vllm_oracle_on_path()
        import vllm_oracle

        oracle = vllm_oracle.load()
        return oracle.CPUOffloadingManager, oracle.ReqContext
    return load_implementation(impl), ReqContext


def make_keys(n: int, seed: int) -> list[bytes]:
    """``n`` distinct keys: 32 pseudo-random hash bytes + KV group 0, like a real engine's."""
    rng = random.Random(seed)
    keys: list[bytes] = []
    for lo in range(0, n, KEY_PIECE):  # randbytes takes at most 2**31 bits at once
        count = min(KEY_PIECE, n - lo)
        blob = rng.randbytes(32 * count)
        keys += [make_offload_key(blob[i : i + 32], 0) for i in range(0, 32 * count, 32)]
    if len(set(keys)) != n:  # 2**-200 odds; cheap to rule out
        raise RuntimeError("duplicate benchmark keys")
    return keys


class FilledCache:
    """A manager filled to capacity with ready chunks, and which keys are resident or absent."""

    def __init__(
        self,
        impl: str,
        policy: str,
        num_chunks: int,
        seed: int = 0,
        batch: int = KEYS_PER_OP,
        keys: list[bytes] | None = None,
        events: bool = False,
        positions: bool = False,
    ) -> None:
        self.impl, self.policy, self.num_chunks, self.batch = impl, policy, num_chunks, batch
        self.positions = positions
        cls, self.context_cls = manager_and_context(impl)
        self.manager: Any = cls(num_chunks, cache_policy=policy, enable_events=events)
        if keys is None:
            keys = make_keys(num_chunks + SPARE_KEYS, seed)
        started = time.perf_counter()
        self._store_all(keys[:num_chunks], "fill")
        self.fill_s = time.perf_counter() - started
        self.resident: dict[bytes, None] = dict.fromkeys(keys[:num_chunks])
        self.absent: deque[bytes] = deque(keys[num_chunks:])
        self._resident_list: list[bytes] | None = None
        self._rng = random.Random(seed + 1)
        self._round = 0
        self._ctx: Any = self.context_cls("bench-0")
        self._outputs: list[Any] = []
        self._pins: list[tuple[list[bytes], Any]] = []
        m = self.manager
        ps, cs, pl, cl = m.prepare_store, m.complete_store, m.prepare_load, m.complete_load
        lk, tc = m.lookup, m.touch
        outputs = self._outputs

        def store_evict(keys: list[bytes], ctx: ReqContext) -> None:
            out = ps(keys, ctx)
            cs(out.keys_to_store, ctx)
            outputs.append(out)

        def load_complete(keys: list[bytes], ctx: ReqContext) -> None:
            pl(keys, ctx)
            cl(keys, ctx)

        def lookup(keys: list[bytes], ctx: ReqContext) -> None:
            for key in keys:
                lk(key, ctx)

        if hasattr(m, "lookup_prefix"):
            lp = m.lookup_prefix

            def lookup_prefix(keys: list[bytes], ctx: ReqContext) -> None:
                lp(keys, ctx)

        else:  # vLLM: its connector looks keys up one by one until the first non-HIT
            _vllm_oracle_on_path()
            import vllm_oracle

            hit = vllm_oracle.load().base.LookupResult.HIT

            def lookup_prefix(keys: list[bytes], ctx: ReqContext) -> None:
                for key in keys:
                    if lk(key, ctx) is not hit:
                        break

        def touch(keys: list[bytes], ctx: ReqContext) -> None:
            tc(keys, ctx)

        self.targets: dict[str, Callable[[list[bytes], ReqContext], None]] = {
            "store_evict": store_evict,
            "load_complete": load_complete,
            "lookup": lookup,
            "lookup_prefix": lookup_prefix,
            "touch": touch,
        }

    def pin(self, fraction: float, seed: int = 2) -> int:
        """Pin ``fraction`` of the resident chunks, picked at random (``prepare_load``, never
        completed), so eviction has to pass them by; return how many are pinned (untimed)."""
        self.settle()
        count = round(fraction * len(self.resident))
        picked = random.Random(seed).sample(list(self.resident), count)
        for lo in range(0, count, FILL_BATCH):
            keys = picked[lo : lo + FILL_BATCH]
            ctx = self.context_cls(f"pin-{lo}")
            self.manager.prepare_load(keys, ctx)
            self._pins.append((keys, ctx))
        for key in picked:  # pinned chunks are neither evicted nor used by the cases
            del self.resident[key]
        self._resident_list = None
        return count

    def _store_all(self, keys: list[bytes], name: str) -> None:
        """Store ``keys`` (absent, and room for all of them), in batches (untimed)."""
        for lo in range(0, len(keys), FILL_BATCH):
            batch_keys = keys[lo : lo + FILL_BATCH]
            ctx = self.context_cls(f"{name}-{lo}")
            out = self.manager.prepare_store(batch_keys, ctx)
            if out is None or len(out.keys_to_store) != len(batch_keys):
                raise RuntimeError(
                    f"{self.impl}/{self.policy}: {name} of {len(keys)} chunks refused"
                )
            self.manager.complete_store(batch_keys, ctx)

    def restore(self) -> None:
        """Store the resident keys again after a ``reset_cache`` emptied the pool (untimed)."""
        self.settle()
        self._store_all(list(self.resident), "restore")

    def top_up(self) -> None:
        """Store absent keys into the chunks that failed stores left free, until the pool is
        full again (untimed)."""
        self.settle()
        fresh = [self.absent.popleft() for _ in range(self.num_chunks - len(self.resident))]
        self._store_all(fresh, "top-up")
        self.resident.update(dict.fromkeys(fresh))
        self._resident_list = None

    def window(self) -> list[bytes]:
        """``batch`` resident keys adjacent in store order (a request's prefix), anywhere."""
        return self._resident_window()

    def _context(self) -> Any:
        if self._round % ROUNDS_PER_REQUEST == 0:
            self._ctx = self.context_cls(f"bench-{self._round}")
        self._round += 1
        return self._ctx

    def _resident_window(self) -> list[bytes]:
        """``batch`` resident keys adjacent in store order (a request's prefix), anywhere."""
        if self._resident_list is None:
            self._resident_list = list(self.resident)
        keys = self._resident_list
        start = self._rng.randrange(len(keys) - self.batch + 1)
        return keys[start : start + self.batch]

    def prepare(self, op: str, rounds: int) -> list[tuple[list[bytes], ReqContext]]:
        """The arguments of ``rounds`` rounds of ``op`` (untimed)."""
        self.settle()
        if op == "store_evict":
            if len(self.absent) < rounds * self.batch:
                raise ValueError(f"at most {len(self.absent) // self.batch} rounds at once")
            pop = self.absent.popleft
            return [self._args([pop() for _ in range(self.batch)]) for _ in range(rounds)]
        if op not in self.targets:
            raise ValueError(f"unknown operation {op!r}")
        return [self._args(self._resident_window()) for _ in range(rounds)]

    def _args(self, keys: list[bytes]) -> tuple[list[bytes], Any]:
        """``keys`` and the context of the next round; with ``positions``, each key's end-token
        position recorded on the context first, as vLLM's scheduler records them: distinct
        within a request, rising across its rounds (``BLOCK_TOKENS`` tokens a key)."""
        ctx = self._context()
        if self.positions:
            first = ((self._round - 1) % ROUNDS_PER_REQUEST) * self.batch
            for j, key in enumerate(keys, first + 1):
                ctx.set_offload_key_position(key, j * BLOCK_TOKENS)
        return keys, ctx

    def settle(self) -> None:
        """Apply the stores run since the last call to the resident/absent view (untimed)."""
        if not self._outputs:
            return
        for out in self._outputs:
            if len(out.keys_to_store) != self.batch or len(out.evicted_keys) != self.batch:
                raise RuntimeError(
                    f"{self.impl}/{self.policy}: a store of {self.batch} keys into a full pool "
                    f"stored {len(out.keys_to_store)} and evicted {len(out.evicted_keys)}"
                )
            for key in out.evicted_keys:
                del self.resident[key]
                self.absent.append(key)
            self.resident.update(dict.fromkeys(out.keys_to_store))
        self._outputs.clear()
        self._resident_list = None


class CacheRegistry:
    """Keeps one filled cache per implementation, so consecutive cases reuse the fill."""

    def __init__(self) -> None:
        self._caches: dict[str, FilledCache] = {}

    def get(
        self, impl: str, policy: str, num_chunks: int, *, positions: bool = False
    ) -> FilledCache:
        """The filled cache of ``impl`` at this policy and size, filling it if needed."""
        cache = self._caches.get(impl)
        wanted = (policy, num_chunks, positions)
        if cache is None or (cache.policy, cache.num_chunks, cache.positions) != wanted:
            self._caches.pop(impl, None)
            del cache  # let the old pool go before filling the new one
            cache = FilledCache(impl, policy, num_chunks, positions=positions)
            self._caches[impl] = cache
        return cache


def time_op(cache: FilledCache, op: str, *, repeat: int, min_time_s: float = 0.02) -> float:
    """Min over ``repeat`` runs of ``op`` (timeit-style): nanoseconds per key.

    Each run is as many rounds as fill ``min_time_s`` (measured once, as ``timeit.autorange``
    does), at most what the spare keys allow for stores; the cyclic GC is paused while timing.
    """
    target = cache.targets[op]
    clock = time.perf_counter_ns
    batch = cache.batch
    number = _autorange(cache, op, min_time_s)
    best: float | None = None
    for _ in range(repeat):
        per_key = _run(cache, target, op, number, clock) / (number * batch)
        best = per_key if best is None else min(best, per_key)
    assert best is not None
    return best


def _autorange(cache: FilledCache, op: str, min_time_s: float) -> int:
    """Rounds per run: enough to fill ``min_time_s`` (at most what the spare keys allow)."""
    batch = cache.batch
    cap = len(cache.absent) // batch - ROUNDS_PER_REQUEST if op == "store_evict" else 20_000
    number = 1
    while True:
        elapsed = _run(cache, cache.targets[op], op, number, time.perf_counter_ns)
        if elapsed >= min_time_s * 1e9 or number >= cap:
            return number
        number = min(cap, number * 4)


def time_op_interleaved(
    caches: dict[str, FilledCache], op: str, *, repeat: int, min_time_s: float = 0.02
) -> dict[str, float]:
    """``time_op`` for several implementations at once, their runs interleaved.

    Each implementation's run length is set once (as ``time_op`` does); then ``repeat`` times,
    every implementation runs once, in an order that rotates each time. So each one's minimum
    is taken over the same stretch of time as the others', and a slow or fast phase of a shared
    machine moves them together: the ratios are side by side, not minutes apart.
    """
    clock = time.perf_counter_ns
    numbers = {impl: _autorange(cache, op, min_time_s) for impl, cache in caches.items()}
    impls = list(caches)
    best: dict[str, float] = {}
    for r in range(repeat):
        for impl in impls[r % len(impls) :] + impls[: r % len(impls)]:
            cache, number = caches[impl], numbers[impl]
            per_key = _run(cache, cache.targets[op], op, number, clock) / (number * cache.batch)
            best[impl] = min(best.get(impl, per_key), per_key)
    return best


def _run(
    cache: FilledCache,
    target: Callable[[list[bytes], ReqContext], None],
    op: str,
    number: int,
    clock: Callable[[], int],
) -> int:
    args = cache.prepare(op, number)
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        t0 = clock()
        for keys, ctx in args:
            target(keys, ctx)
        elapsed = clock() - t0
    finally:
        if gc_was_enabled:
            gc.enable()
    cache.settle()
    return elapsed
