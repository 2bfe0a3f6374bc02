"""``S4StorageReader``: DCP's StorageReader for checkpoints :class:`S4StorageWriter` wrote.

Call sequence (DCP's): ``reset`` -> ``read_metadata`` (refuses a checkpoint without
``.metadata``) -> ``set_up_storage_reader`` -> ``prepare_local_plan`` -> (coordinator)
``prepare_global_plan`` -> ``read_data``. A rank opens only the rank files its read items are
in, reads each file's index and then, by ranged reads, only the planes of the tensors it
needs; each such tensor is decoded once and only the requested offsets and lengths of it are
copied into DCP's destination, so a checkpoint loads into any world size and placement.
"""

from __future__ import annotations

import contextlib
import io
import os
import uuid
from collections import Counter, defaultdict
from collections.abc import Iterator
from typing import Any

import torch
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.storage import StorageReader
from torch.futures import Future

import s4format
from s4format import hashing
from s4format.errors import FormatError, StorageError, UnsupportedObjectError
from s4weights import gpu
from s4weights.dcp.checkpoint import (
    METADATA,
    S4StorageInfo,
    StoreHolder,
    is_checkpoint_url,
    load_metadata,
    read_metadata_bytes,
)
from s4weights.store import Store
from s4weights.store.base import reading_whole


class S4StorageReader(StoreHolder, StorageReader):
    """Reads a DCP checkpoint from ``path`` (a directory, ``file://`` or ``s3://bucket/prefix``;
    or the ``checkpoint_id`` given to ``dcp.load``).

    ``verify`` checks every decoded tensor's content hash (default on). ``device``:
    ``"auto"`` decodes tensors bound for CUDA destinations on the GPU where the GPU path is
    available, ``"cpu"`` always on the CPU; ``workspace`` bounds the GPU decoder's extra
    memory, as for :func:`s4weights.load`. ``.metadata`` is a pickle (DCP's format); it is
    read with an unpickler that builds only DCP's metadata classes, unless
    ``trusted_metadata=True`` (for planners that store other objects in it)."""

    def __init__(self, path: str | os.PathLike[str] = "", *, verify: bool = True,
                 device: str = "auto", workspace: int | None = None,
                 s3_options: dict[str, Any] | None = None,
                 trusted_metadata: bool = False) -> None:
        super().__init__()
        if device not in gpu.DEVICES:
            raise ValueError(f"device must be one of {gpu.DEVICES}, got {device!r}")
        self.url = os.fspath(path)
        self.verify = verify
        self.device = device
        self.workspace = workspace
        self.s3_options = dict(s3_options or {})
        self.trusted_metadata = trusted_metadata
        self.storage_data: dict[Any, S4StorageInfo] = {}
        self._held: Counter[str] | None = None  # items stored per rank file
        self.load_id = str(uuid.uuid4())
        self._store: Store | None = None

    # -- DCP's StorageReader ---------------------------------------------------------------

    def reset(self, checkpoint_id: str | os.PathLike[str] | None = None) -> None:
        self.storage_data, self._held = {}, None
        self.load_id = str(uuid.uuid4())
        if checkpoint_id:
            url = os.fspath(checkpoint_id)
            if url != self.url:
                self.url, self._store = url, None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Any:
        store = self.store()
        if kwargs.get("rank") is not None:
            # DCP's fallback for checkpoints saved without collectives, which the writer
            # refuses: there is one .metadata for all ranks or no checkpoint
            raise StorageError(f"{store.url} holds no committed checkpoint: it has no "
                               f"{METADATA}, and S4 checkpoints have no per-rank metadata")
        md = load_metadata(read_metadata_bytes(store), f"{store.url}/{METADATA}",
                           trusted=self.trusted_metadata)
        try:
            from torch.distributed.checkpoint.metadata import StorageMeta
        except ImportError:  # torch before StorageMeta: the metadata has no such field
            return md
        if getattr(md, "storage_meta", None) is None:
            md.storage_meta = StorageMeta()
        md.storage_meta.load_id = self.load_id
        return md

    def set_up_storage_reader(self, metadata: Any, is_coordinator: bool, *args: Any,
                              **kwargs: Any) -> None:
        self.storage_data, self._held = metadata.storage_data, None

    def prepare_local_plan(self, plan: LoadPlan) -> LoadPlan:
        return plan

    def prepare_global_plan(self, plans: list[LoadPlan]) -> list[LoadPlan]:
        return plans

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        by_file: dict[str, list[ReadItem]] = defaultdict(list)
        for req in plan.items:
            by_file[self._info(req).relative_path].append(req)
        gpu.register_codecs(self.device)
        for name in sorted(by_file):
            self._read_file(name, by_file[name], planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike[str]) -> bool:
        return is_checkpoint_url(checkpoint_id)

    # -- one rank file ---------------------------------------------------------------------

    def _info(self, req: ReadItem) -> S4StorageInfo:
        try:
            return self.storage_data[req.storage_index]
        except KeyError:
            raise FormatError(f"{self.store().url}/{METADATA} names no stored item for "
                              f"{req.storage_index.fqn!r}") from None

    def _open_reader(self, name: str, whole: bool = False) -> s4format.Reader:
        src = self.store().source(name)
        return s4format.Reader(reading_whole(src) if whole else src, verify=self.verify)

    def _close_reader(self, reader: s4format.Reader) -> None:
        reader.close()

    @contextlib.contextmanager
    def _opened(self, name: str, whole: bool = False) -> Iterator[s4format.Reader]:
        reader = self._open_reader(name, whole)
        try:
            yield reader
        finally:
            self._close_reader(reader)

    def _reads_all(self, name: str, reqs: list[ReadItem]) -> bool:
        """Whether ``reqs`` read every item stored in rank file ``name`` (a load with the
        sharding it was saved with): then the file is read whole (reading_whole), on S3 in
        one fetch where it is small, not one per item."""
        if self._held is None:
            self._held = Counter(info.relative_path for info in self.storage_data.values())
        return len({req.storage_index for req in reqs}) == self._held[name]

    def _read_file(self, name: str, reqs: list[ReadItem], planner: LoadPlanner) -> None:
        with self._opened(name, self._reads_all(name, reqs)) as reader:
            by_tensor: dict[int, list[ReadItem]] = defaultdict(list)
            for req in reqs:
                info = self._info(req)
                if req.type == LoadItemType.BYTE_IO:
                    planner.load_bytes(req, io.BytesIO(_stored_bytes(reader, info)))
                else:
                    by_tensor[_stored_index(reader, info)].append(req)
            loader = None
            # in stored order: the GPU loader decodes the following tensors with each batch
            for i in sorted(by_tensor):
                dests = [planner.resolve_tensor(req).detach() for req in by_tensor[i]]
                device = dests[0].device
                if device.type == "cuda" and loader is None:
                    loader = gpu.loader_for(reader, self.device, workspace=self.workspace,
                                            wanted=by_tensor)
                whole = loader(i, device) if loader is not None and device.type == "cuda" \
                    else _host_tensor(reader, i)
                for req, dest in zip(by_tensor[i], dests):
                    _copy_into(dest, whole, req, reader.name)
                    planner.commit_tensor(req, dest)


def _stored_index(reader: s4format.Reader, info: S4StorageInfo) -> int:
    try:
        i = reader.index_of(info.name)
    except KeyError:
        raise FormatError(f"{reader.name} holds no tensor {info.name!r}, which the "
                          "checkpoint's metadata places there: the file is not this "
                          "checkpoint's") from None
    if reader.tensors[i].content_hash != info.content_hash:
        raise FormatError(f"{reader.name}: tensor {info.name!r} is not the one the "
                          "checkpoint's metadata names (its content hash differs): the file "
                          "was replaced or belongs to another save")
    return i


def _stored_bytes(reader: s4format.Reader, info: S4StorageInfo) -> bytes:
    value = reader.tree.get(info.name) if isinstance(reader.tree, dict) else None
    if not isinstance(value, bytes):
        raise FormatError(f"{reader.name} holds no bytes item {info.name!r}, which the "
                          "checkpoint's metadata places there: the file is not this "
                          "checkpoint's")
    if hashing.content_hash(value) != info.content_hash:
        raise FormatError(f"{reader.name}: bytes item {info.name!r} is not the one the "
                          "checkpoint's metadata names (its content hash differs)")
    return value


def _host_tensor(reader: s4format.Reader, i: int) -> torch.Tensor:
    t = reader.read(i)
    dt = getattr(torch, t.dtype.name, None)
    if not isinstance(dt, torch.dtype):
        raise UnsupportedObjectError(f"{reader.name}: tensor {reader.tensors[i].name!r} is "
                                     f"{t.dtype.name}, which this torch has no dtype for")
    data = torch.from_numpy(t.data) if t.data.size else torch.empty(0, dtype=torch.uint8)
    return data.view(dt).reshape(t.shape)


def _copy_into(dest: torch.Tensor, whole: torch.Tensor, req: ReadItem, where: str) -> None:
    """Copy the requested chunk of a stored tensor into DCP's destination."""
    fqn = req.storage_index.fqn
    if whole.dim() != len(req.storage_offsets) or any(
            o + n > s for o, n, s in zip(req.storage_offsets, req.lengths, whole.shape)):
        raise FormatError(f"{where}: tensor of {fqn!r} has shape {tuple(whole.shape)}; the "
                          f"load asks for {tuple(req.lengths)} at {tuple(req.storage_offsets)}")
    part = narrow_tensor_by_index(whole, req.storage_offsets, req.lengths)
    if dest.shape != part.shape:
        raise FormatError(f"{where}: the chunk of {fqn!r} read is {tuple(part.shape)} where "
                          f"the load expects {tuple(dest.shape)}")
    with torch.no_grad():
        dest.copy_(part)
