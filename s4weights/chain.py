"""One process's checkpoint chains: a base and deltas against it, or against the latest
checkpoint (``delta_against``).

Each save writes a file of its own name (``data/<step>-<token>.s4w``) and then its manifest
(:mod:`s4weights.manifests`), so two saves of one step that race cannot replace each other's
file: the first manifest wins, the other save deletes its file and fails. A .s4w file names its
parent by checkpoint ID and the reader refuses another. A delta's parent is pinned against other
processes' retention while the delta is saved (:mod:`s4weights.lease`); a save never writes a
delta against a checkpoint whose chain it cannot open or read, but saves a base and warns. The
process keeps the next delta's parent in host memory: the base, or the checkpoint it saved
last.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

import s4format
from s4format import hashing
from s4format.errors import ParentMismatchError, S4Error, StorageError
from s4weights import chainpolicy, gpu, hostmem, lease
from s4weights.api import read_tree, write_flattened
from s4weights.manifests import (
    RETAINED,
    CheckpointInfo,
    by_step,
    chain_of,
    data_name,
    list_checkpoints,
    manifest_name,
    parent_gone,
    read_manifest,
    retain_after,
    saves_on,
    saving,
)
from s4weights.store import Store
from s4weights.store.base import reading_whole
from s4weights.store.local import LocalStore
from s4weights.torchtree import DeviceTensor, Flattened, flatten

log = logging.getLogger("s4weights")


# Raw bytes of the last checkpoint this process saved, per store: the parent of the next delta
# without re-reading it, with the content hashes the file records. One copy of the state, in
# host memory whatever the tensors' devices (page-locked for CUDA tensors, one buffer per
# device, the last item: the GPU path copies each parent into the XOR's device buffer, within
# the workspace); never GPU memory between saves.
_PARENT_CACHE: dict[str, tuple[str, dict[str, s4format.Tensor], dict[str, bytes],
                               dict[torch.device, np.ndarray]]] = {}


def close_chain(reader: s4format.Reader | None) -> None:
    """Close a reader and every parent it was opened with."""
    while reader is not None:
        reader.close()
        reader = reader.parent


def open_chain(store: Store, chain: list[CheckpointInfo], verify: bool,
               device: str = "auto", whole: bool = False) -> s4format.Reader:
    """Readers for ``chain`` (base first), each attached to its parent; returns the last.
    Close them with :func:`close_chain`; on failure every reader opened so far is closed.
    Checkpoints written with the GPU-only codec (nvcomp-ans) open where it can run, unless
    ``device`` is ``"cpu"``. ``whole``: every tensor will be read (a load; see
    :func:`~s4weights.store.base.reading_whole`). The newest file opens first, so its own
    errors come before its parents': its object tree is the one a load uses, and the parents'
    trees, byte for byte the same in a chain of one state, are then checked by a lookup
    (``s4format.reader._CheckedTrees``) instead of decoded. On a store where each read is a
    round trip (S3) the parents then open together, their errors still reported newest first.
    Every file is opened before any is attached to its parent (rules A1 and A2)."""
    from s4weights import gpu

    gpu.register_codecs(device)
    readers: list[s4format.Reader] = []  # newest first
    futures: list[Future] = []
    try:
        readers.append(_open_file(store, chain, chain[-1], verify, whole))
        parents = chain[-2::-1]
        if store.remote and len(parents) > 1:
            with ThreadPoolExecutor(min(len(parents), OPEN_THREADS),
                                    thread_name_prefix="s4w-open") as pool:
                futures = [pool.submit(_open_file, store, chain, info, verify, whole)
                           for info in parents]
            # (leaving the pool waited for every open)
            readers.extend(f.result() for f in futures)  # (the first failure, in order)
        else:
            for info in parents:
                readers.append(_open_file(store, chain, info, verify, whole))
        for child, parent in itertools.pairwise(readers):
            child.attach_parent(parent)
    except BaseException:
        # (the opens still running when the pool was left have ended by now)
        done = [f.result() for f in futures if f.done() and f.exception() is None]
        for r in {id(r): r for r in readers + done}.values():
            r.close()
        raise
    return readers[0]


# Parent files of a chain opened at once on a remote store, at most.
OPEN_THREADS = 8


def _open_file(store: Store, chain: list[CheckpointInfo], info: CheckpointInfo, verify: bool,
               whole: bool) -> s4format.Reader:
    """The reader of ``info``'s file (of ``chain``), checked against its manifest entry."""
    try:
        # a file deleted since the listing fails in either call (on S3, between the
        # source's HEAD and the header's GET too)
        src = store.source(info.file)
        reader = s4format.Reader(reading_whole(src) if whole else src, verify=verify)
    except StorageError as exc:
        _raise_if_deleted(store, chain, exc)
        if info is chain[-1]:
            raise StorageError(
                f"checkpoint step {info.step} is listed in {store.url}, but its file cannot be "
                f"read: {exc}; restore {info.file}, or drop the step with retain()") from exc
        raise ParentMismatchError(
            f"checkpoint step {chain[-1].step} needs step {info.step} of its chain, whose "
            f"file cannot be read: {exc}") from exc
    if reader.checkpoint_id.hex() != info.checkpoint_id:
        reader.close()
        raise ParentMismatchError(
            f"{info.file} is checkpoint {reader.checkpoint_id.hex()}, its manifest says "
            f"{info.checkpoint_id}")
    return reader


def _raise_if_deleted(store: Store, chain: list[CheckpointInfo], exc: StorageError) -> None:
    """Say that a step of ``chain`` was deleted (by retention in another process) while it was
    being read, where that is why reading it failed with ``exc``."""
    for info in chain:
        if not store.exists(manifest_name(info.step)):
            raise StorageError(
                f"checkpoint step {info.step} was deleted from {store.url} while step "
                f"{chain[-1].step} was being read (retention in another process, or retain()); "
                "list the checkpoints again and load one that is kept") from exc


def _parent_tensors(store: Store, parent: CheckpointInfo, infos: dict[int, CheckpointInfo],
                    device: str = "cpu", workspace: int | None = None
                    ) -> tuple[dict[str, s4format.Tensor], dict[str, bytes], np.ndarray | None,
                               dict[str, int]]:
    """The tensors of ``parent``, to XOR the next checkpoint against, their content hashes
    (by name), the page-locked buffer holding them where the GPU decoded them (else None),
    and the stored bytes of those its file stores whole (by name); an S4Error when its chain
    cannot be read, even when this process still holds them (a delta against a parent nobody
    can read could never be loaded). ``device`` other than "cpu" (a save on the GPU path):
    the chain is decoded on the current GPU, within ``workspace``, as a load would, not on
    the CPU (which takes seconds per GB and file)."""
    chain = chain_of(parent.step, infos)
    cached = _PARENT_CACHE.get(store.url)
    if cached and cached[0] == parent.checkpoint_id:
        # The cache spares decoding the chain, not checking that it is still there: open every
        # file of it (header, footer, index checksum, checkpoint IDs against the manifests),
        # which catches deleted, truncated and replaced files. Damage inside a plane's payload
        # shows only when the planes are read, as they are in a fresh process.
        reader = open_chain(store, chain, verify=False)
        try:
            return cached[1], cached[2], None, _stored_whole(reader)
        finally:
            close_chain(reader)
    reader = open_chain(store, chain, verify=True, device=device, whole=True)
    try:
        hashes = {t.name: t.content_hash for t in reader.tensors}
        whole = _stored_whole(reader)
        if device != "cpu" and gpu.use_gpu(device, True):
            try:
                tensors, buffer = _read_on_gpu(reader, device, workspace)
                return tensors, hashes, buffer, whole
            except gpu.out_of_memory_errors() as exc:  # (a training run may leave little)
                log.warning("reading the parent checkpoint step %d on the GPU ran out of "
                            "memory (%s): read on the CPU instead", parent.step,
                            gpu.error_text(exc))
        return {t.name: reader.read(i) for i, t in enumerate(reader.tensors)}, hashes, None, whole
    finally:
        close_chain(reader)


def _stored_whole(reader: s4format.Reader) -> dict[str, int]:
    """The stored bytes of each tensor ``reader``'s file stores whole (not as a delta), by
    name: what the same tensor of the next state stores coded alone, near enough for the
    CPU coder to weigh its delta against (:attr:`chainpolicy.Sample.alone`), where no
    sample of that state says."""
    return {t.name: t.stored_nbytes for t in reader.tensors if not t.is_delta}


def _read_on_gpu(reader: s4format.Reader, device: str, workspace: int | None
                 ) -> tuple[dict[str, s4format.Tensor], np.ndarray]:
    """Every tensor of ``reader`` (a chain) as host bytes in one page-locked buffer (a kept
    one that fits, else a new one), read on the current device within ``workspace``: in
    batches (:func:`gpu.loader_for`, each decoded tensor counted against the workspace until
    it is copied down), a tensor that alone needs more in chunks, each copied down as it is
    made (:func:`chunked.load_large`), and on the CPU where the GPU does not decode it (empty
    tensors too: their checks; a delta's own level alone where its parent decodes on the GPU,
    :func:`decode.host_level`). Fails as the CPU reader would, reading in order."""
    from s4weights.gpu import plan
    from s4weights.gpu.decode import batched, decodable, device_extra
    from s4weights.gpu.decode_large import chunkable, load_large
    from s4weights.gpu.ransparse import HostDecodes

    total = sum(t.raw_nbytes for t in reader.tensors)
    ws = workspace or plan.default_workspace(total)
    dev = torch.device("cuda", torch.cuda.current_device())
    in_batches = [i for i, t in enumerate(reader.tensors)
                  if t.raw_nbytes > 0 and batched(reader, i)
                  and t.raw_nbytes + device_extra(reader, i) <= ws]
    load = gpu.loader_for(reader, device, workspace=ws, count_outputs=True,
                          wanted=in_batches)
    batched_set = set(in_batches)
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
            if i in batched_set:
                got = load(i, dev)
                # (the device copy's memory goes back to torch's allocator at once: stream
                # order keeps later work from writing it before this copy has read it)
                torch.from_numpy(h).copy_(got.reshape(-1).view(torch.uint8), non_blocking=True)
                del got
            elif on_gpu and chunkable(reader, i):
                try:
                    load_large(reader, i, torch.from_numpy(h), ws, on_host=True)
                except HostDecodes:  # (streams of tiny blocks, say): the CPU decodes it
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


def save(store: Store, state: Any, step: int, **kw: Any) -> CheckpointInfo:
    """Save ``state`` as checkpoint ``step`` of ``store`` in this process (see
    :func:`s4weights.save_checkpoint`), one save per store at a time."""
    with saving(store.url) as nested:
        return _save(store, state, step, nested=nested, **kw)


def _save(store: Store, state: Any, step: int, *, keyframe_interval: int, delta: bool,
          min_delta_gain: float, keep_last: int | None, nested: bool, delta_against: str,
          **coding: Any) -> CheckpointInfo:
    infos = by_step(list_checkpoints(store))
    if step in infos:
        raise StorageError(f"checkpoint step {step} already exists in {store.url}")
    latest = infos[max(infos)] if infos else None
    on_base = None
    if latest is not None and delta_against == "base":
        on_base = saves_on(infos, latest.base_step)
    why = chainpolicy.reason_without_parent(latest, step, delta=delta,
                                            keyframe_interval=keyframe_interval,
                                            min_delta_gain=min_delta_gain, on_base=on_base)
    if why is None and latest is not None and latest.rank_files is not None:
        why = f"step {latest.step} was saved with distributed=True"
    parent = None if why else latest
    if parent is not None and delta_against == "base" and not parent.is_base:
        parent = infos.get(parent.base_step)
        if parent is None:  # (a chain whose base is gone cannot be loaded either)
            why = f"the base step {latest.base_step} of step {latest.step} is not listed"
    info = _save_on(store, state, step, infos, parent, why, nested=nested,
                    against_base=delta_against == "base", **coding)
    if keep_last is not None:
        try:
            retain_after(store, step, keep_last)
        except (S4Error, OSError) as exc:
            # the checkpoint is committed: a retention that fails (a file that cannot be
            # deleted) is said, and the next save's retention tries again
            log.warning("checkpoint step %d is saved, but retention failed: %s", step, exc)
    return info


class _ParentGone(S4Error):
    """The parent of the delta being saved was deleted or is being deleted."""


class _OverBudget(S4Error):
    """The delta as coded makes loading it read more than the read budget."""


def _save_on(store: Store, state: Any, step: int, infos: dict[int, CheckpointInfo],
             parent: CheckpointInfo | None, why: str | None, **kw: Any) -> CheckpointInfo:
    """Save ``state`` as a delta of ``parent``, pinned against retention from before its chain
    is read until the manifest is committed, or as a base (for the reason ``why``) when there
    is no parent or the pin came too late, or when the delta, coded without the read budget's
    sample (:func:`chainpolicy.clear_by_latest`), came out over the budget."""
    if parent is None:
        return _code(store, state, step, infos, None, base_reason=why, **kw)
    over = None  # why a delta coded without the budget's sample did not fit it
    with lease.pin(store, parent.step, parent.checkpoint_id):
        try:
            chain = chain_of(parent.step, infos)
            why = parent_gone(store, chain)
        except S4Error as exc:
            chain, why = [], f"its chain cannot be read: {exc}"
        if why is None:
            try:
                return _code(store, state, step, infos, chain, **kw)
            except _ParentGone as exc:
                why = str(exc)
            except _OverBudget as exc:
                over = str(exc)
    if over is not None:
        log.info("checkpoint step %d starts a new base: %s", step, over)
        return _code(store, state, step, infos, None, base_reason=over, **kw)
    log.warning("checkpoint step %d is saved as a base, not as a delta of step %d: %s", step,
                parent.step, why)
    return _code(store, state, step, infos, None, base_reason=f"parent unusable: {why}", **kw)


def _code(store: Store, state: Any, step: int, infos: dict[int, CheckpointInfo],
          chain: list[CheckpointInfo] | None, *, nested: bool, policy: str,
          metadata: dict[str, str] | None, progress: bool | None, device: str,
          workspace: int | None, read_budget: float | None, against_base: bool,
          base_reason: str | None = None) -> CheckpointInfo:
    """Code ``state`` into a new file of step ``step`` (a delta of ``chain``'s last checkpoint
    where given) and commit it with its manifest. ``against_base``: the next save's parent is
    this one's base, not this one: a delta leaves the parent held as it is (reading a parent
    from the store makes it the held one), and needs no snapshot of its CUDA tensors."""
    parent = chain[-1] if chain else None
    flat = state if isinstance(state, Flattened) else flatten(state)
    # The next delta's parent is a host snapshot of this state. Host tensors are copied as the
    # save starts and the file is coded from the copies, so a caller changing them during the
    # save (from another thread) cannot make the file and the snapshot differ; a delta
    # against the base keeps no snapshot and codes the caller's host tensors, as save does.
    # CUDA tensors are coded in place on the GPU and copied to page-locked memory on a side
    # stream (into the parent's buffer once the file is coded, see _Snapshot): no device copy
    # of the state, so the save's extra GPU memory stays within the workspace; they must not
    # change until the call returns (as for torch.save).
    on_gpu = gpu.use_gpu(device, any(isinstance(t, DeviceTensor) for _n, t in flat.tensors))
    devices = {t.device_bytes.device for _n, t in flat.tensors if isinstance(t, DeviceTensor)}
    parents = hashes = read_buffer = alone = stored_whole = None
    if parent is not None:
        try:
            # (read on the state's device where it has one, whose snapshot may take it over)
            with torch.cuda.device(next(iter(devices))) if on_gpu and len(devices) == 1 \
                    else contextlib.nullcontext():
                parents, hashes, read_buffer, stored_whole = _parent_tensors(
                    store, parent, infos, device if on_gpu else "cpu", workspace)
        except S4Error as exc:
            log.warning("checkpoint step %d is saved as a base, not as a delta of step %d "
                        "(%s), which cannot be read: %s", step, parent.step, parent.file, exc)
            parent, base_reason = None, f"parent unreadable: {exc}"
    check_after = False  # (the budget checked on the delta as coded, not sampled first)
    if parent is not None and read_budget is not None:
        latest = infos[max(infos)] if infos else None
        check_after = chainpolicy.clear_by_latest(chain, latest, read_budget)
        if not check_after:
            base_reason, alone = chainpolicy.over_budget(chain, flat.tensors, parents,
                                                         read_budget, policy)
        if base_reason is not None:
            log.info("checkpoint step %d starts a new base: %s", step, base_reason)
            parent = parents = hashes = alone = None
    if parent is not None and stored_whole:
        # The parent's tensors stored whole stand for this state's coded alone, where the
        # budget's sample gave no figure: sampling each tensor alone took a tenth of a
        # fine-tuning delta's save (2 of 18 ms on 2 cores). A delta not clearly smaller than
        # that figure is weighed against the tensor's own estimate (writer.CLEAR_DELTA).
        alone = {**stored_whole, **(alone or {})}
    # the buffer this snapshot may take over once the file is coded (on the GPU path): the
    # cached parent's, or that of the parent just read from the store (where the state is on
    # one device); none where the parent stays held (a delta against the base)
    keeps_parent = against_base and parent is not None
    replaced = _PARENT_CACHE.get(store.url)
    reuse = replaced[3] if replaced else {}
    if read_buffer is not None and len(devices) == 1:
        reuse = {next(iter(devices)): read_buffer}
    snap = _Snapshot(flat.tensors, reuse if on_gpu and not nested and not keeps_parent else {},
                     devices=not (keeps_parent and on_gpu), hosts=not keeps_parent)
    try:
        if not on_gpu:  # the CPU codes every tensor: from the snapshot, not a second copy
            snap.finish()
        flat = type(flat)(flat.tree, [
            (name, t if on_gpu and isinstance(t, DeviceTensor) else snap.tensors[name])
            for name, t in flat.tensors])
        t0 = time.perf_counter()
        name = data_name(step)
        with store.writer(name) as sink:
            result = write_flattened(
                flat, sink, policy=policy, parent_id=bytes.fromhex(parent.checkpoint_id)
                if parent else None, parents=parents, metadata=metadata, show=progress,
                device=device, workspace=workspace, parent_hashes=hashes, alone=alone)
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
            created=time.time(), base_reason=None if used else base_reason,
            saves_on_base=saves_on(infos, used.base_step) + 1 if used else 1,
            delta_against="base" if against_base else "latest")
        if used is not None and (why := parent_gone(store, chain)):
            _drop_unclaimed(store, step, name, manifest_tried=False)
            raise _ParentGone(why)
        if used is not None and check_after and (why := chainpolicy.over_budget_share(
                chainpolicy.own_share(info), chainpolicy.chain_share(chain), read_budget)):
            _drop_unclaimed(store, step, name, manifest_tried=False)
            raise _OverBudget(why)
        try:
            store.put_atomic(manifest_name(step), info.to_json(), if_absent=True)
        except BaseException:
            _drop_unclaimed(store, step, name)
            raise
    except BaseException:
        snap.abandon()
        raise
    if keeps_parent and used is not None:
        for dev, buf in snap.buffers.items():  # (CUDA tensors coded on the CPU: for the next)
            hostmem.keep(dev, buf)
        if replaced is None or replaced[0] != parent.checkpoint_id:  # (read from the store)
            held = {} if read_buffer is None else {
                next(iter(devices)) if len(devices) == 1
                else torch.device("cuda", torch.cuda.current_device()): read_buffer}
            _cache(store.url, (parent.checkpoint_id, parents, hashes, held), keep_replaced=True)
    elif keeps_parent and snap.partial:  # (a base after all, its tensors not all copied)
        _cache(store.url, None)
    else:
        # (the CPU coder read the parent while this snapshot existed: its buffer is the next's)
        _cache(store.url, (info.checkpoint_id, snap.tensors, result.content_hashes,
                           snap.buffers), keep_replaced=not on_gpu)
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
            claimed = read_manifest(store, manifest_name(step))
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


def _forget_retained(url: str, kept: set[str]) -> None:
    """Retention deleted the cached parent of ``url``: its buffers go back for reuse."""
    cached = _PARENT_CACHE.get(url)
    if cached and cached[0] not in kept:
        _cache(url, None)


RETAINED.append(_forget_retained)


class _Snapshot:
    """A host copy of a state's tensors (the next delta's parent), by name in ``tensors``:
    host tensors copied at once (with ``hosts`` False, taken as they are: the snapshot is
    then only what the save codes from, and ``partial``); each device's CUDA tensors copied
    into one buffer per device (``buffers``: page-locked, or pageable where CuPy is missing or
    the host refuses) on a side stream, after the work already queued on that device's
    current stream.

    Where this save codes CUDA tensors on the GPU, the snapshot it replaces (``reuse``: its
    buffers, by device) is no longer read once the file is coded: :meth:`finish` then copies
    into its buffer (where it fits), so a run holds one snapshot, not two. Else the copies
    go at once into a kept buffer that fits (:func:`hostmem.take`), or into a new one once it
    is ready: its pages are populated by threads meanwhile (while the save codes), and
    :meth:`finish` registers it (which holds the device's other work up) and queues them."""

    def __init__(self, tensors: list[tuple[str, s4format.Tensor | DeviceTensor]],
                 reuse: dict[torch.device, np.ndarray], devices: bool = True,
                 hosts: bool = True) -> None:
        self.tensors: dict[str, s4format.Tensor] = {}
        self.buffers: dict[torch.device, np.ndarray] = {}
        self.takes_over = False  # whether finish() writes into a buffer of ``reuse``
        self.partial = False  # whether tensors were left out (``devices`` or ``hosts`` False)
        self._events: list[torch.cuda.Event] = []
        self._pending: list[tuple[torch.device, list, np.ndarray | hostmem.Populating]] = []
        by_device: dict[torch.device, list[tuple[str, DeviceTensor]]] = {}
        for name, t in tensors:
            if isinstance(t, DeviceTensor):
                if devices:
                    by_device.setdefault(t.device_bytes.device, []).append((name, t))
                else:
                    self.partial = True
            elif hosts:
                self.tensors[name] = s4format.Tensor(t.dtype, t.shape, np.array(t.data, copy=True))
            else:  # (the caller's own tensor: coded from, never kept)
                self.tensors[name] = t
                self.partial = True
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


def load(store: Store, infos: dict[int, CheckpointInfo], step: int, *, map_location: Any,
         strict: bool, verify: bool, progress: bool | None, device: str, into: Any,
         workspace: int | None, resume: bool, max_decoded_bytes: int | None) -> Any:
    """Load checkpoint ``step`` of ``store`` (listed in ``infos``) with its chain in this
    process (see :func:`s4weights.load_checkpoint`)."""
    chain = chain_of(step, infos)
    reader = open_chain(store, chain, verify, device, whole=True)
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
                info = infos[step]
                if info.depth == 1 and not copy.devices and _against_base(info, infos):
                    # the next delta's parent is this step's base, which this step's own
                    # bytes XORed back out of the copy give
                    entry = copy.base_entry(infos[info.base_step].checkpoint_id)
                else:
                    entry = copy.entry(info.checkpoint_id)
            except S4Error as exc:  # a stored tensor the tree does not use, damaged
                log.warning("checkpoint step %d loaded, but no host copy of it is kept as the "
                            "next save's parent: %s", step, exc)
        if entry is not None:
            with saving(store.url):
                # only as the parent of the next save: the latest checkpoint still, and not
                # one this process already holds (a save's, whose buffer it keeps)
                now = by_step(list_checkpoints(store))
                held = _PARENT_CACHE.get(store.url)
                if max(now, default=None) == step and (held is None or held[0] != entry[0]):
                    _cache(store.url, entry, keep_replaced=True)
        return out
    finally:
        close_chain(reader)




def _against_base(info: CheckpointInfo, infos: dict[int, CheckpointInfo]) -> bool:
    """Whether the run that saved ``info`` takes its deltas against the base: as its
    manifest says, else (manifests before 2026-12-05) where no chain deeper than one delta is
    listed."""
    if info.delta_against is not None:
        return info.delta_against == "base"
    return all(i.depth <= 1 for i in infos.values())


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

    def base_entry(self, base_id: str) -> tuple | None:
        """:meth:`entry` of the base of this delta step (its reader's parent), made from the
        copy: each delta tensor's own bytes XORed back out (a level's decode, not the base's),
        checked against the base's content hash; each tensor stored whole read from the base
        where it holds one of that name and size. None where the copy was given up or a
        tensor does not come back to its base's hash."""
        if not self._ready():
            return None
        r, base = self.reader, self.reader.parent
        if base is None:
            return None
        tensors: dict[str, s4format.Tensor] = {}
        hashes: dict[str, bytes] = {}
        for i, t in enumerate(r.tensors):
            h = self._buffer(i)
            if t.is_delta:
                if i not in self.done:
                    h[:] = r.read_raw(i)
                k = r.undo_delta(i, h)
            else:
                try:
                    k = base.index_of(t.name)
                except KeyError:
                    continue  # (no parent of that name: the next save codes it alone)
                if base.tensors[k].raw_nbytes != t.raw_nbytes:
                    continue
                h[:] = base.read_raw(k)  # (checked there: the copy is made only verifying)
            # (by this tensor's name: the next save pairs tensors by name, and two of the
            # base's may hold the same bytes)
            bt = base.tensors[k]
            if t.is_delta and hashing.content_hash(h) != bt.content_hash:
                log.warning("load_checkpoint(resume=True): tensor %r does not come back to its "
                            "base; the next save reads its parent from the store", t.name)
                return None
            tensors[t.name] = s4format.Tensor(bt.dtype, bt.shape, h)
            hashes[t.name] = bt.content_hash
        return base_id, tensors, hashes, {}

    def abandon(self) -> None:
        """While an error propagates: wait for the copies queued into the buffer before it
        can go, hiding a failure there (a device already in error)."""
        for dev in self.devices:
            _wait_quietly(dev)
