"""CUDA path of s4weights: tensors on the GPU are split into planes, coded and hashed on the
device, and decoded and merged back there (``spec/planes.md``, ``spec/rans.md``,
``spec/gdeflate.md``). Files are the same format the CPU path writes and reads; rANS, bitpack
and raw plane bytes are identical to what the CPU coder produces for the same codec choice.

Kernels live in ``kernels/*.cu`` and are compiled at first use with NVRTC through CuPy; they run
on torch's current stream with memory from torch's caching allocator. Importing this package
never needs CUDA: :func:`available` says whether the path can run.
"""

from __future__ import annotations

import logging

from s4weights.gpu.device import DEVICES, available, error_text, out_of_memory_errors, use_gpu

__all__ = ["DEVICES", "available", "coded_in_order", "error_text", "loader_for",
           "nvcomp_ans_available", "out_of_memory_errors", "register_codecs", "use_gpu"]

log = logging.getLogger("s4weights")

# When the device runs out of memory, the GPU path starts again at the tensor it was at with
# half the workspace, down to this (plan.MIN_WORKSPACE, the smallest default); below it the CPU
# codes (or decodes) the rest.
FALLBACK_MIN_WORKSPACE = 4 << 20
# A load whose attempt needing at most this much failed takes the device as full: the CPU
# decodes that device's later tensors without trying it.
FULL_BELOW = 32 << 20


def nvcomp_ans_available() -> bool:
    """Whether codec 6 (nvcomp-ans) can be written and read here."""
    if not available():
        return False
    from s4weights.gpu import nvans

    return nvans.available()


def register_codecs(device: str = "auto") -> None:
    """Make the GPU-only codec (6, nvcomp-ans) readable where it can run, before a file is
    opened: ``s4format``'s reader refuses codecs it has not registered."""
    if device != "cpu" and available():
        from s4weights.gpu import nvans

        nvans.register()


def coded_in_order(tensors: list, policy: str, device: str,
                   parents: dict | None = None, workspace: int | None = None,
                   parent_hashes: dict | None = None) -> dict:
    """The save hook: name -> iterator for every CUDA tensor the GPU codes; ``next()`` on it, in
    flat order, gives ``(CodedTensor, content_hash, parent_hash, full_stored)`` to pass to
    ``Writer.add_coded``, or None: the device ran out of memory even with a small workspace
    (under ``nvcomp-ans``, at all), and the caller codes that tensor on the CPU
    (``_with_fallback``). ``parents`` maps a name to its delta parent (same dtype and byte
    length): the parent is XORed on the tensor's device and both codings are made, the delta
    kept only where it stores strictly less (the writer's rule). A parent on that device (a
    :class:`DeviceTensor`) is read in place; one in host memory (an ``s4format.Tensor``, best
    in pinned memory) is copied into the XOR's device buffer, and its content hash must be in
    ``parent_hashes`` (by name; else the tensor is left to the CPU writer, which hashes it).
    ``workspace`` bounds the extra device memory (default ``plan.default_workspace`` of the
    bytes coded here): XOR buffers take at most half of it when there are parents, the coder
    the rest."""
    from s4weights.torchtree import DeviceTensor

    parents = parents or {}
    parent_hashes = parent_hashes or {}
    chosen = []
    for name, t in tensors:
        if not isinstance(t, DeviceTensor):
            continue
        p = parents.get(name)
        if isinstance(p, DeviceTensor):
            if p.device_bytes.device != t.device_bytes.device:
                continue
            p = (p.device_bytes, None)
        elif p is not None:
            if name not in parent_hashes:
                continue
            p = (_torch_bytes(p), parent_hashes[name])
        chosen.append((name, t, p))
    if not use_gpu(device, bool(chosen)):
        return {}
    # Each CUDA device's tensors are coded on that device (its kernels, buffers and streams),
    # whatever the current device: kernels launched elsewhere would read another device's
    # memory (a fault, or bytes unordered with that device's stream). ``workspace`` is per
    # device.
    by_device: dict = {}
    for c in chosen:
        by_device.setdefault(c[1].device_bytes.device, []).append(c)
    out = {}
    for dev, run in by_device.items():
        stream = _OnDevice(dev, _with_fallback(run, policy, workspace))
        out.update((name, stream) for name, _t, _p in run)
    return out


class _OnDevice:
    """An iterator whose every step runs with ``device`` current: the coding generator only
    runs inside ``next()``, so all its work happens on that device, and the caller's current
    device is back as it was between steps."""

    def __init__(self, device, it) -> None:
        self.device, self.it = device, it

    def __iter__(self):
        return self

    def __next__(self):
        import torch

        with torch.cuda.device(self.device):
            return next(self.it)


def _with_fallback(chosen: list, policy: str, workspace: int | None):
    """:func:`_coded_stream` over ``chosen``, surviving a device out of memory (a training run
    may leave little free): it starts again at the tensor it was coding with half the
    workspace, down to ``FALLBACK_MIN_WORKSPACE``; past that (and under ``nvcomp-ans``, which
    takes whole tensors) it yields None for that tensor and every later one, for the caller
    to code on the CPU. The tensors it has yielded are not coded again."""
    from s4weights.gpu import plan

    ws = workspace or plan.default_workspace(sum(t.nbytes for _n, t, _p in chosen))
    done = 0
    while done < len(chosen):
        try:
            for out in _coded_stream(chosen[done:], policy, ws):
                yield out
                done += 1
            return
        except out_of_memory_errors() as exc:
            name, t = chosen[done][0], chosen[done][1]
            what = f"{t.device_bytes.device} ran out of memory coding {name!r} with a " \
                   f"workspace of {ws >> 20} MiB ({error_text(exc)})"
            if policy == "nvcomp-ans" or ws // 2 < FALLBACK_MIN_WORKSPACE:
                log.warning("%s: the CPU codes it and the %d tensors after it on that device",
                            what, len(chosen) - done - 1)
                break
            ws //= 2
            log.warning("%s: coding again from that tensor with %d MiB", what, ws >> 20)
    for _ in range(done, len(chosen)):
        yield None


def _torch_bytes(t):
    """A host ``s4format.Tensor``'s bytes as a flat uint8 torch tensor (no copy)."""
    import numpy as np
    import torch

    return torch.from_numpy(np.ascontiguousarray(t.data).reshape(-1).view(np.uint8))


def _coded_stream(chosen: list, policy: str, workspace: int | None):
    """Code ``(name, DeviceTensor, parent)`` in order, the parent None or (its flat uint8 bytes
    on the tensor's device or in host memory, its content hash or None: hashed here). XOR
    buffers are made per chunk of at most half the workspace so they never hold a second copy
    of a large state at once; a tensor larger than that is XORed chunk by chunk inside the
    chunked coder (under ``nvcomp-ans``, whose codec takes whole tensors, it is XORed whole)."""
    from s4weights.gpu import plan, runtime
    from s4weights.gpu.encode import Encoder, Item

    ws = workspace or plan.default_workspace(sum(t.nbytes for _n, t, _p in chosen))
    has_parents = any(p is not None for _n, _t, p in chosen)
    budget = ws // 2
    if policy == "nvcomp-ans":
        from s4weights.gpu import nvans

        enc = nvans.Encoder()
    else:
        enc = Encoder(policy, workspace=ws - budget if has_parents else ws)
    i = 0
    while i < len(chosen):
        chunk, used = [], 0
        # the split encoder XORs a tensor larger than the budget chunk by chunk itself;
        # nvCOMP's codes whole tensors, so their XOR is made here
        chunked = policy != "nvcomp-ans"
        while i < len(chosen) and (not chunk or chosen[i][2] is None
                                   or (chunked and chosen[i][1].nbytes > budget)
                                   or used + chosen[i][1].nbytes <= budget):
            chunk.append(chosen[i])
            t, p = chosen[i][1], chosen[i][2]
            used += t.nbytes if p is not None and not (chunked and t.nbytes > budget) else 0
            i += 1
        # the content hashes of the parents on the device (before any XOR is queued)
        on_device = [p[0] for _n, _t, p in chunk if p is not None and p[1] is None]
        hashed = iter(runtime.content_hashes_now([b.data_ptr() for b in on_device],
                                                 [b.numel() for b in on_device])
                      if on_device else ())
        phashes = [None if p is None else p[1] or next(hashed) for _n, _t, p in chunk]
        items: list = []
        for _name, t, p in chunk:
            items.append(Item(t.dtype, t.shape, t.device_bytes))
            if p is not None and chunked and t.nbytes > budget:
                # XORed chunk by chunk by the chunked coder, never held whole
                items.append(Item(t.dtype, t.shape, t.device_bytes, parent=p[0]))
            elif p is not None:
                items.append(Item(t.dtype, t.shape, runtime.xor(t.device_bytes, p[0])))
        results = enc.code(items)
        for (_name, _t, p), phash in zip(chunk, phashes):
            alone = next(results)
            if p is None:
                yield alone.coded, alone.content_hash, None, None
                continue
            delta = next(results)
            full = alone.coded.stored
            if delta.coded.stored < full:
                yield delta.coded, alone.content_hash, phash, full
            else:
                yield alone.coded, alone.content_hash, None, full
        del items


def loader_for(reader, device: str, update=None, direct: dict | None = None,
               workspace: int | None = None, count_outputs: bool = False, on_decoded=None):
    """The load hook: ``f(i, cuda_device)`` decoding stored tensor i on that device as a typed,
    shaped torch tensor, or None when the GPU path is off. ``direct`` maps a stored tensor index
    to caller-owned flat uint8 CUDA bytes (``load(into=...)``) that tensor is decoded straight
    into when its device is the one asked for.

    Decoding is batched: the first request for a GPU-decodable tensor decodes it together with
    the following GPU-decodable tensors (up to a workspace of raw bytes) on the same device, and
    later requests take theirs from that batch. Tensors are requested in stored order, so each
    batch is used up before the next; one never requested stays held until the loader goes.

    Extra device memory per batch is its staged payloads, the decoded planes that wait for
    the merge and the decoder's tables (``decode.device_extra``, known from the index: block
    tables at the writers' block size): a batch holds at most
    ``workspace`` of it (default ``plan.default_workspace`` of the file's raw bytes). A tensor
    that alone needs more is decoded in chunks that fit (``decode_large.load_large``) where its
    codecs allow (raw, bitpack, bitpack-w, rANS; else whole, as one batch of its own). When
    the device runs out of memory, the tensor is decoded again with a halved workspace (and so
    are the batches after it, on that device), down to ``FALLBACK_MIN_WORKSPACE``, where that
    can help; else the CPU decodes it and it is copied in (and every later tensor on that
    device, once an attempt that needed at most ``FULL_BELOW`` failed). The
    returned tensors themselves need their memory, as with ``torch.load``, and nvcomp-ans
    planes decode only on the GPU (their codec's "CPU" decode runs there too), so their
    fallback may run out of memory as well. ``count_outputs``: a batch's decoded tensors count
    against the workspace too (for a caller that copies each away as it comes), so the device
    holds at most the workspace. ``on_decoded(i, raw)``: called with each stored tensor's flat
    uint8 bytes on the device as soon as they are decoded (and checked), before anything else
    is queued that could write them (a batch's tensors all at once, requested or not)."""
    if not use_gpu(device, True):
        return None
    ready: dict[tuple[int, str], object] = {}
    direct = direct or {}
    sizes = [t.raw_nbytes for t in reader.tensors]
    from s4weights.gpu import plan

    budget = workspace or plan.default_workspace(sum(sizes))
    extra: dict[int, int] = {}

    def extra_of(j: int) -> int:
        from s4weights.gpu.decode import device_extra

        if j not in extra:
            extra[j] = device_extra(reader, j) + (sizes[j] if count_outputs else 0)
        return extra[j]

    # per device: its workspace, halved each time the device ran out of memory; 0 once it
    # reached the smallest: the CPU decodes that device's tensors from then on
    budgets: dict[str, int] = {}
    tried = {"chunks": False, "size": 0, "need": 0}  # the last attempt: in chunks, or a batch
    # of ``size`` tensors needing ``need`` bytes of workspace

    def load(i: int, dev):
        import torch

        from s4weights.gpu.decode import decodable, read_on_cpu
        from s4weights.gpu.decode_large import chunkable

        t = reader.tensors[i]
        dev = torch.device(dev)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        raw = ready.pop((i, key), None)
        while raw is None:
            ws = budgets.get(key, budget)
            if ws:
                try:
                    raw = _decoded(i, dev, ws)
                    continue
                except out_of_memory_errors() as exc:
                    what = f"{dev} ran out of memory decoding {t.name!r} with a workspace " \
                           f"of {ws >> 20} MiB ({error_text(exc)})"
                # Out of device memory (a training run may leave little free), and out of the
                # handler, so the failed attempt's buffers are free again. A smaller workspace
                # helps a tensor decoded in chunks (smaller chunks), or one in a batch with
                # others or that chunks can decode (a smaller batch, or chunks): halved until
                # the next attempt differs, down to the smallest, for the later batches on
                # that device too. Else the CPU decodes it and it is copied in; and if the
                # attempt asked for no more than ``FULL_BELOW``, the device is taken as full:
                # the CPU decodes its later tensors too, without trying it.
                smaller = ws // 2
                if not tried["chunks"]:
                    while FALLBACK_MIN_WORKSPACE <= smaller >= tried["need"]:
                        smaller //= 2  # (the same batch again otherwise)
                helps = tried["chunks"] or tried["size"] > 1 or (
                    decodable(reader, i) and chunkable(reader, i))
                if helps and smaller >= FALLBACK_MIN_WORKSPACE:
                    budgets[key] = smaller
                    log.warning("%s: decoding again with %d MiB", what, smaller >> 20)
                    continue
                if (ws if tried["chunks"] else tried["need"]) <= FULL_BELOW:
                    budgets[key] = 0
                log.warning("%s: the CPU decodes it%s", what, "" if budgets.get(key, budget)
                            else " and the later tensors on that device")
            with torch.cuda.device(dev):
                raw = _dest(i, dev)
                read_on_cpu(reader, i, raw)
                if on_decoded is not None:
                    on_decoded(i, raw)
        if update is not None:
            update(t.raw_nbytes)
        return raw.view(getattr(torch, t.dtype.name)).reshape(t.shape)

    def _decoded(i: int, dev, ws: int):
        """Tensor i's raw bytes decoded on ``dev`` within workspace ``ws``: in chunks when it
        alone needs more, else in a batch with the following tensors (theirs kept in
        ``ready``)."""
        import torch

        from s4weights.gpu.decode import decodable, over_limit, read_on_cpu, read_tensors
        from s4weights.gpu.decode_large import chunkable, load_large

        if decodable(reader, i) and extra_of(i) > ws and chunkable(reader, i):
            # too large to decode whole within the workspace: in chunks, straight into place
            from s4weights.gpu.ransparse import TablesTooLarge

            tried.update(chunks=True, size=1, need=0)
            with torch.cuda.device(dev):
                raw = _dest(i, dev)
                try:
                    load_large(reader, i, raw, ws)
                except TablesTooLarge:  # streams of tiny blocks: the CPU decodes it
                    read_on_cpu(reader, i, raw)
                if on_decoded is not None:
                    on_decoded(i, raw)
            return raw
        idx, used = [i], 0
        with torch.cuda.device(dev):  # (the size limit counts that device's memory)
            if decodable(reader, i):
                used = extra_of(i)
                for j in range(i + 1, len(sizes)):
                    if (j, str(dev)) in ready or not decodable(reader, j):
                        continue
                    # a tensor over the size limit (R0) starts a batch of its own, so that
                    # the tensors before it are read first, as the CPU reader reads them
                    if used + extra_of(j) > ws or over_limit(reader, j):
                        break
                    idx.append(j)
                    used += extra_of(j)
            tried.update(chunks=False, size=len(idx), need=used)
            outs = read_tensors(reader, idx, [_dest(j, dev) for j in idx] if direct
                                else None)
            if on_decoded is not None:
                for j, o in zip(idx, outs):
                    on_decoded(j, o)
        for j, o in zip(idx[1:], outs[1:]):
            ready[(j, str(dev))] = o
        return outs[0]

    def _dest(j: int, dev):
        from s4weights.gpu import runtime
        from s4weights.gpu.decode import DEST_ALIGN, check_limit

        d = direct.get(j)
        # the merge kernels store whole words (and 16-byte vectors where aligned): a view at an
        # odd offset (into= a slice of a larger buffer) would fault the device, so it gets a
        # fresh buffer and a copy like any other destination
        if d is not None and d.device == dev and d.data_ptr() % DEST_ALIGN == 0:
            return d
        check_limit(reader, j)  # rule R0 before allocating (read_tensors checks too, later)
        n = sizes[j]
        return runtime.device_empty(n)[:n]

    return load
