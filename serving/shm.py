"""The KServe V2 shared-memory extensions as Triton defines them and `tritonclient` speaks them: a
client on the same host registers a region of its shared memory once, then sends each request's
inputs, and takes its outputs, by region, offset and size instead of as bytes in the message. A
large image then costs the server no bytes off a socket at all.

    system   POSIX shared memory (`/dev/shm/<key>`, what tritonclient.utils.shared_memory makes):
             the server keeps a descriptor of the object, never a mapping of it; an input is read
             with `preadv` straight into the rows of the batch it runs in (or an array of its own),
             an output written with `pwritev`
    cuda     device memory a client exported with cudaIpcGetMemHandle
             (tritonclient.utils.cuda_shared_memory): opened with cudaIpcOpenMemHandle where the
             server runs on a GPU; refused (400) elsewhere

Routes (HTTP; the same six as gRPC methods): `GET
/v2/{system,cuda}sharedmemory[/region/NAME]/status`, `POST .../region/NAME/register`, `POST
/v2/{system,cuda}sharedmemory[/region/NAME]/unregister`.

Why a descriptor and not a mapping: the client owns the object and may shrink it (`ftruncate`) at
any time; a mapping's pages past the new end then raise SIGBUS in whoever touches them, which kills
the server. A read or write on the descriptor past the end is only short: a 400 naming the region.

As Triton does it: unregistering a name that is not registered succeeds (its client helper
unregisters before it registers); a region a request in flight uses (`Use`: from the request's first
look-up of it to its end) stays open and listed until the last such request ends, and is let go
then; `--shared-memory off` answers status with an empty list and refuses register and unregister
(403).

Bounds: a region belongs to the token that registered it (the sha256 of the bearer token; one
namespace for all when the server has no token, whatever Authorization header a request carries):
another token neither sees, uses nor unregisters it. A client holds at most MAX_REGIONS regions and
--max-shared-memory-mb of them; the server holds at most `max_regions` (MAX_REGIONS_TOTAL, or a
quarter of its open-files limit where that is less) over every client, one descriptor each: past
either count a registration is a 429, past the host's descriptors or memory a 503 with Retry-After.
An input or output must lie inside its region (offset + byte size at most the registered size), and
an input's byte size must be exactly its tensor's.

Trust: a region names a shared-memory object by its key, and the server opens whatever its own user
may open. The token is what keeps strangers out; give it only to same-host clients you trust with
that (Triton's extension has the same property). `--shared-memory off` turns the extension off.
"""

from __future__ import annotations

import errno
import hashlib
import os
import re
import resource
import stat
import threading

import numpy as np

from serving import cuda
from serving.codec import BadRequest, Ref, byte_size_mismatch, serialized
from serving.envelope import Refused

# per client (token)
MAX_REGIONS = 256
# over every client: each system region holds one descriptor
MAX_REGIONS_TOTAL = 4096
SHM_DIR = "/dev/shm"
RETRY_AFTER = {"Retry-After": "1"}
_KEY = re.compile(r"/?[A-Za-z0-9_.@:+-]{1,250}")
# The most one read or write system call moves on Linux (0x7ffff000): bigger tensors take several.
_CHUNK = 0x7FFFF000


class Region:
    """One registered region: a system region's descriptor (fd), or a CUDA region's device address.
    `users`: the requests holding it now; `leaving`: unregistered while held, let go when the last
    of them ends."""

    __slots__ = (
        "name",
        "kind",
        "byte_size",
        "key",
        "offset",
        "device_id",
        "fd",
        "address",
        "users",
        "leaving",
    )

    def __init__(
        self,
        name: str,
        kind: str,
        byte_size: int,
        *,
        key: str = "",
        offset: int = 0,
        device_id: int = 0,
        fd: int = -1,
        address: int = 0,
    ):
        self.name, self.kind, self.byte_size = name, kind, byte_size
        self.key, self.offset, self.device_id = key, offset, device_id
        self.fd, self.address = fd, address
        self.users, self.leaving = 0, False

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
        elif self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def owner_of(authorization: str, tokened: bool = True) -> str:
    """Whose regions a request may use: its bearer token's, hashed (never kept); on a server without
    tokens (`tokened` False) everyone's one namespace, "", whatever the request's Authorization
    header says."""
    if not tokened:
        return ""
    token = authorization.partition(" ")[2].strip()
    return hashlib.sha256(token.encode()).hexdigest()[:32] if token else ""


def fd_budget() -> int:
    """The regions the server may hold in all: MAX_REGIONS_TOTAL, or a quarter of the open-files
    limit where that is less (the rest are for connections, models and logs)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return MAX_REGIONS_TOTAL
    return max(1, min(MAX_REGIONS_TOTAL, soft // 4))


class SharedMemory:
    """Every client's registered regions, by owner and then by (kind, name). Calls come from event
    loops (one or several) and the threads that decode requests: under a lock, none of them a scan
    of every region."""

    def __init__(
        self,
        max_bytes: int,
        enabled: bool = True,
        cuda_device: int | None = None,
        *,
        tokened: bool = True,
        max_regions: int | None = None,
    ):
        # per client
        self.max_bytes = max_bytes
        self.enabled = enabled
        # the server's GPU when it serves on one; None: no CUDA regions
        self.cuda_device = cuda_device
        self.tokened = tokened
        self.max_regions = fd_budget() if max_regions is None else max_regions
        self._lock = threading.Lock()
        self._owners: dict[str, dict[tuple[str, str], Region]] = {}
        # owner -> the byte_size of its regions; and the regions of every owner
        self._bytes: dict[str, int] = {}
        self._count = 0

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
        owner = owner_of(authorization, self.tokened)
        if not name or len(name) > 256:
            raise BadRequest(
                f"failed to register shared memory region {name[:40]!r}: invalid args: a {kind} "
                "shared memory region needs a name of 1 to 256 characters"
            )
        if byte_size <= 0 or offset < 0:
            raise BadRequest(
                f"failed to register shared memory region '{name}': invalid args: byte_size must be "
                f"positive and offset >= 0, got byte_size {byte_size}, offset {offset}"
            )
        with self._lock:
            mine = self._owners.get(owner, {})
            if (kind, name) in mine:
                raise BadRequest(
                    f"{kind} shared memory region '{name}' already in manager: unregister it first "
                    "or register under another name"
                )
            if len(mine) >= MAX_REGIONS:
                raise BadRequest(
                    f"this client has {len(mine)} shared memory regions registered, the most it may "
                    "hold; unregister some first",
                    429,
                )
            if self._count >= self.max_regions:
                raise BadRequest(
                    f"the server holds {self._count} shared memory regions, the most it takes from all "
                    "clients together; unregister some, or retry later",
                    429,
                )
            held = self._bytes.get(owner, 0)
            if held + byte_size > self.max_bytes:
                raise BadRequest(
                    f"registering {byte_size} bytes would take this client's shared memory to "
                    f"{held + byte_size} bytes, past --max-shared-memory-mb ({self.max_bytes} bytes)",
                    413,
                )
            region = (
                _open_system(name, key, offset, byte_size)
                if kind == "system"
                else self._open_cuda(name, raw_handle, device_id, byte_size)
            )
            self._owners.setdefault(owner, {})[(kind, name)] = region
            self._bytes[owner] = held + byte_size
            self._count += 1

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
        """One region, or (no name) every region of this client of that kind. A name not registered
        is no error (as Triton answers it). A region a request in flight holds is let go when the
        last such request ends; until then it stays listed."""
        self._check_on(kind)
        owner = owner_of(authorization, self.tokened)
        gone = []
        with self._lock:
            mine = self._owners.get(owner, {})
            names = [name] if name else [n for k, n in mine if k == kind]
            for each in names:
                region = mine.get((kind, each))
                if region is None:
                    continue
                if region.users:
                    region.leaving = True
                else:
                    gone.append(self._forget(owner, region))
        for region in gone:
            region.release()

    def _forget(self, owner: str, region: Region) -> Region:
        """(under _lock) The region out of the books; the caller releases it outside the lock."""
        mine = self._owners[owner]
        del mine[(region.kind, region.name)]
        if not mine:
            del self._owners[owner]
        self._bytes[owner] = self._bytes.get(owner, 0) - region.byte_size
        if self._bytes[owner] <= 0:
            del self._bytes[owner]
        self._count -= 1
        return region

    def status(self, authorization: str, kind: str, name: str | None = None) -> list[dict]:
        """This client's regions of `kind` (a region unregistered while in use, too, until its
        requests end); with the extension off, none (a named one: 404)."""
        if kind not in ("system", "cuda"):
            raise BadRequest(f"unknown shared memory kind {kind!r}")
        owner = owner_of(authorization, self.tokened)
        with self._lock:
            mine = self._owners.get(owner, {})
            if name:
                region = mine.get((kind, name))
                if region is None:
                    raise self._unknown(kind, name, 404)
                return [region.status()]
            return [mine[key].status() for key in sorted(mine) if key[0] == kind]

    def close(self) -> None:
        """Every region let go: now, or (one a request still holds) when that request ends; a
        descriptor closed under a read could be another file's by the time the read runs."""
        gone = []
        with self._lock:
            for owner, mine in list(self._owners.items()):
                for region in list(mine.values()):
                    if region.users:
                        region.leaving = True
                    else:
                        gone.append(self._forget(owner, region))
        for region in gone:
            region.release()

    # ---- inference ----

    def use(self, authorization: str, model: str = "") -> "Use":
        """One request's use of its client's regions (see Use), for model `model` (named in its
        refusals); `close` it when the request ends."""
        return Use(self, owner_of(authorization, self.tokened), model)

    def _hold(self, owner: str, name: str) -> Region:
        if not self.enabled:
            raise BadRequest(
                "Client shared memory is disabled on this server (--shared-memory off); send the "
                "tensors in the request",
                403,
            )
        with self._lock:
            mine = self._owners.get(owner, {})
            region = mine.get(("system", name)) or mine.get(("cuda", name))
            if region is None:
                raise self._unknown("", name, 400)
            region.users += 1
            return region

    def _let_go(self, owner: str, regions) -> None:
        gone = []
        with self._lock:
            for region in regions:
                region.users -= 1
                if not region.users and region.leaving:
                    gone.append(self._forget(owner, region))
        for region in gone:
            region.release()

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
            raise BadRequest(
                "Client shared memory is disabled on this server (--shared-memory off); send the "
                "tensors in the request, or start it with --shared-memory on",
                403,
            )
        if kind not in ("system", "cuda"):
            raise BadRequest(f"unknown shared memory kind {kind!r}")


class Use:
    """The regions one request reads and writes: each held from the request's first look-up of it
    until `close` (the request's end, answered or refused), so that an unregister meanwhile lets it
    go only then."""

    __slots__ = ("memory", "owner", "held", "model")

    def __init__(self, memory: SharedMemory, owner: str, model: str = ""):
        self.memory, self.owner, self.model = memory, owner, model
        self.held: dict[str, Region] = {}

    def region(self, name: str) -> Region:
        region = self.held.get(name)
        if region is None:
            region = self.held[name] = self.memory._hold(self.owner, name)
        return region

    def hold(self, refs: dict[str, Ref]) -> None:
        """The regions a request's outputs go to, held from now (its decode) to its end, as its
        inputs' are."""
        for ref in refs.values():
            self.region(ref.region)

    def close(self) -> None:
        held, self.held = self.held, {}
        if held:
            self.memory._let_go(self.owner, held.values())

    def read(self, ref: Ref, spec, count: int, into: np.ndarray | None = None) -> np.ndarray:
        """An input placed in shared memory, copied into `into` (a flat view of its rows in a batch
        buffer: the only copy) or an array of its own."""
        region = self.region(ref.region)
        want = count * spec.dtype.itemsize
        if ref.byte_size != want:
            raise BadRequest(
                byte_size_mismatch(spec.name, self.model, want, ref.byte_size)
                + f": shared_memory_byte_size must be the {want} bytes its shape takes of "
                f"{spec.datatype}"
            )
        _inside(region, ref, f"input '{spec.name}'")
        array = into if into is not None else np.empty(count, dtype=spec.dtype)
        if not want:
            return array
        # copied to the host once: the batch is gathered there
        if region.kind == "cuda":
            cuda.copy(array.ctypes.data, region.address + ref.offset, want, cuda.DEVICE_TO_HOST)
            return array
        position = region.offset + ref.offset
        got = _transfer(os.preadv, region, memoryview(array).cast("B"), position)
        if got < want:
            raise _short(region, f"input '{spec.name}'", position + want)
        return array

    def write(self, placed: dict[str, Ref], results: dict[str, np.ndarray]) -> dict[str, dict]:
        """Each output placed in shared memory written there (a BYTES one serialized); {output: its
        parameters in the answer, shared_memory_byte_size the bytes written}."""
        said = {}
        for name, ref in placed.items():
            region = self.region(ref.region)
            array = results[name]
            # A BYTES output goes in its binary form (each element a 4-byte length, then its bytes),
            # as Triton writes it and tritonclient's shared_memory.get_contents_as_numpy reads it.
            if array.dtype == object:
                array = np.frombuffer(serialized(array), dtype=np.uint8)
            array = np.ascontiguousarray(array)
            if array.nbytes > ref.byte_size:
                raise BadRequest(
                    f"output '{name}': {array.nbytes} bytes ({list(results[name].shape)} "
                    f"{results[name].dtype}) do not fit the {ref.byte_size} bytes given in shared "
                    f"memory region '{ref.region}'"
                )
            _inside(region, ref, f"output '{name}'")
            if region.kind == "cuda" and array.nbytes:
                cuda.copy(
                    region.address + ref.offset,
                    array.ctypes.data,
                    array.nbytes,
                    cuda.HOST_TO_DEVICE,
                )
            elif array.nbytes:
                position = region.offset + ref.offset
                # Past the object's end a write would grow it: refused instead, as a read there is.
                # (A shrink after this check only makes the write grow the object back; the server
                # is never at risk.)
                if _size(region) < position + array.nbytes:
                    raise _short(region, f"output '{name}'", position + array.nbytes)
                _transfer(os.pwritev, region, memoryview(array.reshape(-1)).cast("B"), position)
            said[name] = {
                "shared_memory_region": ref.region,
                "shared_memory_byte_size": array.nbytes,
                **({"shared_memory_offset": ref.offset} if ref.offset else {}),
            }
        return said


def _open_system(name: str, key: str, offset: int, byte_size: int) -> Region:
    if not isinstance(key, str) or not _KEY.fullmatch(key) or key.strip("/") in (".", ".."):
        raise BadRequest(
            f"cannot register shared memory region '{name}' - invalid shm key {key!r:.80}: not a "
            "POSIX shared memory name ('/name': letters, digits and _.@:+- after one leading '/')"
        )
    path = os.path.join(SHM_DIR, key.lstrip("/"))
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOMEM):
            raise Refused(
                503,
                f"system shared memory region '{name}': the server can't open another descriptor now "
                f"({exc.strerror}); retry later",
                RETRY_AFTER,
            ) from None
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
                f"failed to register shared memory region '{name}': invalid args: offset {offset} + "
                f"byte_size {byte_size} passes the end of shared memory key {key!r} "
                f"({info.st_size} bytes)"
            )
    except BaseException:
        os.close(fd)
        raise
    return Region(name, "system", byte_size, key=key, offset=offset, fd=fd)


def _transfer(call, region: Region, buffer: memoryview, position: int) -> int:
    """`call` (os.preadv or os.pwritev) over all of `buffer` from `position` of the region's object,
    in as many calls as it takes; the bytes moved (fewer only where the object ends first)."""
    done = 0
    try:
        while done < len(buffer):
            n = call(region.fd, [buffer[done : done + _CHUNK]], position + done)
            if n <= 0:
                break
            done += n
    except OSError as exc:
        raise BadRequest(
            f"shared memory region '{region.name}' (key {region.key!r}) can't be "
            f"{'read' if call is os.preadv else 'written'}: {exc.strerror}"
        ) from None
    return done


def _size(region: Region) -> int:
    return os.fstat(region.fd).st_size


def _short(region: Region, what: str, end: int) -> BadRequest:
    return BadRequest(
        f"{what}: shared memory region '{region.name}' (key {region.key!r}) ends before byte {end}: its "
        f"object holds {_size(region)} bytes now, less than when it was registered (offset "
        f"{region.offset} + byte_size {region.byte_size}); register the region again at the object's "
        "size"
    )


def _inside(region: Region, ref: Ref, what: str) -> None:
    """The tensor's bytes lie inside the registered region; else a 400 naming which bound they cross
    (in Triton's words too: an offset past the region, an offset and size past it, a sum past 64
    bits)."""
    if ref.offset < 0 or ref.byte_size < 0 or ref.offset + ref.byte_size > region.byte_size:
        where = (
            f"shared_memory_offset {ref.offset} + shared_memory_byte_size {ref.byte_size} pass the "
            f"end of region '{region.name}' ({region.byte_size} bytes registered)"
        )
        if ref.offset >= region.byte_size:
            why = f"Invalid offset for shared memory region '{region.name}'"
        elif ref.offset + ref.byte_size > 2**64 - 1:
            why = f"Integer overflow detected: byte_size {ref.byte_size} + offset {ref.offset}"
        else:
            why = f"Invalid offset + byte size for shared memory region '{region.name}'"
        raise BadRequest(f"{what}: {why}: {where}")
