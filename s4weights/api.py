"""``save`` and ``load``: drop-in replacements for ``torch.save`` and ``torch.load``.

``save(obj, f)`` writes one self-contained .s4w file (to a path, atomically, or to a binary file
object). ``load(f, map_location=None)`` reads it back; loading is always safe, like
``weights_only=True``: nothing in the file can make the loader run code.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import os
import stat
import time
from concurrent.futures import Future
from pathlib import Path
from typing import Any, BinaryIO

import torch

import s4format
from s4format import memsink, threads
from s4format.errors import BadMagicError, LimitError, S4Error, StorageError
from s4format.reader import MAX_TENSORS
from s4format.source import BufferSource, ByteSource
from s4format.writer import AHEAD, Writer, WriteResult
from s4weights import progress
from s4weights.background import Background, Inline
from s4weights.store.base import Store, reading_whole
from s4weights.store.local import LocalStore
from s4weights.torchtree import DeviceTensor, Flattened, Unflattener, flatten, plan_into

log = logging.getLogger("s4weights")

FileLike = str | os.PathLike[str] | BinaryIO
WRITE_QUEUE = 256 << 20  # payload bytes waiting for the writer thread, at least
# Tensors a CPU load decodes on the caller's thread, not ahead on the workers: under this size
# the Python around the kernels costs more than they do, and two threads only pass the GIL
# back and forth for it (1,000 tensors of 256 bytes, 2 cores: 33 ms a load ahead, 23 here).
INLINE_LOAD = 64 << 10


def producer_metadata() -> dict[str, str]:
    return {"producer": f"s4weights {s4format.__version__}", "torch": str(torch.__version__)}


def write_flattened(flat: Flattened, sink: BinaryIO, *, policy: str = "auto",
                    parent_id: bytes | None = None, parents: dict[str, Any] | None = None,
                    metadata: dict[str, str] | None = None, show: bool | None = None,
                    device: str = "auto", workspace: int | None = None,
                    parent_hashes: dict[str, bytes] | None = None,
                    alone: dict[str, int] | None = None) -> WriteResult:
    """Code and stream every tensor of ``flat`` into ``sink``. ``parents`` maps a tensor name to
    the parent's :class:`~s4format.Tensor` of that name (delta against ``parent_id``), or to a
    :class:`DeviceTensor` copy on the GPU. The GPU path XORs and codes a CUDA tensor's delta on
    its device, its parent read there or copied there from host memory; a host parent needs
    its content hash in ``parent_hashes`` for that (else the CPU writer codes the tensor).
    The CPU writer takes a parent's hash from ``parent_hashes`` too, so each must be the
    content hash of exactly the parent bytes given (a chain's: its file's index says it).
    ``device``: ``"auto"`` codes CUDA tensors on the GPU when the GPU path is available,
    ``"cuda"`` requires it, ``"cpu"`` codes everything on the CPU (same file format).
    ``alone``: estimates of what tensors store coded alone, by name, for the CPU coder to
    compare their deltas with (:attr:`s4weights.chainpolicy.Sample.alone`)."""
    from s4weights import gpu

    if len(flat.tensors) > MAX_TENSORS:  # refused before a byte is written
        raise LimitError(f"the object holds {len(flat.tensors)} tensors; a file holds at most "
                         f"{MAX_TENSORS} (readers refuse more: spec/validation.md, I0)")
    total = sum(t.nbytes for _, t in flat.tensors)
    # A parent of another dtype or length cannot be XORed: such tensors are coded alone.
    parents = {name: parent for name, tensor in flat.tensors
               if (parent := (parents or {}).get(name)) is not None
               and parent.dtype == tensor.dtype and parent.nbytes == tensor.nbytes}
    gpu_only = policy == "nvcomp-ans"
    if gpu_only and (device == "cpu" or not gpu.nvcomp_ans_available()):
        raise ValueError("policy 'nvcomp-ans' writes GPU-only files with nvCOMP's ANS codec: "
                         "it needs device 'auto' or 'cuda' with a CUDA device, CuPy and nvCOMP")
    # (an empty BytesIO is filled through one allocation: a stored tensor is at most its raw
    # bytes and a few hundred more; a larger file only writes its end more slowly)
    with progress.bar("s4weights save", total, show) as bar, \
            memsink.into(sink, total + (len(flat.tensors) + 64) * 1024) as sink:
        # under nvcomp-ans, tensors the GPU does not code (host tensors) get the default codecs
        w = Writer(sink, policy="auto" if gpu_only else policy, parent_id=parent_id)
        coded = gpu.coded_in_order(flat.tensors, policy, device, parents, workspace=workspace,
                                   parent_hashes=parent_hashes)
        # With tensors coded on the GPU, the sink's writes run on a writer thread while this
        # one codes the next tensors (all coding stays on this thread: torch's current stream
        # is per thread, and the CPU coders are not thread-safe). Queued results hold pinned
        # host memory, bounded below (and, saving into a BytesIO, up to memsink.PENDING more
        # bytes written but not yet copied keep theirs). A CPU-only save writes as it codes,
        # the CPU coder's threads coding the next tensors meanwhile (Writer.code_ahead bounds
        # them).
        writes = Background(limit=max(WRITE_QUEUE, total // 20)) if coded else Inline()
        alone, parent_hashes = alone or {}, parent_hashes or {}
        ahead = None if coded else w.code_ahead(
            (name, _host(t), None if (p := parents.get(name)) is None else _host(p),
             alone.get(name), parent_hashes.get(name)) for name, t in flat.tensors)
        try:
            for name, tensor in flat.tensors:
                done = coded.get(name)
                # (None: the GPU path ran out of device memory and left the tensor to the CPU)
                got = next(done) if done is not None else None
                if got is not None:
                    c, content_hash, parent_hash, full = got
                    writes.submit(functools.partial(
                        w.add_coded, name, tensor.dtype, tensor.shape, c, content_hash,
                        parent_hash=parent_hash, full_stored=full), c.stored)
                else:
                    parent = parents.get(name)
                    args = next(ahead) if ahead is not None else w.code(
                        name, _host(tensor), parent=None if parent is None else _host(parent),
                        alone=alone.get(name), parent_hash=parent_hashes.get(name))
                    writes.submit(functools.partial(w.add_coded, **args),
                                  args["coded"].stored)
                bar.update(tensor.nbytes)
            writes.finish()
        except BaseException as exc:
            earlier = writes.abort()
            if earlier is not None and earlier is not exc:
                if hasattr(exc, "add_note"):  # Python 3.11+
                    exc.add_note(f"s4weights: a write had failed before: {earlier!r}")
                else:
                    log.error("a write had failed before: %r", earlier)
            raise
        w.set_tree(flat.tree)
        w.set_metadata({**producer_metadata(), **(metadata or {})})
        return w.close()


def _host(t: s4format.Tensor | DeviceTensor) -> s4format.Tensor:
    return t.to_host() if isinstance(t, DeviceTensor) else t


def save(obj: Any, f: FileLike, *, policy: str = "auto", metadata: dict[str, str] | None = None,
         progress: bool | None = None, device: str = "auto",
         workspace: int | None = None, blocking: bool = True) -> WriteResult | Future[Any]:
    """Save ``obj`` (a state dict, optimizer state, any tree of tensors and plain values).

    ``f`` is a path or ``s3://bucket/key`` URL (written atomically: a failed save leaves any
    previous file intact; a path to a device, FIFO or socket, such as ``os.devnull``, is
    written into as it is) or a binary file object open for writing. ``policy`` is the codec
    choice: ``"auto"`` (smallest, bit-packing planes where entropy coding saves under 1/65,
    planes whose values change along them, such as flat buffers, in segments; format 1.3),
    ``"auto-1.0"`` (the same without codecs 8 and 9: files format-1.0 readers open),
    ``"seed"`` (the fixed assignment of the design) or ``"nvcomp-ans"`` (GPU-only files). Raises
    :class:`s4format.UnsupportedObjectError` naming the key path of any object that cannot be
    stored. ``device`` picks where CUDA tensors are coded (``"auto"``, ``"cuda"``, ``"cpu"``).
    ``workspace`` bounds the extra GPU memory the GPU path uses, in bytes, on each device
    (default: 10% of the state's bytes on it, at least 4 MiB and at most 1 GiB). Tensors are
    coded on the CUDA device that holds them, whatever the current device. A tensor too large
    to code whole in the workspace is coded in chunks that fit (the same stored bytes); the
    smallest chunk (2^16 elements) needs under 2 MiB. When the device runs out of memory, the
    GPU path codes again from the tensor it was at with half the workspace, down to 4 MiB,
    then leaves that device's remaining tensors to the CPU coder (under ``nvcomp-ans`` at once,
    with the default codecs), with a warning: the save does not fail for it.
    When tensors are coded on the GPU, a file object ``f`` is written from a helper thread
    while the next tensors are coded (one thread at a time; ``save`` returns after the last
    write).
    ``blocking=False`` returns a :class:`concurrent.futures.Future` of the result once ``obj``'s
    tensors are copied (:mod:`s4weights.background_save`); a file object ``f`` is written in the
    background and must not be touched until then.
    """
    from s4weights import background_save

    flat = flatten(obj)
    kw = dict(policy=policy, metadata=metadata, progress=progress, device=device,
              workspace=workspace)
    key = os.path.realpath(f) if isinstance(f, (str, os.PathLike)) else f"file {id(f)}"
    if not blocking:
        captured, streams = background_save.capture(flat)
        return background_save.submit(key, lambda: _save_flat(captured, f, **kw), streams)
    background_save.wait_for(key)
    return _save_flat(flat, f, **kw)


def _save_flat(flat: Flattened, f: FileLike, *, policy: str, metadata: dict[str, str] | None,
               progress: bool | None, device: str, workspace: int | None) -> WriteResult:
    t0 = time.perf_counter()
    if isinstance(f, (str, os.PathLike)) and _special_file(f):
        # a device, FIFO or socket (os.devnull, /dev/stdout): written into, as torch.save
        # does; the atomic rename would replace it with a regular file
        with _open_special(f, "wb") as sink:
            result = write_flattened(flat, sink, policy=policy, metadata=metadata,
                                     show=progress, device=device, workspace=workspace)
    elif isinstance(f, (str, os.PathLike)):
        store, name = _store_and_name(f)
        with store.writer(name) as sink:
            result = write_flattened(flat, sink, policy=policy, metadata=metadata,
                                     show=progress, device=device, workspace=workspace)
    else:
        result = write_flattened(flat, f, policy=policy, metadata=metadata, show=progress,
                                 device=device, workspace=workspace)
    log.info("saved %d tensors: %d raw -> %d stored bytes in %.3f s", result.tensor_count,
             result.raw_nbytes, result.stored_nbytes, time.perf_counter() - t0)
    return result


def _special_file(f: str | os.PathLike[str]) -> bool:
    """Whether ``f`` exists and is neither a regular file nor a directory."""
    if isinstance(f, str) and f.startswith("s3://"):
        return False
    try:
        mode = os.stat(f).st_mode
    except OSError:
        return False
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode))


def _open_special(f: str | os.PathLike[str], mode: str) -> BinaryIO:
    try:
        return open(f, mode)
    except OSError as exc:
        raise StorageError(f"cannot open {os.fspath(f)}: {exc.strerror}") from exc


def _store_and_name(f: str | os.PathLike[str]) -> tuple[Store, str]:
    """The store holding the file ``f`` (a path or an ``s3://bucket/key`` URL) and its name."""
    if isinstance(f, str) and f.startswith("s3://"):
        from s4weights.store.s3 import open_object
        return open_object(f)
    # through a symlink (latest.s4w -> ckpt-N.s4w) as torch.save writes: the atomic rename
    # replaces the link's target, not the link
    path = Path(os.path.realpath(f))
    return LocalStore(path.parent), path.name


def _source(f: FileLike | bytes | ByteSource) -> ByteSource | str | os.PathLike[str]:
    if isinstance(f, str) and f.startswith("s3://"):
        store, name = _store_and_name(f)
        return store.source(name)
    if isinstance(f, (str, os.PathLike)) and _special_file(f):
        # a FIFO or device (what save writes into as it is): read through once, as torch.load
        # does; the reader's random access needs the bytes in memory
        with _open_special(f, "rb") as fh:
            try:
                return BufferSource(fh.read(), name=os.fspath(f))
            except OSError as exc:
                raise StorageError(f"reading {os.fspath(f)} failed: {exc.strerror}") from exc
    if isinstance(f, (str, os.PathLike)) and os.path.isdir(f):
        raise StorageError(_directory_message(os.fspath(f)))
    if isinstance(f, (str, os.PathLike, ByteSource)):
        return f
    if isinstance(f, (bytes, bytearray, memoryview)):
        return BufferSource(f)
    if isinstance(f, io.BytesIO):
        # from the current position, as torch.load reads (a file saved after other bytes);
        # the object runs to the end, where the position is left. getvalue() shares the
        # object's bytes (getbuffer() copied all of them when they were given to BytesIO, and
        # its export would stop later writes from resizing the object).
        pos = f.tell()
        view = memoryview(f.getvalue())[pos:]
        f.seek(0, io.SEEK_END)
        return BufferSource(view)
    return BufferSource(f.read(), name=getattr(f, "name", "<file object>"))


def _directory_message(path: str) -> str:
    if os.path.isdir(os.path.join(path, "manifests")):
        return (f"{path} is a checkpoint directory, not a .s4w file: load it with "
                f"s4weights.load_checkpoint({path!r}) (the latest step, or step=N)")
    return (f"{path} is a directory, not a .s4w file: s4weights.load reads one file; a "
            "directory written by save_checkpoint loads with s4weights.load_checkpoint")


def open_reader(f: FileLike | bytes | ByteSource, *, parent: s4format.Reader | None = None,
                verify: bool = True, whole: bool = False) -> s4format.Reader:
    """A Reader of ``f`` (see :func:`load`); a torch.save or safetensors file is refused with
    a BadMagicError that says how to read or convert it. ``whole``: every tensor will be
    read (:func:`~s4weights.store.base.reading_whole`)."""
    src = _source(f)
    if whole:
        reading_whole(src)
    try:
        return s4format.Reader(src, parent=parent, verify=verify)
    except BadMagicError as exc:
        hint = _foreign_format(src)
        if hint is None:
            raise
        raise BadMagicError(f"{exc}: {hint}") from None


def _foreign_format(src: ByteSource | str | os.PathLike[str]) -> str | None:
    """What to do with a file of a format s4weights converts from, else None."""
    try:
        if isinstance(src, (str, os.PathLike)):
            with open(src, "rb") as fh:
                head = fh.read(16)
        else:
            head = src.read_at(0, min(16, src.size())).tobytes()
    except (OSError, S4Error):
        return None
    name = os.fspath(src) if isinstance(src, (str, os.PathLike)) else "FILE"
    convert = f"or convert it once: s4weights convert {name} {Path(name).stem}.s4w"
    pickle = len(head) > 1 and head[0] == 0x80 and 2 <= head[1] <= 5  # a pre-1.6 torch.save
    if head.startswith(b"PK\x03\x04") or pickle:
        return f"it is a torch.save file: read it with torch.load(weights_only=True), {convert}"
    if len(head) > 8 and head[8:9] == b"{":
        return f"it looks like a safetensors file: read it with safetensors, {convert}"
    return None


def read_tree(reader: s4format.Reader, map_location: Any = None, *, strict: bool = True,
              show: bool | None = None, device: str = "auto", into: Any = None,
              workspace: int | None = None, copy_to: Any = None,
              max_decoded_bytes: int | None = None) -> Any:
    """The object tree of ``reader`` (see :func:`load`). ``copy_to``: an object whose
    ``host(i, tensor)`` and ``device(i, raw_bytes)`` are called with each stored tensor i as
    it is decoded (on the CPU, or on the GPU: its flat uint8 bytes, before anything else is
    queued that could write them, such as a copy into another ``into=`` destination)."""
    from s4weights import gpu

    plan = plan_into(reader.tree, lambda i: reader.tensors[i], into) \
        if into is not None else None
    total = sum(t.raw_nbytes for t in reader.tensors)
    with progress.bar("s4weights load", total, show) as bar:
        ahead = None

        def tensor(i: int) -> s4format.Tensor:
            t = ahead.get(i) if ahead is not None else reader.read(i)
            bar.update(t.nbytes)
            if copy_to is not None:
                copy_to.host(i, t)
            return t
        loader = gpu.loader_for(reader, device, bar.update,
                                direct=plan.direct if plan is not None else None,
                                workspace=workspace,
                                on_decoded=copy_to.device if copy_to is not None else None)
        reader.check_budget((i for i, n in enumerate(reader.tensor_uses) if n),
                            _decode_budget(reader, max_decoded_bytes, loader is not None))
        if loader is None:  # the CPU decodes the next tensors on its threads meanwhile
            ahead = threads.Prefetch(reader.read, [
                (i, reader.tensors[i].raw_nbytes) for i, n in enumerate(reader.tensor_uses) if n
            ], AHEAD, INLINE_LOAD)
        return Unflattener(tensor, map_location, strict=strict, device_tensor=loader,
                           into=plan, uses=reader.tensor_uses).walk(reader.tree)


def _decode_budget(reader: s4format.Reader, limit: int | None, on_gpu: bool) -> int:
    """What a load may decode (spec/validation.md, L1): ``limit``, the reader's own, or the
    memory available, the GPUs' included where the GPU path decodes."""
    if limit is not None:
        return limit
    if reader.max_decoded_bytes is not None or not on_gpu:
        return reader.decode_budget()
    gpus = sum(torch.cuda.get_device_properties(d).total_memory
               for d in range(torch.cuda.device_count()))
    return reader.decode_budget() + gpus


# torch.load's keywords for its unpickler (pickle.Unpickler's): s4weights never unpickles
_PICKLE_LOAD_ARGS = frozenset({"encoding", "errors", "fix_imports", "buffers"})


def load(f: FileLike | bytes, map_location: Any = None, pickle_module: Any = None, *,
         weights_only: bool | None = None, mmap: bool | None = None,
         parent: FileLike | s4format.Reader | None = None, strict: bool = True,
         verify: bool = True, progress: bool | None = None, device: str = "auto",
         into: Any = None, workspace: int | None = None, max_decoded_bytes: int | None = None,
         **pickle_load_args: Any) -> Any:
    """Load what :func:`save` wrote. ``map_location`` works as in ``torch.load`` (a device, a
    string, a dict from saved to target location, or a callable). Loading never runs code from
    the file, whatever ``weights_only`` says. ``parent`` is needed only for a delta file.
    ``verify`` checks every tensor's content hash (default on). ``device``: ``"auto"`` decodes
    tensors bound for a CUDA device on the GPU when the GPU path is available, ``"cuda"``
    requires it, ``"cpu"`` decodes on the CPU and copies.

    ``into``: existing tensors to load into, in a tree (dicts, lists, tuples) matching the saved
    one by key path, e.g. ``into=model.state_dict()`` or ``into={"model": model.state_dict(),
    "optimizer": opt.state_dict()}``. Each of its tensors is filled in place and is the very
    object the returned tree holds at that path (its device wins over ``map_location``). On a
    CUDA destination the GPU decoder writes straight into it where the stored tensor is all of
    it (a whole, contiguous tensor); views and tensors sharing a storage are decoded and copied
    in; on the CPU path the decoded tensor is ``copy_``-ed in. Stored tensors without a
    destination load as usual. Every destination is checked before anything is decoded:
    :class:`~s4weights.torchtree.IntoMismatchError` (an ``S4Error`` and a ``ValueError``) names
    the key path of a tensor whose dtype or shape differs from the stored one, that cannot be
    written (a meta tensor), or where the file stores no tensor. Destinations may be partly
    written if decoding then fails (a corrupt file).

    ``workspace`` bounds the extra GPU memory of the GPU decoder beyond the returned tensors,
    in bytes (default: 10% of the file's raw bytes, at least 4 MiB, raised to an eighth of the
    device memory free besides the file's raw bytes; at most 1 GiB); a tensor too large for it
    is decoded in chunks (not one with GDeflate or nvcomp-ans planes, which decodes whole).
    With the default, a tensor that needs more than that but at most an eighth of the free
    device memory is decoded whole, alone, which is faster. A chunk holds whole rANS blocks: a
    file whose blocks are longer than S4's writers make them (2^16 symbols; the spec allows
    2^20) can need a few MiB past a workspace under ~12 MiB. When the device runs out of
    memory, a tensor is decoded again with a halved workspace, down to 4 MiB, where that can
    help, and else on the CPU and copied in (a warning says so); once even a small attempt
    fails, the later tensors on that device are decoded on the CPU without trying it. The
    returned tensors themselves still need their own memory, as with ``torch.load``, and
    nvcomp-ans planes decode only on the GPU, so their fallback may run out of memory too.

    ``max_decoded_bytes`` bounds what the load decodes in all, each stored tensor counted once:
    a file of a few kilobytes can declare gigabytes of tensors, and such a file is refused with
    a LimitError before anything is decoded (default: the memory available, host memory plus
    the GPUs' where the GPU path decodes).

    torch.load's other arguments are taken and change nothing: ``pickle_module`` and the
    unpickler's keywords (``encoding``, ``errors``, ``fix_imports``, ``buffers``), as nothing
    is unpickled, and ``mmap`` (tensors are always read into memory of their own). Any other
    keyword is a ``TypeError``, as a misspelt ``map_location`` would be for torch.load."""
    from s4weights import gpu

    unknown = sorted(set(pickle_load_args) - _PICKLE_LOAD_ARGS)
    if unknown:
        raise TypeError(f"load() got an unexpected keyword argument {unknown[0]!r}")
    if weights_only is False or pickle_module is not None or mmap or pickle_load_args:
        log.debug("s4weights never unpickles nor maps files: weights_only=%r, pickle_module, "
                  "mmap and the unpickler's keywords change nothing", weights_only)
    gpu.register_codecs(device)
    t0 = time.perf_counter()
    with contextlib.ExitStack() as opened:
        # a parent this call opens is closed with it (also when the child fails to open)
        parent_reader = parent if isinstance(parent, s4format.Reader) or parent is None \
            else opened.enter_context(open_reader(parent, verify=verify, whole=True))
        reader = opened.enter_context(open_reader(f, parent=parent_reader, verify=verify,
                                                  whole=True))
        obj = read_tree(reader, map_location, strict=strict, show=progress, device=device,
                        into=into, workspace=workspace, max_decoded_bytes=max_decoded_bytes)
    log.info("loaded %s in %.3f s", reader.name, time.perf_counter() - t0)
    return obj
