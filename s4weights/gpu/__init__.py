"""CUDA path of s4weights: tensors on the GPU are coded and decoded there, into files the CPU
path reads and writes byte for byte (``spec/``). This module holds the hooks the torch layer
calls, with their out-of-memory fallbacks.

Save: :func:`coded_in_order` gives a state's CUDA tensors to ``encode.Encoder``, which plans
windows and groups (``plan``), histograms each window (``histograms``), ranks the codecs
(``choose``), codes each group (``encode_group``: the split, ``ransencode``, ``assemble``) and a
tensor larger than the workspace in chunks (``encode_large``).

Load: :func:`loader_for` decodes batches with ``decode``: ``staging`` reads their planes,
``decode_group`` checks, decodes (``ransparse``, ``ransdecode``) and merges them, ``failures``
orders what went wrong; a tensor larger than the workspace goes to ``decode_large``.

Kernels are ``kernels/*.cu``, compiled and launched by ``runtime`` on torch's current stream;
``gdeflate`` and ``nvans`` reach nvCOMP. Importing this package never needs CUDA (``device``).
"""

from __future__ import annotations

import bisect
import logging
import weakref

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
    """The save hook: name -> iterator for every CUDA tensor the GPU codes. ``next()`` on it,
    in flat order, gives ``(CodedTensor, content_hash, parent_hash, full_stored)`` for
    ``Writer.add_coded``, or None where the device ran out of memory and the caller codes
    that tensor on the CPU. ``parents``: name -> delta parent, on the tensor's device (a
    :class:`DeviceTensor`) or in host memory (an ``s4format.Tensor`` whose content hash is in
    ``parent_hashes``); both codings are made and the delta kept only where it stores less.
    ``workspace`` bounds the extra device memory per device (default
    ``plan.default_save_workspace``: an eighth of the device's free memory, from 10% of the
    bytes coded up to 2 GiB); XOR buffers take at most half of it."""
    from s4format.writer import delta_can_pay
    from s4weights.torchtree import DeviceTensor

    parents = parents or {}
    parent_hashes = parent_hashes or {}
    chosen = []
    for name, t in tensors:
        if not isinstance(t, DeviceTensor):
            continue
        p = parents.get(name) if delta_can_pay(t.nbytes) else None
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

    ws = workspace or plan.default_save_workspace(sum(t.nbytes for _n, t, _p in chosen),
                                                  _free_bytes(chosen[0][1].device_bytes.device))
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
    from s4format.writer import delta_pays
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
            if delta_pays(delta.coded.stored, full):
                yield delta.coded, alone.content_hash, phash, full
            else:
                yield alone.coded, alone.content_hash, None, full
        del items


def loader_for(reader, device: str, update=None, direct: dict | None = None,
               workspace: int | None = None, count_outputs: bool = False, on_decoded=None,
               wanted=None):
    """The load hook: ``f(i, cuda_device)`` decoding stored tensor i on that device as a typed,
    shaped torch tensor, or None when the GPU path is off. Tensors must be asked for in
    stored order: the first request decodes a batch of the following tensors too, within a
    workspace of extra device memory (default ``plan.default_load_workspace``: that of a save
    of the file's raw bytes, raised to an eighth of the memory the device has free besides
    them when it is first used, at most 1 GiB; a tensor alone over it is decoded in chunks
    where its codecs allow). When the device runs out of memory, the workspace is halved down
    to ``FALLBACK_MIN_WORKSPACE``, then the CPU decodes and the bytes are copied in.
    ``direct``: stored tensor index -> caller-owned flat uint8 CUDA bytes to decode into
    (``load(into=...)``). ``count_outputs``: decoded tensors count against the workspace too.
    ``on_decoded(i, raw)``: called with each tensor's checked bytes on the device as soon as
    they are decoded. ``update(nbytes)``: progress, per tensor returned. ``wanted``: the
    tensors that will be asked for (default: those the object tree uses); the planes of the
    batch the next of them starts are read while a batch decodes."""
    if not use_gpu(device, True):
        return None
    return _Loader(reader, update, direct or {}, workspace, count_outputs, on_decoded,
                   wanted).load


def _free_bytes(dev) -> int:
    """Device ``dev``'s free memory, or 0 where it does not answer."""
    import torch

    try:
        return int(torch.cuda.mem_get_info(dev)[0])
    except (RuntimeError, AssertionError, ValueError):
        return 0


class _Loader:
    """The state of one file's GPU load: the batches decoded ahead of their requests, each
    device's workspace (halved when it ran out of memory; 0 once the CPU decodes its tensors)
    and what the last attempt needed."""

    def __init__(self, reader, update, direct: dict, workspace: int | None,
                 count_outputs: bool, on_decoded, wanted=None) -> None:
        from s4weights.gpu import staging

        self.reader, self.update, self.direct = reader, update, direct
        self.count_outputs, self.on_decoded = count_outputs, on_decoded
        self.ready: dict[tuple[int, str], object] = {}
        self.sizes = [t.raw_nbytes for t in reader.tensors]
        self.workspace = workspace
        self.extra: dict[int, int] = {}
        self.budgets: dict[str, int] = {}
        # with the default workspace, per device: the most a tensor may need to be decoded
        # whole in a batch of its own, past the workspace (0 once that device ran out)
        self.whole: dict[str, int] = {}
        # the last attempt: in chunks, or a batch of ``size`` tensors needing ``need`` bytes
        self.tried = {"chunks": False, "size": 0, "need": 0}
        self.ahead = staging.Ahead()  # the next batch's planes, read while one decodes
        # a read ahead that no batch took is waited for when the load is done with this
        # loader (before its files are closed)
        weakref.finalize(self, self.ahead.drop)
        self.wanted = sorted(set(wanted)) if wanted is not None else \
            [j for j, n in enumerate(reader.tensor_uses) if n]

    def extra_of(self, j: int) -> int:
        """Device bytes decoding tensor j holds besides its output (and with it, where
        outputs count)."""
        from s4weights.gpu import decode

        if j not in self.extra:
            self.extra[j] = decode.device_extra(self.reader, j) + (
                self.sizes[j] if self.count_outputs else 0)
        return self.extra[j]

    def load(self, i: int, dev):
        import torch

        t = self.reader.tensors[i]
        dev = torch.device(dev)
        if dev.index is None:
            dev = torch.device("cuda", torch.cuda.current_device())
        key = str(dev)
        raw = self.ready.pop((i, key), None)
        while raw is None:
            ws = self._budget(key, dev)
            if ws:
                try:
                    raw = self._decoded(i, dev, ws)
                    continue
                except out_of_memory_errors() as exc:
                    what = f"{dev} ran out of memory decoding {t.name!r} with a workspace " \
                           f"of {ws >> 20} MiB ({error_text(exc)})"
                # (out of the handler: the failed attempt's buffers are free again)
                if self._smaller(i, key, ws, what):
                    continue
            raw = self._on_cpu(i, dev)
        if self.update is not None:
            self.update(t.raw_nbytes)
        return raw.view(getattr(torch, t.dtype.name)).reshape(t.shape)

    def _budget(self, key: str, dev) -> int:
        """Device ``dev``'s workspace: the caller's, else asked of that device when it is first
        used (a load onto the CPU asks no device), an eighth of what the state would leave
        free (``plan.default_load_workspace``)."""
        from s4weights.gpu import plan

        if key not in self.budgets:
            total = sum(self.sizes)
            free = 0 if self.workspace else _free_bytes(dev) - total
            self.budgets[key] = self.workspace or plan.default_load_workspace(total, free)
            self.whole[key] = plan.whole_load_cap(free)
        return self.budgets[key]

    def _smaller(self, i: int, key: str, ws: int, what: str) -> bool:
        """After device ``key`` ran out of memory with workspace ``ws``: whether to decode
        tensor i again with a smaller one. It helps chunks (smaller ones), or a batch of
        several tensors or one chunks can decode, halved until the attempt differs, for the
        later batches on that device too. Else the CPU decodes it; and if the attempt asked
        for at most ``FULL_BELOW``, the device is taken as full for its later tensors too."""
        from s4weights.gpu import decode, decode_large

        tried = self.tried
        smaller = ws // 2
        if not tried["chunks"]:
            while FALLBACK_MIN_WORKSPACE <= smaller >= tried["need"]:
                smaller //= 2  # (the same batch again otherwise)
        helps = tried["chunks"] or tried["size"] > 1 or (
            decode.decodable(self.reader, i) and decode_large.chunkable(self.reader, i))
        self.whole[key] = 0
        if helps and smaller >= FALLBACK_MIN_WORKSPACE:
            self.budgets[key] = smaller
            log.warning("%s: decoding again with %d MiB", what, smaller >> 20)
            return True
        if (ws if tried["chunks"] else tried["need"]) <= FULL_BELOW:
            self.budgets[key] = 0
        log.warning("%s: the CPU decodes it%s", what, "" if self.budgets[key]
                    else " and the later tensors on that device")
        return False

    def _on_cpu(self, i: int, dev):
        """Tensor i decoded by the CPU reader and copied to ``dev``."""
        import torch

        from s4weights.gpu import decode

        with torch.cuda.device(dev):
            raw = self._dest(i, dev)
            decode.read_on_cpu(self.reader, i, raw)
            if self.on_decoded is not None:
                self.on_decoded(i, raw)
        return raw

    def _decoded(self, i: int, dev, ws: int):
        """Tensor i's raw bytes decoded on ``dev`` within workspace ``ws``: in chunks when it
        alone needs more, else in a batch with the following tensors (theirs kept in
        ``ready``). With the default workspace, a tensor that needs more than it but no more
        than ``whole`` allows is decoded whole, alone: chunks cost host copies and round
        trips that one batch does not."""
        if self._chunked(i, str(dev), ws):
            return self._in_chunks(i, dev, ws)
        return self._in_batch(i, dev, ws)

    def _chunked(self, i: int, key: str, ws: int) -> bool:
        """Whether tensor i decodes in chunks on device ``key`` (see :meth:`_decoded`)."""
        from s4weights.gpu import decode, decode_large

        need = self.extra_of(i)
        return decode.decodable(self.reader, i) and need > ws \
            and need > self.whole.get(key, 0) and decode_large.chunkable(self.reader, i)

    def _in_chunks(self, i: int, dev, ws: int):
        """Tensor i, too large to decode whole within the workspace, in chunks straight into
        place."""
        import torch

        from s4weights.gpu import decode, decode_large
        from s4weights.gpu.ransparse import HostDecodes

        self.tried.update(chunks=True, size=1, need=0)
        with torch.cuda.device(dev):
            raw = self._dest(i, dev)
            try:
                decode_large.load_large(self.reader, i, raw, ws)
            except HostDecodes:  # (streams of tiny blocks, say): the CPU decodes it
                decode.read_on_cpu(self.reader, i, raw)
            if self.on_decoded is not None:
                self.on_decoded(i, raw)
        return raw

    def _in_batch(self, i: int, dev, ws: int):
        """Tensor i decoded in a batch with the following tensors the GPU decodes (or whose
        own levels the CPU decodes, ``decode.host_level``), as many as the workspace holds.
        Once its planes are read, the next batch's are read while it decodes."""
        import torch

        from s4weights.gpu import decode

        with torch.cuda.device(dev):  # (the size limit counts that device's memory)
            idx, used = self._batch(i, str(dev), ws)
            self.tried.update(chunks=False, size=len(idx), need=used)
            # (a tensor the CPU decodes may come between a batch's tensors: the batch after
            # it was read ahead already)
            nxt = None if not decode.batched(self.reader, i) else \
                (lambda ahead: self._read_next(idx[-1], str(dev), ws, ahead))
            outs = decode.read_tensors(
                self.reader, idx, [self._dest(j, dev) for j in idx] if self.direct else None,
                self.ahead, nxt)
            if self.on_decoded is not None:
                for j, o in zip(idx, outs):
                    self.on_decoded(j, o)
        for j, o in zip(idx[1:], outs[1:]):
            self.ready[(j, str(dev))] = o
        return outs[0]

    def _batch(self, i: int, key: str, ws: int) -> tuple[list[int], int]:
        """The batch that tensor i starts, and the device bytes it needs."""
        from s4weights.gpu import decode

        reader = self.reader
        idx, used = [i], 0
        if decode.batched(reader, i):
            used, cap = self.extra_of(i), decode.limit(reader)
            for j in range(i + 1, len(self.sizes)):
                if (j, key) in self.ready or not decode.batched(reader, j):
                    continue
                # a tensor over the size limit (R0) starts a batch of its own, so that
                # the tensors before it are read first, as the CPU reader reads them
                if used + self.extra_of(j) > ws or decode.over_limit(reader, j, cap):
                    break
                idx.append(j)
                used += self.extra_of(j)
        return idx, used

    def _read_next(self, last: int, key: str, ws: int, ahead) -> None:
        """Start reading the planes of the batch after the one ending at tensor ``last``:
        the one the next tensor a load uses starts, where it decodes in a batch."""
        from s4weights.gpu import decode

        ahead.drop()  # (a read ahead that no batch took)
        at = bisect.bisect_right(self.wanted, last)
        while at < len(self.wanted) and (self.wanted[at], key) in self.ready:
            at += 1
        if at == len(self.wanted):
            return
        reader, nxt = self.reader, self.wanted[at]
        if not decode.batched(reader, nxt) or not self.extra_of(nxt) \
                or decode.over_limit(reader, nxt) or self._chunked(nxt, key, ws):
            return  # (the CPU reads it, or it decodes in chunks)
        staged = [j for j in self._batch(nxt, key, ws)[0] if decode.decodable(reader, j)]
        if staged:  # (the planes the GPU decodes: levels the CPU decodes are read then)
            ahead.start(reader, staged)

    def _dest(self, j: int, dev):
        """Where tensor j is decoded: the caller's bytes, or a new device buffer."""
        from s4weights.gpu import decode, runtime

        d = self.direct.get(j)
        # the merge kernels store whole words (and 16-byte vectors where aligned): a view at an
        # odd offset (into= a slice of a larger buffer) would fault the device, so it gets a
        # fresh buffer and a copy like any other destination
        if d is not None and d.device == dev and d.data_ptr() % decode.DEST_ALIGN == 0:
            return d
        decode.check_limit(self.reader, j)  # rule R0 before allocating (and again later)
        n = self.sizes[j]
        return runtime.device_bytes(n)
