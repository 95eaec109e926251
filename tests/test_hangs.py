"""Calls that once hung the process: each scenario runs in a child process with a time limit.

Each one reached a lock its own thread already held: Python code (a policy, a key's finalizer,
an int's ``__index__``) running while the manager or a request's state was locked, and calling
back in. A regression hangs the child, which the time limit turns into a failure.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

#: A child given more than this has hung.
TIME_LIMIT_S = 120


def _answers(script: str) -> str:
    """Run ``script`` in a child Python; its output, once it has exited cleanly."""
    done = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        capture_output=True,
        text=True,
        timeout=TIME_LIMIT_S,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def test_a_policy_reading_its_request_state_gets_an_answer() -> None:
    # The manager holds the request's state while its policy runs: reading it there, or handing
    # the context to another manager, waited on a lock this very thread held.
    out = _answers("""
        import sys, types
        from kvoffload import CPUOffloadingManager, ReentrantCallError, ReqContext, _native
        from kvoffload.reference.lru import LruPolicy

        other = CPUOffloadingManager(4)
        seen = []

        class ReadsItsState(LruPolicy):
            def insert(self, key, chunk, req_context):
                try:
                    other.prepare_store([key + b"!"], req_context)
                except ReentrantCallError as e:
                    seen.append(str(e))
                state = req_context.get_state(_native.RequestState)
                seen.append(repr(state))
                try:
                    state.finished
                except ReentrantCallError:
                    seen.append("finished: ReentrantCallError")
                super().insert(key, chunk, req_context)

        module = types.ModuleType("reads_its_state")
        module.ReadsItsState = ReadsItsState
        sys.modules["reads_its_state"] = module
        m = CPUOffloadingManager(
            4, cache_policy="ReadsItsState", cache_policy_module_path="reads_its_state"
        )
        ctx = ReqContext(req_id="r")
        other.prepare_store([b"x"], ctx)  # the context holds a state already
        out = m.prepare_store([b"k"], ctx)
        assert out.keys_to_store == [b"k"], out
        assert seen[0].startswith("the request's state is held by a manager call"), seen
        assert seen[1:] == [
            "<RequestState (in use by a manager call)>", "finished: ReentrantCallError"
        ], seen
        assert not ctx.get_state(_native.RequestState).finished
        assert other.lookup(b"k!", ctx).name == "MISS"
        m.check_invariants()
        print("answered")
    """)
    assert out == "answered"


def test_check_invariants_refuses_a_call_back_from_a_policys_status() -> None:
    # check_invariants reads a Python policy's statuses under the manager's lock; an int whose
    # __index__ calls the manager waited there for ever.
    out = _answers("""
        import sys, types
        from kvoffload import CPUOffloadingManager, InvariantViolation, ReqContext
        from kvoffload.reference.lru import LruPolicy

        class Keeps(LruPolicy):
            def insert(self, key, chunk, req_context):
                self.last = chunk
                super().insert(key, chunk, req_context)

        module = types.ModuleType("keeps")
        module.Keeps = Keeps
        sys.modules["keeps"] = module
        m = CPUOffloadingManager(4, cache_policy="Keeps", cache_policy_module_path="keeps")
        refused = []

        class CallsBack:
            def __index__(self):
                try:
                    m.get_stats()
                except Exception as e:
                    refused.append(type(e).__name__)
                return -1

        m.prepare_store([b"k" * 36], ReqContext("r"))
        m.policy.last.ref_cnt = CallsBack()
        m.check_invariants()
        assert refused == ["ReentrantCallError"], refused
        m.policy.last.ref_cnt = 1
        try:
            m.check_invariants()
        except InvariantViolation as e:
            print("refused:", e)
    """)
    assert out.startswith("refused: ")
    assert "ref_cnt=1" in out


def test_a_key_finalizer_may_finish_its_request() -> None:
    # A state renewed in place (a reset during the call) released its old key objects while
    # holding its object list; a finalizer finishing the request waited on that list.
    out = _answers("""
        import gc
        from kvoffload import CPUOffloadingManager, ReqContext

        m = CPUOffloadingManager(num_chunks=4)  # LRU: positions are read on every recording

        class ResetsOnce(ReqContext):
            arm = False

            def get_offload_key_position(self, key):
                if self.arm:
                    self.arm = False
                    m.reset_cache()
                return None

        ctx = ResetsOnce("r")
        finished = []

        class FinishesOnDrop(bytes):
            def __del__(self):
                m.on_request_finished(ctx)
                finished.append(True)

        out = m.prepare_store([FinishesOnDrop(b"a" * 36)], ctx)
        m.complete_store(out.keys_to_store, ctx)
        del out
        gc.collect()
        ctx.arm = True
        out = m.prepare_store([b"b" * 36], ctx)
        assert finished == [True], finished
        m.check_invariants()
        print("answered", out.keys_to_store)
    """)
    assert out.startswith("answered")


@pytest.mark.parametrize("records", [1, 100])
def test_a_request_recording_while_it_finishes(records: int) -> None:
    # on_request_finished reads positions with no lock held; a request that records new keys
    # meanwhile (here from its own position callback) was refused with an internal message.
    # Its positions are read again; a request that never stops recording is refused clearly.
    out = _answers(f"""
        from kvoffload import CPUOffloadingManager, InvalidArgumentError, ReqContext

        m = CPUOffloadingManager(num_chunks=8, cache_policy="arc")

        class RecordsWhileFinishing(ReqContext):
            left = 0

            def get_offload_key_position(self, key):
                if self.left:
                    self.left -= 1
                    m.prepare_store([b"z%d" % self.left], self)
                return super().get_offload_key_position(key)

        ctx = RecordsWhileFinishing("r")
        m.prepare_store([b"a" * 36, b"b" * 36], ctx)
        ctx.left = {records}
        try:
            m.on_request_finished(ctx)
            print("finished")
        except InvalidArgumentError as e:
            print("refused:", e)
        m.check_invariants()
    """)
    if records == 1:
        assert out == "finished"
    else:
        assert out.startswith("refused: the request kept recording new keys")
