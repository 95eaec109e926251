"""benches/calls.py: every other call's case runs, and leaves the pool as its view says."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_each_case_keeps_the_pool_full_and_as_its_view_says(impl: str, policy: str) -> None:
    from calls import CALLS, Calls

    calls = Calls(impl, policy, 256)
    for call in CALLS:
        assert calls.run(call, 3, 0) > 0, call  # a case that ran timed something
        # The failed stores' chunks were filled again, the reset pool restored: after every
        # case the pool is full of ready chunks, exactly the keys the case's view holds.
        held = calls.cache.manager.resident()
        assert set(held) == set(calls.cache.resident), call
        assert len(held) == 256, call
        assert all(ref == 0 for _chunk, ref in held.values()), call
    # The pool with events on, too (take_events and store_events ran on it).
    events = calls.events
    assert set(events.manager.resident()) == set(events.resident)
    assert list(events.manager.take_events()) == []


def test_vllm_runs_every_case(oracle: Any, capsys: Any) -> None:
    import calls

    assert (
        calls.main(["--impls", "rust,vllm", "--chunks", "256", "--repeat", "1", "--scale", "0.01"])
        == 0
    )
    out = capsys.readouterr().out
    for label in calls.LABELS.values():
        assert out.count(f"| {label} |") == 2, label  # a row under each policy


def test_bad_arguments_are_refused(capsys: Any) -> None:
    import calls

    assert calls.main(["--calls", "nope"]) == 2
    assert calls.main(["--chunks", "10"]) == 2
    assert "unknown call 'nope'" in capsys.readouterr().err
