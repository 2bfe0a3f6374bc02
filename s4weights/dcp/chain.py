"""Delta chains of sharded checkpoints: ``save_checkpoint(..., distributed=True)`` on every rank.

Each step is a DCP checkpoint in ``steps/<step>-<token>/`` of the run (one .s4w per rank and
``.metadata``), made by :class:`S4StorageWriter`; its manifest, put last by the coordinator,
names the directory, every rank file with its checkpoint ID and parent file, and the step's
parent step, so retention, ``list`` and ``verify`` treat it as any checkpoint. A rank stores its
shards as XOR deltas against its own file of the previous step where that codes smaller; the
parent is the copy of its shards each rank keeps in host memory, so a step is a delta only
when every rank holds its part of the parent (same world size and plan, no restart since).
"""

from __future__ import annotations

import contextlib
import dataclasses
import secrets
import time
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import xxhash
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner
from torch.futures import Future

import s4format
from s4format.errors import FormatError, ParentMismatchError, S4Error, StorageError
from s4weights import chainpolicy, lease, manifests
from s4weights.dcp.reader import S4StorageReader
from s4weights.dcp.writer import S4StorageWriter, flatten_items
from s4weights.manifests import CheckpointInfo, by_step, chain_of, list_checkpoints
from s4weights.store import Store, open_store
from s4weights.store.base import reading_whole
from s4weights.store.local import LocalStore

STEPS = "steps/"


@dataclasses.dataclass
class _Held:
    """What a rank keeps of the step it saved last: the next delta's parent."""
    step_id: str  # the step's checkpoint ID
    file: str | None  # this rank's file of it (its name in the run), None if it wrote none
    file_id: bytes
    world: int
    tensors: dict[str, s4format.Tensor]


# (store URL, rank) -> what that rank of this process saved last there
_HELD: dict[tuple[str, int], _Held] = {}


class _ChainWriter(S4StorageWriter):
    """S4StorageWriter whose rank file is a delta of ``held`` where the whole step's delta
    fits the read budget (``budget``: the chain's files and the budget, in full saves; the
    decision is taken across the ranks inside ``write_data``)."""

    def __init__(self, url: str, *, held: _Held | None, budget: tuple[float, float] | None,
                 group: Any, **kw: Any) -> None:
        super().__init__(url, overwrite=False, **kw)
        self.held, self.budget, self.group = held, budget, group
        self.snapshot: dict[str, s4format.Tensor] = {}
        self.over_budget: str | None = None
        self._name = ""

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Any:
        flat, _keys, _sizes = flatten_items(plan, planner)
        parents = self.held.tensors if self.held is not None else None
        if self.budget is not None:
            mine = chainpolicy.sample_sizes(flat.tensors, parents or {}, self.policy)
            got: list[Any] = [None] * dist.get_world_size(self.group)
            dist.all_gather_object(got, mine, group=self.group)
            full, delta = (sum(x) for x in zip(*got))
            self.over_budget = chainpolicy.over_budget_share(
                delta / full if full else 0.0, *self.budget)
        if self.over_budget is not None:
            self.held = None
        self.snapshot = {n: _host_copy(t) for n, t in flat.tensors}
        if not plan.items:
            return super().write_data(plan, planner)
        self._name = plan.storage_data.name
        results = self._write_rank_file(
            plan.storage_data.name, plan, planner,
            parent_id=self.held.file_id if self.held else None,
            parents=self.held.tensors if self.held else None)
        fut: Future[list[Any]] = Future()
        fut.set_result(results)
        return fut

    def summary(self, folder: str) -> dict[str, Any] | None:
        """This rank's file, for the coordinator's manifest."""
        w = self.written
        if w is None:
            return None
        delta = w.parent_id is not None
        return dict(name=folder + self._name, checkpoint_id=w.checkpoint_id.hex(),
                    parent=self.held.file if delta and self.held else None, raw=w.raw_nbytes,
                    stored=w.stored_nbytes, file=w.file_size, full=w.full_stored_nbytes)


def _host_copy(t: Any) -> s4format.Tensor:
    from s4weights.torchtree import DeviceTensor

    if isinstance(t, DeviceTensor):
        return t.to_host()
    return s4format.Tensor(t.dtype, t.shape, np.array(t.data, copy=True))


def _broadcast(value: Any, group: Any) -> Any:
    """``value`` of the group's first rank, on every rank."""
    box = [value]
    src = dist.get_global_rank(group, 0) if group is not None else 0
    dist.broadcast_object_list(box, src=src, group=group)
    return box[0]


def _all(flag: bool, group: Any) -> bool:
    got: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(got, flag, group=group)
    return all(got)


def save(state: dict[str, Any], url: Any, step: int, *, group: Any = None,
         keyframe_interval: int, delta: bool, min_delta_gain: float,
         read_budget: float | None, keep_last: int | None, policy: str, device: str,
         workspace: int | None) -> CheckpointInfo:
    """Every rank of ``group`` calls this with its part of ``state`` (see
    :func:`s4weights.save_checkpoint`); all return the same :class:`CheckpointInfo`."""
    store = open_store(url)
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    first = rank == 0
    plan = _broadcast(_plan(store, step, world, delta=delta, keyframe_interval=keyframe_interval,
                            min_delta_gain=min_delta_gain) if first else None, group)
    if isinstance(plan, str):
        raise StorageError(plan)
    parent, why = plan
    held = _HELD.get((store.url, rank))
    if parent is not None and not _all(
            held is not None and held.step_id == parent.checkpoint_id and held.world == world,
            group):
        parent, why = None, (f"a rank holds no copy of its part of step {parent.step} (a "
                             "restart, or another world size)")
    coding = dict(policy=policy, device=device, workspace=workspace)
    with contextlib.ExitStack() as pinned:
        budget = None
        if parent is not None:
            if first:  # (the coordinator's pin stands for every rank's: see spec/checkpoints.md)
                pinned.enter_context(lease.pin(store, parent.step, parent.checkpoint_id))
            checked = _broadcast(_check_parent(store, parent, read_budget) if first else None,
                                 group)
            if isinstance(checked, str):
                parent, why = None, f"parent unusable: {checked}"
            else:
                budget = checked
        info = _save_step(store, state, step, group, parent, why,
                          held if parent is not None else None, budget, coding)
    if keep_last is not None and first:
        try:
            manifests.retain_after(store, step, keep_last)
        except (S4Error, OSError) as exc:
            manifests.log.warning("checkpoint step %d is saved, but retention failed: %s", step,
                              exc)
    dist.barrier(group)
    return info


def _plan(store: Store, step: int, world: int, **rules: Any
          ) -> tuple[CheckpointInfo | None, str | None] | str:
    """The coordinator's choice: (parent or None, why not a delta), or an error message."""
    infos = by_step(list_checkpoints(store))
    if step in infos:
        return f"checkpoint step {step} already exists in {store.url}"
    latest = infos[max(infos)] if infos else None
    why = chainpolicy.reason_without_parent(latest, step, **rules)
    if why is None and (latest.rank_files is None
                        or len({f["rank"] for f in latest.rank_files}) > world):
        why = f"step {latest.step} was not saved by these {world} ranks"
    return (None if why else latest), why


def _check_parent(store: Store, parent: CheckpointInfo, read_budget: float | None
                  ) -> str | tuple[float, float] | None:
    """After the pin: why ``parent`` cannot carry a delta, or the read budget's figures."""
    infos = by_step(list_checkpoints(store))
    if parent.step not in infos:
        return f"step {parent.step} was deleted"
    try:
        parents = chain_of(parent.step, infos)
        why = manifests.parent_gone(store, parents)
    except S4Error as exc:
        return f"its chain cannot be read: {exc}"
    if why is not None:
        return why
    return None if read_budget is None else (chainpolicy.chain_share(parents), read_budget)


def _save_step(store: Store, state: dict[str, Any], step: int, group: Any,
               parent: CheckpointInfo | None, why: str | None, held: _Held | None,
               budget: tuple[float, float] | None, coding: dict[str, Any]) -> CheckpointInfo:
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    folder = f"{STEPS}{step:012d}-" + _broadcast(secrets.token_hex(4), group) + "/"
    writer = _ChainWriter(_child_url(store, folder), held=held, budget=budget, group=group,
                          **coding)
    dcp.save(state, storage_writer=writer, process_group=group)
    files: list[Any] = [None] * world
    dist.all_gather_object(files, writer.summary(folder), group=group)
    if writer.over_budget is not None:
        parent, why = None, writer.over_budget
    info = _broadcast(_commit(store, step, folder, files, parent, why) if rank == 0 else None,
                      group)
    if isinstance(info, str):
        raise StorageError(info)
    mine = files[rank]
    _HELD[(store.url, rank)] = _Held(
        info.checkpoint_id, mine["name"] if mine else None,
        bytes.fromhex(mine["checkpoint_id"]) if mine else b"", world, writer.snapshot)
    return info


def _commit(store: Store, step: int, folder: str, files: list[dict[str, Any] | None],
            parent: CheckpointInfo | None, why: str | None) -> CheckpointInfo | str:
    """The coordinator writes the step's manifest; returns it, or why it could not."""
    written = [dict(f, rank=r) for r, f in enumerate(files) if f is not None]
    used = parent if any(f["parent"] for f in written) else None
    if parent is not None and used is None:
        why = "no tensor coded smaller as a delta"
    if used is not None and (gone := _check_parent(store, used, None)):
        return (f"checkpoint step {step} is not saved: its parent step {used.step} is being "
                f"deleted ({gone}); save it again")
    ids = b"".join(bytes.fromhex(f["checkpoint_id"]) for f in written)
    info = CheckpointInfo(
        step=step, file=folder, checkpoint_id=xxhash.xxh3_128_digest(ids).hex(),
        parent_step=used.step if used else None, parent_id=used.checkpoint_id if used else None,
        base_step=used.base_step if used else step, depth=used.depth + 1 if used else 0,
        raw_bytes=sum(f["raw"] for f in written), stored_bytes=sum(f["stored"] for f in written),
        file_bytes=sum(f["file"] for f in written),
        full_stored_bytes=sum(f["full"] for f in written), created=time.time(),
        base_reason=None if used else why,
        rank_files=[{k: f[k] for k in ("rank", "name", "checkpoint_id", "parent")}
                    for f in written])
    try:
        store.put_atomic(manifests.manifest_name(step), info.to_json(), if_absent=True)
    except StorageError as exc:
        return f"checkpoint step {step} is not saved: {exc}"
    return info


def _child_url(store: Store, folder: str) -> str:
    if isinstance(store, LocalStore):
        return str(store.root / folder)
    return f"{store.url}/{folder}".rstrip("/")


def _close_chain(reader: s4format.Reader | None) -> None:
    while reader is not None:
        reader.close()
        reader = reader.parent


# -- loading -------------------------------------------------------------------------------

def open_rank_file(store: Store, name: str, files: dict[str, dict[str, Any]],
                   verify: bool = True, whole: bool = False) -> s4format.Reader:
    """A Reader of rank file ``name`` (a name in the run), attached to its parent files.
    ``whole``: every tensor of ``name`` will be read, and its parents' that its deltas
    need (:func:`~s4weights.store.base.reading_whole`: a small parent is fetched whole,
    though a base may hold tensors no delta needs)."""
    names = [name]
    while (parent := files[names[-1]]["parent"]) is not None:
        if parent not in files:
            raise ParentMismatchError(f"{store.url}: {names[-1]} is a delta of {parent}, "
                                      "whose step is missing from the store")
        names.append(parent)
        if len(names) > len(files):
            raise FormatError(f"{store.url}: the rank files' parents form a cycle")
    reader: s4format.Reader | None = None
    try:
        for n in reversed(names):
            src = store.source(n)
            child = s4format.Reader(reading_whole(src) if whole else src, verify=verify)
            if child.checkpoint_id.hex() != files[n]["checkpoint_id"]:
                child.close()
                raise ParentMismatchError(
                    f"{store.url}/{n} is checkpoint {child.checkpoint_id.hex()}, its manifest "
                    f"says {files[n]['checkpoint_id']}")
            if reader is not None:
                child.attach_parent(reader)
            reader = child
    except BaseException:
        _close_chain(reader)
        raise
    assert reader is not None
    return reader


def rank_files(infos: dict[int, CheckpointInfo]) -> dict[str, dict[str, Any]]:
    return {f["name"]: f for i in infos.values() for f in (i.rank_files or ())}


class _ChainReader(S4StorageReader):
    """S4StorageReader of one step of a run, opening each rank file with its parents."""

    def __init__(self, store: Store, info: CheckpointInfo, infos: dict[int, CheckpointInfo],
                 **kw: Any) -> None:
        super().__init__(_child_url(store, info.file), **kw)
        self.run, self.folder = store, info.file
        self.files = rank_files({i.step: i for i in chain_of(info.step, infos)})

    def _open_reader(self, name: str, whole: bool = False) -> s4format.Reader:
        return open_rank_file(self.run, self.folder + name, self.files, self.verify, whole)

    def _close_reader(self, reader: s4format.Reader) -> None:
        _close_chain(reader)


def load(url: Any, step: int, into: dict[str, Any] | None, *, group: Any = None,
         verify: bool = True, device: str = "auto", workspace: int | None = None) -> Any:
    """Load step ``step`` of a run saved with ``distributed=True``: into ``into`` (a sharded
    state dict, every rank of ``group`` calling this), or, with ``into`` None, as one whole
    state dict in this process."""
    store = open_store(url)
    infos = by_step(list_checkpoints(store))
    if step not in infos:
        raise StorageError(f"no checkpoint step {step} in {store.url}")
    info = infos[step]
    if info.rank_files is None:
        raise StorageError(f"checkpoint step {step} in {store.url} was not saved with "
                           "distributed=True: load it with load_checkpoint(url) in each process")
    reader = _ChainReader(store, info, infos, verify=verify, device=device, workspace=workspace)
    with _s4_errors():
        if into is None:
            from torch.distributed.checkpoint.state_dict_loader import (
                _load_state_dict_from_keys,
            )

            with warnings.catch_warnings():  # (that it loads in one process is what is asked)
                warnings.filterwarnings("ignore", message="torch.distributed is unavailable")
                return _load_state_dict_from_keys(storage_reader=reader)
        no_dist = not (dist.is_available() and dist.is_initialized())
        dcp.load(into, storage_reader=reader, process_group=group, no_dist=no_dist)
    return into


@contextlib.contextmanager
def _s4_errors() -> Iterator[None]:
    """Raise the S4Error a rank met, as itself, rather than DCP's CheckpointException around
    every rank's traceback."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        yield
    except CheckpointException as exc:
        for rank, (error, _trace) in sorted(exc.failures.items()):
            if isinstance(error, S4Error):
                raise type(error)(f"rank {rank}: {error}") from exc
        raise


def verify_step(store: Store, info: CheckpointInfo, infos: dict[int, CheckpointInfo]
                ) -> list[str]:
    """Problems found in every rank file of ``info`` (each checked with its parents)."""
    from s4format.verify import verify

    files = rank_files({i.step: i for i in chain_of(info.step, infos)})
    problems: list[str] = []
    for f in info.rank_files or ():
        try:
            reader = open_rank_file(store, f["name"], files, whole=True)
            try:
                problems += [f"{f['name']}: {p}" for p in verify(reader)]
            finally:
                _close_chain(reader)
        except S4Error as exc:
            problems.append(f"{f['name']}: {type(exc).__name__}: {exc}")
    if not store.exists(info.file + ".metadata"):
        problems.append(f"{info.file}.metadata is missing")
    return problems

