"""`kvoffload sim` end to end: tables on stdout, plot, JSON and CSV in the output folder."""

from __future__ import annotations

import argparse
import json
import re
import struct
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from _helpers import OWN_POLICY
from kvoffload.cli import main
from kvoffload.sim import (
    GeneratorConfig,
    ObjectTrace,
    generate_workload,
    write_jsonl,
    write_object_trace,
)
from kvoffload.sim import cli as sim_cli


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


def test_docs_python_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    text = (Path(__file__).resolve().parent.parent / "docs" / "sim.md").read_text()
    start = text.index("```python\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    # Saved as a script, it starts worker processes that re-run it: it needs the guard.
    assert 'if __name__ == "__main__":' in code
    exec(compile(code, "docs/sim.md", "exec"), {"__name__": "__main__"})
    assert "('arc', 8192" in capsys.readouterr().out


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


CWD_MODULE = "kvoffload_test_cwd_policies"


@pytest.fixture
def policy_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """The current folder, holding the plug-in module `CWD_MODULE` (on no other path)."""
    folder = tmp_path / "policies"
    folder.mkdir()
    (folder / f"{CWD_MODULE}.py").write_text(OWN_POLICY)  # its MRUPolicy
    monkeypatch.chdir(folder)
    yield folder
    sys.modules.pop(CWD_MODULE, None)


@pytest.mark.parametrize("impl", ["rust", "reference"])
def test_sim_imports_a_policy_module_from_the_current_folder(
    policy_folder: Path, tmp_path: Path, impl: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # As `python -m` would, in this process and in the two worker processes.
    argv = ["sim", "--policies", "MRUPolicy", "--cache-policy-module-path", CWD_MODULE]
    argv += ["--impl", impl, "--requests", "30", "--sizes", "64,128", "--jobs", "2"]
    assert main([*argv, "--out", str(tmp_path / "o"), "--no-plot", "--no-progress"]) == 0
    assert "MRUPolicy miss" in capsys.readouterr().out
    assert str(policy_folder) not in sys.path  # put back as it was after the run


def test_sim_unimportable_policy_module_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--policies", "MRUPolicy", "--cache-policy-module-path", "kvoffload_test_nope"]
    assert main([*argv, "--requests", "20", "--out", str(tmp_path), "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvoffload sim: error: cache policy 'MRUPolicy': cannot import")
    assert "No module named 'kvoffload_test_nope'" in err
    assert "looks for it in the current folder" in err
    assert not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("impl", "says"),
    [
        ("Rust", "unknown implementation 'Rust'"),
        ("bogus_kvoffload_module:X", "cannot import it"),
        ("kvoffload:Nope", "has no attribute 'Nope'"),
        ("kvoffload.sim:SimConfig", "not a manager class"),
    ],
)
def test_sim_bad_impl_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], impl: str, says: str
) -> None:
    argv = ["sim", "--impl", impl, "--requests", "20", "--jobs", "2", "--out", str(tmp_path)]
    assert main([*argv, "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith("kvoffload sim: error: ")
    assert says in captured.err
    assert captured.out == ""  # refused before the run began
    assert not list(tmp_path.iterdir())


def _write_empty(path: Path) -> None:
    path.write_bytes(b"")


def _write_zero_sizes(path: Path) -> None:
    path.write_bytes(struct.pack("<IQIq", 1, 5, 0, -1) * 3)


def _write_no_prompt_blocks(path: Path) -> None:
    path.write_text('{"req_id": "r", "arrival": 0, "block_hashes": [[]], "output_tokens": 64}\n')


@pytest.mark.parametrize(
    ("argv", "name", "write"),
    [
        (["--requests", "0"], None, None),
        (["--workload", "zipf-objects", "--requests", "0"], None, None),
        ([], "empty.jsonl", _write_empty),
        ([], "empty.txt", _write_empty),
        ([], "zeros.oracleGeneral", _write_zero_sizes),
        ([], "prompts.jsonl", _write_no_prompt_blocks),
    ],
)
def test_sim_refuses_a_workload_that_looks_nothing_up(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    argv: list[str],
    name: str | None,
    write: object,
) -> None:
    # A hit or a miss ratio over no lookup is undefined: no "hit 0%" beside "miss 0".
    if name is not None:
        assert callable(write)
        write(tmp_path / name)
        argv = ["--workload", str(tmp_path / name)]
    out = tmp_path / "out"
    assert main(["sim", *argv, "--out", str(out), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert "hit and miss ratios over no lookup are undefined" in captured.err
    assert "miss" not in captured.out
    assert not out.exists()


def test_sim_non_utf8_trace_is_a_clear_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_bytes(
        b'{"req_id": "a", "arrival": 0, "block_hashes": [["00"]]}\n{"req_id": "\xff"}\n'
    )
    assert main(["sim", "--workload", str(bad), "--out", str(tmp_path), "--no-progress"]) == 2
    assert "bad.jsonl:2: not UTF-8 text (byte 0xff" in capsys.readouterr().err


def test_sim_libcachesim_says_what_it_did_not_compare(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--libcachesim", "--jobs", "1", "--no-plot", "--no-progress"]
    assert main([*argv, "--requests", "20", "--sizes", "64", "--out", str(tmp_path)]) == 0
    assert "--libcachesim compares classic mode only" in capsys.readouterr().out
    argv += ["--workload", "zipf-objects", "--requests", "500", "--policies", "lru,fifo,s3fifo"]
    assert main([*argv, "--sizes", "10", "--out", str(tmp_path)]) == 0
    text = capsys.readouterr().out
    assert "libCacheSim is not compared for fifo, s3fifo" in text


def test_sim_help_says_what_each_option_is() -> None:
    parser = argparse.ArgumentParser()
    sim_cli.add_arguments(parser)
    for action in parser._actions:
        text = re.sub(r"\s*\(%\(default\)s\)", "", action.help or "")
        assert re.search("[a-z]{3}", text), f"{action.option_strings}: {action.help!r}"


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--alpha", "-1"], "alpha, the Zipf exponent, must be a number >= 0"),
        (["--alpha", "nan", "--workload", "zipf-objects"], "must be a number >= 0"),
        (["--store-threshold", "-1"], "store_threshold must be >= 0"),
        (["--store-failure-prob", "1.5"], "store_failure_prob"),
        # Results of a name given twice shared one column of the tables and files.
        (["--policies", "lru,arc,lru"], "--policies names lru more than once"),
        (["--shadows", "fifo,fifo"], "--shadows names fifo more than once"),
    ],
)
def test_sim_refuses_values_the_generator_or_manager_refuse(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], says: str
) -> None:
    assert main(["sim", *argv, "--requests", "20", "--out", str(tmp_path), "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert says in captured.err
    assert captured.out == ""  # refused before the run began
    assert not list(tmp_path.iterdir())


def test_sim_options_reach_the_config_and_the_workload(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from kvoffload.sim import working_set

    out = tmp_path / "out"
    argv = ["sim", "--requests", "40", "--seed", "5", "--sizes", "30,10", "--chunks", "20"]
    argv += ["--max-running", "7", "--store-failure-prob", "0.25", "--bandwidth", "3"]
    argv += ["--prefill-rate", "1234", "--decode-rate", "55", "--policies", "lru"]
    argv += ["--jobs", "1", "--out", str(out), "--no-progress", "--no-plot"]
    assert main(argv) == 0
    text = capsys.readouterr().out
    doc = json.loads((out / "sim.json").read_text())
    config = doc["config"]
    assert config["max_running"] == 7
    assert config["store_failure_prob"] == 0.25
    assert config["transfer_bytes_per_s"] == 3e9
    assert (config["prefill_tokens_per_s"], config["decode_tokens_per_s"]) == (1234.0, 55.0)
    wss = working_set(generate_workload("chat", GeneratorConfig(requests=40, seed=5)))
    assert wss != working_set(generate_workload("chat", GeneratorConfig(requests=40)))
    assert doc["working_set"] == wss
    # --chunks adds its size to the curve; the side-by-side table is at that size.
    assert [r["num_chunks"] for r in doc["results"]] == [10, 20, 30]
    assert "chat at 20 chunks:" in text
    assert sum(r["stores_failed"] for r in doc["results"]) > 0
    # The speed line counts chunk operations, many per request.
    speed = re.search(r"simulation speed: ([\d,]+) requests/s, ([\d,]+) chunk operations/s", text)
    assert speed is not None
    reqs, ops = (int(x.replace(",", "")) for x in speed.groups())
    assert ops > 5 * reqs


def test_sim_table_defaults_to_the_middle_size(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["sim", "--requests", "20", "--sizes", "10,20,30,40", "--policies", "lru"]
    assert main([*argv, "--jobs", "1", "--out", str(tmp_path), "--no-progress", "--no-plot"]) == 0
    assert "chat at 20 chunks:" in capsys.readouterr().out


def test_sim_table_size_is_the_middle_one_of_sizes_given_in_any_order(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # The sizes are sorted and deduplicated before the middle one is picked, and the header
    # names them as the curve reports them.
    argv = ["sim", "--requests", "20", "--sizes", "40,10,30,20,10", "--policies", "lru"]
    assert main([*argv, "--jobs", "1", "--out", str(tmp_path), "--no-progress", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "chat at 20 chunks:" in out
    assert "sizes 10, 20, 30, 40" in out


def test_sim_refuses_an_absent_object_id_column(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text("1,2,3\n")
    argv = ["sim", "--workload", str(trace), "--csv-columns", "1,0,3", "--out", str(tmp_path)]
    assert main(argv) == 2
    assert "obj_id >= 1" in capsys.readouterr().err


def test_libcachesim_comparison_counts_misses() -> None:
    from kvoffload.sim.libcachesim_ref import LibCacheSimRun
    from kvoffload.sim.results import SimResult

    ours = SimResult("classic", "t", "lru", "rust", 10, requests=100, lookup_chunks=100)
    ours.hit_chunks = 30
    same = LibCacheSimRun("lru", 10, 0.7, 1.0, 100)
    other = LibCacheSimRun("lru", 10, 0.3, 1.0, 100)
    assert "(same)" in sim_cli._format_libcachesim([same], [ours])
    assert "(differs)" in sim_cli._format_libcachesim([other], [ours])


# -- the miss-ratio plot, read back from matplotlib's objects (mutation round: sim/plot.py) ------


def _curve_point(policy: str, size: int, hits: int, hit_tokens: int | None) -> Any:
    """A serving result of 100 chunk lookups (and 1000 prompt tokens unless ``hit_tokens``
    is None: a classic result, one object per request)."""
    from kvoffload.sim import SimResult

    return SimResult(
        mode="serving" if hit_tokens is not None else "classic",
        workload="w",
        policy=policy,
        impl="rust",
        num_chunks=size,
        lookup_chunks=100,
        hit_chunks=hits,
        prompt_tokens=0 if hit_tokens is None else 1000,
        hit_tokens=hit_tokens or 0,
    )


def test_plot_draws_a_line_per_policy_and_a_token_line_where_it_differs(
    tmp_path: Path, saved_figures: list[tuple[Any, Path, dict[str, Any]]]
) -> None:
    import matplotlib.pyplot as plt

    from kvoffload.sim.plot import plot_curves

    results = [
        # Out of size order: the line goes by size. lru's token miss ratio differs from its chunk
        # miss ratio by 0.05 at size 10 (several KV groups); arc's equals it (one group).
        _curve_point("lru", 40, 60, 600),
        _curve_point("lru", 10, 20, 250),
        _curve_point("arc", 10, 30, 300),
        _curve_point("arc", 40, 70, 700),
    ]
    figures = plt.get_fignums()
    paths = plot_curves(results, tmp_path / "curve")
    assert plt.get_fignums() == figures  # the figure is closed
    assert paths == [tmp_path / "curve.png", tmp_path / "curve.svg"]
    assert [path for _, path, _ in saved_figures] == paths
    assert paths[0].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    svg = paths[1].read_text()
    assert svg.startswith("<?xml")
    assert "<dc:date>" not in svg  # no date: the same results give the same file
    (fig, _, _), (same, _, _) = saved_figures
    assert same is fig
    (ax,) = fig.axes
    lines = {line.get_label(): line for line in ax.get_lines()}
    assert list(lines) == ["lru", "lru (tokens)", "arc"]
    assert list(lines["lru"].get_xdata()) == [10, 40]
    assert list(lines["lru"].get_ydata()) == pytest.approx([0.8, 0.4])
    assert list(lines["arc"].get_ydata()) == pytest.approx([0.7, 0.3])
    tokens = lines["lru (tokens)"]
    assert list(tokens.get_xdata()) == [10, 40]
    assert list(tokens.get_ydata()) == pytest.approx([0.75, 0.4])
    assert tokens.get_linestyle() == "--"
    assert tokens.get_color() == lines["lru"].get_color() != lines["arc"].get_color()
    assert ax.get_xscale() == "log"
    assert ax.xaxis.get_transform().base == 2
    assert ax.get_xlabel() == "CPU cache size (chunks)"
    assert ax.get_ylabel() == "miss ratio"
    assert ax.get_ylim()[0] == 0
    assert ax.get_title() == "miss-ratio curve"
    legend = ax.get_legend()
    assert legend is not None
    assert [t.get_text() for t in legend.get_texts()] == ["lru", "lru (tokens)", "arc"]


def test_plot_of_a_classic_curve_with_a_size_0_is_linear_in_objects(
    tmp_path: Path, saved_figures: list[tuple[Any, Path, dict[str, Any]]]
) -> None:
    from kvoffload.sim.plot import plot_curves

    results = [_curve_point("lru", 0, 0, None), _curve_point("lru", 8, 50, None)]
    plot_curves(results, tmp_path / "classic", title="t: objects")
    ax = saved_figures[0][0].axes[0]
    assert ax.get_xscale() == "linear"  # log 2 has no place for a cache of 0 objects
    assert ax.get_xlabel() == "cache size (objects)"
    assert ax.get_title() == "t: objects"
    assert [line.get_label() for line in ax.get_lines()] == ["lru"]  # no token line in classic


def test_plot_of_no_result_still_writes_both_files(tmp_path: Path) -> None:
    from kvoffload.sim.plot import plot_curves

    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no legend without lines: matplotlib would warn
        paths = plot_curves([], tmp_path / "empty")
    assert all(path.stat().st_size > 0 for path in paths)


def test_a_plot_that_fails_to_save_closes_its_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from kvoffload.sim.plot import plot_curves

    def refuse(self: Figure, *args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    before = plt.get_fignums()
    monkeypatch.setattr(Figure, "savefig", refuse)
    with pytest.raises(OSError, match="disk full"):
        plot_curves([], tmp_path / "empty")
    assert plt.get_fignums() == before
