"""tools/ab.py: two builds loaded side by side in one process, timed in turns."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
import sysconfig
import types
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
TOOL = ROOT / "tools" / "ab.py"

# The tool loads a second copy of the extension into one process, which free-threaded CPython
# 3.13t refuses ("init function of _native returned uninitialized object"); it times builds on
# the interpreters kvoffload is measured on, which have the GIL.
pytestmark = pytest.mark.skipif(
    bool(sysconfig.get_config_var("Py_GIL_DISABLED")),
    reason="tools/ab.py loads two copies of the extension: not on a free-threaded build",
)


def _load_tool() -> types.ModuleType:
    spec = importlib.util.spec_from_file_location("ab_tool", TOOL)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, str(TOOL), ".", ".", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _rows(text: str) -> dict[str, list[float]]:
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] and cells[1][0].isdigit():
            rows[cells[0]] = [float(c.replace(",", "")) for c in cells[1:]]
    return rows


def test_replay_in_own_types_gives_every_call_kind_for_both_builds() -> None:
    out = _run("--own-types", "--requests", "40", "--rounds", "2", "--policies", "lru,arc")
    assert "lru: replay of 40 requests (kvoffload's types)" in out
    assert "arc: replay of 40 requests" in out
    rows = _rows(out)
    for kind in ("prepare_store", "prepare_load", "lookup", "finish", "total"):
        a, b, ratio = rows[kind]
        assert a > 0
        assert b > 0
        assert ratio > 0
    # The total row is the fastest round's whole replay, each kind's row its fastest round:
    # the total is at least the kinds' sum (the cells are rounded to hundredths), and equal to
    # it when one round was fastest in every kind. (The rows above are the last policy's.)
    for col in (0, 1):
        kinds = sum(v[col] for k, v in rows.items() if k != "total" and "replay" not in k)
        assert rows["total"][col] >= kinds - 0.05


def test_ffi_cases_give_ns_per_key_for_both_builds() -> None:
    out = _run("--ffi", "store_evict,lookup_prefix", "--size", "1000", "--rounds", "1")
    assert "lru: FFI cases, 1,000 chunks" in out
    rows = _rows(out)
    assert set(rows) == {"store_evict", "lookup_prefix"}
    assert all(a > 0 and b > 0 for a, b, _ in rows.values())


def test_each_build_runs_its_own_copy_of_the_package(tmp_path: Path) -> None:
    ab = _load_tool()
    # The tool swaps kvoffload's modules in sys.modules: put this session's back afterwards,
    # or every later test would meet a second copy of kvoffload's classes.
    saved = {n: m for n, m in sys.modules.items() if ab._owned(n)}
    try:
        dirs = {label: ab.prepare(".", tmp_path, label) for label in ("A", "B")}
        builds = ab.Builds(dirs)
        files = {
            label: Path(builds.module(label, "kvoffload._native").__file__).resolve()
            for label in dirs
        }
        assert files["A"] != files["B"]
        assert files["A"].parent.parent == (tmp_path / "A").resolve()
        # Outside `use`, neither build is importable as kvoffload.
        assert not any(ab._owned(n) for n in sys.modules)
    finally:
        for name in [n for n in sys.modules if ab._owned(n)]:
            del sys.modules[name]
        sys.modules.update(saved)


def test_an_unknown_build_is_refused() -> None:
    out = subprocess.run(
        [sys.executable, str(TOOL), ".", "no-such-revision-xyz", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0
    assert "neither" in out.stderr
