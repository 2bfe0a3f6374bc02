"""``S4StorageWriter``: DCP's StorageWriter that codes each rank's items into one .s4w file.

Call sequence (DCP's): ``reset`` -> ``set_up_storage_writer`` -> ``prepare_local_plan`` ->
(coordinator) ``prepare_global_plan``, which names every rank's file with one fresh token ->
``write_data`` on every rank, which writes and commits that rank's file -> (coordinator)
``finish``, which checks every named file is there, puts ``.metadata`` and only then removes
what earlier or killed saves left in the checkpoint. A rank's file holds its tensors coded as
``s4weights.save`` codes them (CUDA tensors on the GPU path where it is available) and its
bytes items in the object tree, all under the names :func:`item_key` gives.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import secrets
import uuid
from typing import Any

import torch
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
from torch.distributed.checkpoint.storage import StorageWriter, WriteResult
from torch.futures import Future

from s4format import dtypes, hashing
from s4format.errors import StorageError, UnsupportedObjectError
from s4format.objtree import TensorRef
from s4format.policy import check_policy
from s4format.tensor import Tensor
from s4weights import gpu
from s4weights.api import write_flattened
from s4weights.dcp.checkpoint import (
    METADATA,
    RANK_FILE,
    RankFile,
    S4StorageInfo,
    StoreHolder,
    dump_metadata,
    is_checkpoint_url,
    item_key,
    rank_file_name,
    with_field,
)
from s4weights.store import Store
from s4weights.torchtree import DeviceTensor, Flattened, raw_bytes, torch_dtype_name

log = logging.getLogger("s4weights")

# CUDA bytes the GPU coder reads in place must start where a fresh allocation would
DEVICE_ALIGN = 256


class S4StorageWriter(StoreHolder, StorageWriter):
    """Writes a DCP checkpoint to ``path`` (a directory, ``file://`` or ``s3://bucket/prefix``;
    or the ``checkpoint_id`` given to ``dcp.save``).

    ``policy``, ``device`` and ``workspace`` are :func:`s4weights.save`'s. A save into a path
    that holds a checkpoint replaces it atomically (the old one stays whole until the new
    ``.metadata`` is in place, then its files are removed); ``overwrite=False`` refuses
    instead. ``s3_options`` go to :class:`~s4weights.store.s3.S3Store`. The writer pickles
    (``dcp.async_save`` in process mode): the store is opened again where it is used."""

    def __init__(self, path: str | os.PathLike[str] = "", *, policy: str = "auto",
                 device: str = "auto", workspace: int | None = None, overwrite: bool = True,
                 s3_options: dict[str, Any] | None = None) -> None:
        super().__init__()
        if device not in gpu.DEVICES:
            raise ValueError(f"device must be one of {gpu.DEVICES}, got {device!r}")
        self.url = os.fspath(path)
        self.policy = check_policy(policy)
        self.device = device
        self.workspace = workspace
        self.overwrite = overwrite
        self.s3_options = dict(s3_options or {})
        self.save_id = str(uuid.uuid4())
        self.written: Any = None  # the WriteResult of this rank's file, once written
        self._store: Store | None = None

    # -- DCP's StorageWriter ---------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        if checkpoint_id:
            url = os.fspath(checkpoint_id)
            if url != self.url:
                self.url, self._store = url, None
        self.save_id = str(uuid.uuid4())

    def set_up_storage_writer(self, is_coordinator: bool, *args: Any, **kwargs: Any) -> None:
        if not kwargs.get("use_collectives", True):
            raise ValueError("S4StorageWriter commits a checkpoint once every rank's file is "
                             "written, which needs DCP's collectives: save with "
                             "use_collectives=True (the default)")

    def storage_meta(self) -> Any:
        try:
            from torch.distributed.checkpoint.metadata import StorageMeta
        except ImportError:  # torch before StorageMeta: nothing to report
            return None
        return StorageMeta(checkpoint_id=self.url, save_id=self.save_id)

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        return plan

    def prepare_global_plan(self, plans: list[SavePlan]) -> list[SavePlan]:
        if not self.overwrite and self.store().exists(METADATA):
            raise StorageError(f"{self.store().url} already holds a checkpoint and the writer "
                               "was made with overwrite=False")
        token = secrets.token_hex(6)
        return [dataclasses.replace(p, storage_data=RankFile(rank_file_name(i, token)))
                for i, p in enumerate(plans)]

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
        results: list[WriteResult] = []
        if plan.items:
            results = self._write_rank_file(plan.storage_data.name, plan, planner)
        fut: Future[list[WriteResult]] = Future()
        fut.set_result(results)
        return fut

    def finish(self, metadata: Any, results: list[list[WriteResult]]) -> None:
        store = self.store()
        infos = {wr.index: wr.storage_data for rank in results for wr in rank}
        files = {info.relative_path for info in infos.values()}
        present = {n for n in store.list("__") if RANK_FILE.fullmatch(n)}
        missing = sorted(files - present)
        if missing:
            raise StorageError(f"{store.url}: rank file {missing[0]} of this save is not in "
                               "the store although its rank reported it written; the "
                               "checkpoint is not committed")
        metadata.storage_data = infos
        with_field(metadata, "storage_meta", self.storage_meta())
        store.put_atomic(METADATA, dump_metadata(metadata))
        _remove_leftovers(store, present - files)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_url(checkpoint_id)

    # -- the rank's file -------------------------------------------------------------------

    def _write_rank_file(self, name: str, plan: SavePlan, planner: SavePlanner, *,
                         parent_id: bytes | None = None,
                         parents: dict[str, Any] | None = None) -> list[WriteResult]:
        """Write and commit one rank's file. ``parent_id`` and ``parents`` (stored name -> the
        parent's tensor) store tensors as XOR deltas where that codes smaller, as
        :func:`s4weights.api.write_flattened` does."""
        flat, keys, sizes = flatten_items(plan, planner)
        with self.store().writer(name) as sink:
            written = write_flattened(flat, sink, policy=self.policy, device=self.device,
                                      workspace=self.workspace, parent_id=parent_id,
                                      parents=parents, metadata={"dcp.save_id": self.save_id})
        self.written = written
        hashes = written.content_hashes
        return [WriteResult(index=item.index, size_in_bytes=size,
                            storage_data=S4StorageInfo(name, key, hashes.get(key)
                                                       or hashing.content_hash(flat.tree[key])))
                for item, key, size in zip(plan.items, keys, sizes)]


def flatten_items(plan: SavePlan, planner: SavePlanner
                  ) -> tuple[Flattened, list[str], list[int]]:
    """The rank's items as the tree s4weights writes (stored name -> tensor reference or
    bytes), their stored names and raw sizes, in plan order."""
    tree: dict[str, Any] = {}
    tensors: list[tuple[str, Tensor | DeviceTensor]] = []
    keys, sizes = [], []
    for item in plan.items:
        key = item_key(item.index.fqn, item.index.offset)
        if key in tree:
            raise ValueError(f"two write items of this rank are both stored as {key!r}")
        data = planner.resolve_data(item)
        if item.type == WriteItemType.BYTE_IO:
            tree[key] = data.getvalue()
            sizes.append(len(tree[key]))
        else:
            stored = stored_tensor(data, key)
            tree[key] = TensorRef(len(tensors))
            tensors.append((key, stored))
            sizes.append(stored.nbytes)
        keys.append(key)
    return Flattened(tree, tensors), keys, sizes


def stored_tensor(t: torch.Tensor, key: str) -> Tensor | DeviceTensor:
    """A write item's tensor as s4weights stores it: its own elements, in C order, with its
    shape; a CUDA tensor stays on its device for the GPU coder."""
    t = t.detach()
    dt = dtypes.BY_NAME.get(torch_dtype_name(t.dtype))
    if dt is None or t.layout != torch.strided or t.is_quantized:
        raise UnsupportedObjectError(f"write item {key!r} is a {t.dtype}/{t.layout} tensor, "
                                     "which .s4w does not store")
    if t.device.type == "cuda" and t.numel():
        if not t.is_contiguous() or t.data_ptr() % DEVICE_ALIGN:
            t = t.clone(memory_format=torch.contiguous_format)
        return DeviceTensor(dt, tuple(t.shape), t.reshape(-1).view(torch.uint8))
    if t.device.type not in ("cpu", "cuda"):
        t = t.cpu()
    return Tensor(dt, tuple(t.shape), raw_bytes(t))


def _remove_leftovers(store: Store, stale: set[str]) -> None:
    """Remove the files of replaced or unfinished saves and dead writers' temporaries; the
    checkpoint is committed already, so a failure here is only worth a warning."""
    try:
        for name in sorted(stale):
            store.delete(name)
        sweep = getattr(store, "sweep", None)
        if sweep is not None:
            sweep(0.0, dirs=("",))
    except (StorageError, OSError) as exc:
        log.warning("%s: the checkpoint is committed, but files of earlier saves could not "
                    "all be removed: %s", store.url, exc)
