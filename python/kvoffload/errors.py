"""The exception tree of kvoffload: every error it raises derives from `KVOffloadError`.

Subclasses also derive from the matching built-in (TypeError, ValueError, KeyError) so that code
written against vLLM's manager, which raises built-ins or asserts, can catch them generically.
The Rust bindings raise these same classes, mapped in one place:
``rust/kvoffload-py/src/errors.rs``.
"""

from __future__ import annotations

__all__ = [
    "BlockIndexError",
    "CudaRegistrationError",
    "DuplicateKeyError",
    "ForkedWhileBusyError",
    "HostMemoryError",
    "InvalidArgumentError",
    "InvalidKeyError",
    "InvariantViolation",
    "KVOffloadError",
    "KeyStateError",
    "PageLockError",
    "PolicyError",
    "PoolClosedError",
    "ReentrantCallError",
    "RequestFinishedError",
    "SharedRegionError",
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


class BlockIndexError(KVOffloadError, IndexError):
    """A block or chunk id lies outside its buffer or pool; nothing was copied."""


class HostMemoryError(KVOffloadError, OSError):
    """Host memory could not be mapped, pre-faulted or set up (the message says which call)."""


class PageLockError(HostMemoryError):
    """Locking the pool's pages (mlock) failed; the message gives ``RLIMIT_MEMLOCK``."""


class SharedRegionError(HostMemoryError):
    """A named shared region cannot be created or attached.

    It exists already, is missing, has another size, its creator failed or died, or the attach
    timed out.
    """


class CudaRegistrationError(HostMemoryError):
    """``cudaHostRegister`` failed, or CUDA registration was required and no runtime was found."""


class PoolClosedError(KVOffloadError, RuntimeError):
    """The host pool was closed."""


class PolicyError(KVOffloadError, RuntimeError):
    """A plug-in cache policy broke its contract; the manager refused the result.

    For example, ``evict`` chose a key it may not evict.
    """


class ForkedWhileBusyError(KVOffloadError, RuntimeError):
    """The process is a fork's child, made while another thread was inside a call of the manager.

    A fork waits for calls of the Rust managers that other threads are running to end, so the
    child's copies are whole; only a call whose Python cache policy does not return within a
    second is left behind, and the child's copy of that manager raises this from every call that
    needs its lock.
    """


class ReentrantCallError(KVOffloadError, RuntimeError):
    """The manager was called from inside one of its own policy's methods."""
