"""Helpers shared by the contract tests (scenarios and spec rules): keys, stores, event drains."""

from __future__ import annotations

import os
import subprocess
import sys
import warnings
from collections.abc import Callable, Sequence
from typing import Any

from kvoffload import CPUOffloadingMetrics, LookupResult, ReqContext, make_offload_key
from kvoffload.policies import CachePolicy as PluginCachePolicy

MakeManager = Callable[..., Any]

HIT = LookupResult.HIT
MISS = LookupResult.MISS
PENDING = LookupResult.HIT_PENDING

USAGE = CPUOffloadingMetrics.CPU_CACHE_USAGE_PERC
WRITE = CPUOffloadingMetrics.CPU_CACHE_WRITE_USAGE_PERC
READ = CPUOffloadingMetrics.CPU_CACHE_READ_USAGE_PERC
ALLOC = CPUOffloadingMetrics.CPU_ALLOCATION_SIZE
SKIPPED = CPUOffloadingMetrics.STORES_SKIPPED


def k(i: int, group: int = 0) -> bytes:
    """The key of block ``i`` in KV group ``group``, as vLLM's tests build it."""
    return make_offload_key(str(i).encode(), group)


def ks(*ids: int) -> list[bytes]:
    """Keys of group 0 for ``ids``, in order."""
    return [k(i) for i in ids]


def chunk_ids(output: Any) -> list[int]:
    """The chunk ids of a PrepareStoreOutput or a load spec, as a plain list."""
    spec = output.store_spec if hasattr(output, "store_spec") else output
    return [int(x) for x in spec.block_ids]


def drain(m: Any) -> list[tuple[str, list[bytes]]]:
    """Drain the events as (kind, keys); kind is stored, removed or cleanup (metadata-only)."""
    out = []
    for e in m.take_events():
        kind = ("cleanup" if e.metadata_only else "removed") if e.removed else "stored"
        out.append((kind, list(e.keys)))
    return out


def store(m: Any, ctx: Any, *ids: int) -> Any:
    """Prepare and complete a store of ``ids``; the prepare must succeed."""
    out = m.prepare_store(ks(*ids), ctx)
    assert out is not None
    m.complete_store(out.keys_to_store, ctx)
    return out


def stats_data(m: Any) -> dict[str, Any]:
    """This report's metrics as ``{name: value}``."""
    return {name: series[()] for name, series in m.get_stats().data["data"].items()}


def ranks(m: Any) -> dict[bytes, tuple[int, int]]:
    """LRU ranks by key."""
    state = m.policy_state()
    assert state["policy"] == "lru"
    return {key: tuple(rank) for key, rank in state["ranks"].items()}


def lru_state(m: Any) -> tuple[dict[bytes, tuple[int, int]], int]:
    """LRU ranks and the next rank to issue."""
    return ranks(m), m.policy_state()["next_rank"]


def arc_lists(m: Any) -> tuple[list[bytes], list[bytes], list[bytes], list[bytes]]:
    """ARC's T1, T2, B1 and B2, oldest first."""
    state = m.policy_state()
    assert state["policy"] == "arc"
    return (list(state["t1"]), list(state["t2"]), list(state["b1"]), list(state["b2"]))


def target(m: Any) -> float:
    """ARC's target size of T1."""
    return float(m.policy_state()["target_t1_size"])


def request(req_id: str, positions: dict[bytes, int] | None = None) -> ReqContext:
    """A context with the given token positions."""
    ctx = ReqContext(req_id=req_id)
    for key, pos in (positions or {}).items():
        ctx.set_offload_key_position(key, pos)
    return ctx


#: The manager calls the hostile-input fuzz tests make.
FUZZ_CALLS = [
    "lookup",
    "lookup_prefix",
    "get_load_source",
    "prepare_load",
    "complete_load",
    "touch",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
]

#: The keys of the hostile-input fuzz tests (two KV groups).
FUZZ_KEYS = [make_offload_key(b"fuzz-%d" % i, i % 2) for i in range(8)]


def fuzz_world(m: Any, threshold: int) -> dict[str, ReqContext]:
    """Bring a manager of capacity 6 to every chunk state for the fuzz tests: FUZZ_KEYS[0..2]
    ready, [3] pinned by the unfinished request r, [4] pending, [6] counted once by the tracker
    (stored, pending, at threshold 1); f loaded [1] and finished. Returns base, r and f."""
    base, r, f = ReqContext("base"), ReqContext("r"), ReqContext("f")
    for i, key in enumerate(FUZZ_KEYS):
        r.set_offload_key_position(key, 16 * (i + 1))
    for _ in range(threshold):
        out = m.prepare_store(FUZZ_KEYS[:4], base)
    m.complete_store(out.keys_to_store, base)
    for _ in range(threshold):
        m.prepare_store(FUZZ_KEYS[4:5], base)
    m.on_new_request(r)
    m.prepare_load(FUZZ_KEYS[3:4], r)
    m.on_new_request(f)
    m.prepare_load(FUZZ_KEYS[1:2], f)
    m.complete_load(FUZZ_KEYS[1:2], f)
    m.on_request_finished(f)
    m.prepare_store(FUZZ_KEYS[6:7], base)
    return {"base": base, "r": r, "f": f}


def fork(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child, which reports through its exit status only (anything it
    raises: 1); returns the child's pid, in the parent (see `exit_code`)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # fork of a threaded process
        pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = body()
        finally:
            os._exit(code)
    return pid


def exit_code(pid: int) -> int:
    """Wait for child ``pid``; its exit code."""
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


class OldestFirst(PluginCachePolicy):
    """A plug-in policy with vLLM's method set only (no ``items``, no ``check_invariants``):
    oldest first. ``answer``, when set, replaces what ``evict`` returns. By module path:
    ``cache_policy="OldestFirst", cache_policy_module_path="_helpers"``."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[bytes, Any] = {}
        self.answer: Callable[[OldestFirst, int, Any], Any] | None = None

    def get(self, key: bytes) -> Any:
        return self.chunks.get(key)

    def insert(self, key: bytes, chunk: Any, req_context: Any) -> None:
        self.chunks[key] = chunk

    def remove(self, key: bytes) -> None:
        del self.chunks[key]

    def touch(self, keys: Sequence[bytes], req_context: Any) -> None:
        pass

    def evict(self, n: int, protected: set[bytes]) -> Any:
        if self.answer is not None:
            return self.answer(self, n, protected)
        victims = [(k, c) for k, c in self.chunks.items() if c.ref_cnt == 0 and k not in protected]
        if len(victims) < n:
            return None
        for k, _ in victims[:n]:
            del self.chunks[k]
        return victims[:n]

    def clear(self) -> None:
        self.chunks.clear()


#: Two policies written for vLLM 0.33.0: they import vLLM's CachePolicy and nothing of ours.
VLLM_POLICIES = '''
import random

from vllm.v1.kv_offload.cpu.policies.base import CachePolicy


class MRUPolicy(CachePolicy):
    """Evicts the most recently used evictable chunk first."""

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.chunks = {}  # least recently used first

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk, req_context):
        self.chunks[key] = chunk

    def remove(self, key):
        del self.chunks[key]

    def touch(self, keys, req_context):
        for key in keys:
            if key in self.chunks:
                self.chunks[key] = self.chunks.pop(key)

    def evict(self, n, protected):
        victims = []
        for key in reversed(self.chunks):
            chunk = self.chunks[key]
            if chunk.is_ready and chunk.ref_cnt == 0 and key not in protected:
                victims.append((key, chunk))
                if len(victims) == n:
                    break
        if len(victims) < n:
            return None
        for key, _ in victims:
            del self.chunks[key]
        return victims

    def clear(self):
        self.chunks.clear()

    def items(self):  # not vLLM's: what kvoffload's reference manager lists residents with
        return iter(list(self.chunks.items()))


class SeededRandomPolicy(CachePolicy):
    """Evicts uniformly at random (seeded) among the chunks it was told are evictable."""

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.rng = random.Random(1234)
        self.chunks = {}
        self.evictable = {}  # an ordered set

    def get(self, key):
        return self.chunks.get(key)

    def insert(self, key, chunk, req_context):
        self.chunks[key] = chunk

    def remove(self, key):
        del self.chunks[key]

    def touch(self, keys, req_context):
        pass

    def mark_evictable(self, key):
        self.evictable[key] = None

    def mark_non_evictable(self, key):
        del self.evictable[key]

    def evict(self, n, protected):
        candidates = [key for key in self.evictable if key not in protected]
        if len(candidates) < n:
            return None
        victims = self.rng.sample(candidates, n)
        for key in victims:
            del self.evictable[key]
        return [(key, self.chunks.pop(key)) for key in victims]

    def clear(self):
        self.chunks.clear()
        self.evictable.clear()


class Recorded:
    """Mixin: records every call its manager makes, but ``get``, in order."""

    def __init__(self, cache_capacity):
        super().__init__(cache_capacity)
        self.calls = []

    def insert(self, key, chunk, req_context):
        self.calls.append(("insert", key, chunk.chunk_id, req_context.req_id))
        super().insert(key, chunk, req_context)

    def remove(self, key):
        self.calls.append(("remove", key))
        super().remove(key)

    def touch(self, keys, req_context):
        keys = list(keys)
        self.calls.append(("touch", keys, req_context.req_id))
        super().touch(keys, req_context)

    def on_store_miss(self, keys, req_context):
        keys = list(keys)
        self.calls.append(("on_store_miss", keys, req_context.req_id))
        super().on_store_miss(keys, req_context)

    def on_request_access(self, keys, req_context):
        keys = list(keys)
        self.calls.append(("on_request_access", keys, req_context.req_id))
        super().on_request_access(keys, req_context)

    def on_request_finished(self, key_groups, insertion_only_keys, reused_keys, req_context):
        groups = [list(group) for group in key_groups]
        self.calls.append(
            (
                "on_request_finished",
                groups,
                sorted(insertion_only_keys),
                sorted(reused_keys),
                req_context.req_id,
            )
        )
        super().on_request_finished(groups, insertion_only_keys, reused_keys, req_context)

    def evict(self, n, protected):
        answer = super().evict(n, protected)
        victims = None if answer is None else [(key, chunk.chunk_id) for key, chunk in answer]
        self.calls.append(("evict", n, sorted(protected), victims))
        return answer

    def clear(self):
        self.calls.append(("clear",))
        super().clear()

    def mark_evictable(self, key):
        self.calls.append(("mark_evictable", key))
        super().mark_evictable(key)

    def mark_non_evictable(self, key):
        self.calls.append(("mark_non_evictable", key))
        super().mark_non_evictable(key)


class RecordedMRUPolicy(Recorded, MRUPolicy):
    pass


class RecordedRandomPolicy(Recorded, SeededRandomPolicy):
    pass
'''

#: The same policies against kvoffload's own base class.
OWN_POLICY = VLLM_POLICIES.replace(
    "from vllm.v1.kv_offload.cpu.policies.base import", "from kvoffload.policies import"
)


# --- scenarios in a child Python (a fork, a hang turned into a failure) ---

#: A child Python's scenario given more than this has hung.
CHILD_TIME_LIMIT_S = 120

#: Source that scenarios run in a child Python start with: ``fork_and_wait(child, limit)`` forks,
#: runs ``child`` in the forked child and returns its exit status (3 when it raised; the child
#: is killed, and the status is "hung", past ``limit`` seconds); ``plug_in(name, cls)`` makes
#: ``cls`` a plug-in policy module and returns the manager's keyword arguments naming it.
FORK_PRELUDE = """
import os, sys, time, threading, types
import kvoffload
from kvoffload import CPUOffloadingManager, ReqContext

def fork_and_wait(child, limit=30.0):
    pid = os.fork()
    if pid == 0:
        try:
            child()
        except BaseException as e:  # any failure is the child's exit status
            print(f"child failed: {e!r}", file=sys.stderr, flush=True)
            os._exit(3)
        os._exit(0)
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            return os.waitstatus_to_exitcode(status)
        time.sleep(0.01)
    os.kill(pid, 9)
    os.waitpid(pid, 0)
    return "hung"

def plug_in(name, cls):
    module = types.ModuleType(name)
    setattr(module, cls.__name__, cls)
    sys.modules[name] = module
    return dict(cache_policy=cls.__name__, cache_policy_module_path=name)
"""


def run_child_python(program: str) -> subprocess.CompletedProcess[str]:
    """Run ``program`` in a child Python, which must exit cleanly within
    ``CHILD_TIME_LIMIT_S``."""
    done = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", program],
        capture_output=True,
        text=True,
        timeout=CHILD_TIME_LIMIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return done
