"""The main job runs end to end: `kvoffload bench` on a small workload exits 0."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvoffload import CPUOffloadingManager, ReqContext, make_offload_key
from kvoffload.bench import _eviction_order
from kvoffload.cli import main


def test_bench_small_run_agrees(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "--requests", "40", "--chunks", "256", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "identical answers" in out
    assert "lru" in out
    assert "arc" in out


BROKEN = '''
import itertools
from kvoffload import CPUOffloadingManager

class IgnoresTouch(CPUOffloadingManager):
    """Touch does nothing."""

    def touch(self, keys, ctx):
        pass

class Flaky(CPUOffloadingManager):
    """Every second instance ignores touch: its replays disagree with each other."""

    made = itertools.count()

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if next(Flaky.made) % 2:
            self.touch = lambda keys, ctx: None
'''


@pytest.fixture
def broken(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "kvo_broken_managers.py").write_text(BROKEN)
    monkeypatch.syspath_prepend(str(tmp_path))
    return "kvo_broken_managers"


def bench(*extra: str) -> list[str]:
    return ["bench", "--requests", "300", "--chunks", "1024", "--no-progress", *extra]


def test_bench_tells_a_manager_that_ignores_touch_apart(
    broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(bench("--policies", "arc", "--impls", f"rust,{broken}:IgnoresTouch")) == 1
    assert "arc: MISMATCH" in capsys.readouterr().out


def test_bench_fails_an_implementation_whose_replays_disagree(
    broken: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = bench("--policies", "arc", "--impls", f"{broken}:Flaky", "--repeat", "2")
    assert main(argv) == 1
    captured = capsys.readouterr()
    assert "is not deterministic" in captured.err
    assert "arc: MISMATCH" in captured.out


def test_bench_with_one_implementation_compares_nothing(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(bench("--policies", "lru", "--impls", "rust")) == 0
    out = capsys.readouterr().out
    assert "lru: answers from rust alone, compared with nothing" in out
    assert "identical answers" not in out


def test_the_eviction_order_tells_orders_that_no_answer_showed_apart() -> None:
    # The same keys resident, touched in two orders: only the eviction order differs.
    digests = []
    for order in ([0, 1, 2, 3], [3, 2, 1, 0]):
        m = CPUOffloadingManager(4)
        ctx = ReqContext("r")
        keys = [make_offload_key(b"%031d" % i, 0) for i in range(4)]
        m.complete_store(m.prepare_store(keys, ctx).keys_to_store, ctx)
        for i in order:
            m.touch([keys[i]], ReqContext(f"t{i}"))
        digests.append(_eviction_order(m, 4, ReqContext))
    assert digests[0] != digests[1]
