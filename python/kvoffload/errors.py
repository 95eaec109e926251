"""The exception tree of kvoffload: every error it raises derives from `KVOffloadError`.

Subclasses also derive from the matching built-in (TypeError, ValueError, KeyError) so that code
written against vLLM's manager, which raises built-ins or asserts, can catch them generically.
The Rust bindings raise these same classes, mapped in one place:
``rust/kvoffload-py/src/errors.rs``.
"""

from __future__ import annotations

__all__ = [
    "DuplicateKeyError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvariantViolation",
    "KVOffloadError",
    "KeyStateError",
    "RequestFinishedError",
    "TraceFormatError",
    "UnsupportedPolicyError",
]


class KVOffloadError(Exception):
    """Root of every exception kvoffload raises."""


class InvalidArgumentError(KVOffloadError, ValueError):
    """A constructor argument or call argument has an illegal value."""


class UnsupportedPolicyError(InvalidArgumentError):
    """The cache policy name cannot be resolved (unknown, or not usable by this manager)."""


class InvalidKeyError(KVOffloadError, TypeError):
    """A key is not ``bytes``, or a key collection is not a sequence of keys."""


class DuplicateKeyError(KVOffloadError, ValueError):
    """A key appears more than once where each key may appear only once (prepare_store)."""


class KeyStateError(KVOffloadError, KeyError):
    """A key is not in the state the call needs.

    Absent or pending on ``prepare_load``; not pinned on ``complete_load``.
    """

    def __str__(self) -> str:
        # KeyError quotes its argument; a state error carries a sentence, not a key.
        return str(self.args[0]) if self.args else ""


class RequestFinishedError(KVOffloadError):
    """A finished request recorded a key it had not seen before it finished."""


class InvariantViolation(KVOffloadError):
    """``check_invariants()`` found internal state that breaks an invariant (a bug in kvoffload)."""


class TraceFormatError(KVOffloadError, ValueError):
    """A trace file (or trace record) given to ``kvoffload.sim`` is malformed; says where."""
