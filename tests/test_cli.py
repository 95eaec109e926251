"""The main job runs end to end: `kvoffload bench` on a small workload exits 0."""

from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

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
        out = m.prepare_store(keys, ctx)
        assert out is not None
        m.complete_store(out.keys_to_store, ctx)
        for i in order:
            m.touch([keys[i]], ReqContext(f"t{i}"))
        digests.append(_eviction_order(m, 4, ReqContext))
    assert digests[0] != digests[1]


# -- the bench workload and replayer, unit by unit (mutation round 3) -----------------------------


def _spec(req_id: str, keys: list[bytes], prompt_blocks: int, **kw: object) -> Any:
    from kvoffload.workload import RequestSpec

    fields: dict[str, Any] = {
        "after": None,
        "batch_blocks": (len(keys),),
        "store_fails": (False,),
        **kw,
    }
    return RequestSpec(req_id, tuple(keys), len(keys), prompt_blocks, **fields)


def _keys(tag: str, n: int) -> list[bytes]:
    return [make_offload_key(b"%s-%027d" % (tag.encode(), i), 0) for i in range(n)]


def test_contexts_carry_each_keys_end_token() -> None:
    from kvoffload.workload import WorkloadConfig, generate

    wl = generate(WorkloadConfig(requests=5, kv_groups=2))
    for spec, ctx in zip(wl.requests, wl.make_contexts(), strict=True):
        for i, key in enumerate(spec.keys):
            assert ctx.get_offload_key_position(key) == (i // 2 + 1) * 16


def test_replay_loads_all_but_the_last_prompt_block_of_a_whole_hit() -> None:
    from kvoffload.workload import Workload, WorkloadConfig, replay

    keys = _keys("a", 4)
    wl = Workload(WorkloadConfig(requests=2), [_spec("r0", keys, 3), _spec("r1", keys, 3, after=0)])
    res = replay(CPUOffloadingManager(64), wl)
    # r1's prompt is all hits (3 keys); one block must be computed, so it loads 2.
    assert (res.lookup_keys, res.hit_keys, res.loaded_keys) == (6, 3, 2)
    assert res.kinds["prepare_load"].keys == res.kinds["touch"].keys == 2


def test_single_lookup_mode_counts_the_first_key_that_is_not_a_hit() -> None:
    from kvoffload.workload import Workload, WorkloadConfig, replay

    wl = Workload(WorkloadConfig(requests=1, lookup_mode="single"), [_spec("r0", _keys("a", 3), 3)])
    res = replay(CPUOffloadingManager(64), wl)
    assert (res.kinds["lookup"].calls, res.kinds["lookup"].keys) == (1, 1)
    wl = Workload(WorkloadConfig(requests=1), [_spec("r0", _keys("a", 3), 3)])
    res = replay(CPUOffloadingManager(64), wl)  # prefix mode: lookup_prefix, then one lookup
    assert (res.kinds["lookup"].calls, res.kinds["lookup"].keys) == (2, 4)


def test_replay_counts_failed_stores_finish_keys_and_progress() -> None:
    from kvoffload.workload import Workload, WorkloadConfig, replay

    fails = _spec("r0", _keys("a", 4), 2, batch_blocks=(2, 2), store_fails=(True, False))
    others = [_spec("r1", _keys("b", 3), 2), _spec("r2", _keys("c", 2), 1)]
    wl = Workload(WorkloadConfig(requests=3), [fails, *others])
    ticks: list[int] = []
    res = replay(CPUOffloadingManager(64), wl, progress=ticks.append)
    assert res.failed_stores == 1
    assert res.stored_keys == 4 + 3 + 2  # offered and allocated; the failed two dropped after
    assert res.kinds["finish"].keys == 4 + 3 + 2 == wl.num_keys
    assert res.kinds["finish"].calls == 6  # on_new_request and on_request_finished, each 3 times
    # r1 and r2 finish in the first step, r0 in the second.
    assert ticks == [2, 1]


def test_first_divergent_step_names_the_step() -> None:
    from kvoffload.workload import KindStats, ReplayResult

    a = ReplayResult({}, 0, step_digests=[b"x", b"y", b"z"])
    b = ReplayResult({}, 0, step_digests=[b"x", b"Y", b"z"])
    assert a.first_divergent_step(b) == 1
    assert a.first_divergent_step(a) is None
    assert a.first_divergent_step(ReplayResult({}, 0, step_digests=[b"x"])) == 1
    assert KindStats(ns=5, timings=1).net_ns(10) == 0


def test_a_full_conversation_table_abandons_the_oldest() -> None:
    from kvoffload.workload import WorkloadConfig, generate

    # One live conversation at most, each continuing: a follow-up is always the next turn of the
    # request just before it (an older one is the one abandoned).
    cfg = WorkloadConfig(
        requests=200, max_live_conversations=1, continue_prob=1.0, max_turns=1000, seed=3
    )
    wl = generate(cfg)
    afters = [r.after for r in wl.requests]
    assert any(a is not None for a in afters)
    assert all(a in (None, i - 1) for i, a in enumerate(afters))


def test_every_prompt_needs_a_new_user_block() -> None:
    from kvoffload.workload import WorkloadConfig, generate

    with pytest.raises(ValueError, match="user_blocks must start at 1"):
        generate(WorkloadConfig(user_blocks=(0, 4)))


def test_identical_needs_every_replay_of_a_policy_to_agree() -> None:
    from kvoffload.bench import BenchRun, _check_identical, _speedups
    from kvoffload.workload import CALL_KINDS, KindStats, ReplayResult

    def run(impl: str, digest: str, ns: int) -> BenchRun:
        kinds = {k: KindStats(calls=1, keys=10, timings=1, ns=ns) for k in CALL_KINDS}
        return BenchRun("lru", impl, ReplayResult(kinds, 0, digest=digest))

    runs = [run("reference", "d1", 400), run("rust", "d2", 100), run("other", "d1", 200)]
    assert _check_identical(runs) == {"lru": False}
    assert _check_identical([runs[0], runs[2]]) == {"lru": True}
    speedups = _speedups(runs)["lru"]
    assert speedups["rust"]["total"] == pytest.approx(4.0)
    assert speedups["rust"]["lookup"] == pytest.approx(4.0)
    assert speedups["other"]["total"] == pytest.approx(2.0)
    assert "reference" not in speedups
    # vLLM's own manager is a baseline too (its row is the Rust manager's speed-up over it).
    assert "vllm" not in _speedups([*runs, run("vllm", "d1", 800)])["lru"]


def test_bench_refuses_a_negative_pool_before_anything_runs(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["bench", "--requests", "20", "--chunks", "-1", "--no-progress"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == "kvoffload bench: error: --repeat must be >= 1 and --chunks >= 0\n"


def test_bench_header_counts_keys_and_distinct_keys(capsys: pytest.CaptureFixture[str]) -> None:
    from kvoffload.workload import WorkloadConfig, generate

    wl = generate(WorkloadConfig(requests=40, kv_groups=2))
    assert wl.num_unique_keys < wl.num_keys
    argv = ["bench", "--requests", "40", "--kv-groups", "2", "--chunks", "64"]
    assert main([*argv, "--policies", "lru", "--impls", "rust", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert (
        f"({wl.num_keys:,} keys, {wl.num_unique_keys:,} distinct), 64 chunks, 2 KV group(s)" in out
    )


# -- kvoffload bench --json and --plot (mutation round: bench.py's outputs) ----------------------


def test_bench_json_holds_the_workload_options_and_every_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import kvoffload
    from kvoffload.workload import CALL_KINDS, WorkloadConfig, generate

    path = tmp_path / "bench.json"
    argv = ["bench", "--requests", "40", "--kv-groups", "2", "--chunks", "64", "--repeat", "2"]
    argv += ["--impls", "reference,rust", "--no-progress", "--json", str(path)]
    assert main(argv) == 0
    assert not (tmp_path / "bench.png").exists()
    text = path.read_text()
    assert text.endswith("}\n")
    doc = json.loads(text)
    assert doc["kvoffload_version"] == kvoffload.__version__
    config = WorkloadConfig(requests=40, kv_groups=2)
    wl = generate(config)
    assert doc["workload"] == {
        **json.loads(json.dumps(dataclasses.asdict(config))),
        "num_keys": wl.num_keys,
        "num_unique_keys": wl.num_unique_keys,
    }
    assert (doc["chunks"], doc["events"], doc["repeat"]) == (64, False, 2)
    pairs = [(r["policy"], r["impl"]) for r in doc["runs"]]
    assert pairs == [("lru", "reference"), ("lru", "rust"), ("arc", "reference"), ("arc", "rust")]
    assert all(r["digest"] == doc["runs"][0]["digest"] for r in doc["runs"][:2])
    assert doc["identical"] == {"lru": True, "arc": True}
    assert list(doc["speedups"]) == ["lru", "arc"]
    assert list(doc["speedups"]["lru"]) == ["rust"]  # the reference is the baseline
    assert set(doc["speedups"]["lru"]["rust"]) == {*CALL_KINDS, "total"}
    assert doc["speedups_over_vllm"] == {}  # vLLM did not run
    assert "identical answers from reference, rust" in capsys.readouterr().out


def test_bench_json_says_which_policy_disagreed(
    broken: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "bench.json"
    argv = bench("--impls", f"rust,{broken}:IgnoresTouch", "--json", str(path), "--events")
    assert main(argv) == 1
    doc = json.loads(path.read_text())
    out = capsys.readouterr().out
    assert "arc: MISMATCH" in out
    assert doc["identical"] == {"lru": "lru: MISMATCH" not in out, "arc": False}
    assert doc["events"] is True


def test_bench_output_that_cannot_be_written_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str],
) -> None:
    full = Path("/dev/full")  # every write fails with ENOSPC, even for root
    if not full.exists():
        pytest.skip("no /dev/full")
    argv = ["bench", "--requests", "20", "--policies", "lru", "--impls", "rust", "--no-progress"]
    assert main([*argv, "--json", str(full)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvoffload bench: error: ")
    assert "No space left on device" in err


def test_bench_plot_draws_a_log_panel_per_policy_with_a_bar_per_implementation(
    tmp_path: Path, saved_figures: list[tuple[Any, Path, dict[str, Any]]]
) -> None:
    import matplotlib.pyplot as plt

    from kvoffload.bench import TABLE_KINDS

    path = tmp_path / "bench.svg"  # the name's format, whatever it is
    argv = ["bench", "--requests", "40", "--chunks", "64", "--impls", "reference,rust"]
    figures = plt.get_fignums()
    assert main([*argv, "--no-progress", "--plot", str(path)]) == 0
    assert plt.get_fignums() == figures  # the figure is closed
    assert path.read_text().startswith("<?xml")
    ((fig, saved, kwargs),) = saved_figures
    assert (saved, kwargs) == (path, {"dpi": 120})
    lru, arc = fig.axes
    assert lru.get_shared_y_axes().joined(lru, arc)
    kinds = [*TABLE_KINDS, "total"]
    for ax, policy in ((lru, "lru"), (arc, "arc")):
        assert ax.get_title() == f"{policy}: ns per key"
        assert ax.get_yscale() == "log"
        assert [t.get_text() for t in ax.get_xticklabels()] == kinds
        assert [t.get_text() for t in ax.get_legend().get_texts()] == ["reference", "rust"]
        assert len(ax.patches) == 2 * len(kinds)
    assert not (tmp_path / "bench.png").exists()


def test_bench_plot_places_each_implementation_s_bars_and_skips_a_missing_run(
    tmp_path: Path, saved_figures: list[tuple[Any, Path, dict[str, Any]]]
) -> None:
    from kvoffload.bench import TABLE_KINDS, BenchRun, _plot
    from kvoffload.workload import CALL_KINDS, KindStats, ReplayResult

    def run(policy: str, impl: str, ns: int) -> BenchRun:
        kinds = {k: KindStats(calls=1, keys=10, timings=1, ns=ns) for k in CALL_KINDS}
        return BenchRun(policy, impl, ReplayResult(kinds, 0))

    # vLLM has no fifo: its panel has the Rust manager's bars only, in the Rust manager's place.
    runs = [run("lru", "vllm", 400), run("lru", "rust", 100), run("fifo", "rust", 200)]
    _plot(tmp_path / "b.png", runs)
    lru, fifo = saved_figures[0][0].axes
    n = len(TABLE_KINDS) + 1
    vllm_bars, rust_bars = lru.patches[:n], lru.patches[n:]
    assert [b.get_height() for b in vllm_bars] == [40.0] * n  # ns/key; total: all kinds' ns/key
    assert [b.get_x() + b.get_width() / 2 for b in vllm_bars] == pytest.approx(
        [x - 0.2 for x in range(n)]
    )
    assert [b.get_x() + b.get_width() / 2 for b in rust_bars] == pytest.approx(
        [x + 0.2 for x in range(n)]
    )
    assert [b.get_height() for b in fifo.patches] == [20.0] * n
    assert [b.get_x() + b.get_width() / 2 for b in fifo.patches] == pytest.approx(
        [x + 0.2 for x in range(n)]
    )
    assert [t.get_text() for t in fifo.get_legend().get_texts()] == ["rust"]


def test_a_bench_plot_that_fails_to_save_closes_its_figure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import matplotlib.pyplot as plt
    from matplotlib.figure import Figure

    from kvoffload.bench import BenchRun, _plot
    from kvoffload.workload import CALL_KINDS, KindStats, ReplayResult

    def refuse(self: Figure, *args: object, **kwargs: object) -> None:
        raise OSError("disk full")

    kinds = {k: KindStats(calls=1, keys=10, timings=1, ns=100) for k in CALL_KINDS}
    before = plt.get_fignums()
    monkeypatch.setattr(Figure, "savefig", refuse)
    with pytest.raises(OSError, match="disk full"):
        _plot(tmp_path / "b.png", [BenchRun("lru", "rust", ReplayResult(kinds, 0))])
    assert plt.get_fignums() == before


def test_bench_plot_without_matplotlib_says_so_on_stderr(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # import matplotlib: ImportError
    path = tmp_path / "bench.png"
    argv = ["bench", "--requests", "20", "--policies", "lru", "--impls", "rust", "--no-progress"]
    assert main([*argv, "--plot", str(path)]) == 0  # the table was made: only the plot is missing
    captured = capsys.readouterr()
    assert "--plot needs matplotlib" in captured.err
    assert "matplotlib" not in captured.out
    assert not path.exists()
