"""`kvoffload sim` and `kvoffload bench` refuse bad values up front, and stop at once on Ctrl-C."""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kvoffload
from kvoffload.cli import main
from kvoffload.errors import InvalidArgumentError, TraceFormatError
from kvoffload.sim import GeneratorConfig, SimConfig, generate_workload, read_jsonl, simulate
from kvoffload.sim.api import miss_ratio_curve


def _sim(tmp_path: Path, *argv: str) -> int:
    out = tmp_path / "out"
    return main(["sim", "--requests", "20", "--out", str(out), "--no-progress", *argv])


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # NaN is not <= 0: these ran, with NaN event times (wrong hits, NaN in sim.json).
        (["--bandwidth", "nan"], "rates must be > 0"),
        (["--prefill-rate", "nan"], "rates must be > 0"),
        (["--decode-rate", "nan"], "rates must be > 0"),
        # A negative chunk gave negative transfer times and bytes.
        (["--chunk-bytes", "-5"], "chunk_bytes must be >= 1"),
        (["--chunk-bytes", "0"], "chunk_bytes must be >= 1"),
        # Ran with the default sizes.
        (["--sizes", ",,"], "--sizes names no size"),
        # Ran serially.
        (["--jobs", "-3"], "--jobs must be >= 1"),
        # A traceback (argparse.ArgumentTypeError outside argparse).
        (["--csv-columns", "a,b,c"], "--csv-columns needs"),
        # Refused only after the header was printed (the manager refused them).
        (["--sizes", "-1"], "cache sizes must be >= 0"),
        (["--chunks", "-1"], "cache sizes must be >= 0"),
        (["--sizes", "4000000000"], "num_chunks must fit an int32 chunk id"),
        (["--shadows", "nope"], "shadow policies must be built in"),
    ],
)
def test_sim_refuses_bad_values_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert _sim(tmp_path, *argv) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvoffload sim: error: ")
    assert says in captured.err
    assert captured.out == ""
    assert not (tmp_path / "out" / "sim.json").exists()


def test_sim_refuses_negative_csv_columns(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Column -1 read the last-but-one field of every row: another column, silently.
    trace = tmp_path / "t.csv"
    trace.write_text("".join(f"{i},{i % 7},1\n" for i in range(50)))
    argv = ["--workload", str(trace), "--csv-columns=-1,2,3", "--sizes", "3"]
    assert _sim(tmp_path, *argv) == 2
    assert "--csv-columns needs" in capsys.readouterr().err


def test_sim_unusable_out_is_refused_before_the_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    for out in (blocker, blocker / "sub"):
        argv = ["sim", "--requests", "20", "--out", str(out), "--no-progress", "--no-plot"]
        assert main(argv) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("kvoffload sim: error: ")
        assert captured.out == ""  # no run was made (it used to fail after all of them)


@pytest.mark.parametrize("arrival", ["Infinity", "1e999", "NaN", "1" + "0" * 400])
def test_jsonl_refuses_an_arrival_that_is_not_finite(tmp_path: Path, arrival: str) -> None:
    # Infinity ran, and sim.json then held Infinity: not JSON. A 400-digit int raised
    # OverflowError.
    trace = tmp_path / "t.jsonl"
    trace.write_text(f'{{"req_id": "a", "arrival": {arrival}, "block_hashes": [["ab", "cd"]]}}\n')
    with pytest.raises(TraceFormatError, match="arrival must be a finite number"):
        read_jsonl(trace)


def test_sim_json_is_strict_json(tmp_path: Path) -> None:
    argv = ["--sizes", "50", "--jobs", "1", "--no-plot"]
    assert _sim(tmp_path, *argv) == 0

    def refuse(constant: str) -> float:
        raise ValueError(constant)

    json.loads((tmp_path / "out" / "sim.json").read_text(), parse_constant=refuse)


@pytest.mark.parametrize(
    "overrides",
    [
        {"transfer_bytes_per_s": math.nan},
        {"transfer_latency_s": math.inf},
        {"transfer_latency_s": -1.0},
        {"pending_retry_s": math.nan},
        {"max_pending_retries": -1},
        {"chunk_bytes": -1},
    ],
)
def test_simconfig_refuses_values_without_a_meaning(overrides: dict[str, float]) -> None:
    requests = generate_workload("zipf", GeneratorConfig(requests=10))
    with pytest.raises(InvalidArgumentError):
        simulate(requests, SimConfig(**overrides))  # type: ignore[arg-type]


def test_miss_ratio_curve_refuses_negative_jobs() -> None:
    requests = generate_workload("zipf", GeneratorConfig(requests=10))
    with pytest.raises(InvalidArgumentError, match="jobs"):
        miss_ratio_curve(requests, [10], ("lru",), jobs=-2)


def test_sim_ctrl_c_stops_the_workers_at_once(tmp_path: Path) -> None:
    """SIGINT used to print a traceback and wait for every run left (the workers went on)."""
    python = Path(kvoffload.__file__).resolve().parent.parent
    env = {**os.environ, "PYTHONPATH": str(python)}
    # Long enough that no run ends before the signal, on any machine (a regression then takes
    # far longer than the wait below).
    argv = ["--requests", "12000", "--sizes", "64,256,1024,4096", "--policies", "lru,arc"]
    argv += ["--jobs", "2", "--no-plot", "--no-progress", "--out", str(tmp_path / "out")]
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvoffload.cli", "sim", *argv],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,  # a terminal's Ctrl-C reaches the whole group
        # A test run started in the background inherits SIGINT ignored, and so would the
        # command (as it should: it keeps what it was given).
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(_children(proc.pid)) < 3:
            time.sleep(0.2)  # the resource tracker and two workers
        time.sleep(0.5)
        workers = _children(proc.pid)
        assert len(workers) >= 3, "the workers did not start"
        assert proc.poll() is None, "the run ended before the signal"
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=8)  # it used to take the remaining runs' time
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
    assert proc.returncode == 130
    assert "Traceback" not in err
    assert "leaked" not in err
    assert err.strip().splitlines()[-1] == "kvoffload sim: interrupted"
    assert not (tmp_path / "out" / "sim.json").exists()
    time.sleep(1.0)
    assert not [pid for pid in workers if _alive(pid)], "worker processes outlived the command"


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(p) for p in path.read_text().split()] if path.exists() else []


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        # Tracebacks (ValueError from the workload, UnsupportedPolicyError from the manager).
        (["--requests", "-1"], "--requests must be >= 0"),
        (["--kv-groups", "0"], "--kv-groups and --concurrency >= 1"),
        (["--concurrency", "0"], "--kv-groups and --concurrency >= 1"),
        (["--policies", "nope"], "Unknown cache policy: 'nope'"),
        # An empty table and status 0; a policy given twice ran as one more repeat.
        (["--policies", ","], "--policies names nothing"),
        (["--policies", "lru,lru"], "--policies names lru more than once"),
        (["--impls", "rust,rust"], "--impls names rust more than once"),
    ],
)
def test_bench_refuses_bad_values_with_a_one_line_error(
    capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    base = ["bench", "--requests", "20", "--policies", "lru", "--no-progress"]
    assert main([*base, *argv]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.startswith("kvoffload bench: error: ")
    assert says in captured.err
    assert len(captured.err.strip().splitlines()) == 1


@pytest.mark.parametrize("option", ["--json", "--plot"])
def test_bench_unwritable_output_is_refused_before_the_replays(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], option: str
) -> None:
    # A traceback (NotADirectoryError) after every replay had run.
    blocker = tmp_path / "file"
    blocker.write_text("")
    for path in (blocker / "x", tmp_path):
        argv = ["bench", "--requests", "20", "--policies", "lru", "--no-progress"]
        assert main([*argv, option, str(path)]) == 2
        captured = capsys.readouterr()
        assert captured.out == ""
        assert captured.err.startswith(f"kvoffload bench: error: {option} ")
