"""The KServe V2 shared-memory extensions as Triton defines them and `tritonclient` speaks them: a client on the
same host registers a region of its shared memory once, then sends each request's inputs, and takes its outputs,
by region, offset and size instead of as bytes in the message. A 602 KB image then costs the server no bytes off
a socket at all.

    system   POSIX shared memory (`/dev/shm/<key>`, what tritonclient.utils.shared_memory makes): mapped into the
             server; an input is read straight from the mapping into the batch, an output written into it
    cuda     device memory a client exported with cudaIpcGetMemHandle (tritonclient.utils.cuda_shared_memory):
             opened with cudaIpcOpenMemHandle where the server runs on a GPU; refused (400) elsewhere

Routes (HTTP; the same six as gRPC methods): `GET /v2/{system,cuda}sharedmemory[/region/NAME]/status`,
`POST .../region/NAME/register`, `POST /v2/{system,cuda}sharedmemory[/region/NAME]/unregister`.

Bounds: a region belongs to the token that registered it (the sha256 of the bearer token; one namespace for all
when the server has none): another token neither sees, uses nor unregisters it. A client holds at most
MAX_REGIONS regions and --max-shared-memory-mb of mappings; an input or output must lie inside its region
(offset + byte size at most the registered size), and an input's byte size must be exactly its tensor's. A
region's mapping is released when it is unregistered and no request in flight still reads it.

Trust: a region names a shared-memory object by its key, and the server opens whatever its own user may open.
The token is what keeps strangers out; give it only to same-host clients you trust with that (Triton's
extension has the same property). `--shared-memory off` turns the extension off.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import re
import stat
import threading

import numpy as np

from serving import cuda
from serving.codec import BadRequest, Ref

MAX_REGIONS = 256  # per client (token)
SHM_DIR = "/dev/shm"
_KEY = re.compile(r"/?[A-Za-z0-9_.@:+-]{1,250}")


class Region:
    def __init__(
        self,
        name: str,
        kind: str,
        byte_size: int,
        *,
        key: str = "",
        offset: int = 0,
        device_id: int = 0,
        mapping: mmap.mmap | None = None,
        view: memoryview | None = None,
        address: int = 0,
    ):
        self.name, self.kind, self.byte_size = name, kind, byte_size
        self.key, self.offset, self.device_id = key, offset, device_id
        self.mapping, self.view, self.address = mapping, view, address

    def status(self) -> dict:
        if self.kind == "cuda":
            return {"name": self.name, "device_id": self.device_id, "byte_size": self.byte_size}
        return {
            "name": self.name,
            "key": self.key,
            "offset": self.offset,
            "byte_size": self.byte_size,
        }

    def release(self) -> None:
        if self.kind == "cuda":
            cuda.close_ipc_handle(self.address)
            return
        self.view = None
        try:
            self.mapping.close()
        except (
            BufferError
        ):  # an array of a request in flight still reads it: freed with the last of them
            pass


def owner_of(authorization: str) -> str:
    """Whose regions a request may use: its bearer token's, hashed (never kept)."""
    token = authorization.partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


class SharedMemory:
    """Every client's registered regions. Calls come from event loops (one or several): under a lock."""

    def __init__(self, max_bytes: int, enabled: bool = True, cuda_device: int | None = None):
        self.max_bytes = max_bytes
        self.enabled = enabled
        self.cuda_device = (
            cuda_device  # the server's GPU when it serves on one; None: no CUDA regions
        )
        self._lock = threading.Lock()
        self._regions: dict[tuple[str, str, str], Region] = {}  # (owner, kind, name) -> region

    # ---- registering ----

    def register(
        self,
        authorization: str,
        kind: str,
        name: str,
        *,
        key: str = "",
        offset: int = 0,
        byte_size: int = 0,
        raw_handle: bytes = b"",
        device_id: int = 0,
    ) -> None:
        self._check_on(kind)
        owner = owner_of(authorization)
        if not name or len(name) > 256:
            raise BadRequest(f"a {kind} shared memory region needs a name of 1 to 256 characters")
        if byte_size <= 0 or offset < 0:
            raise BadRequest(
                f"{kind} shared memory region '{name}': byte_size must be positive and offset >= 0, "
                f"got byte_size {byte_size}, offset {offset}"
            )
        with self._lock:
            if (owner, kind, name) in self._regions:
                raise BadRequest(
                    f"{kind} shared memory region '{name}' is already registered; unregister it first"
                )
            mine = [r for (o, _, _), r in self._regions.items() if o == owner]
            if len(mine) >= MAX_REGIONS:
                raise BadRequest(
                    f"this client has {len(mine)} shared memory regions registered, the most it may "
                    "hold; unregister some first",
                    429,
                )
            held = sum(r.byte_size for r in mine)
            if held + byte_size > self.max_bytes:
                raise BadRequest(
                    f"registering {byte_size} bytes would take this client's shared memory to "
                    f"{held + byte_size} bytes, past --max-shared-memory-mb ({self.max_bytes} bytes)",
                    413,
                )
            region = (
                self._open_system(name, key, offset, byte_size)
                if kind == "system"
                else self._open_cuda(name, raw_handle, device_id, byte_size)
            )
            self._regions[(owner, kind, name)] = region

    def _open_system(self, name: str, key: str, offset: int, byte_size: int) -> Region:
        if not isinstance(key, str) or not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
            raise BadRequest(
                f"system shared memory region '{name}': key {key!r:.80} is not a POSIX shared memory "
                "name ('/name': letters, digits and _.@:+- after one leading '/')"
            )
        path = os.path.join(SHM_DIR, key.lstrip("/"))
        try:
            fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as exc:
            raise BadRequest(
                f"system shared memory region '{name}': cannot open shared memory key {key!r} "
                f"({exc.strerror}); create it first (tritonclient.utils.shared_memory."
                "create_shared_memory_region)"
            ) from None
        try:
            info = os.fstat(fd)
            if not stat.S_ISREG(info.st_mode):
                raise BadRequest(
                    f"system shared memory region '{name}': key {key!r} is not a shared memory object"
                )
            if offset + byte_size > info.st_size:
                raise BadRequest(
                    f"system shared memory region '{name}': offset {offset} + byte_size {byte_size} "
                    f"passes the end of shared memory key {key!r} ({info.st_size} bytes)"
                )
            start = offset - offset % mmap.ALLOCATIONGRANULARITY
            mapping = mmap.mmap(fd, byte_size + offset - start, offset=start)
        finally:
            os.close(fd)
        view = memoryview(mapping)[offset - start : offset - start + byte_size]
        return Region(name, "system", byte_size, key=key, offset=offset, mapping=mapping, view=view)

    def _open_cuda(self, name: str, raw_handle: bytes, device_id: int, byte_size: int) -> Region:
        if self.cuda_device is None:
            raise BadRequest(
                f"cuda shared memory region '{name}': this server runs on the CPU (no CUDA provider); "
                "use system shared memory (/v2/systemsharedmemory)"
            )
        if device_id != self.cuda_device:
            raise BadRequest(
                f"cuda shared memory region '{name}': device {device_id}, but this server runs on CUDA "
                f"device {self.cuda_device}; register memory of that device"
            )
        try:
            address = cuda.open_ipc_handle(raw_handle, device_id)
        except cuda.CudaError as exc:
            raise BadRequest(
                f"cuda shared memory region '{name}': {exc} (is raw_handle a cudaIpcMemHandle_t of "
                "device memory of this machine?)"
            ) from None
        return Region(name, "cuda", byte_size, device_id=device_id, address=address)

    def unregister(self, authorization: str, kind: str, name: str | None = None) -> None:
        """One region, or (no name) every region of this client of that kind; an unknown name is a 400."""
        self._check_on(kind)
        owner = owner_of(authorization)
        with self._lock:
            if name:
                region = self._regions.pop((owner, kind, name), None)
                if region is None:
                    raise self._unknown(kind, name, 400)
                gone = [region]
            else:
                keys = [k for k in self._regions if k[0] == owner and k[1] == kind]
                gone = [self._regions.pop(k) for k in keys]
        for region in gone:
            region.release()

    def status(self, authorization: str, kind: str, name: str | None = None) -> list[dict]:
        self._check_on(kind)
        owner = owner_of(authorization)
        with self._lock:
            if name:
                region = self._regions.get((owner, kind, name))
                if region is None:
                    raise self._unknown(kind, name, 404)
                return [region.status()]
            return [
                r.status()
                for (o, k, _), r in sorted(self._regions.items())
                if o == owner and k == kind
            ]

    def close(self) -> None:
        with self._lock:
            regions, self._regions = list(self._regions.values()), {}
        for region in regions:
            region.release()

    # ---- inference ----

    def reader(self, authorization: str):
        """What a decoder calls for an input placed in shared memory: (Ref, spec, count) -> its array."""
        owner = owner_of(authorization)
        return lambda ref, spec, count: self.read(owner, ref, spec, count)

    def read(self, owner: str, ref: Ref, spec, count: int) -> np.ndarray:
        region = self._find(owner, ref.region)
        want = count * spec.dtype.itemsize
        if ref.byte_size != want:
            raise BadRequest(
                f"input '{spec.name}': shared_memory_byte_size {ref.byte_size}, but its shape takes "
                f"{want} bytes of {spec.datatype}"
            )
        self._inside(region, ref, f"input '{spec.name}'")
        if region.kind == "cuda":  # copied to the host once: the batch is gathered there
            array = np.empty(count, dtype=spec.dtype)
            if want:
                cuda.copy(array.ctypes.data, region.address + ref.offset, want, cuda.DEVICE_TO_HOST)
            return array
        view = region.view
        if view is None:  # unregistered meanwhile
            raise self._unknown("", ref.region, 400)
        return np.frombuffer(view, dtype=spec.dtype, count=count, offset=ref.offset)

    def write(
        self, authorization: str, placed: dict[str, Ref], results: dict[str, np.ndarray]
    ) -> dict[str, dict]:
        """Each output placed in shared memory written there; {output: its parameters in the answer}."""
        owner = owner_of(authorization)
        said = {}
        for name, ref in placed.items():
            region = self._find(owner, ref.region)
            array = np.ascontiguousarray(results[name])
            if array.nbytes > ref.byte_size:
                raise BadRequest(
                    f"output '{name}': {array.nbytes} bytes ({list(array.shape)} "
                    f"{array.dtype}) do not fit the {ref.byte_size} bytes given in shared memory "
                    f"region '{ref.region}'"
                )
            self._inside(region, ref, f"output '{name}'")
            if region.kind == "cuda":
                if array.nbytes:
                    cuda.copy(
                        region.address + ref.offset,
                        array.ctypes.data,
                        array.nbytes,
                        cuda.HOST_TO_DEVICE,
                    )
            else:
                view = region.view
                if view is None:  # unregistered meanwhile
                    raise self._unknown("", ref.region, 400)
                view[ref.offset : ref.offset + array.nbytes] = array.reshape(-1).view(np.uint8)
            said[name] = {
                "shared_memory_region": ref.region,
                "shared_memory_byte_size": array.nbytes,
                **({"shared_memory_offset": ref.offset} if ref.offset else {}),
            }
        return said

    # ----

    def _find(self, owner: str, name: str) -> Region:
        if not self.enabled:
            raise BadRequest(
                "shared memory is off on this server (--shared-memory off); send the tensors in the "
                "request",
                403,
            )
        with self._lock:
            for kind in ("system", "cuda"):
                region = self._regions.get((owner, kind, name))
                if region is not None:
                    return region
        raise self._unknown("", name, 400)

    @staticmethod
    def _inside(region: Region, ref: Ref, what: str) -> None:
        if ref.offset < 0 or ref.byte_size < 0 or ref.offset + ref.byte_size > region.byte_size:
            raise BadRequest(
                f"{what}: shared_memory_offset {ref.offset} + shared_memory_byte_size {ref.byte_size} "
                f"pass the end of region '{region.name}' ({region.byte_size} bytes registered)"
            )

    @staticmethod
    def _unknown(kind: str, name: str, status: int) -> BadRequest:
        what = f"{kind} shared memory region" if kind else "shared memory region"
        return BadRequest(
            f"no {what} '{name[:100]}' is registered by this client (regions belong to the token "
            "that registered them); register it first",
            status,
        )

    def _check_on(self, kind: str) -> None:
        if not self.enabled:
            raise BadRequest("shared memory is off on this server (--shared-memory off)", 403)
        if kind not in ("system", "cuda"):
            raise BadRequest(f"unknown shared memory kind {kind!r}")
