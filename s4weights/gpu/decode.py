"""The load side of the CUDA path: stored tensors decoded on the GPU in batches, each batch's
planes staged in one copy (``staging``) and decoded in one pass (``decode_group``), deltas
made whole with their parents' bytes one chain level at a time.

It also says which tensors the GPU decodes and how much device memory each needs, known from
the index alone, so the loader sizes its batches by what they hold. Failures come out as the
CPU reader would raise them (``failures``). :func:`stage` and ``decode_staged`` split a batch
at the H2D, so benchmarks can time the device-to-device part alone.
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable

import numpy as np
import torch

from s4format import codecs, layouts, threads
from s4format.codecs import rans, ransseg
from s4format.errors import (
    ContentHashError,
    LimitError,
    ParentMismatchError,
    S4Error,
)
from s4format.hashing import LEAF_SIZE
from s4format.reader import Reader
from s4format.writer import AHEAD
from s4weights.gpu import gdeflate, nvans, ransparse, runtime, segdecode, staging
from s4weights.gpu.decode_group import decode_staged
from s4weights.gpu.failures import about, raise_as_cpu
from s4weights.gpu.plan import GPU_LAYOUTS
from s4weights.gpu.staging import SLOT_ALIGN, Staged

GPU_CODECS = {codecs.RAW, codecs.BITPACK, codecs.RANS, codecs.GDEFLATE, codecs.BITPACK_W,
              codecs.RANS_SEG}
DEST_ALIGN = 16  # the merge kernels store 16-byte vectors: destinations decoded into in place


def decodable(reader: Reader, i: int) -> bool:
    """Whether the GPU decodes tensor i (else the CPU does and the bytes are copied up). An
    XOR delta decodes on the GPU when its planes do and its parent is attached; the parent's
    bytes are then decoded (or copied up) to the device too and XORed there."""
    form = _forms(reader)[i]
    if form & _DELTA and reader.parent is None:
        return False
    form &= ~_DELTA
    return form == _YES or (form == _NEEDS_GDEFLATE and gdeflate.available()) \
        or (form == _NEEDS_NVANS and nvans.available())


def host_level(reader: Reader, i: int) -> bool:
    """Whether tensor i is a delta the GPU does not decode (masked, or with planes of a codec
    the GPU lacks) whose parent is attached: the CPU reader then decodes its own level, its
    XOR bytes, which are copied up and made whole with its parent's bytes on the GPU, as a
    delta the GPU decodes is. Its parent then decodes on the GPU where it can, not on the CPU
    with it."""
    t = reader.tensors[i]
    return t.is_delta and reader.parent is not None and t.raw_nbytes > 0 \
        and not decodable(reader, i)


def batched(reader: Reader, i: int) -> bool:
    """Whether tensor i decodes in a batch (:func:`read_tensors`): the GPU decodes it, or the
    CPU its own level (:func:`host_level`). A delta so read leaves its XOR bytes, made whole
    with its parent's on the GPU (:func:`_apply_parents`), its parents in one batch a level."""
    return decodable(reader, i) or host_level(reader, i)


# What a tensor's record says of its decoding on the GPU, known once per reader (a load asks
# for each tensor several times): never, yes, or only where nvCOMP's GDeflate or ANS runs;
# with a bit for a delta, which needs its parent attached.
_NEVER, _YES, _NEEDS_GDEFLATE, _NEEDS_NVANS, _DELTA = 0, 1, 2, 3, 4
_FORMS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reader -> form per tensor


def _forms(reader: Reader) -> list[int]:
    forms = _FORMS.get(reader)
    if forms is None:
        forms = _FORMS[reader] = [_form(t) for t in reader.tensors]
    return forms


def _form(t) -> int:
    """:func:`decodable`'s answer for record ``t``, before its parent and nvCOMP are known."""
    delta = _DELTA if t.is_delta else 0
    if t.masked:  # (masked tensors decode on the host, their parents on the GPU: host_level)
        return _NEVER
    c = t.planes[0].codec
    if t.layout.layout_id == layouts.RAW.layout_id:  # one plane: copied or decoded into place
        if c in (codecs.RAW, codecs.RANS, codecs.RANS_SEG):
            return _YES | delta
        return _NEEDS_NVANS | delta if c == codecs.NVCOMP_ANS else _NEVER
    # The merge kernels read bitpack only on the sign plane (plane 0) and bitpack-w only on
    # the others; the spec allows either on any plane, and such tensors decode on the CPU.
    if t.layout.layout_id not in GPU_LAYOUTS or c == codecs.BITPACK_W \
            or any(p.codec not in GPU_CODECS for p in t.planes) \
            or any(p.codec == codecs.BITPACK for p in t.planes[1:]):
        return _NEVER
    if any(p.codec == codecs.GDEFLATE for p in t.planes):
        return _NEEDS_GDEFLATE | delta
    return _YES | delta


_BY_HASH: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reader -> hash -> index


# Device bytes of the decoder's tables and flags, besides the staged payloads and decoded
# planes (measured under the emulation, with room): per tensor (its merge-table rows, content
# digest, flags), per plane (its checksum, digest slot and launch rows), per rANS plane (its
# stream's frequency tables and rows), per rANS block at the writers' block size (the block
# tables and error codes; a file of smaller blocks holds more, bounded per batch by
# ``ransparse.tables_fit``), per 64 KiB leaf of stored or decoded bytes (its digest and the
# digest's copy on the way to the host).
DECODE_TENSOR, DECODE_PLANE, DECODE_RANS_PLANE, DECODE_RANS_BLOCK, DECODE_LEAF = (
    512, 128, 1536, 64, 16)
DECODE_SEGMENT_OPS = 128  # a codec-9 segment's copy or unpack op rows, and its realignment's


def device_extra(reader: Reader, i: int) -> int:
    """Device bytes that decoding tensor i on the GPU holds besides its output: its staged
    payloads, the decoded planes that wait for the merge (rANS and GDeflate planes of a
    split layout; nvCOMP's output for a codec-6 plane) and the decoder's tables and flags
    (``DECODE_*``). Known from the index alone, so the loader sizes its batches by what they
    really hold. A delta's chain is decoded one level at a time (:func:`_apply_parents`):
    at most two of its tensors' bytes and one level's decoding at once, whatever the depth."""
    extra = _own_extra(reader, i)
    t = reader.tensors[i]
    if not (t.is_delta and reader.parent is not None):
        return extra
    j = parent_index(reader, i)
    if j is None:
        return extra
    # below the delta, from its parent down: the level's bytes and its own decoding, and the
    # bytes of the level below it (full by then) that are XORed into them
    below, level, k, n = 0, reader.parent, j, t.raw_nbytes
    while True:
        pt = level.tensors[k]
        deeper = (parent_index(level, k) if pt.is_delta and level.parent is not None
                  and batched(level, k) else None)
        below = max(below, n + _own_extra(level, k) + (n if deeper is not None else 0))
        if deeper is None:
            return max(extra, below)
        level, k = level.parent, deeper


def _own_extra(reader: Reader, i: int) -> int:
    """:func:`device_extra` of tensor i's own planes (a delta's XOR bytes, its chain aside)."""
    t = reader.tensors[i]
    pad = max(SLOT_ALIGN, reader.alignment)  # staging keeps the file's padding between planes
    extra = sum(p.stored_len + pad for p in t.planes)
    extra += DECODE_TENSOR + DECODE_LEAF * -(-t.raw_nbytes // LEAF_SIZE)
    whole = t.layout.layout_id == layouts.RAW.layout_id
    for p in t.planes:
        extra += DECODE_PLANE + DECODE_LEAF * -(-p.stored_len // LEAF_SIZE)
        if p.codec == codecs.RANS_SEG:
            extra += _segments_extra(p.decoded_len, p.stored_len, whole)
        if p.codec == codecs.RANS:
            extra += DECODE_RANS_PLANE + DECODE_RANS_BLOCK * -(  # (the blocks ours are cut in)
                -p.decoded_len >> rans.plane_log2_block(p.decoded_len))
        if (p.codec in (codecs.RANS, codecs.GDEFLATE) and not whole) \
                or p.codec == codecs.NVCOMP_ANS:
            extra += runtime.align(p.decoded_len, SLOT_ALIGN)
    return extra


def _segments_extra(decoded_len: int, stored_len: int, whole: bool) -> int:
    """Device bytes a codec-9 plane's decode holds besides its staged bytes, from the index
    alone (its segments are not known there): the decoded plane awaiting the merge (not for a
    raw-layout tensor, decoded in place), its rANS segments moved to aligned places (at most
    its stored bytes), and at most a segment per 65,536 symbols, each with a rANS table, a
    block of its own and its copy or unpack op's rows."""
    segs = -(-decoded_len // ransseg.SEGMENT_UNIT)
    blocks = segs + (decoded_len >> rans.LOG2_BLOCK_DEFAULT)
    return (0 if whole else runtime.align(decoded_len, SLOT_ALIGN)) \
        + runtime.align(stored_len + SLOT_ALIGN * segs, SLOT_ALIGN) \
        + segs * (DECODE_RANS_PLANE + DECODE_SEGMENT_OPS) + blocks * DECODE_RANS_BLOCK


def parent_index(reader: Reader, i: int) -> int | None:
    """Index in ``reader.parent`` of delta i's parent tensor (its content hash and byte
    length), or None when the parent holds no such tensor."""
    parent = reader.parent
    by_hash = _BY_HASH.get(parent)
    if by_hash is None:
        by_hash = _BY_HASH[parent] = {pt.content_hash: j for j, pt in enumerate(parent.tensors)}
    t = reader.tensors[i]
    j = by_hash.get(t.parent_hash)
    return j if j is not None and parent.tensors[j].raw_nbytes == t.raw_nbytes else None


_CAPS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # reader -> device -> cap


def limit(reader: Reader) -> int:
    """Rule R0's limit for ``reader`` on the current device, asked of torch once per device:
    a load checks it for every tensor several times, and each ask costs microseconds."""
    dev = torch.cuda.current_device()
    caps = _CAPS.setdefault(reader, {})
    cap = caps.get(dev)
    if cap is None:
        cap = caps[dev] = min(reader.max_tensor_bytes,
                              torch.cuda.get_device_properties(dev).total_memory)
    return cap


def over_limit(reader: Reader, i: int, cap: int | None = None) -> bool:
    """Whether tensor i fails rule R0 on the GPU path (:func:`check_limit`); ``cap``: the
    limit, where the caller asked :func:`limit` once for several tensors."""
    return reader.tensors[i].raw_nbytes > (limit(reader) if cap is None else cap)


def check_limit(reader: Reader, i: int) -> None:
    """Rule R0 on the GPU path: refuse, before allocating anything, a tensor larger than the
    reader's ``max_tensor_bytes`` or than the current device's memory (codec 6 has no expansion
    bound of its own; every codec may expand a small file enormously)."""
    t = reader.tensors[i]
    if over_limit(reader, i):
        raise LimitError(f"{reader.name}: tensor {t.name!r} declares {t.raw_nbytes} raw bytes, "
                         f"more than {limit(reader)} (the reader's max_tensor_bytes or the "
                         "device's memory)")


def _check_limits(reader: Reader, idx: list[int]) -> None:
    """Rule R0 for a batch before anything is allocated, failing as the CPU reader would
    reading ``idx`` in order: when a tensor is over the limit, the CPU reader first reads the
    tensors before it (on this error path only), and the first failure among them wins."""
    cap = limit(reader)
    for k, i in enumerate(idx):
        if not over_limit(reader, i, cap):
            continue
        for j in idx[:k]:
            try:
                reader.read_raw(j)
            except S4Error as first:
                raise about(first, reader, j) from None
        try:
            check_limit(reader, i)
        except LimitError as exc:
            raise about(exc, reader, i) from None


def read_tensor(reader: Reader, i: int, out: torch.Tensor | None = None) -> torch.Tensor:
    """Tensor i's raw bytes as a flat uint8 CUDA tensor (``out`` if given: written in place)."""
    return read_tensors(reader, [i], None if out is None else [out])[0]


def read_tensors(reader: Reader, idx: list[int],
                 outs: list[torch.Tensor] | None = None, ahead: staging.Ahead | None = None,
                 staged: Callable[[staging.Ahead], None] | None = None) -> list[torch.Tensor]:
    """Raw bytes of tensors ``idx`` as flat uint8 CUDA tensors, decoded as one batch. Delta
    tensors are decoded to their XOR bytes, XORed on the device with their parent's bytes
    (read the same way from ``reader.parent``), and their content hash is checked after.
    ``ahead``: reads started before (by an earlier call's ``staged``), used where they are
    this batch's; ``staged(ahead)`` is called once this batch's planes are read, to start
    reading a later batch's while this one decodes."""
    _check_limits(reader, idx)
    if outs is None:  # (the caching allocator's blocks are aligned)
        return _read_aligned(reader, idx, [runtime.device_bytes(reader.tensors[i].raw_nbytes)
                                           for i in idx], ahead, staged)
    for i, out in zip(idx, outs):
        t = reader.tensors[i]
        if out.numel() != t.raw_nbytes or out.dtype != torch.uint8 or not out.is_contiguous():
            raise ValueError(f"destination for {t.name!r} must be {t.raw_nbytes} contiguous bytes")
    # The merge kernels store whole words: a destination that is not 16-byte aligned is decoded
    # into a fresh buffer and copied (a misaligned word store would fault the device).
    given, outs = outs, [o if o.data_ptr() % DEST_ALIGN == 0 or not o.numel()
                         else runtime.device_bytes(o.numel()) for o in outs]
    outs = _read_aligned(reader, idx, outs, ahead, staged)
    for g, o in zip(given, outs):
        if g is not o:
            g.copy_(o)
    return given


def read_on_cpu(reader: Reader, i: int, out: torch.Tensor, own: bool = False) -> None:
    """Tensor i decoded by the CPU reader (parents applied there) and copied into ``out``;
    with ``own``, its own level alone (:func:`host_level`)."""
    try:
        raw = reader.read_own(i) if own else reader.read_raw(i)
    except S4Error as exc:
        raise about(exc, reader, i) from None
    if raw.size:
        out.copy_(torch.from_numpy(raw))


def _read_aligned(reader: Reader, idx: list[int], outs: list[torch.Tensor],
                  ahead: staging.Ahead | None = None,
                  staged: Callable[[staging.Ahead], None] | None = None) -> list[torch.Tensor]:
    """:func:`_read_batch`, failing as the CPU reader would, reading ``idx`` in order and each
    tensor's planes in order. The batch finds some failures before decoding anything
    (checksums, stream headers and tables, forms) and others after (a corrupt bitstream, a
    content hash), so on failure the CPU reader reads the tensors up to the one the failure is
    about (only on this error path): the first failure it meets is raised, or the batch's own
    when it names the same tensor and plane."""
    try:
        return _read_batch(reader, idx, outs, ahead, staged)
    except S4Error as exc:
        at = getattr(exc, "s4_tensor", None)
        if at is None or at[0] is not reader or at[1] not in idx:
            raise
        for i in idx[:idx.index(at[1])]:
            try:
                reader.read_raw(i)
            except S4Error as first:
                raise about(first, reader, i) from None
        raise_as_cpu(reader, at[1], exc)
        raise


def _read_batch(reader: Reader, idx: list[int], outs: list[torch.Tensor],
                ahead: staging.Ahead | None = None,
                staged: Callable[[staging.Ahead], None] | None = None) -> list[torch.Tensor]:
    """:func:`read_tensors` into checked, 16-byte aligned destinations. Once the batch's own
    planes are read, those of its deltas' parents, every level, are read ahead while it
    decodes, then what ``staged`` starts."""
    levels = staging.Ahead()

    def then() -> None:
        _read_levels_ahead(reader, idx, levels)
        if staged is not None:
            staged(ahead or levels)
    try:
        deltas = _decode_batch(reader, idx, outs, ahead, then)
        if deltas:  # (the batch's staged planes are freed by now)
            _apply_parents(reader, [idx[k] for k in deltas], [outs[k] for k in deltas], levels)
    finally:
        levels.drop()
    return outs


def _decode_batch(reader: Reader, idx: list[int], outs: list[torch.Tensor],
                  ahead: staging.Ahead | None = None,
                  staged: Callable[[], None] | None = None) -> list[int]:
    """Tensors ``idx`` decoded into ``outs``: on the GPU where it decodes them, else by the
    CPU reader and copied up (a delta's own level alone where its parent is attached,
    :func:`host_level`). Returns the positions of the deltas whose XOR bytes were decoded
    (unchecked); every other tensor's bytes are its own, checked. ``staged()`` is called
    once the GPU's planes are read (or at once, without them)."""
    gpu = [k for k, i in enumerate(idx) if decodable(reader, i)]
    on_gpu = set(gpu)
    levels = [k for k, i in enumerate(idx) if k not in on_gpu and host_level(reader, i)]
    own = set(levels)
    if not gpu and staged is not None:  # (the parents' planes are read while the CPU decodes)
        staged()
        staged = None
    # The tensors the CPU decodes: the larger ones on the pool's threads side by side while
    # the GPU's planes are read and decoded (a CPU-written delta's levels are most of its
    # tensors); the small ones at once on this thread. (A CPU-written base holds 84 small
    # ones the GPU does not decode, of 147: as tasks, it loaded in 1.5 x the time.)
    large = []
    for k, i in enumerate(idx):
        if k in on_gpu:
            continue
        if reader.tensors[i].raw_nbytes < threads.SHARE_MIN:
            read_on_cpu(reader, i, outs[k], k in own)
        else:
            large.append(k)
    host = _OnHost(reader, idx, outs, own, large)
    try:
        host.start()
        st = stage(reader, [idx[k] for k in gpu], ahead) if gpu else None
        if staged is not None:
            staged()
        if st is not None:
            heavy = _tables_too_large(st)
            if heavy:  # decoded by the CPU decoder (parents applied there), copied up
                for h in sorted(heavy):
                    read_on_cpu(reader, idx[gpu[h]], outs[gpu[h]])
                st = _subset(st, [h for h in range(len(gpu)) if h not in heavy])
                gpu = [k for h, k in enumerate(gpu) if h not in heavy]
            decode_staged(st, [outs[k] for k in gpu])
        host.finish()
    except BaseException:
        host.settle()  # (no task left reading a file the caller may close)
        raise
    return sorted(levels + [k for k in gpu if reader.tensors[idx[k]].is_delta])


class _OnHost:
    """Tensors ``idx[k]`` for ``k`` in ``large`` decoded by the CPU reader (their own levels
    for ``k`` in ``own``) and copied into ``outs[k]``, as tasks of the pool, in order, at most
    :data:`s4format.writer.AHEAD` raw bytes of them at once (and at least one), as a CPU load
    decodes ahead. Each copy goes on the stream that was current on the calling thread, which
    the caller's work on the destinations is ordered by."""

    def __init__(self, reader: Reader, idx: list[int], outs: list[torch.Tensor], own: set[int],
                 large: list[int]) -> None:
        self.reader, self.idx, self.outs, self.own = reader, idx, outs, own
        self.todo = collections.deque(large)
        self.pool = threads.pool()
        self.tasks: collections.deque[tuple[threads.Task, int]] = collections.deque()
        self.held = 0
        self.streams = {outs[k].device: torch.cuda.current_stream(outs[k].device)
                        for k in large if outs[k].is_cuda}

    def _one(self, k: int) -> None:
        out = self.outs[k]
        stream = self.streams.get(out.device)
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            read_on_cpu(self.reader, self.idx[k], out, k in self.own)

    def start(self) -> None:
        """Submit tasks while they stay within the bytes allowed."""
        while self.todo:
            n = self.reader.tensors[self.idx[self.todo[0]]].raw_nbytes
            if self.tasks and self.held + n > AHEAD:
                return
            k = self.todo.popleft()
            self.tasks.append((self.pool.submit(self._one, k), n))
            self.held += n

    def finish(self) -> None:
        """Wait for every task in order, submitting the rest as room frees; the first failure
        in order is raised."""
        self.start()
        while self.tasks:
            task, n = self.tasks[0]
            self.pool.wait([task])
            self.tasks.popleft()
            self.held -= n
            self.start()

    def settle(self) -> None:
        """Wait for the tasks submitted, their results and failures dropped; submit no more."""
        self.todo.clear()
        with contextlib.suppress(BaseException):
            self.pool.wait([task for task, _n in self.tasks])
        self.tasks.clear()


def _levels(reader: Reader, idx: list[int]) -> list[tuple[Reader, dict[int, int]]]:
    """The chains of deltas ``idx`` of ``reader``: per level below it, the level's reader and
    {position in ``idx``: tensor index there}, from the nearest parent down; a level's
    deltas read as XOR bytes (:func:`batched`) go on to the next. ParentMismatchError
    where a parent holds no tensor for a delta."""
    levels: list[tuple[Reader, dict[int, int]]] = []
    r, cur = reader, dict(enumerate(idx))
    while cur:
        p, at = r.parent, {}
        for k, i in cur.items():
            j = parent_index(r, i)
            if j is None:
                raise about(ParentMismatchError(
                    f"{r.name}: parent {p.name} holds no tensor with hash "
                    f"{r.tensors[i].parent_hash.hex()} of {r.tensors[i].raw_nbytes} bytes "
                    f"for delta {r.tensors[i].name!r}"), reader, idx[k])
            at[k] = j
        levels.append((p, at))
        cur = {k: j for k, j in at.items()
               if p.tensors[j].is_delta and p.parent is not None and batched(p, j)}
        r = p
    return levels


def _read_levels_ahead(reader: Reader, idx: list[int], ahead: staging.Ahead) -> None:
    """Start reading the planes of every parent level that the deltas of ``idx`` read as
    XOR bytes will stage (:func:`_apply_parents`), in its order: the deepest level first."""
    deltas = [i for i in idx if reader.tensors[i].is_delta and batched(reader, i)]
    if not deltas or reader.parent is None:
        return
    try:
        levels = _levels(reader, deltas)
    except S4Error:  # (raised in order when the parents are applied)
        return
    for p, at in reversed(levels):
        ahead.start(p, [j for j in sorted(set(at.values())) if decodable(p, j)])


def _tables_too_large(st: Staged) -> set[int]:
    """Positions in ``st.idx`` whose rANS streams declare more blocks than the batch builds
    tables for (``ransparse.tables_fit`` over the batch's stored bytes, tensors in order): a
    CONST stream stores one byte per block, so without this a small hostile file could make
    the decoder allocate ~160 bytes per stored byte on the host and the device."""
    pos, _j, codec, n, sizes, _np = st.meta.T
    rows = np.flatnonzero(codec == codecs.RANS)
    sg = segdecode.of(st)  # (codec-9 planes' rANS segments count too)
    seg = sg.rows(codecs.RANS)
    if not rows.size and not seg.size:
        return set()
    nb = ransparse.stream_blocks(st.host, np.concatenate([st.at[rows], sg.at[seg]]),
                                 np.concatenate([sizes[rows], sg.stored[seg]]),
                                 np.concatenate([n[rows], sg.n[seg]]))
    blocks = np.zeros(len(st.idx), np.int64)
    np.add.at(blocks, np.concatenate([pos[rows], pos[sg.q[seg]]]), nb)
    stored = int(sizes.sum())
    heavy, used = set(), 0
    for k in range(len(st.idx)):
        if ransparse.tables_fit(used + int(blocks[k]), stored):
            used += int(blocks[k])
        else:
            heavy.add(k)
    return heavy


def _subset(st: Staged, keep: list[int]) -> Staged:
    """``st`` restricted to positions ``keep`` (same staged buffers)."""
    pos = {k: n for n, k in enumerate(keep)}
    sel = [q for q, (k, _j, _p) in enumerate(st.planes) if k in pos]
    return Staged(st.reader, [st.idx[k] for k in keep],
                  [(pos[st.planes[q][0]], st.planes[q][1], st.planes[q][2]) for q in sel],
                  st.at[sel], st.host, st.device, st.keep)


def _apply_parents(reader: Reader, idx: list[int], outs: list[torch.Tensor],
                   ahead: staging.Ahead | None = None) -> None:
    """Each delta's decoded XOR bytes in ``outs`` made whole with its parent's bytes, then its
    content hash checked: always, as the CPU reader does, since it is the only proof the parent
    was right. The chains are decoded one level at a time from the deepest up, each level as
    one batch, so the device holds two levels' bytes whatever the depth. A chain ends at a
    tensor stored whole (or an empty one, which the CPU reader reads with its parents).
    ``ahead``: the levels' planes where they were read ahead."""
    levels = _levels(reader, idx)
    below: dict[int, torch.Tensor] = {}  # the level below's whole bytes, by position
    for p, at in reversed(levels):
        uniq = sorted(set(at.values()))
        try:
            _check_limits(p, uniq)
            got = [runtime.device_bytes(p.tensors[j].raw_nbytes)
                   for j in uniq]
            xored = {uniq[h] for h in _decode_batch(p, uniq, got, ahead)}
            mine = dict(zip(uniq, got))
            del got
            done, pairs = set(), []
            for k, j in at.items():  # a level's delta made whole with the level below
                if j in xored and j not in done:
                    pairs.append((mine[j], below[k]))
                done.add(j)
            runtime.xor_into(pairs)
            del pairs  # (it holds the level below, which must go when ``below`` moves up)
            _check_hashes(p, sorted(xored), [mine[j] for j in sorted(xored)])
        except S4Error as exc:  # about the first delta (in order) whose chain failed
            a = getattr(exc, "s4_tensor", None)
            if a is None or a[0] is not p or a[1] not in uniq:
                raise
            first = min(k for k, j in at.items() if j == a[1])
            # The CPU reader reads a chain from the top down and may fail higher up first;
            # files opened from buffers share one name, so the plane named cannot tell the
            # levels apart: its failure, read on this error path only
            try:
                reader.read_raw(idx[first])
            except S4Error as cpu:
                raise about(cpu, reader, idx[first]) from None
            raise about(exc, reader, idx[first]) from None
        below = {k: mine[j] for k, j in at.items()}
        del mine
    runtime.xor_into([(o, below[k]) for k, o in enumerate(outs)])
    del below
    _check_hashes(reader, idx, outs)


def _check_hashes(reader: Reader, idx: list[int], outs: list[torch.Tensor]) -> None:
    """Raise the content hash mismatch of the first of ``reader``'s deltas ``idx`` (made whole
    in ``outs``) whose bytes miss it."""
    if not idx:
        return
    hashes = runtime.content_hashes_now([o.data_ptr() for o in outs], [o.numel() for o in outs])
    for k, got in enumerate(hashes):
        t = reader.tensors[idx[k]]
        if got != t.content_hash:
            raise about(ContentHashError(
                f"{reader.name}: tensor {t.name!r} content hash mismatch after decoding: the "
                "file is corrupt or its parent is wrong"), reader, idx[k])


def stage(reader: Reader, idx: list[int], ahead: staging.Ahead | None = None) -> Staged:
    """Every plane of tensors ``idx`` staged for the device (``staging.stage_planes``, with
    the reads ``ahead`` started for them); the GPU must decode each of them."""
    for i in idx:
        if not decodable(reader, i):
            raise ValueError(f"tensor {reader.tensors[i].name!r} is not decoded on the GPU")
    return staging.stage_planes(reader, idx, ahead)




