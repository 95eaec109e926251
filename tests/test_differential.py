"""Differential tests: the Rust manager against the reference, and both against vLLM 0.33.0.

The implementations compared default to ``rust,reference``; ``KVOFFLOAD_DIFF_IMPLS`` overrides
the list (for example ``reference,reference`` before the extension is built). The vLLM tests run
only where ``tools/fetch_vllm.sh`` has unpacked the oracle. Longer runs: ``tools/difftest.py``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
from collections.abc import Sequence
from typing import Any, Protocol

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, rule, run_state_machine_as_test

import _driver
from _driver import WEIGHTS, Chooser, Config, Generator, Session
from kvoffload._common import BUILTIN_POLICIES

IMPLS = tuple(os.environ.get("KVOFFLOAD_DIFF_IMPLS", "rust,reference").split(","))
#: vLLM 0.33.0 has LRU and ARC; kvoffload adds more policies, compared Rust vs reference only.
VLLM_POLICIES = ("lru", "arc")
POLICIES = BUILTIN_POLICIES
THRESHOLDS = (1, 2, 3)

MACHINE_SETTINGS = settings(
    max_examples=100,
    stateful_step_count=80,
    deadline=None,
    derandomize=True,
    database=None,
    print_blob=False,
    suppress_health_check=list(HealthCheck),
)


def _oracle() -> str:
    _driver.require_vllm()
    return "vllm"


class DataChooser(Chooser):
    """Choices drawn from hypothesis, so a failing run shrinks toward plain calls."""

    def __init__(self, data: st.DataObject) -> None:
        self.data = data

    def chance(self, p: float) -> bool:
        return self.data.draw(st.integers(0, 99)) >= 100 - round(p * 100)

    def int(self, lo: int, hi: int) -> int:
        return self.data.draw(st.integers(lo, hi))


class DifferentialMachine(RuleBasedStateMachine):
    """Each rule makes one kind of legal call on every implementation and compares everything."""

    impl_names: Sequence[str] = IMPLS
    policies: Sequence[str] = POLICIES

    def __init__(self) -> None:
        super().__init__()
        self.session: Session | None = None
        self.gen: Generator | None = None

    @initialize(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        ch = DataChooser(data)
        config = Config.draw(ch, big=False, policies=self.policies)
        self.session = Session(config, [_driver.impl_spec(n) for n in self.impl_names])
        self.gen = Generator(self.session.model, ch)

    def step(self, kind: str, data: st.DataObject) -> None:
        assert self.session is not None
        assert self.gen is not None
        op = self.gen.next_op(DataChooser(data), kind)
        if op is not None:
            self.session.apply(op)


class _Stepping(Protocol):
    def step(self, kind: str, data: st.DataObject) -> None: ...


def _add_rules(machine: type[RuleBasedStateMachine]) -> None:
    # One rule per op kind, calling the machine's ``step``; the generator keeps every call legal.
    for kind in WEIGHTS:

        def do(self: _Stepping, data: st.DataObject, kind: str = kind) -> None:
            self.step(kind, data)

        do.__name__ = kind
        setattr(machine, kind, rule(data=st.data())(do))


_add_rules(DifferentialMachine)


class SharedMachine(RuleBasedStateMachine):
    """Two managers of each implementation sharing every request context (``SharedSession``);
    each rule makes one kind of legal call on one of the two and compares everything."""

    impl_names: Sequence[str] = IMPLS

    def __init__(self) -> None:
        super().__init__()
        self.session: _driver.SharedSession | None = None

    @initialize(data=st.data())
    def configure(self, data: st.DataObject) -> None:
        ch = DataChooser(data)
        config = Config.draw(ch, big=False, policies=VLLM_POLICIES)
        other = dataclasses.replace(config, policy=ch.pick(VLLM_POLICIES))
        specs = [_driver.impl_spec(n) for n in self.impl_names]
        self.session = _driver.SharedSession([config, other], specs, ch)

    def step(self, kind: str, data: st.DataObject) -> None:
        assert self.session is not None
        ch = DataChooser(data)
        self.session.step(ch.int(0, 1), ch, kind)


_add_rules(SharedMachine)


def _run_shared_machine(impls: Sequence[str], examples: int) -> None:
    class Machine(SharedMachine):
        impl_names = impls

    run_state_machine_as_test(Machine, settings=settings(MACHINE_SETTINGS, max_examples=examples))


def test_state_machine_two_managers_sharing_contexts() -> None:
    _run_shared_machine(IMPLS, examples=60)


def test_state_machine_two_managers_sharing_contexts_vllm_oracle() -> None:
    _run_shared_machine((*IMPLS, _oracle()), examples=60)


def _run_machine(impls: Sequence[str], policies: Sequence[str] = POLICIES) -> None:
    chosen = policies

    class Machine(DifferentialMachine):
        impl_names = impls
        policies = chosen

    run_state_machine_as_test(Machine, settings=MACHINE_SETTINGS)


def test_state_machine() -> None:
    _run_machine(IMPLS)


def test_state_machine_vllm_oracle() -> None:
    _run_machine((*IMPLS, _oracle()), VLLM_POLICIES)


def _run_seeded(impls: Sequence[str], policy: str, threshold: int, count: int, calls: int) -> None:
    specs = [_driver.impl_spec(name) for name in impls]
    for seed in range(count):
        result = _driver.run_sequence(specs, policy, threshold, seed, calls)
        if result.mismatch is not None:
            small = (
                _driver.shrink(result.config, result.ops, specs, budget_s=30.0) or result.mismatch
            )
            pytest.fail(
                f"{result.mismatch.report(20)}\n\nshrunk:\n{small.report(None)}\n\n"
                f"repro:\n{small.repro()}",
                pytrace=False,
            )


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("policy", POLICIES)
def test_seeded_sequences(policy: str, threshold: int) -> None:
    _run_seeded(IMPLS, policy, threshold, count=50, calls=400)


@pytest.mark.parametrize("threshold", THRESHOLDS)
@pytest.mark.parametrize("policy", VLLM_POLICIES)
def test_seeded_sequences_vllm_oracle(policy: str, threshold: int) -> None:
    _run_seeded((*IMPLS, _oracle()), policy, threshold, count=30, calls=400)


#: Pairs of managers sharing request contexts: an LRU manager's request rank must outlive the
#: other manager's replacing of its request state exactly when vLLM's does.
SHARED_PAIRS = (("lru", "arc"), ("arc", "lru"), ("lru", "lru"), ("lru", "fifo"))


def _run_shared(impls: Sequence[str], policies: tuple[str, str], count: int, calls: int) -> None:
    specs = [_driver.impl_spec(name) for name in impls]
    mismatch = _driver.first_shared_mismatch(specs, policies, count, calls, THRESHOLDS)
    if mismatch is not None:
        pytest.fail(f"{mismatch.report(60)}\n\nrepro:\n{mismatch.repro()}", pytrace=False)


@pytest.mark.parametrize("policies", SHARED_PAIRS, ids="+".join)
def test_two_managers_sharing_request_contexts(policies: tuple[str, str]) -> None:
    _run_shared(IMPLS, policies, count=40, calls=400)


@pytest.mark.parametrize(
    "policies", [p for p in SHARED_PAIRS if set(p) <= set(VLLM_POLICIES)], ids="+".join
)
def test_two_managers_sharing_request_contexts_vllm_oracle(policies: tuple[str, str]) -> None:
    _run_shared((*IMPLS, _oracle()), policies, count=25, calls=400)


def _broken_reference() -> _driver.ImplSpec:
    """The reference with one planted bug: a failed store is completed as a success."""
    from kvoffload.reference import CPUOffloadingManager

    class Broken(CPUOffloadingManager):
        def complete_store(self, keys: Any, req_context: Any, success: bool = True) -> None:
            super().complete_store(keys, req_context, True)

    spec = _driver.impl_spec("reference")
    return _driver.ImplSpec("broken", Broken, spec.context_cls, spec.state)


def test_driver_finds_shrinks_and_reproduces_a_planted_bug() -> None:
    specs = [_driver.impl_spec("reference"), _broken_reference()]
    result = next(
        r
        for seed in range(50)
        if (r := _driver.run_sequence(specs, "lru", 1, seed, 300)).mismatch is not None
    )
    small = _driver.shrink(result.config, result.ops, specs, budget_s=30.0)
    assert small is not None
    assert small.op.kind == "complete_store"
    assert len(small.history) <= 4  # new_request, prepare_store, complete_store(success=False)
    script = small.repro()
    exec(compile(script, "<repro>", "exec"), {})  # the repro runs as written
    # And it reproduces: replayed on the broken manager instead, it ends in another state.
    importing = "from kvoffload.reference import CPUOffloadingManager\n"
    assert importing in script
    code = compile(script.replace(importing, ""), "<repro>", "exec")
    ends = []
    for spec in specs:
        namespace: dict[str, Any] = {"CPUOffloadingManager": spec.manager_cls}
        with contextlib.redirect_stdout(io.StringIO()):
            exec(code, namespace)
        assert spec.state is not None
        ends.append(spec.state(namespace["m"]))
    assert ends[0] != ends[1]


def test_driver_sequences_are_deterministic() -> None:
    specs = [_driver.impl_spec("reference")]
    first = _driver.run_sequence(specs, "arc", 2, 7, 200)
    again = _driver.run_sequence(specs, "arc", 2, 7, 200)
    assert first.mismatch is None
    assert first.ops == again.ops
    assert first.config == again.config


def test_difftest_compares_the_calls_managers_make_of_a_plug_in(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    difftest = _driver._load_tool("difftest")
    argv = ["--plug-ins", "--sequences", "2", "--calls", "200", "--no-shrink"]
    assert difftest.main(argv) == 0
    out = capsys.readouterr().out
    for policy in _driver.PLUGIN_CLASSES:
        assert f"{policy} threshold=1: 2 sequences, 400 calls, 0 mismatches" in out
    # The reference forgets to pass touches on to its policy: the calls differ.
    from kvoffload.reference import CPUOffloadingManager as ReferenceManager

    monkeypatch.setattr(ReferenceManager, "touch", lambda self, keys, req_context: None)
    assert difftest.main([*argv, "--policies", "mru", "--thresholds", "1"]) == 1
    out = capsys.readouterr().out
    assert "rust.calls: [(touch," in out
    assert "total: 2 sequences, 2 mismatches" in out
    # Two managers on one set of contexts, each with its plug-in: every pair of the two.
    monkeypatch.undo()
    assert difftest.main([*argv, "--shared", "--sequences", "1", "--thresholds", "2"]) == 0
    out = capsys.readouterr().out
    for pair in ("mru+mru", "mru+random", "random+mru", "random+random"):
        assert f"{pair} threshold=2: 1 sequences, 200 calls, 0 mismatches" in out


def test_difftest_shared_mode_runs_two_managers_on_one_set_of_contexts(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    difftest = _driver._load_tool("difftest")
    argv = ["--shared", "--policies", "lru", "arc", "--thresholds", "1"]
    argv += ["--sequences", "3", "--calls", "300", "--no-shrink"]
    assert difftest.main(argv) == 0
    out = capsys.readouterr().out
    for pair in ("lru+lru", "lru+arc", "arc+lru", "arc+arc"):
        assert f"{pair} threshold=1: 3 sequences, 900 calls, 0 mismatches" in out
    # A reference LRU that takes up any policy's request rank, not only its own: only two
    # managers sharing a context can tell.
    from kvoffload.reference import lru

    def any_rank(self: lru.LruPolicy, req_context: Any) -> int:
        state = req_context.get_state(lru._RequestRank)
        if state is None or state.epoch != self._epoch:
            state = lru._RequestRank(self, self._epoch, self._fresh_rank()[0])
            req_context.set_state(state)
        return int(state.rank)

    monkeypatch.setattr(lru.LruPolicy, "_request_rank", any_rank)
    assert difftest.main(["--policies", "lru", "--sequences", "3", "--calls", "300"]) == 0
    capsys.readouterr()
    assert difftest.main([*argv, "--policies", "lru"]) == 1
    out = capsys.readouterr().out
    assert "lru+lru threshold=1: 3 sequences" in out
    assert "state mismatch" in out  # the rank a reference manager took is not its own
    assert "a.prepare_store" in out
    assert "b.prepare_store" in out


def test_difftest_plug_in_mode_refuses_built_in_policy_names(
    capsys: pytest.CaptureFixture[str],
) -> None:
    difftest = _driver._load_tool("difftest")
    with pytest.raises(SystemExit):
        difftest.main(["--plug-ins", "--policies", "lru"])
    assert "--policies: choose from mru, random" in capsys.readouterr().err
