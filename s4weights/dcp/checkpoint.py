"""What an S4 DCP checkpoint holds, and how its pieces are named and read.

A checkpoint is a directory or ``s3://`` prefix with one ``__<rank>_<token>.s4w`` file per rank
that wrote items, and DCP's own ``Metadata``, pickled as ``FileSystemWriter`` pickles it, in
``.metadata``. Invariants: a save's rank files all carry a token no earlier save used, so a save
never writes over a file that a committed ``.metadata`` names; ``.metadata`` is put last, in one
atomic step, once every rank's file is committed; only files named by it belong to the
checkpoint. Reading ``.metadata`` never runs code: its pickle may only build DCP's metadata
classes, torch sizes, dtypes and layouts, paths and :class:`S4StorageInfo`.
"""

from __future__ import annotations

import dataclasses
import io
import os
import pickle
import re
from dataclasses import dataclass
from typing import Any

from s4format.errors import FormatError, StorageError
from s4weights.store import Store, open_store

METADATA = ".metadata"
RANK_FILE = re.compile(r"__(\d+)_([0-9a-f]{12})\.s4w")


def rank_file_name(rank: int, token: str) -> str:
    return f"__{rank}_{token}.s4w"


@dataclass(frozen=True)
class RankFile:
    """A rank's part of the global save plan: the file its items go to."""
    name: str


@dataclass(frozen=True)
class S4StorageInfo:
    """Where one DCP item lives: its rank file, the name of its stored tensor there (or its key
    in the file's object tree, for a bytes item), and the content hash of its bytes, which
    ties the metadata to that very file."""
    relative_path: str
    name: str
    content_hash: bytes


def item_key(fqn: str, offset: Any) -> str:
    """The stored name of a write item: its fully qualified name, with the chunk's offsets
    for a tensor (a rank may hold several chunks of one tensor)."""
    if offset is None:
        return fqn
    return f"{fqn}@{','.join(str(int(o)) for o in offset)}"


def open_checkpoint(url: str, s3_options: dict[str, Any] | None = None) -> Store:
    """The store of a checkpoint: a local directory, ``file://`` URL or ``s3://bucket/prefix``
    (``s3_options`` go to :class:`~s4weights.store.s3.S3Store`)."""
    if not url:
        raise ValueError("no checkpoint path: pass one to the storage writer or reader, or "
                         "as checkpoint_id")
    if url.startswith("s3://"):
        from s4weights.store.s3 import S3Store
        return S3Store.from_url(url, **(s3_options or {}))
    if s3_options:
        raise ValueError(f"s3_options are for s3:// checkpoints, not {url!r}")
    return open_store(url)


class StoreHolder:
    """The checkpoint store of a DCP storage reader or writer, opened on first use: clients and
    pools do not pickle, so a pickled copy (async_save's process mode) opens its own."""

    url: str
    s3_options: dict[str, Any]
    _store: Store | None

    def __getstate__(self) -> dict[str, Any]:
        return {**self.__dict__, "_store": None}

    def store(self) -> Store:
        if self._store is None:
            self._store = open_checkpoint(self.url, self.s3_options)
        return self._store

    @property
    def checkpoint_id(self) -> str:
        return self.url


def is_checkpoint_url(checkpoint_id: str | os.PathLike[str]) -> bool:
    """Whether a checkpoint_id names something these classes store to: a local path, a
    ``file://`` or an ``s3://`` URL."""
    text = os.fspath(checkpoint_id)
    scheme = text.partition("://")[0] if "://" in text else ""
    return scheme in ("", "file", "s3")


def read_metadata_bytes(store: Store) -> bytes:
    try:
        return store.get(METADATA)
    except StorageError as exc:
        if store.exists(METADATA):
            raise
        raise StorageError(
            f"{store.url} holds no committed checkpoint: it has no {METADATA} (the save did "
            "not finish, or this is not a DCP checkpoint); load an earlier one") from exc


_METADATA_CLASSES = frozenset({
    "Metadata", "MetadataIndex", "TensorStorageMetadata", "BytesStorageMetadata",
    "ChunkStorageMetadata", "TensorProperties", "StorageMeta", "_MEM_FORMAT_ENCODING"})
_ALLOWED = {
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("torch._utils", "_get_layout"),
    ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"), ("collections", "OrderedDict"),
    (__name__, "S4StorageInfo"),
    # so that a FileSystemWriter checkpoint is named as such rather than refused as unsafe
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
}


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        if (module == "torch.distributed.checkpoint.metadata" and name in _METADATA_CLASSES) \
                or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"it refers to {module}.{name}, which DCP metadata does "
                                     "not hold")


def load_metadata(data: bytes, where: str, *, trusted: bool = False) -> Any:
    """DCP's ``Metadata`` from the bytes of ``.metadata``. Unless ``trusted``, the pickle may
    only build what DCP's own planner and this storage put there."""
    from torch.distributed.checkpoint.metadata import Metadata

    try:
        md = pickle.loads(data) if trusted else _MetadataUnpickler(io.BytesIO(data)).load()
    except Exception as exc:  # any malformed pickle: its own error classes vary
        hint = "" if trusted else (" (metadata of a custom planner may hold other classes: "
                                   "pass trusted_metadata=True for a checkpoint you trust)")
        raise FormatError(f"{where}: not DCP metadata: {exc}{hint}") from None
    if not isinstance(md, Metadata) or not isinstance(md.storage_data, dict):
        raise FormatError(f"{where}: not DCP metadata written by S4StorageWriter")
    for info in md.storage_data.values():
        if not isinstance(info, S4StorageInfo):
            raise FormatError(f"{where}: a checkpoint of another storage writer (its items "
                              f"are {type(info).__name__}); read it with that writer's "
                              "reader, such as torch's FileSystemReader")
        if not (isinstance(info.relative_path, str) and isinstance(info.name, str)
                and isinstance(info.content_hash, bytes) and len(info.content_hash) == 16):
            raise FormatError(f"{where}: malformed item location {info!r}")
    return md


def dump_metadata(md: Any) -> bytes:
    return pickle.dumps(md)


def with_field(obj: Any, name: str, value: Any) -> None:
    """Set a field of DCP's metadata that this torch has (older versions lack some)."""
    if name in {f.name for f in dataclasses.fields(obj)}:
        setattr(obj, name, value)
