"""The main job runs end to end: `kvoffload bench` on a small workload exits 0."""

from __future__ import annotations

import pytest

from kvoffload.cli import main


def test_bench_small_run_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--requests", "40", "--chunks", "256", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "identical answers" in out
    assert "lru" in out
    assert "arc" in out
