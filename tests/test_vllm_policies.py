"""kvoffload's Rust policies inside vLLM 0.33.0's own manager (``RustLRU``, ``RustARC``).

Against vLLM's real ``kv_offload`` modules (see ``test_vllm_spec.py``): vLLM's manager running
``RustLRU``/``RustARC`` gives the same results as with its own LRU/ARC over seeded random
sequences; with kvoffload's other policies (``RustSIEVE``, ...) it gives the same results as
kvoffload's manager running them; and random ``CachePolicy`` call sequences leave the Rust and
the Python policy in the same order with the same evictions. The native policy core's own
contract needs no vLLM.
"""

from __future__ import annotations

import ctypes
import os
import random
import sys
from typing import Any

import pytest

import _driver
from _vllm import (
    OURS,
    POLICIES,
    RUST_POLICY,
    SPEC_MODULE_PATH,
    THRESHOLDS,
    Checked,
    key,
    run_seeded,
    run_shared,
    via_spec,
    vllm_spec_impl,
)
from kvoffload.integrations.vllm import RUST_POLICIES as RUST_POLICIES_BY_NAME

# --- the Rust policies inside vLLM's manager ---


def _rust_policy_impl(oracle: Any) -> _driver.ImplSpec:
    def extra(policy: str) -> dict[str, Any]:
        return {
            "eviction_policy": RUST_POLICY[policy],
            "cache_policy_module_path": SPEC_MODULE_PATH,
        }

    def check(m: Any) -> None:
        m._policy.check_invariants()

    make = via_spec(oracle, extra, lambda m: Checked(m, oracle.manager_module, check))
    return _driver.ImplSpec("vllm+rust-policy", make, oracle.ReqContext, None)


def test_rust_policies_in_vllms_managers_sharing_contexts_match_vllms(oracle: Any) -> None:
    # Two of vLLM's managers on one set of request contexts: each replaces the other's request
    # state, and an LRU policy's request rank outlives that, in kvoffload's policies as in
    # vLLM's.
    run_shared([vllm_spec_impl(oracle), _rust_policy_impl(oracle)], count=15)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_rust_policy_in_vllms_manager_matches_vllms_policy(
    oracle: Any, policy: str, threshold: int
) -> None:
    run_seeded([vllm_spec_impl(oracle), _rust_policy_impl(oracle)], policy, threshold, count=15)


#: kvoffload's own policies, as vLLM ``CachePolicy`` classes (vLLM has no Python twin of them).
OWN_RUST_POLICIES = {
    kind: name for name, kind in RUST_POLICIES_BY_NAME.items() if kind not in ("lru", "arc")
}


@pytest.mark.parametrize("policy", sorted(OWN_RUST_POLICIES))
def test_own_rust_policy_in_vllms_manager_matches_kvoffloads_manager(
    oracle: Any, vllm_mod: Any, policy: str
) -> None:
    def extra(policy: str) -> dict[str, Any]:
        return {
            "eviction_policy": OWN_RUST_POLICIES[policy],
            "cache_policy_module_path": SPEC_MODULE_PATH,
        }

    def ours(policy: str) -> dict[str, Any]:
        return {**OURS, "eviction_policy": policy}

    in_vllm = _driver.ImplSpec(
        "vllm+rust-policy",
        via_spec(oracle, extra, lambda m: Checked(m, oracle.manager_module)),
        oracle.ReqContext,
        None,
    )
    kvoffload = _driver.ImplSpec(
        "kvoffload",
        via_spec(oracle, ours, lambda m: Checked(m, oracle.manager_module)),
        oracle.ReqContext,
        None,
    )
    for threshold in (1, 2):
        run_seeded(
            [kvoffload, in_vllm],
            policy,
            threshold,
            count=int(os.environ.get("KVOFFLOAD_VLLM_SEEDS", "5")),
        )


def test_rust_policies_load_through_cache_policy_module_path(oracle: Any, vllm_mod: Any) -> None:
    factory = oracle.manager_module.CachePolicyFactory
    base = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].CachePolicy
    for name in RUST_POLICIES_BY_NAME:
        cls = factory.get_cache_policy_cls(name, SPEC_MODULE_PATH)
        assert cls is getattr(vllm_mod, name)
        assert issubclass(cls, base)
        policy = cls(cache_capacity=4)
        # vLLM's manager calls reach Rust directly: bound native methods, no Python frame.
        assert type(policy.get).__name__ == "builtin_function_or_method"


class PolicyDriver:
    """Random ``CachePolicy`` calls, legal as vLLM's manager would make them, on two policies."""

    def __init__(self, oracle: Any, policies: list[Any], rng: random.Random, capacity: int) -> None:
        self.status = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].ChunkStatus
        self.oracle, self.policies, self.rng, self.capacity = oracle, policies, rng, capacity
        self.chunks: list[dict[bytes, Any]] = [{} for _ in policies]  # key -> ChunkStatus
        self.ctxs: list[list[Any]] = [[] for _ in policies]
        self.next_id = 0

    def new_request(self) -> None:
        positions = {
            key(self.rng.randrange(40), self.rng.choice((0, 1))): 16 * self.rng.randrange(1, 9)
            for _ in range(self.rng.randrange(0, 12))
        }
        for ctxs in self.ctxs:
            ctx = self.oracle.ReqContext(f"r{len(ctxs)}")
            for k, p in positions.items():
                ctx.set_offload_key_position(k, p)
            ctxs.append(ctx)

    def step(self) -> tuple[str, list[Any], list[Any]] | None:
        """One random call on every policy: ``(kind, results, get() of some keys)``."""
        rng = self.rng
        resident = sorted(self.chunks[0])
        some = [key(rng.randrange(40), rng.choice((0, 1))) for _ in range(rng.randrange(1, 6))]
        kind = rng.choice(
            ["insert"] * 5 + ["ready", "pin", "unpin", "touch", "access", "miss", "finish"] * 2
            + ["evict"] * 3 + ["remove", "new", "clear"]
        )  # fmt: skip
        new = [k for k in dict.fromkeys(some) if k not in self.chunks[0]]
        if kind == "insert" and len(resident) + len(new) > self.capacity:
            return None
        if kind == "new":
            self.new_request()
            return None
        inserted = {k for k in some if rng.random() < 0.5}
        n = rng.randrange(0, 4)
        results = [self._call(i, kind, some, new, resident, inserted, n) for i in range(2)]
        if kind == "insert":
            self.next_id += len(new)
        gets = [
            [(k, None if (c := p.get(k)) is None else (c.chunk_id, c.ref_cnt)) for k in some]
            for p in self.policies
        ]
        return kind, results, gets

    def _call(
        self,
        i: int,
        kind: str,
        some: list[bytes],
        new: list[bytes],
        resident: list[bytes],
        inserted: set[bytes],
        n: int,
    ) -> Any:
        policy, chunks, ctx = self.policies[i], self.chunks[i], self.ctxs[i][-1]
        if kind == "insert":
            for j, k in enumerate(new):
                chunks[k] = self.status(self.next_id + j)
                policy.insert(k, chunks[k], ctx)
            return new
        if kind == "ready":
            pending = [k for k in resident if chunks[k].ref_cnt == -1][:3]
            for k in pending:
                chunks[k].ref_cnt = 0
                policy.mark_evictable(k)
            return pending
        if kind == "pin":
            ready = [k for k in resident if chunks[k].ref_cnt >= 0][:2]
            for k in ready:
                if chunks[k].ref_cnt == 0:
                    policy.mark_non_evictable(k)
                chunks[k].ref_cnt += 1
            return ready
        if kind == "unpin":
            pinned = [k for k in resident if chunks[k].ref_cnt > 0][:2]
            for k in pinned:
                chunks[k].ref_cnt -= 1
                if chunks[k].ref_cnt == 0:
                    policy.mark_evictable(k)
            return pinned
        if kind == "touch":
            return policy.touch(some, ctx)
        if kind == "access":
            return policy.on_request_access(some, ctx)
        if kind == "miss":
            return policy.on_store_miss(some, ctx)
        if kind == "finish":
            groups = (tuple(k for k in some if k[-1] == 0), tuple(k for k in some if k[-1]))
            return policy.on_request_finished(groups, inserted, set(some) - inserted, ctx)
        if kind == "evict":
            out = policy.evict(n, set(some))
            if out is None:
                return None
            for k, chunk in out:
                assert chunk is chunks.pop(k)  # the very object that was inserted
            return [(k, c.chunk_id) for k, c in out]
        if kind == "remove":
            pending = [k for k in resident if chunks[k].ref_cnt == -1][:1]
            for k in pending:
                policy.remove(k)
                del chunks[k]
            return pending
        assert kind == "clear"
        policy.clear()
        chunks.clear()
        return None


def _order_of(policy: Any) -> dict[str, Any]:
    """A policy's eviction order: LRU ranks (issued from 0), or ARC's lists and target."""
    if hasattr(policy, "_core"):
        state: dict[str, Any] = policy._core.policy_state()
        if state["policy"] == "lru":
            return {"ranks": state["ranks"]}
        return {k: state[k] for k in ("t1", "t2", "b1", "b2", "target_t1_size")}
    if hasattr(policy, "_ranks"):  # vLLM's first rank is 1
        return {"ranks": {k: (major - 1, minor) for k, (major, minor) in policy._ranks.items()}}
    return {
        "t1": list(policy.t1),
        "t2": list(policy.t2),
        "b1": list(policy.b1),
        "b2": list(policy.b2),
        "target_t1_size": float(policy.target_t1_size),
    }


@pytest.mark.parametrize("policy", POLICIES)
def test_rust_policy_calls_match_vllms_policy(oracle: Any, vllm_mod: Any, policy: str) -> None:
    factory = oracle.manager_module.CachePolicyFactory
    for seed in range(40):
        rng = random.Random(f"{policy}/{seed}")
        capacity = rng.randrange(1, 24)
        policies = [
            factory.get_cache_policy_cls(policy)(cache_capacity=capacity),
            getattr(vllm_mod, RUST_POLICY[policy])(cache_capacity=capacity),
        ]
        driver = PolicyDriver(oracle, policies, rng, capacity)
        driver.new_request()
        for step in range(300):
            got = driver.step()
            if got is None:
                continue
            kind, results, gets = got
            assert results[0] == results[1], (seed, step, kind, results)
            assert gets[0] == gets[1], (seed, step, kind, gets)
            policies[1].check_invariants()
            assert _order_of(policies[0]) == _order_of(policies[1]), (seed, step, kind)


def test_rust_policy_evict_is_all_or_nothing(oracle: Any, vllm_mod: Any) -> None:
    status = sys.modules["vllm.v1.kv_offload.cpu.policies.base"].ChunkStatus
    policy = vllm_mod.RustLRU(cache_capacity=4)
    ctx = oracle.ReqContext("r")
    chunks = {key(i): status(i) for i in range(3)}
    for k, c in chunks.items():
        policy.insert(k, c, ctx)
        c.ref_cnt = 0
        policy.mark_evictable(k)
    assert policy.evict(3, {key(0)}) is None  # only two unprotected
    assert len(policy) == 3
    evicted = policy.evict(2, {key(0)})
    assert [(k, c) for k, c in evicted] == [(key(1), chunks[key(1)]), (key(2), chunks[key(2)])]
    assert policy.get(key(0)) is chunks[key(0)]
    assert isinstance(chunks[key(0)], ctypes.Structure)


# --- the native policy core's own contract (no vLLM needed) ---


class _Chunk:
    def __init__(self, chunk_id: int, ref_cnt: int = -1) -> None:
        self.chunk_id, self.ref_cnt = chunk_id, ref_cnt


def test_policy_core_rejects_calls_vllms_manager_never_makes() -> None:
    from kvoffload import (
        InvalidKeyError,
        KeyStateError,
        ReqContext,
        UnsupportedPolicyError,
        _native,
    )

    with pytest.raises(UnsupportedPolicyError):
        _native.PolicyCore("mru", 4)
    core = _native.PolicyCore("lru", 4)
    ctx = ReqContext("r")
    core.insert(key(1), _Chunk(0), ctx)
    with pytest.raises(KeyStateError, match="already resident"):
        core.insert(key(1), _Chunk(1), ctx)
    with pytest.raises(KeyStateError):
        core.mark_non_evictable(key(1))  # pending, not evictable
    core.mark_evictable(key(1))
    with pytest.raises(KeyStateError, match="already evictable"):
        core.mark_evictable(key(1))
    with pytest.raises(KeyStateError, match="only a pending chunk"):
        core.remove(key(1))
    with pytest.raises(KeyStateError, match="absent"):
        core.mark_evictable(key(2))
    with pytest.raises(InvalidKeyError):
        core.get("not bytes")  # type: ignore[arg-type]
    core.remove(key(2))  # absent: ignored, as vLLM's ARC does
    core.check_invariants()
    assert len(core) == 1


def test_policy_core_refuses_the_position_an_lru_rank_cannot_negate() -> None:
    # -(2**63) has no int64 negation: refused as kvoffload's manager refuses it (it raised a
    # PanicException and poisoned the policy's lock), and the policy goes on working.
    from kvoffload import InvalidArgumentError, ReqContext, _native

    core = _native.PolicyCore("lru", 4)
    ctx = ReqContext("r")
    ctx.set_offload_key_position(key(1), -(2**63))
    with pytest.raises(InvalidArgumentError, match="out of range"):
        core.insert(key(1), _Chunk(0), ctx)
    core.insert(key(2), _Chunk(1), ctx)
    with pytest.raises(InvalidArgumentError, match="out of range"):
        core.on_request_access([key(1), key(2)], ctx)
    ctx.set_offload_key_position(key(1), -(2**63) + 1)
    core.insert(key(1), _Chunk(0), ctx)
    core.check_invariants()
    assert len(core) == 2


def test_policy_core_refuses_bad_arguments_from_kvoffloads_tree() -> None:
    # What vLLM's manager never passes, refused as kvoffload refuses bad input (these were
    # OverflowError, AttributeError and TypeError), changing nothing.
    from kvoffload import InvalidArgumentError, InvalidKeyError, ReqContext, _native

    for capacity in (-1, 2**32, 2**63, "4", 4.0, True, None):
        with pytest.raises(InvalidArgumentError, match="cache_capacity must be an int"):
            _native.PolicyCore("lru", capacity)  # type: ignore[arg-type]
    core = _native.PolicyCore("lru", 4)
    ctx = ReqContext("r")
    core.insert(key(1), _Chunk(0, 0), ctx)
    with pytest.raises(InvalidArgumentError, match="n must be an int >= 0"):
        core.evict(-1, [])
    with pytest.raises(InvalidArgumentError, match="n must be an int >= 0"):
        core.evict("1", [])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="ChunkStatus"):
        core.insert(key(2), object(), ctx)
    with pytest.raises(InvalidKeyError, match="key_groups"):
        core.on_request_finished(5, set(), set(), ctx)  # type: ignore[arg-type]
    assert len(core) == 1
    victims = core.evict(1, [])
    assert victims is not None
    assert [k for k, _ in victims] == [key(1)]
    core.check_invariants()


def _huge_key() -> bytes:
    """A key of 2**32 bytes, one past the longest a slot's 32-bit length holds.

    ``bytes(n)`` takes zeroed pages from the system and nothing here writes them, so it costs
    address space, not memory; a system that refuses the address space skips the test.
    """
    try:
        return bytes(2**32)
    except MemoryError:
        pytest.skip("no 4 GiB of address space for the key")


@pytest.mark.parametrize("kind", ["lru", "arc"])
def test_policy_core_refuses_a_key_too_long_to_store_and_holds_nothing(kind: str) -> None:
    from kvoffload import InvalidArgumentError, KeyStateError, ReqContext, _native

    huge = _huge_key()
    core = _native.PolicyCore(kind, 4)
    ctx = ReqContext("r")
    core.insert(key(1), _Chunk(0, 0), ctx)
    with pytest.raises(InvalidArgumentError, match="too long to store"):
        core.insert(huge, _Chunk(1, 0), ctx)
    # Other calls see it as a key the policy does not hold (each hashes its 4 GiB: a few).
    assert core.get(huge) is None
    with pytest.raises(KeyStateError, match="absent key"):
        core.mark_evictable(huge)
    assert len(core) == 1
    victims = core.evict(1, [huge])
    assert victims is not None
    assert [k for k, _ in victims] == [key(1)]
    core.check_invariants()


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_managers_refuse_to_store_a_key_too_long_and_change_nothing(impl: str) -> None:
    import kvoffload
    import kvoffload.reference
    from kvoffload import InvalidArgumentError, LookupResult, ReqContext

    module = kvoffload if impl == "rust" else kvoffload.reference
    huge = _huge_key()
    m = module.CPUOffloadingManager(4)
    ctx = ReqContext("r")
    m.on_new_request(ctx)
    with pytest.raises(InvalidArgumentError, match="key 1 is too long to store"):
        m.prepare_store([key(1), huge], ctx)
    assert m.lookup(key(1), ctx) == LookupResult.MISS
    out = m.prepare_store([key(1)], ctx)
    assert out is not None
    assert list(out.store_spec.chunk_ids) == [0]
    m.check_invariants()


@pytest.mark.parametrize(
    ("name", "kind"),
    [
        ("RustLRU", "lru"),
        ("RustARC", "arc"),
        ("RustFIFO", "fifo"),
        ("RustSIEVE", "sieve"),
        ("RustS3FIFO", "s3fifo"),
        ("Rust2Q", "2q"),
        ("RustSLRU", "slru"),
        ("RustLFU", "lfu"),
        ("RustARCPaper", "arc-paper"),
    ],
)
def test_each_rust_policy_class_runs_the_policy_its_name_says(
    vllm_mod: Any, name: str, kind: str
) -> None:
    # Spelled out here (docs/vllm.md), not derived from RUST_POLICIES, which it checks.
    policy = getattr(vllm_mod, name)(8)
    assert policy._core.policy_state()["policy"] == kind
    assert kind in policy.__doc__
