"""Checkpoint chains: a base and deltas against the previous checkpoint, in one store.

Objects under the store root::

    data/<step:012d>-<token>.s4w  the checkpoint file (committed first)
    manifests/<step:012d>.json    the manifest (committed last, create-if-absent)

A checkpoint exists exactly when its manifest does; the manifest names its file (stores written
before the token came hold ``data/<step:012d>.s4w``, which the manifests name as well). Each
save writes a file of its own name, so two saves of one step that race (two processes, or a
save from a signal handler) cannot replace each other's file: the one whose manifest lands
first wins, and the other deletes its file and fails. The manifest names the parent step and
parent checkpoint ID; the .s4w file names its parent by checkpoint ID too, and the reader
refuses a parent whose ID differs. A save never writes a delta against a checkpoint whose
chain it cannot open: it saves a base instead and warns. Retention deletes manifests first, then
files, never removes a checkpoint that a kept delta depends on, and after a save never one
newer than the step saved (another process may have just committed it). A delta's parent is
pinned against other processes' retention while the delta is saved (:mod:`s4weights.lease`,
spec/checkpoints.md). A manifest that does not parse is skipped with a warning, so one damaged
file does not stop every save and load.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import numbers
import re
import secrets
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, fields
from typing import Any

import numpy as np
import torch

import s4format
from s4format.errors import FormatError, ParentMismatchError, S4Error, StorageError
from s4weights import background_save, chainpolicy, gpu, hostmem, lease
from s4weights.api import read_tree, write_flattened
from s4weights.store import Store, open_store
from s4weights.store.local import LocalStore
from s4weights.torchtree import DeviceTensor, Flattened, flatten

log = logging.getLogger("s4weights")

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

    def to_json(self) -> bytes:
        fields = {k: v for k, v in asdict(self).items()
                  if k not in ("base_reason", "rank_files") or v is not None}
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


def _check_rank_files(files: Any) -> None:
    if not isinstance(files, list) or not files:
        raise ValueError("rank_files must be a non-empty list")
    for f in files:
        if not isinstance(f, dict) or type(f.get("rank")) is not int \
                or not isinstance(f.get("name"), str) \
                or not isinstance(f.get("checkpoint_id"), str) \
                or not (f.get("parent") is None or isinstance(f["parent"], str)):
            raise ValueError(f"rank_files entry {f!r} is not rank, name, checkpoint_id, parent")


def _manifest_name(step: int) -> str:
    return f"manifests/{step:012d}.json"


def _data_name(step: int) -> str:
    """A new file name for checkpoint ``step``: no other save picks it."""
    return f"data/{step:012d}-{secrets.token_hex(4)}.s4w"


def _check_step(step: Any) -> int:
    if isinstance(step, bool) or not isinstance(step, numbers.Integral):
        raise TypeError(f"step must be an int, not {type(step).__name__}")
    if step < 0:
        raise ValueError("step must be >= 0")
    return int(step)


# Raw bytes of the last checkpoint this process saved, per store: the parent of the next delta
# without re-reading it, with the content hashes the file records. One copy of the state, in
# host memory whatever the tensors' devices (page-locked for CUDA tensors, one buffer per
# device, the last item: the GPU path copies each parent into the XOR's device buffer, within
# the workspace); never GPU memory between saves.
_PARENT_CACHE: dict[str, tuple[str, dict[str, s4format.Tensor], dict[str, bytes],
                               dict[torch.device, np.ndarray]]] = {}


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
            got = dict(zip(todo, pool.map(lambda n: _manifest(store, n), todo)))
    else:
        got = {n: _manifest(store, n) for n in todo}
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


def _manifest(store: Store, name: str) -> CheckpointInfo | FormatError | None:
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


def close_chain(reader: s4format.Reader | None) -> None:
    """Close a reader and every parent it was opened with."""
    while reader is not None:
        reader.close()
        reader = reader.parent


def open_chain(store: Store, chain: list[CheckpointInfo], verify: bool,
               device: str = "auto") -> s4format.Reader:
    """Readers for ``chain`` (base first), each attached to its parent; returns the last.
    Close them with :func:`close_chain`; on failure every reader opened so far is closed.
    Checkpoints written with the GPU-only codec (nvcomp-ans) open where it can run, unless
    ``device`` is ``"cpu"``."""
    from s4weights import gpu

    gpu.register_codecs(device)
    reader: s4format.Reader | None = None
    try:
        for info in chain:
            try:
                source = store.source(info.file)
            except StorageError as exc:
                _raise_if_deleted(store, chain, exc)
                if info is chain[-1]:
                    raise StorageError(
                        f"checkpoint step {info.step} is listed in {store.url}, but its file "
                        f"cannot be read: {exc}; restore {info.file}, or drop the step with "
                        "retain()") from exc
                raise ParentMismatchError(
                    f"checkpoint step {chain[-1].step} needs step {info.step} of its chain, "
                    f"whose file cannot be read: {exc}") from exc
            child = s4format.Reader(source, verify=verify)
            if child.checkpoint_id.hex() != info.checkpoint_id:
                child.close()
                raise ParentMismatchError(
                    f"{info.file} is checkpoint {child.checkpoint_id.hex()}, its manifest says "
                    f"{info.checkpoint_id}")
            if reader is not None:
                try:
                    child.attach_parent(reader)
                except BaseException:
                    child.close()
                    raise
            reader = child
    except BaseException:
        close_chain(reader)
        raise
    assert reader is not None
    return reader


def _raise_if_deleted(store: Store, chain: list[CheckpointInfo], exc: StorageError) -> None:
    """Say that a step of ``chain`` was deleted (by retention in another process) while it was
    being read, where that is why reading it failed with ``exc``."""
    for info in chain:
        if not store.exists(_manifest_name(info.step)):
            raise StorageError(
                f"checkpoint step {info.step} was deleted from {store.url} while step "
                f"{chain[-1].step} was being read (retention in another process, or retain()); "
                "list the checkpoints again and load one that is kept") from exc


def _parent_tensors(store: Store, parent: CheckpointInfo, infos: dict[int, CheckpointInfo],
                    device: str = "cpu", workspace: int | None = None
                    ) -> tuple[dict[str, s4format.Tensor], dict[str, bytes], np.ndarray | None]:
    """The tensors of ``parent``, to XOR the next checkpoint against, their content hashes
    (by name), and the page-locked buffer holding them where the GPU decoded them (else
    None); an S4Error when its chain cannot be read, even when this process still holds them
    (a delta against a parent nobody can read could never be loaded). ``device`` other than
    "cpu" (a save on the GPU path): the chain is decoded on the current GPU, within
    ``workspace``, as a load would, not on the CPU (which takes seconds per GB and file)."""
    chain = chain_of(parent.step, infos)
    cached = _PARENT_CACHE.get(store.url)
    if cached and cached[0] == parent.checkpoint_id:
        # The cache spares decoding the chain, not checking that it is still there: open every
        # file of it (header, footer, index checksum, checkpoint IDs against the manifests),
        # which catches deleted, truncated and replaced files. Damage inside a plane's payload
        # shows only when the planes are read, as they are in a fresh process.
        close_chain(open_chain(store, chain, verify=False))
        return cached[1], cached[2], None
    reader = open_chain(store, chain, verify=True, device=device)
    try:
        hashes = {t.name: t.content_hash for t in reader.tensors}
        if device != "cpu" and gpu.use_gpu(device, True):
            try:
                tensors, buffer = _read_on_gpu(reader, device, workspace)
                return tensors, hashes, buffer
            except gpu.out_of_memory_errors() as exc:  # (a training run may leave little)
                log.warning("reading the parent checkpoint step %d on the GPU ran out of "
                            "memory (%s): read on the CPU instead", parent.step,
                            gpu.error_text(exc))
        return {t.name: reader.read(i) for i, t in enumerate(reader.tensors)}, hashes, None
    finally:
        close_chain(reader)


def _read_on_gpu(reader: s4format.Reader, device: str, workspace: int | None
                 ) -> tuple[dict[str, s4format.Tensor], np.ndarray]:
    """Every tensor of ``reader`` (a chain) as host bytes in one page-locked buffer (a kept
    one that fits, else a new one), read on the current device within ``workspace``: in
    batches (:func:`gpu.loader_for`, each decoded tensor counted against the workspace until
    it is copied down), a tensor that alone needs more in chunks, each copied down as it is
    made (:func:`chunked.load_large`), and on the CPU where the GPU does not decode it (empty
    tensors too: their checks). Fails as the CPU reader would, reading in order."""
    from s4weights.gpu import plan
    from s4weights.gpu.decode import decodable, device_extra
    from s4weights.gpu.decode_large import chunkable, load_large
    from s4weights.gpu.ransparse import TablesTooLarge

    total = sum(t.raw_nbytes for t in reader.tensors)
    ws = workspace or plan.default_workspace(total)
    dev = torch.device("cuda", torch.cuda.current_device())
    load = gpu.loader_for(reader, device, workspace=ws, count_outputs=True)
    host = hostmem.take(dev, total)
    if host is None:
        host = hostmem.populated(total).result()
        hostmem.lock(host, dev.index)
    out: dict[str, s4format.Tensor] = {}
    at = 0
    try:
        for i, t in enumerate(reader.tensors):
            h = host[at:at + t.raw_nbytes]
            on_gpu = t.raw_nbytes > 0 and decodable(reader, i)
            if on_gpu and t.raw_nbytes + device_extra(reader, i) <= ws:
                got = load(i, dev)
                # (the device copy's memory goes back to torch's allocator at once: stream
                # order keeps later work from writing it before this copy has read it)
                torch.from_numpy(h).copy_(got.reshape(-1).view(torch.uint8), non_blocking=True)
                del got
            elif on_gpu and chunkable(reader, i):
                try:
                    load_large(reader, i, torch.from_numpy(h), ws, on_host=True)
                except TablesTooLarge:  # streams of tiny blocks: the CPU decodes it
                    h[:] = reader.read_raw(i)
            else:
                h[:] = reader.read_raw(i)
            out[t.name] = s4format.Tensor(t.dtype, t.shape, h)
            at += t.raw_nbytes
    except S4Error:
        # a batch decodes the GPU's tensors ahead of those the CPU reads: the failure the
        # CPU reader meets first, reading in order (on this error path only)
        _wait_quietly(dev)
        for i in range(len(reader.tensors)):
            reader.read_raw(i)
        raise
    except BaseException:
        _wait_quietly(dev)  # (no copy may still write into the buffer once it goes)
        raise
    torch.cuda.current_stream(dev).synchronize()
    return out, host


def _wait_quietly(dev: torch.device) -> None:
    """Wait for the work queued on ``dev``'s current stream, hiding a failure there (a
    device already in error) while another error propagates."""
    with contextlib.suppress(Exception):
        torch.cuda.current_stream(dev).synchronize()


def save_checkpoint(state: Any, url_or_dir: Any, step: int, *, keyframe_interval: int = 10,
                    delta: bool = True, min_delta_gain: float = 0.05,
                    read_budget: float | str | None = "default", keep_last: int | None = None,
                    policy: str = "auto", metadata: dict[str, str] | None = None,
                    progress: bool | None = None, device: str = "auto",
                    workspace: int | None = None, distributed: bool = False,
                    group: Any = None, blocking: bool = True
                    ) -> CheckpointInfo | Future[CheckpointInfo]:
    """Save ``state`` as checkpoint ``step``: a delta against the latest checkpoint when allowed
    (chain shorter than ``keyframe_interval`` files, the previous delta saved at least
    ``min_delta_gain`` of a full save, and loading the new step would read at most
    ``read_budget`` full saves: by default :data:`chainpolicy.READ_BUDGET`, None for no bound),
    else a new base, whose manifest says why. Each tensor is stored as a delta only where the
    XOR codes smaller. ``keep_last`` applies retention afterwards (docs/checkpoints.md).

    ``device`` and ``workspace`` are as in :func:`s4weights.save`; on the GPU path the XOR with
    the parent is made on the device too. This process keeps the checkpoint it saved last in
    host memory as the next delta's parent (page-locked for CUDA tensors); nothing stays in GPU
    memory between saves. A process without it (after a restart) reads the parent from the
    store, unless it loaded it with ``load_checkpoint(..., resume=True)``.
    CUDA tensors must not change until the call returns. Saves to one store from several
    threads run one at a time. When the latest checkpoint cannot be read, the save still
    succeeds, as a base, and logs a warning naming it.

    ``distributed=True``: every rank of ``group`` (default: the default process group) calls
    this with its sharded state dict (FSDP2, DTensor); the step is a DCP checkpoint of one
    .s4w per rank, each a delta of that rank's previous file where that pays (docs/dcp.md).

    ``blocking=False`` returns a :class:`concurrent.futures.Future` of the CheckpointInfo once
    the state is captured (copied: on the device for CUDA tensors where it has room); coding,
    writing, the commit and retention go on in the background, and ``result()`` raises what a
    blocking save would. Saves to one store run in the order they were made
    (:mod:`s4weights.background_save`)."""
    step = _check_step(step)
    if read_budget == "default":
        read_budget = chainpolicy.READ_BUDGET
    if read_budget is not None and not (isinstance(read_budget, (int, float))
                                        and read_budget >= 1):
        raise ValueError(f"read_budget must be a number >= 1 (full saves) or None, not "
                         f"{read_budget!r}")
    if keep_last is not None and keep_last < 1:
        # steps[-0:] would keep every checkpoint, the opposite of what 0 asks.
        raise ValueError("keep_last must be >= 1 (the checkpoint being saved is kept)")
    store = open_store(url_or_dir)
    if not blocking:
        if distributed:
            raise ValueError("distributed=True saves block; use dcp.async_save with "
                             "S4StorageWriter for asynchronous sharded saves")
        captured, streams = background_save.capture(flatten(state))
        kw = dict(keyframe_interval=keyframe_interval, delta=delta,
                  min_delta_gain=min_delta_gain, read_budget=read_budget, keep_last=keep_last,
                  policy=policy, metadata=metadata, progress=progress, device=device,
                  workspace=workspace)

        def job() -> CheckpointInfo:
            with _saving(store.url) as nested:
                return _save(store, captured, step, nested=nested, **kw)
        return background_save.submit(store.url, job, streams)
    background_save.wait_for(store.url)
    if distributed:
        from s4weights.dcp import chain as dcp_chain

        if metadata or progress:
            raise ValueError("metadata and progress are not supported with distributed=True")
        with _saving(store.url):
            return dcp_chain.save(
                state, store.url, step, group=group, keyframe_interval=keyframe_interval,
                delta=delta, min_delta_gain=min_delta_gain, read_budget=read_budget,
                keep_last=keep_last, policy=policy, device=device, workspace=workspace)
    with _saving(store.url) as nested:
        return _save(store, state, step, keyframe_interval=keyframe_interval, delta=delta,
                     min_delta_gain=min_delta_gain, read_budget=read_budget,
                     keep_last=keep_last, policy=policy,
                     metadata=metadata, progress=progress, device=device, workspace=workspace,
                     nested=nested)


_SAVING: dict[str, threading.RLock] = {}
_SAVING_LOCK = threading.Lock()
_DEPTH: dict[str, int] = {}  # saves in progress per store (on the thread holding its lock)


@contextlib.contextmanager
def _saving(url: str):
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


def _save(store: Store, state: Any, step: int, *, keyframe_interval: int, delta: bool,
          min_delta_gain: float, keep_last: int | None, nested: bool, **coding: Any
          ) -> CheckpointInfo:
    infos = by_step(list_checkpoints(store))
    if step in infos:
        raise StorageError(f"checkpoint step {step} already exists in {store.url}")
    latest = infos[max(infos)] if infos else None
    why = chainpolicy.reason_without_parent(latest, step, delta=delta,
                                            keyframe_interval=keyframe_interval,
                                            min_delta_gain=min_delta_gain)
    if why is None and latest is not None and latest.rank_files is not None:
        why = f"step {latest.step} was saved with distributed=True"
    info = _save_on(store, state, step, infos, None if why else latest, why, nested=nested,
                    **coding)
    if keep_last is not None:
        try:
            _retain_after(store, step, keep_last)
        except (S4Error, OSError) as exc:
            # the checkpoint is committed: a retention that fails (a file that cannot be
            # deleted) is said, and the next save's retention tries again
            log.warning("checkpoint step %d is saved, but retention failed: %s", step, exc)
    return info


class _ParentGone(S4Error):
    """The parent of the delta being saved was deleted or is being deleted."""


def _save_on(store: Store, state: Any, step: int, infos: dict[int, CheckpointInfo],
             parent: CheckpointInfo | None, why: str | None, **kw: Any) -> CheckpointInfo:
    """Save ``state`` as a delta of ``parent``, pinned against retention from before its chain
    is read until the manifest is committed, or as a base (for the reason ``why``) when there
    is no parent or the pin came too late."""
    if parent is None:
        return _code(store, state, step, infos, None, base_reason=why, **kw)
    with lease.pin(store, parent.step, parent.checkpoint_id):
        try:
            chain = chain_of(parent.step, infos)
            why = _parent_gone(store, chain)
        except S4Error as exc:
            chain, why = [], f"its chain cannot be read: {exc}"
        if why is None:
            try:
                return _code(store, state, step, infos, chain, **kw)
            except _ParentGone as exc:
                why = str(exc)
    log.warning("checkpoint step %d is saved as a base, not as a delta of step %d: %s", step,
                parent.step, why)
    return _code(store, state, step, infos, None, base_reason=f"parent unusable: {why}", **kw)


def _parent_gone(store: Store, chain: list[CheckpointInfo]) -> str | None:
    """Why ``chain`` (base first) can no longer carry a delta, or None. Read after the pin is
    written: retention that marks the chain later sees the pin and keeps it."""
    marked = lease.retiring(store) & {i.step for i in chain}
    if marked:
        return f"retention in another process is deleting step(s) {sorted(marked)}"
    listed = set(store.list("manifests/"))
    missing = [i.step for i in chain if _manifest_name(i.step) not in listed]
    if missing:
        return f"step(s) {missing} of its chain were deleted during the save"
    now = _manifest(store, _manifest_name(chain[-1].step))
    if not isinstance(now, CheckpointInfo) or now.checkpoint_id != chain[-1].checkpoint_id:
        return f"step {chain[-1].step} was deleted or replaced during the save"
    return None


def _code(store: Store, state: Any, step: int, infos: dict[int, CheckpointInfo],
          chain: list[CheckpointInfo] | None, *, nested: bool, policy: str,
          metadata: dict[str, str] | None, progress: bool | None, device: str,
          workspace: int | None, read_budget: float | None,
          base_reason: str | None = None) -> CheckpointInfo:
    """Code ``state`` into a new file of step ``step`` (a delta of ``chain``'s last checkpoint
    where given) and commit it with its manifest."""
    parent = chain[-1] if chain else None
    flat = state if isinstance(state, Flattened) else flatten(state)
    # The next delta's parent is a host snapshot of this state. Host tensors are copied as the
    # save starts and the file is coded from the copies, so a caller changing them during the
    # save (from another thread) cannot make the file and the snapshot differ. CUDA tensors
    # are coded in place on the GPU and copied to page-locked memory on a side stream (into
    # the parent's buffer once the file is coded, see _Snapshot): no device copy of the
    # state, so the save's extra GPU memory stays within the workspace; they must not change
    # until the call returns (as for torch.save).
    on_gpu = gpu.use_gpu(device, any(isinstance(t, DeviceTensor) for _n, t in flat.tensors))
    devices = {t.device_bytes.device for _n, t in flat.tensors if isinstance(t, DeviceTensor)}
    parents = hashes = read_buffer = None
    if parent is not None:
        try:
            # (read on the state's device where it has one, whose snapshot may take it over)
            with torch.cuda.device(next(iter(devices))) if on_gpu and len(devices) == 1 \
                    else contextlib.nullcontext():
                parents, hashes, read_buffer = _parent_tensors(
                    store, parent, infos, device if on_gpu else "cpu", workspace)
        except S4Error as exc:
            log.warning("checkpoint step %d is saved as a base, not as a delta of step %d "
                        "(%s), which cannot be read: %s", step, parent.step, parent.file, exc)
            parent, base_reason = None, f"parent unreadable: {exc}"
    if parent is not None and read_budget is not None:
        base_reason = chainpolicy.over_budget(chain, flat.tensors, parents, read_budget, policy)
        if base_reason is not None:
            log.info("checkpoint step %d starts a new base: %s", step, base_reason)
            parent = parents = hashes = None
    # the buffer this snapshot may take over once the file is coded (on the GPU path): the
    # cached parent's, or that of the parent just read from the store (where the state is on
    # one device)
    replaced = _PARENT_CACHE.get(store.url)
    reuse = replaced[3] if replaced else {}
    if read_buffer is not None and len(devices) == 1:
        reuse = {next(iter(devices)): read_buffer}
    snap = _Snapshot(flat.tensors, reuse if on_gpu and not nested else {})
    try:
        if not on_gpu:  # the CPU codes every tensor: from the snapshot, not a second copy
            snap.finish()
        flat = type(flat)(flat.tree, [
            (name, t if on_gpu and isinstance(t, DeviceTensor) else snap.tensors[name])
            for name, t in flat.tensors])
        t0 = time.perf_counter()
        name = _data_name(step)
        with store.writer(name) as sink:
            result = write_flattened(
                flat, sink, policy=policy, parent_id=bytes.fromhex(parent.checkpoint_id)
                if parent else None, parents=parents, metadata=metadata, show=progress,
                device=device, workspace=workspace, parent_hashes=hashes)
            # before the commit: a save whose snapshot fails leaves no checkpoint behind
            if snap.takes_over:  # the parent's buffer is about to be overwritten: from here
                # on it is nobody's parent, whatever happens (a failure, an interrupt, a
                # nested save from a signal handler reads the parent from the store)
                _PARENT_CACHE.pop(store.url, None)
            snap.finish()
        used = parent if result.parent_id is not None else None
        if parent is not None and used is None:
            base_reason = "no tensor coded smaller as a delta"
        info = CheckpointInfo(
            step=step, file=name, checkpoint_id=result.checkpoint_id.hex(),
            parent_step=used.step if used else None,
            parent_id=used.checkpoint_id if used else None,
            base_step=used.base_step if used else step, depth=used.depth + 1 if used else 0,
            raw_bytes=result.raw_nbytes, stored_bytes=result.stored_nbytes,
            file_bytes=result.file_size, full_stored_bytes=result.full_stored_nbytes,
            created=time.time(), base_reason=None if used else base_reason)
        if used is not None and (why := _parent_gone(store, chain)):
            _drop_unclaimed(store, step, name, manifest_tried=False)
            raise _ParentGone(why)
        try:
            store.put_atomic(_manifest_name(step), info.to_json(), if_absent=True)
        except BaseException:
            _drop_unclaimed(store, step, name)
            raise
    except BaseException:
        snap.abandon()
        raise
    # (the CPU coder read the parent while this snapshot existed: its buffer is the next's)
    _cache(store.url, (info.checkpoint_id, snap.tensors, result.content_hashes, snap.buffers),
           keep_replaced=not on_gpu)
    log.info("checkpoint step %d: %s, %d -> %d bytes in %.3f s", step,
             f"delta of step {info.parent_step}" if used else "base", info.raw_bytes,
             info.file_bytes, time.perf_counter() - t0)
    return info


def _drop_unclaimed(store: Store, step: int, name: str, manifest_tried: bool = True) -> None:
    """Delete this save's file ``name`` where no manifest can come to name it: no manifest
    write was tried, another save's manifest holds the step, or the local write that failed
    did not happen. Not where a manifest write failed on S3: a write that timed out may still
    land, and would then name a deleted file. Best effort: a file left there is named by no
    manifest, and readers ignore it."""
    try:
        if manifest_tried:
            claimed = _manifest(store, _manifest_name(step))
            if isinstance(claimed, CheckpointInfo) and claimed.file == name:
                return  # this save's write did land, after all
            if claimed is None and not isinstance(store, LocalStore):
                log.warning("%s: %s is left: its manifest's write failed and may still land",
                            store.url, name)
                return
        store.delete(name)
    except (S4Error, OSError) as exc:
        log.warning("%s: could not delete %s, which no checkpoint uses: %s", store.url, name,
                    exc)


def _retain_after(store: Store, step: int, keep_last: int) -> None:
    """Retention after saving ``step``: the last ``keep_last`` steps listed now, the one just
    saved (an older step, after a rollback, is not among the highest), and every step above it
    (another process may have committed one during this save)."""
    with _saving(store.url):
        # one listing for both: a step committed after it is not deleted
        infos = by_step(list_checkpoints(store))
        steps = sorted(infos)
        _retain(store, sorted(set(steps[-keep_last:]) | {step} | {s for s in steps if s > step}),
                infos)


def _cache(url: str, entry: tuple | None, keep_replaced: bool = False) -> None:
    """Set ``url``'s parent, or with None drop it: then its buffers are kept for the next
    save's snapshot (:func:`hostmem.take` hands one out only once the snapshot in it is no
    longer referred to), as they are when ``keep_replaced`` (saves that coded on the CPU,
    whose snapshots alternate between two buffers). Otherwise a replaced parent's buffers
    go: a save on the GPU path took them over, or its state changed size."""
    old = _PARENT_CACHE.pop(url, None)
    if entry is not None:
        _PARENT_CACHE[url] = entry
    if old is not None and (entry is None or keep_replaced):
        for dev, buf in old[3].items():
            if entry is None or all(buf is not b for b in entry[3].values()):
                hostmem.keep(dev, buf)


class _Snapshot:
    """A host copy of a state's tensors (the next delta's parent), by name in ``tensors``:
    host tensors copied at once; each device's CUDA tensors copied into one buffer per device
    (``buffers``: page-locked, or pageable where CuPy is missing or the host refuses) on a side
    stream, after the work already queued on that device's current stream.

    Where this save codes CUDA tensors on the GPU, the snapshot it replaces (``reuse``: its
    buffers, by device) is no longer read once the file is coded: :meth:`finish` then copies
    into its buffer (where it fits), so a run holds one snapshot, not two. Else the copies
    go at once into a kept buffer that fits (:func:`hostmem.take`), or into a new one once it
    is ready: its pages are populated by threads meanwhile (while the save codes), and
    :meth:`finish` registers it (which holds the device's other work up) and queues them."""

    def __init__(self, tensors: list[tuple[str, s4format.Tensor | DeviceTensor]],
                 reuse: dict[torch.device, np.ndarray]) -> None:
        self.tensors: dict[str, s4format.Tensor] = {}
        self.buffers: dict[torch.device, np.ndarray] = {}
        self.takes_over = False  # whether finish() writes into a buffer of ``reuse``
        self._events: list[torch.cuda.Event] = []
        self._pending: list[tuple[torch.device, list, np.ndarray | hostmem.Populating]] = []
        by_device: dict[torch.device, list[tuple[str, DeviceTensor]]] = {}
        for name, t in tensors:
            if isinstance(t, DeviceTensor):
                by_device.setdefault(t.device_bytes.device, []).append((name, t))
            else:
                self.tensors[name] = s4format.Tensor(t.dtype, t.shape, np.array(t.data, copy=True))
        try:
            for dev, run in by_device.items():
                nbytes = sum(t.nbytes for _n, t in run)
                if dev in reuse and hostmem.fits(reuse[dev], nbytes):
                    self.takes_over = True
                    self._pending.append((dev, run, reuse[dev]))
                elif (host := hostmem.take(dev, nbytes)) is not None:
                    self._copy(dev, run, host)
                else:
                    self._pending.append((dev, run, hostmem.populated(nbytes)))
        except BaseException:
            self.abandon()
            raise

    def _copy(self, dev: torch.device, run: list[tuple[str, DeviceTensor]], host: np.ndarray
              ) -> None:
        self._events.append(_copy_to_host(dev, run, host, self.tensors))
        self.buffers[dev] = host

    def finish(self) -> None:
        """Queue the copies still waiting for their buffers, wait for every copy."""
        while self._pending:
            dev, run, into = self._pending.pop(0)
            if isinstance(into, np.ndarray):  # the replaced snapshot's: overwritten
                self._copy(dev, run, into)
                continue
            host = into.result()
            hostmem.lock(host, dev.index)  # (else pageable: the copies wait for the device)
            self._copy(dev, run, host)
        _wait(self._events)

    def abandon(self) -> None:
        """While an error propagates: wait for the copies queued (they read the caller's
        tensors), hiding a failure there (a device already in error)."""
        self._pending.clear()
        _wait(self._events, quiet=True)


def _copy_to_host(dev: torch.device, run: list[tuple[str, DeviceTensor]], host: np.ndarray,
                  out: dict[str, s4format.Tensor]) -> torch.cuda.Event:
    """:class:`_Snapshot`'s copies of one device's tensors into ``host``, by name into
    ``out``; the event that ends them."""
    with torch.cuda.device(dev):
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        at = 0
        try:
            with torch.cuda.stream(side):
                for name, t in run:
                    h = host[at:at + t.nbytes]
                    if t.nbytes:
                        torch.from_numpy(h).copy_(t.device_bytes, non_blocking=True)
                    out[name] = s4format.Tensor(t.dtype, t.shape, h)
                    at += t.nbytes
            done = torch.cuda.Event()
            done.record(side)
        except BaseException:
            with contextlib.suppress(Exception):  # (the copies queued so far end first)
                side.synchronize()
            raise
    return done


def _wait(events: list[torch.cuda.Event], quiet: bool = False) -> None:
    """Wait for ``events``; ``quiet``: while another error propagates, which a failure here
    (a device already in error) must not hide."""
    for done in events:
        try:
            done.synchronize()
        except Exception:
            if not quiet:
                raise


def load_checkpoint(url_or_dir: Any, step: int | None = None, *, map_location: Any = None,
                    strict: bool = True, verify: bool = True, progress: bool | None = None,
                    device: str = "auto", into: Any = None, workspace: int | None = None,
                    resume: bool = False, distributed: bool = False, group: Any = None,
                    max_decoded_bytes: int | None = None) -> Any:
    """Load checkpoint ``step`` (default: the latest), resolving its delta chain.
    ``device`` and ``into`` (existing tensors to decode into, matched by key path, e.g.
    ``into={"model": model.state_dict(), "optimizer": opt.state_dict()}``), ``workspace`` and
    ``max_decoded_bytes`` are as in :func:`s4weights.load`.

    ``resume``: training resumes from this checkpoint and saves to this store again. A host
    copy of it is kept (page-locked where it can be: as much host memory as the checkpoint's
    raw bytes, what :func:`save_checkpoint` holds during a run anyway) as the parent of the
    next delta: that save then need not read the chain back from the store, which takes
    seconds per GB and level. The copy is made as each tensor is decoded, before the caller
    sees it, and kept only for the store's latest checkpoint (the next save's parent), with
    ``verify`` on, and where this process does not hold it already.

    A step saved with ``distributed=True`` loads into ``into`` (a sharded state dict) on every
    rank of ``group`` with ``distributed=True``, at any world size; without it, as one whole
    state dict in this process (host tensors)."""
    if step is not None:
        step = _check_step(step)
    store = open_store(url_or_dir)
    infos = by_step(list_checkpoints(store))
    if not infos:
        if isinstance(store, LocalStore) and not store.root.exists():
            raise StorageError(f"{store.root} does not exist: there is no checkpoint directory "
                               "there (save_checkpoint creates it)")
        hint = ""
        if isinstance(store, LocalStore) and store.root.is_file():
            hint = (": it is a file, not a checkpoint directory (load a single file with "
                    "s4weights.load)")
        raise StorageError(f"no checkpoints in {store.url}{hint}")
    if step is None:
        step = max(infos)
    if step not in infos:
        raise StorageError(f"no checkpoint step {step} in {store.url}; "
                           f"steps there: {sorted(infos)}")
    if distributed or infos[step].rank_files is not None:
        from s4weights.dcp import chain as dcp_chain

        if distributed and into is None:
            raise ValueError("load_checkpoint(distributed=True) loads into the sharded state "
                             "dict given as into=")
        return dcp_chain.load(store.url, step, into if distributed else None, group=group,
                              verify=verify, device=device, workspace=workspace)
    chain = chain_of(step, infos)
    reader = open_chain(store, chain, verify, device)
    try:
        copy = _HostCopy(reader) if resume and verify and step == max(infos) else None
        try:
            out = read_tree(reader, map_location, strict=strict, show=progress, device=device,
                            into=into, workspace=workspace, copy_to=copy,
                            max_decoded_bytes=max_decoded_bytes)
        except BaseException as exc:
            if copy is not None:
                copy.abandon()
            if isinstance(exc, StorageError):
                _raise_if_deleted(store, chain, exc)
            raise
        entry = None
        if copy is not None:
            try:
                entry = copy.entry(infos[step].checkpoint_id)
            except S4Error as exc:  # a stored tensor the tree does not use, damaged
                log.warning("checkpoint step %d loaded, but no host copy of it is kept as the "
                            "next save's parent: %s", step, exc)
        if entry is not None:
            with _saving(store.url):
                # only as the parent of the next save: the latest checkpoint still, and not
                # one this process already holds (a save's, whose buffer it keeps)
                now = by_step(list_checkpoints(store))
                held = _PARENT_CACHE.get(store.url)
                if max(now, default=None) == step and (held is None or held[0] != entry[0]):
                    _cache(store.url, entry, keep_replaced=True)
        return out
    finally:
        close_chain(reader)


class _HostCopy:
    """:func:`load_checkpoint`'s ``resume``: every stored tensor's raw bytes, copied as it is
    decoded into one host buffer (in stored order; its pages populated by threads while the
    chain opens and the first batch decodes, page-locked for the first CUDA tensor's device),
    then made the store's cached parent (:meth:`entry`), as a save would have left it."""

    def __init__(self, reader: s4format.Reader) -> None:
        self.reader = reader
        sizes = [t.raw_nbytes for t in reader.tensors]
        self.at = np.concatenate(([0], np.cumsum(sizes, dtype=np.int64))).tolist()
        self.off = False  # no copy: the host could not map it (the load goes on without)
        self._pending: hostmem.Populating | None = None
        try:
            self._pending = hostmem.populated(self.at[-1])
        except (MemoryError, OSError) as exc:
            self._give_up(exc)
        self._host: np.ndarray | None = None
        self._locked = False
        self.done: set[int] = set()
        self.devices: set[torch.device] = set()

    def _give_up(self, exc: BaseException) -> None:
        log.warning("load_checkpoint(resume=True): no host copy of the checkpoint's %d bytes "
                    "could be made (%s); the next save reads its parent back from the store",
                    self.at[-1], exc)
        self.off, self._pending, self._host = True, None, None

    def _whole(self, device: int | None = None) -> np.ndarray:
        if self._host is None:
            self._host = self._pending.result()
            self._pending = None
        if device is not None and not self._locked:
            hostmem.lock(self._host, device)  # (else pageable: the copies wait for the device)
            self._locked = True
        return self._host

    def _buffer(self, i: int, device: int | None = None) -> np.ndarray:
        return self._whole(device)[self.at[i]:self.at[i + 1]]

    def _ready(self) -> bool:
        """Whether the copy goes on: its buffer mapped and populated (a host out of memory
        there gives the copy up, not the load)."""
        if not self.off and self._host is None:
            try:
                self._whole()
            except (MemoryError, OSError) as exc:
                self._give_up(exc)
        return not self.off

    def host(self, i: int, t: s4format.Tensor) -> None:
        if not self._ready():
            return
        self._buffer(i)[:] = np.asarray(t.data).reshape(-1).view(np.uint8)
        self.done.add(i)

    def device(self, i: int, t: torch.Tensor) -> None:
        if not self._ready():
            return
        h = self._buffer(i, t.device.index)
        self.devices.add(t.device)  # (before the copy is queued: abandon() waits for it)
        if h.size:
            torch.from_numpy(h).copy_(t.reshape(-1).view(torch.uint8), non_blocking=True)
        self.done.add(i)

    def entry(self, checkpoint_id: str) -> tuple | None:
        """The cache entry (None when the copy was given up): the copies waited for (a
        caller's later writes to the tensors, on any stream, come after them), tensors no
        part of the tree loaded read here."""
        if not self._ready():
            return None
        for dev in self.devices:
            torch.cuda.current_stream(dev).synchronize()
        for i in range(len(self.reader.tensors)):
            if i not in self.done:
                self._buffer(i)[:] = self.reader.read_raw(i)
        host = self._whole()
        tensors = {t.name: s4format.Tensor(t.dtype, t.shape, host[self.at[i]:self.at[i + 1]])
                   for i, t in enumerate(self.reader.tensors)}
        hashes = {t.name: t.content_hash for t in self.reader.tensors}
        # (the next save's snapshot takes the buffer over where its state is on that device)
        buffers = {next(iter(self.devices)): host} if len(self.devices) == 1 else {}
        return checkpoint_id, tensors, hashes, buffers

    def abandon(self) -> None:
        """While an error propagates: wait for the copies queued into the buffer before it
        can go, hiding a failure there (a device already in error)."""
        for dev in self.devices:
            _wait_quietly(dev)


@dataclass(frozen=True)
class Swept:
    """What :func:`sweep` found: checkpoint files no manifest names (deleted unless a dry run),
    how many temporary files, uploads, pins or retiring marks of dead writers went (or would
    go), and what stopped it removing something."""
    orphans: list[str]
    temporaries: int
    problems: list[str]


_CHECKPOINT_FILE = re.compile(r"data/\d{12}(-[0-9a-f]{8})?\.s4w")
_STEP_FOLDER = re.compile(r"steps/\d{12}-[0-9a-f]{8}/")


def _unnamed_steps(store: Store, named: set[str], cutoff: float) -> list[str]:
    """The objects of distributed steps' folders that no manifest names (saves killed before
    their manifest), where none was written after ``cutoff``."""
    folders: dict[str, list[tuple[str, float]]] = {}
    for n, t in store.modified("steps/").items():
        if (m := _STEP_FOLDER.match(n)) and m[0] not in named:
            folders.setdefault(m[0], []).append((n, t))
    return [n for objs in folders.values() if max(t for _n, t in objs) < cutoff
            for n, _t in objs]


def sweep(url_or_dir: Any, older_than_s: float = 3600.0, *, dry_run: bool = False) -> Swept:
    """Remove what failed saves left in a run and nothing reads: checkpoint files that no
    manifest names (a save killed between its file and its manifest, a file a failed save
    could not delete) and the temporary files, or S3 multipart uploads, of writers that died
    in the run's ``data/`` and ``manifests/``, all last written more than ``older_than_s``
    ago (a save in progress writes its manifest right after its file; on S3 an object's time
    may be when its upload began, so keep ``older_than_s`` above the longest save, or sweep
    while no save runs; and above any difference between this machine's clock and the
    store's). Only names a save writes are candidates (``data/<step>[-<token>].s4w``, right
    inside ``data/``: not another run's files under this one). Where a manifest does not
    parse, it could name any file, and where there is none, every file would go: then no
    checkpoint file is removed and ``problems`` says why. ``dry_run`` removes nothing."""
    if not (math.isfinite(older_than_s) and older_than_s > 0):
        raise ValueError(f"older_than_s must be a positive number of seconds, not "
                         f"{older_than_s!r}")
    store = open_store(url_or_dir)
    with _saving(store.url):
        malformed: list[str] = []
        infos = list_checkpoints(store, problems=malformed)
        problems = [f"checkpoint files left alone: {p} (it may name any of them)"
                    for p in malformed]
        named = {i.file for i in infos}
        cutoff = time.time() - older_than_s
        found = [n for n, t in store.modified("data/").items()
                 if _CHECKPOINT_FILE.fullmatch(n) and n not in named and t < cutoff]
        found += _unnamed_steps(store, named, cutoff)
        if found and not infos and not problems:
            problems.append("checkpoint files left alone: no manifest names any of them, so "
                            "every one would go (delete them by hand if that is what is meant)")
        orphans = [] if problems else found
        removed = []
        for n in orphans:
            if not dry_run:
                try:
                    store.delete(n)
                except S4Error as exc:
                    problems.append(f"could not delete {n}: {exc}")
                    continue
            removed.append(n)
        try:
            temporaries = store.sweep(older_than_s, dirs=("data/", "manifests/"),
                                      dry_run=dry_run) if hasattr(store, "sweep") else 0
            leases = lease.stale(store, older_than_s)
            for n in leases if not dry_run else ():
                store.delete(n)
            temporaries += len(leases)
        except S4Error as exc:
            temporaries = 0
            problems.append(f"temporary files: {exc}")
    return Swept(removed, temporaries, problems)


def retain(url_or_dir: Any, keep_steps: list[int]) -> list[int]:
    """Delete every checkpoint not in ``keep_steps`` and not needed by a kept one (its chain
    back to the base). Returns the deleted steps."""
    store = open_store(url_or_dir)
    with _saving(store.url):
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
                store.delete(_manifest_name(s))
            for s in doomed:
                _delete_files(store, infos[s])
        needed = set(infos) - set(doomed)
    else:
        needed = set(infos)
    cached = _PARENT_CACHE.get(store.url)
    if cached and cached[0] not in {infos[s].checkpoint_id for s in needed}:
        _cache(store.url, None)
    return doomed


def _delete_files(store: Store, info: CheckpointInfo) -> None:
    """Delete a checkpoint's file, or every object of a distributed step's folder."""
    if info.file.endswith("/"):
        for name in store.list(info.file):
            store.delete(name)
        if isinstance(store, LocalStore):
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
