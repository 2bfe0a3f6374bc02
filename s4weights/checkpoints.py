"""``save_checkpoint`` and ``load_checkpoint``: checkpoints of a training run in a store.

A run is a local directory or an ``s3://`` prefix holding bases and XOR deltas
(:mod:`s4weights.chain`, one process) or sharded steps (:mod:`s4weights.dcp.chain`, every rank
calling with ``distributed=True``), listed by their manifests (:mod:`s4weights.manifests`).
These functions check the arguments and pick the path; docs/checkpoints.md is the user guide.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any

from s4format.errors import StorageError
from s4weights import background_save, chain, chainpolicy
from s4weights.manifests import CheckpointInfo, by_step, check_step, list_checkpoints, saving
from s4weights.store import open_store
from s4weights.store.local import LocalStore
from s4weights.torchtree import flatten


def save_checkpoint(state: Any, url_or_dir: Any, step: int, *, keyframe_interval: int = 10,
                    delta: bool = True, min_delta_gain: float = 0.05,
                    read_budget: float | str | None = "default", keep_last: int | None = None,
                    policy: str = "auto", metadata: dict[str, str] | None = None,
                    progress: bool | None = None, device: str = "auto",
                    workspace: int | None = None, distributed: bool = False,
                    group: Any = None, blocking: bool = True,
                    delta_against: str = chainpolicy.DELTA_AGAINST
                    ) -> CheckpointInfo | Future[CheckpointInfo]:
    """Save ``state`` as checkpoint ``step``: a delta when allowed, else a new base, whose
    manifest says why. ``delta_against``: ``"base"`` (default) makes the delta against the
    latest checkpoint's base, so every step loads from at most two files; ``"latest"`` against
    the latest checkpoint itself, a chain that grows a file per save. A delta is allowed while
    fewer than ``keyframe_interval`` saves share the base (retention's deletions counted; with
    ``"latest"``: while the chain is shorter than ``keyframe_interval`` files), the previous
    delta saved at
    least ``min_delta_gain`` of a full save, and loading the new step would read at most
    ``read_budget`` full saves (by default :data:`chainpolicy.READ_BUDGET`, None for no
    bound). Each tensor is stored as a delta only where the XOR codes smaller. ``keep_last``
    applies retention afterwards (docs/checkpoints.md).

    ``device`` and ``workspace`` are as in :func:`s4weights.save`; on the GPU path the XOR with
    the parent is made on the device too. This process keeps the next delta's parent in host
    memory (page-locked for CUDA tensors): the base it saved or read last, or with
    ``"latest"`` the checkpoint it saved last; nothing stays in GPU memory between saves. A
    process without it (after a restart) reads the parent from the store, unless it loaded
    it with ``load_checkpoint(..., resume=True)``.
    CUDA tensors must not change until the call returns. Saves to one store from several
    threads run one at a time. When the latest checkpoint cannot be read, the save still
    succeeds, as a base, and logs a warning naming it.

    ``distributed=True``: every rank of ``group`` (default: the default process group) calls
    this with its sharded state dict (FSDP2, DTensor); the step is a DCP checkpoint of one
    .s4w per rank, each a delta of that rank's previous file where that pays (docs/dcp.md),
    whatever ``delta_against`` says.

    ``blocking=False`` returns a :class:`concurrent.futures.Future` of the CheckpointInfo once
    the state is captured (copied: on the device for CUDA tensors where it has room); coding,
    writing, the commit and retention go on in the background, and ``result()`` raises what a
    blocking save would. Saves to one store run in the order they were made
    (:mod:`s4weights.background_save`)."""
    step = check_step(step)
    if read_budget == "default":
        read_budget = chainpolicy.READ_BUDGET
    if read_budget is not None and not (isinstance(read_budget, (int, float))
                                        and read_budget >= 1):
        raise ValueError(f"read_budget must be a number >= 1 (full saves) or None, not "
                         f"{read_budget!r}")
    if delta_against not in chainpolicy.DELTA_TARGETS:
        raise ValueError(f"delta_against must be one of {chainpolicy.DELTA_TARGETS}, not "
                         f"{delta_against!r}")
    if keep_last is not None and keep_last < 1:
        # steps[-0:] would keep every checkpoint, the opposite of what 0 asks.
        raise ValueError("keep_last must be >= 1 (the checkpoint being saved is kept)")
    store = open_store(url_or_dir)
    kw = dict(keyframe_interval=keyframe_interval, delta=delta, min_delta_gain=min_delta_gain,
              read_budget=read_budget, keep_last=keep_last, policy=policy, device=device,
              workspace=workspace)
    if distributed:
        if not blocking:
            raise ValueError("distributed=True saves block; use dcp.async_save with "
                             "S4StorageWriter for asynchronous sharded saves")
        if metadata or progress:
            raise ValueError("metadata and progress are not supported with distributed=True")
        background_save.wait_for(store.url)
        # Imported here: torch.distributed.checkpoint takes seconds to import, which a
        # one-process save should not pay.
        from s4weights.dcp import chain as dcp_chain
        with saving(store.url):
            return dcp_chain.save(state, store.url, step, group=group, **kw)
    kw.update(metadata=metadata, progress=progress, delta_against=delta_against)
    if not blocking:
        captured, streams = background_save.capture(flatten(state))
        return background_save.submit(store.url,
                                      lambda: chain.save(store, captured, step, **kw), streams)
    background_save.wait_for(store.url)
    return chain.save(store, state, step, **kw)


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
    sees it, and kept only for the store's latest checkpoint, with ``verify`` on, and where this
    process does not hold it already. Where that checkpoint is a delta on its base saved with
    ``delta_against="base"`` (the default; its manifest says so, or for manifests before
    2026-12-05, no deeper chain is listed), the copy is turned
    into the base, the next delta's parent, by XORing the step's own bytes back out of it (a
    level's decode, each tensor checked against the base's content hash); this on the CPU
    path only: a step loaded onto the GPU keeps its own copy, and the next delta against the
    base reads the base from the store.

    A step saved with ``distributed=True`` loads into ``into`` (a sharded state dict) on every
    rank of ``group`` with ``distributed=True``, at any world size; without it, as one whole
    state dict in this process (host tensors)."""
    if step is not None:
        step = check_step(step)
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
        if distributed and into is None:
            raise ValueError("load_checkpoint(distributed=True) loads into the sharded state "
                             "dict given as into=")
        from s4weights.dcp import chain as dcp_chain
        return dcp_chain.load(store.url, step, into if distributed else None, group=group,
                              verify=verify, device=device, workspace=workspace)
    return chain.load(store, infos, step, map_location=map_location, strict=strict,
                      verify=verify, progress=progress, device=device, into=into,
                      workspace=workspace, resume=resume, max_decoded_bytes=max_decoded_bytes)
