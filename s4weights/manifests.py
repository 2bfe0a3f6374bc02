"""Manifests: which checkpoints a store holds, their chains, and retention.

Objects under the store root (spec/checkpoints.md)::

    data/<step:012d>-<token>.s4w  a checkpoint file (committed first)
    steps/<step:012d>-<token>/    a distributed step's rank files and DCP metadata
    manifests/<step:012d>.json    the manifest (committed last, create-if-absent)

A checkpoint exists exactly when its manifest does. A manifest that does not parse is skipped
with a warning, so one damaged file does not stop every save and load. Retention deletes
manifests first, newest first, then files; it never removes a checkpoint that a kept step or a
save in progress needs (:mod:`s4weights.lease`).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import secrets
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any

from s4format.errors import FormatError, ParentMismatchError, StorageError
from s4weights import lease
from s4weights.store import Store, open_store
from s4weights.store.local import LocalStore

log = logging.getLogger("s4weights")

# Called after a retention with the store's URL and the checkpoint IDs it kept (the parent
# cache of s4weights.chain drops a parent that went).
RETAINED: list[Callable[[str, set[str]], None]] = []


MANIFEST_FORMAT = "s4weights-checkpoint"


MANIFEST_VERSION = 1


@dataclass(frozen=True)
class CheckpointInfo:
    step: int
    file: str
    checkpoint_id: str
    parent_step: int | None
    parent_id: str | None
    base_step: int
    depth: int  # deltas between this checkpoint and its base (0 for a base)
    raw_bytes: int
    stored_bytes: int
    file_bytes: int
    full_stored_bytes: int  # payload had every tensor been coded alone
    created: float
    base_reason: str | None = None  # why a base was started (None for deltas and old bases)
    # a step saved with distributed=True: its rank files (rank, name, checkpoint_id, parent)
    rank_files: list[dict[str, Any]] | None = None
    # the saves on its base up to this one, the base and itself included, whatever retention
    # deleted since (None in manifests written before 2026-12-05 and in distributed steps)
    saves_on_base: int | None = None
    # what the save took deltas against, "base" or "latest" (a base too: the run's choice)
    delta_against: str | None = None

    @property
    def is_base(self) -> bool:
        return self.parent_step is None

    def _check_types(self) -> None:
        """Every field of the type it is written with (a hand-edited or foreign manifest
        with ``"step": "3"`` would otherwise fail later, far from its cause)."""
        ints = ("step", "base_step", "depth", "raw_bytes", "stored_bytes", "file_bytes",
                "full_stored_bytes")
        for k in ints:
            v = getattr(self, k)
            if type(v) is not int or v < 0:
                raise ValueError(f"{k} must be a non-negative integer, not {v!r}")
        for k in ("file", "checkpoint_id"):
            if type(getattr(self, k)) is not str:
                raise ValueError(f"{k} must be a string")
        if (self.parent_step is None) != (self.parent_id is None) \
                or (self.parent_step is not None and (type(self.parent_step) is not int
                                                      or type(self.parent_id) is not str)):
            raise ValueError("parent_step and parent_id must be an integer and a string, or "
                             "both null")
        if type(self.created) not in (int, float) or not math.isfinite(self.created):
            raise ValueError(f"created must be a finite number, not {self.created!r}")
        if self.base_reason is not None and type(self.base_reason) is not str:
            raise ValueError("base_reason must be a string or null")
        if self.rank_files is not None:
            _check_rank_files(self.rank_files)
        if self.saves_on_base is not None and (type(self.saves_on_base) is not int
                                               or self.saves_on_base < 1):
            raise ValueError(f"saves_on_base must be a positive integer or null, not "
                             f"{self.saves_on_base!r}")
        if self.delta_against is not None and type(self.delta_against) is not str:
            raise ValueError("delta_against must be a string or null")

    def to_json(self) -> bytes:
        fields = {k: v for k, v in asdict(self).items() if k not in _OPTIONAL or v is not None}
        return json.dumps({"format": MANIFEST_FORMAT, "version": MANIFEST_VERSION, **fields},
                          indent=1).encode()

    @classmethod
    def from_json(cls, data: bytes, name: str) -> CheckpointInfo:
        try:
            d = json.loads(data)
            if d.pop("format") != MANIFEST_FORMAT or d.pop("version") != MANIFEST_VERSION:
                raise ValueError("not an s4weights v1 manifest")
            # members a later version adds are ignored (spec/checkpoints.md)
            info = cls(**{k: v for k, v in d.items() if k in _FIELDS})
            info._check_types()
            return info
        except (ValueError, TypeError, KeyError, AttributeError, RecursionError) as exc:
            raise FormatError(f"manifest {name} is malformed: {exc}") from None


_FIELDS = frozenset(f.name for f in fields(CheckpointInfo))
# Members written only where they hold something.
_OPTIONAL = frozenset(("base_reason", "rank_files", "saves_on_base", "delta_against"))


def saves_on(infos: dict[int, CheckpointInfo], base_step: int) -> int:
    """The saves on base ``base_step`` up to the newest listed one, the base included: as
    that one's manifest records them, else (manifests before 2026-12-05) those listed."""
    on = [i for i in infos.values() if i.base_step == base_step]
    if not on:
        return 0
    newest = max(on, key=lambda i: i.step)
    return newest.saves_on_base if newest.saves_on_base is not None else len(on)


def _check_rank_files(files: Any) -> None:
    if not isinstance(files, list) or not files:
        raise ValueError("rank_files must be a non-empty list")
    for f in files:
        if not isinstance(f, dict) or type(f.get("rank")) is not int \
                or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("checkpoint_id"), str) \
                or not (f.get("parent") is None or isinstance(f["parent"], str)):
            raise ValueError(f"rank_files entry {f!r} is not rank, name, checkpoint_id, parent")


def manifest_name(step: int) -> str:
    return f"manifests/{step:012d}.json"


def data_name(step: int) -> str:
    """A new file name for checkpoint ``step``: no other save picks it."""
    return f"data/{step:012d}-{secrets.token_hex(4)}.s4w"


def check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise ValueError("step must be >= 0")
    return int(step)


def list_checkpoints(url_or_dir: Any, *, problems: list[str] | None = None
                     ) -> list[CheckpointInfo]:
    """Every committed checkpoint under the store, by step. A manifest that does not parse is
    skipped, with a warning, or with its error appended to ``problems`` when that is given."""
    store = open_store(url_or_dir)
    listed = {n: v for n, v in store.list_versions("manifests/").items() if n.endswith(".json")}
    known = _MANIFESTS.get(store.url, {})  # never changed in place: no lock (a save from a
    # signal handler lists too, while the interrupted listing holds what it holds)
    todo = [n for n, v in listed.items() if not v or known.get(n, ("",))[0] != v]
    # a run's manifests are read once per process (each is written once; a new version is
    # read again), several at a time: a save or load then costs a listing, not a GET for
    # every checkpoint of the run
    if len(todo) > 1:
        with ThreadPoolExecutor(min(8, len(todo))) as pool:
            got = dict(zip(todo, pool.map(lambda n: read_manifest(store, n), todo)))
    else:
        got = {n: read_manifest(store, n) for n in todo}
    out, kept = [], {}
    for n, version in listed.items():
        if n in got:
            read = got[n]
            if read is None:
                continue  # deleted since the listing (a trainer's retention, running now)
        else:
            read = known[n][1]
        if version:
            kept[n] = (version, read)
        if isinstance(read, CheckpointInfo):
            out.append(read)
        elif problems is None:
            # one damaged or stray manifest must not stop every save and load of the run
            log.warning("%s: skipped: %s", store.url, read)
        else:
            problems.append(str(read))
    _MANIFESTS[store.url] = kept  # what this listing found, no more
    return out


# store URL -> manifest name -> (its version when read, what it parsed to or why it did not)
_MANIFESTS: dict[str, dict[str, tuple[str, CheckpointInfo | FormatError]]] = {}


def read_manifest(store: Store, name: str) -> CheckpointInfo | FormatError | None:
    """Manifest ``name`` parsed, the error that says why it does not parse, or None if it was
    deleted since the listing."""
    try:
        data = store.get(name)
    except StorageError:
        if not store.exists(name):
            return None
        raise
    try:
        return CheckpointInfo.from_json(data, name)
    except FormatError as exc:
        return exc


def by_step(infos: list[CheckpointInfo]) -> dict[int, CheckpointInfo]:
    return {i.step: i for i in infos}


def chain_of(step: int, infos: dict[int, CheckpointInfo]) -> list[CheckpointInfo]:
    """The checkpoints to open for ``step``, base first."""
    chain = [infos[step]]
    while chain[-1].parent_step is not None:
        parent = infos.get(chain[-1].parent_step)
        if parent is None:
            raise ParentMismatchError(
                f"checkpoint step {chain[-1].step} is a delta of step {chain[-1].parent_step}, "
                "which is missing from the store")
        if parent.checkpoint_id != chain[-1].parent_id:
            raise ParentMismatchError(
                f"checkpoint step {chain[-1].step} expects parent {chain[-1].parent_id}, but "
                f"step {parent.step} is {parent.checkpoint_id}")
        chain.append(parent)
        if len(chain) > len(infos):
            raise FormatError("checkpoint manifests form a cycle")
    return chain[::-1]


_SAVING: dict[str, threading.RLock] = {}


_SAVING_LOCK = threading.Lock()


_DEPTH: dict[str, int] = {}  # saves in progress per store (on the thread holding its lock)


@contextlib.contextmanager
def saving(url: str):
    """One save (or retention) at a time per store in this process: the cached parent's
    buffer is overwritten by the save that replaces it. Re-entrant, for a save made from
    within another on the same thread (a signal handler's, on preemption); yields whether
    this one is such a nested save, which must leave the outer save's parent alone."""
    with _SAVING_LOCK:
        held = _SAVING.setdefault(url, threading.RLock())
    with held:
        _DEPTH[url] = _DEPTH.get(url, 0) + 1
        try:
            yield _DEPTH[url] > 1
        finally:
            _DEPTH[url] -= 1


def parent_gone(store: Store, chain: list[CheckpointInfo]) -> str | None:
    """Why ``chain`` (base first) can no longer carry a delta, or None. Read after the pin is
    written: retention that marks the chain later sees the pin and keeps it."""
    marked = lease.retiring(store) & {i.step for i in chain}
    if marked:
        return f"retention in another process is deleting step(s) {sorted(marked)}"
    listed = set(store.list("manifests/"))
    missing = [i.step for i in chain if manifest_name(i.step) not in listed]
    if missing:
        return f"step(s) {missing} of its chain were deleted during the save"
    now = read_manifest(store, manifest_name(chain[-1].step))
    if not isinstance(now, CheckpointInfo) or now.checkpoint_id != chain[-1].checkpoint_id:
        return f"step {chain[-1].step} was deleted or replaced during the save"
    return None


def retain_after(store: Store, step: int, keep_last: int) -> None:
    """Retention after saving ``step``: the last ``keep_last`` steps listed now, the one just
    saved (an older step, after a rollback, is not among the highest), and every step above it
    (another process may have committed one during this save)."""
    with saving(store.url):
        # one listing for both: a step committed after it is not deleted
        infos = by_step(list_checkpoints(store))
        steps = sorted(infos)
        _retain(store, sorted(set(steps[-keep_last:]) | {step} | {s for s in steps if s > step}),
                infos)


def retain(url_or_dir: Any, keep_steps: list[int]) -> list[int]:
    """Delete every checkpoint not in ``keep_steps`` and not needed by a kept one (its chain
    back to the base). Returns the deleted steps."""
    store = open_store(url_or_dir)
    with saving(store.url):
        return _retain(store, keep_steps)


def _retain(store: Store, keep_steps: list[int],
            infos: dict[int, CheckpointInfo] | None = None) -> list[int]:
    """Delete what ``keep_steps`` do not need. The steps to delete are marked first; then the
    pins of saves in progress and the manifests are listed again, and a pinned step, a step
    committed since ``infos`` was listed, and their chains are kept (see :mod:`lease`)."""
    if infos is None:
        infos = by_step(list_checkpoints(store))
    doomed = _unneeded(keep_steps, infos)
    if doomed:
        with lease.marking(store, doomed):
            held = lease.pinned(store)
            now = by_step(list_checkpoints(store))
            keep = set(keep_steps) | (set(now) - set(infos)) | {
                p.step for p in held
                if p.step in now and now[p.step].checkpoint_id == p.checkpoint_id}
            doomed = [s for s in _unneeded(keep, now)
                      if s in doomed and now[s].checkpoint_id == infos[s].checkpoint_id]
            # newest first: a delta's manifest goes before its parent's, so an interrupted
            # retention never leaves a listed delta whose parent is gone
            for s in reversed(doomed):
                store.delete(manifest_name(s))
            for s in doomed:
                _delete_files(store, infos[s])
        needed = set(infos) - set(doomed)
    else:
        needed = set(infos)
    for hook in RETAINED:
        hook(store.url, {infos[s].checkpoint_id for s in needed})
    return doomed


def _delete_files(store: Store, info: CheckpointInfo) -> None:
    """Delete a checkpoint's file, or every object of a distributed step's folder."""
    if info.file.endswith("/"):
        local = isinstance(store, LocalStore)
        for name in store.list(info.file):
            # (held open, a file of the folder would linger on NFS as a hidden one, and the
            # folder could not be removed)
            if local:
                store.delete(name, release_later=False)
            else:
                store.delete(name)
        if local:
            with contextlib.suppress(OSError):  # (a folder something else put a file in)
                (store.root / info.file).rmdir()
    else:
        store.delete(info.file)


def _unneeded(keep_steps: set[int] | list[int], infos: dict[int, CheckpointInfo]) -> list[int]:
    """The steps of ``infos`` that no step of ``keep_steps`` is, or needs for its chain."""
    needed: set[int] = set()
    for s in keep_steps:
        if s in infos:
            needed.update(i.step for i in chain_of(s, infos))
    return sorted(set(infos) - needed)
