"""Host memory for offloaded KV blocks: ``HostPool``, the memory behind the manager's chunk ids.

A pool is ``num_chunks * chunk_bytes`` bytes of page-aligned, pre-faulted memory (anonymous, or a
named ``/dev/shm`` region shared by worker processes), optionally page-locked and registered with
CUDA. It hands out zero-copy numpy views and moves KV blocks between a buffer (the device cache's
host image: any C-contiguous buffer) and its chunks, in Rust with the GIL released, either now
(``gather``/``scatter``) or as jobs shaped like vLLM's ``OffloadingWorker`` (``submit_store``,
``submit_load``, ``get_finished``, ``wait``).
"""

from __future__ import annotations

import math
import operator
import os
import re
import sys
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt

from kvoffload import _cuda, _native
from kvoffload.errors import (
    BlockIndexError,
    CudaRegistrationError,
    InvalidArgumentError,
)

__all__ = ["HostPool", "HostPoolStats", "PinnedState"]

PinnedState = Literal["cuda-registered", "page-locked", "pageable"]
_MAX_JOB_ID = 2**64 - 1


def _janitor_command() -> list[str] | None:
    """The janitor's argv: its source, run by this interpreter in isolated mode.

    With ``-I -S`` it needs nothing but the standard library, whatever this process's import
    path was.
    """
    if not sys.executable:
        return None  # embedded interpreter: the last user or the next opener cleans up
    from kvoffload import _janitor

    return [sys.executable, "-I", "-S", "-c", Path(_janitor.__file__).read_text()]


_JANITOR = _janitor_command()

# A forked child would share its parent's open file of each shared region, and so its lock:
# the parent's close would then find itself the last user and remove the name while the child
# still maps the region. Each fork gives the child a locked open file of its own.
os.register_at_fork(
    before=_native._before_fork,
    after_in_parent=_native._after_fork_in_parent,
    after_in_child=_native._after_fork_in_child,
)


@dataclass(frozen=True)
class HostPoolStats:
    """What a pool is and how it was set up."""

    num_chunks: int
    chunk_bytes: int
    nbytes: int
    mapped_bytes: int
    pinned: PinnedState
    pinned_reason: str
    locked: bool
    huge_pages: bool
    prefault_method: str
    prefault_seconds: float
    prefault_gb_per_s: float
    shared_path: str | None
    creator: bool
    num_threads: int
    jobs_in_flight: int
    closed: bool
    released: bool


def _count(name: str, value: object, minimum: int, maximum: int = sys.maxsize) -> int:
    """An int (Python or numpy integer, not bool) in ``minimum..=maximum``."""
    if isinstance(value, (bool, np.bool_)):
        raise InvalidArgumentError(f"{name} must be an int, got bool")
    try:
        n = operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise InvalidArgumentError(f"{name} must be an int, got {type(value).__name__}") from None
    if not minimum <= n <= maximum:
        raise InvalidArgumentError(f"{name} must be in {minimum}..{maximum}, got {n}")
    return n


#: numpy's deprecated ``"a"`` alias of ``"S"`` (byte strings), with an optional byte order and size.
_DEPRECATED_DTYPE = re.compile(r"[<>=|]?a\d*")


def _dtype(dtype: object) -> np.dtype[Any]:
    """``dtype`` as a numpy dtype.

    A spelling numpy deprecates (``"a"`` for ``"S"``) is refused rather than passed on with
    numpy's warning, which a program running with warnings as errors would get as an exception
    from outside kvoffload. It is screened here, not by changing the warning filters, which are
    process-wide and would race with other threads.
    """
    spec = dtype.decode("ascii", "replace") if isinstance(dtype, bytes) else dtype
    if isinstance(spec, str) and _DEPRECATED_DTYPE.fullmatch(spec.strip()):
        raise InvalidArgumentError(f"not a numpy dtype: {dtype!r} (numpy deprecates 'a': use 'S')")
    try:
        return np.dtype(dtype)  # type: ignore[call-overload,no-any-return]
    except Exception as e:
        # Not only TypeError and ValueError: numpy parses a comma-separated string with
        # `ast.literal_eval`, so `","` raises SyntaxError from numpy's parser.
        raise InvalidArgumentError(f"not a numpy dtype: {dtype!r} ({e})") from e


def _ids(name: str, ids: object) -> npt.NDArray[np.int64]:
    """A 1-D int64 array of ids (negative or too-large ids are range-checked in Rust)."""
    try:
        arr = np.asarray(ids)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{name} must be a sequence of ints: {e}") from e
    if arr.ndim != 1:
        raise InvalidArgumentError(f"{name} must be one-dimensional, got shape {arr.shape}")
    if arr.size == 0:
        return np.empty(0, dtype=np.int64)
    if arr.dtype.kind not in "iu":
        raise InvalidArgumentError(f"{name} must hold ints, got dtype {arr.dtype}")
    if arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        raise BlockIndexError(f"{name} holds {int(arr.max())}, out of range")
    return np.ascontiguousarray(arr, dtype=np.int64)


def _is_torch_tensor(obj: object) -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and isinstance(obj, torch.Tensor)


def as_byte_buffer(obj: object) -> npt.NDArray[np.uint8]:
    """A flat ``uint8`` view (no copy) of a C-contiguous buffer.

    Accepts numpy arrays, CPU torch tensors (any dtype, bfloat16 included), objects with
    ``__dlpack__`` and anything with the buffer protocol.
    """
    arr: np.ndarray[Any, Any]
    if isinstance(obj, np.ndarray):
        arr = obj
    elif _is_torch_tensor(obj):
        t: Any = obj
        if t.device.type != "cpu":
            raise InvalidArgumentError(
                f"a tensor on {t.device} is not host memory; pass a CPU tensor (the copy to the "
                "device is the engine's)"
            )
        if not t.is_contiguous():
            raise InvalidArgumentError("the tensor is not contiguous")
        torch: Any = sys.modules["torch"]
        arr = t.detach().reshape(-1).view(torch.uint8).numpy()
    elif hasattr(obj, "__dlpack__"):
        arr = np.from_dlpack(obj)
    else:
        try:
            arr = np.frombuffer(obj, dtype=np.uint8)  # type: ignore[call-overload]
        except (TypeError, ValueError, BufferError) as e:
            raise InvalidArgumentError(
                f"expected a C-contiguous buffer (numpy array, CPU tensor, bytearray...), got "
                f"{type(obj).__name__}: {e}"
            ) from e
    if arr.dtype.hasobject:
        raise InvalidArgumentError("an array of Python objects is not a byte buffer")
    if not arr.flags.c_contiguous:
        raise InvalidArgumentError("the buffer is not C-contiguous")
    return arr.reshape(-1).view(np.uint8)


def _release(mem: Any, registration: _cuda.CudaRegistration | None) -> None:
    if registration is not None:
        registration.unregister()
    mem.close()


class HostPool:
    """``num_chunks`` chunks of ``chunk_bytes`` of host memory; chunk ``i`` is the manager's id i.

    Args:
        num_chunks: chunks in the pool (the manager's ``num_chunks``).
        chunk_bytes: bytes per chunk; the pool is exactly ``num_chunks * chunk_bytes`` bytes,
            mapped page-aligned and rounded up to the page only.
        shared_name: back the pool by ``/dev/shm/kvoffload.<name>``: the first process creates
            it, the others attach (same sizes required). The name disappears once every process
            using it has closed it or exited, killed ones included.
        lock_pages: lock the pages in memory (mlock); ``PageLockError`` names ``RLIMIT_MEMLOCK``.
        huge_pages: ask for transparent huge pages (``MADV_HUGEPAGE``).
        register_cuda: ``"auto"`` registers with ``cudaHostRegister`` when a CUDA runtime and a
            device are found (this initialises the CUDA runtime in the process), ``True``
            requires it, ``False`` skips it. ``pinned`` says what happened and
            ``stats().pinned_reason`` why.
        num_threads: copy threads, which also pre-fault the memory together (default: the CPU
            count, at most 8).
        shared_mode: ``"create_or_attach"``, ``"create"`` or ``"attach"``.
        attach_timeout: seconds an attacher waits for the creator to finish setting up.

    """

    def __init__(
        self,
        num_chunks: int,
        chunk_bytes: int,
        *,
        shared_name: str | None = None,
        lock_pages: bool = False,
        huge_pages: bool = False,
        register_cuda: bool | Literal["auto"] = "auto",
        num_threads: int | None = None,
        shared_mode: Literal["create_or_attach", "create", "attach"] = "create_or_attach",
        attach_timeout: float = 30.0,
    ) -> None:
        num_chunks = _count("num_chunks", num_chunks, 1)
        chunk_bytes = _count("chunk_bytes", chunk_bytes, 1)
        if not (register_cuda is True or register_cuda is False or register_cuda == "auto"):
            raise InvalidArgumentError(
                f"register_cuda must be 'auto', True or False, got {register_cuda!r}"
            )
        if num_threads is None:
            num_threads = max(1, min(os.cpu_count() or 1, 8))
        num_threads = _count("num_threads", num_threads, 1, 1024)
        if shared_name is not None and not isinstance(shared_name, str):
            raise InvalidArgumentError("shared_name must be a str")
        if shared_name is not None and not shared_name.isprintable():
            raise InvalidArgumentError(f"shared_name must be printable, got {shared_name!r}")
        if isinstance(attach_timeout, bool) or not isinstance(attach_timeout, (int, float)):
            raise InvalidArgumentError("attach_timeout must be a number of seconds")
        self._mem = _native.HostMemory(
            num_chunks,
            chunk_bytes,
            num_threads=num_threads,
            lock_pages=bool(lock_pages),
            huge_pages=bool(huge_pages),
            shared_name=shared_name,
            shared_mode=shared_mode,
            attach_timeout=float(attach_timeout),
            janitor=_JANITOR if shared_name is not None else None,
        )
        self._mapped_bytes = int(self._mem.mapped_bytes)
        self._registration: _cuda.CudaRegistration | None = None
        try:
            self._pinned_reason = self._register(register_cuda)
        except BaseException:
            self._mem.close()
            raise
        self._finalizer = weakref.finalize(self, _release, self._mem, self._registration)
        method, seconds, locked, huge, path, creator = self._mem.info()
        self._info = (method, float(seconds), bool(locked), bool(huge), path, bool(creator))

    def _register(self, mode: bool | Literal["auto"]) -> str:
        if mode is False:
            return "register_cuda=False"
        lib = _cuda.load_runtime()
        if lib is None:
            if mode is True:
                raise CudaRegistrationError("register_cuda=True but no CUDA runtime was found")
            return "no CUDA runtime library (libcudart) found"
        try:
            count, why = _cuda.device_count(lib)
        except (AttributeError, OSError) as e:  # a library without the runtime's symbols
            count, why = 0, f"not a usable CUDA runtime: {e}"
        if count == 0:
            if mode is True:
                raise CudaRegistrationError(f"register_cuda=True but no CUDA device: {why}")
            return f"CUDA runtime found but no usable device ({why or 'none visible'})"
        self._registration = _cuda.register(lib, self._mem.address, self._mapped_bytes)
        return f"cudaHostRegister in {len(self._registration.ranges)} piece(s)"

    # -- facts -------------------------------------------------------------------------------

    @property
    def num_chunks(self) -> int:
        """Chunks in the pool."""
        return int(self._mem.num_chunks)

    @property
    def chunk_bytes(self) -> int:
        """Bytes per chunk."""
        return int(self._mem.chunk_bytes)

    @property
    def nbytes(self) -> int:
        """Usable bytes: exactly ``num_chunks * chunk_bytes``."""
        return int(self._mem.nbytes)

    @property
    def pinned(self) -> PinnedState:
        """``"cuda-registered"``, ``"page-locked"`` or ``"pageable"``: what the memory really is."""
        if self._registration is not None and self._registration.ranges:
            return "cuda-registered"
        return "page-locked" if self._info[2] else "pageable"

    @property
    def shared_path(self) -> str | None:
        """The ``/dev/shm`` file of a shared pool."""
        return self._info[4]

    @property
    def closed(self) -> bool:
        """Whether ``close()`` was called."""
        return bool(self._mem.closed)

    def stats(self) -> HostPoolStats:
        """The pool's facts, pinned state and pre-fault rate."""
        method, seconds, locked, huge, path, creator = self._info
        mapped = self._mapped_bytes
        rate = mapped / seconds / 1e9 if seconds > 0 else math.inf
        return HostPoolStats(
            num_chunks=self.num_chunks,
            chunk_bytes=self.chunk_bytes,
            nbytes=self.nbytes,
            mapped_bytes=mapped,
            pinned=self.pinned,
            pinned_reason=self._pinned_reason,
            locked=locked,
            huge_pages=huge,
            prefault_method=method,
            prefault_seconds=seconds,
            prefault_gb_per_s=rate,
            shared_path=path,
            creator=creator,
            num_threads=int(self._mem.num_threads),
            jobs_in_flight=int(self._mem.in_flight()),
            closed=self.closed,
            released=bool(self._mem.released),
        )

    # -- views -------------------------------------------------------------------------------

    def view(self) -> npt.NDArray[np.uint8]:
        """The whole pool, writable, as ``uint8[num_chunks, chunk_bytes]`` (no copy)."""
        return self._mem.view()

    def typed_view(self, dtype: npt.DTypeLike, shape: Sequence[int]) -> npt.NDArray[Any]:
        """The pool as ``dtype[num_chunks, *shape]``; ``shape`` must fill a chunk exactly."""
        dt = _dtype(dtype)
        if not isinstance(shape, Sequence):
            raise InvalidArgumentError(f"shape must be a sequence of ints, got {shape!r}")
        dims = tuple(_count("shape entry", d, 0) for d in shape)
        if dt.hasobject:
            raise InvalidArgumentError(f"{dt} holds Python objects: pool memory cannot be one")
        if math.prod(dims) * dt.itemsize != self.chunk_bytes:
            raise InvalidArgumentError(
                f"{dt}{list(dims)} is {math.prod(dims) * dt.itemsize} bytes, not one "
                f"{self.chunk_bytes}-byte chunk"
            )
        if dt.subdtype is not None:
            # A subarray dtype (``("<u2", (2,))``) is its base over trailing dimensions, as
            # numpy lays out arrays made with one (a view cannot take it directly).
            base, sub = dt.subdtype
            dt, dims = base, (*dims, *sub)
        return self.view().view(dt).reshape(self.num_chunks, *dims)

    def chunk(
        self, chunk_id: int, dtype: npt.DTypeLike = np.uint8, shape: Sequence[int] | None = None
    ) -> npt.NDArray[Any]:
        """One chunk's memory (no copy): ``uint8[chunk_bytes]``, or ``dtype[*shape]``."""
        cid = _count("chunk_id", chunk_id, -sys.maxsize - 1)
        if not 0 <= cid < self.num_chunks:  # as an id out of range in a transfer
            raise BlockIndexError(f"chunk id {cid} is out of range 0..{self.num_chunks}")
        dt = _dtype(dtype)
        if shape is None and dt == np.uint8:
            whole: npt.NDArray[Any] = self.view()
        else:
            dims = (self.chunk_bytes // max(dt.itemsize, 1),) if shape is None else shape
            whole = self.typed_view(dt, dims)
        out: npt.NDArray[Any] = whole[cid]
        return out

    # -- transfers ---------------------------------------------------------------------------

    def _args(
        self,
        buf: object,
        blocks: object,
        chunk_ids: object,
        block_bytes: int | None,
        chunk_offset: int,
    ) -> tuple[npt.NDArray[np.uint8], int, npt.NDArray[np.int64], npt.NDArray[np.int64], int]:
        bb = self.chunk_bytes if block_bytes is None else _count("block_bytes", block_bytes, 1)
        off = _count("chunk_offset", chunk_offset, 0)
        return (
            as_byte_buffer(buf),
            bb,
            _ids("block ids", blocks),
            _ids("chunk ids", chunk_ids),
            off,
        )

    def gather(
        self,
        src: object,
        src_blocks: Iterable[int] | npt.ArrayLike,
        chunk_ids: Iterable[int] | npt.ArrayLike,
        *,
        block_bytes: int | None = None,
        chunk_offset: int = 0,
        threads: int | None = None,
    ) -> None:
        """Copy block ``src_blocks[i]`` of ``src`` into chunk ``chunk_ids[i]``, now.

        ``src`` is a C-contiguous buffer of ``block_bytes``-byte blocks (default: one chunk);
        each block lands at ``chunk_offset`` in its chunk. Every id and size is checked first:
        on error nothing is written.
        """
        args = self._args(src, src_blocks, chunk_ids, block_bytes, chunk_offset)
        t = 0 if threads is None else _count("threads", threads, 1, 1024)
        self._mem.transfer("gather", *args, t)

    def scatter(
        self,
        dst: object,
        dst_blocks: Iterable[int] | npt.ArrayLike,
        chunk_ids: Iterable[int] | npt.ArrayLike,
        *,
        block_bytes: int | None = None,
        chunk_offset: int = 0,
        threads: int | None = None,
    ) -> None:
        """Copy chunk ``chunk_ids[i]`` into block ``dst_blocks[i]`` of ``dst``, now."""
        args = self._args(dst, dst_blocks, chunk_ids, block_bytes, chunk_offset)
        t = 0 if threads is None else _count("threads", threads, 1, 1024)
        self._mem.transfer("scatter", *args, t)

    def _job_id(self, job_id: object) -> int:
        return _count("job_id", job_id, 0, _MAX_JOB_ID)

    def submit_store(
        self,
        job_id: int,
        src: object,
        src_blocks: Iterable[int] | npt.ArrayLike,
        chunk_ids: Iterable[int] | npt.ArrayLike,
        *,
        block_bytes: int | None = None,
        chunk_offset: int = 0,
    ) -> None:
        """Queue a gather (device cache to host) as job ``job_id``; checked before queueing.

        ``src`` is kept alive until the job's result is taken; do not resize or free it (for
        example a torch tensor's storage) before that.
        """
        jid = self._job_id(job_id)
        args = self._args(src, src_blocks, chunk_ids, block_bytes, chunk_offset)
        self._mem.submit(jid, "gather", *args)

    def submit_load(
        self,
        job_id: int,
        dst: object,
        dst_blocks: Iterable[int] | npt.ArrayLike,
        chunk_ids: Iterable[int] | npt.ArrayLike,
        *,
        block_bytes: int | None = None,
        chunk_offset: int = 0,
    ) -> None:
        """Queue a scatter (host back to the device cache) as job ``job_id``."""
        jid = self._job_id(job_id)
        args = self._args(dst, dst_blocks, chunk_ids, block_bytes, chunk_offset)
        self._mem.submit(jid, "scatter", *args)

    def get_finished(self) -> list[tuple[int, bool]]:
        """``(job_id, success)`` of the jobs finished since the last call."""
        return list(self._mem.get_finished())

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished (their results stay for get_finished)."""
        try:
            ids = list(job_ids)
        except TypeError:
            raise InvalidArgumentError(
                f"job_ids must be an iterable of ints, got {type(job_ids).__name__}"
            ) from None
        self._mem.wait([self._job_id(j) for j in ids])

    def cancel(self, job_id: int) -> bool:
        """Cancel a job that has not started: it reports ``success=False`` and copies nothing."""
        return bool(self._mem.cancel(self._job_id(job_id)))

    # -- lifetime ----------------------------------------------------------------------------

    def close(self) -> None:
        """Wait for queued jobs and release the memory; idempotent.

        Views that are still alive keep the memory mapped (and valid) until they are gone; the
        unmap is deferred, never dangling. A shared region's name is removed once no process
        uses it.
        """
        self._finalizer()

    def __enter__(self) -> HostPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        shared = f", shared_path={self.shared_path!r}" if self.shared_path else ""
        return (
            f"HostPool(num_chunks={self.num_chunks}, chunk_bytes={self.chunk_bytes}, "
            f"pinned={self.pinned!r}{shared}{', closed' if self.closed else ''})"
        )
