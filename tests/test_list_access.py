"""The binding reads and fills Python lists, and reads tuples, through their item arrays where
the layouts check out, and through ``PyList_GetItem``/``PyList_SetItem``/``PyTuple_GetItem``
otherwise: both paths give the same answers. ``kvoffload._native._list_access`` reports and
switches the path."""

from __future__ import annotations

import sysconfig
from collections.abc import Iterator

import pytest

import _driver
import kvoffload
from kvoffload import _native
from kvoffload.errors import InvalidArgumentError


@pytest.fixture
def api_lists() -> Iterator[None]:
    """Lists through the C API for the test's duration; the checked path afterwards."""
    assert _native._list_access("api") == "api"
    try:
        yield
    finally:
        _native._list_access("direct")


#: The path the layout check settles on: every CPython with the GIL that loads the abi3
#: extension (3.10+, release builds) has the layout; a free-threaded build's larger object header
#: does not, and takes the C API.
CHECKED = "api" if sysconfig.get_config_var("Py_GIL_DISABLED") else "direct"


def test_cpython_layout_checks_out() -> None:
    assert _native._list_access() == CHECKED
    assert _native._list_access(None) == CHECKED
    # Asking for the direct path gets it only where the layout checks out.
    assert _native._list_access("direct") == CHECKED


def test_unknown_mode_is_refused_and_changes_nothing() -> None:
    with pytest.raises(InvalidArgumentError, match="mode must be"):
        _native._list_access("fast")
    assert _native._list_access() == CHECKED


def _store_round(keys: list[bytes]) -> list[object]:
    """Answers of a small cache through stores with eviction, loads, lookups and events,
    with keys given as lists and tuples (read by the binding) and answered as lists (filled by
    it)."""
    m = kvoffload.CPUOffloadingManager(8, enable_events=True)
    ctx = kvoffload.ReqContext(req_id="r")
    seen: list[object] = []
    for lo in range(0, len(keys), 4):
        batch = keys[lo : lo + 4]
        out = m.prepare_store(batch, ctx)
        assert out is not None
        assert isinstance(out.store_spec, kvoffload.CPULoadStoreSpec)
        seen.append(
            (
                list(out.keys_to_store),
                out.store_spec.chunk_ids.tolist(),
                list(out.evicted_keys),
                [k is b for k, b in zip(out.keys_to_store, batch, strict=False)],
            )
        )
        m.complete_store(tuple(out.keys_to_store), None)
        found = [m.lookup(k, ctx) for k in batch]
        seen.append(found)
        resident = [k for k, r in zip(batch, found, strict=True) if r is kvoffload.LookupResult.HIT]
        seen.append((m.lookup_prefix(list(batch), ctx), m.lookup_prefix(tuple(batch), ctx)))
        if resident:
            spec = m.prepare_load(tuple(resident), ctx)
            seen.append(spec.chunk_ids.tolist())
            m.complete_load(resident, None)
        m.touch(list(batch), None)
        m.touch(tuple(batch[:2]), None)
    seen.append([(sorted(e.keys), e.removed) for e in m.take_events()])
    m.check_invariants()
    return seen


def test_both_paths_answer_alike(api_lists: None) -> None:
    keys = [bytes([i]) * 36 for i in range(40)]
    through_api = _store_round(keys)
    _native._list_access("direct")
    direct = _store_round(keys)
    assert direct == through_api
    # The stored key objects come back as themselves, not copies, on both paths.
    stores = [s for s in direct if isinstance(s, tuple) and len(s) == 4]
    assert len(stores) == 10
    assert all(all(same) for *_, same in stores)


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_seeded_sequences_through_the_api_path(api_lists: None, policy: str) -> None:
    # The differential driver's random legal sequences, Rust against the reference, with
    # every list the binding reads or fills going through the C API.
    specs = [_driver.impl_spec(name) for name in ("rust", "reference")]
    for seed in range(6):
        result = _driver.run_sequence(specs, policy, 2, seed, 300)
        assert result.mismatch is None, result.mismatch.report(20)
