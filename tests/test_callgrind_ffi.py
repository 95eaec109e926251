"""benches/callgrind_ffi.py: its counted process runs every case, and a count is repeatable."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path
from typing import Any

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"
if str(BENCHES) not in sys.path:
    sys.path.insert(0, str(BENCHES))

import callgrind_ffi  # noqa: E402
from cases import OPERATIONS  # noqa: E402


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("op", OPERATIONS)
def test_the_counted_process_runs_each_case(op: str, policy: str) -> None:
    # What callgrind runs, without callgrind: a small pool, a few rounds after a warm-up.
    assert callgrind_ffi.main(["--child", "rust", policy, op, "64", "3", "2"]) == 0


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--ops", "store"], "unknown operation 'store'"),
        (["--impls", "rust,cpp"], "unknown implementation 'cpp'"),
        (["--policies", "lru,mru"], "unknown policy 'mru'"),
    ],
)
def test_unknown_names_are_refused(argv: list[str], says: str, capsys: Any) -> None:
    assert callgrind_ffi.main(argv) == 2
    assert says in capsys.readouterr().err


@pytest.mark.skipif(shutil.which("valgrind") is None, reason="valgrind is not installed")
def test_a_count_is_the_same_twice() -> None:
    # The point of the tool: the same case counts (nearly) the same instructions in two
    # processes (hash randomisation off, BLAS threads at one, GC paused), whatever the machine is
    # doing. Not always exactly: addresses differ between processes, and what hashes them (the
    # binding's chunk guesses) can take another branch now and then (44 instructions of 147,500
    # once, on CPython 3.10).
    valgrind = shutil.which("valgrind")
    assert valgrind is not None
    counts = [
        callgrind_ffi.count("rust", "lru", "load_complete", 64, 4, 1, valgrind) for _ in range(2)
    ]
    assert abs(counts[0] - counts[1]) <= counts[0] // 1000
    # Four rounds of 32 keys through prepare_load and complete_load: more than a few hundred
    # instructions a key would mean the fill or the start-up were counted too.
    assert 4 * 32 * 200 < counts[0] < 4 * 32 * 5_000
