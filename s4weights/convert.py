"""Converting checkpoints to and from .s4w: ``torch.save`` files (.pt, .pth, .bin, .ckpt),
``.safetensors`` files and Hugging Face model folders (weight shards and their index) become
.s4w; .s4w files and folders become ``.safetensors``.

Sources are read without running code from them (``torch.load(weights_only=True)``). Unless
``verify=False``, every file written is read back and compared with what was read, tensor by
tensor and bit for bit, before it counts as converted. Paths are local or ``s3://`` URLs.
"""

from __future__ import annotations

import functools
import io
import json
import os
import pickle
import struct
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

import s4format
from s4format.errors import (
    ContentHashError,
    FormatError,
    S4Error,
    StorageError,
    UnsupportedError,
    UnsupportedObjectError,
)
from s4format.objtree import key_path
from s4weights import api
from s4weights import progress as progress_bar
from s4weights.store import LocalStore, Store, open_store
from s4weights.store.base import reading_whole

S4W = ".s4w"
SAFETENSORS = ".safetensors"
TORCH_SUFFIXES = (".pt", ".pth", ".bin", ".ckpt")
INDEX = ".index.json"
# A safetensors file's own metadata is kept in the .s4w metadata under this prefix, so that
# converting back restores it exactly.
META_PREFIX = "safetensors."
SAFETENSORS_MISSING = "reading or writing .safetensors needs the safetensors package: " \
                      "pip install 's4weights[hf]' (or pip install safetensors)"


@dataclass(frozen=True)
class Converted:
    """One file converted: sizes in bytes (``raw_bytes``: the tensors' own bytes)."""
    src: str
    dst: str
    tensors: int
    raw_bytes: int
    src_bytes: int
    dst_bytes: int
    seconds: float
    verified: bool


@dataclass(frozen=True)
class _File:
    store: Store
    name: str

    @property
    def where(self) -> str:
        if isinstance(self.store, LocalStore):
            return os.path.normpath(self.store.root / self.name)
        return f"{self.store.url}/{self.name}"


def convert(src: str, dst: str, *, verify: bool = True, policy: str = "auto",
            progress: bool | None = None,
            on_file: Callable[[Converted], None] | None = None) -> list[Converted]:
    """Convert ``src`` to ``dst`` (see the module docstring) and return what was converted,
    file by file; ``on_file`` is called as each one is done. A folder converts to a folder
    (one file per shard, the index rewritten, the other files copied) or, for a ``dst``
    ending in ``.s4w``, to one file. ``policy`` is :func:`s4weights.save`'s."""
    src, dst = os.fspath(src), os.fspath(dst)
    job = _Job(verify, policy, progress, on_file)
    if _is_folder(src):
        return job.folder(open_store(src), src, dst)
    source = _file(src)
    suffix = _suffix(src)
    if suffix == S4W:
        want = SAFETENSORS
    elif suffix == SAFETENSORS or suffix in TORCH_SUFFIXES:
        want = S4W
    else:
        raise UnsupportedError(f"{src}: cannot tell its format from the name; convert reads "
                               f"{', '.join(TORCH_SUFFIXES)} (torch.save), {SAFETENSORS}, "
                               f"{S4W} and folders of these")
    if not dst.startswith("s3://") and os.path.isdir(dst):
        dst = os.path.join(dst, _renamed(os.path.basename(src), want))
    if _suffix(dst) != want:
        raise UnsupportedError(f"{dst}: a {suffix} file converts to {want}; name the "
                               f"destination *{want} (or an existing folder)")
    with job.bar(_size(source)):
        return [job.one([source], _file(dst))]


class _Job:
    def __init__(self, verify: bool, policy: str, progress: bool | None,
                 on_file: Callable[[Converted], None] | None) -> None:
        self.verify, self.policy, self.on_file = verify, policy, on_file
        self.show = progress
        self.progress: progress_bar.Bar | None = None

    @contextmanager
    def bar(self, total: int) -> Iterator[None]:
        # (any size: a conversion shows its bar on a terminal unless told not to)
        with progress_bar.bar("s4weights convert", total, self.show, 0) as self.progress:
            yield

    def one(self, sources: list[_File], dst: _File) -> Converted:
        """Read ``sources`` (several: shards merged into one .s4w), write ``dst``, verify."""
        t0 = time.perf_counter()
        obj, meta = _read(sources[0])
        for more in sources[1:]:
            obj = _merge(obj, _read(more)[0], more.where)
        if _suffix(dst.name) == SAFETENSORS:
            obj = _safetensors_dict(obj, sources[0].where)
        _write(obj, meta, dst, self.policy)
        if self.verify:
            back = _read(dst)[0]
            if isinstance(back, dict) and _suffix(dst.name) == SAFETENSORS:
                # safetensors keeps its tensors in an order of its own
                back = {**{k: back[k] for k in obj if k in back}, **back}
            problem = differs(obj, back)
            if problem is not None:
                raise ContentHashError(f"{dst.where} does not read back as {sources[0].where} "
                                       f"was read: {problem}; the file is left there to "
                                       "inspect: do not use it")
        src_bytes = sum(_size(s) for s in sources)
        done = Converted(src=", ".join(s.where for s in sources), dst=dst.where,
                         tensors=len(_tensors(obj)), raw_bytes=sum(
                             t.numel() * t.element_size() for t in _tensors(obj)),
                         src_bytes=src_bytes, dst_bytes=_size(dst),
                         seconds=time.perf_counter() - t0, verified=self.verify)
        if self.progress is not None:
            self.progress.update(src_bytes)
        if self.on_file is not None:
            self.on_file(done)
        return done

    def folder(self, store: Store, src: str, dst: str) -> list[Converted]:
        names = store.list()
        if not names:
            raise StorageError(f"{src}: no such folder, or it holds no files")
        weights, indexes, want = _weights_of(store, names, src)
        total = sum(_size(_File(store, n)) for n in weights)
        if _suffix(dst) == S4W:
            if want != S4W:
                raise UnsupportedError(f"{dst}: a folder of .s4w files converts to a folder "
                                       "of .safetensors files, not to one .s4w file")
            with self.bar(total):
                return [self.one([_File(store, n) for n in weights], _file(dst))]
        out_store = open_store(dst)
        if isinstance(out_store, LocalStore) and out_store.root.is_file():
            raise StorageError(f"{dst} is a file: a folder converts to a folder, or to one "
                               "file named *.s4w")
        done = []
        with self.bar(total):
            for name in weights:
                done.append(self.one([_File(store, name)],
                                     _File(out_store, _renamed(name, want))))
        for name in indexes:
            _copy_index(store, name, out_store, want)
        if out_store.url != store.url:
            for name in sorted(set(names) - set(weights) - set(indexes)):
                with out_store.writer(name) as w:
                    w.write(store.get(name))
        return done


# -- places -----------------------------------------------------------------------------------

def _suffix(name: str) -> str:
    return os.path.splitext(name.rstrip("/"))[1].lower()


def _renamed(name: str, suffix: str) -> str:
    return os.path.splitext(name)[0] + suffix


def _is_folder(text: str) -> bool:
    if text.startswith("s3://"):
        return _suffix(text) not in (S4W, SAFETENSORS, *TORCH_SUFFIXES)
    if not os.path.exists(text):
        raise StorageError(f"{text} does not exist")
    return os.path.isdir(text)


def _file(text: str) -> _File:
    store, name = api._store_and_name(text)
    return _File(store, name)


def _size(f: _File) -> int:
    source = f.store.source(f.name)
    try:
        return source.size()
    finally:
        source.close()


def _bytes(f: _File) -> memoryview:
    source = f.store.source(f.name)
    try:
        return memoryview(source.read_at(0, source.size()))
    finally:
        source.close()


def _weights_of(store: Store, names: list[str], src: str) -> tuple[list[str], list[str], str]:
    """A folder's weight files in order, its index files, and the suffix they convert to.
    With an index, its ``weight_map`` names the weight files; without, every .safetensors
    file is one (else every torch.save file), or every .s4w file."""
    indexes = [n for n in names if n.endswith(INDEX)]
    if indexes:
        weights: list[str] = []
        for index in indexes:
            for shard in _weight_map(store, index).values():
                name = f"{index.rpartition('/')[0]}/{shard}".lstrip("/")
                if name not in names:
                    raise StorageError(f"{src}: {index} names {shard}, which is not there")
                if name not in weights:
                    weights.append(name)
    else:
        weights = [n for n in names if _suffix(n) == SAFETENSORS] or \
            [n for n in names if _suffix(n) in TORCH_SUFFIXES] or \
            [n for n in names if _suffix(n) == S4W]
    if not weights:
        raise StorageError(f"{src}: no weight files ({SAFETENSORS}, {', '.join(TORCH_SUFFIXES)} "
                           f"or {S4W}) in this folder")
    kinds = {_suffix(n) == S4W for n in weights}
    if len(kinds) > 1:
        raise UnsupportedError(f"{src}: holds both .s4w and other weight files; convert them "
                               "one by one")
    return weights, indexes, SAFETENSORS if kinds == {True} else S4W


def _weight_map(store: Store, index: str) -> dict[str, str]:
    try:
        got = json.loads(store.get(index))
        weight_map = got["weight_map"]
    except (ValueError, KeyError, TypeError) as exc:
        raise FormatError(f"{index}: not a weight index (JSON with a weight_map): {exc}") from None
    if not isinstance(weight_map, dict) or not all(
            isinstance(v, str) and isinstance(k, str) for k, v in weight_map.items()):
        raise FormatError(f"{index}: its weight_map is not a dict of tensor names to files")
    return weight_map


def _copy_index(store: Store, index: str, out: Store, want: str) -> None:
    """The index under its new name (``model.safetensors.index.json`` ->
    ``model.s4w.index.json``), its weight map naming the converted files."""
    got = json.loads(store.get(index))
    got["weight_map"] = {k: _renamed(v, want) for k, v in _weight_map(store, index).items()}
    with out.writer(_renamed(index.removesuffix(INDEX), want) + INDEX) as w:
        w.write(json.dumps(got, indent=2, sort_keys=False).encode() + b"\n")


# -- reading and writing ----------------------------------------------------------------------

def _read(f: _File) -> tuple[Any, dict[str, str]]:
    """The object a file holds and the metadata to carry over."""
    suffix = _suffix(f.name)
    if suffix == S4W:
        with s4format.Reader(reading_whole(f.store.source(f.name))) as reader:
            meta = {k.removeprefix(META_PREFIX): v for k, v in reader.metadata.items()
                    if k.startswith(META_PREFIX)}
            return api.read_tree(reader, "cpu", show=False), meta
    if suffix == SAFETENSORS:
        return _read_safetensors(f)
    return _read_torch(f), {}


def _read_torch(f: _File) -> Any:
    target: Any = f.store.root / f.name if isinstance(f.store, LocalStore) \
        else io.BytesIO(_bytes(f))
    try:
        return torch.load(target, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise UnsupportedObjectError(
            f"{f.where}: torch.load(weights_only=True) refuses what it holds "
            f"({_why_refused(exc)}): reading it would run code named by the file. If you "
            f"trust the file: obj = torch.load({f.where!r}, weights_only=False), then "
            "s4weights.save(obj, 'checkpoint.s4w')") from None
    except (RuntimeError, EOFError, OSError, ValueError) as exc:
        raise FormatError(f"{f.where}: not a readable torch.save file: "
                          f"{str(exc).strip().splitlines()[0] if str(exc).strip() else exc!r}"
                          ) from None


def _why_refused(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    for line in lines:
        if "Unsupported global" in line or "WeightsUnpickler error" in line:
            return line.removeprefix("WeightsUnpickler error: ")
    return lines[-1] if lines else type(exc).__name__


def _safetensors() -> Any:
    try:
        import safetensors.torch
    except ImportError:
        raise UnsupportedError(SAFETENSORS_MISSING) from None
    return safetensors.torch


def _read_safetensors(f: _File) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    st = _safetensors()
    try:
        if isinstance(f.store, LocalStore):  # (memory-mapped by safetensors)
            tensors = st.load_file(f.store.root / f.name)
        else:
            tensors = st.load(bytes(_bytes(f)))
        source = f.store.source(f.name)
        try:
            (n,) = struct.unpack("<Q", source.read_at(0, 8).tobytes())
            header = json.loads(source.read_at(8, n).tobytes())
        finally:
            source.close()
        meta = header.pop("__metadata__", None) or {}
        # in the file's own order: safetensors' loaders each return another
        order = sorted(header, key=lambda k: header[k]["data_offsets"][0])
        tensors = {k: tensors[k] for k in order}
    except S4Error:
        raise
    except Exception as exc:  # safetensors raises its own SafetensorError, and others
        raise FormatError(f"{f.where}: not a readable safetensors file: {exc}") from None
    return tensors, {META_PREFIX + k: v for k, v in meta.items()}


def _write(obj: Any, meta: dict[str, str], dst: _File, policy: str) -> None:
    if _suffix(dst.name) == S4W:
        with dst.store.writer(dst.name) as sink:
            api.save(obj, sink, policy=policy, metadata=meta)  # type: ignore[arg-type]
        return
    data = _safetensors().save(obj, metadata=meta or None)
    with dst.store.writer(dst.name) as sink:
        sink.write(data)


def _merge(into: Any, more: Any, where: str) -> dict[Any, Any]:
    if not (isinstance(into, dict) and isinstance(more, dict)):
        raise UnsupportedObjectError(f"{where}: shards merge only when each holds a dict of "
                                     "tensors")
    twice = sorted(set(into) & set(more), key=str)
    if twice:
        raise FormatError(f"{where}: tensor {twice[0]!r} is in an earlier shard too")
    return {**into, **more}


@functools.cache
def _safetensors_holds(dtype: torch.dtype) -> bool:
    try:
        _safetensors().save({"x": torch.empty(0, dtype=dtype)})
    except (KeyError, ValueError, TypeError, RuntimeError):
        return False
    return True


def _safetensors_dict(obj: Any, where: str) -> dict[str, torch.Tensor]:
    """``obj`` as safetensors holds it: a flat dict of str to dense, contiguous tensors of
    its dtypes, none sharing memory; an UnsupportedObjectError names what it cannot hold."""
    if not isinstance(obj, dict):
        raise UnsupportedObjectError(f"{where} holds a {type(obj).__name__}; safetensors holds "
                                     "only a flat dict of str to tensors: keep it as .s4w")
    bad = []
    for k, v in obj.items():
        if not isinstance(k, str):
            bad.append(f"key {k!r} (a {type(k).__name__}, not a str)")
        elif not isinstance(v, torch.Tensor):
            bad.append(f"{k!r} (a {type(v).__name__})")
        elif not _safetensors_holds(v.dtype):
            bad.append(f"{k!r} (dtype {str(v.dtype).removeprefix('torch.')})")
    if bad:
        more = f" and {len(bad) - 5} more" if len(bad) > 5 else ""
        raise UnsupportedObjectError(
            f"{where}: safetensors cannot hold {', '.join(bad[:5])}{more}: it holds only a flat "
            "dict of str to tensors of its dtypes. Keep this checkpoint as .s4w, or convert "
            "its model weights alone")
    out, seen = {}, set()
    for k, v in obj.items():
        t = v.detach()
        key = (t.untyped_storage().data_ptr(), t.device.type) if t.numel() else None
        if not t.is_contiguous() or key in seen:  # safetensors refuses views and shared memory
            t = t.clone(memory_format=torch.contiguous_format)
        seen.add(key)
        out[k] = t
    return out


# -- comparing --------------------------------------------------------------------------------

def _tensors(obj: Any) -> list[torch.Tensor]:
    if isinstance(obj, torch.Tensor):
        return [obj]
    if isinstance(obj, dict):
        return [t for v in obj.values() for t in _tensors(v)]
    if isinstance(obj, (list, tuple)):
        return [t for v in obj for t in _tensors(v)]
    return []


def _raw(t: torch.Tensor) -> torch.Tensor:
    return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)


def differs(a: Any, b: Any, path: str = "") -> str | None:
    """Where ``b`` is not ``a`` bit for bit (tensors: dtype, shape and every byte; floats:
    their bits; containers: types, keys and order), or None when it is."""
    where = path or "<root>"
    if isinstance(a, torch.Tensor):
        if not isinstance(b, torch.Tensor):
            return f"{where}: a tensor became a {type(b).__name__}"
        if a.dtype != b.dtype or a.shape != b.shape:
            return f"{where}: {a.dtype}{list(a.shape)} became {b.dtype}{list(b.shape)}"
        return None if torch.equal(_raw(a), _raw(b)) else f"{where}: the tensor's bytes differ"
    if type(a) is not type(b):
        return f"{where}: a {type(a).__name__} became a {type(b).__name__}"
    if isinstance(a, dict):
        if list(a) != list(b):
            return f"{where}: keys {list(a)[:5]}... became {list(b)[:5]}..."
        return next((d for k in a if (d := differs(a[k], b[k], key_path(path, k)))), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return f"{where}: {len(a)} items became {len(b)}"
        return next((d for i, (x, y) in enumerate(zip(a, b))
                     if (d := differs(x, y, key_path(path, i)))), None)
    if isinstance(a, np.ndarray):
        same = a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()
        return None if same else f"{where}: the array differs"
    if isinstance(a, float):
        return None if struct.pack("<d", a) == struct.pack("<d", b) else f"{where}: {a!r} " \
                                                                          f"became {b!r}"
    return None if a == b else f"{where}: {a!r} became {b!r}"


__all__ = ["Converted", "convert", "differs"]
