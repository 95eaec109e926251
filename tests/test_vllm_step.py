"""benches/vllm_step.py: every manager gives vLLM's answers under each setting it offers."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))


@pytest.mark.parametrize(
    "settings",
    [
        [],
        ["--events"],
        ["--store-threshold", "2"],
        ["--kv-groups", "2"],
        ["--events", "--store-threshold", "3", "--kv-groups", "2"],
    ],
)
def test_the_managers_agree_with_vllm(oracle: Any, settings: list[str], capsys: Any) -> None:
    # main() returns 1 when any manager's digest (every answer, event and the final stats)
    # differs from vLLM's own manager's.
    import vllm_step

    argv = ["--requests", "40", "--repeat", "1", "--chunks", "256", *settings]
    assert vllm_step.main(argv) == 0
    out = capsys.readouterr().out
    assert "identical answers" in out
    assert f"events {'on' if '--events' in settings else 'off'}" in out
