"""Fork hooks of the Rust managers: a forked child gets each one whole and unlocked.

A manager's lock belongs to the thread running a call. Forked while another thread holds it,
the child would get a copy locked for good (that thread does not exist in the child) and a call
halfway through. So just before a fork the forking thread locks every live manager, waiting for
such calls to end, and unlocks them on both sides after it. Calls that run a Python cache
policy are waited for at most `PYTHON_POLICY_WAIT_S` seconds in all (a policy may wait on
anything, the forking thread included); one that has not ended by then is left behind, and the
child's copy of its manager raises `kvoffload.ForkedWhileBusyError` from calls that need its
lock.

Python runs before-fork hooks last registered first, so a hook registered before kvoffload was
imported runs while the managers are held: its calls that need a manager's lock raise
`kvoffload.ReentrantCallError` instead of waiting on the lock its own thread holds.
"""

from __future__ import annotations

import os
import weakref

from kvoffload import _native

#: Longest wait, in seconds, for calls into managers whose cache policy is Python code.
PYTHON_POLICY_WAIT_S = 1.0

_cores: weakref.WeakSet[_native.ManagerCore] = weakref.WeakSet()


def track(core: _native.ManagerCore) -> None:
    """Cover ``core`` by the fork hooks for as long as it lives."""
    _cores.add(core)


def _before() -> None:
    _native._managers_before_fork(list(_cores), PYTHON_POLICY_WAIT_S)


def _after_in_child() -> None:
    _native._managers_after_fork_in_child(list(_cores))


os.register_at_fork(
    before=_before,
    after_in_parent=_native._managers_after_fork_in_parent,
    after_in_child=_after_in_child,
)
