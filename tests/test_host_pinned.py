"""The pinned state a HostPool reports: pageable, page-locked (mlock, and its RLIMIT_MEMLOCK
error), or registered with CUDA through a runtime found with ctypes (a fake runtime here, which
records the calls: pieces, flags, unregistration, failures)."""

from __future__ import annotations

import mmap
import os
import shutil
import subprocess
import sys
import textwrap
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
        self.cudaGetErrorString = error_string


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
