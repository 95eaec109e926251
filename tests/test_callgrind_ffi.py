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
from cases import BLOCK_TOKENS, OPERATIONS, ROUNDS_PER_REQUEST, FilledCache  # noqa: E402


@pytest.mark.parametrize("policy", ["lru", "arc"])
@pytest.mark.parametrize("op", OPERATIONS)
def test_the_counted_process_runs_each_case(op: str, policy: str) -> None:
    # What callgrind runs, without callgrind: a small pool, a few rounds after a warm-up.
    assert callgrind_ffi.main(["--child", "rust", policy, op, "64", "3", "2"]) == 0
    argv = ["--child", "rust", policy, op, "64", "3", "2", "positions"]
    assert callgrind_ffi.main(argv) == 0


@pytest.mark.parametrize("op", ["store_evict", "load_complete"])
def test_positions_are_recorded_as_a_scheduler_records_them(op: str) -> None:
    # Distinct within a request, rising across its rounds; none without `positions`.
    cache = FilledCache("rust", "lru", 256, batch=4, positions=True)
    rounds = cache.prepare(op, 2 * ROUNDS_PER_REQUEST)
    by_ctx: dict[int, list[int | None]] = {}
    for keys, ctx in rounds:
        by_ctx.setdefault(id(ctx), []).extend(ctx.get_offload_key_position(k) for k in keys)
    expected = [BLOCK_TOKENS * (j + 1) for j in range(4 * ROUNDS_PER_REQUEST)]
    assert list(by_ctx.values()) == [expected, expected]
    plain = FilledCache("rust", "lru", 256, batch=4)
    keys, ctx = plain.prepare(op, 1)[0]
    assert [ctx.get_offload_key_position(k) for k in keys] == [None] * 4


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
