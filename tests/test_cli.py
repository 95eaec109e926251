"""The main job runs end to end: `kvoffload bench` on a small workload exits 0."""

from __future__ import annotations

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
        m.complete_store(m.prepare_store(keys, ctx).keys_to_store, ctx)
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
