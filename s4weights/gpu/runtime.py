"""Kernel modules, launches and buffers for the CUDA path.

Kernels are the ``kernels/*.cu`` sources compiled once per process and device with NVRTC through
CuPy (``-std=c++17``; CuPy targets the current device's architecture). Every launch goes on
torch's current stream, and every buffer is a torch tensor from torch's caching allocator, so
the path composes with the caller's stream and memory accounting.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import sys
import threading
import time
from concurrent.futures import Future, InvalidStateError
from pathlib import Path

import numpy as np
import torch

KERNELS = Path(__file__).with_name("kernels")
ALIGN = 256  # plane and payload offsets inside group buffers


def align(n: int, a: int = ALIGN) -> int:
    return (n + a - 1) // a * a


def kernel_source(name: str, folder: Path = KERNELS) -> str:
    """The source CuPy compiles for ``kernels/<name>.cu``: the file, after a line that names the
    digest of every header in the folder. CuPy's on-disk kernel cache is keyed by the source
    text and the options, not by what the source includes, so without that line a changed
    header alone would load kernels compiled from the old one."""
    digest = hashlib.sha256()
    for h in sorted(folder.glob("*.cuh")):
        digest.update(h.name.encode() + b"\0" + h.read_bytes() + b"\0")
    return f"// headers {digest.hexdigest()}\n" + (folder / f"{name}.cu").read_text()


_MODULES: dict[tuple[str, int], Future] = {}
_MODULES_LOCK = threading.Lock()


def _compiled(name: str, device: int):
    import cupy as cp

    with cp.cuda.Device(device):
        mod = cp.RawModule(code=kernel_source(name), options=("-std=c++17", f"-I{KERNELS}"))
        mod.compile()  # (else at the first get_function)
        return mod


def _module(name: str, device: int):
    """Kernel module ``name`` (``kernels/<name>.cu``) on ``device``, compiled once per process
    and device; CuPy keeps the binary on disk. The first request for a device compiles every
    module at once, each in a thread (NVRTC runs without the GIL), so a bare machine waits for
    the slowest module, not their sum. A compile that fails is forgotten at once: its waiters
    get the error, and the next request compiles it again."""
    mine: list[tuple[Future, str]] = []  # registered here: this call starts them
    with _MODULES_LOCK:
        if (name, device) not in _MODULES:
            for n in sorted({name} | {p.stem for p in KERNELS.glob("*.cu")}):
                if (n, device) not in _MODULES:
                    mine.append((Future(), n))
                    _MODULES[(n, device)] = mine[-1][0]
        fut = _MODULES[(name, device)]
    begun = 0
    try:
        for f, n in mine:
            try:
                threading.Thread(target=_compile_into, args=(f, n, device),
                                 name=f"s4weights-nvrtc-{n}", daemon=True).start()
            except RuntimeError:  # ("can't start new thread", "can't create new thread at
                _compile_into(f, n, device, caller=True)  # interpreter shutdown")
            begun += 1
    finally:
        # interrupted (Ctrl-C) before starting them all: the rest are not left to hang (one
        # whose thread did start settles once, the first way)
        for f, n in mine[begun:]:
            _settle(f, n, device, RuntimeError(f"compiling kernel module {n!r} was interrupted"))
    return fut.result()


def _compile_into(fut: Future, name: str, device: int, caller: bool = False) -> None:
    try:
        mod = _compiled(name, device)
    except BaseException as exc:  # handed to the waiters (and raised on in the caller's own
        _settle(fut, name, device, exc)  # thread where it is no error: an interrupt)
        if caller and not isinstance(exc, Exception):
            raise
        return
    _settle(fut, name, device, None, mod)


def _settle(fut: Future, name: str, device: int, exc: BaseException | None, mod=None) -> None:
    """Complete ``fut`` with the module or the error; a failed one leaves the registry first,
    so the next request compiles again."""
    if exc is not None:
        with _MODULES_LOCK:
            if _MODULES.get((name, device)) is fut:
                del _MODULES[(name, device)]
    with contextlib.suppress(InvalidStateError):  # (settled already)
        if exc is None:
            fut.set_result(mod)
        else:
            fut.set_exception(exc)


@functools.cache
def _function(module: str, name: str, device: int):
    return _module(module, device).get_function(name)


def kernel(module: str, name: str):
    return _function(module, name, torch.cuda.current_device())


@functools.lru_cache(maxsize=64)
def _external(handle: int, device: int):
    import cupy as cp

    return cp.cuda.ExternalStream(handle, device)


def _raw_stream(dev: int) -> int:
    """The handle of torch's current stream on ``dev``. torch's raw-handle query, where it has
    one, builds no Stream object (building one was about half of a launch's host time in a
    profiler trace on the H200 host)."""
    raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)
    return raw(dev) if raw is not None else torch.cuda.current_stream(dev).cuda_stream


def stream():
    """CuPy's handle on torch's current stream (one per torch stream, cached: a launch costs
    no new object)."""
    dev = torch.cuda.current_device()
    return _external(_raw_stream(dev), dev)


_SMS: dict[int, int] = {}


def sm_count() -> int:
    """The current device's multiprocessor count (asked once per device)."""
    dev = torch.cuda.current_device()
    if dev not in _SMS:
        _SMS[dev] = torch.cuda.get_device_properties(dev).multi_processor_count
    return _SMS[dev]


# A launch of at most this many rANS decode warps (blocks) per multiprocessor takes
# kernels/rans.cu's `rans_decode_ahead` build, which loads each row's words before the row
# decodes: it pays where too few warps hide that load and costs where many do (both builds
# timed side by side on the H200 at commit c7b699a: 4,096 fp32 blocks 0.74 -> 0.56 ms, 8,192
# bf16 blocks 0.69 -> 0.74).
RANS_AHEAD_WARPS_PER_SM = 32


def rans_decode_kernel(nblocks: int) -> str:
    """The rANS decode kernel for a launch of ``nblocks`` blocks (one warp each)."""
    return ("rans_decode_ahead" if nblocks <= RANS_AHEAD_WARPS_PER_SM * sm_count()
            else "rans_decode")


def launch(module: str, name: str, grid: int, block: int, *args: object) -> None:
    """Launch ``name`` from ``kernels/<module>.cu`` on torch's current stream."""
    if grid <= 0:
        return
    _function(module, name, torch.cuda.current_device())((grid,), (block,), args,
                                                         stream=stream())


class Batch:
    """Launches whose tables go to the device in one upload: each upload costs tens of
    microseconds of host time. ``table(*arrays)`` reserves tables and returns placeholders that
    ``launch`` takes among its arguments; ``run()`` uploads every table, launches in order and
    returns the device buffer (stream-ordered: keep it or drop it). ``run(stop)`` launches only
    the first ``stop``, keeping the buffer until a later ``run()`` has queued the rest."""

    class _At:
        def __init__(self, i: int) -> None:
            self.i = i

    def __init__(self) -> None:
        self._arrays: list[np.ndarray] = []
        self._launches: list[tuple] = []
        self._addrs: list[int] = []
        self._held: list[object] = []
        self._bytes = 0

    def hold(self, *objs: object) -> None:
        """Keep device buffers the batch's launches use until they are queued (then the stream
        orders their reuse)."""
        self._held += objs

    def table(self, *arrays: np.ndarray) -> list[Batch._At]:
        self._arrays += arrays
        self._bytes += sum(align(np.asarray(a).nbytes, 16) for a in arrays)
        return [Batch._At(len(self._arrays) - len(arrays) + j) for j in range(len(arrays))]

    def launch(self, module: str, name: str, grid: int, block: int, *args: object) -> None:
        self._launches.append((module, name, grid, block, args))

    def table_bytes(self) -> int:
        """Bytes of the tables queued since the last upload (what ``run`` will upload)."""
        return self._bytes

    def mark(self) -> int:
        """The number of launches queued so far (a ``stop`` for :meth:`run`)."""
        return len(self._launches)

    def run(self, stop: int | None = None) -> torch.Tensor | None:
        """Upload every table, then launch in order; with ``stop``, only the first ``stop``
        launches: the rest (their tables uploaded with these) wait for the next ``run()``, so
        a caller can queue other work (a copy) between them without a second upload."""
        dev, addrs = upload(*self._arrays) if self._arrays else (None, [])
        if self._arrays:
            self._launches = [(m, n, g, b, tuple(np.uint64(addrs[a.i]) if isinstance(a, Batch._At)
                                                 else a for a in args))
                              for m, n, g, b, args in self._launches]
        now = self._launches if stop is None else self._launches[:stop]
        for module, name, grid, block, args in now:
            launch(module, name, grid, block, *args)
        self._arrays, self._addrs, self._bytes = [], addrs, 0
        self._launches = [] if stop is None else self._launches[stop:]
        if self._launches:  # the rest read these tables: kept until they are queued
            self._held.append(dev)
        else:
            self._held = []
        return dev

    def address(self, at: Batch._At) -> int:
        """The device address of a table of the last ``run()`` (valid while its buffer is
        kept)."""
        return self._addrs[at.i]


def ptr(t: torch.Tensor) -> np.uint64:
    return np.uint64(t.data_ptr())


def i64(x: int) -> np.int64:
    return np.int64(x)


def device_empty(nbytes: int) -> torch.Tensor:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, device="cuda")


def device_bytes(nbytes: int) -> torch.Tensor:
    """Exactly ``nbytes`` bytes on the current device (sliced only when empty: a load makes
    one per tensor, and a slice costs as much as the allocation)."""
    t = device_empty(nbytes)
    return t if nbytes else t[:0]


def to_device(a: np.ndarray) -> torch.Tensor:
    """A small host table on the device: staged in pinned memory and copied without a host
    synchronisation (torch's caching host allocator keeps the staging block until the copy
    has run)."""
    return upload(a)[0]


def upload(*arrays: np.ndarray) -> tuple[torch.Tensor, list[int]]:
    """Many small host tables in one pinned staging buffer and one asynchronous H2D copy:
    (device buffer, device address of each array, 16-byte aligned)."""
    offs, total = [], 0
    for a in arrays:
        offs.append(total)
        total += align(np.asarray(a).nbytes, 16)
    host = pinned(total)
    h = host.numpy()
    for a, o in zip(arrays, offs):
        b = np.ascontiguousarray(a).reshape(-1).view(np.uint8)
        h[o:o + b.size] = b
    dev = torch.empty(max(total, 1), dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)
    base = dev.data_ptr()
    return dev, [base + o for o in offs]


_CONSTANTS: dict[tuple[str, int], torch.Tensor] = {}
_CONSTANTS_LOCK = threading.Lock()


def constant(name: str, array: np.ndarray) -> np.uint64:
    """The device address of a constant table, uploaded once per device and kept for the
    process (a few KiB, like the kernels' own constants; not workspace)."""
    key = (name, torch.cuda.current_device())
    with _CONSTANTS_LOCK:
        t = _CONSTANTS.get(key)
        if t is None:
            t = upload(array)[0]
            torch.cuda.current_stream().synchronize()  # (once: then any stream may read it)
            _CONSTANTS[key] = t
    return np.uint64(t.data_ptr())


def to_host(t: torch.Tensor, dtype: np.dtype) -> np.ndarray:
    return t.cpu().numpy().view(dtype)


def pinned(nbytes: int) -> torch.Tensor:
    return torch.empty(max(nbytes, 1), dtype=torch.uint8, pin_memory=True)


def copy_ops(src: np.ndarray, dst: np.ndarray, length: np.ndarray, batch: Batch | None = None
             ) -> torch.Tensor | None:
    """Batched device copies: ``length[i]`` bytes from ``src[i]`` to ``dst[i]`` (addresses).
    Long ops are cut into 64 KiB pieces (``plan.split_copies``): one CTA per piece, so a large
    raw or bitpacked plane is copied by many SMs. Returns the device op table (keep it until the
    launch has run, or let the stream order its reuse: it comes from torch's caching allocator
    on the current stream); with a ``batch``, the launch joins it and runs with it."""
    from s4weights.gpu.plan import split_copies

    s, d, ln = split_copies(src, dst, length)
    if not s.size:
        return None
    own = batch is None
    batch = Batch() if own else batch
    batch.launch("copy", "copy_ops", int(s.size), 256, *batch.table(s, d, ln))
    return batch.run() if own else None


def pack_ops(src, dst, n, width, src_width=None, batch: Batch | None = None
             ) -> torch.Tensor | None:
    """Batched bitpack-w packing (codec 8): the ``n[i]`` plane values at ``src[i]`` stored as
    ``width[i]`` bits each at ``dst[i]`` (8: a byte each, as they are), the source a byte per
    value or, where ``src_width[i]`` < 8, itself packed at that many bits. Long planes are cut
    into pieces of ``plan.COPY_PIECE`` values (whole 8-value groups: a piece starts on a byte
    in both), one CTA each. Returns the op table as :func:`copy_ops` does."""
    from s4weights.gpu.plan import COPY_PIECE, cut

    src, dst = (np.asarray(x, np.uint64).reshape(-1) for x in (src, dst))
    n, width = (np.asarray(x, np.int64).reshape(-1) for x in (n, width))
    sw = np.full(n.size, 8, np.int64) if src_width is None else np.asarray(
        src_width, np.int64).reshape(-1)
    op, off = cut(n, COPY_PIECE)
    if not op.size:
        return None
    own = batch is None
    batch = Batch() if own else batch
    batch.launch("copy", "pack_ops", int(op.size), 256, *batch.table(
        src[op] + (off // 8 * sw[op]).astype(np.uint64),
        dst[op] + (off // 8 * width[op]).astype(np.uint64),
        np.minimum(n[op] - off, COPY_PIECE).astype(np.uint64), width[op].astype(np.uint8),
        sw[op].astype(np.uint8)))
    return batch.run() if own else None


def xor(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a ^ b`` of two flat uint8 CUDA tensors of one length (``kernels/planes.cu``
    ``xor_bytes``, on torch's current stream), into ``out`` (may be ``a``) or a new tensor.
    ``b`` may be elsewhere, in host memory (a delta's parent kept there): it is copied into
    ``out`` first (without a synchronisation from pinned memory: it must stay as it is until
    the stream has run the copy), so ``out`` must not then be ``a``."""
    n = int(a.numel())
    if int(b.numel()) != n:
        raise ValueError(f"xor of {n} and {int(b.numel())} bytes")
    if out is None:
        out = device_bytes(n)
    if b.device != a.device:
        if n and out.data_ptr() == a.data_ptr():
            raise ValueError("xor with a host operand needs an output other than a")
        if n:
            out.copy_(b, non_blocking=True)
        b = out
    if n:
        launch("planes", "xor_bytes", min(4096, (n + 4095) // 4096), 256, ptr(a), ptr(b),
               ptr(out), np.int64(n))
    return out


def xor_into(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    """``a ^= b`` for each (a, b) of ``pairs``, flat uint8 CUDA tensors of one length each, in
    one launch (``kernels/planes.cu`` ``xor_ops``, on torch's current stream; long ones in
    64 KiB pieces, one CTA each)."""
    from s4weights.gpu.plan import split_ops

    # (torch's int device index, not a torch.device per tensor: a chain level has one pair
    # per tensor, hundreds)
    n = [a.numel() for a, _b in pairs]
    if n != [b.numel() for _a, b in pairs] \
            or [a.get_device() for a, _b in pairs] != [b.get_device() for _a, b in pairs]:
        a, b = next((a, b) for a, b in pairs
                    if a.numel() != b.numel() or a.get_device() != b.get_device())
        raise ValueError(f"xor of {int(a.numel())} bytes on {a.device} and "
                         f"{int(b.numel())} on {b.device}")
    x, y, n = split_ops(n, [a.data_ptr() for a, _b in pairs], [b.data_ptr() for _a, b in pairs])
    if n.size:
        batch = Batch()
        batch.launch("planes", "xor_ops", int(n.size), 256, *batch.table(x, y, n))
        batch.run()


def _leaf_launch(ptrs, lengths, batch: Batch, gap: bool, out: torch.Tensor | None = None,
                 at: np.ndarray | None = None
                 ) -> tuple[torch.Tensor, np.ndarray, list[Batch._At]]:
    """Queue the leaf digests of each segment in ``batch``: segment s's go to ``out`` from index
    ``at[s]`` on (by default a new buffer, the segments' digests back to back, or with ``gap``
    a slot before each segment's, where :func:`_roots_launch` puts its length). Returns
    (device digests, first leaf per segment, the batch's tables of lengths and first leaves)."""
    from s4format.hashing import LEAF_SIZE

    lengths = np.asarray(lengths, dtype=np.int64).reshape(-1)
    first = np.zeros(lengths.size + 1, dtype=np.int64)
    np.cumsum((lengths + LEAF_SIZE - 1) // LEAF_SIZE, out=first[1:])
    total = int(first[-1])
    if out is None:
        out = torch.empty(max(total + (lengths.size if gap else 0), 1), dtype=torch.int64,
                          device="cuda")
    if not total and not gap:  # nothing to digest, no tables to keep
        return out, first, []
    if at is None:
        at = first[:-1] + (np.arange(1, lengths.size + 1) if gap else 0)
    p_len, p_first = batch.table(lengths.astype(np.uint64), first)
    if total:
        batch.launch("hash", "leaf_digests", (total + 7) // 8, 256, np.int32(lengths.size),
                     *batch.table(np.asarray(ptrs, dtype=np.uint64)), p_len, p_first,
                     *batch.table(np.asarray(at, np.int64)), ptr(out))
    return out, first, [p_len, p_first]


def _roots_launch(nseg: int, tables: list[Batch._At], buf: torch.Tensor, batch: Batch,
                  wide: bool) -> torch.Tensor:
    """Queue the roots (kernels/hash.cu ``hash_roots``) of ``nseg`` segments whose digests lie
    in ``buf`` with a slot before each segment's (``tables``: their lengths and first leaves):
    a u64 each (the plane checksums) or, ``wide``, 16 bytes each (the content hashes)."""
    out = torch.empty(max(nseg * (2 if wide else 1), 1), dtype=torch.int64, device="cuda")
    if nseg:
        batch.launch("hash", "hash_roots", nseg, 256, np.int32(nseg), *tables,
                     ptr(buf), ptr(out), np.int32(wide))
        batch.hold(buf)
    return out


def leaf_digests(ptrs, lengths, batch: Batch | None = None, out: torch.Tensor | None = None,
                 at: np.ndarray | None = None) -> tuple[torch.Tensor, np.ndarray]:
    """XXH3-64 digests of the 64 KiB leaves of each segment (a warp each): (device digests,
    first leaf per segment). No host synchronisation: the digests stay on the device until the
    caller copies them. With ``out`` and ``at``, segment s's digests go to ``out`` from index
    ``at[s]`` on (else to a new buffer, back to back). With a ``batch``, the launch joins it
    (and runs with it)."""
    own = batch is None
    batch = Batch() if own else batch
    out, first, tables = _leaf_launch(ptrs, lengths, batch, False, out, at)
    if own and tables:
        batch.run()
    return out, first


def _rooted(ptrs, lengths, batch: Batch | None, wide: bool) -> torch.Tensor:
    nseg = np.asarray(lengths).size
    own = batch is None
    batch = Batch() if own else batch
    buf, _first, tables = _leaf_launch(ptrs, lengths, batch, True) if nseg else (None, None, [])
    out = _roots_launch(nseg, tables, buf, batch, wide)
    if own and nseg:
        batch.run()
    return out


def plane_checksums(ptrs, lengths, batch: Batch | None = None) -> torch.Tensor:
    """The plane checksums (XXH3-64 roots over the 64 KiB leaves' digests, spec/format.md
    "Hashes") of segments on the device: a u64 per segment, no host synchronisation, the
    host hashes nothing. The leaf digests go with a slot before each segment's, where the
    roots' launch puts its length. With a ``batch``, both launches join it."""
    return _rooted(ptrs, lengths, batch, False)


def content_hashes(ptrs, lengths, batch: Batch | None = None) -> torch.Tensor:
    """The content hashes (XXH3-128 roots, canonical bytes) of segments on the device, as
    :func:`plane_checksums`: 16 bytes per segment (an int64 tensor of two words each)."""
    return _rooted(ptrs, lengths, batch, True)


def content_hashes_now(ptrs, lengths) -> list[bytes]:
    """:func:`content_hashes` on the host, one 16-byte hash per segment (a synchronisation)."""
    n = np.asarray(lengths).size
    b = content_hashes(ptrs, lengths).view(torch.uint8)[:16 * n].cpu().numpy().tobytes()
    return [b[16 * k:16 * (k + 1)] for k in range(n)]


def roots_over(buf: torch.Tensor, lengths, first, batch: Batch, wide: bool) -> torch.Tensor:
    """Queue the roots of digests a caller laid out in ``buf`` with a slot before each
    segment's (segment s's at ``first[s] + s``, ``first`` the leaf prefix sums): see
    :func:`_roots_launch`."""
    lengths = np.asarray(lengths, np.int64).reshape(-1)
    return _roots_launch(lengths.size, batch.table(lengths.astype(np.uint64),
                                                   np.asarray(first, np.int64)), buf, batch,
                         wide)


class Profile:
    """Stage timings (device synchronised) printed to stderr when $S4_GPU_PROFILE is set."""

    def __init__(self, what: str) -> None:
        self.on = bool(os.environ.get("S4_GPU_PROFILE"))
        self.what = what
        self.marks: list[tuple[str, float]] = []
        self.t = time.perf_counter()

    def mark(self, stage: str) -> None:
        if self.on:
            torch.cuda.synchronize()
            now = time.perf_counter()
            self.marks.append((stage, now - self.t))
            self.t = now

    def report(self) -> None:
        if self.on:
            print(f"[s4 gpu {self.what}] " + ", ".join(f"{s} {1e3 * t:.1f} ms"
                                                      for s, t in self.marks), file=sys.stderr)
