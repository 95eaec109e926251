"""Junk of any shape into every HostPool method raises a kvoffload exception (or Python's own
TypeError for a wrong argument count) and never crashes, hangs or writes into the pool."""

from __future__ import annotations

import contextlib
from typing import Any

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvoffload import HostPool, KVOffloadError

junk = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True),
    st.text(max_size=4),
    st.binary(max_size=64),
    st.lists(st.one_of(st.integers(-(2**65), 2**65), st.none(), st.floats()), max_size=4),
    st.just(np.zeros((2, 32), np.float32)),
    st.just(np.zeros((4, 8), np.uint8)[:, ::2]),
    st.just(np.array([[0, 1]])),
    st.just(np.array([1.5, 2.5])),
    st.just(np.array([2**63], np.uint64)),
    st.just(object()),
)

CALLS = ["gather", "scatter", "submit_store", "submit_load", "chunk", "typed_view", "wait"]


@pytest.fixture(scope="module")
def pool() -> Any:
    p = HostPool(4, 64, num_threads=2, register_cuda=False)
    yield p
    p.close()


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    call=st.sampled_from(CALLS),
    args=st.lists(junk, max_size=4),
    kwargs=st.dictionaries(
        st.sampled_from(["block_bytes", "chunk_offset", "threads", "shape", "dtype"]),
        junk,
        max_size=2,
    ),
)
def test_junk_never_crashes_or_writes(
    pool: Any, call: str, args: list[Any], kwargs: dict[str, Any]
) -> None:
    pool.view()[:] = 0x11
    error: Exception | None = None
    try:
        getattr(pool, call)(*args, **kwargs)
    except Exception as e:
        error = e
    # A kvoffload error, or Python's own complaint about the call's shape; nothing else.
    if error is not None and not isinstance(error, KVOffloadError):
        assert isinstance(error, TypeError), repr(error)
        assert "argument" in str(error), repr(error)
    pool.wait(range(64))
    finished = pool.get_finished()
    if (pool.view() != 0x11).any():
        # Only a transfer into the pool that was accepted may have written, and it must have
        # been valid: the call raised nothing, and a store's job finished and succeeded.
        assert call in ("gather", "submit_store"), call
        assert error is None, repr(error)
        if call == "submit_store":
            assert finished, "a store wrote without a finished job"
            assert all(ok for _, ok in finished), finished


VALID: dict[str, tuple[tuple[Any, ...], dict[str, Any]]] = {
    "gather": ((np.zeros((2, 32), np.uint8), [0, 1], [1, 2]), {"block_bytes": 32}),
    "scatter": ((np.zeros((2, 32), np.uint8), [0, 1], [1, 2]), {"block_bytes": 32}),
    "submit_store": ((5, np.zeros((2, 32), np.uint8), [0, 1], [1, 2]), {"block_bytes": 32}),
    "submit_load": ((6, np.zeros((2, 32), np.uint8), [0, 1], [1, 2]), {"block_bytes": 32}),
    "chunk": ((1,), {"dtype": np.float32, "shape": (16,)}),
    "typed_view": ((np.float32, (16,)), {}),
}


@settings(
    max_examples=400, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(
    call=st.sampled_from(sorted(VALID)),
    position=st.integers(0, 5),
    value=junk,
)
def test_one_bad_argument_in_a_valid_call(pool: Any, call: str, position: int, value: Any) -> None:
    """A valid call with one argument replaced by junk: a kvoffload error or a valid call."""
    valid_args, kwargs = VALID[call]
    args = list(valid_args)
    names = list(kwargs)
    if position < len(args):
        args[position] = value
    elif names:
        kwargs = kwargs | {names[(position - len(args)) % len(names)]: value}
    with contextlib.suppress(KVOffloadError):
        getattr(pool, call)(*args, **kwargs)
    pool.wait(range(64))
    pool.get_finished()
