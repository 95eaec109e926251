"""A process that forks while another of its threads is inside a manager call.

The forking thread holds every Rust manager's lock across the fork (`kvoffload._forks`), so the
child gets each manager whole and unlocked; before, a child forked in the middle of another
thread's call had that manager locked for good, and its first call waited for ever. Each
scenario runs in a child Python with a time limit: a regression hangs instead of failing.
"""

from __future__ import annotations

import textwrap

from _helpers import FORK_PRELUDE, run_child_python


def _run(script: str, expect: str, before_import: str = "") -> None:
    """Run ``before_import``, the fork prelude and ``script`` in a child Python; it must exit
    cleanly printing ``expect``."""
    program = textwrap.dedent(before_import) + FORK_PRELUDE + textwrap.dedent(script)
    done = run_child_python(program)
    assert done.stdout.strip() == expect, done.stderr


def test_a_fork_during_long_builtin_calls_gives_the_child_a_working_manager() -> None:
    # Touches of 200,000 keys run detached from the interpreter, holding the manager's lock for
    # milliseconds each, back to back on another thread: most forks land inside one.
    _run(
        """
        n = 200_000
        m = CPUOffloadingManager(n)
        keys = [b"k%d" % i for i in range(n)]
        ctx = ReqContext(req_id="fill")
        for i in range(0, n, 10_000):
            m.prepare_store(keys[i : i + 10_000], ctx)
            m.complete_store(keys[i : i + 10_000], ctx)
        stop = threading.Event()

        def toucher():
            c = ReqContext(req_id="touch")
            while not stop.is_set():
                m.touch(keys, c)

        t = threading.Thread(target=toucher)
        t.start()
        time.sleep(0.05)

        def child():
            c = ReqContext(req_id="child")
            assert m.lookup_prefix(keys[:64], c) == 64
            out = m.prepare_store([b"new"], c)
            assert out is not None and out.keys_to_store == [b"new"], out
            m.complete_store([b"new"], c)
            m.touch(keys[:1000], c)
            m.check_invariants()

        statuses = [fork_and_wait(child) for _ in range(8)]
        stop.set()
        t.join()
        m.check_invariants()
        print(statuses)
    """,
        str([0] * 8),
    )


def test_a_fork_waits_for_a_python_policy_call_and_the_child_sees_it_done() -> None:
    # The policy's touch takes 0.3 s, well within the fork's wait (10 s here): the fork happens
    # after the call, so the child's manager has the touch applied and is unlocked.
    _run(
        """
        from kvoffload.reference.lru import LruPolicy
        entered = threading.Event()

        class SlowTouch(LruPolicy):
            def touch(self, keys, req_context):
                if list(keys) == [b"a"]:
                    entered.set()
                    time.sleep(0.3)
                super().touch(keys, req_context)

        kvoffload._forks.PYTHON_POLICY_WAIT_S = 10.0  # a loaded machine cannot outlast it
        m = CPUOffloadingManager(2, **plug_in("slow_touch", SlowTouch))
        ctx = ReqContext(req_id="r")
        m.prepare_store([b"a", b"b"], ctx)
        m.complete_store([b"a", b"b"], ctx)
        t = threading.Thread(target=m.touch, args=([b"a"], ctx))
        t.start()
        assert entered.wait(30)

        def child():
            c = ReqContext(req_id="child")
            out = m.prepare_store([b"c"], c)
            # "a" was touched before the fork, so "b" is the least recent and goes.
            assert out is not None and out.evicted_keys == [b"b"], out
            m.check_invariants()

        status = fork_and_wait(child)
        t.join()
        print(status)
    """,
        "0",
    )


def test_a_child_forked_while_a_python_policy_is_stuck_gets_an_error_not_a_hang() -> None:
    # The policy waits for the forking thread itself: the fork gives up waiting after a second,
    # and the child's copy of that manager refuses calls that need its lock, as does the
    # request's state the call held; lookups, which need no lock, still answer. The parent's
    # manager is unharmed once the policy returns.
    _run(
        """
        from kvoffload import ForkedWhileBusyError
        from kvoffload.reference.lru import LruPolicy
        entered, release = threading.Event(), threading.Event()

        class Stuck(LruPolicy):
            def insert(self, key, status, req_context):
                if key == b"s":
                    entered.set()
                    release.wait()
                super().insert(key, status, req_context)

        m = CPUOffloadingManager(2, **plug_in("stuck", Stuck))
        other = CPUOffloadingManager(2)
        ctx = ReqContext(req_id="r")
        m.prepare_store([b"a"], ctx)
        m.complete_store([b"a"], ctx)
        # A store holds its request's state while the policy runs.
        t = threading.Thread(target=m.prepare_store, args=([b"s"], ctx))
        t.start()
        assert entered.wait(30)

        def child():
            c = ReqContext(req_id="child")
            assert m.lookup(b"a", c).name == "HIT"
            for call in (lambda: m.prepare_store([b"b"], c), m.get_stats):
                try:
                    call()
                except ForkedWhileBusyError as e:
                    assert "forked" in str(e), e
                else:
                    raise AssertionError("no ForkedWhileBusyError")
            assert other.prepare_store([b"x"], c).keys_to_store == [b"x"]
            # The stuck call holds its request's state too: reading it refuses as well.
            state = ctx.get_state(kvoffload._native.RequestState)
            assert "forked in the middle" in repr(state), repr(state)
            try:
                state.finished
            except ForkedWhileBusyError:
                pass
            else:
                raise AssertionError("no ForkedWhileBusyError from the state")

        status = fork_and_wait(child)
        release.set()
        t.join()
        m.complete_store([b"s"], ctx)
        assert m.prepare_store([b"b"], ctx).evicted_keys == [b"a"]
        m.check_invariants()
        print(status)
    """,
        "0",
    )


def test_a_fork_from_inside_a_policy_lets_the_call_finish_in_the_child() -> None:
    # The forking thread holds the manager's lock itself: the fork must not wait for it, and in
    # the child the same call goes on, returns and unlocks the manager.
    _run(
        """
        from kvoffload.reference.lru import LruPolicy
        children = []

        class Forks(LruPolicy):
            def touch(self, keys, req_context):
                if list(keys) == [b"a"] and not children:
                    pid = os.fork()
                    children.append(pid)
                super().touch(keys, req_context)

        m = CPUOffloadingManager(2, **plug_in("forks", Forks))
        ctx = ReqContext(req_id="r")
        m.prepare_store([b"a"], ctx)
        m.complete_store([b"a"], ctx)
        m.touch([b"a"], ctx)
        if children[0] == 0:
            try:
                assert m.prepare_store([b"b"], ctx).keys_to_store == [b"b"]
                m.check_invariants()
            except BaseException:
                os._exit(3)
            os._exit(0)
        _, status = os.waitpid(children[0], 0)
        m.check_invariants()
        print(os.waitstatus_to_exitcode(status))
    """,
        "0",
    )


def test_shadow_managers_are_held_across_a_fork_too() -> None:
    _run(
        """
        m = CPUOffloadingManager(4, shadow_policies=["arc"])
        ctx = ReqContext(req_id="r")
        m.prepare_store([b"a"], ctx)
        m.complete_store([b"a"], ctx)
        cores = list(kvoffload._forks._cores)

        def child():
            assert m.prepare_store([b"b"], ReqContext(req_id="c")).keys_to_store == [b"b"]

        print(len(cores), fork_and_wait(child))
    """,
        "2 0",
    )


def test_a_fork_hook_that_runs_while_the_managers_are_held_gets_an_error_not_a_hang() -> None:
    # A before-fork hook registered before kvoffload was imported runs after kvoffload's, which
    # holds every manager's lock by then: its call of a manager is refused at once.
    _run(
        """
        from kvoffload.reference import LruPolicy

        m = CPUOffloadingManager(4)
        p = CPUOffloadingManager(4, **plug_in("lru_plug_in", LruPolicy))
        hook.managers = [m, p]
        print(fork_and_wait(lambda: m.prepare_store([b"c"], ReqContext(req_id="c"))))
        print(*hook.outcomes)
        for manager in (m, p):  # the hook's calls changed nothing; the managers are free
            assert manager.resident() == {}
            assert manager.prepare_store([b"p"], ReqContext(req_id="p")) is not None
            manager.check_invariants()
    """,
        "0\nReentrantCallError ReentrantCallError",
        before_import="""
        import os

        def hook():
            for manager in hook.managers:
                try:
                    manager.prepare_store([b"h"], ReqContext(req_id="h"))
                    hook.outcomes.append("stored")
                except Exception as e:
                    hook.outcomes.append(type(e).__name__)

        hook.managers, hook.outcomes = [], []
        os.register_at_fork(before=hook)
        """,
    )
