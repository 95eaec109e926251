"""CUDA host registration through the CUDA runtime library, found and called with ctypes.

No CUDA package is needed: when ``libcudart`` can be loaded, ``cudaHostRegister`` pins a pool's
memory for DMA, in pieces of at most ``MAX_PIECE_BYTES``. Tests replace ``load_runtime``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
from typing import Any

from kvoffload.errors import CudaRegistrationError

__all__ = ["MAX_PIECE_BYTES", "CudaRegistration", "load_runtime", "pieces", "register"]

#: Largest range registered in one ``cudaHostRegister`` call.
MAX_PIECE_BYTES = 64 << 30
#: ``cudaHostRegisterPortable``: pinned for every CUDA context, not only the current one.
HOST_REGISTER_PORTABLE = 1
_LIBRARY_NAMES = ("libcudart.so", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0")


def load_runtime() -> Any | None:
    """The CUDA runtime library, or None when none can be loaded."""
    names = [ctypes.util.find_library("cudart"), *_LIBRARY_NAMES]
    for name in names:
        if not name:
            continue
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def pieces(address: int, nbytes: int, max_piece: int) -> list[tuple[int, int]]:
    """``(address, size)`` ranges of at most ``max_piece`` bytes covering the range."""
    return [(address + off, min(max_piece, nbytes - off)) for off in range(0, nbytes, max_piece)]


def _error_string(lib: Any, code: int) -> str:
    try:
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaGetErrorString.argtypes = [ctypes.c_int]
        text = lib.cudaGetErrorString(code)
    except (AttributeError, OSError):
        text = None
    if isinstance(text, bytes):
        return f"{text.decode(errors='replace')} (cudaError {code})"
    return f"cudaError {code}"


def device_count(lib: Any) -> tuple[int, str]:
    """Visible CUDA devices, and the runtime's error text when it cannot tell (0 devices)."""
    count = ctypes.c_int(0)
    lib.cudaGetDeviceCount.restype = ctypes.c_int
    lib.cudaGetDeviceCount.argtypes = [ctypes.POINTER(ctypes.c_int)]
    code = lib.cudaGetDeviceCount(ctypes.byref(count))
    if code != 0:
        return 0, _error_string(lib, code)
    return count.value, ""


class CudaRegistration:
    """Registered ranges of one pool; ``unregister`` undoes them (idempotent)."""

    def __init__(self, lib: Any, ranges: list[tuple[int, int]]) -> None:
        self._lib = lib
        self.ranges = ranges

    def unregister(self) -> None:
        """Unregister every range (errors are ignored: the memory is being released)."""
        ranges, self.ranges = self.ranges, []
        for address, _ in ranges:
            self._lib.cudaHostUnregister(ctypes.c_void_p(address))


def register(lib: Any, address: int, nbytes: int) -> CudaRegistration:
    """Register ``nbytes`` at ``address`` in pieces; on failure undo the pieces done and raise."""
    lib.cudaHostRegister.restype = ctypes.c_int
    lib.cudaHostRegister.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
    lib.cudaHostUnregister.restype = ctypes.c_int
    lib.cudaHostUnregister.argtypes = [ctypes.c_void_p]
    done = CudaRegistration(lib, [])
    for start, size in pieces(address, nbytes, MAX_PIECE_BYTES):
        code = lib.cudaHostRegister(ctypes.c_void_p(start), size, HOST_REGISTER_PORTABLE)
        if code != 0:
            done.unregister()
            raise CudaRegistrationError(
                f"cudaHostRegister of {size} bytes at {start:#x} failed: {_error_string(lib, code)}"
            )
        done.ranges.append((start, size))
    return done
