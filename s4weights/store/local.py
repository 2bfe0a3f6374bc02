"""Local directories as a store, with crash-safe commits.

Commit = write to a temporary file in the same directory, fsync it, rename it over the final
name, fsync the directory (and the parent of every directory the writer created). A crash
before the rename leaves only a ``.tmp-*`` file that readers never list; a crash after it leaves
the complete object. Temporary files of dead writers are swept by :meth:`LocalStore.sweep`.
The file a commit replaces, or ``delete`` removes, is freed on a helper thread.
"""

from __future__ import annotations

import collections
import contextlib
import os
import secrets
import stat
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from s4format.errors import StorageError
from s4weights.store.base import ObjectWriter, Store

if TYPE_CHECKING:
    from s4format.source import ByteSource

TMP_PREFIX = ".tmp-"


def _keep_mode(final: Path, tmp: Path, held: int | None) -> None:
    """An object replacing a file keeps that file's permission bits (as writing it in place
    would); a new one gets the temp file's (the umask's)."""
    try:
        mode = stat.S_IMODE(os.fstat(held).st_mode if held is not None else
                            os.stat(final).st_mode)
    except FileNotFoundError:
        return
    os.chmod(tmp, mode)


class _Closer:
    """Closes file descriptors on a daemon thread. The last close of a file that was replaced
    or deleted frees its page cache (35 ms for a 220 MB file), which a save need not wait for;
    the kernel closes whatever is left at exit all the same. At most :data:`HELD_MAX` wait:
    past that (a retention deleting many files), or where no thread can start (at interpreter
    shutdown), the caller closes its own."""

    def __init__(self) -> None:
        self._cv = threading.Condition()
        self._fds: collections.deque[int] = collections.deque()
        self._thread: threading.Thread | None = None

    def close(self, fd: int) -> None:
        with self._cv:
            if len(self._fds) < HELD_MAX and self._started():
                self._fds.append(fd)
                self._cv.notify()
                return
        _close(fd)

    def _started(self) -> bool:
        if self._thread is None:
            thread = threading.Thread(target=self._run, name="s4w-closer", daemon=True)
            try:
                thread.start()
            except RuntimeError:  # (interpreter shutdown)
                return False
            self._thread = thread
        return True

    def _run(self) -> None:
        while True:
            with self._cv:
                while not self._fds:
                    self._cv.wait()
                fd = self._fds.popleft()
            _close(fd)

    def after_fork(self) -> None:
        """In a forked child: no thread, and the parent's waiting descriptors (the child's
        copies) closed now, not held until the child exits."""
        fds, self._fds = self._fds, collections.deque()
        self._cv, self._thread = threading.Condition(), None
        for fd in fds:
            _close(fd)


def _close(fd: int) -> None:
    with contextlib.suppress(OSError):  # (a file opened to be read loses nothing)
        os.close(fd)


HELD_MAX = 16  # descriptors waiting for the closer thread, at most
HOLD_MIN = 16 << 20  # a file's bytes, under which freeing it is not worth a thread's while

_closer = _Closer()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_closer.after_fork)


def _hold(path: Path) -> int | None:
    """A read-only descriptor of the regular file at ``path`` of at least :data:`HOLD_MIN`
    bytes (else None, or where it cannot be opened): holding it keeps the file's pages alive
    past a rename or unlink, to be freed when :data:`_closer` closes it. Not on Windows, where
    an open file cannot be replaced."""
    if os.name != "posix":
        return None
    try:
        if os.stat(path).st_size < HOLD_MIN:
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except OSError:
        return None
    try:
        if stat.S_ISREG(os.fstat(fd).st_mode):
            return fd
    except OSError:
        pass
    os.close(fd)
    return None


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# Bytes written between write-backs started during a write. At 64 MiB the smaller files reached
# the disk mostly in commit's fsync: bench/cpu_speed.py's saves to disk with fsync took 1.11-1.33
# times their saves into memory on 2 cores, at 8 MiB 1.03-1.18 times (2026-12-07).
SYNC_EVERY = 8 << 20


class _LocalWriter(ObjectWriter):
    def __init__(self, final: Path) -> None:
        self.final = final
        # Directories this writer creates: their own entries must be fsynced at commit too, or
        # a crash can lose the directory, and the committed object with it.
        self._new_dirs = [d for d in (final.parent, *final.parent.parents) if not d.exists()]
        try:
            final.parent.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot create the directory of {final}: {exc.strerror}") from exc
        self.tmp = final.parent / f"{TMP_PREFIX}{secrets.token_hex(8)}-{final.name}"
        try:
            self._f = open(self.tmp, "xb")  # noqa: SIM115
        except OSError as exc:
            raise StorageError(f"cannot create {self.tmp}: {exc.strerror}") from exc
        self._done = False
        self._aborted = False
        self._unsynced = 0
        self._sync: threading.Thread | None = None
        self._sync_error: OSError | None = None

    def write(self, data: bytes | memoryview) -> int:
        if self._done:
            raise StorageError(f"{self.final}: write after commit/abort")
        try:
            n = self._f.write(data)
            self._unsynced += n
            if self._unsynced >= SYNC_EVERY and (self._sync is None or not self._sync.is_alive()):
                self._f.flush()
                self._unsynced = 0
                self._start_sync()
            return n
        except OSError as exc:
            self.abort()
            raise StorageError(f"writing {self.final} failed: {exc.strerror}") from exc

    def _start_sync(self) -> None:
        """Start writing back what is written so far, on a helper thread: the kernel would
        otherwise hold it all in the page cache until commit's fsync, which then waits for the
        whole object to reach the disk after the last write instead of during the writes."""
        fd = self._f.fileno()

        sync = getattr(os, "fdatasync", os.fsync)  # macOS and Windows have no fdatasync

        def run() -> None:
            try:
                sync(fd)
            except OSError as exc:
                self._sync_error = exc

        self._sync = threading.Thread(target=run, name="s4w-fsync", daemon=True)
        self._sync.start()

    def _join_sync(self) -> None:
        if self._sync is not None:
            self._sync.join()
            self._sync = None

    def commit(self, *, exclusive: bool = False) -> None:
        """Publish the object; ``exclusive`` fails if it exists (``os.link`` never replaces)."""
        if self._aborted:
            # Returning quietly would let a caller that swallowed a failed write publish a
            # manifest for an object that does not exist (S3Store's writer raises the same).
            raise StorageError(f"{self.final}: commit after the write was aborted (an earlier "
                               "write failed or abort() was called)")
        if self._done:
            return
        try:
            self._join_sync()
            if self._sync_error is not None:
                raise self._sync_error
            self._f.flush()
            os.fsync(self._f.fileno())
            self._f.close()
            if exclusive:
                os.link(self.tmp, self.final)
                self.tmp.unlink()
            else:
                held = _hold(self.final)
                try:
                    _keep_mode(self.final, self.tmp, held)
                    os.replace(self.tmp, self.final)
                finally:
                    if held is not None:
                        _closer.close(held)
        except FileExistsError:
            self.abort()
            raise StorageError(f"{self.final} already exists") from None
        except OSError as exc:
            self.abort()
            raise StorageError(f"committing {self.final} failed: {exc.strerror}") from exc
        self._done = True
        # The object is published: a save that fails from here on would report failure for a
        # complete file that already replaced the previous one. A directory that cannot be
        # fsynced only weakens the guarantee against a crash in the next moments: say so.
        failed = None
        for d in (self.final.parent, *(d.parent for d in self._new_dirs)):
            try:
                _fsync_dir(d)
            except OSError as exc:
                failed = failed or exc
        if failed is not None:
            warnings.warn(f"{self.final} is written, but its directory could not be synced "
                          f"({failed.strerror}): a system crash now could still lose it",
                          RuntimeWarning, stacklevel=2)

    def abort(self) -> None:
        if self._done:
            return
        self._done = self._aborted = True
        try:
            self._join_sync()  # not closing the file under a write-back in flight
            if not self._f.closed:
                self._f.close()  # flushes what is buffered: on a full disk that fails again
        except OSError:
            pass  # the file is closed all the same; the write's own error is what matters
        finally:
            self.tmp.unlink(missing_ok=True)


class LocalStore(Store):
    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.root = Path(root)
        self.url = self.root.resolve().as_uri()

    def _path(self, name: str) -> Path:
        parts = name.split("/")
        if not name or any(p in ("", ".", "..") or p.startswith(TMP_PREFIX) for p in parts):
            raise StorageError(f"invalid object name {name!r}")
        return self.root.joinpath(*parts)

    def writer(self, name: str) -> ObjectWriter:
        return _LocalWriter(self._path(name))

    def put_atomic(self, name: str, data: bytes, *, if_absent: bool = False) -> None:
        w = _LocalWriter(self._path(name))
        w.write(data)
        w.commit(exclusive=if_absent)

    def get(self, name: str) -> bytes:
        try:
            return self._path(name).read_bytes()
        except OSError as exc:
            raise StorageError(f"cannot read {self._path(name)}: {exc.strerror}") from exc

    def source(self, name: str) -> ByteSource:
        from s4format.source import FileSource  # (numpy: not needed to list or write)

        return FileSource(self._path(name))

    def modified(self, prefix: str = "") -> dict[str, float]:
        return {name: st.st_mtime for name, st in self._stats(prefix)}

    def list_versions(self, prefix: str = "") -> dict[str, str]:
        """Names under ``prefix`` with their inode, size and times of writing and of the
        inode's change (a commit renames a new file into place)."""
        return {name: f"{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
                for name, st in self._stats(prefix)}

    def _stats(self, prefix: str) -> Iterator[tuple[str, os.stat_result]]:
        for name in self.list(prefix):
            try:
                yield name, os.stat(self.root / name)
            except OSError:
                continue  # deleted since the listing

    def list(self, prefix: str = "") -> list[str]:
        # from the folder the prefix names; a folder that cannot be read is an error, not
        # an empty listing (sweeping what no manifest names trusts this listing)
        top = self.root / prefix.rpartition("/")[0] if "/" in prefix else self.root
        if not top.is_dir():
            return []

        def fail(exc: OSError) -> None:
            if not isinstance(exc, FileNotFoundError):  # (one deleted during the walk is gone)
                raise StorageError(f"cannot list {exc.filename}: {exc.strerror}") from exc

        out = []
        for dirpath, _dirs, files in os.walk(top, onerror=fail):
            rel = Path(dirpath).relative_to(self.root)
            for f in files:
                if f.startswith(TMP_PREFIX):
                    continue
                name = (rel / f).as_posix().removeprefix("./")
                if name.startswith(prefix):
                    out.append(name)
        return sorted(out)

    def delete(self, name: str, *, release_later: bool = True) -> None:
        """Delete the object (none there: nothing to do). ``release_later``: its pages are
        freed on a helper thread, and the file stays open until then (on NFS, as a hidden file
        in its folder)."""
        path = self._path(name)
        held = _hold(path) if release_later else None
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"cannot delete {path}: {exc.strerror}") from exc
        finally:
            if held is not None:
                _closer.close(held)

    def exists(self, name: str) -> bool:
        return self._path(name).is_file()

    def sweep(self, older_than_s: float = 3600.0, *, dirs: tuple[str, ...] | None = None,
              dry_run: bool = False) -> int:
        """Remove temporary files left by writers that died more than ``older_than_s`` ago:
        anywhere under the root, or only right inside the folders ``dirs`` (``"data/"``).
        Returns how many (that would go, with ``dry_run``)."""
        removed = 0
        cutoff = time.time() - older_than_s
        if dirs is None:
            places = [(Path(d), files) for d, _sub, files in os.walk(self.root)]
        else:
            places = [(self.root / d, os.listdir(self.root / d)) for d in dirs
                      if (self.root / d).is_dir()]
        for folder, files in places:
            for f in files:
                p = folder / f
                if not f.startswith(TMP_PREFIX):
                    continue
                try:
                    # A live writer may rename its temp file between listing and stat.
                    stale = p.stat().st_mtime < cutoff
                    if stale and not dry_run:
                        p.unlink(missing_ok=True)
                except FileNotFoundError:
                    continue
                except OSError as exc:
                    raise StorageError(f"cannot remove {p}: {exc.strerror}") from exc
                removed += stale
        return removed
