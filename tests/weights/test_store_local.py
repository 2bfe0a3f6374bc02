"""LocalStore: atomic commits (temp file, fsync, rename, directory fsync), conditional puts,
aborts that leave nothing, refused names, sweeping dead writers' temporary files."""

from __future__ import annotations

import errno
import os
import threading
import time
from pathlib import Path

import pytest

from s4format.errors import StorageError
from s4weights.store import LocalStore, local, open_store
from s4weights.store.local import TMP_PREFIX


def _all_files(root: Path) -> list[str]:
    return sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())


def test_put_atomic_if_absent_refuses_an_existing_object(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_atomic("manifests/1.json", b"first", if_absent=True)
    with pytest.raises(StorageError, match=r"1\.json already exists"):
        store.put_atomic("manifests/1.json", b"second", if_absent=True)
    assert store.get("manifests/1.json") == b"first"
    assert _all_files(tmp_path) == ["manifests/1.json"]  # the loser's temp file is gone
    store.put_atomic("manifests/1.json", b"third")
    assert store.get("manifests/1.json") == b"third"


def test_writer_is_invisible_until_commit(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    w = store.writer("data/a.s4w")
    w.write(b"abc")
    w.write(memoryview(b"def"))
    assert store.list() == [] and not store.exists("data/a.s4w")
    w.commit()
    assert store.list("data/") == ["data/a.s4w"]
    assert store.get("data/a.s4w") == b"abcdef"
    assert store.source("data/a.s4w").read_at(2, 3).tobytes() == b"cde"


def test_writer_abort_and_exceptions_leave_nothing(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_atomic("data/a.s4w", b"old")
    w = store.writer("data/a.s4w")
    w.write(b"new, half written")
    w.abort()
    w.abort()  # idempotent
    with pytest.raises(RuntimeError, match="boom"), store.writer("data/a.s4w") as w2:
        w2.write(b"x" * 1000)
        raise RuntimeError("boom")
    # An explicit abort inside the block is not undone by the exit, whose commit refuses.
    with pytest.raises(StorageError, match="commit after the write was aborted"), \
            store.writer("data/b.s4w") as w3:
        w3.write(b"y")
        w3.abort()
    assert _all_files(tmp_path) == ["data/a.s4w"]
    assert store.get("data/a.s4w") == b"old"


@pytest.mark.parametrize("name", ["..", "../x", "a/../../x", "a/./b", "", "/abs", "a//b",
                                  f"data/{TMP_PREFIX}1-a.s4w", "a/"])
def test_bad_names_are_refused(tmp_path: Path, name: str) -> None:
    store = LocalStore(tmp_path / "root")
    for op in (lambda: store.writer(name), lambda: store.put_atomic(name, b"x"),
               lambda: store.get(name), lambda: store.delete(name)):
        with pytest.raises(StorageError, match="invalid object name"):
            op()
    assert not (tmp_path / "x").exists()
    assert _all_files(tmp_path) == []


def test_commit_fsyncs_the_file_before_the_rename_and_the_directory_after(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []
    real_fsync, real_replace, real_link = os.fsync, os.replace, os.link

    def fsync(fd: int) -> None:
        events.append("fsync-dir" if os.path.isdir(f"/proc/self/fd/{fd}") else "fsync-file")
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(os, "replace", lambda *a: (events.append("rename"), real_replace(*a)))
    monkeypatch.setattr(os, "link", lambda *a: (events.append("link"), real_link(*a)))
    store = LocalStore(tmp_path)
    with store.writer("d/a") as w:
        w.write(b"1")
    store.put_atomic("m/a", b"2", if_absent=True)
    # "d" and "m" are new: their entries in the root are fsynced as well.
    assert events == ["fsync-file", "rename", "fsync-dir", "fsync-dir",
                      "fsync-file", "link", "fsync-dir", "fsync-dir"]
    events.clear()
    with store.writer("d/b") as w:
        w.write(b"3")
    assert events == ["fsync-file", "rename", "fsync-dir"]


def test_commit_fsyncs_every_directory_the_writer_created(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    synced: list[str] = []
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        path = os.readlink(f"/proc/self/fd/{fd}")
        if os.path.isdir(path):
            synced.append(os.path.relpath(path, tmp_path))
        real_fsync(fd)

    (tmp_path / "run").mkdir()
    store = LocalStore(tmp_path / "run")
    monkeypatch.setattr(os, "fsync", fsync)
    with store.writer("a/b/c.s4w") as w:
        w.write(b"x")
    assert synced == ["run/a/b", "run/a", "run"]


def test_a_directory_that_cannot_be_created_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "f").write_bytes(b"a file where a directory is needed")
    with pytest.raises(StorageError, match=r"cannot create the directory of .*f/x\.s4w"):
        LocalStore(tmp_path).writer("f/x.s4w")


def test_sweep_removes_only_stale_temp_files(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_atomic("data/keep.s4w", b"k")
    stale = tmp_path / "data" / f"{TMP_PREFIX}dead-x.s4w"
    fresh = tmp_path / "data" / f"{TMP_PREFIX}live-y.s4w"
    stale.write_bytes(b"s")
    fresh.write_bytes(b"f")
    old = time.time() - 7200
    os.utime(stale, (old, old))
    os.utime(tmp_path / "data" / "keep.s4w", (old, old))
    assert store.list() == ["data/keep.s4w"]  # temp files are never listed
    assert store.sweep() == 1
    assert not stale.exists() and fresh.exists()
    assert store.sweep(older_than_s=0) == 1
    assert _all_files(tmp_path) == ["data/keep.s4w"]


def test_get_list_delete_exists(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "s")
    assert store.list() == []
    with pytest.raises(StorageError, match=r"cannot read .*missing"):
        store.get("missing")
    with pytest.raises(StorageError, match="cannot open"):
        store.source("missing")
    for name in ("b/2", "a/1", "b/1"):
        store.put_atomic(name, name.encode())
    assert store.list() == ["a/1", "b/1", "b/2"]
    assert store.list("b/") == ["b/1", "b/2"]
    assert store.exists("a/1") and not store.exists("a")
    store.delete("a/1")
    store.delete("a/1")  # missing is fine
    assert store.list() == ["b/1", "b/2"]


def test_open_store(tmp_path: Path) -> None:
    assert isinstance(open_store(tmp_path), LocalStore)
    by_url = open_store(tmp_path.as_uri())
    assert isinstance(by_url, LocalStore) and by_url.root == tmp_path
    assert by_url.url == tmp_path.resolve().as_uri()
    store = LocalStore(tmp_path)
    assert open_store(store) is store
    with pytest.raises(ValueError, match="unsupported store URL scheme 'gopher'"):
        open_store("gopher://host/x")


def test_write_or_commit_after_a_failed_write_raises(tmp_path: Path) -> None:
    # A caller that swallows the failed write must not get a quiet "commit" of an object that
    # does not exist (and then commit a manifest pointing at it).
    store = LocalStore(tmp_path)
    w = store.writer("data/a.s4w")
    w.write(b"abc")

    class FullDisk:
        closed = False

        def write(self, data: bytes) -> int:
            raise OSError(errno.ENOSPC, "No space left on device")

        def close(self) -> None:
            self.closed = True

    w._f.close()
    w._f = FullDisk()
    with pytest.raises(StorageError, match=r"writing .*a\.s4w failed: No space left"):
        w.write(b"def")
    with pytest.raises(StorageError, match="write after commit/abort"):
        w.write(b"ghi")
    with pytest.raises(StorageError, match="commit after the write was aborted"):
        w.commit()
    assert _all_files(tmp_path) == []


def test_a_full_disk_whose_close_fails_too_leaves_no_temp_file(tmp_path: Path) -> None:
    # /dev/full takes buffered bytes and fails on flush: the failed write's abort closes the
    # file, which flushes and fails again; the temp file must still go and the error stay a
    # StorageError (a full-size temp file would keep the disk full until sweep()).
    store = LocalStore(tmp_path)
    w = store.writer("data/a.s4w")
    w._f.close()
    w._f = open("/dev/full", "wb")  # noqa: SIM115
    with pytest.raises(StorageError, match="No space left"):
        w.write(b"x" * 100_000)  # more than the buffer: the write itself flushes
    assert _all_files(tmp_path) == []
    w2 = store.writer("data/b.s4w")
    w2.write(b"abc")
    w2._f.close()
    w2._f = open("/dev/full", "wb")  # noqa: SIM115
    w2._f.write(b"pending")  # buffered: the flush in abort() fails
    w2.abort()
    assert _all_files(tmp_path) == []


def test_a_directory_sync_failure_after_the_rename_warns_and_keeps_the_file(
        tmp_path: Path, monkeypatch) -> None:
    # Once the rename has published the new file, failing the save would report failure for a
    # complete file that already replaced the previous one.
    from s4weights.store import local

    store = LocalStore(tmp_path)
    store.put_atomic("a.s4w", b"old")

    def fail(path):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(local, "_fsync_dir", fail)
    w = store.writer("a.s4w")
    w.write(b"new")
    with pytest.warns(RuntimeWarning, match="could not be synced"):
        w.commit()
    assert store.get("a.s4w") == b"new"
    assert _all_files(tmp_path) == ["a.s4w"]


def _record_write_backs(monkeypatch) -> list[int]:
    """The file's size at each write-back (``fdatasync``) from now on, appended as they run."""
    synced: list[int] = []
    real = getattr(os, "fdatasync", os.fsync)
    monkeypatch.setattr(os, "fdatasync", lambda fd: synced.append(os.fstat(fd).st_size)
                        or real(fd), raising=False)
    return synced


def test_write_back_starts_during_the_writes_and_its_error_fails_the_commit(
        tmp_path: Path, monkeypatch) -> None:
    from s4weights.store import local

    monkeypatch.setattr(local, "SYNC_EVERY", 1000)
    synced = _record_write_backs(monkeypatch)
    store = LocalStore(tmp_path)
    w = store.writer("a.s4w")
    for _ in range(20):
        w.write(b"x" * 600)
        time.sleep(0.01)
    assert synced and all(0 < n <= 12_000 for n in synced)  # flushed bytes reach the write-back
    w.commit()
    assert store.get("a.s4w") == b"x" * 12_000

    def fail(fd):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "fdatasync", fail, raising=False)
    w = store.writer("b.s4w")
    w.write(b"y" * 5000)
    with pytest.raises(StorageError, match=r"committing .*b\.s4w failed: Input/output error"):
        w.commit()
    assert _all_files(tmp_path) == ["a.s4w"]


def test_a_file_of_a_few_tens_of_mib_starts_its_write_back_before_the_commit(
        tmp_path: Path, monkeypatch) -> None:
    # (a 64 MiB threshold left such files, most saves on the CPU path, to commit's fsync)
    synced = _record_write_backs(monkeypatch)
    w = LocalStore(tmp_path).writer("a.s4w")
    piece = b"z" * (1 << 20)
    for _ in range(24):
        w.write(piece)
    deadline = time.monotonic() + 10
    while not synced and time.monotonic() < deadline:  # (the write-back's thread, not commit)
        time.sleep(0.01)
    assert synced
    w.commit()
    assert (tmp_path / "a.s4w").stat().st_size == 24 << 20


def test_a_replaced_object_keeps_its_mode_and_a_new_one_gets_the_umasks(tmp_path: Path) -> None:
    store = LocalStore(tmp_path)
    store.put_atomic("a", b"1")
    os.chmod(tmp_path / "a", 0o640)
    with store.writer("a") as w:
        w.write(b"2")
    assert (tmp_path / "a").read_bytes() == b"2"
    assert (os.stat(tmp_path / "a").st_mode & 0o777) == 0o640
    umask = os.umask(0o022)
    os.umask(umask)
    store.put_atomic("b", b"3")
    assert (os.stat(tmp_path / "b").st_mode & 0o777) == 0o666 & ~umask


def _deleted_files_held(root: Path) -> list[str]:
    held = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(str(root)) and target.endswith("(deleted)"):
            held.append(target)
    return held


needs_proc = pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")


@needs_proc
def test_replaced_and_deleted_files_are_released_in_the_background(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # The file a commit replaces, or delete() removes, is held open for a moment so that its
    # pages are freed off the caller's thread; every such descriptor is closed soon after.
    monkeypatch.setattr(local, "HOLD_MIN", 0)
    store = LocalStore(tmp_path)
    reader = open(tmp_path / "x", "wb+")  # noqa: SIM115 (the old file stays readable)
    reader.write(b"old" * 1000)
    reader.flush()
    for i in range(20):
        with store.writer("x") as w:
            w.write(b"%d" % i * 1000)
    store.put_atomic("y", b"y")
    store.delete("y")
    store.delete("never-there")
    _wait_released(tmp_path, 1)
    assert _deleted_files_held(tmp_path) == [f"{tmp_path / 'x'} (deleted)"]  # the test's own
    reader.seek(0)
    assert reader.read(3) == b"old"
    reader.close()
    assert (tmp_path / "x").read_bytes() == b"19" * 1000
    assert store.list() == ["x"]


def _wait_released(root: Path, left: int = 0) -> None:
    deadline = time.monotonic() + 10
    while len(_deleted_files_held(root)) > left and time.monotonic() < deadline:
        time.sleep(0.01)


def test_small_files_are_not_held(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = []
    monkeypatch.setattr(local._closer, "close", held.append)
    store = LocalStore(tmp_path)
    store.put_atomic("small", b"s" * 1000)
    store.put_atomic("small", b"t" * 1000)
    store.delete("small")
    assert held == []
    monkeypatch.setattr(local, "HOLD_MIN", 1000)
    store.put_atomic("large", b"l" * 1000)
    store.put_atomic("large", b"m" * 1000)
    store.delete("large")
    assert len(held) == 2
    for fd in held:
        os.close(fd)


@needs_proc
def test_deleting_many_files_holds_a_bounded_number_open(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # (a retention deleting hundreds of steps must not run the process out of descriptors)
    monkeypatch.setattr(local, "HOLD_MIN", 0)
    store = LocalStore(tmp_path)
    for i in range(300):
        store.put_atomic(f"d/{i}", b"x" * 4096)
    most = 0
    for i in range(300):
        store.delete(f"d/{i}")
        most = max(most, len(_deleted_files_held(tmp_path)))
    assert most <= local.HELD_MAX + 1
    _wait_released(tmp_path)
    assert _deleted_files_held(tmp_path) == []


def test_without_a_thread_the_caller_closes(monkeypatch: pytest.MonkeyPatch,
                                            tmp_path: Path) -> None:
    # At interpreter shutdown no thread can start: the descriptor is closed at once.
    closer = local._Closer()

    def refuse(self: threading.Thread) -> None:
        raise RuntimeError("can't create new thread at interpreter shutdown")

    monkeypatch.setattr(threading.Thread, "start", refuse)
    fd = os.open(tmp_path, os.O_RDONLY)
    closer.close(fd)
    with pytest.raises(OSError):
        os.fstat(fd)


@pytest.mark.skipif(not hasattr(os, "fork") or not os.path.isdir("/proc/self/fd"),
                    reason="needs fork and /proc")
def test_a_forked_child_closes_the_descriptors_it_inherits_waiting(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(local, "HOLD_MIN", 0)
    store = LocalStore(tmp_path)
    store.put_atomic("x", b"0")
    with store.writer("x") as w:  # the parent's closer thread is started
        w.write(b"1")
    _wait_released(tmp_path)
    # Descriptors waiting at the fork: queued without waking the thread (as if it were busy).
    for i in range(3):
        (tmp_path / f"w{i}").write_bytes(b"w")
        local._closer._fds.append(os.open(tmp_path / f"w{i}", os.O_RDONLY))
        (tmp_path / f"w{i}").unlink()
    pid = os.fork()
    if pid == 0:  # the child: they are closed at once, and its own replaced files too
        code = 1
        try:
            code = 3 if _deleted_files_held(tmp_path) else 0
            if code == 0:
                with store.writer("x") as w:
                    w.write(b"2")
                _wait_released(tmp_path)
                code = 4 if _deleted_files_held(tmp_path) else 0
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    with local._closer._cv:
        local._closer._cv.notify()
    assert os.waitstatus_to_exitcode(status) == 0
    assert (tmp_path / "x").read_bytes() == b"2"
    _wait_released(tmp_path)
    assert _deleted_files_held(tmp_path) == []


def test_delete_may_release_at_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    held = []
    monkeypatch.setattr(local, "HOLD_MIN", 0)
    monkeypatch.setattr(local._closer, "close", held.append)
    store = LocalStore(tmp_path)
    store.put_atomic("d/a", b"a")
    store.put_atomic("d/b", b"b")
    store.delete("d/a", release_later=False)
    assert held == [] and not (tmp_path / "d" / "a").exists()
    store.delete("d/b")
    assert len(held) == 1
    os.close(held[0])
