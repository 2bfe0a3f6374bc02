"""S3 (and S3-compatible servers) as a store: ``s3://bucket/prefix``.

Writes stream: an object writer buffers one part, uploads full parts on a small thread pool
(at most ``max_concurrency`` in flight, so memory stays near ``part_size * (max_concurrency + 1)``)
and completes the multipart upload only after every part succeeded; any failure, or ``abort()``,
aborts the upload so no parts are left behind; once its upload completes or aborts, a writer
lists its key's uploads and aborts any other (a start whose answer was lost, then retried,
leaves one). An object smaller than one part at commit is sent
with a single PutObject. ``put_atomic(if_absent=True)`` is a conditional PutObject
(``If-None-Match: *``), which AWS S3 and SeaweedFS (>= 4.x, checked by the tests) enforce
atomically. Reads are ranged GETs, split across threads when large, pinned to the ETag seen at
open so a concurrently replaced object fails loudly instead of mixing two versions.

Retries happen at two levels, both bounded by ``max_attempts``: botocore's ``standard`` (or
``adaptive``) mode for throttling and 5xx answers, and our own loop with jittered exponential
backoff around part uploads, ranged GETs and commits for what botocore cannot replay — a
connection that resets while a response body streams in. Every request names ``self.bucket``;
object names are validated, so no byte goes anywhere else. Errors surface as
:class:`~s4format.errors.StorageError` naming ``s3://bucket/key``.
"""

from __future__ import annotations

import copy
import hashlib
import logging
import random
import threading
import time
from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Any, TypeVar
from urllib.parse import urlparse

import numpy as np

from s4format.errors import StorageError
from s4format.source import check_range
from s4weights.store.base import ObjectWriter, Store

log = logging.getLogger("s4weights")

MiB = 1 << 20
MIN_PART_SIZE = 5 * MiB  # S3's minimum for every part but the last
MAX_PARTS = 10_000
TAIL_CACHE = 256 << 10  # footer + (most) index: fetched once per source
READ_CHUNK = 8 * MiB  # reads larger than this are split across threads
# An object read whole (a load, a chain level) of at most this size is fetched whole at its
# first read: a small delta's tensors would otherwise cost a round trip each.
WHOLE_READ_MAX = 32 * MiB

# Error codes worth another attempt; anything else (403, 404, 412, ...) is final.
_RETRY_CODES = frozenset({
    "SlowDown", "Throttling", "ThrottlingException", "RequestTimeout", "RequestTimeTooSkewed",
    "InternalError", "ServiceUnavailable", "503", "500", "502", "504", "BadDigest",
    "IncompleteBody", "XAmzContentSHA256Mismatch"})

T = TypeVar("T")


def _botocore() -> Any:
    try:
        import boto3
        import botocore.exceptions
    except ImportError as exc:  # pragma: no cover - exercised only without the extra
        raise StorageError("s3:// URLs need boto3: pip install 's4weights[s3]'") from exc
    return boto3, botocore


def _error_code(exc: BaseException) -> str:
    response = getattr(exc, "response", None) or {}
    code = str(response.get("Error", {}).get("Code", ""))
    return code or str(response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))


def _transient(exc: BaseException) -> bool:
    _, botocore = _botocore()
    e = botocore.exceptions
    if isinstance(exc, e.ClientError):
        return _error_code(exc) in _RETRY_CODES
    if isinstance(exc, e.SSLError):
        return False  # an untrusted certificate does not become trusted by retrying
    if isinstance(exc, (e.ConnectTimeoutError, e.ReadTimeoutError, e.EndpointConnectionError)) \
            and not getattr(exc, "s4_body", False):
        # botocore has retried the request itself (up to max_attempts): another round of ours
        # would multiply the wait, to 25 timeouts of a minute each on an endpoint that stalls
        return False
    # Connection resets, timeouts and bodies cut short (urllib3 errors arrive wrapped in these
    # or as OSError subclasses).
    import urllib3.exceptions
    return isinstance(exc, (e.ConnectionError, e.ResponseStreamingError, e.IncompleteReadError,
                            e.HTTPClientError, urllib3.exceptions.HTTPError, OSError))


def _read_body(response: dict) -> bytes:
    """A GetObject response's body. An error while it streams in is marked: botocore cannot
    replay it, so :meth:`S3Store.call` retries it (a timeout among them)."""
    try:
        return response["Body"].read()
    except Exception as exc:
        exc.s4_body = True  # type: ignore[attr-defined]
        raise


def _describe(exc: BaseException) -> str:
    code = _error_code(exc)
    if code:
        msg = getattr(exc, "response", {}).get("Error", {}).get("Message", "")
        return f"{code}: {msg}" if msg else code
    return f"{type(exc).__name__}: {exc}"


def _parse_url(url: str) -> tuple[str, str]:
    parsed = urlparse(url)
    if parsed.scheme != "s3" or not parsed.netloc:
        raise ValueError(f"not an s3://bucket/prefix URL: {url!r}")
    if parsed.query or parsed.fragment:
        raise ValueError(f"s3 URL {url!r} may not carry a query or fragment")
    return parsed.netloc, parsed.path.strip("/")


class S3Store(Store):
    """Objects under ``s3://bucket/prefix``. ``client`` is a ready boto3 S3 client; otherwise
    one is built from ``session``/``profile``, ``endpoint_url`` and ``region`` on top of the
    standard AWS configuration (environment credentials, ``~/.aws``, ``AWS_ENDPOINT_URL``,
    ``AWS_CA_BUNDLE``)."""

    remote = True

    def __init__(self, bucket: str, prefix: str = "", *, client: Any = None,
                 session: Any = None, profile: str | None = None,
                 endpoint_url: str | None = None, region: str | None = None,
                 sse: str | None = None, sse_kms_key_id: str | None = None,
                 part_size: int = 8 * MiB, max_concurrency: int = 4, max_attempts: int = 5,
                 retry_mode: str = "standard") -> None:
        if sse not in (None, "AES256", "aws:kms"):
            raise ValueError(f"sse must be None, 'AES256' or 'aws:kms', not {sse!r}")
        if sse_kms_key_id and sse != "aws:kms":
            raise ValueError("sse_kms_key_id needs sse='aws:kms'")
        if part_size < MIN_PART_SIZE:
            raise ValueError(f"part_size must be at least {MIN_PART_SIZE} bytes (S3's minimum)")
        if max_concurrency < 1 or max_attempts < 1:
            raise ValueError("max_concurrency and max_attempts must be >= 1")
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        if "//" in self.prefix:
            # AWS keeps "a//b" apart from "a/b", while servers that store keys as paths
            # (SeaweedFS, MinIO) fold them: a run saved there would not be found again
            raise ValueError(f"S3 prefix {prefix!r} has an empty path segment ('//'); "
                             "write it with single slashes")
        self.url = f"s3://{bucket}/{self.prefix}".rstrip("/")
        self.part_size = part_size
        self.max_concurrency = max_concurrency
        self.max_attempts = max_attempts
        self._sse: dict[str, str] = {}
        if sse:
            self._sse["ServerSideEncryption"] = sse
        if sse_kms_key_id:
            self._sse["SSEKMSKeyId"] = sse_kms_key_id
        self.client = client if client is not None else self._make_client(
            session, profile, endpoint_url, region, retry_mode)
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    @classmethod
    def from_url(cls, url: str, **kwargs: Any) -> S3Store:
        """``s3://bucket`` or ``s3://bucket/prefix``; keyword arguments as for the class."""
        bucket, prefix = _parse_url(url)
        return cls(bucket, prefix, **kwargs)

    def child(self, sub: str) -> S3Store:
        """The store under ``prefix/sub``, sharing this one's client and settings."""
        other = copy.copy(self)
        other.prefix = self.key(sub.strip("/"))
        other.url = f"s3://{self.bucket}/{other.prefix}"
        other._pool = None
        other._pool_lock = threading.Lock()
        return other

    def _make_client(self, session: Any, profile: str | None, endpoint_url: str | None,
                     region: str | None, retry_mode: str) -> Any:
        boto3, botocore = _botocore()
        from botocore.config import Config
        try:
            session = session or boto3.session.Session(profile_name=profile)
            config = Config(retries={"mode": retry_mode, "total_max_attempts": self.max_attempts},
                            max_pool_connections=max(10, 2 * self.max_concurrency + 2))
            return session.client("s3", endpoint_url=endpoint_url, region_name=region,
                                  config=config)
        except botocore.exceptions.BotoCoreError as exc:
            raise StorageError(f"{self.url}: cannot configure the S3 client: {exc}") from exc

    # -- plumbing -------------------------------------------------------------------------

    def key(self, name: str) -> str:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") for p in parts):
            raise StorageError(f"invalid object name {name!r}")
        return f"{self.prefix}/{name}" if self.prefix else name

    def _where(self, key: str) -> str:
        return f"s3://{self.bucket}/{key}"

    def pool(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(self.max_concurrency,
                                                thread_name_prefix="s4w-s3-read")
            return self._pool

    def call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        """Run ``fn`` with bounded, jittered exponential backoff on transient failures;
        anything else (or the last failure) becomes a StorageError naming the object."""
        _, botocore = _botocore()
        import urllib3.exceptions
        attempts = self.max_attempts
        for attempt in range(1, attempts + 1):
            try:
                return fn()
            except (botocore.exceptions.BotoCoreError, botocore.exceptions.ClientError,
                    urllib3.exceptions.HTTPError, OSError) as exc:
                if isinstance(exc, botocore.exceptions.NoCredentialsError):
                    raise StorageError(f"{what} {self._where(key)}: no AWS credentials found "
                                       "(set AWS_PROFILE or AWS_ACCESS_KEY_ID/"
                                       "AWS_SECRET_ACCESS_KEY)") from exc
                if attempt == attempts or not _transient(exc):
                    raise StorageError(f"{what} {self._where(key)} failed after {attempt} "
                                       f"attempt(s): {_describe(exc)}") from exc
                delay = min(2.0, 0.05 * 2 ** (attempt - 1)) * (0.5 + random.random())
                log.debug("%s %s: %s; retrying in %.2f s", what, self._where(key),
                          _describe(exc), delay)
                time.sleep(delay)
        raise AssertionError("unreachable")

    def _is_code(self, exc: BaseException, *codes: str) -> bool:
        cause = exc.__cause__ if isinstance(exc, StorageError) else exc
        return cause is not None and _error_code(cause) in codes

    # -- Store ----------------------------------------------------------------------------

    def writer(self, name: str) -> ObjectWriter:
        return _S3Writer(self, self.key(name))

    def put_atomic(self, name: str, data: bytes, *, if_absent: bool = False) -> None:
        key = self.key(name)
        cond = {"IfNoneMatch": "*"} if if_absent else {}
        try:
            self.call("put", key, lambda: self.client.put_object(
                Bucket=self.bucket, Key=key, Body=data, **cond, **self._sse))
        except StorageError as exc:
            if not self._is_code(exc, "PreconditionFailed", "412"):
                raise
            # A retried conditional put whose first attempt landed (the answer was lost) meets
            # its own object; that is success. Anything else there is a real conflict.
            if self._get_or_none(key) != data:
                raise StorageError(f"{self._where(key)} already exists") from None

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return self._get(key)
        except StorageError as exc:
            if self._is_code(exc, "NoSuchKey", "404"):
                return None
            raise

    def _get(self, key: str) -> bytes:
        return self.call("get", key, lambda: _read_body(self.client.get_object(
            Bucket=self.bucket, Key=key)))

    def get(self, name: str) -> bytes:
        key = self.key(name)
        data = self._get_or_none(key)
        if data is None:
            raise StorageError(f"{self._where(key)} does not exist")
        return data

    def source(self, name: str) -> S3Source:
        return S3Source(self, self.key(name))

    def list(self, prefix: str = "") -> list[str]:
        return sorted(self.list_versions(prefix))

    def list_versions(self, prefix: str = "") -> dict[str, str]:
        """Names under ``prefix`` with their ETag and time of writing, from the listing."""
        return {n: f"{o.get('ETag', '')}@{o.get('LastModified', '')}"
                for n, o in self._objects(prefix).items()}

    def modified(self, prefix: str = "") -> dict[str, float]:
        return {n: o["LastModified"].timestamp() for n, o in self._objects(prefix).items()}

    def _objects(self, prefix: str) -> dict[str, dict]:
        """Name under the store -> ListObjectsV2's entry, by name."""
        base = f"{self.prefix}/" if self.prefix else ""

        def pages() -> list[dict]:
            objects = []
            paginator = self.client.get_paginator("list_objects_v2")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base + prefix):
                objects.extend(page.get("Contents", ()))
            return objects

        objects = self.call("list", base + prefix, pages)
        return {o["Key"][len(base):]: o for o in sorted(objects, key=lambda o: o["Key"])
                if not o["Key"].endswith("/")}

    def delete(self, name: str) -> None:
        key = self.key(name)
        self.call("delete", key, lambda: self.client.delete_object(Bucket=self.bucket, Key=key))

    def exists(self, name: str) -> bool:
        key = self.key(name)
        try:
            self.call("head", key, lambda: self.client.head_object(Bucket=self.bucket, Key=key))
        except StorageError as exc:
            if self._is_code(exc, "NoSuchKey", "404", "NotFound"):
                return False
            raise
        return True

    def pending_uploads(self) -> list[dict[str, Any]]:
        """Multipart uploads under the prefix that were neither completed nor aborted."""
        base = f"{self.prefix}/" if self.prefix else ""

        def pages() -> list[dict[str, Any]]:
            out = []
            paginator = self.client.get_paginator("list_multipart_uploads")
            for page in paginator.paginate(Bucket=self.bucket, Prefix=base):
                out.extend(page.get("Uploads", ()))
            return out

        return self.call("list uploads", base, pages)

    def sweep(self, older_than_s: float = 3600.0, *, dirs: tuple[str, ...] | None = None,
              dry_run: bool = False) -> int:
        """Abort multipart uploads started more than ``older_than_s`` ago (left by processes
        that died mid-save): anywhere under the prefix, or only of objects right inside the
        folders ``dirs`` (``"data/"``). Returns how many (that would go, with ``dry_run``)."""
        cutoff = time.time() - older_than_s
        base = f"{self.prefix}/" if self.prefix else ""

        def ours(key: str) -> bool:
            name = key[len(base):]
            return dirs is None or any(
                name.startswith(d) and "/" not in name[len(d):] for d in dirs)
        stale = [u for u in self.pending_uploads()
                 if u["Initiated"].timestamp() < cutoff and ours(u["Key"])]
        if dry_run:
            return len(stale)
        for u in stale:
            self.call("abort upload", u["Key"], lambda u=u: self.client.abort_multipart_upload(
                Bucket=self.bucket, Key=u["Key"], UploadId=u["UploadId"]))
        return len(stale)


class _S3Writer(ObjectWriter):
    """Streams one object; see the module docstring for the memory bound and failure rules."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store = store
        self.key = key
        self._buf = bytearray(store.part_size)
        self._fill = 0
        self._upload_id: str | None = None
        self._inflight: dict[Future[dict[str, Any]], int] = {}
        self._parts: list[dict[str, Any]] = []
        self._pool: ThreadPoolExecutor | None = None
        self._done = False
        self._aborted = False
        self._started = False  # (a multipart upload was asked for)
        self.parts_uploaded = 0
        # write/commit and abort's clean-up never overlap (an interrupted save may abort from
        # the caller's thread while the writer thread is still inside write()); the flags are
        # set first, so a running write stops at its next part instead of starting uploads
        self._lock = threading.RLock()
        self._flags = threading.Lock()

    def _part_size(self, number: int) -> int:
        # Parts double every 1000 parts: ordinary checkpoints use part_size throughout, and the
        # 10,000-part limit still allows ~1,023,000 x part_size (8 TiB with 8 MiB parts).
        return self.store.part_size << ((number - 1) // 1000)

    def write(self, data: bytes | memoryview) -> int:
        if self._done:
            raise StorageError(f"{self.store._where(self.key)}: write after commit/abort")
        with self._lock:
            return self._write(memoryview(data).cast("B"))

    def _write(self, mv: memoryview) -> int:
        pos, n = 0, len(mv)
        try:
            while pos < n:
                if self._done:
                    raise StorageError(f"{self.store._where(self.key)}: aborted during a write")
                take = min(len(self._buf) - self._fill, n - pos)
                self._buf[self._fill:self._fill + take] = mv[pos:pos + take]
                self._fill += take
                pos += take
                if self._fill == len(self._buf):
                    self._send_part()
        except BaseException:
            self.abort()
            raise
        return n

    def _send_part(self, *, last: bool = False) -> None:
        if self._aborted:
            raise StorageError(f"{self.store._where(self.key)}: aborted during a write")
        if self._upload_id is None:
            self._started = True
            self._upload_id = self.store.call(
                "start upload", self.key, lambda: self.store.client.create_multipart_upload(
                    Bucket=self.store.bucket, Key=self.key, ChecksumAlgorithm="CRC32",
                    **self.store._sse)["UploadId"])
            self._pool = ThreadPoolExecutor(self.store.max_concurrency,
                                            thread_name_prefix="s4w-s3-part")
        assert self._pool is not None
        # Bounded queue: wait for a slot before handing the buffer over, so at most
        # max_concurrency parts plus the one being filled are held.
        while len(self._inflight) >= self.store.max_concurrency:
            self._reap(wait(self._inflight, return_when=FIRST_COMPLETED).done)
        number = len(self._parts) + len(self._inflight) + 1
        if number > MAX_PARTS:
            raise StorageError(f"{self.store._where(self.key)}: more than {MAX_PARTS} parts")
        if last:
            body, self._buf = self._buf[:self._fill], bytearray()
        else:
            body, self._buf = self._buf, bytearray(self._part_size(number + 1))
        self._fill = 0
        self._inflight[self._pool.submit(self._upload_part, number, body)] = number

    def _upload_part(self, number: int, body: bytearray) -> dict[str, Any]:
        s = self.store
        r = s.call(f"upload part {number} of", self.key, lambda: s.client.upload_part(
            Bucket=s.bucket, Key=self.key, UploadId=self._upload_id, PartNumber=number,
            Body=body, ChecksumAlgorithm="CRC32"))
        part = {"PartNumber": number, "ETag": r["ETag"]}
        if r.get("ChecksumCRC32"):  # servers that do not echo flexible checksums omit it
            part["ChecksumCRC32"] = r["ChecksumCRC32"]
        return part

    def _reap(self, done: set[Future[dict[str, Any]]]) -> None:
        for f in done:
            del self._inflight[f]
            self._parts.append(f.result())  # raises the part's StorageError
            self.parts_uploaded += 1

    def commit(self) -> None:
        with self._lock:
            self._commit()

    def _commit(self) -> None:
        if self._aborted:
            raise StorageError(f"{self.store._where(self.key)}: commit after the upload was "
                               "aborted (an earlier write failed or abort() was called)")
        if self._done:
            return
        s = self.store
        try:
            if self._upload_id is None:
                body = bytes(self._buf[:self._fill])
                s.call("put", self.key, lambda: s.client.put_object(
                    Bucket=s.bucket, Key=self.key, Body=body, **s._sse))
            else:
                if self._fill:
                    self._send_part(last=True)
                self._reap(wait(self._inflight).done)
                self._complete()
        except BaseException:
            self.abort()
            raise
        self._done = True
        self._shutdown()

    def _complete(self) -> None:
        s = self.store
        parts = sorted(self._parts, key=lambda p: p["PartNumber"])
        try:
            s.call("complete upload", self.key, lambda: s.client.complete_multipart_upload(
                Bucket=s.bucket, Key=self.key, UploadId=self._upload_id,
                MultipartUpload={"Parts": parts}))
        except StorageError as exc:
            # A retried complete whose first attempt succeeded finds no upload any more; the
            # object's multipart ETag (MD5 of the part MD5s, "-N") tells whether it is ours.
            if not s._is_code(exc, "NoSuchUpload") or self._etag_now() != _multipart_etag(parts):
                raise
        self._abort_strays()
        self._upload_id = None

    def _abort_strays(self) -> None:
        """Abort this key's uploads other than the writer's own: a start of the upload whose
        answer was lost, and which was retried, left one that only a listing finds (the key
        is this save's alone)."""
        s = self.store
        try:
            found = s.call("list uploads", self.key, lambda: s.client.list_multipart_uploads(
                Bucket=s.bucket, Prefix=self.key).get("Uploads", []))
            for u in found:
                if u["Key"] == self.key and u["UploadId"] != self._upload_id:
                    s.call("abort upload", self.key,
                           lambda u=u: s.client.abort_multipart_upload(
                               Bucket=s.bucket, Key=self.key, UploadId=u["UploadId"]))
        except StorageError as exc:
            # (a role without s3:ListBucketMultipartUploads: nothing to do but the sweep)
            (log.debug if s._is_code(exc, "AccessDenied") else log.warning)(
                "%s; S3Store.sweep() or a bucket lifecycle rule will remove its parts", exc)

    def _etag_now(self) -> str | None:
        s = self.store
        try:
            return s.call("head", self.key, lambda: s.client.head_object(
                Bucket=s.bucket, Key=self.key))["ETag"]
        except StorageError:
            return None

    def abort(self) -> None:
        with self._flags:
            if self._done:
                return
            self._done = self._aborted = True
        with self._lock:  # a write in progress stops at its next part, then this cleans up
            self._abort()

    def _abort(self) -> None:
        self._buf = bytearray()
        s = self.store
        if self._pool is not None:
            for f in self._inflight:
                f.cancel()
            # Parts still uploading could land after an abort and resurrect storage; wait.
            wait(self._inflight)
        self._shutdown()
        if self._upload_id is not None:
            try:
                s.call("abort upload", self.key, lambda: s.client.abort_multipart_upload(
                    Bucket=s.bucket, Key=self.key, UploadId=self._upload_id))
            except StorageError as exc:
                if not s._is_code(exc, "NoSuchUpload"):
                    log.warning("%s; looking for the upload to abort it again", exc)
            self._upload_id = None
        if self._started:  # (this upload again if its abort failed, and any other start's)
            self._abort_strays()

    def _shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._pool = None
        self._inflight.clear()


def _multipart_etag(parts: list[dict[str, Any]]) -> str:
    digest = hashlib.md5(b"".join(bytes.fromhex(p["ETag"].strip('"')) for p in parts),
                         usedforsecurity=False)
    return f'"{digest.hexdigest()}-{len(parts)}"'


class S3Source:
    """A :class:`~s4format.source.ByteSource` over one S3 object, by ranged GETs."""

    def __init__(self, store: S3Store, key: str) -> None:
        self.store = store
        self.key = key
        self.name = store._where(key)
        head = store.call("head", key, lambda: store.client.head_object(
            Bucket=store.bucket, Key=key))
        self._size = int(head["ContentLength"])
        self._etag = head.get("ETag")
        self._tail: np.ndarray | None = None
        self._tail_start = max(0, self._size - TAIL_CACHE)
        self._tail_lock = threading.Lock()
        self._whole: np.ndarray | None = None
        self._whole_wanted = False
        self._count_lock = threading.Lock()
        self.bytes_fetched = 0
        self.requests = 0

    def size(self) -> int:
        return self._size

    def read_whole(self) -> None:
        """The caller will read every tensor (a load): an object of at most
        :data:`WHOLE_READ_MAX` bytes is then fetched whole, in parallel parts, at the first
        read before its tail, and served from memory after."""
        self._whole_wanted = self._size <= WHOLE_READ_MAX

    def read_at(self, offset: int, length: int) -> np.ndarray:
        check_range(self.name, offset, length, self._size)
        if length == 0:
            return np.empty(0, dtype=np.uint8)
        if self._whole_wanted and offset < self._tail_start:
            with self._tail_lock:
                if self._whole is None:
                    whole = self._ranged(0, self._size)
                    whole.flags.writeable = False  # (every read shares it)
                    self._whole = whole
        if self._whole is not None:
            return self._whole[offset:offset + length]
        if offset >= self._tail_start:
            with self._tail_lock:
                if self._tail is None:
                    self._tail = self._fetch(self._tail_start, self._size - self._tail_start)
            start = offset - self._tail_start
            return self._tail[start:start + length]
        return self._ranged(offset, length)

    def _ranged(self, offset: int, length: int) -> np.ndarray:
        """Bytes ``offset..offset + length`` by ranged GETs, split across threads above
        READ_CHUNK."""
        if length <= READ_CHUNK:
            return self._fetch(offset, length)
        out = np.empty(length, dtype=np.uint8)
        chunks = [(a, min(READ_CHUNK, length - a)) for a in range(0, length, READ_CHUNK)]

        def one(a: int, n: int) -> None:
            out[a:a + n] = self._fetch(offset + a, n)

        for f in [self.store.pool().submit(one, a, n) for a, n in chunks]:
            f.result()
        return out

    def _fetch(self, offset: int, length: int) -> np.ndarray:
        s = self.store
        pin = {"IfMatch": self._etag} if self._etag else {}

        def get() -> bytes:
            r = s.client.get_object(Bucket=s.bucket, Key=self.key,
                                    Range=f"bytes={offset}-{offset + length - 1}", **pin)
            data = _read_body(r)
            with self._count_lock:
                self.bytes_fetched += len(data)
                self.requests += 1
            if len(data) != length:
                raise OSError(f"short body: {len(data)} of {length} bytes")
            return data

        try:
            data = s.call(f"read {length} bytes at {offset} of", self.key, get)
        except StorageError as exc:
            if s._is_code(exc, "PreconditionFailed", "412"):
                raise StorageError(f"{self.name} was replaced while it was being read") from exc
            raise
        return np.frombuffer(data, dtype=np.uint8)

    def close(self) -> None:
        self._whole = self._tail = None  # (the reads still held keep theirs)
        self._whole_wanted = False


def open_object(url: str, **kwargs: Any) -> tuple[S3Store, str]:
    """The store holding ``s3://bucket/dir/name`` and the object's name in it."""
    bucket, path = _parse_url(url)
    prefix, _, name = path.rpartition("/")
    if not name:
        raise ValueError(f"{url!r} names no object")
    return S3Store(bucket, prefix, **kwargs), name


__all__ = ["S3Source", "S3Store", "open_object"]
