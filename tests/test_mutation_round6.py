"""Round 6 of the mutation audit: tests that kill hand-made mutants no earlier test caught.

The spots: a request state's lock (``RequestState::lock_with`` and its holder mark), the
``PolicyCore`` wrappers of the built-in policies, and the binding's list reading and filling.
(The fourth spot, the streaming copy loops of ``host/transfer.rs``, left no survivor that a test
can kill on this kind of machine: its unit tests next to the loops caught the rest.) Each test
names the mutants it kills in its docstring.
"""

from __future__ import annotations

import textwrap

import pytest

from _helpers import FORK_PRELUDE, k, run_child_python
from kvoffload import ReqContext, _native
from kvoffload.policies import ChunkStatus

#: The fork prelude, and the policy the scenarios subclass.
_PRELUDE = FORK_PRELUDE + "from kvoffload.reference.lru import LruPolicy\n"


def _run(script: str) -> str:
    """Run ``_PRELUDE`` and ``script`` in a child Python; its output, once it exited cleanly."""
    return run_child_python(_PRELUDE + textwrap.dedent(script)).stdout.strip()


# --- spot 1: a request state's lock and its holder mark -------------------------------------


def test_another_thread_reading_a_state_a_python_policy_holds_waits_for_the_call() -> None:
    """A Python policy's call holds its request's state; another thread reading the state waits
    for the call and gets the answer, in a process and in a child forked from it (the holder's
    mark carries the fork count it was set in).

    Kills the mutants that call a held state orphaned when its holder's fork count matches
    (``!=`` -> ``==`` in ``lock_with``) and those that record no, or a wrong, fork count in
    ``set_holder``.
    """
    out = _run("""
        def scenario():
            entered, release = threading.Event(), threading.Event()

            class Holds(LruPolicy):
                def insert(self, key, status, req_context):
                    if key == b"s":
                        entered.set()
                        release.wait()
                    super().insert(key, status, req_context)

            m = CPUOffloadingManager(4, **plug_in("holds", Holds))
            ctx = ReqContext(req_id="r")
            m.prepare_store([b"a"], ctx)
            state = ctx.get_state(kvoffload._native.RequestState)
            call = threading.Thread(target=m.prepare_store, args=([b"s"], ctx))
            call.start()
            assert entered.wait(30)
            answers = []

            def read():
                try:
                    answers.append(state.finished)
                except Exception as e:
                    answers.append(type(e).__name__)

            reader = threading.Thread(target=read)
            reader.start()
            # Time for the reader to find the state held (not needed for the answer: a reader
            # that comes late finds it free); it cannot be done while the call holds it.
            reader.join(timeout=1.0)
            early = not reader.is_alive()
            release.set()
            call.join()
            reader.join()
            assert not early and answers == [False], (early, answers)
            m.check_invariants()

        scenario()
        print(fork_and_wait(scenario, 60.0))
    """)
    assert out == "0"


def test_a_forked_child_waits_for_its_own_threads_call_on_a_request_state() -> None:
    """In a forked child, a state that a built-in policy's call on another child thread holds
    (no holder mark) is waited for, not taken for one held by a parent's thread.

    Kills the mutants that test the fork count without a holder (``holder != 0`` dropped from
    ``lock_with``, or turned into ``holder == 0``). Another thread's long detached calls must
    hold the state while this one reads it: a read that finds it free proves nothing, so the
    reads go on while the calls run (many land inside one), and none may fail.
    """
    out = _run("""
        def contended_reads():
            ctx = ReqContext(req_id="child")
            n = 100_000
            keys = [b"k%d" % i for i in range(n)]
            m = CPUOffloadingManager(n)
            m.prepare_store(keys, ctx)
            m.complete_store(keys, ctx)
            state = ctx.get_state(kvoffload._native.RequestState)
            errors = []

            def loads():
                try:
                    for _ in range(20):
                        m.prepare_load(keys, ctx)
                        m.complete_load(keys, ctx)
                except Exception as e:
                    errors.append(repr(e))

            t = threading.Thread(target=loads)
            t.start()
            reads = 0
            while t.is_alive() and not errors:
                try:
                    state.finished
                    assert "RequestState seen=" in repr(state), repr(state)
                except Exception as e:
                    errors.append(repr(e))
                reads += 1
            t.join()
            assert errors == [], errors
            assert reads > 0
            m.check_invariants()

        print(fork_and_wait(contended_reads, 60.0))
    """)
    assert out == "0"


# --- spot 2: PolicyCore, the built-in policies behind vLLM's CachePolicy calls ----------------

#: Every built-in policy a ``PolicyCore`` runs.
KINDS = ("lru", "arc", "fifo", "sieve", "s3fifo", "2q", "slru", "lfu", "arc-paper")


def _filled(kind: str, ref_cnts: list[int]) -> tuple[_native.PolicyCore, list[ChunkStatus]]:
    """A ``PolicyCore`` of ``kind`` for 8 chunks holding ``k(i)`` with ref count
    ``ref_cnts[i]``, inserted in that order."""
    core = _native.PolicyCore(kind, 8)
    ctx = ReqContext("fill")
    chunks = [ChunkStatus(i, r) for i, r in enumerate(ref_cnts)]
    for i, chunk in enumerate(chunks):
        core.insert(k(i), chunk, ctx)
    return core, chunks


@pytest.mark.parametrize("kind", KINDS)
def test_a_policy_core_refuses_an_evict_its_protected_keys_make_infeasible(kind: str) -> None:
    """``evict`` answers ``None`` and changes nothing when the protected evictable keys leave
    fewer than ``n`` to evict; a pinned key among the protected takes nothing away, and one
    key listed twice counts once.

    Kills the mutants of ``evict``'s feasibility rule: protected keys ignored, pinned ones
    counted instead of evictable ones, duplicates counted twice (``dedup`` dropped).
    """
    core, chunks = _filled(kind, [0, 0, 1])
    assert core.evict(2, [k(0)]) is None
    assert len(core) == 3
    core.check_invariants()
    victims = core.evict(1, [k(0), k(0), k(2), k(2)])
    assert victims == [(k(1), chunks[1])]
    victims = core.evict(1, [k(2)])
    assert victims == [(k(0), chunks[0])]
    assert len(core) == 1
    core.check_invariants()


def test_a_policy_core_evicts_in_order_as_key_and_chunk_pairs() -> None:
    """``evict`` answers ``(key, chunk)`` tuples, oldest first, with the very chunk objects
    inserted, and the count of resident keys drops with each victim.

    Kills the mutants that reverse the victims, swap the pair, or count vacated slots in
    ``__len__``.
    """
    core, chunks = _filled("lru", [0, 0, 0])
    victims = core.evict(2, [])
    assert victims is not None
    assert [type(v) for v in victims] == [tuple, tuple]
    assert victims == [(k(0), chunks[0]), (k(1), chunks[1])]
    assert victims[0][1] is chunks[0]
    assert len(core) == 1
    assert core.get(k(0)) is None
    assert core.get(k(2)) is chunks[2]
    core.check_invariants()


def test_a_policy_core_orders_a_finished_requests_keys_by_token_position() -> None:
    """LRU's ``on_request_finished`` refreshes a request's keys tail first, in token-position
    order whatever order the groups list them in: the head, refreshed last, leaves last. When a
    key has no position, the keys stay in the order given.

    Kills the mutants that skip the sort by position, or that sort when a position is missing.
    """
    core, _ = _filled("lru", [0, 0, 0])
    ctx = ReqContext("r")
    for i in range(3):
        ctx.set_offload_key_position(k(i), i)
    core.on_request_finished([[k(2), k(1)], [k(0)]], set(), set(), ctx)
    victims = core.evict(3, [])
    assert victims is not None
    assert [key for key, _ in victims] == [k(2), k(1), k(0)]

    core, _ = _filled("lru", [0, 0, 0])
    ctx = ReqContext("r")
    ctx.set_offload_key_position(k(2), 2)
    ctx.set_offload_key_position(k(0), 1)  # k(1) has none: the order given stands
    core.on_request_finished([[k(2), k(1), k(0)]], set(), set(), ctx)
    victims = core.evict(3, [])
    assert victims is not None
    assert [key for key, _ in victims] == [k(0), k(1), k(2)]


def test_a_policy_core_tells_arc_which_finished_keys_were_inserted_only_and_which_reused() -> None:
    """ARC keeps a finished request's inserted-only key in T1 (as its newest) and moves a reused
    one to T2.

    Kills the mutant that swaps the two flags of ``FinishedKey``.
    """
    core, _ = _filled("arc", [0, 0, 0])
    ctx = ReqContext("r")
    core.on_request_finished([[k(0)]], {k(0)}, set(), ctx)
    core.on_request_finished([[k(1)]], set(), {k(1)}, ctx)
    state = core.policy_state()
    assert state["t1"] == [k(2), k(0)]
    assert state["t2"] == [k(1)]


# --- spot 3: the binding's list reading and filling -------------------------------------------


def test_the_first_list_access_of_a_process_answers_the_path_its_check_settles_on() -> None:
    """In a fresh process, the very first question (before any list was read or filled) gets
    the path the layout check settles on, and later ones the same.

    Kills the mutant whose first ``direct()`` answers the opposite of the mode it settled.
    ``test_list_access`` catches it only when it runs first in its process: in a whole-suite
    run, earlier tests have settled the mode by then.
    """
    import sysconfig

    checked = "api" if sysconfig.get_config_var("Py_GIL_DISABLED") else "direct"
    out = _run("""
        from kvoffload import _native
        print(_native._list_access(), _native._list_access())
    """)
    assert out == f"{checked} {checked}"
