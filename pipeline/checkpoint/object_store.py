"""A run directory on an object store: `train.output_dir=s3://bucket/prefix`, through fsspec (s3fs).

Two hosts that share no disk still share a bucket: every rank writes its own checkpoint shard there
(DCP's FsspecWriter), a restarted job resumes from there (FsspecReader), and consolidate/export
fetch a complete checkpoint from there. How a checkpoint is published without a rename, and how one
job owns the run, is said where it is done: layout.py and dcp.py (the marker written last) and
run_dir.py (the owner record).

The endpoint and credentials come only from the standard variables boto3/s3fs read themselves
(AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, AWS_DEFAULT_REGION, or a credentials
file): nothing of ours. Any S3-compatible server works (MinIO, moto_server, AWS S3).

Locations on the store are `StoreUrl`s (a str with `.name`, `.parent` and `/`), local ones `Path`s;
code that serves both asks `is_url(location)`. Listings are never cached: another host writes the
same prefixes.
"""

from __future__ import annotations

import email.utils
import json
import os
import re
from pathlib import PurePosixPath

from pipeline.errors import ConfigError

SCHEMES = ("s3",)
# S3's bucket naming rules, in short
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")


class StoreUrl(str):
    """`s3://bucket/key...`, with the few Path operations the run-directory code uses."""

    def __truediv__(self, part: str) -> "StoreUrl":
        return StoreUrl(f"{self.rstrip('/')}/{part}")

    @property
    def name(self) -> str:
        return self.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> "StoreUrl":
        return StoreUrl(self.rstrip("/").rsplit("/", 1)[0])

    # already absolute: what a run records as where it lives
    def resolve(self) -> "StoreUrl":
        return self

    @property
    def key(self) -> str:
        """bucket/key, as fsspec names it (no scheme)."""
        return self.split("://", 1)[1].rstrip("/")

    # What the run-directory code asks of a location, answered by the store ("directories" are
    # prefixes).
    def exists(self) -> bool:
        return exists(self)

    def is_file(self) -> bool:
        return filesystem().isfile(self.key)

    def is_dir(self) -> bool:
        return bool(files(self) or children(self))

    def read_text(self) -> str:
        return read_bytes(self).decode()

    def write_text(self, text: str) -> None:
        """One PUT: the object appears whole or not at all (what a local file needs a rename
        for)."""
        write_bytes(self, text.encode())

    def mkdir(self, parents: bool = False, exist_ok: bool = False) -> None:
        """Nothing to do: a prefix exists once an object is written under it."""

    def unlink(self, missing_ok: bool = False) -> None:
        try:
            filesystem().rm_file(self.key)
        except FileNotFoundError:
            if not missing_ok:
                raise


def location(path_or_url: str):
    """A local Path, or a StoreUrl for a URL (checked)."""
    from pathlib import Path

    return check_url(path_or_url) if is_url(path_or_url) else Path(path_or_url)


def is_url(location) -> bool:
    """A location with a scheme (s3://...) rather than a local path."""
    return isinstance(location, str) and "://" in location


def check_url(url: str, what: str = "train.output_dir") -> StoreUrl:
    """The URL's form, and that its filesystem is installed: config time, nothing is contacted."""
    scheme, _, rest = url.partition("://")
    if scheme not in SCHEMES:
        raise ConfigError(
            f"{what}={url}: '{scheme}://' is not a supported object store; use s3://<bucket>/<prefix> "
            "(any S3-compatible server: set AWS_ENDPOINT_URL), or a local path"
        )
    bucket, _, prefix = rest.partition("/")
    if not _BUCKET.match(bucket):
        raise ConfigError(
            f"{what}={url}: '{bucket}' is not a valid bucket name (3-63 characters: lowercase "
            "letters, digits, dots, hyphens); write s3://<bucket>/<prefix>"
        )
    if any(part in ("", ".", "..") for part in prefix.rstrip("/").split("/")) and prefix.rstrip(
        "/"
    ):
        raise ConfigError(
            f"{what}={url}: the prefix '{prefix}' has an empty, '.' or '..' part; write "
            "s3://<bucket>/<prefix>/<more>"
        )
    try:
        import s3fs  # noqa: F401
    except ImportError:
        raise ConfigError(
            f"{what}={url} needs s3fs, which is not installed: pip install -e '.[remote]'"
        ) from None
    return StoreUrl(url.rstrip("/"))


def endpoint_name() -> str:
    """The S3 endpoint the process talks to, as a message names it."""
    return os.environ.get("AWS_ENDPOINT_URL") or "AWS S3 (AWS_ENDPOINT_URL is not set)"


def check_reachable(url: str, what: str = "train.output_dir") -> None:
    """Credentials, endpoint and bucket, before anything runs: one clear line instead of a botocore
    traceback."""
    import botocore.session

    url = check_url(url, what)
    if botocore.session.Session().get_credentials() is None:
        raise ConfigError(
            f"{what}={url}: no S3 credentials: set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (and "
            "AWS_ENDPOINT_URL for a server other than AWS S3)"
        )
    endpoint = endpoint_name()
    bucket, _, prefix = url.key.partition("/")
    try:
        # One key under the run's prefix, not a listing of the bucket: a policy may allow only
        # prefix/*, and a large bucket's top level takes pages to list.
        filesystem().call_s3("list_objects_v2", Bucket=bucket, Prefix=prefix, MaxKeys=1)
    except FileNotFoundError:
        raise ConfigError(
            f"{what}={url}: bucket '{bucket}' does not exist on {endpoint}; create it first"
        ) from None
    except PermissionError as exc:
        raise ConfigError(
            f"{what}={url}: access to bucket '{bucket}' on {endpoint} was refused ({exc}); check "
            "AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY"
        ) from None
    except Exception as exc:
        # connection refused, DNS, TLS: botocore's zoo of errors
        raise ConfigError(
            f"{what}={url}: the object store at {endpoint} can't be reached ({type(exc).__name__}: "
            f"{str(exc)[:200]}); check AWS_ENDPOINT_URL"
        ) from None
    check_conditional_writes(url, endpoint, what)


def check_conditional_writes(url: StoreUrl, endpoint: str, what: str) -> None:
    """The run directory's single owner rests on a create that fails when the object exists
    (If-None-Match: *; run_dir.py). A server that ignores the header would let two jobs both
    "create" the lease, and one that answers otherwise than S3 does would end a claim in a
    traceback: tried once here, on a probe object."""
    import uuid

    probe = url / f".trainserve-write-probe-{uuid.uuid4().hex}"
    try:
        write_bytes(probe, b"1", mode="create")
        try:
            write_bytes(probe, b"2", mode="create")
        except FileExistsError:
            # refused, as S3 (AWS, MinIO, moto) does
            return
        except OSError as exc:
            raise ConfigError(
                f"{what}={url}: the object store at {endpoint} answered a conditional write "
                f"(If-None-Match) with {type(exc).__name__}: {str(exc)[:200]}, not the 412 S3 gives; "
                "trainserve's run-directory lease needs S3's conditional writes"
            ) from None
        raise ConfigError(
            f"{what}={url}: the object store at {endpoint} does not enforce conditional writes "
            "(If-None-Match: * let an existing object be overwritten): two jobs could both own a run "
            "there. Use a store that does (AWS S3, MinIO, Ceph RGW recent releases), or a local "
            "train.output_dir"
        ) from None
    except OSError as exc:
        # the first create: no write access, or a server that rejects the header
        raise ConfigError(
            f"{what}={url}: creating an object under it on {endpoint} failed ({type(exc).__name__}: "
            f"{str(exc)[:200]}); the run needs write access to its prefix and S3's conditional "
            "writes (If-None-Match)"
        ) from None
    finally:
        try:
            filesystem().rm_file(probe.key)
        except OSError:
            pass


def storage_options() -> dict:
    """s3fs's options, for our calls and DCP's: the listings cache off (a listing cached here would
    miss what another rank or host wrote), and the endpoint named, so that fsspec's cache of
    filesystem instances (keyed by these options) never hands out one made for another endpoint."""
    return {"use_listings_cache": False, "endpoint_url": os.environ.get("AWS_ENDPOINT_URL") or None}


def filesystem():
    import s3fs

    return s3fs.S3FileSystem(**storage_options())


def _quiet_clients() -> None:
    """botocore announces at INFO where it found the credentials and endpoint, on every rank, every
    start."""
    import logging

    for name in ("botocore", "aiobotocore", "s3fs"):
        logging.getLogger(name).setLevel(logging.WARNING)


_quiet_clients()


# --- reading and writing -----------------------------------------------------------------------


def exists(url: str) -> bool:
    return filesystem().exists(StoreUrl(url).key)


def read_bytes(url: str) -> bytes:
    return filesystem().cat_file(StoreUrl(url).key)


def write_bytes(url: str, data: bytes, **conditions) -> dict | None:
    """One PUT: the object appears whole or not at all. `conditions`: mode="create" (If-None-Match:
    *), IfMatch=<ETag>."""
    # S3's answer: its ETag
    return filesystem().pipe_file(StoreUrl(url).key, data, **conditions)


def write_json(url: str, payload) -> None:
    write_bytes(url, json.dumps(payload, indent=2).encode())


def _entries(url: str) -> list[dict]:
    """What is directly under `url` (a "directory"), as listed now (never from a cache); none if
    nothing is."""
    try:
        return filesystem().ls(StoreUrl(url).key, detail=True, refresh=True)
    except FileNotFoundError:
        return []


def files(url: str) -> dict[str, int]:
    """The objects directly under `url`, name -> size in bytes."""
    return {
        PurePosixPath(e["name"]).name: int(e["size"]) for e in _entries(url) if e["type"] == "file"
    }


def children(url: str) -> list[str]:
    """The names of the "directories" directly under `url`."""
    return sorted(PurePosixPath(e["name"]).name for e in _entries(url) if e["type"] == "directory")


def remove_tree(url: str, first: str | None = None) -> None:
    """Every object under `url`; `first` (a name in it) goes before the rest, so that a removal cut
    short leaves no object that makes the rest look valid (a checkpoint's marker)."""
    fs = filesystem()
    key = StoreUrl(url).key
    if first and fs.exists(f"{key}/{first}"):
        fs.rm_file(f"{key}/{first}")
    if fs.exists(key):
        fs.rm(key, recursive=True)


def copy_tree(source: str, destination: str, last: str | None = None) -> None:
    """Every object under `source` to `destination` (server-side copies), `last` (a name) after the
    rest."""
    fs = filesystem()
    src, dst = StoreUrl(source).key, StoreUrl(destination).key
    for name in sorted(files(source), key=lambda n: n == last):
        fs.copy(f"{src}/{name}", f"{dst}/{name}")


def fetch(url: str, local) -> None:
    """Every object directly under `url` into the local directory `local`."""
    fs = filesystem()
    os.makedirs(local, exist_ok=True)
    key = StoreUrl(url).key
    for name in files(url):
        fs.get_file(f"{key}/{name}", os.path.join(local, name))


def sha256(url: str, block: int = 8 << 20) -> str:
    """Read in blocks: a shard is as big as a rank's share of the model, and hashing it whole would
    hold it in memory once more after every save."""
    import hashlib

    digest = hashlib.sha256()
    with filesystem().open(StoreUrl(url).key, "rb", block_size=block) as f:
        while chunk := f.read(block):
            digest.update(chunk)
    return digest.hexdigest()


def etag(url: str) -> str | None:
    try:
        return filesystem().info(StoreUrl(url).key, refresh=True)["ETag"]
    except FileNotFoundError:
        return None


def _bucket_and_key(url: str) -> tuple[str, str]:
    bucket, _, key = StoreUrl(url).key.partition("/")
    return bucket, key


def last_written(url: str) -> tuple[str, float] | None:
    """(ETag, seconds since the object was last written) of one object, None if there is none. The
    age is the store's own: its answer's Date header minus the object's LastModified, both from the
    store's clock, so the hosts' clocks, however far apart, do not enter into it (to within the
    header's one second)."""
    bucket, key = _bucket_and_key(url)
    try:
        head = filesystem().call_s3("head_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return None
    now = email.utils.parsedate_to_datetime(head["ResponseMetadata"]["HTTPHeaders"]["date"])
    return head["ETag"], max(0.0, (now - head["LastModified"]).total_seconds())


def remove_if_unchanged(url: str, tag: str) -> bool:
    """Deletes the object only while its ETag is `tag` (a conditional delete, If-Match: S3 has them
    since 2025-09); False, and nothing deleted, when it was written since or is gone. The ETag is
    compared first too: a store that ignores If-Match on a delete, or a botocore too old to send it
    (then a plain delete), still leaves an object written since."""
    from botocore.exceptions import ParamValidationError

    if etag(url) != tag:
        return False
    bucket, key = _bucket_and_key(url)
    fs = filesystem()
    try:
        fs.call_s3("delete_object", Bucket=bucket, Key=key, IfMatch=tag)
    except ParamValidationError:
        # this botocore does not know IfMatch on DeleteObject
        fs.call_s3("delete_object", Bucket=bucket, Key=key)
    except FileNotFoundError:
        return False
    except OSError as exc:
        # s3fs's translation of the store's answer; the answer itself is its cause
        answer = getattr(exc.__cause__, "response", None) or {}
        if answer.get("Error", {}).get("Code") in ("PreconditionFailed", "412"):
            return False
        raise
    return True
