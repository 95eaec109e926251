"""The pinned state a HostPool reports: pageable, page-locked (mlock, and its RLIMIT_MEMLOCK
error), or registered with CUDA through a runtime found with ctypes (a fake runtime here, which
records the calls: pieces, flags, unregistration, failures)."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import shutil
import subprocess
import sys
import textwrap
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvoffload import CudaRegistrationError, HostPool, InvalidArgumentError, PageLockError, _cuda

PAGE = mmap.PAGESIZE


def test_pageable_by_default_without_a_cuda_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(_cuda, "load_runtime", lambda: None)
    with HostPool(2, 4096) as pool:
        assert pool.pinned == "pageable"
        stats = pool.stats()
        assert stats.pinned == "pageable"
        assert not stats.locked
        assert "no CUDA runtime" in stats.pinned_reason
    with pytest.raises(CudaRegistrationError, match="no CUDA runtime"):
        HostPool(2, 4096, register_cuda=True)


def test_page_locked_when_mlock_succeeds() -> None:
    with HostPool(2, 4096, lock_pages=True, register_cuda=False) as pool:
        assert pool.pinned == "page-locked"
        assert pool.stats().locked


LOW_MEMLOCK = textwrap.dedent(
    """
    import resource
    from kvoffload import HostPool, PageLockError
    resource.setrlimit(resource.RLIMIT_MEMLOCK, (1 << 20, 1 << 20))
    try:
        HostPool(4, 1 << 20, lock_pages=True, register_cuda=False)
    except PageLockError as e:
        print("PageLockError:", e)
    else:
        print("locked")
    """
)


def test_mlock_failure_names_rlimit_memlock() -> None:
    cmd = [sys.executable, "-c", LOW_MEMLOCK]
    if os.geteuid() == 0:  # root has CAP_IPC_LOCK, which ignores the limit: drop it
        setpriv = shutil.which("setpriv")
        if setpriv is None:
            pytest.skip("running as root without setpriv to drop CAP_IPC_LOCK")
        cmd = [setpriv, "--bounding-set", "-ipc_lock", "--inh-caps", "-ipc_lock", *cmd]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.startswith("PageLockError:"), out
    assert "RLIMIT_MEMLOCK is 1048576 bytes" in out
    assert issubclass(PageLockError, OSError)


class FakeCudart:
    """Records the calls a pool makes into a CUDA runtime (plain functions: ctypes-style
    attributes such as ``argtypes`` are set on them)."""

    def __init__(self, devices: int = 1, fail_at: int | None = None) -> None:
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

        def register(ptr: Any, size: int, flags: int) -> int:
            if fail_at is not None and len(self.registered) == fail_at:
                return 2
            self.registered.append((ptr.value, size, flags))
            return 0

        def unregister(ptr: Any) -> int:
            self.unregistered.append(ptr.value)
            return 0

        def count(out: Any) -> int:
            if devices == 0:
                return 100
            out._obj.value = devices
            return 0

        def error_string(code: int) -> bytes:
            return b"fake error"

        self.cudaHostRegister = register
        self.cudaHostUnregister = unregister
        self.cudaGetDeviceCount = count
        self.cudaGetErrorString: Callable[[int], bytes | None] = error_string


def test_cuda_registration_in_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(_cuda, "load_runtime", lambda: fake)
    monkeypatch.setattr(_cuda, "MAX_PIECE_BYTES", 3 * PAGE)
    pool = HostPool(8, PAGE)
    assert pool.pinned == "cuda-registered"
    assert pool.stats().pinned == "cuda-registered"
    base = pool.view().ctypes.data
    assert fake.registered == [
        (base, 3 * PAGE, 1),
        (base + 3 * PAGE, 3 * PAGE, 1),
        (base + 6 * PAGE, 2 * PAGE, 1),
    ]
    pool.close()
    assert fake.unregistered == [base, base + 3 * PAGE, base + 6 * PAGE]
    assert _cuda.pieces(0, 10, 4) == [(0, 4), (4, 4), (8, 2)]
    assert _cuda.MAX_PIECE_BYTES == 3 * PAGE  # the real default is 64 GiB, patched here


def test_cuda_failures_are_loud(monkeypatch: pytest.MonkeyPatch) -> None:
    no_device = FakeCudart(devices=0)
    monkeypatch.setattr(_cuda, "load_runtime", lambda: no_device)
    with HostPool(2, PAGE) as pool:
        assert pool.pinned == "pageable"
        assert "no usable device" in pool.stats().pinned_reason
    with pytest.raises(CudaRegistrationError, match="no CUDA device"):
        HostPool(2, PAGE, register_cuda=True)
    broken = FakeCudart(fail_at=1)
    monkeypatch.setattr(_cuda, "load_runtime", lambda: broken)
    monkeypatch.setattr(_cuda, "MAX_PIECE_BYTES", PAGE)
    with pytest.raises(CudaRegistrationError, match="fake error"):
        HostPool(2, PAGE)
    assert [p for p, _, _ in broken.registered] == broken.unregistered  # undone


def test_register_cuda_takes_only_auto_true_false() -> None:
    for bad in (1, 0, "true", None):
        with pytest.raises(InvalidArgumentError):
            HostPool(2, PAGE, register_cuda=bad)  # type: ignore[arg-type]


def test_a_library_without_the_runtime_symbols_is_no_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(_cuda, "load_runtime", lambda: object())
    with HostPool(2, PAGE) as pool:
        assert pool.pinned == "pageable"
        assert "not a usable CUDA runtime" in pool.stats().pinned_reason


# -- the CUDA runtime's answers, and the pool around a registration (mutation round) -------------


def test_register_cuda_false_never_looks_for_a_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_lookup() -> None:
        raise AssertionError("load_runtime was called")

    monkeypatch.setattr(_cuda, "load_runtime", no_lookup)
    with HostPool(2, PAGE, register_cuda=False) as pool:
        assert pool.pinned == "pageable"
        assert pool.stats().pinned_reason == "register_cuda=False"


def test_a_registered_pool_says_in_how_many_pieces_and_covers_whole_pages(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudart()
    monkeypatch.setattr(_cuda, "load_runtime", lambda: fake)
    with HostPool(3, 100) as pool:  # 300 bytes: one page mapped, and registered whole
        base = pool.view().ctypes.data
        assert fake.registered == [(base, PAGE, 1)]
        assert pool.stats().pinned_reason == "cudaHostRegister in 1 piece(s)"
    monkeypatch.setattr(_cuda, "MAX_PIECE_BYTES", PAGE)
    with HostPool(3, PAGE) as pool:
        assert pool.stats().pinned_reason == "cudaHostRegister in 3 piece(s)"


def test_close_unregisters_before_it_releases_the_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart()
    closed_at_unregister: list[bool] = []
    unregister = fake.cudaHostUnregister

    def recording_unregister(ptr: Any) -> int:
        closed_at_unregister.append(pool.closed)
        return unregister(ptr)

    fake.cudaHostUnregister = recording_unregister
    monkeypatch.setattr(_cuda, "load_runtime", lambda: fake)
    pool = HostPool(2, PAGE)
    pool.close()
    assert closed_at_unregister == [False]  # unregistered while the memory was still mapped
    assert pool.pinned == "pageable"  # no longer registered
    pool.close()
    assert len(fake.unregistered) == 1  # once


def test_a_failed_registration_releases_the_shared_region(monkeypatch: pytest.MonkeyPatch) -> None:
    if not Path("/dev/shm").is_dir():
        pytest.skip("no /dev/shm")
    monkeypatch.setattr(_cuda, "load_runtime", lambda: FakeCudart(fail_at=0))
    name = f"test-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    with pytest.raises(CudaRegistrationError) as info:
        HostPool(2, PAGE, shared_name=name)
    # Released by the failed constructor itself: ``info`` holds its frame, and so the pool.
    assert info.type is CudaRegistrationError
    assert not (Path("/dev/shm") / f"kvoffload.{name}").exists()


def test_no_device_reports_none_visible_when_the_runtime_gives_no_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudart(devices=1)
    fake.cudaGetDeviceCount = lambda out: 0  # success, and the count left at 0
    monkeypatch.setattr(_cuda, "load_runtime", lambda: fake)
    with HostPool(2, PAGE) as pool:
        assert pool.stats().pinned_reason == (
            "CUDA runtime found but no usable device (none visible)"
        )


def test_a_runtime_whose_device_query_fails_in_the_loader_is_no_runtime(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    fake = FakeCudart()

    def count(out: Any) -> int:
        raise OSError("exception: access violation reading 0x0")  # as ctypes reports a crash

    fake.cudaGetDeviceCount = count
    monkeypatch.setattr(_cuda, "load_runtime", lambda: fake)
    with HostPool(2, PAGE) as pool:
        assert pool.pinned == "pageable"
        assert (
            "not a usable CUDA runtime: exception: access violation" in pool.stats().pinned_reason
        )


def test_load_runtime_tries_every_known_name_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    tried: list[str] = []

    def cdll(name: str) -> str:
        tried.append(name)
        if name != "libcudart.so.12":
            raise OSError(f"{name}: cannot open shared object file")
        return f"loaded {name}"

    monkeypatch.setattr(ctypes, "CDLL", cdll)
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)  # not on the search path
    assert _cuda.load_runtime() == "loaded libcudart.so.12"
    assert tried == ["libcudart.so", "libcudart.so.13", "libcudart.so.12"]
    tried.clear()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: "libcudart.so.12")
    assert _cuda.load_runtime() == "loaded libcudart.so.12"
    assert tried == ["libcudart.so.12"]  # what the search path found comes first
    tried.clear()
    monkeypatch.setattr(ctypes.util, "find_library", lambda name: None)
    monkeypatch.setattr(_cuda, "_LIBRARY_NAMES", ("libcudart.so.9",))
    assert _cuda.load_runtime() is None
    assert tried == ["libcudart.so.9"]


def test_device_count_reports_the_error_and_no_device_on_failure() -> None:
    fake = FakeCudart()

    def count(out: Any) -> int:
        out._obj.value = 2  # whatever the runtime left there, a failure counts no device
        return 35

    fake.cudaGetDeviceCount = count
    assert _cuda.device_count(fake) == (0, "fake error (cudaError 35)")
    fake.cudaGetErrorString = lambda code: None  # no text for the code
    assert _cuda.device_count(fake) == (0, "cudaError 35")

    def crashes(code: int) -> bytes:
        raise OSError("exception: access violation")

    fake.cudaGetErrorString = crashes
    assert _cuda.device_count(fake) == (0, "cudaError 35")
    assert _cuda.device_count(FakeCudart(devices=3)) == (3, "")


def test_a_failed_registration_names_the_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    fake = FakeCudart(fail_at=1)
    monkeypatch.setattr(_cuda, "MAX_PIECE_BYTES", 1 << 12)
    with pytest.raises(CudaRegistrationError) as info:
        _cuda.register(fake, 0x10000, 3 << 12)
    assert str(info.value) == (
        "cudaHostRegister of 4096 bytes at 0x11000 failed: fake error (cudaError 2)"
    )
    assert fake.unregistered == [0x10000]


def test_unregister_is_idempotent() -> None:
    fake = FakeCudart()
    registration = _cuda.register(fake, 0x10000, 1 << 12)
    registration.unregister()
    registration.unregister()
    assert fake.unregistered == [0x10000]
    assert registration.ranges == []
