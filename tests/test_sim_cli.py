"""`kvoffload sim` end to end: tables on stdout, plot, JSON and CSV in the output folder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvoffload.cli import main
from kvoffload.sim import (
    GeneratorConfig,
    ObjectTrace,
    generate_workload,
    write_jsonl,
    write_object_trace,
)


def test_sim_serving_smoke(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "out"
    args = ["sim", "--requests", "60", "--jobs", "1", "--out", str(out), "--no-progress"]
    assert main(args) == 0
    text = capsys.readouterr().out
    assert "hit ratio (tokens)" in text
    assert "lru miss" in text
    assert "arc miss" in text
    assert "requests/s" in text
    for name in ("sim.png", "sim.svg", "sim.json", "sim.csv"):
        assert (out / name).stat().st_size > 0
    doc = json.loads((out / "sim.json").read_text())
    assert doc["mode"] == "serving"
    assert {r["policy"] for r in doc["results"]} == {"lru", "arc"}
    assert (out / "sim.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len((out / "sim.csv").read_text().splitlines()) == 1 + len(doc["results"])


def test_sim_classic_trace_with_libcachesim(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("libcachesim")
    trace = tmp_path / "t.oracleGeneral"
    write_object_trace(
        ObjectTrace.from_ids([i % 50 for i in range(0, 3000, 7)]), trace, "oracleGeneral"
    )
    args = ["sim", "--workload", str(trace), "--sizes", "5,20", "--jobs", "1", "--libcachesim"]
    args += ["--impl", "reference", "--policies", "lru,arc,LibCacheSimArc"]
    args += ["--cache-policy-module-path", "kvoffload.sim.policies"]
    assert main([*args, "--out", str(tmp_path / "o"), "--no-plot", "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "classic" in text
    report = text.split("libCacheSim 0.3.5 on the same trace")[1]
    assert report.count("(same)") >= 4  # lru and LibCacheSimArc at both sizes
    assert "lru at 5:" in report
    assert "LibCacheSimArc at 20:" in report
    assert not (tmp_path / "o" / "sim.png").exists()


def test_sim_bad_trace_is_a_clear_error(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "bad.txt"
    bad.write_text("1\nfoo\n")
    assert main(["sim", "--workload", str(bad), "--out", str(tmp_path), "--no-progress"]) == 2
    assert "bad.txt:2: object id must be an integer" in capsys.readouterr().err


def test_sim_zipf_objects_classic(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = ["sim", "--workload", "zipf-objects", "--requests", "3000", "--sizes", "10,100"]
    assert main([*args, "--jobs", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    text = capsys.readouterr().out
    assert "3,000 requests" in text
    assert "classic" in text
    assert json.loads((tmp_path / "sim.json").read_text())["mode"] == "classic"


def test_simulate_takes_a_generator_name() -> None:
    from kvoffload.sim import simulate

    res = simulate("zipf-objects", num_chunks=50)
    assert res.mode == "classic"
    assert res.workload == "zipf-objects"


def test_sim_plugin_runs_on_the_rust_manager(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = ["sim", "--requests", "20", "--policies", "LibCacheSimArc", "--jobs", "2"]
    args += ["--cache-policy-module-path", "kvoffload.sim.policies", "--sizes", "64,128"]
    assert main([*args, "--out", str(tmp_path), "--no-progress"]) == 0
    assert "LibCacheSimArc" in capsys.readouterr().out
    assert (tmp_path / "sim.json").exists()


def test_docs_python_example_runs() -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "sim.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    exec(compile(code, "docs/sim.md", "exec"), {"__name__": "docs_example"})


def test_sim_jsonl_trace(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "requests.jsonl"
    write_jsonl(generate_workload("rag", GeneratorConfig(requests=40, kv_groups=2)), trace)
    args = ["sim", "--workload", str(trace), "--sizes", "256,1024", "--decode-rate", "100"]
    assert main([*args, "--jobs", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    assert "requests.jsonl, 40 requests" in capsys.readouterr().out
    assert json.loads((tmp_path / "sim.json").read_text())["config"]["decode_tokens_per_s"] == 100


def test_sim_csv_trace_columns(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("obj,time\n" + "".join(f"{i % 30},{i}\n" for i in range(500)))
    args = ["sim", "--workload", str(trace), "--csv-columns", "2,1,0", "--csv-header"]
    args += ["--sizes", "10,40", "--jobs", "1", "--no-plot"]
    assert main([*args, "--out", str(tmp_path), "--no-progress"]) == 0
    doc = json.loads((tmp_path / "sim.json").read_text())
    assert doc["working_set"] == 30
    big = [r for r in doc["results"] if r["num_chunks"] == 40]
    assert all(r["miss_ratio"] == pytest.approx(30 / 500) for r in big)


def test_sim_shadows_beside_the_reference_are_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--impl", "reference", "--shadows", "arc", "--requests", "20"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 2
    assert "shadows run beside kvoffload's Rust manager only" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written
