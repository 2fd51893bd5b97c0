"""The few CUDA runtime calls the server makes itself, through ctypes (it never imports torch):
pinning host buffers, and opening the device memory a same-host client shares (the V2 CUDA
shared-memory extension).

libcudart is the one onnxruntime's CUDA provider loads (onnxruntime.preload_dlls: the nvidia-* pip
packages, else the system's); found by its soname. On a machine without it every call says so:
`available()` is False, `pin` returns False (the buffer stays pageable, which is only slower), and
the shared-memory calls raise CudaError.
"""

from __future__ import annotations

import ctypes
import logging
import threading

import numpy as np

log = logging.getLogger("serving.cuda")

# cudaMemcpyKind
HOST_TO_DEVICE, DEVICE_TO_HOST, DEVICE_TO_DEVICE = 1, 2, 3
# sizeof(cudaIpcMemHandle_t)
IPC_HANDLE_BYTES = 64
_SONAMES = ("libcudart.so.13", "libcudart.so.12", "libcudart.so")

_lock = threading.Lock()
_runtime: ctypes.CDLL | None = None
_looked = False
# addresses registered with cudaHostRegister
_pinned: set[int] = set()


class CudaError(Exception):
    """A CUDA runtime call failed (or there is no CUDA runtime)."""


def runtime() -> ctypes.CDLL | None:
    """libcudart, loaded once (None where there is none)."""
    global _runtime, _looked
    with _lock:
        if not _looked:
            _looked = True
            for name in _SONAMES:
                try:
                    _runtime = ctypes.CDLL(name)
                    break
                except OSError:
                    continue
        return _runtime


def available() -> bool:
    return runtime() is not None


def _check(code: int, what: str) -> None:
    if code != 0:
        lib = runtime()
        text = ""
        if lib is not None:
            lib.cudaGetErrorString.restype = ctypes.c_char_p
            text = (lib.cudaGetErrorString(code) or b"").decode(errors="replace")
        raise CudaError(f"{what} failed: CUDA error {code} {text}".rstrip())


def pin(array: np.ndarray) -> bool:
    """Page-locks `array`'s memory (cudaHostRegister) so that copies to the device run at full
    speed; False where CUDA cannot (no runtime, or the driver refused), leaving it pageable."""
    lib = runtime()
    if lib is None or not array.nbytes:
        return False
    address = array.ctypes.data
    code = lib.cudaHostRegister(
        ctypes.c_void_p(address), ctypes.c_size_t(array.nbytes), ctypes.c_uint(0)
    )
    if code != 0:
        # clear it: a failed registration is not sticky, but leave nothing behind
        lib.cudaGetLastError()
        log.debug(
            "cudaHostRegister of %d bytes failed (CUDA error %d): the buffer stays pageable",
            array.nbytes,
            code,
        )
        return False
    with _lock:
        _pinned.add(address)
    return True


def unpin(array: np.ndarray) -> None:
    address = array.ctypes.data
    with _lock:
        if address not in _pinned:
            return
        _pinned.discard(address)
    lib = runtime()
    if lib is not None:
        lib.cudaHostUnregister(ctypes.c_void_p(address))


def set_device(device_id: int) -> None:
    lib = _need()
    _check(lib.cudaSetDevice(ctypes.c_int(device_id)), f"cudaSetDevice({device_id})")


def open_ipc_handle(handle: bytes, device_id: int) -> int:
    """The device address of the memory another process exported with cudaIpcGetMemHandle (64
    bytes)."""
    if len(handle) != IPC_HANDLE_BYTES:
        raise CudaError(f"a CUDA IPC handle has {IPC_HANDLE_BYTES} bytes, got {len(handle)}")
    lib = _need()
    set_device(device_id)
    pointer = ctypes.c_void_p()
    raw = (ctypes.c_char * IPC_HANDLE_BYTES).from_buffer_copy(handle)
    # cudaIpcMemHandle_t is a struct passed by value: a 64-byte char array as the argument does
    # that.
    _check(
        lib.cudaIpcOpenMemHandle(ctypes.byref(pointer), raw, ctypes.c_uint(1)),
        "cudaIpcOpenMemHandle",
    )
    return int(pointer.value or 0)


def close_ipc_handle(address: int) -> None:
    lib = runtime()
    if lib is not None and address:
        lib.cudaIpcCloseMemHandle(ctypes.c_void_p(address))


def copy(destination: int, source: int, size: int, kind: int) -> None:
    """cudaMemcpy between addresses (host or device as `kind` says); synchronous."""
    lib = _need()
    _check(
        lib.cudaMemcpy(
            ctypes.c_void_p(destination),
            ctypes.c_void_p(source),
            ctypes.c_size_t(size),
            ctypes.c_int(kind),
        ),
        "cudaMemcpy",
    )


def _need() -> ctypes.CDLL:
    lib = runtime()
    if lib is None:
        raise CudaError("no CUDA runtime (libcudart) on this machine")
    return lib
