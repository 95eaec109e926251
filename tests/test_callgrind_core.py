"""``benches/callgrind_core.py``: it reads callgrind's and the example's output right.

The counted run itself needs valgrind and a release build of the example, which the test run
does not have time for; what can go wrong without them is reading their output.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

BENCHES = Path(__file__).resolve().parent.parent / "benches"

ANNOTATED = """\
--------------------------------------------------------------------------------
Ir                   file:function
--------------------------------------------------------------------------------
110,902,820 (100.0%)  ???:callgrind_ops::main [/x/callgrind_ops]
 56,468,076 (50.92%)  ???:kvoffload_core::manager::Manager::prepare_store [/x/callgrind_ops]
 25,576,967 (23.06%)  ???:callgrind_ops::common::run_store_events [/x/callgrind_ops]
 25,311,463 (22.82%)  ???:callgrind_ops::common::run_store [/x/callgrind_ops]
 22,748,390 (20.65%)  ???:callgrind_ops::common::run_store_fail [/x/callgrind_ops]
 20,024,017 (18.18%)  ???:callgrind_ops::common::run_load [/x/callgrind_ops]
  5,609,081 ( 5.09%)  ???:callgrind_ops::common::run_touch [/x/callgrind_ops]
  4,782,553 ( 4.34%)  ???:callgrind_ops::common::run_finish [/x/callgrind_ops]
  3,325,247 ( 3.02%)  ???:callgrind_ops::common::run_lookup_prefix [/x/callgrind_ops]
  2,763,839 ( 2.51%)  ???:callgrind_ops::common::run_lookup [/x/callgrind_ops]
     17,026 ( 0.02%)  ???:callgrind_ops::common::run_reset [/x/callgrind_ops]
"""

PRINTED = """\
lru chunks=1000 batches=500 keys_per_op=16000
store    0.094 allocations/key
load     0.094 allocations/key
lookup   0.000 allocations/key
touch    0.000 allocations/key
finish   0.000 allocations/key
fail     0.094 allocations/key
prefix   0.000 allocations/key
reset    0.000 allocations/key
events   0.094 allocations/key
"""


@pytest.fixture(scope="module")
def core() -> Iterator[ModuleType]:
    sys.path.insert(0, str(BENCHES))
    try:
        yield importlib.import_module("callgrind_core")
    finally:
        sys.path.remove(str(BENCHES))


def _fake_runs(monkeypatch: pytest.MonkeyPatch, annotated: str) -> None:
    """Stand-ins for the valgrind run (which leaves its output file) and the annotation."""

    def run(cmd: list[str], **_: Any) -> subprocess.CompletedProcess[str]:
        if "--tool=callgrind" in cmd:
            out = next(c for c in cmd if c.startswith("--callgrind-out-file="))
            Path(out.split("=", 1)[1]).write_text("")
            return subprocess.CompletedProcess(cmd, 0, PRINTED, "")
        return subprocess.CompletedProcess(cmd, 0, annotated, "")

    monkeypatch.setattr(subprocess, "run", run)


def test_counts_are_read_a_key_and_the_reset_a_chunk(
    core: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    _fake_runs(monkeypatch, ANNOTATED)
    rows = core.count(Path("callgrind_ops"), "lru", 1000, 500, "valgrind")
    by_op = {r["op"]: r for r in rows}
    assert [r["op"] for r in rows] == [op.name for op in core.CORE_OPS]
    assert by_op["store_evict"]["instructions"] == 25_311_463
    assert by_op["store_evict"]["per_key"] == pytest.approx(25_311_463 / 16_000)
    # run_store's count, not the run_store_events line above it that shares its prefix
    assert by_op["store_events"]["instructions"] == 25_576_967
    assert by_op["lookup"]["instructions"] == 2_763_839
    assert by_op["reset_cache"]["per_key"] == pytest.approx(17.026)
    assert by_op["store_fail"]["allocations"] == pytest.approx(0.094)
    assert by_op["touch"]["allocations"] == 0.0


def test_a_call_callgrind_did_not_count_is_an_error(
    core: ModuleType, monkeypatch: pytest.MonkeyPatch
) -> None:
    without_reset = "\n".join(line for line in ANNOTATED.splitlines() if "run_reset" not in line)
    _fake_runs(monkeypatch, without_reset)
    with pytest.raises(RuntimeError, match="run_reset"):
        core.count(Path("callgrind_ops"), "lru", 1000, 500, "valgrind")


def test_bad_arguments_are_refused_before_anything_runs(core: ModuleType) -> None:
    assert core.main(["--policies", "lru,nope"]) == 2
    assert core.main(["--chunks", "10"]) == 2
    assert core.main(["--batches", "0"]) == 2
