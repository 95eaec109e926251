"""A seeded scheduler driving vLLM 0.33.0's ``TieringOffloadingManager`` with each primary tier.

Each implementation is a tiering manager built by a spec through vLLM's
``OffloadingSpecFactory``: vLLM's own ``TieringOffloadingSpec`` (its
``CPUPrimaryTierOffloadingManager``) or kvoffload's ``KVOffloadTieringOffloadingSpec``
(``KVOffloadCPUPrimaryTier``), each with vLLM's in-memory ``example`` secondary tier, which
completes every transfer at once, so every run is deterministic. The managers run side by side,
every call's answer compared as it comes (``_driver.canon``), and after each step their primary
tiers' state and their secondary tiers' contents.

A step is a scheduler's: the last step's loads and stores complete (a few stores fail); new
requests arrive (``on_new_request``, a lookup per key up to the first that is not a HIT, then
``prepare_load`` and ``touch`` of the hit prefix, or a wait when the next key is being stored or
promoted); each running request offers its next batch (``prepare_store``) and finishes once all
its keys are offered; now and then a lookup of any key, events, stats or a reset; then
``on_schedule_end``. The tiers interact the way they do in vLLM: a completed store is cascaded
to the secondary tier (``prepare_read`` of the primary, then ``complete_read`` when the copy
completes), and a key evicted from the primary tier but held by the secondary one is promoted
back by a lookup (``prepare_write``, then ``complete_write``). The driver plays the worker as
well: a store writes each key's bytes into its chunk's row of the shared region, and when every
secondary tier copies bytes (``ScriptedTier`` does, vLLM's example tier does not) each load
checks that its chunks' rows hold its keys, however the chunks got there.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import random
import sys
import tempfile
import time
import types
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

import _driver
from _vllm import offloading_config

#: ``spec_name`` and ``spec_module_path`` of each implementation (vLLM's spec is in-tree).
SPECS: dict[str, dict[str, str]] = {
    "vllm": {},
    "kvoffload": {
        "spec_name": "KVOffloadTieringOffloadingSpec",
        "spec_module_path": "kvoffload.integrations.vllm",
    },
}


#: The module ``install_tiers`` makes, holding ``ScriptedTier``.
TIERS_MODULE = "kvoffload_test_tiers"

_SCRIPTED_TIER = '''
import collections
import contextlib
import os
import shutil
import threading

import numpy as np

from vllm.v1.kv_offload.base import (
    LookupResult,
    OffloadPolicy,
    ReqContext,
    RequestOffloadingContext,
)
from vllm.v1.kv_offload.tiering.base import JobResult
from vllm.v1.kv_offload.tiering.example.manager import ExampleSecondaryTierManager
from vllm.v1.kv_offload.tiering.fs.manager import FileSystemTierManager, FsAsyncLookupManager


class ScriptedTier(ExampleSecondaryTierManager):
    """vLLM's in-memory example tier, made to behave like a slower, fallible one by rules that
    depend only on the calls it gets (so two managers that call alike see alike):

    - ``request_level_every``: request rN asks for request-level offloading when N is a
      multiple (the tiering manager then also cascades the request's keys already stored);
    - ``delay``: a job's completion is reported only after that many ``on_schedule_end`` calls;
    - ``fail_every``: a store job whose id is a multiple fails (nothing kept); a promotion
      whose id is a multiple fails, for its second half of keys when it has two or more;
    - ``capacity``: at most that many keys, the oldest dropped first (0: no limit);
    - ``serve_every``: every that many steps a peer asks for the four keys this tier stored
      last, as a peer-to-peer tier's peers do: through the parent manager, a new request, a
      lookup of each (a primary miss may start a promotion), a store job of the hits (the
      primary tier's ``prepare_read``, pins released when the job completes) and the
      request's finish.

    Unlike the example tier it copies the bytes: a store reads each chunk's row of the primary
    tier's view, a promotion writes them back into the row of the chunk the primary allocated.
    """

    copies = True

    def __init__(
        self,
        *args,
        request_level_every=0,
        delay=0,
        fail_every=0,
        capacity=0,
        serve_every=0,
        **kw,
    ):
        super().__init__(*args, **kw)
        self.request_level_every, self.delay = request_level_every, delay
        self.fail_every, self.capacity = fail_every, capacity
        self.serve_every, self.serves = serve_every, 0
        self.held = []  # [steps left, JobResult]
        self.rows = np.asarray(self._primary_kv_view)
        self.data = {}

    def _fails(self, job_id):
        return self.fail_every and job_id % self.fail_every == 0

    def on_new_request(self, req_context):
        n = int(req_context.req_id[1:])
        if self.request_level_every and n % self.request_level_every == 0:
            return RequestOffloadingContext(policy=OffloadPolicy.REQUEST_LEVEL)
        return RequestOffloadingContext()

    def submit_store(self, job):
        if self._fails(job.job_id):
            self.completed_jobs.append(JobResult(job_id=job.job_id, success=False))
        else:
            super().submit_store(job)
            for key, c in zip(job.keys, job.chunk_ids):
                self.data[key] = self.rows[int(c)].tobytes()
            while self.capacity and len(self.chunks) > self.capacity:
                oldest = next(iter(self.chunks))
                del self.chunks[oldest], self.data[oldest]
        self._hold()

    def submit_load(self, job):
        keys = list(job.keys)
        if self._fails(job.job_id) and all(k in self.chunks for k in keys):
            half = keys[: len(keys) // 2]
            self.completed_jobs.append(
                JobResult(job_id=job.job_id, success=False, successful_keys=half or None)
            )
            copied = half
        else:
            super().submit_load(job)
            copied = keys if all(k in self.chunks for k in keys) else []
        for key, c in zip(job.keys, job.chunk_ids):
            if key in copied:
                self.rows[int(c)] = np.frombuffer(self.data[key], dtype=self.rows.dtype)
        self._hold()

    def _hold(self):
        self.held += [[self.delay, r] for r in self.completed_jobs]
        self.completed_jobs = []

    def on_schedule_end(self, context):
        for h in self.held:
            h[0] -= 1

    def serve_external_requests(self, parent):
        self.serves += 1
        if not self.serve_every or self.serves % self.serve_every or not self.chunks:
            return
        ctx = ReqContext(req_id=f"p{self.serves}")
        parent.on_new_request(ctx)
        hits = [k for k in list(self.chunks)[-4:] if parent.lookup(k, ctx) is LookupResult.HIT]
        if hits:
            job = parent.create_store_job(hits, ctx)
            self.held.append([self.delay, JobResult(job_id=job.job_id, success=True)])
        parent.on_request_finished(ctx)

    def get_finished_jobs(self):
        done = [r for left, r in self.held if left <= 0]
        self.held = [h for h in self.held if h[0] > 0]
        return done

    def has_pending_work(self):
        return bool(self.held)

    def drain_jobs(self):
        for h in self.held:
            h[0] = 0

    def shutdown(self):
        super().shutdown()
        self.rows = None  # the region may be unmapped now


class SettledLookups(FsAsyncLookupManager):
    """vLLM's file system tier's lookups, answered at once: the worker thread is ended as it
    starts, and each step's ``flush`` (the tier's ``on_schedule_end``) answers the batch it
    posts, on the calling thread, with the tier's own ``batch_lookup``. So a key the tier was
    asked for is RETRY for the rest of the step and known from the next, as with a worker that
    is never late."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._lookup_queue.put(None)
        self._thread.join()

    def flush(self):
        super().flush()
        while not self._lookup_queue.empty():
            batch = self._lookup_queue.get_nowait()
            by_request = {}
            for key, ctx, _ in batch:
                by_request.setdefault(ctx.req_id, (ctx, []))[1].append(key)
            found = {}
            for ctx, keys in by_request.values():
                found.update(zip(keys, self.batch_lookup(keys, ctx)))
            self._pending_results.put([(k, gen, bool(found[k])) for k, _, gen in batch])

    def shutdown(self):
        self.drain_results()


class LiveFileSystemTier(FileSystemTierManager):
    """vLLM's file system tier as it runs in vLLM (real files under ``root_dir``, its I/O
    thread pool, its lookup thread, its file names and config file), which copies the bytes
    and whose ``shutdown`` removes ``root_dir``. Its threads' timing decides when a lookup is
    answered and when a transfer finishes, so a run with it is not deterministic."""

    copies = True

    def __init__(self, *args, root_dir, **kw):
        super().__init__(*args, root_dir=root_dir, **kw)
        self.root_dir = root_dir

    def files(self):
        """The tier's files, relative to ``root_dir``."""
        return sorted(
            os.path.relpath(os.path.join(folder, name), self.root_dir)
            for folder, _, names in os.walk(self.root_dir)
            for name in names
        )

    def shutdown(self):
        super().shutdown()
        shutil.rmtree(self.root_dir, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(self.root_dir))  # the run's folder, once both are gone


class SettledFileSystemTier(LiveFileSystemTier):
    """`LiveFileSystemTier` settled so that two tiering managers see it alike: lookups as
    `SettledLookups` answers them, and every transfer submitted before a poll finished by it
    (``drain_jobs``), its pool's finished jobs taken in job order (so are the results and the
    tier's events)."""

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self._lookup_manager.shutdown()
        self._lookup_manager = SettledLookups(tier=self, tier_type=self.tier_type)
        finished = self._pool.get_finished
        self._pool.get_finished = lambda: sorted(finished(), key=lambda done: done[0])

    def get_finished_jobs(self):
        self.drain_jobs()
        return super().get_finished_jobs()


class PolledScriptedTier(ScriptedTier):
    """A ``ScriptedTier`` that the tiering manager also services from its tier-poll thread
    between steps (finished jobs collected, peers served), as vLLM's peer-to-peer tier is.
    ``serving_threads`` counts its serves by thread ident."""

    tolerates_off_thread_polling = True

    def __init__(self, *args, **kw):
        super().__init__(*args, **kw)
        self.serving_threads = collections.Counter()

    def serve_external_requests(self, parent):
        self.serving_threads[threading.get_ident()] += 1
        super().serve_external_requests(parent)
'''


def install_tiers() -> str:
    """Make ``ScriptedTier`` importable in this process (the oracle loaded); the module name."""
    if TIERS_MODULE not in sys.modules:
        module = types.ModuleType(TIERS_MODULE)
        exec(compile(_SCRIPTED_TIER, f"<{TIERS_MODULE}>", "exec"), module.__dict__)
        sys.modules[TIERS_MODULE] = module
    return TIERS_MODULE


def scripted_tier(*, polled: bool = False, **rules: int) -> dict[str, Any]:
    """A ``secondary_tiers`` entry: a ``ScriptedTier`` with ``rules`` (a
    ``PolledScriptedTier`` when ``polled``)."""
    kind = "PolledScriptedTier" if polled else "ScriptedTier"
    return {"type": kind, "module_path": install_tiers(), **rules}


def fs_tier(*, settled: bool = True) -> dict[str, Any]:
    """A ``secondary_tiers`` entry: vLLM's file system tier, settled (``SettledFileSystemTier``)
    or not (``LiveFileSystemTier``), in a fresh folder under the temporary directory (each
    manager's in a subfolder of its own: `make_spec`), with two read and two write threads and
    its own events (a stored key's)."""
    root = os.path.join(tempfile.gettempdir(), f"kvoffload-fs-{uuid.uuid4().hex}")
    return {
        "type": "SettledFileSystemTier" if settled else "LiveFileSystemTier",
        "module_path": install_tiers(),
        "root_dir": root,
        "n_read_threads": 2,
        "n_write_threads": 2,
        "enable_kv_events": True,
    }


#: Secondary tiers of the differential runs, by name (``ScriptedTier``'s rules: see above).
SETUPS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    "example": lambda: [{"type": "example"}],
    "slow-failing": lambda: [scripted_tier(delay=1, fail_every=5)],
    "request-level": lambda: [scripted_tier(request_level_every=2, delay=2, capacity=30)],
    "two-tiers": lambda: [
        {"type": "example"},
        scripted_tier(request_level_every=3, fail_every=4, delay=1, capacity=20),
    ],
    "serving": lambda: [scripted_tier(serve_every=2, delay=1, capacity=40)],
    "polled": lambda: [
        scripted_tier(polled=True, serve_every=2, delay=1, fail_every=7, capacity=40)
    ],
    "fs": lambda: [fs_tier()],
}


def build(oracle: Any, impl: str, num_chunks: int, extra: dict[str, Any]) -> Any:
    """A tiering manager of ``impl`` over ``num_chunks`` chunks (see `make_spec`)."""
    return make_spec(oracle, impl, num_chunks, extra).get_manager()


def make_spec(oracle: Any, impl: str, num_chunks: int, extra: dict[str, Any]) -> Any:
    """The tiering spec of ``impl`` that vLLM's ``OffloadingSpecFactory`` builds, for
    ``num_chunks`` chunks, with one ``example`` secondary tier unless ``extra`` says otherwise
    (the tier-poll thread off) and an engine of its own (the spec names its shared memory file
    after the engine)."""
    extra = {
        "tier_poll_interval_s": 0,
        "secondary_tiers": [{"type": "example"}],
        **SPECS[impl],
        **extra,
    }
    if impl == "vllm":
        extra["spec_name"] = "TieringOffloadingSpec"
    extra["secondary_tiers"] = [
        {**tier, "root_dir": os.path.join(tier["root_dir"], impl)} if "root_dir" in tier else tier
        for tier in extra["secondary_tiers"]
    ]
    config = offloading_config(oracle, num_chunks, extra)
    config = dataclasses.replace(config, engine_id=f"kvoffload-test-{uuid.uuid4().hex}")
    return oracle.factory.OffloadingSpecFactory.create_spec(config)


def primary_state(oracle_mod: Any, manager: Any) -> dict[str, Any]:
    """The primary tier's state in kvoffload's introspection layout (invariants checked)."""
    primary = manager.primary_tier
    if hasattr(primary, "resident"):
        return _driver._own_state(primary)
    state: dict[str, Any] = oracle_mod.state_of(primary)
    return state


def tier_contents(tier: Any) -> list[Any]:
    """What a secondary tier holds: its keys (the example tier and its subclasses) or its files
    (`SettledFileSystemTier`)."""
    if hasattr(tier, "files"):
        files: list[Any] = tier.files()
        return files
    return sorted(tier.chunks)


class TieringMismatch(AssertionError):
    """Two tiering managers answered a call differently, or their tiers hold different state."""


@dataclass
class _Request:
    rid: str
    keys: list[bytes]
    ctxs: list[Any]
    offered: int = 0
    waits: int = 0


@dataclass
class TieringRun:
    """Several tiering managers driven in lockstep by one seeded scheduler."""

    oracle: Any
    managers: Sequence[Any]
    names: Sequence[str]
    seed: int
    #: Documents the prompts are drawn from (shared prefixes) and their lengths in keys.
    docs: int = 4
    doc_keys: tuple[int, int] = (4, 24)
    #: New requests a step (drawn from these) and keys a store offers (a range).
    arrivals: tuple[int, ...] = (0, 1, 1, 2)
    batch: tuple[int, int] = (1, 8)
    #: After each step, compare the managers' state (off for timing: ``benches/vllm_tiering.py``).
    inspect: bool = True
    #: Hold each manager's ``lock`` through every step: the scheduler's side of the contract
    #: with a tier-poll thread, which enters the manager between steps (a run with one then is
    #: no longer deterministic: one manager).
    locked: bool = False
    #: Seconds to sleep between steps, as the model runs: the turn of a tier-poll thread, or of
    #: a tier's own threads (`LiveFileSystemTier`).
    pause: float = 0.0
    history: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.rng = random.Random(f"tiering/{self.seed}")
        self.oracle_mod = _driver._load_tool("vllm_oracle")
        self.base = self.oracle.base
        self.doc_list = [
            [
                _driver.key(self.rng.randrange(10**6))
                for _ in range(self.rng.randint(*self.doc_keys))
            ]
            for _ in range(self.docs)
        ]
        self.running: list[_Request] = []
        self.waiting: list[_Request] = []
        self.loads: list[tuple[_Request, list[bytes]]] = []
        self.stores: list[tuple[_Request, list[bytes]]] = []
        self.next_rid = 0
        self.reset_pending = False
        #: Nanoseconds each manager spent in its calls, in all and in each step.
        self.ns = [0] * len(self.managers)
        self.step_ns: list[list[int]] = []
        # The worker's side: each manager's region, one row per chunk. A store writes its keys
        # into their chunks' rows; a load's rows must hold its keys, wherever each chunk has
        # been since (checked when every secondary tier copies bytes, as ScriptedTier does).
        self.rows = [np.asarray(m.primary_tier.get_kv_memoryview()) for m in self.managers]
        self.check_data = all(
            getattr(t, "copies", False) for m in self.managers for t in m.secondary_tiers
        )
        # A tier that asks to be polled off-thread, with the tier-poll thread off: the
        # scheduler runs the thread's rounds itself (`poll_tiers`), 0-2 between two steps at
        # seeded places, so that the managers can be compared call by call.
        self.polls = all(
            m._tier_poll_thread is None
            and any(t.tolerates_off_thread_polling for t in m.secondary_tiers)
            for m in self.managers
        )

    # --- calls, compared ---

    def call(self, what: str, run: Callable[[Any, int], Any]) -> Any:
        """Run ``run(manager, i)`` on each manager; their canonical answers must agree. Returns
        the first manager's raw answer."""
        answers, raw = [], []
        clock = time.perf_counter_ns
        for i, m in enumerate(self.managers):
            try:
                t0 = clock()
                out = run(m, i)
                self.ns[i] += clock() - t0
                answers.append(_driver.canon(out))
            except Exception as e:  # compared like an answer
                out = None
                answers.append(("raised", type(e).__name__, str(e)))
            raw.append(out)
        self.history.append(f"{what} -> {_driver.render(answers[0])}")
        if any(a != answers[0] for a in answers):
            self.fail(
                f"{what}: "
                + "; ".join(
                    f"{n}: {_driver.render(a)}" for n, a in zip(self.names, answers, strict=True)
                )
            )
        if isinstance(answers[0], tuple) and answers[0][:1] == ("raised",):
            self.fail(f"{what} raised in every manager: {answers[0]}")
        return raw[0]

    def fail(self, what: str) -> None:
        """Raise a mismatch with the last steps of the history."""
        tail = "\n  ".join(self.history[-30:])
        raise TieringMismatch(f"seed {self.seed}: {what}\nlast calls:\n  {tail}")

    def check_state(self) -> None:
        """The primary tiers' state, the secondary tiers' contents and pending work agree."""
        states = [primary_state(self.oracle_mod, m) for m in self.managers]
        tiers = [[tier_contents(t) for t in m.secondary_tiers] for m in self.managers]
        work = [m.has_pending_work() for m in self.managers]
        for n, s, t, w in zip(self.names, states, tiers, work, strict=True):
            if s != states[0]:
                diff = [part for part in s if s[part] != states[0].get(part)]
                self.fail(f"primary tier state differs ({self.names[0]} vs {n}): {diff}")
            if t != tiers[0] or w != work[0]:
                self.fail(f"secondary tiers differ ({self.names[0]} vs {n})")

    # --- the scheduler ---

    def step(self) -> None:
        """One scheduler step (see the module's docstring), the managers' locks held through
        it when the run is `locked`."""
        with contextlib.ExitStack() as held:
            if self.locked:
                for m in self.managers:
                    held.enter_context(m.lock)
            self._step()

    def _step(self) -> None:
        rng, ScheduleEnd = self.rng, self.base.ScheduleEndContext
        start = list(self.ns)
        for _ in range(rng.randint(0, 2) if self.polls else 0):
            self.call("poll_tiers()", _poll_round)
        for req, keys in self.loads:
            self.call(f"complete_load({req.rid}, {len(keys)})", _on(req, "complete_load", keys))
        for req, keys in self.stores:
            ok = rng.random() > 0.05
            self.call(
                f"complete_store({req.rid}, {len(keys)}, {ok})",
                _on(req, "complete_store", keys, ok),
            )
        self.loads, self.stores = [], []
        if self.reset_pending:
            self.call("on_reset_flushed()", lambda m, i: m.on_reset_flushed())
            self.reset_pending = False
        new: list[str] = []
        for _ in range(rng.choice(self.arrivals)):
            self.waiting.append(self._arrive(new))
        for req in list(self.waiting):
            self._admit(req)
        for req in list(self.running):
            self._offer(req)
        self._extras()
        self.call(
            "on_schedule_end()",
            lambda m, i: m.on_schedule_end(ScheduleEnd(new_req_ids=new, preempted_req_ids=[])),
        )
        self.step_ns.append([b - a for a, b in zip(start, self.ns, strict=True)])
        if self.inspect:
            self.check_state()

    def _arrive(self, new: list[str]) -> _Request:
        rng = self.rng
        keys: list[bytes] = []
        for doc in rng.sample(self.doc_list, rng.randint(1, 2)):
            keys += doc[: rng.randint(1, len(doc))]
        keys += [_driver.key(rng.randrange(10**6, 2 * 10**6)) for _ in range(rng.randint(0, 6))]
        keys = list(dict.fromkeys(keys))
        rid = f"r{self.next_rid}"
        self.next_rid += 1
        ctxs = []
        for _ in self.managers:
            ctx = self.oracle.ReqContext(req_id=rid)
            for j, k in enumerate(keys):
                ctx.set_offload_key_position(k, 16 * (j + 1))
            ctxs.append(ctx)
        req = _Request(rid, keys, ctxs)
        self.call(f"on_new_request({rid})", lambda m, i: m.on_new_request(req.ctxs[i]))
        new.append(rid)
        return req

    def _admit(self, req: _Request) -> None:
        hits, stopped = 0, None
        for k in req.keys:
            res = self.call(
                f"lookup({req.rid}, {_driver.key_name(k)})",
                _on(req, "lookup", k),
            )
            if res.name != "HIT":
                stopped = res.name
                break
            hits += 1
        if stopped in ("HIT_PENDING", "RETRY") and req.waits < 2 and self.rng.random() < 0.8:
            req.waits += 1
            return  # waits for the key being stored or promoted
        self.waiting.remove(req)
        # A later key's promotion may have evicted an earlier hit to make room (vLLM's lookup
        # allocates in the primary tier): only the keys still readable there are loaded.
        primary, ctx = self.managers[0].primary_tier, req.ctxs[0]
        still = [primary.lookup(k, ctx).name == "HIT" for k in req.keys[:hits]]
        hits = still.index(False) if False in still else hits
        if hits:
            hit = req.keys[:hits]
            for k in hit[: self.rng.randint(0, 2)]:
                self.call(
                    f"get_load_source({req.rid}, {_driver.key_name(k)})",
                    _on(req, "get_load_source", k),
                )
            spec = self.call(f"prepare_load({req.rid}, {hits})", _on(req, "prepare_load", hit))
            if self.check_data:
                self._check_rows(hit, spec.chunk_ids)
            self.call(f"touch({req.rid}, {hits})", _on(req, "touch", hit))
            self.loads.append((req, hit))
        req.offered = hits
        self.running.append(req)

    def _offer(self, req: _Request) -> None:
        batch = req.keys[req.offered : req.offered + self.rng.randint(*self.batch)]
        req.offered += len(batch)
        if batch:
            out = self.call(
                f"prepare_store({req.rid}, {len(batch)})", _on(req, "prepare_store", batch)
            )
            if out is not None and out.keys_to_store:
                self.stores.append((req, list(out.keys_to_store)))
                for rows in self.rows:  # the worker copies the blocks in
                    for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids, strict=True):
                        rows[c] = 0
                        rows[c, : len(k)] = np.frombuffer(k, dtype=rows.dtype)
        if req.offered >= len(req.keys):
            self.running.remove(req)
            self.call(f"on_request_finished({req.rid})", _on(req, "on_request_finished"))

    def _check_rows(self, keys: Sequence[bytes], chunks: Any) -> None:
        for name, rows in zip(self.names, self.rows, strict=True):
            for k, c in zip(keys, chunks, strict=True):
                if rows[c, : len(k)].tobytes() != k:
                    self.fail(f"{name}: chunk {c} does not hold {_driver.key_name(k)}'s bytes")

    def _extras(self) -> None:
        rng = self.rng
        if rng.random() < 0.3:
            doc = rng.choice(self.doc_list)
            k = rng.choice(doc)
            req = rng.choice(self.running) if self.running else None
            if req is not None:
                self.call(f"lookup({req.rid}, {_driver.key_name(k)})", _on(req, "lookup", k))
        if rng.random() < 0.2:
            self.call("take_events()", lambda m, i: list(m.take_events()))
        if rng.random() < 0.1:
            self.call("get_stats()", lambda m, i: _timeless(m.get_stats()))
        if rng.random() < 0.1:
            self.call("config_info()", lambda m, i: m.config_info())
        if rng.random() < 0.01 and not self.loads and not self.stores:
            self.call("reset_cache()", lambda m, i: m.reset_cache())
            self.reset_pending = True

    def run(self, steps: int) -> None:
        """Run ``steps`` steps, then shut the managers down."""
        try:
            for _ in range(steps):
                self.step()
                if self.pause:
                    time.sleep(self.pause)  # the tier-poll thread's turn
        finally:
            self.rows = []  # the regions are unmapped at shutdown
            for m in self.managers:
                m.shutdown()


def _timeless(stats: Any) -> Any:
    """A stats report's metrics, each measured with the clock replaced by what does not depend
    on it: a series of times (``*_seconds``) by how many it holds, a summed time (``*_time``,
    a secondary tier's transfers) by its type. The rest must be equal."""
    if stats is None:
        return None
    data = stats.data["data"]
    return {
        name: {labels: len(v) for labels, v in series.items()}
        if name.endswith("_seconds")
        else {labels: type(v).__name__ for labels, v in series.items()}
        if name.endswith("_time")
        else series
        for name, series in data.items()
    }


def _poll_round(manager: Any, _: int) -> None:
    """One round of the tier-poll thread's, on this thread: ``poll_tiers`` under the lock."""
    with manager.lock:
        manager.poll_tiers()


def _on(req: _Request, name: str, *args: Any) -> Callable[[Any, int], Any]:
    """A call of method ``name`` with ``args`` and the request's context of each manager."""
    if name == "complete_store":
        keys, ok = args
        return lambda m, i: m.complete_store(keys, req.ctxs[i], ok)
    return lambda m, i: getattr(m, name)(*args, req.ctxs[i])


def run_pair(
    oracle: Any, seed: int, steps: int, num_chunks: int, extra: dict[str, Any]
) -> list[str]:
    """Run vLLM's tiering manager and kvoffload's side by side (raises `TieringMismatch`);
    the paths of their shared regions (gone once they have shut down)."""
    names = ("vllm", "kvoffload")
    managers = [build(oracle, name, num_chunks, extra) for name in names]
    paths = [m.primary_tier._mmap_region.mmap_path for m in managers]
    TieringRun(oracle, managers, names, seed).run(steps)
    return paths
