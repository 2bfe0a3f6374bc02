"""Checkpoint stores against what a review found: two saves of one step that race, retention
during another save, damaged or stray manifests, a retention that fails after the commit, a
manifest write that fails, odd step types, and an S3 endpoint that stalls."""

from __future__ import annotations

import logging
import os
import re
import socket
import threading
import time

import pytest
import torch

import s4weights
from s4format.errors import StorageError
from s4weights import chain, manifests
from s4weights.store.local import LocalStore, _LocalWriter


def _state(v: float, who: str) -> dict:
    return {"w": torch.full((64,), v), "who": who}


def _files(root) -> list[str]:
    return sorted(os.listdir(root / "data"))


def _during_manifest(monkeypatch, step: int, action) -> None:
    """Run ``action`` once, just before the manifest of ``step`` is written (as a second
    process, or a save from a signal handler, would land there)."""
    real = LocalStore.put_atomic
    done = []

    def put(self, name, data, *, if_absent=False):
        if name == f"manifests/{step:012d}.json" and not done:
            done.append(1)
            action()
        return real(self, name, data, if_absent=if_absent)
    monkeypatch.setattr(LocalStore, "put_atomic", put)


def _before_data_commit(monkeypatch, action) -> None:
    """Run ``action`` once, just before the first data file of a save is committed."""
    real = _LocalWriter.commit
    done = []

    def commit(self, **kw):
        if not done and "/data/" in str(self.final):
            done.append(1)
            action()
        return real(self, **kw)
    monkeypatch.setattr(_LocalWriter, "commit", commit)


@pytest.mark.parametrize("hook", [_before_data_commit, lambda mp, a: _during_manifest(mp, 10, a)])
def test_two_saves_of_one_step_keep_the_winner(tmp_path, monkeypatch, hook) -> None:
    # B saves step 10 while A is saving it: B's file lands before A's (A's replaced it, when
    # both had one name), or between A's file and A's manifest
    s4weights.save_checkpoint(_state(0, "base"), tmp_path, step=1)
    hook(monkeypatch, lambda: s4weights.save_checkpoint(_state(2, "B"), tmp_path, step=10,
                                                        delta=False))
    with pytest.raises(StorageError, match="already exists"):
        s4weights.save_checkpoint(_state(1, "A"), tmp_path, step=10, delta=False)
    got = s4weights.load_checkpoint(tmp_path, step=10)
    assert got["who"] == "B" and torch.equal(got["w"], torch.full((64,), 2.0))
    # the loser deleted its own file; the winner's is the one its manifest names
    named = {i.file for i in chain.list_checkpoints(tmp_path)}
    assert {f"data/{n}" for n in _files(tmp_path)} == named
    assert all(re.fullmatch(r"\d{12}-[0-9a-f]{8}\.s4w", n) for n in _files(tmp_path))


def test_a_failed_manifest_write_leaves_no_file_and_the_step_free(tmp_path, monkeypatch) -> None:
    s4weights.save_checkpoint(_state(0, "base"), tmp_path, step=1)
    real = LocalStore.put_atomic

    def fail(self, name, data, *, if_absent=False):
        if name.startswith("manifests/000000000002"):
            raise StorageError("injected: the manifest write failed")
        return real(self, name, data, if_absent=if_absent)
    monkeypatch.setattr(LocalStore, "put_atomic", fail)
    with pytest.raises(StorageError, match="injected"):
        s4weights.save_checkpoint(_state(1, "A"), tmp_path, step=2)
    assert len(_files(tmp_path)) == 1
    monkeypatch.setattr(LocalStore, "put_atomic", real)
    s4weights.save_checkpoint(_state(1, "A"), tmp_path, step=2)
    assert s4weights.load_checkpoint(tmp_path)["who"] == "A"


def test_retention_keeps_a_newer_step_committed_during_the_save(tmp_path, monkeypatch) -> None:
    for s in (1, 2, 3):
        s4weights.save_checkpoint(_state(s, str(s)), tmp_path, step=s, delta=False)
    _during_manifest(monkeypatch, 4, lambda: s4weights.save_checkpoint(
        _state(5, "5"), tmp_path, step=5, delta=False))
    s4weights.save_checkpoint(_state(4, "4"), tmp_path, step=4, delta=False, keep_last=2)
    assert sorted(i.step for i in chain.list_checkpoints(tmp_path)) == [4, 5]
    assert s4weights.load_checkpoint(tmp_path)["who"] == "5"


def test_damaged_and_stray_manifests_are_skipped_with_a_warning(tmp_path, caplog) -> None:
    for s in (1, 2):
        s4weights.save_checkpoint(_state(s, str(s)), tmp_path, step=s)
    (tmp_path / "manifests" / f"{2:012d}.json").write_bytes(b"{not json")
    (tmp_path / "manifests" / "notes.json").write_text('{"hello": 1}')
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        assert [i.step for i in chain.list_checkpoints(tmp_path)] == [1]
    assert "000000000002.json is malformed" in caplog.text and "notes.json" in caplog.text
    assert s4weights.load_checkpoint(tmp_path)["who"] == "1"
    s4weights.save_checkpoint(_state(3, "3"), tmp_path, step=3)
    assert s4weights.load_checkpoint(tmp_path, step=3)["who"] == "3"
    with pytest.raises(StorageError, match="already exists"):  # its manifest is still there
        s4weights.save_checkpoint(_state(2, "2"), tmp_path, step=2)


def test_a_retention_that_fails_after_the_commit_only_warns(tmp_path, monkeypatch,
                                                            caplog) -> None:
    s4weights.save_checkpoint(_state(1, "1"), tmp_path, step=1, delta=False)

    def refuse(self, name):
        raise StorageError(f"cannot delete {name}: Operation not permitted")
    monkeypatch.setattr(LocalStore, "delete", refuse)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        info = s4weights.save_checkpoint(_state(2, "2"), tmp_path, step=2, delta=False,
                                         keep_last=1)
    assert info.step == 2 and "retention failed" in caplog.text
    monkeypatch.undo()
    assert s4weights.load_checkpoint(tmp_path)["who"] == "2"
    s4weights.save_checkpoint(_state(3, "3"), tmp_path, step=3, delta=False, keep_last=1)
    assert [i.step for i in chain.list_checkpoints(tmp_path)] == [3]
    assert len(_files(tmp_path)) == 1


def test_a_local_delete_that_fails_is_a_storage_error(tmp_path, monkeypatch) -> None:
    store = LocalStore(tmp_path)
    (tmp_path / "x").write_bytes(b"1")

    def unlink(self, missing_ok=False):
        raise PermissionError(1, "Operation not permitted")
    monkeypatch.setattr(type(tmp_path), "unlink", unlink)
    with pytest.raises(StorageError, match=r"cannot delete .*x: Operation not permitted"):
        store.delete("x")


@pytest.mark.parametrize("step", [8.5, "5", True, None])
def test_steps_must_be_ints(tmp_path, step) -> None:
    with pytest.raises(TypeError, match="step must be an int"):
        s4weights.save_checkpoint(_state(0, "x"), tmp_path, step=step)
    if step is not None:
        with pytest.raises(TypeError, match="step must be an int"):
            s4weights.load_checkpoint(tmp_path, step=step)


def test_stores_written_before_the_token_still_load(tmp_path) -> None:
    # a store whose files are named data/<step>.s4w, as before the token
    for s in (1, 2):
        info = s4weights.save_checkpoint(_state(s, str(s)), tmp_path, step=s)
        old = f"data/{s:012d}.s4w"
        os.rename(tmp_path / info.file, tmp_path / old)
        m = tmp_path / "manifests" / f"{s:012d}.json"
        m.write_bytes(m.read_bytes().replace(info.file.encode(), old.encode()))
    chain._PARENT_CACHE.clear()  # a fresh process: the parent is read from the store
    assert s4weights.load_checkpoint(tmp_path)["who"] == "2"
    s4weights.save_checkpoint(_state(3, "3"), tmp_path, step=3, keep_last=1)
    assert s4weights.load_checkpoint(tmp_path)["who"] == "3"


def test_load_reads_a_fifo_through(tmp_path) -> None:
    fifo = tmp_path / "pipe.s4w"
    os.mkfifo(fifo)
    writer = threading.Thread(target=lambda: s4weights.save(_state(7, "fifo"), fifo))
    writer.start()
    got = s4weights.load(fifo)
    writer.join(30)
    assert got["who"] == "fifo" and torch.equal(got["w"], torch.full((64,), 7.0))


def test_a_stalled_s3_endpoint_fails_after_botocore_s_attempts_not_25() -> None:
    boto3 = pytest.importorskip("boto3")
    from botocore.config import Config

    from s4weights.store.s3 import S3Store
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(64)
    conns: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                conns.append(srv.accept()[0])
            except OSError:
                return
    threading.Thread(target=accept, daemon=True).start()
    client = boto3.client(
        "s3", endpoint_url=f"http://127.0.0.1:{srv.getsockname()[1]}", region_name="us-east-1",
        aws_access_key_id="k", aws_secret_access_key="s",
        config=Config(read_timeout=0.5, connect_timeout=0.5,
                      retries={"mode": "standard", "total_max_attempts": 3}))
    t0 = time.perf_counter()
    try:
        with pytest.raises(StorageError, match="Read timeout"):
            S3Store("b", "p", client=client, max_attempts=3).get("x")
        assert len(conns) <= 3 and time.perf_counter() - t0 < 10
    finally:
        srv.close()
        for c in conns:
            c.close()


def test_manifests_are_read_once_per_version(tmp_path, monkeypatch) -> None:
    for s in range(1, 6):
        s4weights.save_checkpoint(_state(s, str(s)), tmp_path, step=s)
    gets: list[str] = []
    real = LocalStore.get
    monkeypatch.setattr(LocalStore, "get", lambda self, n: (gets.append(n), real(self, n))[1])
    manifests._MANIFESTS.clear()  # a fresh process
    assert len(chain.list_checkpoints(tmp_path)) == 5 and len(gets) == 5
    gets.clear()
    assert len(chain.list_checkpoints(tmp_path)) == 5 and gets == []
    # a manifest written again is read again, and a deleted one is gone
    m = tmp_path / "manifests" / f"{3:012d}.json"
    m.write_bytes(m.read_bytes().replace(b'"created"', b'"created" '))
    (tmp_path / "manifests" / f"{5:012d}.json").unlink()
    assert [i.step for i in chain.list_checkpoints(tmp_path)] == [1, 2, 3, 4]
    assert gets == ["manifests/000000000003.json"]
    assert s4weights.load_checkpoint(tmp_path)["who"] == "4"


def test_retention_keeps_a_step_committed_between_its_listings(tmp_path, monkeypatch) -> None:
    for s in (1, 2, 3):
        s4weights.save_checkpoint(_state(s, str(s)), tmp_path, step=s, delta=False)
    real = manifests._retain
    done = []

    def retain(store, keep, infos=None):
        if not done:  # another process commits step 5 after retention has listed
            done.append(1)
            s4weights.save_checkpoint(_state(5, "5"), tmp_path, step=5, delta=False)
        return real(store, keep, infos)
    monkeypatch.setattr(manifests, "_retain", retain)
    s4weights.save_checkpoint(_state(4, "4"), tmp_path, step=4, delta=False, keep_last=2)
    assert sorted(i.step for i in chain.list_checkpoints(tmp_path)) == [3, 4, 5]


def test_a_save_inside_a_listing_completes(tmp_path, monkeypatch) -> None:
    # a signal handler's save while the interrupted code lists the store's manifests
    for s in (1, 2, 3):
        s4weights.save_checkpoint(_state(s, str(s)), tmp_path, step=s)
    manifests._MANIFESTS.clear()
    real = LocalStore.get
    done = []

    def get(self, name):
        if name.startswith("manifests/") and not done:
            done.append(1)
            s4weights.save_checkpoint(_state(9, "handler"), tmp_path, step=9)
        return real(self, name)
    monkeypatch.setattr(LocalStore, "get", get)
    worker = threading.Thread(target=lambda: chain.list_checkpoints(tmp_path))
    worker.start()
    worker.join(60)
    assert not worker.is_alive()
    assert s4weights.load_checkpoint(tmp_path)["who"] == "handler"


class _LateStore(chain.Store):
    """A store whose manifest writes fail on the way back and land later (an S3 PUT that
    timed out at the client): what a save cannot tell from a write that did not happen."""

    def __init__(self, root) -> None:
        self.inner = LocalStore(root)
        self.url = f"late:{root}"
        self.pending: list[tuple[str, bytes]] = []

    def put_atomic(self, name, data, *, if_absent=False):
        if name.startswith("manifests/"):
            self.pending.append((name, data))
            raise StorageError(f"put {name}: Read timeout")
        self.inner.put_atomic(name, data, if_absent=if_absent)

    def land(self) -> None:
        for name, data in self.pending:
            self.inner.put_atomic(name, data, if_absent=True)

    def writer(self, name):
        return self.inner.writer(name)

    def get(self, name):
        return self.inner.get(name)

    def source(self, name):
        return self.inner.source(name)

    def list(self, prefix=""):
        return self.inner.list(prefix)

    def delete(self, name):
        self.inner.delete(name)


def test_a_manifest_write_that_may_still_land_keeps_its_file(tmp_path) -> None:
    store = _LateStore(tmp_path)
    with pytest.raises(StorageError, match="Read timeout"):
        s4weights.save_checkpoint(_state(1, "late"), store, step=1)
    store.land()
    assert s4weights.load_checkpoint(tmp_path)["who"] == "late"


def test_a_deeply_nested_manifest_is_skipped(tmp_path, caplog) -> None:
    s4weights.save_checkpoint(_state(1, "1"), tmp_path, step=1)
    (tmp_path / "manifests" / "zz.json").write_text("[" * 100_000 + "]" * 100_000)
    with caplog.at_level(logging.WARNING, logger="s4weights"):
        assert s4weights.load_checkpoint(tmp_path)["who"] == "1"
    assert "zz.json is malformed" in caplog.text


def test_a_socket_path_is_a_storage_error(tmp_path) -> None:
    path = tmp_path / "sock"
    server = socket.socket(socket.AF_UNIX)
    server.bind(str(path))
    try:
        with pytest.raises(StorageError, match="cannot open"):
            s4weights.load(path)
        with pytest.raises(StorageError, match="cannot open"):
            s4weights.save({"w": torch.ones(2)}, path)
    finally:
        server.close()


def test_load_checkpoint_of_a_file_says_what_to_do(tmp_path) -> None:
    path = tmp_path / "model.s4w"
    s4weights.save({"w": torch.ones(2)}, path)
    with pytest.raises(StorageError, match="it is a file, not a checkpoint directory"):
        s4weights.load_checkpoint(path)

