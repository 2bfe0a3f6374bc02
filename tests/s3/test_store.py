"""S3Store against a real S3 server: the Store contract, multipart streaming, conditional
commits, ranged reads, signatures, TLS and the failure rules (abort, never dangle)."""

from __future__ import annotations

import os

import numpy as np
import pytest

from s4format.errors import StorageError, TruncatedError
from s4weights.store import open_store
from s4weights.store.s3 import MIN_PART_SIZE, TAIL_CACHE, S3Store
from tests.s3 import seaweed
from tests.s3.proxy import FaultProxy

PART = MIN_PART_SIZE


def _store(admin, bucket: str, prefix: str = "run", **kw) -> S3Store:
    return S3Store(bucket, prefix, client=admin, part_size=PART, max_concurrency=2, **kw)


def _write(store: S3Store, name: str, data: bytes, chunk: int = 1 << 20) -> int:
    w = store.writer(name)
    for i in range(0, len(data), chunk):
        w.write(memoryview(data)[i:i + chunk])
    w.commit()
    return w.parts_uploaded


@pytest.mark.parametrize("size", [0, 1000, PART - 1, PART, 2 * PART + 12345])
def test_writer_round_trips_single_put_and_multipart(admin, bucket, size: int) -> None:
    store = _store(admin, bucket)
    data = os.urandom(size)
    parts = _write(store, "data/x.s4w", data)
    # Below one part at commit: one PutObject; from one full part on: multipart.
    assert parts == (0 if size < PART else -(-size // PART))
    src = store.source("data/x.s4w")
    assert src.size() == size
    assert src.read_at(0, size).tobytes() == data
    assert store.pending_uploads() == []
    key = admin.head_object(Bucket=bucket, Key="run/data/x.s4w")
    assert key["ContentLength"] == size


def test_writer_accepts_numpy_arrays(admin, bucket) -> None:
    store = _store(admin, bucket)
    arr = np.arange(3 * PART // 8, dtype="<i8")
    w = store.writer("a")
    w.write(arr)
    w.commit()
    assert store.get("a") == arr.tobytes()


def test_object_invisible_until_commit_and_abort_leaves_nothing(admin, bucket) -> None:
    store = _store(admin, bucket)
    w = store.writer("data/big")
    w.write(os.urandom(3 * PART))
    assert store.pending_uploads(), "three full parts must have started a multipart upload"
    assert store.list() == []
    w.abort()
    assert store.list() == []
    assert store.pending_uploads() == []
    with pytest.raises(StorageError, match="commit after the upload was aborted"):
        w.commit()


def test_failed_part_aborts_upload_and_raises_storage_error(admin, bucket, monkeypatch) -> None:
    store = _store(admin, bucket)
    real = admin.upload_part

    def flaky(**kw):
        if kw["PartNumber"] == 3:
            raise OSError("injected: disk on fire")
        return real(**kw)

    monkeypatch.setattr(admin, "upload_part", flaky)
    with pytest.raises(StorageError, match=rf"upload part 3 of s3://{bucket}/run/data/x"), \
            store.writer("data/x") as w:
        w.write(os.urandom(5 * PART))
    assert store.list() == []
    assert store.pending_uploads() == []


def _start_answered_lost(admin, monkeypatch) -> None:
    """The first start of a multipart upload reaches the server, and its answer is lost (the
    connection reset): the writer retries, and the first upload is one it never knew of."""
    real = admin.create_multipart_upload
    starts = []

    def lost(**kw):
        starts.append(real(**kw))
        if len(starts) == 1:
            raise OSError("injected: connection reset before the answer")
        return starts[-1]

    monkeypatch.setattr(admin, "create_multipart_upload", lost)


@pytest.mark.parametrize("end", ["commit", "abort"])
def test_an_upload_whose_start_answer_was_lost_is_not_left(admin, bucket, monkeypatch,
                                                          end: str) -> None:
    store = _store(admin, bucket)
    admin.create_multipart_upload(Bucket=bucket, Key="run/data/x.s4w.other")  # (not this key's)
    _start_answered_lost(admin, monkeypatch)
    w = store.writer("data/x.s4w")
    w.write(os.urandom(2 * PART + 5))
    assert len([u for u in store.pending_uploads() if u["Key"] == "run/data/x.s4w"]) == 2
    w.commit() if end == "commit" else w.abort()
    assert [u["Key"] for u in store.pending_uploads()] == ["run/data/x.s4w.other"]
    assert store.list() == (["data/x.s4w"] if end == "commit" else [])


def test_commit_replaces_existing_object_whole(admin, bucket) -> None:
    store = _store(admin, bucket)
    _write(store, "x", b"old")
    new = os.urandom(PART + 7)
    _write(store, "x", new)
    assert store.get("x") == new


def test_put_atomic_if_absent_is_a_conditional_put(admin, bucket) -> None:
    store = _store(admin, bucket)
    store.put_atomic("manifests/1.json", b"first", if_absent=True)
    with pytest.raises(StorageError, match=rf"s3://{bucket}/run/manifests/1.json already exists"):
        store.put_atomic("manifests/1.json", b"second", if_absent=True)
    assert store.get("manifests/1.json") == b"first"
    # A retry of the same put (its first answer lost) meets its own bytes: success.
    store.put_atomic("manifests/1.json", b"first", if_absent=True)
    store.put_atomic("manifests/1.json", b"replaced")
    assert store.get("manifests/1.json") == b"replaced"


def test_list_get_delete_exists(admin, bucket, monkeypatch) -> None:
    store = _store(admin, bucket)
    names = [f"data/{i:03d}.s4w" for i in range(11)] + ["manifests/a.json"]
    for n in names:
        store.put_atomic(n, n.encode())
    _store(admin, bucket, "run-other").put_atomic("data/zzz", b"elsewhere")
    real = admin.get_paginator

    def small_pages(op):  # force several ListObjectsV2 pages
        p = real(op)
        orig = p.paginate
        p.paginate = lambda **kw: orig(PaginationConfig={"PageSize": 4}, **kw)
        return p

    monkeypatch.setattr(admin, "get_paginator", small_pages)
    assert store.list() == sorted(names)
    assert store.list("data/") == sorted(names[:-1])
    assert store.exists("manifests/a.json") and not store.exists("manifests/b.json")
    assert store.get("data/003.s4w") == b"data/003.s4w"
    store.delete("data/003.s4w")
    store.delete("data/never-there")
    assert "data/003.s4w" not in store.list()
    with pytest.raises(StorageError, match=rf"s3://{bucket}/run/data/003.s4w does not exist"):
        store.get("data/003.s4w")


@pytest.mark.parametrize("name", ["", "/abs", "a//b", "../escape", "a/./b"])
def test_invalid_names_are_refused(admin, bucket, name: str) -> None:
    with pytest.raises(StorageError, match="invalid object name"):
        _store(admin, bucket).put_atomic(name, b"x")


def test_source_reads_ranges_caches_tail_and_refuses_past_end(admin, bucket) -> None:
    store = _store(admin, bucket)
    data = os.urandom(3 * TAIL_CACHE)
    store.put_atomic("f", data)
    src = store.source("f")
    assert src.read_at(len(data) - 32, 32).tobytes() == data[-32:]
    assert src.read_at(len(data) - 500, 100).tobytes() == data[-500:-400]
    assert src.requests == 1 and src.bytes_fetched == TAIL_CACHE
    assert src.read_at(10, 20).tobytes() == data[10:30]
    assert src.bytes_fetched == TAIL_CACHE + 20
    with pytest.raises(TruncatedError, match="runs past the end"):
        src.read_at(len(data) - 1, 2)


def test_large_read_is_split_across_threads(admin, bucket) -> None:
    store = _store(admin, bucket)
    data = os.urandom(20 << 20)
    _write(store, "f", data)
    src = store.source("f")
    assert src.read_at(1, len(data) - TAIL_CACHE - 1).tobytes() == data[1:-TAIL_CACHE]
    assert src.requests == 3  # 8 + 8 + 3 MiB chunks


def test_object_replaced_during_read_fails_loudly(admin, bucket) -> None:
    store = _store(admin, bucket)
    store.put_atomic("f", b"a" * (3 * TAIL_CACHE))
    src = store.source("f")
    store.put_atomic("f", b"b" * (3 * TAIL_CACHE))
    with pytest.raises(StorageError, match="replaced while it was being read"):
        src.read_at(0, 10)


def test_a_small_object_read_whole_is_fetched_once(admin, bucket) -> None:
    # what a load asks of a source (s4weights.store.base.reading_whole): one fetch of the
    # object at the first read before its tail, every later read from memory
    store = _store(admin, bucket)
    data = os.urandom(20 << 20)  # three ranged GETs, split across threads
    _write(store, "f", data)
    src = store.source("f")
    src.read_whole()
    assert src.read_at(len(data) - 40, 40).tobytes() == data[-40:]  # (the tail, as opened)
    assert src.requests == 1
    got = src.read_at(5, 100)
    assert got.tobytes() == data[5:105] and not got.flags.writeable
    assert src.requests == 4 and src.bytes_fetched == TAIL_CACHE + len(data)
    for at in (0, 12345, len(data) - TAIL_CACHE - 7, len(data) - 9):
        assert src.read_at(at, 9).tobytes() == data[at:at + 9]
    assert src.requests == 4


def test_a_large_object_read_whole_is_still_read_by_range(admin, bucket, monkeypatch) -> None:
    from s4weights.store import s3

    monkeypatch.setattr(s3, "WHOLE_READ_MAX", 2 * TAIL_CACHE)
    store = _store(admin, bucket)
    data = os.urandom(3 * TAIL_CACHE)
    store.put_atomic("f", data)
    src = store.source("f")
    src.read_whole()
    assert src.read_at(10, 20).tobytes() == data[10:30]
    assert src.requests == 1 and src.bytes_fetched == 20


def test_an_object_read_whole_reads_as_one_version(admin, bucket) -> None:
    # replaced before the whole fetch: refused (the fetch is pinned to the ETag seen at
    # open); replaced after it: every read is of the version fetched, with no GET
    store = _store(admin, bucket)
    for name in ("early", "late"):
        store.put_atomic(name, b"a" * (3 * TAIL_CACHE))
    early, late = store.source("early"), store.source("late")
    early.read_whole()
    late.read_whole()
    assert late.read_at(0, 10).tobytes() == b"a" * 10
    for name in ("early", "late"):
        store.put_atomic(name, b"b" * (3 * TAIL_CACHE))
    with pytest.raises(StorageError, match="replaced while it was being read"):
        early.read_at(0, 10)
    assert late.read_at(2 * TAIL_CACHE, 10).tobytes() == b"a" * 10
    assert late.requests == 1
    late.close()  # (drops what it fetched)
    assert late._whole is None


def test_a_load_of_a_small_file_fetches_it_once(aws_env, bucket, opened_sources) -> None:
    import torch

    import s4weights

    state = {f"w{i}": torch.randn(256, 256) for i in range(12)}
    url = f"s3://{bucket}/run/m.s4w"
    s4weights.save(state, url)
    opened_sources.clear()
    got = s4weights.load(url)
    assert all(torch.equal(got[k], v) for k, v in state.items())
    assert [src.requests for src in opened_sources] == [1]  # the whole file (3 MB), at once


def test_sse_aes256_is_requested(admin, bucket) -> None:
    store = _store(admin, bucket, sse="AES256")
    store.put_atomic("small", b"x")
    _write(store, "big", os.urandom(PART + 1))
    for key in ("run/small", "run/big"):
        assert admin.head_object(Bucket=bucket, Key=key)["ServerSideEncryption"] == "AES256"
    assert store.get("small") == b"x"


def test_wrong_credentials_are_rejected(server, bucket) -> None:
    bad = seaweed.admin_client(server.endpoint, attempts=1, secret="not-the-secret")
    store = _store(bad, bucket, max_attempts=1)
    with pytest.raises(StorageError, match=rf"s3://{bucket}/run/x.*SignatureDoesNotMatch"):
        store.put_atomic("x", b"nope")
    assert seaweed.admin_client(server.endpoint).list_objects_v2(Bucket=bucket)["KeyCount"] == 0


def test_from_url_uses_standard_aws_environment(aws_env, bucket) -> None:
    store = open_store(f"s3://{bucket}/team/run1")
    assert isinstance(store, S3Store) and store.url == f"s3://{bucket}/team/run1"
    store.put_atomic("hello", b"world", if_absent=True)
    assert store.list() == ["hello"]
    assert store.child("sub").url == f"s3://{bucket}/team/run1/sub"


def test_https_with_ca_bundle(server, aws_env, bucket, monkeypatch) -> None:
    monkeypatch.setenv("AWS_ENDPOINT_URL", server.https_endpoint)
    monkeypatch.setenv("AWS_CA_BUNDLE", str(server.ca_bundle))
    store = S3Store.from_url(f"s3://{bucket}/tls", part_size=PART)
    data = os.urandom(PART + 99)
    _write(store, "f", data)
    assert store.source("f").read_at(0, len(data)).tobytes() == data
    monkeypatch.delenv("AWS_CA_BUNDLE")
    untrusted = S3Store.from_url(f"s3://{bucket}/tls", max_attempts=1)
    with pytest.raises(StorageError, match=r"(?i)certificate"):
        untrusted.get("f")


def test_sweep_aborts_stale_uploads(admin, bucket) -> None:
    store = _store(admin, bucket)
    admin.create_multipart_upload(Bucket=bucket, Key="run/data/dead.s4w")
    admin.create_multipart_upload(Bucket=bucket, Key="elsewhere/keep")
    assert store.sweep(older_than_s=3600) == 0
    assert store.sweep(older_than_s=-60) == 1
    assert store.pending_uploads() == []
    assert len(admin.list_multipart_uploads(Bucket=bucket).get("Uploads", [])) == 1


def test_ranged_read_through_counting_proxy(server, bucket) -> None:
    proxy = FaultProxy(server.http_port)
    try:
        store = _store(seaweed.admin_client(proxy.endpoint), bucket)
        data = os.urandom(4 * TAIL_CACHE)
        store.put_atomic("f", data)
        proxy.reset_counts()
        src = store.source("f")
        assert src.read_at(1000, 5000).tobytes() == data[1000:6000]
        assert proxy.stats.to_client < 5000 + 4096  # the range and HTTP headers, nothing more
    finally:
        proxy.close()


def test_the_server_starts_again_when_a_port_was_taken(tmp_path, monkeypatch) -> None:
    # the test harness: a port weed found free may be taken before it binds it (weed then
    # exits with "address already in use"); the start is tried again in a fresh folder
    from tests.s3 import seaweed

    real, tried = seaweed._start, []

    def start(root, cert, key):
        tried.append(root.name)
        if len(tried) == 1:
            raise seaweed._PortTaken("weed mini exited with 255: address already in use")
        return real(root, cert, key)

    monkeypatch.setattr(seaweed, "_start", start)
    server = seaweed.start(tmp_path)
    try:
        seaweed.admin_client(server.endpoint).list_buckets()
        assert tried == ["attempt-1", "attempt-2"]
    finally:
        server.stop()
