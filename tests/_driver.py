"""Differential driver: random legal call sequences run side by side on several managers.

A ``Model`` tracks what the driver knows from the observables (each key's state, the pins and
stores in flight, each request's state and the keys it has surely recorded) and decides what is
legal; a ``Generator`` draws the next legal ``Op`` through a ``Chooser`` (seeded ``random`` here,
hypothesis draws in the state machine); a ``Session`` runs each op on every implementation,
compares the canonical results, updates the model from them and, after each step, compares the
introspection of the implementations that have it. The first difference raises ``Mismatch``,
whose report holds the call history and a Python repro. ``shrink`` cuts a failing sequence down.
"""

from __future__ import annotations

import builtins
import dataclasses
import importlib.util
import itertools
import os
import random
import sys
import time
import types
from collections import Counter, deque
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any, NamedTuple

ROOT = Path(__file__).resolve().parent.parent
IMPL_NAMES = ("rust", "reference", "vllm", "vllm-deep")


# --- keys ---


def key(h: int, g: int = 0) -> bytes:
    """The key of block hash ``h<h>`` in KV group ``g``.

    Hashes vary in length on purpose: short ones (``b"h12"``), and every fourth one padded to a
    real hash's 32 bytes or more (``b"h3###..."``), so byte order and storage see both.
    """
    return b"h%d" % h + (b"#" * 29 if h % 4 == 3 else b"") + g.to_bytes(4, "big")


#: ``key`` as repro scripts define it.
KEY_SOURCE = """def K(h, g=0):
    return make_offload_key(b"h%d" % h + (b"#" * 29 if h % 4 == 3 else b""), g)"""


def key_name(k: object) -> str:
    """``h3/1`` for ``key(3, 1)``; any other value as its repr."""
    if type(k) is bytes and len(k) >= 4:
        head = k[:-4].rstrip(b"#").decode("ascii", "backslashreplace")
        return f"{head}/{int.from_bytes(k[-4:], 'big')}"
    return repr(k)


def _key_code(k: bytes) -> str:
    head, group = k[:-4].rstrip(b"#"), int.from_bytes(k[-4:], "big")
    if head[:1] == b"h" and head[1:].isdigit() and key(int(head[1:]), group) == k:
        return f"K({int(head[1:])})" if group == 0 else f"K({int(head[1:])}, {group})"
    return repr(k)


# --- configuration and ops ---


@dataclass(frozen=True)
class Config:
    """One manager configuration plus the shape of the workload driven against it."""

    num_chunks: int
    policy: str = "lru"
    store_threshold: int = 1
    max_tracker_size: int = 64_000
    admission: str = "tracker"  # or "tinylfu" (kvoffload only: vLLM has the tracker)
    enable_events: bool = True
    groups: tuple[int, ...] = (0,)  # KV group indices, in the order a prompt lists them
    num_hashes: int = 8
    max_active: int = 3

    def manager_kwargs(self) -> dict[str, Any]:
        """Constructor arguments, identical for every implementation."""
        return {
            "num_chunks": self.num_chunks,
            "cache_policy": self.policy,
            "enable_events": self.enable_events,
            "store_threshold": self.store_threshold,
            "max_tracker_size": self.max_tracker_size,
            **({"admission": self.admission} if self.admission != "tracker" else {}),
        }

    @classmethod
    def draw(
        cls,
        ch: Chooser,
        policy: str | None = None,
        threshold: int | None = None,
        big: bool = True,
        policies: Sequence[str] = ("lru", "arc"),
    ) -> Config:
        """A random configuration; ``big`` allows caches up to 64 chunks."""
        if big and ch.chance(0.25):
            num_chunks = ch.int(17, 64)
        elif big and ch.chance(0.03):
            num_chunks = 0
        else:
            num_chunks = ch.int(1 if big else 0, 16 if big else 8)
        tiny_tracker = not ch.chance(0.4)
        return cls(
            num_chunks=num_chunks,
            policy=policy if policy is not None else ch.pick(tuple(policies)),
            store_threshold=threshold if threshold is not None else ch.int(1, 3),
            max_tracker_size=ch.int(1, 4) if tiny_tracker else ch.pick((8, 64_000)),
            enable_events=not ch.chance(0.1),
            groups=(0,) if not ch.chance(0.35) else ch.pick(_GROUPS),
            num_hashes=min(
                128,
                ch.int(2, num_chunks + 2)
                if ch.chance(0.2)
                else ch.int(num_chunks + 1, 2 * num_chunks + 8),
            ),
            max_active=ch.int(1, 4),
        )


#: Group sets of multi-group configurations: two groups, unsorted, and indices that need all
#: four big-endian bytes.
_GROUPS = ((0, 1), (1, 0), (0, 256), (2**32 - 1, 7))


#: Legal but unusual token positions (vLLM takes any int).
_ODD_POSITIONS = (-32, 0, 2**31, 2**40)


class Op(NamedTuple):
    """One step: a manager call (or a context change) with explicit arguments."""

    kind: str
    rid: str | None = None
    keys: tuple[bytes, ...] = ()
    arg: Any = None

    def code(self, mgr: str = "m") -> list[str]:
        """The step as lines of Python for a repro; a call's last line is its result expression."""
        ks = "[" + ", ".join(_key_code(k) for k in self.keys) + "]"
        ctx, kind = self.rid, self.kind
        if kind in ("new_request", "set_position"):
            lines = [f"{ctx} = ReqContext({ctx!r})"] if kind == "new_request" else []
            return lines + [
                f"{ctx}.set_offload_key_position({_key_code(k)}, {p})" for k, p in self.arg or ()
            ]
        taken = "list(events)" if self.arg is None else f"take(events, {self.arg})"
        return {
            "on_new_request": [f"{mgr}.on_new_request({ctx})"],
            "finish": [f"{mgr}.on_request_finished({ctx})"],
            "lookup": [f"{mgr}.lookup({ks[1:-1]}, {ctx})"],
            "lookup_prefix": [f"{mgr}.lookup_prefix({ks}, {ctx})"],
            "get_load_source": [f"{mgr}.get_load_source({ks[1:-1]}, {ctx})"],
            "prepare_load": [f"{mgr}.prepare_load({ks}, {ctx})"],
            "prepare_read": [f"{mgr}.prepare_read({ks}, {ctx})"],
            "complete_load": [f"{mgr}.complete_load({ks}, {ctx})"],
            "touch": [f"{mgr}.touch({ks}, {ctx})"],
            "prepare_store": [f"{mgr}.prepare_store({ks}, {ctx})"],
            "complete_store": [f"{mgr}.complete_store({ks}, {ctx}, success={self.arg})"],
            "take_events": [f"events = iter({mgr}.take_events())", taken],
            "events_more": [taken],
            "events_drop": ["events = None"],
            "get_stats": [f"{mgr}.get_stats().data"],
            "reset_cache": [f"{mgr}.reset_cache()"],
            "misc": [f"({mgr}.config_info(), {mgr}.has_pending_work())"],
        }[kind]

    def __str__(self) -> str:
        parts = [self.rid] if self.rid else []
        if self.kind in ("set_position", "new_request"):
            parts += [f"{key_name(k)}@{p}" for k, p in self.arg or ()]
        else:
            if self.keys or self.kind in _KEYED:
                parts.append("[" + ", ".join(key_name(k) for k in self.keys) + "]")
            if self.arg is not None:
                parts.append(
                    f"success={self.arg}" if self.kind == "complete_store" else str(self.arg)
                )
        return f"{self.kind}({', '.join(parts)})"


_KEYED = {
    "prepare_load",
    "prepare_read",
    "complete_load",
    "touch",
    "prepare_store",
    "complete_store",
}


# --- canonical observables ---


class Raised(NamedTuple):
    """An exception raised by a call, compared by class name and message."""

    type: str
    message: str


def canon(v: Any) -> Any:
    """A comparable, implementation-neutral form of a return value (types are kept strict)."""
    if v is None or type(v) in (str, bytes):
        return v
    if type(v) in (int, float, bool):
        return (type(v).__name__, v)
    if isinstance(v, Enum):
        return (type(v).__name__, v.name)
    if hasattr(v, "block_ids"):
        ids = v.block_ids
        return ("spec", str(getattr(ids, "dtype", type(ids).__name__)), tuple(ids.tolist()))
    if hasattr(v, "keys_to_store"):
        return (
            "store",
            canon_keys(v.keys_to_store),
            canon(v.store_spec),
            canon_keys(v.evicted_keys),
        )
    if hasattr(v, "removal_expected"):
        return (
            "event",
            canon_keys(v.keys),
            canon(v.medium),
            canon(v.removed),
            canon(v.locality),
            canon(v.ownership),
            canon(v.removal_expected),
            canon(v.metadata_only),
        )
    if type(v).__name__ == "RequestOffloadingContext":
        return ("request_context", canon(v.policy))
    if hasattr(v, "data") and hasattr(v, "set_gauge"):
        return ("stats", canon(v.data))
    if isinstance(v, dict):
        return ("dict", tuple((canon(k), canon(x)) for k, x in v.items()))
    if isinstance(v, list | tuple):
        return (type(v).__name__, tuple(canon(x) for x in v))
    return ("?", type(v).__name__, repr(v))


def canon_keys(keys: Any) -> Any:
    """Keys as a tuple of bytes, or their generic form when they are not a list of bytes."""
    if type(keys) is list and all(type(k) is bytes for k in keys):
        return tuple(keys)
    return canon(keys)


def render(v: Any) -> str:
    """A readable rendering of a canonical value (or of raw state): keys as ``h3/0``."""
    t = type(v)
    if t is bytes:
        return key_name(v)
    if t is str:
        return str(v).removeprefix("vllm:kv_offload_")
    if isinstance(v, Raised):
        return f"raised {v.type}: {v.message}"
    if t is dict:
        return "{" + ", ".join(f"{render(k)}: {render(x)}" for k, x in v.items()) + "}"
    if t is list:
        return "[" + ", ".join(render(x) for x in v) + "]"
    if t is not tuple:
        return repr(v)
    if not v:
        return "[]"
    tag = v[0]
    if all(type(x) is bytes for x in v):
        return "[" + ", ".join(map(key_name, v)) + "]"
    if len(v) == 2 and tag in ("int", "float", "bool"):
        return repr(v[1])
    if len(v) == 2 and tag in ("list", "tuple"):
        inner = ", ".join(render(x) for x in v[1])
        return f"[{inner}]" if tag == "list" else f"({inner})"
    if len(v) == 2 and tag == "dict":
        return "{" + ", ".join(f"{render(k)}: {render(x)}" for k, x in v[1]) + "}"
    if len(v) == 2 and tag == "stats":
        return _render_stats(v[1])
    if len(v) == 2 and tag == "request_context":
        return f"RequestOffloadingContext({render(v[1])})"
    if len(v) == 2 and tag == "events":
        return "events[" + ", ".join(render(e) for e in v[1]) + "]"
    if len(v) == 2 and type(v[1]) is str and tag[:1].isupper():  # an enum member
        return v[1]
    if len(v) == 3 and tag == "spec":
        return f"ids{list(v[2])}" + ("" if v[1] == "int32" else f" ({v[1]})")
    if len(v) == 4 and tag == "store":
        return f"store(keys={render(v[1])}, {render(v[2])}, evicted={render(v[3])})"
    if len(v) == 8 and tag == "event":
        _, keys, medium, removed, locality, ownership, expected, meta = v
        usual = medium == ("Medium", "CPU") and locality is None and ownership is None
        what = "removed" if removed == ("bool", True) else "stored"
        if meta == ("bool", True):
            what += "(metadata_only)"
        if not (usual and expected == ("bool", False) and removed[0] == meta[0] == "bool"):
            what += "(" + ", ".join(render(x) for x in v[2:]) + ")"
        return f"{what}{render(keys)}"
    return "(" + ", ".join(render(x) for x in v) + ")"


def _render_stats(data: Any) -> str:
    """``stats{cpu_cache_usage_perc=0.5, ...}`` from the canonical payload; generic otherwise."""
    try:
        sections = dict(data[1])
        series = [
            f"{render(name)}={render(value)}"
            if labels == ("tuple", ())
            else f"{render(name)}{render(labels)}={render(value)}"
            for name, values in sections["data"][1]
            for labels, value in values[1]
        ]
        info = "" if sections["info"] is None else f", info={render(sections['info'])}"
    except (KeyError, IndexError, TypeError, ValueError):
        return f"stats{render(data)}"
    return "stats{" + ", ".join(series) + info + "}"


# --- implementations ---


def _load_tool(name: str) -> Any:
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, ROOT / "tools" / f"{name}.py")
        assert spec is not None
        assert spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return module


def vllm_unavailable_reason() -> str | None:
    """Why the vLLM 0.33.0 oracle cannot run here, or None."""
    reason: str | None = _load_tool("vllm_oracle").unavailable_reason()
    return reason


def require_vllm() -> None:
    """Skip the calling test without the vLLM oracle, or fail it where scripts/test fetched one.

    ``scripts/test`` sets ``KVOFFLOAD_REQUIRE_VLLM=1`` once ``tools/fetch_vllm.py`` has put the
    sources in place, so the vLLM tests cannot silently skip there.
    """
    import pytest

    reason = vllm_unavailable_reason()
    if reason is None:
        return
    if os.environ.get(_load_tool("vllm_oracle").REQUIRE_ENV):
        pytest.fail(f"the vLLM tests are required here, but: {reason}", pytrace=False)
    pytest.skip(reason)


def _own_state(mgr: Any) -> dict[str, Any]:
    mgr.check_invariants()
    return {
        "resident": mgr.resident(),
        "policy_state": mgr.policy_state(),
        "tracker_state": mgr.tracker_state(),
        "pool_state": mgr.pool_state(),
    }


@dataclass
class ImplSpec:
    """How to build one implementation: manager class, context class, introspection."""

    name: str
    manager_cls: Callable[..., Any]
    context_cls: type
    state: Callable[[Any], dict[str, Any]] | None


def impl_spec(name: str) -> ImplSpec:
    """``rust``, ``reference``, ``vllm`` (public observables) or ``vllm-deep`` (plus internals)."""
    from kvoffload.types import ReqContext

    if name == "rust":
        from kvoffload import CPUOffloadingManager

        return ImplSpec(name, CPUOffloadingManager, ReqContext, _own_state)
    if name == "reference":
        from kvoffload.reference import CPUOffloadingManager as ReferenceManager

        return ImplSpec(name, ReferenceManager, ReqContext, _own_state)
    if name in ("vllm", "vllm-deep"):
        oracle_mod = _load_tool("vllm_oracle")
        oracle = oracle_mod.load()
        state = oracle_mod.state_of if name == "vllm-deep" else None
        return ImplSpec(name, oracle.CPUOffloadingManager, oracle.ReqContext, state)
    raise ValueError(f"unknown implementation {name!r}; known: {IMPL_NAMES}")


#: The recording plug-in policies (``tests/_helpers.py``) by the driver's policy name.
PLUGIN_CLASSES = {"mru": "RecordedMRUPolicy", "random": "RecordedRandomPolicy"}

#: The module ``install_plugins`` makes of them.
PLUGIN_MODULE = "kvoffload_driver_plugins"


def install_plugins(vllm: bool) -> str:
    """Make the recording plug-ins importable in this process (subclassing vLLM's
    ``CachePolicy`` when ``vllm``, which needs the oracle loaded, else kvoffload's); the
    module's name."""
    if PLUGIN_MODULE not in sys.modules:
        from _helpers import OWN_POLICY, VLLM_POLICIES

        if vllm:
            _load_tool("vllm_oracle").load()
        module = types.ModuleType(PLUGIN_MODULE)
        code = compile(VLLM_POLICIES if vllm else OWN_POLICY, f"<{PLUGIN_MODULE}>", "exec")
        exec(code, module.__dict__)  # the suite's own source text
        sys.modules[PLUGIN_MODULE] = module
    return PLUGIN_MODULE


def plugin_impl(
    name: str,
    manager_cls: Callable[..., Any],
    context_cls: type,
    classes: Mapping[str, tuple[str, str]],
    state: Callable[[Any], dict[str, Any]] | None,
) -> ImplSpec:
    """A manager running, for the driver's policy name, the plug-in ``classes[name]`` (its
    module and class name)."""

    def make(**kwargs: Any) -> Any:
        module, cls = classes[kwargs["cache_policy"]]
        return manager_cls(**{**kwargs, "cache_policy": cls, "cache_policy_module_path": module})

    return ImplSpec(name, make, context_cls, state)


def plugin_spec(spec: ImplSpec, module: str) -> ImplSpec:
    """``spec``'s manager driving the recording plug-in of ``module`` that the driver's policy
    name (``mru`` or ``random``) stands for; its state is what ``plugin_state`` reads."""
    classes = {name: (module, cls) for name, cls in PLUGIN_CLASSES.items()}
    return plugin_impl(spec.name, spec.manager_cls, spec.context_cls, classes, plugin_state)


def plugin_state(mgr: Any) -> dict[str, Any]:
    """The calls ``mgr`` made of its recording plug-in since the last look (all but ``get``,
    in order, with their arguments and ``evict``'s answers), and the plug-in's chunks (the
    session checks their ref counts against its model)."""
    policy = mgr.policy if hasattr(mgr, "policy") else mgr._policy  # vLLM's keeps it private
    calls, policy.calls = policy.calls, []
    resident = {key: (chunk.chunk_id, chunk.ref_cnt) for key, chunk in policy.chunks.items()}
    return {"calls": calls, "resident": resident}


class Impl:
    """One running manager with its own mirror contexts and its open event iterator."""

    def __init__(self, spec: ImplSpec, config: Config) -> None:
        self.spec = spec
        self.name = spec.name
        self.mgr = spec.manager_cls(**config.manager_kwargs())
        self.ctx: dict[str, Any] = {}
        self.events: Iterator[Any] | None = None

    def run(self, op: Op) -> Any:
        """Apply ``op``; return its canonical result.

        The prepare calls get lists and the others tuples: both are the Collections vLLM takes.
        """
        m, kind = self.mgr, op.kind
        ctx = self.ctx.get(op.rid) if op.rid is not None else None
        if kind == "lookup":
            return canon(m.lookup(op.keys[0], ctx))
        if kind == "prepare_store":
            return canon(m.prepare_store(list(op.keys), ctx))
        if kind == "complete_store":
            return canon(m.complete_store(op.keys, ctx, success=op.arg))
        if kind == "prepare_load":
            return canon(m.prepare_load(list(op.keys), ctx))
        if kind == "prepare_read":
            if not hasattr(m, "prepare_read"):  # vLLM's: its tiering primary tier's read
                return canon(m._prepare_load(list(op.keys), ctx, record_access=False))
            return canon(m.prepare_read(list(op.keys), ctx))
        if kind == "complete_load":
            return canon(m.complete_load(op.keys, ctx))
        if kind == "touch":
            return canon(m.touch(op.keys, ctx))
        if kind == "take_events":
            self.events = iter(m.take_events())
            return self._step_events(op.arg)
        if kind == "events_more":
            return self._step_events(op.arg)
        if kind == "events_drop":
            self.events = None
            return None
        if kind == "get_stats":
            return canon(m.get_stats())
        if kind == "lookup_prefix":
            if not hasattr(m, "lookup_prefix"):  # a kvoffload extension: count leading HITs
                hits = itertools.takewhile(lambda k: m.lookup(k, ctx).name == "HIT", op.keys)
                return canon(sum(1 for _ in hits))
            return canon(m.lookup_prefix(list(op.keys), ctx))
        if kind == "get_load_source":
            return canon(m.get_load_source(op.keys[0], ctx))
        if kind == "new_request":
            assert op.rid is not None
            ctx = self.ctx[op.rid] = self.spec.context_cls(op.rid)
            for k, p in op.arg or ():
                ctx.set_offload_key_position(k, p)
            return None
        if kind == "set_position":
            assert ctx is not None
            for k, p in op.arg:
                ctx.set_offload_key_position(k, p)
            return None
        if kind == "on_new_request":
            return canon(m.on_new_request(ctx))
        if kind == "finish":
            return canon(m.on_request_finished(ctx))
        if kind == "reset_cache":
            return canon(m.reset_cache())
        if kind == "misc":
            with m.lock:
                return canon((m.config_info(), m.has_pending_work()))
        raise ValueError(f"unknown op kind {kind!r}")

    def _step_events(self, n: int | None) -> Any:
        assert self.events is not None
        taken = list(self.events) if n is None else list(itertools.islice(self.events, n))
        return ("events", tuple(canon(e) for e in taken))


# --- the model of what is legal ---


@dataclass
class Req:
    """What the driver knows of one request's state in the managers."""

    rid: str
    current: bool = False
    finished: bool = False
    seen: set[bytes] = field(default_factory=set)  # keys surely recorded (a lower bound)


class Model:
    """Key states, jobs in flight and request states, as implied by the observables."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.state: dict[bytes, int] = {}  # resident keys: -1 pending, 0 ready, n pinned
        self.reqs: dict[str, Req] = {}
        self.loads: list[tuple[str, list[bytes]]] = []  # pins not yet completed, per load
        self.stores: list[tuple[str, tuple[bytes, ...]]] = []  # stores with a key still pending
        self.done_stores: deque[tuple[str, tuple[bytes, ...]]] = deque(maxlen=4)
        self.events_open = False

    def readable(self, k: bytes) -> bool:
        """Ready or pinned."""
        return self.state.get(k, -1) >= 0

    def locked(self, req: Req) -> bool:
        """True when the request may record no new key (its current state is finished)."""
        return req.current and req.finished

    def legal(self, op: Op) -> bool:
        """Whether ``op`` is a legal call in the current state (SPEC.md, last section)."""
        kind = op.kind
        if kind == "new_request":
            return op.rid not in self.reqs
        req = self.reqs.get(op.rid) if op.rid is not None else None
        if op.rid is not None and req is None:
            return False
        if kind == "prepare_load":
            assert req is not None
            return all(self.readable(k) for k in op.keys) and (
                not self.locked(req) or all(k in req.seen for k in op.keys)
            )
        if kind == "prepare_read":
            return all(self.readable(k) for k in op.keys)
        if kind == "complete_load":
            return all(self.state.get(k, 0) >= n for k, n in Counter(op.keys).items())
        if kind == "prepare_store":
            assert req is not None
            return len(set(op.keys)) == len(op.keys) and (
                not self.locked(req)
                or all(k in req.seen or self.state.get(k) == -1 for k in op.keys)
            )
        if kind == "events_more":
            return self.events_open
        return True

    def _recording(self, req: Req) -> Req:
        if not req.current:  # stale or no state: the call creates fresh, unfinished state
            req.current, req.finished = True, False
            req.seen = set()
        return req

    def update(self, op: Op, res: Any) -> str | None:
        """Fold a call's (agreed) result into the model; return a contradiction, if any."""
        kind, state = op.kind, self.state
        if kind == "lookup":
            s = state.get(op.keys[0])
            want = "MISS" if s is None else "HIT_PENDING" if s < 0 else "HIT"
            if res != ("LookupResult", want):
                return f"lookup gave {render(res)}, the model expects {want}"
        elif kind == "prepare_store":
            return self._update_store(op, res)
        elif kind == "complete_store":
            for k in op.keys:
                if state.get(k) == -1:
                    if op.arg:
                        state[k] = 0
                    else:
                        del state[k]
            kept = [job for job in self.stores if any(state.get(k) == -1 for k in job[1])]
            self.done_stores.extend(job for job in self.stores if job not in kept)
            self.stores = kept
        elif kind == "prepare_load":
            for k in op.keys:
                state[k] += 1
            self.loads.append((op.rid or "", list(op.keys)))
            self._recording(self.reqs[op.rid or ""]).seen.update(op.keys)
        elif kind == "prepare_read":  # pins, and no request records the keys
            for k in op.keys:
                state[k] += 1
            self.loads.append((op.rid or "", list(op.keys)))
        elif kind == "complete_load":
            for k in op.keys:
                state[k] -= 1
                job = next(j for j in self.loads if k in j[1])
                job[1].remove(k)
            self.loads = [job for job in self.loads if job[1]]
        elif kind == "new_request":
            self.reqs[op.rid or ""] = Req(op.rid or "")
        elif kind == "on_new_request":
            self._recording(self.reqs[op.rid or ""])
        elif kind == "finish":
            req = self.reqs[op.rid or ""]
            if req.current:
                req.finished = True
        elif kind == "reset_cache":
            state.clear()
            self.loads.clear()
            self.stores.clear()
            self.done_stores.clear()
            for req in self.reqs.values():
                req.current = req.finished = False
                req.seen = set()
        elif kind == "take_events":
            self.events_open = True
        elif kind == "events_drop":
            self.events_open = False
        return None

    def _update_store(self, op: Op, res: Any) -> str | None:
        state, tracker = self.state, self.config.store_threshold >= 2
        req = self._recording(self.reqs[op.rid or ""])
        existing = [k for k in op.keys if self.readable(k)]
        absent = [k for k in op.keys if k not in state]
        if res is None:
            req.seen.update(existing)
            if not tracker:  # every absent key was a candidate, and candidates are recorded
                req.seen.update(absent)
            return None
        _, to_store, _spec, evicted = res
        if (not tracker and list(to_store) != absent) or not set(to_store) <= set(absent):
            return f"keys_to_store {render(to_store)} do not fit the absent keys {render(absent)}"
        for k in evicted:
            if state.get(k) != 0 or k in op.keys:
                return f"evicted {key_name(k)}, which is not an evictable, unoffered chunk"
            del state[k]
        for k in to_store:
            state[k] = -1
        if to_store:
            self.stores.append((op.rid or "", tuple(to_store)))
        req.seen.update(existing)
        req.seen.update(to_store)
        return None


# --- choosers: where the randomness comes from ---


class Chooser:
    """The generator's source of choices."""

    def chance(self, p: float) -> bool:
        """True with probability ``p`` (shrinks to False)."""
        raise NotImplementedError

    def int(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]``."""
        raise NotImplementedError

    def pick(self, seq: Sequence[Any]) -> Any:
        """One element of a non-empty sequence."""
        return seq[self.int(0, len(seq) - 1)]

    def sample(self, seq: Sequence[Any], k: builtins.int) -> list[Any]:
        """``k`` distinct elements, in a random order."""
        pool = list(seq)
        return [pool.pop(self.int(0, len(pool) - 1)) for _ in range(k)]

    def weighted(self, kinds: Sequence[str], cum: Sequence[float]) -> str:
        """A kind, drawn by cumulative weights."""
        return kinds[self.int(0, len(kinds) - 1)]


class RandomChooser(Chooser):
    """Choices from a seeded ``random.Random``."""

    def __init__(self, rng: random.Random) -> None:
        self.rng = rng

    def chance(self, p: float) -> bool:
        """True with probability ``p``."""
        return self.rng.random() < p

    def int(self, lo: int, hi: int) -> int:
        """An int in ``[lo, hi]``."""
        return self.rng.randint(lo, hi)

    def sample(self, seq: Sequence[Any], k: builtins.int) -> list[Any]:
        """``k`` distinct elements, in a random order."""
        return self.rng.sample(list(seq), k)

    def weighted(self, kinds: Sequence[str], cum: Sequence[float]) -> str:
        """A kind, drawn by cumulative weights."""
        return self.rng.choices(kinds, cum_weights=cum)[0]


# --- the generator of legal ops ---

#: Relative frequency of each op kind in random sequences.
WEIGHTS: dict[str, float] = {
    "prepare_store": 16,
    "complete_store": 12,
    "prepare_load": 8,
    "prepare_read": 2,
    "complete_load": 8,
    "lookup": 6,
    "touch": 5,
    "get_stats": 3,
    "take_events": 3,
    "new_request": 2.5,
    "finish": 2.5,
    "lookup_prefix": 2,
    "events_more": 1.5,
    "set_position": 1.5,
    "on_new_request": 0.7,
    "events_drop": 0.5,
    "misc": 0.3,
    "get_load_source": 0.3,
    "reset_cache": 0.25,
}


class Generator:
    """Draws legal ops from the model's state; requests follow a scheduler-like lifecycle."""

    def __init__(self, model: Model, ch: Chooser, kinds: Sequence[str] = tuple(WEIGHTS)) -> None:
        self.model = model
        cfg = model.config
        self.universe = [key(h, g) for h in range(cfg.num_hashes) for g in cfg.groups]
        # Documents: chains of block hashes that requests share prefixes of.
        self.docs = [
            ch.sample(range(cfg.num_hashes), ch.int(1, min(cfg.num_hashes, 24)))
            for _ in range(ch.int(1, 4))
        ]
        self.kinds = list(kinds)
        self.cum = list(itertools.accumulate(WEIGHTS[k] for k in self.kinds))
        self.open: list[str] = []  # requests not yet finished by the driver
        self.closed: deque[str] = deque(maxlen=3)  # recently finished: late calls still come
        self.queue: deque[Op] = deque()
        self.next_rid = 0
        self.rid_prefix = "r"  # request names: r0, r1, ...
        # The workload shape of each request: its keys head to tail, and their positions.
        self.prompts: dict[str, list[bytes]] = {}
        self.positions: dict[str, dict[bytes, int]] = {}
        self.styles: dict[str, tuple[bool, float]] = {}

    def next_op(self, ch: Chooser, kind: str | None = None) -> Op | None:
        """The next legal op: queued follow-ups first, then one of ``kind`` (None when there is
        none to make) or, without a kind, of a kind drawn by weight (never None)."""
        while self.queue:
            op = self.queue.popleft()
            if self.model.legal(op):
                return op
        if not self.open:
            return self.make("new_request", ch)
        if kind is not None:
            return self.make(kind, ch)
        for _ in range(20):
            made = self.make(ch.weighted(self.kinds, self.cum), ch)
            if made is not None:
                return made
        return Op("get_stats")

    def make(self, kind: str, ch: Chooser) -> Op | None:
        """An op of ``kind``, or None when none is legal or useful now."""
        op: Op | None = getattr(self, "_" + kind)(ch)
        return op

    # helpers

    def _req(self, ch: Chooser) -> tuple[Req, list[bytes]]:
        """A request to act for (rarely a recently finished one) and its prompt keys."""
        if self.closed and (not self.open or ch.chance(0.05)):
            rid = ch.pick(self.closed)
        else:
            rid = ch.pick(self.open)
        return self.model.reqs[rid], self.prompts[rid]

    def _window(self, ch: Chooser, keys: Sequence[bytes], most: int = 8) -> list[bytes]:
        if not keys:
            return []
        start = ch.int(0, len(keys) - 1)
        return list(keys[start : start + ch.int(1, most)])

    def _arrange(self, ch: Chooser, keys: list[bytes]) -> list[bytes]:
        if len(keys) > 1 and ch.chance(0.15):
            keys.sort(key=lambda k: k[-4:])  # group-major, as a per-group scheduler would offer
        if len(keys) > 1 and ch.chance(0.05):
            keys = ch.sample(keys, len(keys))
        return keys

    def _extra(self, ch: Chooser, keys: list[bytes], p: float) -> list[bytes]:
        if ch.chance(p):
            keys = keys + [ch.pick(self.universe) for _ in range(ch.int(1, 3))]
        return keys

    # one method per op kind

    def _new_request(self, ch: Chooser) -> Op | None:
        cfg = self.model.config
        if len(self.open) >= cfg.max_active:
            return None
        rid = f"{self.rid_prefix}{self.next_rid}"
        self.next_rid += 1
        self.prompts[rid], self.positions[rid] = [], {}
        # Position style: equal positions (ties) or by block index; known for no, some or all keys.
        self.styles[rid] = (
            ch.chance(0.15),
            0.0 if ch.chance(0.2) else 0.5 if ch.chance(0.4) else 1.0,
        )
        doc = ch.pick(self.docs)
        hashes = list(doc[: ch.int(1, len(doc))])
        if ch.chance(0.3):
            hashes += [ch.int(0, cfg.num_hashes - 1) for _ in range(2)]
        initial = self._grow(ch, rid, list(dict.fromkeys(hashes)))
        self.open.append(rid)
        if ch.chance(0.7):
            self.queue.append(Op("on_new_request", rid))
        return Op("new_request", rid, (), tuple(initial))

    def _grow(self, ch: Chooser, rid: str, hashes: list[int]) -> list[tuple[bytes, int]]:
        """Append blocks to a request's prompt; return the positions to set now."""
        prompt, positions = self.prompts[rid], self.positions[rid]
        ties, share = self.styles[rid]
        known = []
        groups = self.model.config.groups
        for j, h in enumerate(hashes, len(prompt) // len(groups)):
            pos = 16 * (ch.int(0, 3) if ties else j + 1)
            for g in groups:
                prompt.append(key(h, g))
                positions[prompt[-1]] = pos
                if share == 1.0 or (share and ch.chance(share)):
                    known.append((prompt[-1], pos))
        return known

    def _set_position(self, ch: Chooser) -> Op | None:
        req, prompt = self._req(ch)
        pairs = []
        for k in self._window(ch, prompt, 4):
            if ch.chance(0.1):  # a changed position, now and then an extreme one
                pos = ch.pick(_ODD_POSITIONS) if ch.chance(0.2) else 16 * ch.int(0, 8)
            else:
                pos = self.positions[req.rid][k]
            pairs.append((k, pos))
        return Op("set_position", req.rid, (), tuple(pairs))

    def _on_new_request(self, ch: Chooser) -> Op | None:
        return Op("on_new_request", self._req(ch)[0].rid)

    def _finish(self, ch: Chooser) -> Op | None:
        if self.open and not ch.chance(0.1):
            rid = self.open.pop(ch.int(0, len(self.open) - 1))
            self.closed.append(rid)
            return Op("finish", rid)
        return Op("finish", ch.pick(self.closed)) if self.closed else None  # a repeat

    def _lookup(self, ch: Chooser) -> Op | None:
        req, prompt = self._req(ch)
        pool = prompt if not ch.chance(0.3) else self.universe
        return Op("lookup", req.rid, (ch.pick(pool),))

    def _get_load_source(self, ch: Chooser) -> Op | None:
        return Op("get_load_source", self._req(ch)[0].rid, (ch.pick(self.universe),))

    def _lookup_prefix(self, ch: Chooser) -> Op | None:
        req, prompt = self._req(ch)
        return Op("lookup_prefix", req.rid, tuple(prompt[: ch.int(0, len(prompt))]))

    def _touch(self, ch: Chooser) -> Op | None:
        req, prompt = self._req(ch)
        if ch.chance(0.02):
            return Op("touch", req.rid, ())
        if not ch.chance(0.3):
            keys = self._window(ch, prompt)
        else:
            keys = [ch.pick(self.universe) for _ in range(ch.int(1, 4))]
        if ch.chance(0.05):
            keys.append(ch.pick(keys))
        return Op("touch", req.rid, tuple(self._arrange(ch, keys)))

    def _prepare_store(self, ch: Chooser) -> Op | None:
        req, prompt = self._req(ch)
        if ch.chance(0.02):
            return Op("prepare_store", req.rid, ())
        state = self.model.state
        fresh = next((i for i, k in enumerate(prompt) if k not in state), None)
        if fresh is None and len(prompt) < 48 and not self.model.locked(req) and ch.chance(0.5):
            # The request generated new blocks: grow its prompt, set positions, then offer them.
            hashes = [ch.int(0, self.model.config.num_hashes - 1) for _ in range(ch.int(1, 4))]
            hashes = [h for h in dict.fromkeys(hashes) if key(h) not in prompt]
            if hashes:
                start = len(prompt)
                known = self._grow(ch, req.rid, hashes)
                store = Op("prepare_store", req.rid, tuple(prompt[start:]))
                if not known:
                    return store
                self.queue.append(store)
                return Op("set_position", req.rid, (), tuple(known))
        if fresh is not None and ch.chance(0.6):  # the blocks past the cached prefix
            keys = prompt[fresh : fresh + ch.int(1, 8)]
        elif ch.chance(0.1):
            keys = prompt[:16]
        else:
            keys = self._window(ch, prompt)
        keys = list(dict.fromkeys(self._extra(ch, keys, 0.15)))
        if self.model.locked(req):
            keys = [k for k in keys if k in req.seen or state.get(k) == -1]
        return Op("prepare_store", req.rid, tuple(self._arrange(ch, keys))) if keys else None

    def _prepare_load(self, ch: Chooser) -> Op | None:
        req, prompt = self._req(ch)
        model = self.model
        if ch.chance(0.2):
            readable = [k for k, s in model.state.items() if s >= 0]
        else:
            readable = [k for k in prompt if model.readable(k)]
        if model.locked(req):
            readable = [k for k in readable if k in req.seen]
        return self._pin_op(ch, "prepare_load", req, readable)

    def _prepare_read(self, ch: Chooser) -> Op | None:
        # A tier's copy of stored keys: often the keys a store of the request just completed,
        # for a request that may have finished since (vLLM's tiering cascades them then).
        req, prompt = self._req(ch)
        model = self.model
        if model.done_stores and ch.chance(0.6):
            rid, keys = ch.pick(model.done_stores)
            req = model.reqs[rid]
            readable = [k for k in keys if model.readable(k)]
        else:
            readable = [k for k in prompt if model.readable(k)]
        return self._pin_op(ch, "prepare_read", req, readable)

    def _pin_op(self, ch: Chooser, kind: str, req: Req, readable: list[bytes]) -> Op | None:
        """A ``kind`` call pinning a window of ``readable`` (now and then a key twice)."""
        if not readable:
            return None
        keys = self._window(ch, readable)
        if ch.chance(0.05):
            keys.append(ch.pick(keys))
        return Op(kind, req.rid, tuple(self._arrange(ch, keys)))

    def _complete_load(self, ch: Chooser) -> Op | None:
        if not self.model.loads:
            return None
        rid, keys = ch.pick(self.model.loads)
        if len(keys) > 1 and ch.chance(0.3):
            keys = ch.sample(keys, ch.int(1, len(keys) - 1))
        elif ch.chance(0.1):
            keys = ch.sample(keys, len(keys))
        return Op("complete_load", rid, tuple(keys))

    def _complete_store(self, ch: Chooser) -> Op | None:
        model = self.model
        if model.done_stores and ch.chance(0.3 if not model.stores else 0.05):
            rid, keys = ch.pick(model.done_stores)  # a repeat of a finished store
        elif model.stores:
            rid, keys = ch.pick(model.stores)
        else:
            return None
        keys = list(keys)
        if len(keys) > 1 and ch.chance(0.25):
            keys = ch.sample(keys, ch.int(1, len(keys) - 1))
        keys = self._extra(ch, keys, 0.1)
        if ch.chance(0.05):
            keys.append(ch.pick(keys))
        if len(keys) > 1 and ch.chance(0.1):
            keys = ch.sample(keys, len(keys))
        return Op("complete_store", rid, tuple(keys), not ch.chance(0.2))

    def _take_events(self, ch: Chooser) -> Op | None:
        return Op("take_events", arg=ch.int(0, 2) if ch.chance(0.4) else None)

    def _events_more(self, ch: Chooser) -> Op | None:
        if not self.model.events_open:
            return None
        return Op("events_more", arg=ch.int(1, 2) if ch.chance(0.4) else None)

    def _events_drop(self, ch: Chooser) -> Op | None:
        return Op("events_drop") if self.model.events_open else None

    def _get_stats(self, ch: Chooser) -> Op | None:
        return Op("get_stats")

    def _reset_cache(self, ch: Chooser) -> Op | None:
        return Op("reset_cache")

    def _misc(self, ch: Chooser) -> Op | None:
        return Op("misc")


# --- running side by side ---


class Mismatch(AssertionError):
    """The implementations disagreed (or broke the model) at one step of a sequence."""

    def __init__(
        self,
        what: str,
        index: int,
        op: Op,
        detail: dict[str, str],
        config: Config,
        history: list[tuple[Op, Any]],
        label: str = "",
        managers: Mapping[str, Config] | None = None,
        names: Sequence[str] | None = None,
    ) -> None:
        self.what, self.index, self.op, self.detail = what, index, op, detail
        self.config, self.history, self.label = config, history, label
        #: The managers by the name a repro gives them (several: a shared-context run, see
        #: ``SharedSession``), and the one each step of the history ran on ("": a context step).
        self.managers = dict(managers) if managers is not None else {"m": config}
        self.names = list(names) if names is not None else [""] * len(history)
        super().__init__(self.report())

    def report(self, context: int | None = 40) -> str:
        """The divergence, the calls that led to it, and a Python repro."""
        lines = [f"{self.what} mismatch at call #{self.index}: {self.op}  [{self.label}]"]
        lines += [f"  {name}: {text}" for name, text in self.detail.items()]
        if len(self.managers) == 1:
            lines.append(f"config: {self.config}")
        else:
            lines += [f"manager {name}: {cfg}" for name, cfg in self.managers.items()]
        steps = [(n, op, res) for n, (op, res) in zip(self.names, self.history, strict=True)]
        return "\n".join(lines + _history_lines(steps, context))

    def repro(self) -> str:
        """A standalone Python script replaying the history on the reference manager(s)."""
        first = next(iter(self.managers))
        steps = [
            (n or first, op, res) for n, (op, res) in zip(self.names, self.history, strict=True)
        ]
        return _repro_script(self.managers, steps, self.detail)


def _history_lines(steps: Sequence[tuple[str, Op, Any]], context: int | None) -> list[str]:
    """A report's history: the last ``context`` steps (all: None), each with the name of the
    manager it ran on (when there are several) and its result."""
    shown = steps if context is None else steps[-context:]
    if len(shown) < len(steps):
        lines = [f"history (last {len(shown)} of {len(steps)} calls):"]
    else:
        lines = ["history:"]
    for i, (name, op, res) in enumerate(shown, len(steps) - len(shown)):
        out = "" if res is None and op.kind != "prepare_store" else f" -> {render(res)}"
        lines.append(f"  #{i} {name + '.' if name else ''}{op}{out}")
    return lines


def _repro_script(
    managers: Mapping[str, Config], steps: Sequence[tuple[str, Op, Any]], detail: Mapping[str, str]
) -> str:
    """A standalone Python script building the reference managers ``managers`` (by variable
    name) and replaying ``steps`` on them; the last step's result is printed."""
    head = [
        "from itertools import islice",
        "from kvoffload import ReqContext, make_offload_key",
        "from kvoffload.reference import CPUOffloadingManager",
        "",
        KEY_SOURCE,
        "",
        "def take(it, n):",
        "    return list(islice(it, n))",
        "",
    ]
    head += [
        f"{name} = CPUOffloadingManager("
        + ", ".join(f"{k}={v!r}" for k, v in cfg.manager_kwargs().items())
        + ")"
        for name, cfg in managers.items()
    ]
    body = []
    for i, (name, op, res) in enumerate(steps):
        lines = op.code(name)
        if i == len(steps) - 1:
            if op.kind not in ("new_request", "set_position", "events_drop"):
                lines[-1] = f"print({lines[-1]})"
            lines += [f"# {who}: {text}" for who, text in detail.items()]
        elif res is not None or op.kind == "prepare_store":
            lines[-1] += f"  # -> {render(res)}"
        body += lines
    return "\n".join(head + body) + "\n"


class Session:
    """Implementations of one configuration, driven in lockstep, plus the model."""

    def __init__(
        self,
        config: Config,
        specs: Sequence[ImplSpec],
        label: str = "",
        introspect: bool = True,
    ) -> None:
        self.config = config
        self.impls = [Impl(spec, config) for spec in specs]
        self.inner = [impl for impl in self.impls if introspect and impl.spec.state is not None]
        self.model = Model(config)
        self.history: list[tuple[Op, Any]] = []
        self.label = label

    def _fail(self, what: str, op: Op, detail: dict[str, str]) -> Mismatch:
        return Mismatch(
            what, len(self.history) - 1, op, detail, self.config, self.history, self.label
        )

    def apply(self, op: Op) -> Any:
        """Run ``op`` everywhere and compare; raise ``Mismatch`` on the first difference."""
        if not self.model.legal(op):
            self.history.append((op, None))
            raise self._fail("driver", op, {"driver": "generated an illegal call"})
        results = []
        for impl in self.impls:
            try:
                results.append(impl.run(op))
            except Exception as exc:  # compared like any other result
                results.append(Raised(type(exc).__name__, str(exc)))
        first = results[0]
        self.history.append((op, first))
        if any(r != first for r in results[1:]):
            shown = [render(r) for r in results]
            if len(set(shown)) < len(shown):  # the readable form hides the difference
                shown = [repr(r) for r in results]
            raise self._fail(
                "result", op, dict(zip([i.name for i in self.impls], shown, strict=True))
            )
        if isinstance(first, Raised):
            raise self._fail("error", op, {"all": render(first)})
        problem = self.model.update(op, first)
        if problem is not None:
            raise self._fail("model", op, {"model": problem})
        if self.inner:
            self._compare_states(op)
        return first

    def _compare_states(self, op: Op) -> None:
        states = []
        for impl in self.inner:
            assert impl.spec.state is not None
            try:
                states.append(impl.spec.state(impl.mgr))
            except Exception as exc:
                raise self._fail("state", op, {impl.name: f"{type(exc).__name__}: {exc}"}) from exc
        first = states[0]
        for impl, st in zip(self.inner[1:], states[1:], strict=True):
            if st != first:
                detail = {}
                for part in first:
                    if st.get(part) != first[part]:
                        a, b = render(first[part]), render(st.get(part))
                        if a == b:  # the readable form hides the difference (a type, say)
                            a, b = repr(first[part]), repr(st.get(part))
                        detail[f"{self.inner[0].name}.{part}"] = a
                        detail[f"{impl.name}.{part}"] = b
                raise self._fail("state", op, detail)
        ref_cnts = {k: rc for k, (_cid, rc) in first["resident"].items()}
        if ref_cnts != self.model.state:
            detail = {"resident ref counts": render(ref_cnts), "model": render(self.model.state)}
            raise self._fail("model", op, detail)


@dataclass
class SequenceResult:
    """What one random sequence did."""

    seed: int
    config: Config
    calls: int
    mismatch: Mismatch | None
    ops: list[Op]


def sequence_config(
    policy: str, threshold: int, seed: int, admission: str = "tracker"
) -> tuple[Config, random.Random]:
    """The configuration of sequence ``seed`` and the random stream that continues it."""
    prefix = "" if admission == "tracker" else f"{admission}/"
    rng = random.Random(f"{prefix}{policy}/{threshold}/{seed}")
    config = Config.draw(RandomChooser(rng), policy, threshold)
    return dataclasses.replace(config, admission=admission), rng


def run_sequence(
    specs: Sequence[ImplSpec],
    policy: str,
    threshold: int,
    seed: int,
    calls: int,
    introspect: bool = True,
    admission: str = "tracker",
) -> SequenceResult:
    """Generate and run one seeded sequence of ``calls`` legal calls."""
    config, rng = sequence_config(policy, threshold, seed, admission)
    session = Session(config, specs, f"{policy} threshold={threshold} seed={seed}", introspect)
    ch = RandomChooser(rng)
    gen = Generator(session.model, ch)
    try:
        for _ in range(calls):
            op = gen.next_op(ch)
            assert op is not None
            session.apply(op)
    except Mismatch as mismatch:
        return SequenceResult(
            seed, config, len(session.history), mismatch, [op for op, _ in session.history]
        )
    return SequenceResult(seed, config, calls, None, [op for op, _ in session.history])


def replay(
    config: Config, ops: Sequence[Op], specs: Sequence[ImplSpec], introspect: bool = True
) -> Mismatch | None:
    """Run ``ops``, skipping those that are not legal where they now fall; return the mismatch."""
    session = Session(config, specs, "replay", introspect)
    try:
        for op in ops:
            if session.model.legal(op):
                session.apply(op)
    except Mismatch as mismatch:
        return mismatch
    return None


def shrink(
    config: Config,
    ops: list[Op],
    specs: Sequence[ImplSpec],
    introspect: bool = True,
    budget_s: float = 60.0,
) -> Mismatch | None:
    """Cut a failing sequence down (ddmin over calls, then keys); return the smallest mismatch."""
    deadline = time.monotonic() + budget_s
    best = replay(config, ops, specs, introspect)
    if best is None:
        return None
    target = (best.what, best.op.kind)

    def fails(candidate: list[Op]) -> Mismatch | None:
        found = replay(config, candidate, specs, introspect)
        return found if found is not None and (found.what, found.op.kind) == target else None

    ops = [op for op, _ in best.history]
    n = 2
    while len(ops) >= 2 and time.monotonic() < deadline:
        size = -(-len(ops) // n)
        for i in range(n):
            found = fails(ops[: i * size] + ops[(i + 1) * size :])
            if found is not None:
                best, ops = found, [op for op, _ in found.history]
                n = max(n - 1, 2)
                break
        else:
            if n >= len(ops):
                break
            n = min(len(ops), 2 * n)
    for i in range(len(ops)):  # then drop single keys (or positions) from each call
        j = 0
        while i < len(ops) and j < len(_items(ops[i])) and time.monotonic() < deadline:
            found = fails([*ops[:i], _without(ops[i], j), *ops[i + 1 :]])
            if found is not None:
                best, ops = found, [o for o, _ in found.history]
            else:
                j += 1
    return best


# --- two managers sharing their request contexts ---

#: Calls that make a manager's request state current on the context (replacing any other's).
_RECORDING = frozenset({"prepare_store", "prepare_load", "on_new_request"})

#: Steps that change a context rather than call a manager: made once, known to both models.
_CONTEXT_OPS = frozenset({"new_request", "set_position"})


class SharedSession:
    """Two managers per implementation, ``a`` and ``b``, that share every request context, as
    two offloading tiers of one engine would.

    A manager's recording call replaces the other's request state on the context (vLLM's
    managers keep it under one type), so the other's model forgets what that request recorded.
    Each manager has its own model and generator; the generators share the requests.
    """

    NAMES = ("a", "b")

    def __init__(
        self,
        configs: Sequence[Config],
        specs: Sequence[ImplSpec],
        ch: Chooser,
        label: str = "",
        introspect: bool = True,
    ) -> None:
        self.configs = dict(zip(self.NAMES, configs, strict=True))
        self.sessions = [
            Session(cfg, specs, f"{label} manager {name}", introspect)
            for name, cfg in self.configs.items()
        ]
        first, other = self.sessions
        for mine, theirs in zip(first.impls, other.impls, strict=True):
            theirs.ctx = mine.ctx  # one context per request and implementation
        self.gens = [Generator(s.model, ch) for s in self.sessions]
        lead, follow = self.gens
        follow.rid_prefix = "s"
        follow.prompts, follow.positions, follow.styles = lead.prompts, lead.positions, lead.styles
        follow.open, follow.closed = lead.open, lead.closed
        self.steps: list[tuple[str, Op, Any]] = []

    def step(self, which: int, ch: Chooser, kind: str | None = None) -> Any:
        """Draw manager ``which``'s next legal op (of ``kind``, if given and one is legal) and
        apply it."""
        op = self.gens[which].next_op(ch, kind)
        if op is None:
            return None
        return self.apply(which, op)

    def apply(self, which: int, op: Op) -> Any:
        """Run ``op`` on manager ``which`` of every implementation (a context step once, for
        both); raise ``Mismatch``, with both managers' steps, on the first difference."""
        me = self.sessions[which]
        name = "" if op.kind in _CONTEXT_OPS else self.NAMES[which]  # a context step: no manager's
        try:
            if op.kind in _CONTEXT_OPS:
                res = self.sessions[0].apply(op)
                for s in self.sessions[1:]:
                    s.model.update(op, res)
            else:
                res = me.apply(op)
                if op.kind in _RECORDING:
                    for s in self.sessions:
                        req = s.model.reqs.get(op.rid or "")
                        if s is not me and req is not None:
                            req.current = False  # its state on the context was replaced
        except Mismatch as inner:
            self.steps.append((name, op, inner.history[-1][1]))
            history = [(op, res) for _, op, res in self.steps]
            names = [name for name, _, _ in self.steps]
            raise Mismatch(
                inner.what,
                len(self.steps) - 1,
                inner.op,
                inner.detail,
                inner.config,
                history,
                inner.label,
                self.configs,
                names,
            ) from None
        self.steps.append((name, op, res))
        return res


def run_shared_sequence(
    specs: Sequence[ImplSpec],
    policies: tuple[str, str],
    threshold: int,
    seed: int,
    calls: int,
    introspect: bool = True,
) -> SequenceResult:
    """One seeded sequence of ``calls`` legal calls on two managers (of ``policies``) sharing
    their request contexts; runs of calls on one manager alternate with runs on the other."""
    rng = random.Random(f"shared/{policies[0]}+{policies[1]}/{threshold}/{seed}")
    ch = RandomChooser(rng)
    config = Config.draw(ch, policies[0], threshold)
    configs = [config, dataclasses.replace(config, policy=policies[1])]
    label = f"{'+'.join(policies)} threshold={threshold} seed={seed}"
    session = SharedSession(configs, specs, ch, label, introspect)
    which = 0
    try:
        for _ in range(calls):
            if ch.chance(0.3):
                which = 1 - which
            session.step(which, ch)
    except Mismatch as mismatch:
        ops = [op for _, op, _ in session.steps]
        return SequenceResult(seed, config, len(session.steps), mismatch, ops)
    return SequenceResult(seed, config, calls, None, [op for _, op, _ in session.steps])


def first_shared_mismatch(
    specs: Sequence[ImplSpec],
    policies: tuple[str, str],
    count: int,
    calls: int,
    thresholds: Sequence[int] = (1, 2, 3),
) -> Mismatch | None:
    """The first mismatch of ``count`` seeded shared-context sequences (seed ``i`` with threshold
    ``thresholds[i % len(thresholds)]``), or None."""
    for seed in range(count):
        threshold = thresholds[seed % len(thresholds)]
        result = run_shared_sequence(specs, policies, threshold, seed, calls)
        if result.mismatch is not None:
            return result.mismatch
    return None


def _items(op: Op) -> tuple[Any, ...]:
    """What shrinking may drop one at a time from a call: its keys, or the positions it sets."""
    return tuple(op.arg or ()) if op.kind in ("new_request", "set_position") else op.keys


def _without(op: Op, j: int) -> Op:
    items = _items(op)
    rest = items[:j] + items[j + 1 :]
    return (
        op._replace(arg=rest)
        if op.kind in ("new_request", "set_position")
        else op._replace(keys=rest)
    )
