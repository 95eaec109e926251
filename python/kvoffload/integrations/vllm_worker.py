"""kvoffload's ``HostPool`` as the CPU buffer of vLLM 0.33.0's offloading worker.

``HostPoolWorker`` has the method set of vLLM's ``OffloadingWorker`` (``submit_store``,
``submit_load``, ``get_finished``, ``wait``, ``shutdown``) and moves KV blocks between the
worker's KV-cache tensors and the chunks of a :class:`kvoffload.HostPool` with the pool's own
jobs: copies in Rust, on the pool's threads, with the GIL released.

The device side must be host memory. Each KV-cache tensor is read through the buffer protocol
(numpy arrays, CPU torch tensors, DLPack); a tensor on a GPU is refused when the worker is built.
GPU<->host copies (CUDA streams, events, pinned registration) are not built here.

The chunk layout is the one vLLM's CPU worker uses for its shared host region: a chunk holds one
slot per worker, and a worker's slot holds, tensor after tensor, ``blocks_per_chunk`` device
pages of that tensor. A device page is copied whole (the tensor's block stride); vLLM copies the
unpadded bytes of each layer reference, which are a prefix of that page.

This module imports without vLLM: the specs are read by attribute (``block_ids``; on the device
side also ``group_sizes`` and ``block_indices``) and results are ``result_type`` instances,
kvoffload's :class:`TransferResult` unless vLLM's is given. ``kvoffload.integrations.vllm``
builds the vLLM-facing subclass and wires it into its spec.
"""

from __future__ import annotations

import hashlib
import itertools
import operator
import re
import threading
from collections import defaultdict
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import numpy.typing as npt

from kvoffload.errors import BlockIndexError, InvalidArgumentError, KVOffloadError
from kvoffload.memory import HostPool, as_byte_buffer

__all__ = ["HostPoolWorker", "TransferResult"]

Ids = npt.NDArray[np.int64]


@dataclass
class TransferResult:
    """One finished job, with the fields of vLLM's ``TransferResult``."""

    job_id: int
    success: bool
    #: Bytes copied.
    transfer_size: int | None = None
    #: Seconds the copy took; the pool does not time jobs, so always None here.
    transfer_time: float | None = None


@dataclass(frozen=True)
class _Tensor:
    """One KV-cache tensor: its bytes and where its pages sit in a chunk."""

    buffer: npt.NDArray[np.uint8]  # the tensor's own memory (a view: .base keeps it alive)
    page_bytes: int
    num_blocks: int
    chunk_offset: int


@dataclass
class _Job:
    """A submitted job: the pool jobs it was split into, and how they went so far."""

    size: int
    pending: set[int] = field(default_factory=set)
    success: bool = True


def _ids(name: str, value: object) -> Ids:
    try:
        arr = np.asarray(value)
    except (TypeError, ValueError) as e:
        raise InvalidArgumentError(f"{name} must be a sequence of ints: {e}") from e
    if arr.ndim != 1 or (arr.size and arr.dtype.kind not in "iu"):
        raise InvalidArgumentError(f"{name} ids must be a 1-D array of ints, got {arr.shape}")
    if arr.size and arr.dtype.kind == "u" and int(arr.max()) > np.iinfo(np.int64).max:
        # astype would wrap it to a negative id (and name that one in the error)
        raise BlockIndexError(f"{name} id {int(arr.max())} is out of range")
    return arr.astype(np.int64, copy=False)


def _int_list(name: str, value: object) -> list[int]:
    try:
        return [operator.index(v) for v in value]  # type: ignore[attr-defined]
    except TypeError as e:
        raise InvalidArgumentError(f"{name} must be a sequence of ints: {e}") from e


def _attr(spec: object, name: str, what: str) -> Any:
    try:
        return getattr(spec, name)
    except AttributeError:
        raise InvalidArgumentError(
            f"the {what} spec ({type(spec).__name__}) has no {name!r}"
        ) from None


def _check_range(name: str, ids: Ids, bound: int) -> None:
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= bound):
        bad = int(ids[(ids < 0) | (ids >= bound)][0])
        raise BlockIndexError(f"{name} id {bad} is out of range 0..{bound}")


def _tensors(
    kv_caches: Any, blocks_per_chunk: int, slot_offset: int, slot_bytes: int
) -> list[_Tensor]:
    out: list[_Tensor] = []
    offset = slot_offset
    for t, canonical in enumerate(_attr(kv_caches, "tensors", "KV caches")):
        page = int(canonical.page_size_bytes)
        try:
            buffer = as_byte_buffer(canonical.tensor)
        except InvalidArgumentError as e:
            raise InvalidArgumentError(
                f"KV-cache tensor {t}: {e}. kvoffload's host-pool worker copies between host "
                "buffers only; copies to and from a GPU are not built (leave 'host_pool' unset "
                "to use vLLM's worker)"
            ) from e
        if not buffer.flags.writeable:
            raise InvalidArgumentError(f"KV-cache tensor {t} is read-only; loads write to it")
        if page < 1 or buffer.size % page:
            raise InvalidArgumentError(
                f"KV-cache tensor {t} has {buffer.size} bytes, not a whole number of "
                f"{page}-byte pages"
            )
        out.append(_Tensor(buffer, page, buffer.size // page, offset))
        offset += page * blocks_per_chunk
    if offset > slot_offset + slot_bytes:
        raise InvalidArgumentError(
            f"the KV-cache pages of one chunk take {offset - slot_offset} bytes, more than the "
            f"worker's {slot_bytes}-byte slot"
        )
    return out


def _group_tensors(kv_caches: Any, tensors: Sequence[_Tensor]) -> list[tuple[int, ...]]:
    """Per KV-cache group, the tensors its layers use (each once, in first-use order)."""
    groups: list[tuple[int, ...]] = []
    for g, refs in enumerate(_attr(kv_caches, "group_data_refs", "KV caches")):
        used: dict[int, None] = {}
        for ref in refs:
            t = int(ref.tensor_idx)
            if not 0 <= t < len(tensors):
                raise InvalidArgumentError(f"group {g} refers to tensor {t} of {len(tensors)}")
            if int(ref.page_size_bytes) > tensors[t].page_bytes:
                raise InvalidArgumentError(
                    f"group {g}: a {ref.page_size_bytes}-byte page in tensor {t}, whose pages "
                    f"are {tensors[t].page_bytes} bytes"
                )
            used[t] = None
        groups.append(tuple(used))
    return groups


class HostPoolWorker:
    """Moves KV blocks between host-memory KV-cache tensors and a ``HostPool``'s chunks.

    Args:
        pool: the pool; the worker owns it from here on and closes it in ``shutdown``.
        kv_caches: vLLM's ``CanonicalKVCaches`` (or anything with its ``tensors`` and
            ``group_data_refs``); every tensor must be C-contiguous host memory.
        blocks_per_chunk: device blocks per chunk (vLLM's ``blocks_per_chunk``).
        slot_offset: where this worker's slot starts in every chunk.
        slot_bytes: the slot's size (default: the rest of the chunk).
        result_type: what ``get_finished`` returns, called with ``job_id``, ``success``,
            ``transfer_size`` and ``transfer_time`` (vLLM's ``TransferResult`` in vLLM).

    Every id and size of a job is checked before any of it is queued: a bad job raises a
    :class:`kvoffload.KVOffloadError` and moves no byte. A queued job is reported once by
    ``get_finished``, failed if any of its copies failed; ``submit_*`` returns False (vLLM's
    "not submitted") only if the pool is closed while a job is being queued. Jobs run
    concurrently and finish in any order; ``expedited`` loads are queued like the others.

    """

    def __init__(
        self,
        pool: HostPool,
        kv_caches: Any,
        blocks_per_chunk: int,
        *,
        slot_offset: int = 0,
        slot_bytes: int | None = None,
        result_type: Callable[..., Any] = TransferResult,
    ) -> None:
        if isinstance(blocks_per_chunk, bool) or not isinstance(blocks_per_chunk, int):
            raise InvalidArgumentError("blocks_per_chunk must be an int")
        if blocks_per_chunk < 1 or slot_offset < 0:
            raise InvalidArgumentError("blocks_per_chunk must be >= 1 and slot_offset >= 0")
        chunk_bytes = pool.chunk_bytes
        slot = chunk_bytes - slot_offset if slot_bytes is None else slot_bytes
        if slot_offset + slot > chunk_bytes:
            raise InvalidArgumentError(
                f"a {slot}-byte slot at {slot_offset} does not fit in a {chunk_bytes}-byte chunk"
            )
        self._pool = pool
        self._bpc = blocks_per_chunk
        self._tensors = _tensors(kv_caches, blocks_per_chunk, slot_offset, slot)
        self._groups = _group_tensors(kv_caches, self._tensors)
        self._result_type = result_type
        self._pool_ids = itertools.count()
        # Guards the three tables below; never held while waiting on the pool.
        self._lock = threading.Lock()
        self._jobs: dict[int, _Job] = {}
        self._owner: dict[int, int] = {}  # pool job id -> job id
        self._done: list[int] = []  # finished jobs not yet reported, in finishing order

    @classmethod
    def from_spec(cls, spec: Any, kv_caches: Any, **kwargs: Any) -> HostPoolWorker:
        """The worker of a vLLM ``CPUOffloadingSpec``, over a pool sized as vLLM sizes its own.

        The pool has the spec's ``num_chunks`` chunks of ``kv_bytes_per_chunk`` bytes (page
        aligned, a slot per worker); this worker's slot is the one vLLM's would use. With more
        than one worker the pool is shared under ``/dev/shm``, named after the engine id.
        """
        parallel = spec.config.parallel
        if spec.num_chunks < 1:
            raise InvalidArgumentError(
                "cpu_bytes_to_use holds no chunk; the host pool needs at least one"
            )
        shared = None
        if parallel.world_size > 1:
            shared = _shared_name(str(spec.config.engine_id))
        pool = HostPool(
            spec.num_chunks, spec.kv_bytes_per_chunk, shared_name=shared, register_cuda=False
        )
        slot = spec.cpu_page_size_per_worker
        try:
            return cls(
                pool,
                kv_caches,
                spec.blocks_per_chunk,
                slot_offset=0 if spec.replicated_layout else parallel.rank * slot,
                slot_bytes=slot,
                **kwargs,
            )
        except BaseException:
            pool.close()
            raise

    @property
    def pool(self) -> HostPool:
        """The host pool behind the chunks."""
        return self._pool

    # -- the OffloadingWorker API ------------------------------------------------------------

    def submit_store(self, job_id: int, src_spec: Any, dst_spec: Any) -> bool:
        """Queue the copy of the device blocks of ``src_spec`` into the chunks of ``dst_spec``."""
        return self._submit(job_id, src_spec, dst_spec, store=True)

    def submit_load(
        self, job_id: int, src_spec: Any, dst_spec: Any, expedited: bool = False
    ) -> bool:
        """Queue the copy of the chunks of ``src_spec`` into the device blocks of ``dst_spec``."""
        return self._submit(job_id, dst_spec, src_spec, store=False)

    def get_finished(self) -> list[Any]:
        """The jobs finished since the last call, each reported once."""
        finished = self._pool.get_finished()
        with self._lock:
            for pool_id, ok in finished:
                job_id = self._owner.pop(pool_id, None)
                if job_id is None:
                    continue  # a copy of a job abandoned while being queued: not reported
                job = self._jobs[job_id]
                job.pending.discard(pool_id)
                job.success = job.success and ok
                if not job.pending:
                    self._done.append(job_id)
            done, self._done = self._done, []
            jobs = [(job_id, self._jobs.pop(job_id)) for job_id in done]
        return [
            self._result_type(
                job_id=job_id, success=job.success, transfer_size=job.size, transfer_time=None
            )
            for job_id, job in jobs
        ]

    def wait(self, job_ids: Iterable[int]) -> None:
        """Block until the given jobs have finished (unknown ids are ignored)."""
        with self._lock:
            pending = [p for j in job_ids if j in self._jobs for p in self._jobs[j].pending]
        if pending:
            self._pool.wait(pending)

    def shutdown(self) -> None:
        """Wait for every queued copy, then close the pool; idempotent."""
        self._pool.close()

    # -- planning ----------------------------------------------------------------------------

    def _submit(self, job_id: int, device_spec: Any, host_spec: Any, *, store: bool) -> bool:
        if isinstance(job_id, bool) or not isinstance(job_id, (int, np.integer)):
            raise InvalidArgumentError(f"job_id must be an int, got {type(job_id).__name__}")
        job_id = int(job_id)
        copies = self._plan(device_spec, host_spec, store)
        size = sum(self._tensors[t].page_bytes * len(blocks) for (t, _), (blocks, _) in copies)
        with self._lock:
            # Drawn under the lock: with the GIL off (free-threaded CPython) an itertools.count
            # shared by threads can hand two of them the same number.
            pool_ids = [next(self._pool_ids) for _ in copies]
            if job_id in self._jobs:
                raise InvalidArgumentError(f"job id {job_id} is already in flight")
            # Every copy is registered before the first is queued, so a job cannot look
            # finished while some of its copies are still to be queued.
            self._jobs[job_id] = _Job(size, set(pool_ids))
            self._owner.update(dict.fromkeys(pool_ids, job_id))
            if not copies:
                self._done.append(job_id)
        submit = self._pool.submit_store if store else self._pool.submit_load
        for i, (pool_id, ((t, j), (blocks, chunks))) in enumerate(
            zip(pool_ids, copies, strict=True)
        ):
            tensor = self._tensors[t]
            try:
                submit(
                    pool_id,
                    tensor.buffer,
                    blocks,
                    chunks,
                    block_bytes=tensor.page_bytes,
                    chunk_offset=tensor.chunk_offset + j * tensor.page_bytes,
                )
            except Exception as e:
                self._abandon(job_id, pool_ids, queued=pool_ids[:i])
                if i == 0 or not isinstance(e, KVOffloadError):
                    raise  # nothing was queued (a closed pool, say): refused as a whole
                # Part of the job may have run (only a pool closed meanwhile gets here): report
                # it as not submitted, which vLLM's connector records as a failed job.
                return False
        return True

    def _abandon(self, job_id: int, pool_ids: list[int], queued: list[int]) -> None:
        with self._lock:
            self._jobs.pop(job_id, None)
            for pool_id in pool_ids:
                self._owner.pop(pool_id, None)  # get_finished drops their results
        for pool_id in queued:
            self._pool.cancel(pool_id)
        self._pool.wait(queued)

    def _plan(
        self, device_spec: Any, host_spec: Any, store: bool
    ) -> list[tuple[tuple[int, int], tuple[Ids, Ids]]]:
        """The pool jobs of one transfer: ``(tensor, page in chunk) -> (blocks, chunks)``."""
        device = _ids("device block", _attr(device_spec, "block_ids", "device"))
        chunks = _ids("chunk", _attr(host_spec, "block_ids", "host"))
        sizes = _int_list("group_sizes", _attr(device_spec, "group_sizes", "device"))
        starts = _int_list("block_indices", _attr(device_spec, "block_indices", "device"))
        if not len(sizes) == len(starts) == len(self._groups):
            raise InvalidArgumentError(
                f"{len(sizes)} group sizes and {len(starts)} block indices for "
                f"{len(self._groups)} KV-cache groups"
            )
        if min(sizes, default=0) < 0 or sum(sizes) != device.size:
            raise InvalidArgumentError(f"group sizes {sizes} do not add up to {device.size} blocks")
        _check_range("chunk", chunks, self._pool.num_chunks)
        bpc = self._bpc
        parts: dict[tuple[int, int], list[tuple[Ids, Ids]]] = defaultdict(list)
        dev_off = chunk_off = 0
        for g, (n, start) in enumerate(zip(sizes, starts, strict=True)):
            if n == 0:
                continue  # an empty group takes no chunk
            # The group's blocks fill its chunks from page `start % bpc` of the first one.
            pos = start % bpc + np.arange(n)
            count = -(-(int(pos[-1]) + 1) // bpc)
            if chunk_off + count > chunks.size:
                raise InvalidArgumentError(f"{chunks.size} chunk ids are too few for group {g}")
            blocks = device[dev_off : dev_off + n]
            group_chunks = chunks[chunk_off + pos // bpc]
            page = pos % bpc
            for t in self._groups[g]:
                _check_range(f"device block (tensor {t})", blocks, self._tensors[t].num_blocks)
                for j in range(bpc):
                    mask = page == j
                    if mask.any():
                        parts[(t, j)].append((blocks[mask], group_chunks[mask]))
            dev_off += n
            chunk_off += count
        if chunk_off != chunks.size:
            raise InvalidArgumentError(f"{chunks.size} chunk ids for {chunk_off} chunks")
        copies = [
            (key, (np.concatenate([b for b, _ in p]), np.concatenate([c for _, c in p])))
            for key, p in parts.items()
        ]
        _check_destinations(copies, bpc, store)
        return copies


def _check_destinations(
    copies: Collection[tuple[tuple[int, int], tuple[Ids, Ids]]], bpc: int, store: bool
) -> None:
    """Refuse a job that would write the same bytes twice (its copies would race)."""
    per_tensor: dict[int, list[Ids]] = defaultdict(list)
    for (t, j), (blocks, chunks) in copies:
        per_tensor[t].append(chunks * bpc + j if store else blocks)
    for t, dests in per_tensor.items():
        all_dests = np.concatenate(dests)
        if np.unique(all_dests).size != all_dests.size:
            what = "chunk page" if store else "device block"
            raise InvalidArgumentError(f"a {what} of tensor {t} is a destination twice")


def _shared_name(engine_id: str) -> str:
    """The shared pool's name for ``engine_id``: ``vllm-<engine_id>``, made a valid name.

    Characters a pool name cannot hold become ``_``; where any did (or the id is long), a hash
    of the exact id is appended, so that engines whose ids differ only there share nothing.
    """
    readable = re.sub(r"[^A-Za-z0-9_.-]", "_", engine_id)
    if readable == engine_id and len(engine_id) <= 150:
        return "vllm-" + engine_id
    digest = hashlib.blake2b(engine_id.encode("utf-8", "surrogatepass"), digest_size=8)
    return f"vllm-{readable[:150]}-{digest.hexdigest()}"
