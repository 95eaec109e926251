"""Python plug-in policies driven by the Rust manager.

- Policies written against vLLM 0.33.0's interface (importing only vLLM) load by module path and
  give the same results in kvoffload's Rust manager as in vLLM's own manager.
- kvoffload's plain-Python policy twins, driven by the Rust manager as plug-ins, match the Rust
  manager running the same policies built in: the plumbing (context, key objects, ref counts
  mirrored into the statuses, the order of every call) is exact.
- A policy that raises leaves the manager consistent, as `CPUOffloadingManager` documents; a
  policy that breaks the evict contract or calls back into its manager gets a clear error. The
  reference manager refuses a broken evict answer the same way.
"""

from __future__ import annotations

import contextlib
import functools
import random
import re
import sys
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

import _driver
from _helpers import OWN_POLICY, VLLM_POLICIES
from kvoffload import (
    CPUOffloadingManager,
    InvalidArgumentError,
    KeyStateError,
    PolicyError,
    ReentrantCallError,
    ReqContext,
    UnsupportedPolicyError,
    _native,
)
from kvoffload.policies import POLICY_METHODS, CachePolicy, CachePolicyFactory, ChunkStatus
from kvoffload.reference import CPUOffloadingManager as ReferenceManager
from kvoffload.types import CPULoadStoreSpec, PrepareStoreOutput

VLLM_MODULE = "kvoffload_test_vllm_policies"
OWN_MODULE = "kvoffload_test_own_policies"
VLLM_CLASSES = {"mru": "MRUPolicy", "random": "SeededRandomPolicy"}

#: kvoffload's plain-Python twins of the built-in policies, by built-in name.
TWINS = {
    "lru": ("kvoffload.reference.lru", "LruPolicy"),
    "arc": ("kvoffload.reference.arc", "ArcPolicy"),
    "fifo": ("kvoffload.reference.fifo", "FifoPolicy"),
    "sieve": ("kvoffload.reference.sieve", "SievePolicy"),
    "s3fifo": ("kvoffload.reference.s3fifo", "S3FifoPolicy"),
    "2q": ("kvoffload.reference.twoq", "TwoQPolicy"),
    "slru": ("kvoffload.reference.slru", "SlruPolicy"),
    "lfu": ("kvoffload.reference.lfu", "LfuPolicy"),
    "arc-paper": ("kvoffload.reference.arc_paper", "LibCacheSimArc"),
}


@pytest.fixture(scope="module")
def policy_modules(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """The test policy modules, importable for the module's tests."""
    root = tmp_path_factory.mktemp("policies")
    (root / f"{VLLM_MODULE}.py").write_text(VLLM_POLICIES)
    (root / f"{OWN_MODULE}.py").write_text(OWN_POLICY)
    sys.path.insert(0, str(root))
    yield root
    sys.path.remove(str(root))
    for name in (VLLM_MODULE, OWN_MODULE):
        sys.modules.pop(name, None)


def _state(mgr: Any) -> dict[str, Any]:
    """What both managers show of themselves, policy order aside (a plug-in's is its own)."""
    mgr.check_invariants()
    return {
        "resident": mgr.resident(),
        "tracker_state": mgr.tracker_state(),
        "pool_state": mgr.pool_state(),
    }


def _built_in_state(mgr: Any) -> dict[str, Any]:
    """``_state`` and the built-in policy's order."""
    return {**_state(mgr), "order": mgr.policy_state()}


def _twin_state(mgr: Any) -> dict[str, Any]:
    """``_state`` and the order of the plug-in twin (in the built-in's format)."""
    return {**_state(mgr), "order": mgr.policy.state()}


def _run(specs: list[_driver.ImplSpec], policy: str, threshold: int, seeds: range) -> None:
    for seed in seeds:
        result = _driver.run_sequence(specs, policy, threshold, seed, calls=250)
        if result.mismatch is not None:
            pytest.fail(result.mismatch.report(20), pytrace=False)


# --- policies written for vLLM ---


@pytest.mark.parametrize("threshold", [1, 2])
@pytest.mark.parametrize("policy", sorted(VLLM_CLASSES))
def test_vllm_policy_in_rust_manager_matches_vllms_manager(
    oracle: Any, policy_modules: Path, policy: str, threshold: int
) -> None:
    classes = {name: (VLLM_MODULE, cls) for name, cls in VLLM_CLASSES.items()}
    specs = [
        _driver.plugin_impl("vllm", oracle.CPUOffloadingManager, oracle.ReqContext, classes, None),
        _driver.plugin_impl("rust", CPUOffloadingManager, ReqContext, classes, None),
    ]
    _run(specs, policy, threshold, range(12))


@pytest.mark.parametrize("threshold", [1, 2, 3])
@pytest.mark.parametrize("policy", sorted(_driver.PLUGIN_CLASSES))
def test_both_managers_call_a_plug_in_exactly_as_vllms_manager_does(
    oracle: Any, policy_modules: Path, policy: str, threshold: int
) -> None:
    """Every call but ``get``, in order, with the same arguments (and answers from ``evict``)."""
    specs = [
        _driver.plugin_spec(_driver.impl_spec(name), VLLM_MODULE)
        for name in ("vllm", "rust", "reference")
    ]
    _run(specs, policy, threshold, range(12))


def test_vllm_policy_gets_vllms_chunk_status(oracle: Any, policy_modules: Path) -> None:
    m = CPUOffloadingManager(4, cache_policy="MRUPolicy", cache_policy_module_path=VLLM_MODULE)
    ctx = ReqContext(req_id="r")
    keys = [bytes([i]) * 8 for i in range(3)]
    m.prepare_store(keys, ctx)
    status = m.policy.get(keys[0])
    assert type(status) is sys.modules["vllm.v1.kv_offload.cpu.policies.base"].ChunkStatus
    assert (status.chunk_id, status.ref_cnt, status.is_ready) == (0, -1, False)
    m.complete_store(keys, ctx)
    m.prepare_load(keys[:1], ctx)
    m.prepare_load(keys[:1], ReqContext(req_id="s"))
    assert (status.ref_cnt, status.is_ready) == (2, True)
    m.complete_load(keys[:1], ctx)
    assert status.ref_cnt == 1
    m.check_invariants()


def test_own_policy_matches_the_reference_manager(policy_modules: Path) -> None:
    classes = {"mru": (OWN_MODULE, "MRUPolicy")}
    specs = [
        _driver.plugin_impl("reference", ReferenceManager, ReqContext, classes, _state),
        _driver.plugin_impl("rust", CPUOffloadingManager, ReqContext, classes, _state),
    ]
    _run(specs, "mru", 2, range(12))


# --- kvoffload's twins as plug-ins: the plumbing is exact ---


@pytest.mark.parametrize("policy", sorted(TWINS))
def test_python_twin_in_rust_manager_matches_the_built_in(policy: str) -> None:
    specs = [
        _driver.ImplSpec("rust", CPUOffloadingManager, ReqContext, _built_in_state),
        _driver.plugin_impl("rust+python", CPUOffloadingManager, ReqContext, TWINS, _twin_state),
    ]
    _run(specs, policy, 2, range(6))
    _run(specs, policy, 1, range(6))


# --- factory and loading ---


def test_one_name_registered_from_several_threads_at_once_is_registered_once(
    policy_modules: Path,
) -> None:
    n = 8
    start = threading.Barrier(n)
    outcomes: list[str] = []

    def register() -> None:
        start.wait()
        try:
            CachePolicyFactory.register_cache_policy("own-mru-race", OWN_MODULE, "MRUPolicy")
            outcomes.append("registered")
        except UnsupportedPolicyError:
            outcomes.append("refused")

    try:
        for _ in range(20):
            threads = [threading.Thread(target=register) for _ in range(n)]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            assert sorted(outcomes) == ["refused"] * (n - 1) + ["registered"], outcomes
            outcomes.clear()
            CachePolicyFactory._registry.pop("own-mru-race")
    finally:
        CachePolicyFactory._registry.pop("own-mru-race", None)


def test_factory_resolves_registered_names_then_module_paths(policy_modules: Path) -> None:
    assert CachePolicyFactory.get_cache_policy_cls("lru").__name__ == "LruPolicy"
    CachePolicyFactory.register_cache_policy("own-mru-test", OWN_MODULE, "MRUPolicy")
    try:
        with pytest.raises(UnsupportedPolicyError, match="already registered"):
            CachePolicyFactory.register_cache_policy("own-mru-test", OWN_MODULE, "MRUPolicy")
        m = CPUOffloadingManager(2, cache_policy="own-mru-test")
        assert type(m.policy).__module__ == OWN_MODULE
        assert m.policy_state() == {"policy": "MRUPolicy"}
    finally:
        CachePolicyFactory._registry.pop("own-mru-test")
    with pytest.raises(UnsupportedPolicyError, match="no cache policy class"):
        CPUOffloadingManager(2, cache_policy="Nope", cache_policy_module_path=OWN_MODULE)
    with pytest.raises(UnsupportedPolicyError, match="cache_policy_module_path"):
        CPUOffloadingManager(2, cache_policy="Nope")
    with pytest.raises(UnsupportedPolicyError, match="lacks"):
        CPUOffloadingManager(
            2, cache_policy="ChunkStatus", cache_policy_module_path="kvoffload.policies"
        )
    assert CPUOffloadingManager(2).policy is None


def _refusal(manager_cls: Any, module_path: Any) -> UnsupportedPolicyError:
    """What building ``manager_cls`` with policy "MyPolicy" from ``module_path`` raises."""
    with pytest.raises(UnsupportedPolicyError) as info:
        manager_cls(4, cache_policy="MyPolicy", cache_policy_module_path=module_path)
    return info.value


@pytest.mark.parametrize(
    ("module_path", "says", "cause"),
    [
        ("kvoffload_test_no_such_module", "which was not found", ModuleNotFoundError),
        ("kvoffload_test_no_such.module", "which was not found", ModuleNotFoundError),
        ("kvoffload.no_such_module", "which was not found", ModuleNotFoundError),
        ("", "must be an absolute module path", None),
        (".relative", "must be an absolute module path", None),
        (123, "must be a str", None),
        (b"kvoffload.policies", "must be a str", None),
    ],
)
def test_a_bad_module_path_is_an_unsupported_policy_in_both_managers(
    module_path: Any, says: str, cause: type | None
) -> None:
    # Raised from the factory both managers resolve through: one class, one message, naming
    # the policy and the path; an import's error stays chained for its traceback.
    errors = [_refusal(cls, module_path) for cls in (CPUOffloadingManager, ReferenceManager)]
    assert str(errors[0]) == str(errors[1])
    assert says in str(errors[0])
    assert "'MyPolicy'" in str(errors[0])
    if cause is None:
        assert all(e.__cause__ is None for e in errors)
    else:
        assert f"its module {module_path!r}" in str(errors[0])
        assert all(type(e.__cause__) is cause for e in errors)
    assert isinstance(errors[0], InvalidArgumentError)  # also a ValueError, as before for ""
    with pytest.raises(UnsupportedPolicyError, match=re.escape(str(errors[0]))):
        CachePolicyFactory.get_cache_policy_cls("MyPolicy", module_path)


@pytest.mark.parametrize(
    ("source", "cause", "shows"),
    [
        ("import kvoffload_test_missing_dependency\n", ModuleNotFoundError, "missing_dependency"),
        ("raise RuntimeError('bad config')\n", RuntimeError, "RuntimeError: bad config"),
        ("def broken(:\n", SyntaxError, "SyntaxError"),
    ],
)
def test_a_policy_module_that_fails_while_importing_says_so(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, source: str, cause: type, shows: str
) -> None:
    # Found, then failed: not "not found", and the module's own error is kept as the cause
    # (whose traceback runs into the module's line).
    name = "kvoffload_test_broken_policy"
    (tmp_path / f"{name}.py").write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.delitem(sys.modules, name, raising=False)
    errors = [_refusal(cls, name) for cls in (CPUOffloadingManager, ReferenceManager)]
    assert str(errors[0]) == str(errors[1])
    message = str(errors[0])
    assert f"cache policy 'MyPolicy': cannot import its module {name!r}" in message
    assert "failed while being imported" in message
    assert shows in message
    assert "not found" not in message
    assert all(type(e.__cause__) is cause for e in errors)


def test_a_registered_name_does_not_read_the_module_path() -> None:
    # As in vLLM's factory: a registered name wins, whatever the path.
    for path in ("no.such.module", "", 123):
        assert CachePolicyFactory.get_cache_policy_cls("fifo", path).__name__ == "FifoPolicy"  # type: ignore[arg-type]
        assert CPUOffloadingManager(2, cache_policy="arc", cache_policy_module_path=path)  # type: ignore[arg-type]


def test_chunk_status_matches_vllms_meaning() -> None:
    s = ChunkStatus(3)
    assert (s.chunk_id, s.ref_cnt, s.is_ready, s.is_evictable) == (3, -1, False, False)
    s.ref_cnt = 0
    assert (s.is_ready, s.is_evictable) == (True, True)
    s.ref_cnt = 2
    assert (s.is_ready, s.is_evictable) == (True, False)


# --- a policy that raises ---


class Flaky(CachePolicy):
    """A FIFO-ish policy that raises once in method ``fail_in`` when armed (before acting, but
    for ``remove`` and ``clear``, which a manager cannot undo)."""

    def __init__(self, cache_capacity: int) -> None:
        super().__init__(cache_capacity)
        self.chunks: dict[bytes, Any] = {}
        self.fail_in: str | None = None
        self.calls: list[str] = []

    def _maybe_fail(self, name: str) -> None:
        self.calls.append(name)
        if self.fail_in == name:
            self.fail_in = None
            raise RuntimeError(f"policy failed in {name}")

    def get(self, key: bytes) -> Any:
        return self.chunks.get(key)

    def insert(self, key: bytes, chunk: Any, req_context: Any) -> None:
        self._maybe_fail("insert")
        self.chunks[key] = chunk

    def remove(self, key: bytes) -> None:
        del self.chunks[key]
        self._maybe_fail("remove")  # after acting: what a notification can do is not undone

    def touch(self, keys: Any, req_context: Any) -> None:
        self._maybe_fail("touch")
        for key in keys:
            if key in self.chunks:
                self.chunks[key] = self.chunks.pop(key)

    def on_store_miss(self, keys: Any, req_context: Any) -> None:
        self._maybe_fail("on_store_miss")

    def on_request_access(self, keys: Any, req_context: Any) -> None:
        self._maybe_fail("on_request_access")

    def on_request_finished(self, groups: Any, inserted: Any, reused: Any, ctx: Any) -> None:
        self._maybe_fail("on_request_finished")

    def mark_evictable(self, key: bytes) -> None:
        self._maybe_fail("mark_evictable")

    def mark_non_evictable(self, key: bytes) -> None:
        self._maybe_fail("mark_non_evictable")

    def evict(self, n: int, protected: set[bytes]) -> list[tuple[bytes, Any]] | None:
        self._maybe_fail("evict")
        victims = [(k, c) for k, c in self.chunks.items() if c.ref_cnt == 0 and k not in protected]
        if len(victims) < n:
            return None
        for key, _ in victims[:n]:
            del self.chunks[key]
        return victims[:n]

    def clear(self) -> None:
        self.chunks.clear()
        self._maybe_fail("clear")


FLAKY_METHODS = tuple(m for m in POLICY_METHODS if m != "get")


def _flaky_manager(
    num_chunks: int, manager_cls: Any = CPUOffloadingManager, **kwargs: Any
) -> CPUOffloadingManager:
    module = type(sys)("kvoffload_test_flaky")
    module.Flaky = Flaky  # type: ignore[attr-defined]
    sys.modules["kvoffload_test_flaky"] = module
    manager: CPUOffloadingManager = manager_cls(
        num_chunks,
        cache_policy="Flaky",
        cache_policy_module_path="kvoffload_test_flaky",
        enable_events=True,
        **kwargs,
    )
    return manager


def _snapshot(m: CPUOffloadingManager) -> tuple[Any, ...]:
    return m.resident(), m.pool_state(), m.tracker_state()


def _policy_agrees(m: CPUOffloadingManager) -> None:
    """The manager's invariants hold and the policy holds exactly the resident keys."""
    m.check_invariants()
    resident = m.resident()
    assert set(m.policy.chunks) == set(resident)
    for key, (chunk, ref) in resident.items():
        status = m.policy.chunks[key]
        assert (status.chunk_id, status.ref_cnt) == (chunk, ref)


@pytest.mark.parametrize("seed", range(8))
def test_a_raising_policy_leaves_the_manager_consistent(seed: int) -> None:
    rng = random.Random(seed)
    m = _flaky_manager(6, store_threshold=2, max_tracker_size=8)
    keys = [bytes([i]) * 6 for i in range(14)]
    contexts = [ReqContext(req_id=str(i)) for i in range(3)]
    pins: list[tuple[bytes, ReqContext]] = []
    failures = 0
    for _ in range(400):
        policy: Flaky = m.policy
        if rng.random() < 0.5:
            policy.fail_in = rng.choice(FLAKY_METHODS)
        ctx = rng.choice(contexts)
        resident = m.resident()
        before = _snapshot(m)
        op = rng.choice(["store", "complete", "fail", "load", "unload", "touch", "finish", "reset"])
        try:
            if op == "store":
                m.prepare_store(rng.sample(keys, rng.randint(1, 4)), ctx)
            elif op in ("complete", "fail"):
                pending = [k for k, (_, r) in resident.items() if r == -1]
                m.complete_store(pending[: rng.randint(0, 3)], ctx, success=op == "complete")
            elif op == "load":
                ready = [k for k, (_, r) in resident.items() if r >= 0]
                chosen = ready[: rng.randint(0, 2)]
                m.prepare_load(chosen, ctx)
                pins.extend((k, ctx) for k in chosen)
            elif op == "unload" and pins:
                k, c = pins.pop(rng.randrange(len(pins)))
                m.complete_load([k], c)
            elif op == "touch":
                m.touch(rng.sample(keys, 3), ctx)
            elif op == "finish":
                # The request is finished even if the policy raises: it needs a new context.
                contexts[contexts.index(ctx)] = ReqContext(req_id=str(rng.random()))
                m.on_request_finished(ctx)
            elif op == "reset" and rng.random() < 0.1:
                m.reset_cache()
                pins.clear()
        except RuntimeError as e:
            assert str(e).startswith("policy failed in")  # noqa: PT017 (not one call's check)
            failures += 1
            if op in ("load", "store"):
                after = _snapshot(m)
                if op == "load" or str(e) != "policy failed in insert":
                    assert after == before
                else:
                    # Evictions made before a failed insert stand; nothing else changed.
                    assert after[2] == before[2]
                    assert set(after[0]) <= set(before[0])
            if op == "reset":
                pins.clear()
        _policy_agrees(m)
    assert failures > 10


def test_failed_insert_after_eviction_reports_the_eviction() -> None:
    m = _flaky_manager(2)
    ctx = ReqContext(req_id="r")
    a, b, c, d = (bytes([i]) * 4 for i in range(4))
    m.prepare_store([a, b], ctx)
    m.complete_store([a, b], ctx)
    list(m.take_events())
    m.policy.fail_in = "insert"
    with pytest.raises(RuntimeError, match="insert"):
        m.prepare_store([c, d], ctx)
    assert m.resident() == {}
    assert m.pool_state() == (2, [0, 1])
    events = list(m.take_events())
    assert [(e.keys, e.removed) for e in events] == [([a, b], True)]
    _policy_agrees(m)
    # The same offer goes through once the policy stops failing.
    out = m.prepare_store([c, d], ctx)
    assert out is not None
    assert out.keys_to_store == [c, d]
    _policy_agrees(m)


def test_failed_load_pins_nothing() -> None:
    m = _flaky_manager(4)
    ctx = ReqContext(req_id="r")
    keys = [bytes([i]) * 4 for i in range(3)]
    m.prepare_store(keys, ctx)
    m.complete_store(keys, ctx)
    m.policy.fail_in = "mark_non_evictable"
    m.policy.calls.clear()
    with pytest.raises(RuntimeError):
        m.prepare_load(keys, ctx)
    assert {k: r for k, (_, r) in m.resident().items()} == dict.fromkeys(keys, 0)
    assert m.policy.calls == ["mark_non_evictable"]
    m.policy.fail_in = "on_request_access"
    m.policy.calls.clear()
    with pytest.raises(RuntimeError):
        m.prepare_load(keys, ReqContext(req_id="new to these keys"))
    # Every pin reported was reported released again.
    assert (
        m.policy.calls
        == ["mark_non_evictable"] * 3 + ["on_request_access"] + ["mark_evictable"] * 3
    )
    _policy_agrees(m)


# --- contract breaches and reentrancy ---


class Liar(Flaky):
    """Evicts whatever ``answer`` says."""

    answer: Any = None

    def evict(self, n: int, protected: set[bytes]) -> Any:
        return self.answer(self, n, protected)


#: Answers of ``evict`` that break its contract, and what the error says.
BROKEN_EVICTS: list[tuple[Any, str]] = [
    (lambda p, n, prot: [], "returned 0 chunks"),
    (lambda p, n, prot: list(p.chunks.items())[: n + 1], "returned 3 chunks"),
    (
        lambda p, n, prot: [(k, c) for k, c in p.chunks.items() if k in prot or c.ref_cnt == 0][:n],
        "protected",
    ),
    (lambda p, n, prot: [(k, c) for k, c in p.chunks.items() if c.ref_cnt != 0][:n], "ref"),
    (lambda p, n, prot: [(b"nope", ChunkStatus(0))] * n, "does not hold"),
    (lambda p, n, prot: [(k, ChunkStatus(99)) for k in list(p.chunks)[:n]], "does not hold"),
    (lambda p, n, prot: [5] * n, r"\(key, status\) pairs"),
    (lambda p, n, prot: [(c, k) for k, c in list(p.chunks.items())[:n]], "key of type"),
    (lambda p, n, prot: 5, r"\(key, status\) pairs or None"),
    (lambda p, n, prot: [(k, None) for k in list(p.chunks)[:n]], "no int chunk_id"),
    (
        lambda p, n, prot: (
            [(k, c) for k, c in p.chunks.items() if c.ref_cnt == 0 and k not in prot][:1] * n
        ),
        "twice",
    ),
]

#: The two managers that drive a Python policy.
MANAGERS = [
    pytest.param(CPUOffloadingManager, id="rust"),
    pytest.param(ReferenceManager, id="reference"),
]


@pytest.mark.parametrize("manager_cls", MANAGERS)
@pytest.mark.parametrize(("answer", "match"), BROKEN_EVICTS)
def test_an_evict_that_breaks_the_contract_raises_policy_error(
    manager_cls: Any, answer: Any, match: str
) -> None:
    m = _flaky_manager(5, manager_cls)
    m.policy.__class__ = Liar
    m.policy.answer = answer
    ctx = ReqContext(req_id="r")
    a, b, c, d, e, f, g = (bytes([i]) * 4 for i in range(7))
    m.prepare_store([a, b, c, f, g], ctx)
    m.complete_store([a, b, f, g], ctx)
    m.prepare_load([b], ctx)
    before = _snapshot(m)
    # Two chunks to evict out of a, f and g; a is offered again, so it is protected.
    with pytest.raises(PolicyError, match=match):
        m.prepare_store([a, d, e], ctx)
    assert _snapshot(m) == before
    m.check_invariants()


def _raise(p: Any, n: int, prot: Any) -> Any:
    raise RuntimeError("policy failed in evict")


@pytest.mark.parametrize(
    "answer", [pytest.param(a, id=m) for a, m in BROKEN_EVICTS] + [pytest.param(_raise, id="raise")]
)
def test_both_managers_refuse_a_broken_evict_alike(answer: Any) -> None:
    # The same calls, the same broken policy: the same exception, and neither manager changed
    # anything, the offer's admission counts (store_threshold 2) included.
    seen: dict[str, Any] = {}
    for manager_cls in (CPUOffloadingManager, ReferenceManager):
        m = _flaky_manager(5, manager_cls, store_threshold=2, max_tracker_size=16)
        m.policy.__class__ = Liar
        m.policy.answer = answer
        a, b, c, d, e, f, g = (bytes([i]) * 4 for i in range(7))
        for req in ("s", "t"):  # the second offer reaches the threshold
            m.prepare_store([a, b, c, f, g], ReqContext(req_id=req))
        m.complete_store([a, b, f, g], ReqContext(req_id="t"))
        m.prepare_load([b], ReqContext(req_id="t"))
        m.prepare_store([d, e], ReqContext(req_id="u"))  # counted once: admitted next time
        before = _snapshot(m)
        with pytest.raises(Exception) as info:  # noqa: PT011 (compared below)
            m.prepare_store([a, d, e], ReqContext(req_id="r"))
        assert _snapshot(m) == before
        m.check_invariants()
        seen[manager_cls.__module__] = (type(info.value), before)
    assert seen["kvoffload.manager"] == seen["kvoffload.reference.manager"]
    assert seen["kvoffload.manager"][0] in (PolicyError, RuntimeError)


@pytest.mark.parametrize("method", ["on_store_miss", "on_request_access"])
def test_both_managers_leave_the_offer_uncounted_when_the_policy_raises(method: str) -> None:
    seen = []
    for manager_cls in (CPUOffloadingManager, ReferenceManager):
        m = _flaky_manager(5, manager_cls, store_threshold=2, max_tracker_size=16)
        a, b, c = (bytes([i]) * 4 for i in range(3))
        m.prepare_store([a, b], ReqContext(req_id="s"))
        before = _snapshot(m)
        m.policy.fail_in = method
        with pytest.raises(RuntimeError, match=method):
            m.prepare_store([a, b, c], ReqContext(req_id="t"))
        assert _snapshot(m) == before
        seen.append(before)
    assert seen[0] == seen[1]


@pytest.mark.parametrize("failing_insert", [0, 1, 2])
def test_both_managers_undo_a_store_whose_insert_raises(failing_insert: int) -> None:
    """An insert that raises takes back the call's earlier inserts and allocation, leaves the
    offer uncounted and unrecorded, and keeps the evictions made for it: in both managers."""
    seen = []
    for manager_cls in (CPUOffloadingManager, ReferenceManager):
        m = _flaky_manager(4, manager_cls, store_threshold=2, max_tracker_size=16)
        old, new = [bytes([i]) * 4 for i in range(4)], [bytes([i]) * 4 for i in range(4, 7)]
        ctx = ReqContext(req_id="fill")
        m.prepare_store(old, ctx)
        m.prepare_store(old, ctx)
        m.complete_store(old, ctx)
        m.prepare_store(new, ReqContext(req_id="first offer"))  # counted once: not stored
        before = _snapshot(m)
        observed: list[Any] = [before, list(m.take_events()), repr(m.get_stats())]
        policy = m.policy
        real_insert = policy.insert
        inserts: list[bytes] = []

        def insert(key: bytes, chunk: Any, req_context: Any) -> None:
            if len(inserts) == failing_insert:  # noqa: B023 (this manager's list)
                inserts.append(key)  # noqa: B023
                raise RuntimeError("policy failed in insert")
            inserts.append(key)  # noqa: B023
            real_insert(key, chunk, req_context)  # noqa: B023

        policy.insert = insert
        offer = [old[0], *new]  # the resident key is protected: the other three are evicted
        ctx = ReqContext(req_id="second offer")
        with pytest.raises(RuntimeError, match="insert"):
            m.prepare_store(offer, ctx)
        assert inserts == new[: failing_insert + 1]
        after = _snapshot(m)
        assert after[0] == {old[0]: before[0][old[0]]}  # the evictions stand
        assert after[2] == before[2]  # the offer was not counted
        _policy_agrees(m)
        events = list(m.take_events())
        assert [(e.keys, e.removed) for e in events] == [(old[1:], True)]
        observed += [after, events, repr(m.get_stats())]
        # Unrecorded: the same request offers the same keys again and stores them.
        del policy.insert
        out = m.prepare_store(offer, ctx)
        assert out is not None
        assert out.keys_to_store == new
        m.complete_store(new, ctx)
        m.on_request_finished(ctx)
        _policy_agrees(m)
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        observed += [list(out.store_spec.chunk_ids), _snapshot(m), repr(m.get_stats())]
        seen.append(observed)
    assert seen[0] == seen[1]


class Countdown(Flaky):
    """Flaky, raising at the ``skip + 1``-th call of ``fail_in`` rather than the first; it also
    keeps what ``on_request_access`` and ``on_request_finished`` are given (in ``heard``)."""

    skip = 0
    heard: list[Any]

    def _maybe_fail(self, name: str) -> None:
        if self.fail_in == name and self.skip:
            self.skip -= 1
            self.calls.append(name)
            return
        super()._maybe_fail(name)

    def on_request_access(self, keys: Any, req_context: Any) -> None:
        self.heard.append(("access", list(keys)))
        super().on_request_access(keys, req_context)

    def on_request_finished(self, groups: Any, inserted: Any, reused: Any, ctx: Any) -> None:
        self.heard.append(("finished", [list(g) for g in groups], sorted(inserted), sorted(reused)))
        super().on_request_finished(groups, inserted, reused, ctx)


def _countdown_manager(manager_cls: Any, num_chunks: int, **kwargs: Any) -> Any:
    m = _flaky_manager(num_chunks, manager_cls, **kwargs)
    m.policy.__class__ = Countdown
    m.policy.heard = []
    return m


def _outcome(call: Any) -> tuple[Any, ...]:
    """What a call answered, comparable across the two managers (a manager's own error by its
    type only: the two word their messages differently)."""
    try:
        out = call()
    except KeyStateError as e:
        return ("raised", type(e).__name__)
    except RuntimeError as e:
        return ("raised", type(e).__name__, str(e))
    if isinstance(out, CPULoadStoreSpec):
        return ("ok", list(out.chunk_ids))
    if isinstance(out, PrepareStoreOutput):
        assert isinstance(out.store_spec, CPULoadStoreSpec)
        return ("ok", out.keys_to_store, list(out.store_spec.chunk_ids), out.evicted_keys)
    return ("ok", out)


_READY = [bytes([i]) * 4 for i in range(5)]
_PENDING = [bytes([i]) * 4 for i in range(5, 8)]
_A, _B, _C, _D, _E = _READY
_P, _Q, _R = _PENDING
_NEW = [bytes([i]) * 4 for i in range(8, 10)]

#: Calls of a manager holding ready keys A-E (B pinned) and pending P, Q, R, request "s" having
#: seen them all: (the policy method that raises, how many of its reports the call makes, the
#: call, what prepares it, the call whose clean run the failing call must end like (None: the
#: failing call must change nothing)). A call gets the manager, the contexts and the clock.
RAISING_CALLS: dict[str, tuple[str, int, Any, Any, Any]] = {
    "complete_store": (
        "mark_evictable",
        3,
        lambda m, ctx, now: m.complete_store([_P, _A, _Q, _Q, _R], ctx["s"]),
        None,
        "same",
    ),
    "complete_store failed": (
        "remove",
        3,
        lambda m, ctx, now: m.complete_store([_P, _A, _Q, _Q, _R], ctx["s"], success=False),
        None,
        "same",
    ),
    "complete_load": (
        "mark_evictable",
        3,  # A, D, then C at its second unpin
        lambda m, ctx, now: m.complete_load([_A, _C, _D, _C], ctx["s"]),
        lambda m, ctx: m.prepare_load([_A, _C, _D, _C], ctx["s"]),
        "same",
    ),
    "prepare_load": (
        "mark_non_evictable",
        3,  # A, C, D: B is pinned already and A's second pin is no report
        lambda m, ctx, now: m.prepare_load([_A, _B, _C, _A, _D], ctx["s"]),
        None,
        None,
    ),
    "prepare_load of a new request": (
        "on_request_access",
        1,
        lambda m, ctx, now: m.prepare_load([_A, _B, _C, _A], ctx["new"]),
        None,
        None,
    ),
    "touch": ("touch", 1, lambda m, ctx, now: m.touch([_A, _P, _NEW[0]], ctx["s"]), None, "same"),
    "on_request_finished": (
        "on_request_finished",
        1,
        lambda m, ctx, now: m.on_request_finished(ctx["s"]),
        None,
        "same",
    ),
    "reset_cache": ("clear", 1, lambda m, ctx, now: m.reset_cache(), None, "same"),
    "expire_pending_writes": (
        "remove",
        3,
        lambda m, ctx, now: (now.append(10.0), m.expire_pending_writes(5.0))[1],
        None,
        "same",
    ),
    "prepare_store expiring": (
        "remove",
        3,  # the expiry fails: no offer is made
        lambda m, ctx, now: (now.append(10.0), m.prepare_store(_NEW, ctx["s"]))[1],
        None,
        lambda m, ctx, now: (now.append(10.0), m.expire_pending_writes(5.0))[1],
    ),
}

RAISING_CASES = [
    pytest.param(name, skip, id=f"{name}-{RAISING_CALLS[name][0]}-{skip + 1}")
    for name, (_, reports, *_) in RAISING_CALLS.items()
    for skip in range(reports)
]


def _raising_run(manager_cls: Any, name: str, skip: int | None) -> tuple[list[Any], list[Any]]:
    """Run case ``name`` (the policy raising at report ``skip``; None: not at all, the call
    being the case's clean twin); returns what the call left, and what followed."""
    method, _, call, prep, same_as = RAISING_CALLS[name]
    now = [0.0]
    m = _countdown_manager(manager_cls, 10, pending_write_timeout=5.0, clock=lambda: now[-1])
    policy = m.policy
    ctx = {"s": ReqContext(req_id="s"), "new": ReqContext(req_id="new")}
    m.prepare_store(_READY + _PENDING, ctx["s"])
    m.complete_store(_READY, ctx["s"])
    m.prepare_load([_B], ctx["s"])
    if prep is not None:
        prep(m, ctx)
    list(m.take_events())
    m.get_stats()  # the setup's samples
    before = [_snapshot(m), repr(m.get_stats())]
    policy.calls.clear()
    policy.heard.clear()
    if skip is None:
        if same_as is None:
            return [*before, []], []  # a failing call must leave this
        outcome = _outcome(lambda: (call if same_as == "same" else same_as)(m, ctx, now))
    else:
        policy.fail_in, policy.skip = method, skip
        outcome = _outcome(lambda: call(m, ctx, now))
        assert outcome == ("raised", "RuntimeError", f"policy failed in {method}")
        assert policy.fail_in is None  # it raised where it was told to
    _policy_agrees(m)
    left = [_snapshot(m), repr(m.get_stats()), list(m.take_events())]
    # What follows: the call again, then every pending store completed, every ready key loaded
    # by a new request, and every request finished.
    followed: list[Any] = [outcome, list(policy.calls), _outcome(lambda: call(m, ctx, now))]
    everything = [*_READY, *_PENDING, *_NEW]
    followed.append([m.lookup(k, ctx["s"]) for k in everything])
    m.complete_store(sorted(k for k, (_, r) in m.resident().items() if r == -1), ctx["s"])
    ready = sorted(k for k, (_, r) in m.resident().items() if r >= 0)
    last = ReqContext(req_id="last")
    followed.append(_outcome(lambda: m.prepare_load(ready, last)))
    m.complete_load(ready, last)
    for c in (*ctx.values(), last):
        m.on_request_finished(c)
    _policy_agrees(m)
    followed += [_snapshot(m), list(m.take_events()), repr(m.get_stats()), policy.calls]
    followed.append(policy.heard)
    return left, followed


@pytest.mark.parametrize(("name", "skip"), RAISING_CASES)
def test_both_managers_complete_or_undo_a_call_whose_policy_raises(name: str, skip: int) -> None:
    """A policy method raising at any of a call's reports: a load changes nothing (pins already
    reported are reported released), any other call completes (ending as the same call with no
    failure), and the first exception is raised; the same in both managers, with the same
    policy calls, and the same calls after it."""
    seen = []
    for manager_cls in (CPUOffloadingManager, ReferenceManager):
        left, followed = _raising_run(manager_cls, name, skip)
        clean, _ = _raising_run(manager_cls, name, None)
        assert left == clean
        seen.append((left, followed))
    assert seen[0] == seen[1]


@pytest.mark.parametrize("call", ["prepare_load", "prepare_read"])
def test_a_load_whose_report_raises_reports_released_what_it_pinned(call: str) -> None:
    """The policy hears of each pin taken back (last first); the key whose report raised is
    released unreported; in both managers, for a load and for a read alike."""
    seen = []
    for manager_cls in (CPUOffloadingManager, ReferenceManager):
        m = _countdown_manager(manager_cls, 8)
        ctx = ReqContext(req_id="r")
        m.prepare_store(_READY, ctx)
        m.complete_store(_READY, ctx)
        m.prepare_load([_B], ctx)
        before = _snapshot(m)
        m.policy.fail_in, m.policy.skip = "mark_non_evictable", 2
        m.policy.calls.clear()
        with pytest.raises(RuntimeError, match="mark_non_evictable"):
            getattr(m, call)([_A, _B, _C, _A, _D, _E], ctx)
        assert m.policy.calls == ["mark_non_evictable"] * 3 + ["mark_evictable"] * 2
        assert _snapshot(m) == before
        _policy_agrees(m)
        seen.append(m.policy.calls)
    assert seen[0] == seen[1]


@pytest.mark.parametrize("seed", range(6))
def test_both_managers_agree_under_a_randomly_failing_policy(seed: int) -> None:
    """The same random calls, the policy raising now and then at some report of one: both
    managers answer, raise, change and tell the policy exactly the same at every step."""
    runs = []
    for manager_cls in (CPUOffloadingManager, ReferenceManager):
        rng = random.Random(seed)
        m = _countdown_manager(manager_cls, 6, store_threshold=2, max_tracker_size=8)
        policy: Countdown = m.policy
        keys = [bytes([i]) * 6 for i in range(14)]
        contexts = [ReqContext(req_id=str(i)) for i in range(3)]
        pins: list[tuple[bytes, ReqContext]] = []
        log: list[Any] = []
        call: Callable[[], Any]
        for _ in range(300):
            if rng.random() < 0.4:
                policy.fail_in, policy.skip = rng.choice(FLAKY_METHODS), rng.randrange(3)
            ctx = rng.choice(contexts)
            pending = sorted(k for k, (_, r) in m.resident().items() if r == -1)
            ready = sorted(k for k, (_, r) in m.resident().items() if r >= 0)
            op = rng.choice(["store", "complete", "fail", "load", "unload", "touch", "finish"])
            if op == "store":
                call = functools.partial(m.prepare_store, rng.sample(keys, rng.randint(1, 4)), ctx)
            elif op in ("complete", "fail"):
                chosen = rng.sample(pending, min(len(pending), rng.randint(0, 3)))
                call = functools.partial(m.complete_store, chosen, ctx, op == "complete")
            elif op == "load":
                chosen = rng.sample(ready, min(len(ready), rng.randint(0, 3)))
                chosen += chosen[:1]  # a repeat: pinned twice

                def call(chosen: list[bytes] = chosen, ctx: ReqContext = ctx) -> Any:
                    out = m.prepare_load(chosen, ctx)  # noqa: B023 (this manager)
                    pins.extend((k, ctx) for k in chosen)  # noqa: B023
                    return out

            elif op == "unload" and pins:
                k, c = pins.pop(rng.randrange(len(pins)))
                call = functools.partial(m.complete_load, [k], c)
            elif op == "touch":
                call = functools.partial(m.touch, rng.sample(keys, 3), ctx)
            elif op == "finish":
                contexts[contexts.index(ctx)] = ReqContext(req_id=str(rng.random()))
                call = functools.partial(m.on_request_finished, ctx)
            elif rng.random() < 0.05:
                call = m.reset_cache
                pins.clear()
            else:
                continue
            log.append((op, _outcome(call), _snapshot(m), list(m.take_events())))
            log.append(repr(m.get_stats()))
            _policy_agrees(m)
        log += [policy.calls, policy.heard]
        runs.append(log)
    assert runs[0] == runs[1]


def _panic_exception() -> type[BaseException]:
    """PyO3's PanicException (what a PyO3 extension raises for a Rust panic)."""
    with contextlib.suppress(Exception):
        _native._raise_core_error("Invariant")
    for cls in BaseException.__subclasses__():
        if cls.__name__ == "PanicException":
            return cls
    pytest.skip("PyO3's PanicException class is not reachable")


class Raising(Flaky):
    """Flaky, raising ``exc`` instead of RuntimeError."""

    exc: type[BaseException] = RuntimeError

    def _maybe_fail(self, name: str) -> None:
        self.calls.append(name)
        if self.fail_in == name:
            self.fail_in = None
            raise self.exc(f"policy failed in {name}")


@pytest.mark.parametrize(
    "method", ["on_store_miss", "on_request_access", "evict", "insert", "mark_non_evictable"]
)
def test_a_panic_exception_from_the_policy_is_undone_like_any_other(method: str) -> None:
    # PyO3 turns a PanicException it takes back into a Rust panic; unwinding through the core
    # it skipped the undo and poisoned the manager's lock for good.
    ends = []
    call: Callable[[], object]
    for exc in (RuntimeError, _panic_exception()):
        m = _flaky_manager(3)
        policy = m.policy
        policy.__class__ = Raising
        policy.exc = exc
        keys = [bytes([i]) * 4 for i in range(5)]
        ctx = ReqContext(req_id="r")
        m.prepare_store(keys[:3], ctx)
        m.complete_store(keys[:3], ctx)
        before = _snapshot(m)
        policy.fail_in = method
        if method == "mark_non_evictable":
            call = functools.partial(m.prepare_load, keys[:2], ctx)
        else:  # a full pool: evicts
            call = functools.partial(m.prepare_store, keys[3:], ReqContext(req_id="s"))
        with pytest.raises(exc, match=f"policy failed in {method}"):
            call()
        after = _snapshot(m)
        _policy_agrees(m)
        out = m.prepare_store(keys[3:], ReqContext(req_id="t"))
        assert out is not None
        _policy_agrees(m)
        ends.append((before, after, list(m.take_events()), out.keys_to_store, _snapshot(m)))
    assert ends[0] == ends[1]


def test_a_policy_calling_its_manager_gets_reentrant_call_error() -> None:
    m = _flaky_manager(2)
    seen: list[BaseException] = []

    def evict(self: Any, n: int, protected: set[bytes]) -> Any:
        # Lookups read the table without the lock, so they work even here.
        assert m.lookup(b"a", None).name == "HIT"
        try:
            m.touch([b"x"], None)
        except ReentrantCallError as e:
            seen.append(e)
            raise
        return None

    m.policy.__class__ = Liar
    m.policy.answer = evict
    ctx = ReqContext(req_id="r")
    m.prepare_store([b"a", b"b"], ctx)
    m.complete_store([b"a", b"b"], ctx)
    with pytest.raises(ReentrantCallError, match="inside its own cache policy"):
        m.prepare_store([b"c"], ctx)
    assert len(seen) == 1
    assert m.lookup(b"a", ctx).name == "HIT"
    _policy_agrees(m)


def test_threads_share_a_manager_with_a_python_policy() -> None:
    m = _flaky_manager(64)
    errors: list[BaseException] = []

    def work(t: int) -> None:
        try:
            rng = random.Random(t)
            for i in range(300):
                ctx = ReqContext(req_id=f"{t}/{i}")
                keys = [b"t%d/%d" % (t, rng.randrange(40)) for _ in range(3)]
                keys = list(dict.fromkeys(keys))
                out = m.prepare_store(keys, ctx)
                if out is not None:
                    m.complete_store(out.keys_to_store, ctx)
                hits = [k for k in keys if m.lookup(k, ctx).name == "HIT"]
                try:
                    m.prepare_load(hits, ctx)
                except KeyStateError:
                    continue  # another thread evicted one since the lookup
                m.complete_load(hits, ctx)
                m.on_request_finished(ctx)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert errors == []
    _policy_agrees(m)


def test_expired_writes_are_removed_from_a_python_policy() -> None:
    now = [0.0]
    m = _flaky_manager(4, pending_write_timeout=1.0, clock=lambda: now[0])
    ctx = ReqContext(req_id="r")
    a, b = b"a" * 4, b"b" * 4
    m.prepare_store([a], ctx)
    now[0] = 0.5
    m.prepare_store([b], ctx)
    now[0] = 1.2
    m.policy.calls.clear()
    assert m.expire_pending_writes() == [a]
    assert m.policy.calls == ["remove"]
    _policy_agrees(m)
    now[0] = 3.0
    m.policy.fail_in = "remove"
    with pytest.raises(RuntimeError, match="remove"):
        m.expire_pending_writes()
    assert m.resident() == {}  # the expiry stands, as a failed store's removal does
    _policy_agrees(m)
