"""kvoffload's HostPool as vLLM 0.33.0's worker-side CPU buffer (``"host_pool": "kvoffload"``).

Against vLLM's real ``kv_offload`` modules (``tools/vllm_oracle.py``): the spec built by vLLM's
``OffloadingSpecFactory`` hands out ``KVOffloadHostPoolWorker`` (an ``OffloadingWorker``) over a
pool sized as vLLM sizes its buffer; blocks of numpy "device" caches go into chunks and back
bit-identical, and land exactly where vLLM's own address arithmetic (``compute_sub_block_ptrs``
through the handler's ``_fill_direct_ops``) puts them; bad jobs raise before a byte moves;
failures come back as vLLM's ``TransferResult``; many jobs run at once; kvoffload's manager in
vLLM types drives the worker end to end. The device side is host memory: no GPU is involved.
"""

from __future__ import annotations

import ctypes
import hashlib
import importlib
import random
import sys
import threading
import types
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _vllm import OURS, make_spec, offloading_config
from kvoffload import BlockIndexError, HostPool, InvalidArgumentError, PoolClosedError
from kvoffload.integrations.vllm_worker import HostPoolWorker, TransferResult

PAGE = 4096
HOST_POOL = {**OURS, "host_pool": "kvoffload"}


# --- building specs, caches and specs of transfers ---


def worker_spec(
    oracle: Any,
    num_chunks: int,
    pages: tuple[int, ...],
    bpc: int,
    *,
    rank: int = 0,
    world_size: int = 1,
    engine_id: str = "engine-0",
    extra: dict[str, Any] | None = None,
) -> Any:
    """The spec vLLM builds for a worker whose KV-cache tensors have ``pages``-byte blocks."""
    per_block = sum(pages)
    chunk = -(-per_block * bpc * world_size // PAGE) * PAGE
    config = offloading_config(
        oracle, num_chunks, {**HOST_POOL, "cpu_bytes_to_use": num_chunks * chunk, **(extra or {})}
    )
    config = replace(
        config,
        worker_kv_bytes_per_block=per_block,
        engine_id=engine_id,
        cache=replace(config.cache, blocks_per_chunk=bpc),
        parallel=replace(config.parallel, rank=rank, world_size=world_size),
    )
    return oracle.factory.OffloadingSpecFactory.create_spec(config)


def device_caches(
    base: Any, pages: tuple[int, ...], groups: list[list[int]], num_blocks: int, seed: int
) -> tuple[Any, list[np.ndarray[Any, Any]]]:
    """vLLM's ``CanonicalKVCaches`` over random numpy tensors (float16, num_blocks leading)."""
    rng = np.random.default_rng(seed)
    arrays = [
        rng.integers(0, 256, (num_blocks, page), dtype=np.uint8).view(np.float16) for page in pages
    ]
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(a, p) for a, p in zip(arrays, pages, strict=True)],
        group_data_refs=[[base.CanonicalKVCacheRef(t, pages[t]) for t in g] for g in groups],
    )
    return caches, arrays


def gpu(base: Any, blocks: list[list[int]], starts: list[int]) -> Any:
    """vLLM's ``GPULoadStoreSpec``: per group, its device blocks and its first block index."""
    flat = [b for group in blocks for b in group]
    return base.GPULoadStoreSpec(flat, [len(g) for g in blocks], starts)


def cpu(oracle: Any, chunks: list[int]) -> Any:
    return oracle.manager_module.CPULoadStoreSpec(chunks)


def result(worker: Any, job_id: int) -> Any:
    worker.wait({job_id})
    (done,) = worker.get_finished()
    assert done.job_id == job_id
    return done


@pytest.fixture
def base(oracle: Any) -> Any:
    return oracle.base


# --- importing and wiring ---


def test_default_worker_is_vllms(oracle: Any, vllm_mod: Any) -> None:
    for extra in (OURS, {**OURS, "host_pool": "vllm"}):
        spec = make_spec(oracle, 4, extra)
        assert spec.host_pool == "vllm"
        # vLLM's own get_worker runs, and without a GPU it refuses to start.
        with pytest.raises(Exception, match="only supported on CUDA-alike"):
            spec.get_worker(None)


def test_unknown_host_pool_is_refused(oracle: Any, vllm_mod: Any) -> None:
    config = offloading_config(oracle, 4, {**OURS, "host_pool": "cuda"})
    with pytest.raises(InvalidArgumentError, match="host_pool must be one of"):
        oracle.factory.OffloadingSpecFactory.create_spec(config)


def test_spec_builds_a_host_pool_worker_sized_like_vllms_buffer(oracle: Any, base: Any) -> None:
    pages = (3 * 512, 1024)  # 2,560 bytes a block: chunks of 2 blocks round up to 8,192 bytes
    spec = worker_spec(oracle, 5, pages, bpc=2)
    theirs = worker_spec(oracle, 5, pages, bpc=2, extra={"spec_name": "CPUOffloadingSpec"})
    assert type(theirs).__name__ == "CPUOffloadingSpec"
    caches, _ = device_caches(base, pages, [[0, 1]], 6, seed=1)
    worker = spec.get_worker(caches)
    try:
        assert worker is spec.get_worker(caches)
        assert type(worker).__name__ == "KVOffloadHostPoolWorker"
        assert isinstance(worker, base.OffloadingWorker)
        pool = worker.pool
        assert (pool.num_chunks, pool.chunk_bytes) == (theirs.num_chunks, theirs.kv_bytes_per_chunk)
        assert (pool.num_chunks, pool.chunk_bytes) == (5, 8192)
        assert pool.shared_path is None  # one worker: a private pool
        assert pool.pinned == "pageable"  # no CUDA registration on this path
    finally:
        worker.shutdown()
    assert pool.closed


class _Cuda:
    type = "cuda"

    def __str__(self) -> str:
        return "cuda:0"


class _FakeCudaTensor:
    """What ``as_byte_buffer`` reads of a torch tensor on a GPU (no torch is installed here)."""

    device = _Cuda()


@pytest.mark.parametrize("tensor", ["cuda", "opaque"])
def test_a_gpu_tensor_is_refused_with_the_reason(
    oracle: Any, base: Any, monkeypatch: pytest.MonkeyPatch, tensor: str
) -> None:
    monkeypatch.setitem(sys.modules, "torch", types.SimpleNamespace(Tensor=_FakeCudaTensor))
    spec = worker_spec(oracle, 2, (PAGE,), bpc=1)
    caches = base.CanonicalKVCaches(
        tensors=[
            base.CanonicalKVCacheTensor(_FakeCudaTensor() if tensor == "cuda" else object(), PAGE)
        ],
        group_data_refs=[[base.CanonicalKVCacheRef(0, PAGE)]],
    )
    why = (
        "a tensor on cuda:0 is not host memory"
        if tensor == "cuda"
        else "expected a C-contiguous buffer"
    )
    with pytest.raises(InvalidArgumentError, match=why) as info:
        spec.get_worker(caches)
    assert "copies to and from a GPU are not built" in str(info.value)


def test_a_pool_of_no_chunk_is_refused(oracle: Any, base: Any) -> None:
    spec = worker_spec(oracle, 2, (PAGE,), bpc=1, extra={"cpu_bytes_to_use": PAGE - 1})
    assert spec.num_chunks == 0  # vLLM sizes its buffer to nothing; the host pool refuses
    caches, _ = device_caches(base, (PAGE,), [[0]], 4, seed=14)
    with pytest.raises(InvalidArgumentError, match="holds no chunk"):
        spec.get_worker(caches)


def test_pages_larger_than_the_slot_are_refused(oracle: Any, base: Any) -> None:
    spec = worker_spec(oracle, 2, (PAGE,), bpc=1)
    caches, _ = device_caches(base, (PAGE, PAGE), [[0, 1]], 4, seed=2)  # twice the spec's bytes
    with pytest.raises(InvalidArgumentError, match="more than the worker's 4096-byte slot"):
        spec.get_worker(caches)


# --- bytes: round trips, and vLLM's own placement ---

# Two tensors (one per KV-cache group), 2 blocks per chunk, groups starting mid-chunk.
PAGES = (1024, 3072)
GROUPS = [[0], [1]]


def test_store_then_load_into_other_blocks_is_bit_identical(oracle: Any, base: Any) -> None:
    spec = worker_spec(oracle, 8, PAGES, bpc=2)
    caches, arrays = device_caches(base, PAGES, GROUPS, 12, seed=3)
    original = [a.copy() for a in arrays]
    worker = spec.get_worker(caches)
    # Group 0: blocks 1, 4, 2 from page 1 of chunk 5 on; group 1: blocks 7, 8 from page 0 of 0.
    store = gpu(base, [[1, 4, 2], [7, 8]], [3, 0])
    assert worker.submit_store(1, store, cpu(oracle, [5, 2, 0]))
    done = result(worker, 1)
    assert type(done) is base.TransferResult
    assert done.success
    assert done.transfer_size == 3 * 1024 + 2 * 3072
    assert done.transfer_time is None
    for a in arrays:
        a[...] = 0
    assert worker.submit_load(2, cpu(oracle, [5, 2, 0]), gpu(base, [[9, 0, 3], [11, 6]], [3, 0]))
    assert result(worker, 2).success
    for a, o, moved in zip(
        arrays, original, ([(1, 9), (4, 0), (2, 3)], [(7, 11), (8, 6)]), strict=True
    ):
        for src, dst in moved:
            assert a[dst].tobytes() == o[src].tobytes()
    untouched = [b for b in range(12) if b not in (9, 0, 3)]
    assert not arrays[0][untouched].view(np.uint8).any()
    worker.shutdown()


@dataclass
class _TorchLike:
    """What vLLM's ``compute_sub_block_ptrs`` reads of a tensor, over a 2-D uint8 array."""

    arr: np.ndarray[Any, Any]

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.arr.shape)

    def data_ptr(self) -> int:
        return int(self.arr.ctypes.data)

    def stride(self, dim: int) -> int:
        return int(self.arr.strides[dim])


def vllm_copies(
    refs: Any, bpc: int, src: list[Any], dst: list[Any], gpu_spec: Any, cpu_spec: Any, store: bool
) -> None:
    """Run one transfer with vLLM's own descriptor code (direct layout), copying with memmove."""
    handler = importlib.import_module("vllm.v1.kv_offload.cpu.gpu_worker")
    src_ids, dst_ids = gpu_spec.block_ids, cpu_spec.block_ids
    if not store:
        src_ids, dst_ids = dst_ids, src_ids
    fake = types.SimpleNamespace(
        layer_refs_per_group=refs,
        src_blocks_per_chunk=1 if store else bpc,
        dst_blocks_per_chunk=bpc if store else 1,
        src_tensors=[_TorchLike(a) for a in src],
        dst_tensors=[_TorchLike(a) for a in dst],
    )
    n_ops = sum(n * len(r) for n, r in zip(gpu_spec.group_sizes, refs, strict=True))
    ptr_src, ptr_dst, sizes = (np.zeros(n_ops, np.int64) for _ in range(3))
    op = s_off = d_off = 0
    for g, (n, start) in enumerate(zip(gpu_spec.group_sizes, gpu_spec.block_indices, strict=True)):
        if n == 0:
            continue
        s_skip, d_skip = start % fake.src_blocks_per_chunk, start % fake.dst_blocks_per_chunk
        s_n = -(-(n + s_skip) // fake.src_blocks_per_chunk)
        d_n = -(-(n + d_skip) // fake.dst_blocks_per_chunk)
        op, _ = handler.SingleDirectionOffloadingHandler._fill_direct_ops(
            fake, g, src_ids[s_off : s_off + s_n], dst_ids[d_off : d_off + d_n], n,
            s_skip, d_skip, ptr_src, ptr_dst, sizes, op,
        )  # fmt: skip
        s_off, d_off = s_off + s_n, d_off + d_n
    for s, d, size in zip(ptr_src[:op], ptr_dst[:op], sizes[:op], strict=True):
        ctypes.memmove(int(d), int(s), int(size))


def test_chunks_hold_what_vllms_worker_would_write(oracle: Any, base: Any) -> None:
    # vLLM's host buffer in its shared-region layout: a row per chunk, each tensor's pages at
    # the tensor's offset in the row. kvoffload's pool must end up byte for byte the same, and
    # loads from it must write the same device bytes as vLLM's loads from its buffer.
    pages, bpc, num_chunks = (1024, 512, 2560), 3, 6
    groups = [[0, 1], [2], [0, 1]]  # groups 0 and 2 share tensors 0 and 1 (distinct blocks)
    spec = worker_spec(oracle, num_chunks, pages, bpc)
    caches, arrays = device_caches(base, pages, groups, 20, seed=4)
    worker = spec.get_worker(caches)
    theirs = np.zeros((num_chunks, spec.kv_bytes_per_chunk), np.uint8)
    offsets = np.cumsum((0, *pages))[:-1] * bpc
    host_views = [theirs[:, o : o + p * bpc] for o, p in zip(offsets, pages, strict=True)]
    device = [a.view(np.uint8).reshape(len(a), -1) for a in arrays]
    refs = caches.group_data_refs
    rng = random.Random(5)
    chunk_pool = list(range(num_chunks))
    rng.shuffle(chunk_pool)
    blocks_left = list(range(20))
    rng.shuffle(blocks_left)
    gpu_blocks, starts, chunks = [], [], []
    for n, start in ((4, 2), (2, 5), (3, 0)):  # 2 + 1 + 1 chunks
        gpu_blocks.append([blocks_left.pop() for _ in range(n)])
        starts.append(start)
        chunks += [chunk_pool.pop() for _ in range(-(-(n + start % bpc) // bpc))]
    store = (gpu(base, gpu_blocks, starts), cpu(oracle, chunks))
    assert worker.submit_store(1, *store)
    vllm_copies(refs, bpc, device, host_views, *store, store=True)
    assert result(worker, 1).success
    assert (worker.pool.view() == theirs).all()
    assert worker.pool.view()[chunks].any()

    # Load the same chunks into other blocks, from both buffers, into copies of the devices.
    targets = [[blocks_left.pop() for _ in g] for g in gpu_blocks]
    load = (gpu(base, targets, starts), cpu(oracle, chunks))
    stored = [d.copy() for d in device]
    theirs_device = [d.copy() for d in device]
    assert worker.submit_load(2, load[1], load[0])
    vllm_copies(refs, bpc, host_views, theirs_device, *load, store=False)
    assert result(worker, 2).success
    for d, t in zip(device, theirs_device, strict=True):
        assert (d == t).all()
    for g, tensors in enumerate(groups):
        for t in tensors:
            assert (device[t][targets[g]] == stored[t][gpu_blocks[g]]).all()
    worker.shutdown()


# --- refusals: checked before a byte moves ---


@pytest.mark.parametrize(
    ("store", "blocks", "starts", "chunks", "error", "match"),
    [
        (True, [[0, 1], [2]], [0, 0], [0, 8], BlockIndexError, "chunk id 8"),
        (True, [[0, 1], [2]], [0, 0], [0, -1], BlockIndexError, "chunk id -1"),
        (True, [[0, 12], [2]], [0, 0], [0, 1], BlockIndexError, "device block .* id 12"),
        (False, [[0, 1], [-3]], [0, 0], [0, 1], BlockIndexError, "device block .* id -3"),
        (True, [[0, 1], [2]], [0, 0], [0], InvalidArgumentError, "too few for group 1"),
        (True, [[0, 1], [2]], [0, 0], [0, 1, 2], InvalidArgumentError, "3 chunk ids for 2"),
        (True, [[0, 1, 3], [2]], [1, 0], [0, 1], InvalidArgumentError, "too few for group 1"),
        (True, [[0, 1, 2, 3], [4]], [0, 0], [4, 4, 5], InvalidArgumentError, "destination twice"),
        (False, [[0, 0], [2]], [0, 0], [4, 5], InvalidArgumentError, "destination twice"),
        (True, [[0, 1]], [0], [4], InvalidArgumentError, "1 group sizes and 1 block indices for 2"),
    ],
)  # fmt: skip
def test_a_bad_job_raises_and_moves_nothing(
    oracle: Any,
    base: Any,
    store: bool,
    blocks: list[list[int]],
    starts: list[int],
    chunks: list[int],
    error: type[Exception],
    match: str,
) -> None:
    spec = worker_spec(oracle, 8, PAGES, bpc=2)
    caches, arrays = device_caches(base, PAGES, GROUPS, 12, seed=6)
    before = [a.copy() for a in arrays]
    worker = spec.get_worker(caches)
    worker.pool.view()[:] = 0x5A
    call: Callable[[], object]
    if store:
        call = lambda: worker.submit_store(3, gpu(base, blocks, starts), cpu(oracle, chunks))  # noqa: E731
    else:
        call = lambda: worker.submit_load(3, cpu(oracle, chunks), gpu(base, blocks, starts))  # noqa: E731
    with pytest.raises(error, match=match):
        call()
    assert worker.pool.stats().jobs_in_flight == 0
    worker.wait({3})
    assert worker.get_finished() == []
    assert (worker.pool.view() == 0x5A).all()
    for a, b in zip(arrays, before, strict=True):
        assert a.tobytes() == b.tobytes()
    # The id was not taken: the same job id, well formed, goes through.
    assert worker.submit_store(3, gpu(base, [[0, 1], [2]], [0, 0]), cpu(oracle, [0, 1]))
    assert result(worker, 3).success
    worker.shutdown()


def test_a_job_id_in_flight_is_refused(oracle: Any, base: Any) -> None:
    spec = worker_spec(oracle, 8, PAGES, bpc=2)
    caches, _ = device_caches(base, PAGES, GROUPS, 12, seed=7)
    worker = spec.get_worker(caches)
    job = (gpu(base, [[0], [1]], [0, 0]), cpu(oracle, [0, 1]))
    assert worker.submit_store(1, *job)
    with pytest.raises(InvalidArgumentError, match="job id 1 is already in flight"):
        worker.submit_store(1, *job)
    assert result(worker, 1).success
    assert worker.submit_store(1, *job)  # reported, so the id is free again
    assert result(worker, 1).success
    worker.shutdown()


# --- failures come back as vLLM's TransferResult ---


class _FlakyPool(HostPool):
    """A pool whose copies with the ids in ``fail`` report failure (as a cancelled job does)."""

    fail: set[int]

    def get_finished(self) -> list[tuple[int, bool]]:
        return [(j, ok and j not in self.fail) for j, ok in super().get_finished()]


def test_a_failed_copy_fails_its_job_once(oracle: Any, base: Any, vllm_mod: Any) -> None:
    spec = worker_spec(oracle, 8, PAGES, bpc=2)
    caches, _ = device_caches(base, PAGES, GROUPS, 12, seed=8)
    pool = _FlakyPool(spec.num_chunks, spec.kv_bytes_per_chunk, register_cuda=False)
    worker = vllm_mod.KVOffloadHostPoolWorker(pool, caches, 2)
    # Job 1 is split into 3 pool copies (tensor 0 pages 0 and 1, tensor 1 page 0): fail one.
    pool.fail = {1}
    assert worker.submit_store(1, gpu(base, [[0, 1], [2]], [0, 0]), cpu(oracle, [0, 1]))
    assert worker.submit_store(2, gpu(base, [[3], [4]], [0, 0]), cpu(oracle, [2, 3]))
    worker.wait({1, 2})
    got = {r.job_id: r for r in worker.get_finished()}
    assert set(got) == {1, 2}
    assert all(type(r) is base.TransferResult for r in got.values())
    assert not got[1].success
    assert got[2].success
    assert worker.get_finished() == []
    worker.shutdown()


def test_submitting_after_shutdown_is_refused(oracle: Any, base: Any) -> None:
    spec = worker_spec(oracle, 8, PAGES, bpc=2)
    caches, _ = device_caches(base, PAGES, GROUPS, 12, seed=9)
    worker = spec.get_worker(caches)
    worker.shutdown()
    worker.shutdown()  # idempotent
    with pytest.raises(PoolClosedError):
        worker.submit_store(1, gpu(base, [[0], [1]], [0, 0]), cpu(oracle, [0, 1]))
    assert worker.get_finished() == []


class _ClosingPool(HostPool):
    """A pool closed by another thread right after the first copy of a job is queued."""

    def submit_store(self, *args: Any, **kwargs: Any) -> None:
        super().submit_store(*args, **kwargs)
        self.close()


def test_a_pool_closed_mid_job_reports_not_submitted(oracle: Any, base: Any, vllm_mod: Any) -> None:
    spec = worker_spec(oracle, 8, PAGES, bpc=2)
    caches, _ = device_caches(base, PAGES, GROUPS, 12, seed=12)
    pool = _ClosingPool(spec.num_chunks, spec.kv_bytes_per_chunk, register_cuda=False)
    worker = vllm_mod.KVOffloadHostPoolWorker(pool, caches, 2)
    # Three copies; the pool closes after the first: vLLM's connector records False as failed.
    assert worker.submit_store(1, gpu(base, [[0, 1], [2]], [0, 0]), cpu(oracle, [0, 1])) is False
    worker.wait({1})
    assert worker.get_finished() == []


def test_a_read_only_cache_is_refused(oracle: Any, base: Any) -> None:
    spec = worker_spec(oracle, 2, (PAGE,), bpc=1)
    caches, arrays = device_caches(base, (PAGE,), [[0]], 4, seed=13)
    arrays[0].flags.writeable = False
    with pytest.raises(InvalidArgumentError, match="read-only"):
        spec.get_worker(caches)


def test_cancelled_copies_fail_their_job() -> None:
    # Without vLLM: kvoffload's own TransferResult and any objects with the specs' attributes.
    # Job 2 waits behind 64 MiB of copies on the only worker, so the cancel almost always finds
    # its copy unstarted; a try that lost that race is repeated.
    device = np.random.default_rng(10).integers(0, 256, (72, 1 << 20), dtype=np.uint8)
    caches = types.SimpleNamespace(
        tensors=[types.SimpleNamespace(tensor=device, page_size_bytes=1 << 20)],
        group_data_refs=[[types.SimpleNamespace(tensor_idx=0, page_size_bytes=1 << 20)]],
    )

    def spec(ids: list[int]) -> Any:
        return types.SimpleNamespace(block_ids=ids, group_sizes=[len(ids)], block_indices=[0])

    for _ in range(5):
        pool = HostPool(80, 1 << 20, num_threads=1, register_cuda=False)
        worker = HostPoolWorker(pool, caches, 1)
        assert worker.submit_store(1, spec(list(range(64))), spec(list(range(64))))  # busy
        assert worker.submit_store(2, spec([70]), spec([79]))
        cancelled = pool.cancel(1)  # job 2's only copy is pool job 1 (job 1 took pool job 0)
        worker.wait([1, 2])
        got = {r.job_id: r for r in worker.get_finished()}
        stored = pool.chunk(79).copy()
        worker.shutdown()
        assert got[1] == TransferResult(1, True, 64 << 20, None)
        assert got[2].success is not cancelled
        if cancelled:
            assert not stored.any()
            return
    pytest.fail("job 2's copy had always started before its cancel, in five tries")


# --- many jobs at once ---


def test_many_jobs_in_flight_from_several_threads(oracle: Any, base: Any) -> None:
    n_threads, per_thread = 4, 6
    n = n_threads * per_thread  # chunks; device blocks [0, 2n) are stored, [2n, 4n) loaded into
    spec = worker_spec(oracle, n, PAGES, bpc=2)
    caches, arrays = device_caches(base, PAGES, GROUPS, 4 * n, seed=11)
    for a in arrays:
        a[2 * n :] = 0
    original = [a.copy() for a in arrays]
    worker = spec.get_worker(caches)
    errors: list[BaseException] = []
    seen: dict[int, Any] = {}
    lock = threading.Lock()

    def collect() -> None:
        for r in worker.get_finished():
            with lock:
                assert r.job_id not in seen, "a job reported twice"
                seen[r.job_id] = r

    def run(t: int, load: bool) -> None:
        try:
            jobs = []
            for i in range(per_thread):
                c = t * per_thread + i
                b = 2 * c + (2 * n if load else 0)
                # Group 0: blocks b, b+1 -> pages 0, 1 of chunk c; group 1: block b -> page 0.
                device, host = gpu(base, [[b, b + 1], [b]], [0, 0]), cpu(oracle, [c, c])
                job = 1000 * load + 100 * t + i
                if load:
                    assert worker.submit_load(job, host, device)
                else:
                    assert worker.submit_store(job, device, host)
                jobs.append(job)
            worker.wait(set(jobs[: per_thread // 2]))
            collect()
            worker.wait(set(jobs))
            collect()
        except BaseException as e:
            errors.append(e)

    for load in (False, True):
        threads = [threading.Thread(target=run, args=(t, load)) for t in range(n_threads)]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    collect()
    assert not errors, errors
    assert len(seen) == 2 * n
    assert all(r.success for r in seen.values())
    assert arrays[0][2 * n :].tobytes() == original[0][: 2 * n].tobytes()
    assert arrays[1][2 * n :: 2].tobytes() == original[1][: 2 * n : 2].tobytes()
    worker.shutdown()


# --- several workers: one shared pool, a slot each ---


@pytest.fixture
def engine_id() -> Iterator[str]:
    name = f"test-{uuid.uuid4().hex[:12]}"
    yield name
    assert not Path(f"/dev/shm/kvoffload.vllm-{name}").exists()


@pytest.mark.skipif(not Path("/dev/shm").is_dir(), reason="no /dev/shm")
def test_two_workers_share_the_pool_a_slot_each(oracle: Any, base: Any, engine_id: str) -> None:
    pages, bpc = (1024, 2048), 2
    specs = [
        worker_spec(oracle, 4, pages, bpc, rank=r, world_size=2, engine_id=engine_id)
        for r in (0, 1)
    ]
    slot = specs[0].cpu_page_size_per_worker
    assert slot == sum(pages) * bpc
    assert specs[0].kv_bytes_per_chunk == 3 * PAGE  # two slots of 6 KiB, page aligned
    made = [device_caches(base, pages, [[0, 1]], 8, seed=20 + r) for r in (0, 1)]
    workers = [spec.get_worker(caches) for spec, (caches, _) in zip(specs, made, strict=True)]
    try:
        assert workers[0].pool.shared_path == workers[1].pool.shared_path is not None
        for r, worker in enumerate(workers):
            assert worker.submit_store(r, gpu(base, [[2, 3, 5]], [0]), cpu(oracle, [1, 3]))
            assert result(worker, r).success
        view = workers[0].pool.view()  # either pool object sees both slots
        for r, (_, arrays) in enumerate(made):
            row = view[1, r * slot : (r + 1) * slot]
            assert row[: 2 * pages[0]].tobytes() == arrays[0][[2, 3]].tobytes()
            assert row[2 * pages[0] :].tobytes() == arrays[1][[2, 3]].tobytes()
            assert view[3, r * slot : r * slot + pages[0]].tobytes() == arrays[0][5].tobytes()
        for r, (worker, (_, arrays)) in enumerate(zip(workers, made, strict=True)):
            assert worker.submit_load(r, cpu(oracle, [1, 3]), gpu(base, [[0, 1, 7]], [0]))
            assert result(worker, r).success
            for a in arrays:
                assert a[[0, 1, 7]].tobytes() == a[[2, 3, 5]].tobytes()
    finally:
        for worker in workers:
            worker.shutdown()


# --- end to end: kvoffload's manager (vLLM's types) and the host-pool worker ---

E2E_PAGES, E2E_BPC, E2E_BLOCKS = (1024, 2048), 2, 32


def page_content(key: bytes, tensor: int, page: int) -> bytes:
    seed = hashlib.blake2b(key + bytes([tensor, page]), digest_size=8).digest()
    rng = np.random.default_rng(int.from_bytes(seed, "little"))
    return rng.integers(0, 256, E2E_PAGES[tensor], dtype=np.uint8).tobytes()


@pytest.mark.parametrize("policy", ["lru", "arc"])
def test_manager_and_worker_end_to_end(oracle: Any, base: Any, vllm_mod: Any, policy: str) -> None:
    # As in vLLM: the scheduler and the worker each build the spec from the same config.
    extra = {"eviction_policy": policy}
    manager = worker_spec(oracle, 12, E2E_PAGES, E2E_BPC, extra=extra).get_manager()
    assert type(manager) is vllm_mod.KVOffloadCPUOffloadingManager
    spec = worker_spec(oracle, 12, E2E_PAGES, E2E_BPC, extra=extra)
    caches, arrays = device_caches(base, E2E_PAGES, [[0, 1]], E2E_BLOCKS, seed=30)
    device = [a.view(np.uint8).reshape(E2E_BLOCKS, -1) for a in arrays]
    worker = spec.get_worker(caches)
    HIT = oracle.manager_module.LookupResult.HIT
    rng = random.Random(31)
    jobs = iter(range(1 << 30))
    counts = {"loaded": 0, "stored": 0, "failed": 0}
    pending: list[tuple[list[bytes], Any, bool]] = []  # stores copied, not yet completed

    def run(submit: Any, *args: Any) -> bool:
        job = next(jobs)
        assert submit(job, *args)
        done = result(worker, job)
        assert type(done) is base.TransferResult
        return bool(done.success)

    for step in range(150):
        chain, length = rng.randrange(8), rng.randint(1, 6)
        keys = [
            hashlib.blake2b(f"{chain}/{i}".encode(), digest_size=32).digest() + bytes(4)
            for i in range(length)
        ]
        ctx = oracle.ReqContext(f"r{step}")
        for i, k in enumerate(keys):
            ctx.set_offload_key_position(k, 32 * (i + 1))
        manager.on_new_request(ctx)
        hits = 0  # looked up one by one, as vLLM's connector does
        while hits < length and manager.lookup(keys[hits], ctx) is HIT:
            hits += 1
        if hits:
            load_spec = manager.prepare_load(keys[:hits], ctx)
            blocks = rng.sample(range(E2E_BLOCKS), hits * E2E_BPC)
            for d in device:
                d[blocks] = 0
            assert run(worker.submit_load, load_spec, gpu(base, [blocks], [0]))
            for i, k in enumerate(keys[:hits]):
                for j in range(E2E_BPC):
                    for t, d in enumerate(device):
                        assert d[blocks[i * E2E_BPC + j]].tobytes() == page_content(k, t, j)
            manager.complete_load(keys[:hits], ctx)
            counts["loaded"] += hits
        out = manager.prepare_store(keys[hits:], ctx)
        if out is not None and out.keys_to_store:
            blocks = rng.sample(range(E2E_BLOCKS), len(out.keys_to_store) * E2E_BPC)
            for i, k in enumerate(out.keys_to_store):
                for j in range(E2E_BPC):
                    for t, d in enumerate(device):
                        d[blocks[i * E2E_BPC + j]] = np.frombuffer(page_content(k, t, j), np.uint8)
            ok = run(worker.submit_store, gpu(base, [blocks], [0]), out.store_spec)
            pending.append((list(out.keys_to_store), ctx, ok and rng.random() > 0.1))
        # Stores complete a step later (others see them pending); some are reported failed, as
        # vLLM's connector does for a failed job: never a HIT afterwards.
        now = pending if rng.random() < 0.5 else pending[:-1]
        pending = pending[len(now) :]
        for stored, sctx, ok in now:
            manager.complete_store(stored, sctx, success=ok)
            counts["stored" if ok else "failed"] += len(stored)
            for k in stored:
                assert (manager.lookup(k, sctx) is HIT) == ok
        manager.on_request_finished(ctx)
        manager.check_invariants()
    assert counts["loaded"] > 50, counts
    assert counts["stored"] > 50, counts
    assert counts["failed"] > 0, counts
    worker.shutdown()


def test_the_slot_must_hold_every_tensors_pages(oracle: Any, base: Any) -> None:
    # Two 1000-byte pages per tensor (2 blocks per chunk), two tensors: 4,000 bytes exactly.
    caches, _ = device_caches(base, (1000, 1000), [[0, 1]], 4, seed=21)
    with HostPool(2, PAGE, register_cuda=False) as pool:
        worker = HostPoolWorker(pool, caches, 2, slot_offset=96, slot_bytes=4000)
        assert worker.pool is pool
        with pytest.raises(InvalidArgumentError, match="take 4000 bytes, more than the worker's"):
            HostPoolWorker(pool, caches, 2, slot_offset=96, slot_bytes=3999)
        with pytest.raises(InvalidArgumentError, match="does not fit in a 4096-byte chunk"):
            HostPoolWorker(pool, caches, 2, slot_offset=97, slot_bytes=4000)


def test_a_layer_page_larger_than_its_tensors_page_is_refused(base: Any) -> None:
    arr = np.zeros((4, 1024), dtype=np.uint8)
    caches = base.CanonicalKVCaches(
        tensors=[base.CanonicalKVCacheTensor(arr, 1024)],
        group_data_refs=[[base.CanonicalKVCacheRef(0, 1024)], [base.CanonicalKVCacheRef(0, 1025)]],
    )
    with (
        HostPool(2, PAGE, register_cuda=False) as pool,
        pytest.raises(InvalidArgumentError, match="group 1: a 1025-byte page in tensor 0"),
    ):
        HostPoolWorker(pool, caches, 1)
