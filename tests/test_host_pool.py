"""HostPool: exact sizes and alignment, zero-copy views and their lifetime, block transfers with
every id and size checked before a byte moves, and the limits (THP settings, available memory,
fork). The pinned state is in test_host_pinned.py."""

from __future__ import annotations

import gc
import mmap
import os
import signal
import sys
import types
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from _helpers import exit_code, fork
from kvoffload import (
    BlockIndexError,
    HostMemoryError,
    HostPool,
    InvalidArgumentError,
    KVOffloadError,
    PoolClosedError,
    _native,
)

PAGE = mmap.PAGESIZE


def owner_of(arr: np.ndarray[Any, Any]) -> object:
    """The first non-array object down the ``.base`` chain."""
    base: object = arr
    while isinstance(base, np.ndarray):
        base = base.base
    return base


# -- sizes and alignment ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_chunks", "chunk_bytes"),
    [(1, 1), (3, 1000), (7, PAGE), (5, 3 * PAGE + 1), (1000, 48)],
)
def test_exact_size_page_aligned(num_chunks: int, chunk_bytes: int) -> None:
    with HostPool(num_chunks, chunk_bytes, register_cuda=False) as pool:
        total = num_chunks * chunk_bytes
        assert pool.nbytes == total
        stats = pool.stats()
        assert stats.mapped_bytes == -(-total // PAGE) * PAGE  # the page, never a power of two
        v = pool.view()
        assert v.shape == (num_chunks, chunk_bytes)
        assert v.dtype == np.uint8
        assert v.nbytes == total
        assert v.ctypes.data % PAGE == 0
        assert v.flags.writeable
        assert v.flags.c_contiguous
        assert not v.any()  # fresh memory is zero
        assert stats.prefault_method in ("madv-populate-write", "touch")
        assert stats.prefault_gb_per_s > 0


def thp_mode(knob: str) -> str:
    try:
        text = Path(f"/sys/kernel/mm/transparent_hugepage/{knob}").read_text()
    except OSError:
        return "unavailable"
    return text.split("[")[1].split("]")[0]


def test_huge_pages_are_aligned_to_2_mib() -> None:
    if thp_mode("enabled") in ("never", "unavailable"):
        with pytest.raises(HostMemoryError, match="huge_pages=True"):
            HostPool(3, 1 << 20, huge_pages=True, register_cuda=False)
        return
    with HostPool(3, 1 << 20, huge_pages=True, register_cuda=False) as pool:
        assert pool.stats().huge_pages
        assert pool.view().ctypes.data % (2 << 20) == 0
        assert pool.stats().mapped_bytes == 3 << 20


def test_huge_pages_the_kernel_would_ignore_are_refused() -> None:
    name = f"thp-{os.getpid()}"
    if thp_mode("shmem_enabled") in ("never", "deny", "unavailable"):
        with pytest.raises(HostMemoryError, match="shmem_enabled"):
            HostPool(2, 4096, huge_pages=True, shared_name=name, register_cuda=False)
    else:
        with HostPool(2, 4096, huge_pages=True, shared_name=name, register_cuda=False) as pool:
            assert pool.stats().huge_pages
    assert not Path(f"/dev/shm/kvoffload.{name}").exists()


@pytest.mark.parametrize(
    "kwargs",
    [
        {"num_chunks": 0, "chunk_bytes": 8},
        {"num_chunks": 8, "chunk_bytes": 0},
        {"num_chunks": -1, "chunk_bytes": 8},
        {"num_chunks": True, "chunk_bytes": 8},
        {"num_chunks": "4", "chunk_bytes": 8},
        {"num_chunks": 2**62, "chunk_bytes": 2**62},
        {"num_chunks": 4, "chunk_bytes": 8, "num_threads": 0},
        {"num_chunks": 4, "chunk_bytes": 8, "register_cuda": "yes"},
        {"num_chunks": 4, "chunk_bytes": 8, "shared_name": "a/b"},
        {"num_chunks": 4, "chunk_bytes": 8, "shared_name": "x", "shared_mode": "maybe"},
        {"num_chunks": 4, "chunk_bytes": 8, "shared_name": "x", "attach_timeout": -1.0},
    ],
)
def test_bad_constructor_arguments(kwargs: dict[str, Any]) -> None:
    with pytest.raises(InvalidArgumentError):
        HostPool(**kwargs)


# -- views and their lifetime ---------------------------------------------------------------------


def test_views_share_memory_and_are_owned() -> None:
    pool = HostPool(4, 2 * 3 * 8 * 2, register_cuda=False)  # float16 [2, 3, 8] per chunk
    whole = pool.view()
    typed = pool.typed_view(np.float16, (2, 3, 8))
    one = pool.chunk(2)
    one_typed = pool.chunk(1, np.float16, (2, 3, 8))
    assert typed.shape == (4, 2, 3, 8)
    assert typed.dtype == np.float16
    assert one.shape == (96,)
    assert one_typed.shape == (2, 3, 8)
    for arr in (whole, typed, one, one_typed):
        assert isinstance(owner_of(arr), _native.HostMemoryOwner)
    typed[3, 1, 2, 7] = 1.5
    assert whole[3].view(np.float16)[1 * 24 + 2 * 8 + 7] == 1.5
    one[0] = 9
    assert whole[2, 0] == 9
    one_typed[0, 0, 0] = -2.0
    assert typed[1, 0, 0, 0] == -2.0
    assert pool.chunk(3, np.float32).shape == (24,)
    pool.close()


def test_view_errors() -> None:
    with HostPool(4, 96, register_cuda=False) as pool:
        with pytest.raises(InvalidArgumentError):
            pool.typed_view(np.float16, (2, 3, 7))
        with pytest.raises(InvalidArgumentError, match="holds Python objects"):
            pool.typed_view(object, (12,))
        with pytest.raises(BlockIndexError):
            pool.chunk(4)
        with pytest.raises(BlockIndexError, match="chunk id -1 is out of range"):
            pool.chunk(-1)  # as in a transfer (it was an InvalidArgumentError)
        with pytest.raises(InvalidArgumentError):
            pool.chunk(1.0)  # type: ignore[arg-type]


def test_a_subarray_dtype_views_as_its_base_over_trailing_dims() -> None:
    """Found by hypothesis: ``("<u2", (2,))`` reached numpy's ``view``, which refuses subarray
    dtypes with a ValueError from outside kvoffload's tree. Laid out as numpy lays out an array
    made with one: the base dtype, the subarray's shape appended."""
    sub = np.dtype(("<u2", (2,)))
    with HostPool(4, 64, register_cuda=False) as pool:
        typed = pool.typed_view(sub, (16,))
        assert typed.shape == (4, 16, 2)
        assert typed.dtype == np.uint16
        # numpy's stubs give zeros() the shape argument's rank, without the subarray's axis.
        assert typed.shape == np.zeros((4, 16), sub).shape  # type: ignore[comparison-overlap]
        one = pool.chunk(1, dtype=sub)
        assert one.shape == (16, 2)
        assert one.dtype == np.uint16
        one[3, 1] = 0xABCD
        assert typed[1, 3, 1] == 0xABCD
        assert pool.view()[1].view(np.uint16)[3 * 2 + 1] == 0xABCD
        with pytest.raises(InvalidArgumentError):
            pool.typed_view(sub, (15,))


@pytest.mark.parametrize("dtype", ["a", b"a", "a4"])
def test_dtypes_numpy_deprecates_are_refused_without_a_warning(dtype: Any) -> None:
    """Found by hypothesis on CPython 3.13t: ``b"a"`` got to numpy, whose DeprecationWarning
    (an exception under warnings-as-errors) came from outside kvoffload's tree."""
    with HostPool(4, 96, register_cuda=False) as pool:
        with pytest.raises(InvalidArgumentError, match="not a numpy dtype"):
            pool.chunk(1, dtype=dtype)
        with pytest.raises(InvalidArgumentError, match="not a numpy dtype"):
            pool.typed_view(dtype, (4,))
        assert pool.chunk(1, dtype="S1").dtype == np.dtype("S1")


@pytest.mark.parametrize("dtype", [",", b",", "f4,,"])
def test_dtype_strings_numpy_cannot_parse_are_refused(dtype: Any) -> None:
    """Found by hypothesis: ``b","`` made numpy's comma-string parser raise SyntaxError, from
    outside kvoffload's tree."""
    with HostPool(4, 96, register_cuda=False) as pool:
        with pytest.raises(InvalidArgumentError, match="not a numpy dtype"):
            pool.chunk(1, dtype=dtype)
        with pytest.raises(InvalidArgumentError, match="not a numpy dtype"):
            pool.typed_view(dtype, (4,))


def test_dropping_the_pool_keeps_a_live_view_valid() -> None:
    pool = HostPool(64, 4096, register_cuda=False)
    view = pool.typed_view(np.uint32, (1024,))
    view[:] = np.arange(64 * 1024, dtype=np.uint32).reshape(64, 1024)
    del pool
    gc.collect()
    junk = [np.ones(1 << 16) for _ in range(64)]  # reuse freed memory, if any was freed
    assert (view.ravel() == np.arange(64 * 1024, dtype=np.uint32)).all()
    view[5, 5] = 7  # still writable, still ours
    assert view[5, 5] == 7
    del junk


def test_close_defers_the_unmap_until_the_last_view_is_gone() -> None:
    pool = HostPool(8, 1024, register_cuda=False)
    view = pool.chunk(7)
    view[:] = 0x5A
    pool.close()
    pool.close()  # idempotent
    assert pool.closed
    assert not pool.stats().released  # the view still holds the memory
    assert (view == 0x5A).all()
    with pytest.raises(PoolClosedError):
        pool.view()
    with pytest.raises(PoolClosedError):
        pool.gather(np.zeros(1024, np.uint8), [0], [0])
    with pytest.raises(PoolClosedError):
        pool.submit_store(1, np.zeros(1024, np.uint8), [0], [0])
    del view
    gc.collect()
    assert pool.stats().released


# -- transfers ----------------------------------------------------------------------------------


def pattern(n_blocks: int, block_bytes: int, seed: int = 0) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 256, (n_blocks, block_bytes), dtype=np.uint8)


@pytest.mark.parametrize("threads", [1, 2])
def test_gather_scatter_round_trip(threads: int) -> None:
    block = 3000
    with HostPool(16, 8192, num_threads=2, register_cuda=False) as pool:
        src = pattern(32, block)
        blocks = [31, 0, 7, 7, 12]  # a source block may be read twice
        chunks = np.array([15, 0, 3, 4, 9], dtype=np.uint16)
        pool.gather(src, blocks, chunks, block_bytes=block, chunk_offset=100, threads=threads)
        view = pool.view()
        for b, c in zip(blocks, chunks, strict=True):
            assert (view[c, 100 : 100 + block] == src[b]).all()
        assert not view[1].any()
        assert not view[15, :100].any()
        dst = np.zeros_like(src)
        pool.scatter(dst, [1, 2, 3, 4, 5], chunks, block_bytes=block, chunk_offset=100)
        assert (dst[1:6] == src[blocks]).all()
        assert not dst[6:].any()
        assert not dst[0].any()


def test_large_transfer_on_two_threads_matches_numpy() -> None:
    with HostPool(8, 1 << 20, num_threads=2, register_cuda=False) as pool:
        src = pattern(8, 1 << 20, seed=3)
        order = [5, 2, 7, 0, 1, 6, 3, 4]
        pool.gather(src, order, range(8), threads=2)
        assert (pool.view() == src[order]).all()
        back = np.empty_like(src)
        pool.scatter(back, order, range(8), threads=2)
        assert (back == src).all()


def test_any_c_contiguous_buffer_is_a_source() -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        halves = np.arange(64, dtype=np.float16).reshape(2, 32)  # 2 blocks of 64 bytes
        pool.gather(halves, [1], [0])
        assert (pool.chunk(0, np.float16) == halves[1]).all()
        pool.gather(bytearray(range(128)), [1], [1])
        assert list(pool.chunk(1)) == list(range(64, 128))
        pool.gather(bytes(range(64)), [0], [2])  # read-only is fine for a gather
        out = bytearray(64)
        pool.scatter(out, [0], [2])
        assert out == bytes(range(64))
        pool.scatter(memoryview(out), [0], [1])
        assert out == bytes(range(64, 128))


class DLPackOnly:
    """An exporter known only through ``__dlpack__`` (as a tensor library's would be)."""

    def __init__(self, arr: np.ndarray[Any, Any]) -> None:
        self.arr = arr

    def __dlpack__(self, **kwargs: Any) -> Any:
        return self.arr.__dlpack__(**kwargs)

    def __dlpack_device__(self) -> Any:
        return self.arr.__dlpack_device__()


def test_dlpack_exporters_are_buffers() -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        src = np.arange(32, dtype=np.float32).reshape(2, 16)
        pool.gather(DLPackOnly(src), [1], [2])
        assert (pool.chunk(2, np.float32) == src[1]).all()
        dst = np.zeros((2, 16), np.float32)
        pool.scatter(DLPackOnly(dst), [0], [2])  # zero-copy: the exporter's memory is written
        assert (dst[0] == src[1]).all()


def test_torch_cpu_tensors_are_buffers() -> None:
    torch = pytest.importorskip("torch")
    with HostPool(4, 64, register_cuda=False) as pool:
        src = torch.arange(64, dtype=torch.bfloat16).reshape(2, 32)
        pool.gather(src, [1], [3])
        dst = torch.zeros(2, 32, dtype=torch.bfloat16)
        pool.scatter(dst, [0], [3])
        assert torch.equal(dst[0], src[1])
        with pytest.raises(InvalidArgumentError):
            pool.gather(src.t(), [0], [0])


def filled(pool: HostPool) -> np.ndarray[Any, Any]:
    pool.view()[:] = 0xAB
    copy: np.ndarray[Any, Any] = pool.view().copy()
    return copy


BAD_TRANSFERS: list[tuple[str, dict[str, Any], type[Exception]]] = [
    ("block id past the end", {"blocks": [0, 1, 8]}, BlockIndexError),
    ("negative block id", {"blocks": [0, 1, -1]}, BlockIndexError),
    ("chunk id past the end", {"chunks": [0, 1, 4]}, BlockIndexError),
    ("huge unsigned id", {"chunks": np.array([0, 1, 2**64 - 1], np.uint64)}, BlockIndexError),
    ("lengths differ", {"chunks": [0, 1]}, InvalidArgumentError),
    ("duplicate chunk", {"chunks": [0, 1, 0]}, InvalidArgumentError),
    ("float ids", {"blocks": [0.0, 1.0, 2.0]}, InvalidArgumentError),
    ("2-d ids", {"blocks": [[0, 1, 2]]}, InvalidArgumentError),
    ("ids not ints", {"blocks": ["a", "b", "c"]}, InvalidArgumentError),
    ("block too big for a chunk", {"block_bytes": 96}, InvalidArgumentError),
    ("offset pushes out", {"chunk_offset": 40}, InvalidArgumentError),
    ("partial blocks", {"block_bytes": 24, "chunk_offset": 0}, InvalidArgumentError),
    ("zero block bytes", {"block_bytes": 0}, InvalidArgumentError),
    ("non-contiguous buffer", {"src": np.zeros((8, 64), np.uint8)[:, ::2]}, InvalidArgumentError),
    ("object buffer", {"src": np.array([None] * 8)}, InvalidArgumentError),
    ("not a buffer", {"src": [1, 2, 3]}, InvalidArgumentError),
    ("negative threads", {"threads": -1}, InvalidArgumentError),
]


@pytest.mark.parametrize(
    ("case", "change", "exc"), BAD_TRANSFERS, ids=[c[0] for c in BAD_TRANSFERS]
)
def test_bad_gather_raises_and_writes_nothing(
    case: str, change: dict[str, Any], exc: type[Exception]
) -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        before = filled(pool)
        args: dict[str, Any] = {
            "src": pattern(8, 32),
            "blocks": [0, 1, 2],
            "chunks": [3, 2, 1],
            "block_bytes": 32,
            "chunk_offset": 16,
            "threads": None,
        } | change
        with pytest.raises(exc) as info:
            pool.gather(
                args["src"],
                args["blocks"],
                args["chunks"],
                block_bytes=args["block_bytes"],
                chunk_offset=args["chunk_offset"],
                threads=args["threads"],
            )
        assert isinstance(info.value, KVOffloadError)
        assert (pool.view() == before).all()
        # The same arguments as a queued job are refused at submit: nothing runs.
        if case != "negative threads":
            with pytest.raises(exc):
                pool.submit_store(
                    7,
                    args["src"],
                    args["blocks"],
                    args["chunks"],
                    block_bytes=args["block_bytes"],
                    chunk_offset=args["chunk_offset"],
                )
            assert pool.stats().jobs_in_flight == 0
            assert pool.get_finished() == []
        assert (pool.view() == before).all()


def test_bad_scatter_raises_and_writes_nothing() -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        filled(pool)
        dst = pattern(8, 64, seed=1)
        before = dst.copy()
        with pytest.raises(BlockIndexError):
            pool.scatter(dst, [0, 1, 8], [0, 1, 2])
        with pytest.raises(InvalidArgumentError, match="destination twice"):
            pool.scatter(dst, [5, 6, 5], [0, 1, 2])
        with pytest.raises(InvalidArgumentError, match="read-only"):
            pool.scatter(bytes(512), [0], [0])
        frozen = dst.copy()
        frozen.flags.writeable = False
        with pytest.raises(InvalidArgumentError, match="read-only"):
            pool.scatter(frozen, [0], [0])
        assert (dst == before).all()


def test_the_pool_cannot_be_its_own_buffer() -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        with pytest.raises(InvalidArgumentError, match="overlaps"):
            pool.gather(pool.view(), [0], [1])
        with pytest.raises(InvalidArgumentError, match="overlaps"):
            pool.scatter(pool.chunk(3), [0], [1], block_bytes=64)


def test_more_memory_than_the_machine_has_is_an_error() -> None:
    with pytest.raises(HostMemoryError, match=r"memory available \(MemAvailable\)|mmap"):
        HostPool(1 << 20, 1 << 30, register_cuda=False)  # 1 PiB


def in_forked_child(body: Callable[[], int]) -> int:
    """Run ``body`` in a forked child (see `_helpers.fork`); the child's exit code."""
    return exit_code(fork(body))


def test_a_forked_child_does_not_wait_for_the_parents_jobs() -> None:
    # Jobs in flight at the fork have no thread in the child to finish them: the child's
    # wait, close and exit must not wait for them (they used to hang forever). The jobs and
    # their results are the parent's: the child's queue is empty (it used to report the results
    # finished before the fork a second time, and count the parent's jobs in flight).
    pool = HostPool(8, 1 << 20, num_threads=1, register_cuda=False)
    src = np.full((8, 1 << 20), 5, np.uint8)
    pool.submit_store(100, src, [0], [0])
    pool.wait([100])  # finished before the fork, its result not yet taken
    for j in range(64):
        pool.submit_store(j, src, [j % 8], [j % 8])  # tens of ms of copying, one thread

    def child() -> int:
        signal.alarm(20)  # a hang ends the child with SIGALRM
        empty = pool.stats().jobs_in_flight == 0 and pool.get_finished() == []
        pool.wait(range(64))
        cancelled = pool.cancel(63)
        pool.close()
        return 0 if empty and not cancelled else 2

    assert pool.stats().jobs_in_flight > 0  # in flight at the fork (most of them)
    status = in_forked_child(child)
    pool.wait(range(64))
    assert sorted(pool.get_finished()) == [(j, True) for j in [*range(64), 100]]
    pool.close()
    assert status == 0


def test_a_forked_child_copies_without_the_parents_threads() -> None:
    pool = HostPool(8, 1 << 20, num_threads=2, register_cuda=False)
    src = np.full((8, 1 << 20), 3, np.uint8)

    def child() -> int:
        pool.gather(src, range(8), range(8), threads=2)  # runs inline, no hang
        try:
            pool.submit_store(1, src, [0], [0])
        except InvalidArgumentError:
            return 0 if (pool.view() == 3).all() else 2
        return 1

    assert in_forked_child(child) == 0
    assert not pool.view().any()  # the child's private copy-on-write pages, not ours
    pool.close()


def test_the_prefault_rate_is_mapped_gigabytes_per_second() -> None:
    with HostPool(64, PAGE, register_cuda=False) as pool:
        stats = pool.stats()
        if stats.prefault_seconds > 0:
            expected = stats.mapped_bytes / stats.prefault_seconds / 1e9
            assert stats.prefault_gb_per_s == pytest.approx(expected)
        else:  # too fast to time: an unbounded rate, not a division by zero
            assert stats.prefault_gb_per_s == float("inf")


@pytest.mark.parametrize("dtype", ["a", b"a", "<a4"])
def test_a_deprecated_dtype_is_refused_before_numpy_warns(dtype: Any) -> None:
    # With warnings shown rather than raised, numpy's DeprecationWarning must not appear at all:
    # kvoffload refuses the spelling itself.
    import warnings

    with HostPool(4, 96, register_cuda=False) as pool, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(InvalidArgumentError, match="numpy deprecates 'a'"):
            pool.typed_view(dtype, (4,))
    assert [str(w.message) for w in seen] == []


def test_repr_says_closed() -> None:
    pool = HostPool(2, PAGE, register_cuda=False)
    assert repr(pool) == f"HostPool(num_chunks=2, chunk_bytes={PAGE}, pinned='pageable')"
    pool.close()
    assert repr(pool).endswith("pinned='pageable', closed)")


@pytest.mark.parametrize("big", [2**63, 2**64 - 1])
def test_unsigned_ids_beyond_int64_are_named_as_given(big: int) -> None:
    # Not wrapped to a negative id by the int64 conversion: the error names the id passed.
    with HostPool(4, 64, register_cuda=False) as pool:
        src = np.zeros((4, 64), np.uint8)
        ids = np.array([big], dtype=np.uint64)
        with pytest.raises(BlockIndexError, match=f"^block ids holds {big}, out of range$"):
            pool.gather(src, ids, [0])
        with pytest.raises(BlockIndexError, match=f"^chunk ids holds {big}, out of range$"):
            pool.scatter(src, [0], ids)


# -- torch tensors, through a stand-in torch (none is installed here; mutation round) ------------


class _FakeDevice:
    def __init__(self, kind: str) -> None:
        self.type = kind

    def __str__(self) -> str:
        return self.type if self.type == "cpu" else f"{self.type}:0"


class _FakeTensor:
    """What ``as_byte_buffer`` uses of a torch tensor, over a numpy array (its storage).

    As torch's, ``numpy()`` refuses a tensor that requires grad and a bfloat16 one (numpy has no
    bfloat16), so only a detached, byte-typed view can be handed to numpy.
    """

    def __init__(
        self,
        arr: np.ndarray[Any, Any],
        dtype: str = "uint8",
        device: str = "cpu",
        requires_grad: bool = False,
        contiguous: bool = True,
    ) -> None:
        self.arr, self.dtype, self.device = arr, dtype, _FakeDevice(device)
        self.requires_grad, self.contiguous = requires_grad, contiguous

    def is_contiguous(self) -> bool:
        return self.contiguous

    def detach(self) -> _FakeTensor:
        return _FakeTensor(self.arr, self.dtype, self.device.type, False, self.contiguous)

    def reshape(self, *shape: int) -> _FakeTensor:
        return _FakeTensor(
            self.arr.reshape(shape), self.dtype, self.device.type, self.requires_grad
        )

    def view(self, dtype: str) -> _FakeTensor:
        assert dtype == "uint8", dtype
        return _FakeTensor(self.arr.view(np.uint8), "uint8", self.device.type, self.requires_grad)

    def numpy(self) -> np.ndarray[Any, Any]:
        if self.requires_grad:
            raise RuntimeError("Can't call numpy() on Tensor that requires grad.")
        if self.dtype == "bfloat16":
            raise TypeError("Got unsupported ScalarType BFloat16")
        return self.arr


@pytest.fixture
def fake_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(
        sys.modules, "torch", types.SimpleNamespace(Tensor=_FakeTensor, uint8="uint8")
    )


@pytest.mark.usefixtures("fake_torch")
def test_a_cpu_tensor_is_read_and_written_in_place_as_bytes() -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        bits = np.arange(64, dtype=np.uint16).reshape(2, 32)  # bfloat16 [2, 32], as raw bits
        pool.gather(_FakeTensor(bits, "bfloat16", requires_grad=True), [1], [3])
        assert (pool.chunk(3, np.uint16) == bits[1]).all()
        out = np.zeros((2, 32), np.uint16)
        pool.scatter(_FakeTensor(out, "bfloat16"), [0], [3])  # zero-copy: the storage is written
        assert (out[0] == bits[1]).all()


@pytest.mark.usefixtures("fake_torch")
@pytest.mark.parametrize("device", ["cuda", "mps", "meta"])
def test_a_tensor_on_any_device_but_the_cpu_is_refused(device: str) -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        tensor = _FakeTensor(np.zeros(64, np.uint8), device=device)
        with pytest.raises(
            InvalidArgumentError, match=f"^a tensor on {device}:0 is not host memory"
        ):
            pool.gather(tensor, [0], [0])


@pytest.mark.usefixtures("fake_torch")
def test_a_tensor_that_is_not_contiguous_is_refused() -> None:
    with HostPool(4, 64, register_cuda=False) as pool:
        tensor = _FakeTensor(np.zeros(64, np.uint8), contiguous=False)
        with pytest.raises(InvalidArgumentError, match=r"^the tensor is not contiguous$"):
            pool.gather(tensor, [0], [0])
