"""Bad input of any shape raises a kvoffload exception (or Python's own argument TypeError) and
never reaches a Rust panic or crashes the process; the core's error variants each map to their
documented Python class."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import kvoffload
from kvoffload import _native
from kvoffload.errors import (
    BlockIndexError,
    DuplicateKeyError,
    HostMemoryError,
    InvalidArgumentError,
    InvariantViolation,
    KeyStateError,
    KVOffloadError,
    PageLockError,
    PoolClosedError,
    RequestFinishedError,
    SharedRegionError,
)

CORE_VARIANTS = {
    "InvalidArgument": InvalidArgumentError,
    "KeyState": KeyStateError,
    "DuplicateKey": DuplicateKeyError,
    "RequestFinished": RequestFinishedError,
    "Overflow": KeyStateError,
    "Invariant": InvariantViolation,
    "OutOfRange": BlockIndexError,
    "Os": HostMemoryError,
    "PageLock": PageLockError,
    "SharedRegion": SharedRegionError,
    "Closed": PoolClosedError,
}


@pytest.mark.parametrize(("variant", "cls"), CORE_VARIANTS.items())
def test_each_core_error_maps_to_its_class(variant: str, cls: type[Exception]) -> None:
    with pytest.raises(cls, match=f"test {variant}") as info:
        _native._raise_core_error(variant)
    assert type(info.value) is cls
    assert isinstance(info.value, KVOffloadError)


def test_unknown_variant_is_an_argument_error() -> None:
    with pytest.raises(InvalidArgumentError):
        _native._raise_core_error("Nope")


junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.binary(max_size=6),
    st.lists(st.one_of(st.binary(max_size=6), st.integers(), st.none()), max_size=4),
    st.tuples(st.binary(max_size=6)),
    st.dictionaries(st.binary(max_size=3), st.integers(), max_size=2),
    st.just(object()),
    st.builds(lambda: iter([b"a", 1])),
)

CALLS = [
    "lookup",
    "lookup_prefix",
    "get_load_source",
    "prepare_load",
    "prepare_read",
    "touch",
    "complete_load",
    "prepare_store",
    "complete_store",
    "on_new_request",
    "on_request_finished",
]


class WeirdContext:
    """A context whose methods misbehave: wrong return types and raising lookups."""

    def __init__(self, positions: Any) -> None:
        self.positions = positions
        self.state: dict[type, Any] = {}

    def get_state(self, cls: type) -> Any:
        return self.state.get(cls)

    def set_state(self, val: Any) -> None:
        self.state[type(val)] = val

    def get_offload_key_position(self, key: bytes) -> Any:
        if isinstance(self.positions, Exception):
            raise self.positions
        return self.positions


def call_error(method: Any, args: tuple[Any, ...]) -> Exception | None:
    try:
        method(*args)
    except Exception as e:
        return e
    return None


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(["lru", "arc"]),
    call=st.sampled_from(CALLS),
    arg=junk,
    position=st.one_of(junk, st.just(ValueError("boom"))),
    use_weird=st.booleans(),
)
def test_junk_arguments_never_panic(
    policy: str, call: str, arg: Any, position: Any, use_weird: bool
) -> None:
    m = kvoffload.CPUOffloadingManager(4, cache_policy=policy)
    ctx: Any = kvoffload.ReqContext("r")
    good = [b"k1\x00\x00\x00\x00", b"k2\x00\x00\x00\x00"]
    m.prepare_store(good, ctx)
    m.complete_store(good, ctx)
    if use_weird:
        ctx = WeirdContext(position)
    else:
        for key in good:
            ctx.set_offload_key_position(key, position)
    method = getattr(m, call)
    for args in ((arg, ctx), (good, arg), (arg,)):
        error = call_error(method, args)
        # Allowed: kvoffload's errors, Python's own arity check, the context's own failure.
        assert (
            error is None
            or isinstance(error, KVOffloadError)
            or (type(error) is TypeError and "positional argument" in str(error))
            or (type(error) is ValueError and str(error) == "boom")
        ), repr(error)
        m.check_invariants()


def test_huge_and_empty_inputs() -> None:
    m = kvoffload.CPUOffloadingManager(0)
    ctx = kvoffload.ReqContext("r")
    assert m.prepare_store([], ctx) is not None
    assert m.prepare_store([b"x" * 100_000], ctx) is None
    assert m.lookup(b"", ctx) is kvoffload.LookupResult.MISS
    with pytest.raises(InvalidArgumentError):
        kvoffload.CPUOffloadingManager(2**31)
    with pytest.raises(InvalidArgumentError):
        kvoffload.CPUOffloadingManager(2**64)
    big = kvoffload.CPUOffloadingManager(2**31 - 1)  # memory grows with use, not with capacity
    assert big.prepare_store([b"a\x00\x00\x00\x00"], ctx) is not None
    big.check_invariants()


def test_position_out_of_int64_range_is_rejected_without_change() -> None:
    m = kvoffload.CPUOffloadingManager(4)
    ctx = kvoffload.ReqContext("r")
    key = b"k\x00\x00\x00\x00"
    for bad in (2**63, -(2**63), "7", 1.5):
        ctx.set_offload_key_position(key, bad)  # type: ignore[arg-type]
        with pytest.raises(InvalidArgumentError):
            m.prepare_store([key], ctx)
        assert m.resident() == {}
    m.check_invariants()


@pytest.mark.parametrize("size", [2**30 + 1, 2**36, 2**62])
def test_core_refuses_a_sketch_too_wide(size: int) -> None:
    # The core's own check, behind the Python layer's: no allocation abort, no overflow panic.
    with pytest.raises(InvalidArgumentError, match="2\\*\\*30"):
        _native.ManagerCore(4, "lru", False, 2, size, admission="tinylfu")
