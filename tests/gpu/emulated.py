"""CPU emulation of the CUDA path's kernels and device, for tests of its host side without a
GPU: ``launch`` runs every kernel of kernels/*.cu with the reference implementations (the
layouts' split and merge, ``rans.normalise``, the reference rANS block encoder and decoder,
byte copies, XXH3 leaves), following their launch arguments; ``Torch`` makes device tensors
on the CPU and counts them (``Device``). A kernel's launch arguments that change must change
here too (the GPU tests, run on the H200, catch the kernels themselves)."""

from __future__ import annotations

import contextlib
import ctypes
import weakref

import numpy as np
import torch
import xxhash

from s4format import layouts
from s4format.codecs import rans
from s4format.errors import FormatError
from s4weights.gpu.plan import TABLE_STRIDE

LAYOUT = {f"{kind}_{name}": (lay, word, kind != "split", kind != "hist")
          for kind in ("split", "hist", "split_hist")
          for name, lay, word in (("bf16", layouts.BF16, 2), ("fp16", layouts.FP16, 2),
                                  ("fp32", layouts.FP32, 4))}  # (layout, word, hist, write)


MERGE = {f"merge_{name}": (lay, word) for name, lay, word in
         (("bf16", layouts.BF16, 2), ("fp16", layouts.FP16, 2), ("fp32", layouts.FP32, 4))}

def at(addr, dtype, n) -> np.ndarray:
    """A numpy view of ``n`` items at a (CPU) address."""
    n = int(n)
    if n == 0:
        return np.zeros(0, dtype)
    ct = np.ctypeslib.as_ctypes_type(np.dtype(dtype))
    return np.ctypeslib.as_array((ct * n).from_address(int(addr)))


def pack_bits(values: np.ndarray, w: int) -> np.ndarray:
    """Bitpack-w's stored bytes of ``values`` at ``w`` bits each (w = 8: the bytes)."""
    return np.packbits(np.unpackbits(values[:, None], axis=1, count=w,
                                     bitorder="little").reshape(-1), bitorder="little")


def unpack_plane(addr: int, n: int, w: int) -> np.ndarray:
    """``n`` plane values at ``addr``: bytes (w = 8) or packed at ``w`` bits each."""
    if w == 8:
        return at(addr, np.uint8, n).copy()
    bits = np.unpackbits(at(addr, np.uint8, (n * w + 7) // 8), bitorder="little")
    return np.packbits(bits[:n * w].reshape(n, w), axis=1, bitorder="little").reshape(-1)


def launch(module: str, name: str, grid: int, block: int, *a) -> None:
    if grid <= 0:
        return
    if name in LAYOUT:  # cs, c0, src, n, planes, pack, hist, ones
        lay, word, hist_on, write = LAYOUT[name]
        nseg = int(at(a[0], np.int32, grid).max()) + 1
        src, n = at(a[2], np.uint64, nseg), at(a[3], np.int64, nseg)
        table = at(a[4], np.uint64, 5 * nseg).reshape(nseg, 5)
        pack = at(a[5], np.uint8, nseg)
        for r in range(nseg):
            planes = lay.split(at(src[r], np.uint8, n[r] * word).copy(), word)
            if write:
                bits = np.packbits(planes[0], bitorder="little")
                at(table[r, 0], np.uint8, bits.size)[:] = bits
                for k, p in enumerate(planes[1:]):
                    f = lay.fields[1 + k]
                    if pack[r] and f.kind == layouts.KIND_MANTISSA and f.bits < 8:
                        assert table[r, 1 + k] % 4 == 0
                        p = pack_bits(p, f.bits)
                    at(table[r, 1 + k], np.uint8, p.size)[:] = p
            if hist_on:
                hist = at(int(a[6]) + 8192 * r, np.uint64, 1024)
                for k, p in enumerate(planes[1:]):
                    hist[256 * k:256 * (k + 1)] += np.bincount(p, minlength=256).astype(
                        np.uint64)
                at(int(a[7]) + 8 * r, np.uint64, 1)[0] += int(planes[0].sum())
    elif name == "rans_normalise":  # hist, ones, n, sbits, fc, stats, tbytes, log2_block,
        # wcost, bound
        hist, ones = at(a[0], np.uint64, grid), at(a[1], np.uint64, grid)
        wcost, bound = at(a[8], np.uint32, rans.PROB_SCALE + 1), at(a[9], np.uint64, grid)
        n, sbits = at(a[2], np.int64, grid), at(a[3], np.float64, rans.PROB_SCALE + 1)
        fc = at(a[4], np.uint32, 512 * grid).reshape(grid, 512)
        stats = at(a[5], np.uint64, 4 * grid).reshape(grid, 4)
        lb = int(a[7])
        for q in range(grid):
            c = np.zeros(256, np.int64)
            if hist[q]:
                c[:] = at(hist[q], np.uint64, 256)
            else:
                o = int(at(ones[q], np.uint64, 1)[0])
                c[:2] = n[q] - o, o
            f = rans.normalise(c) if c.any() else np.zeros(256, np.int64)
            fc[q, :256], fc[q, 256:] = f, np.cumsum(f) - f
            bound[q] = int((c * wcost[f].astype(np.int64)).sum())
            k = int(np.count_nonzero(c))
            table = rans.table_bytes(f) if k else np.zeros(32, np.uint8).tobytes()
            at(int(a[6]) + TABLE_STRIDE * q, np.uint8, len(table))[:] = np.frombuffer(
                table, np.uint8)
            total, est = int(c.sum()), 12
            if k == 1:
                est = 12 + -(-total >> 20)
            elif k > 1:
                bits = 0.0  # the kernel's order: one addition at a time, in symbol order
                for t in range(256):
                    bits += float(c[t]) * float(sbits[f[t]]) if c[t] else 0.0
                full = 12 + len(table) + 132 * -(-total >> lb) + 2 * int(np.ceil(bits / 16))
                est = min(full, 12 + total)
            ends = (int(np.argmax(c > 0)) | 255 - int(np.argmax(c[::-1] > 0)) << 16) if k else 0
            stats[q] = k, est, ends, len(table)
    elif name == "rans_jobs":  # stats, n, rule, rows, slack_s, slack_e, run: the kernel's rule
        rows = int(a[3])
        stats = at(a[0], np.uint64, 4 * rows).reshape(rows, 4).astype(np.int64)
        n, rule = at(a[1], np.int64, rows), at(a[2], np.uint8, rows)
        out = at(a[6], np.uint8, rows)
        for q in range(rows):
            m, r = int(n[q]), int(rule[q])
            est = int(stats[q, 1]) if r & 1 else 0
            cand_rans = bool(r & 1) and est < m
            est_bp = (m + 7) // 8
            cand_bp = bool(r & 2) and est_bp < m
            width = max(1, (int(stats[q, 2]) >> 16).bit_length())
            est_bw = (m * width + 7) // 8
            cand_bw = bool(r & 4) and width <= 7 and est_bw < m
            bp_first = cand_bp and cand_rans and est_bp <= est
            bw_first = cand_bw and (not cand_rans or int(a[4]) * est_bw <= int(a[5]) * est)
            out[q] = cand_rans and not bp_first and not bw_first and stats[q, 0] > 1
    elif name == "rans_encode":  # CTAs: plane, block, warps; planes: src, n, tab, scratch,
        # first block, source width; log2_block; per block: counts, states, firsts, varied;
        # planes: run, capacity (words; none: a slot per block), cursor; per block: its
        # words' place; wcost
        cplane, cblock = at(a[0], np.uint32, grid), at(a[1], np.uint32, grid)
        cwarps = at(a[2], np.uint8, grid)
        nq = int(cplane.max()) + 1
        src, n, tab = at(a[3], np.uint64, nq), at(a[4], np.int64, nq), at(a[5], np.uint64, nq)
        scr, pfirst = at(a[6], np.uint64, nq), at(a[7], np.int64, nq)
        width, lg = at(a[8], np.uint8, nq), int(a[9])
        nb = int(pfirst[-1] + -(-int(n[-1]) >> lg))
        counts, states = at(a[10], np.uint32, nb), at(a[11], np.uint32, 32 * nb)
        firsts, varied = at(a[12], np.uint8, nb), at(a[13], np.uint8, nb)
        run = at(a[14], np.uint8, nq) if int(a[14]) else np.ones(nq, np.uint8)
        cap = at(a[15], np.uint64, nq) if int(a[15]) else np.full(nq, ~np.uint64(0))
        cursor = at(a[16], np.uint64, nq) if int(a[16]) else None
        boff, wcost = at(a[17], np.uint64, nb), at(a[18], np.uint32, rans.PROB_SCALE + 1)
        for c in range(grid):
            q = int(cplane[c])
            if not run[q]:  # its blocks code nothing
                b0 = int(pfirst[q]) + int(cblock[c])
                w = int(cwarps[c])
                counts[b0:b0 + w], firsts[b0:b0 + w], varied[b0:b0 + w] = 0, 0, 0
                continue
            freqs = at(tab[q], np.uint32, 256).astype(np.int64)
            plane = unpack_plane(int(src[q]), int(n[q]), int(width[q]))
            for k in range(int(cblock[c]), int(cblock[c]) + int(cwarps[c])):
                start = k << lg
                b = int(pfirst[q]) + k
                data = plane[start:start + (1 << lg)].copy()
                off, most = start, data.size
                if cap[q] != ~np.uint64(0):  # the block's share of the plane's bound
                    most = int(wcost[freqs[data]].astype(np.int64).sum()) >> 20
                    off = int(cursor[q])
                    cursor[q] += np.uint64(most)
                    if off + most > int(cap[q]):
                        counts[b] = 0xFFFFFFFF
                        continue
                boff[b] = off
                words = np.empty(data.size, np.uint16)
                cnt, s_ = np.empty(1, np.int64), np.empty(rans.LANES, np.int64)
                rans._encode_blocks(data, rans.LOG2_BLOCK_MAX, rans._encoder_table(freqs), words,
                                    cnt, s_)
                counts[b] = cnt[0] if cnt[0] <= most else 0xFFFFFFFF
                states[32 * b:32 * (b + 1)] = s_
                at(int(scr[q]) + 2 * off, np.uint16, min(cnt[0], most))[:] = \
                    words[:min(cnt[0], most)]
                firsts[b], varied[b] = data[0], bool((data != data[0]).any())
    elif name == "copy_ops":  # src, dst, len
        for s, d, n in zip(*(at(x, np.uint64, grid).tolist() for x in a[:3])):
            ctypes.memmove(d, s, n)
    elif name == "pack_ops":  # src, dst, n, w, source width
        for s, d, n, w, sw in zip(*(at(x, np.uint64, grid).tolist() for x in a[:3]),
                                  *(at(x, np.uint8, grid).tolist() for x in a[3:5])):
            values = unpack_plane(s, n, sw)
            assert int(values.max()) < 1 << w
            packed = pack_bits(values, w)
            at(d, np.uint8, packed.size)[:] = packed
    elif name == "rans_place":  # njobs, first, scratch, words (per job); per block: its
        # words' place, count, excl; cap
        nj = int(a[0])
        first = at(a[1], np.int64, nj + 1)
        scratch, words = at(a[2], np.uint64, nj), at(a[3], np.uint64, nj)
        boff, count, excl = at(a[4], np.uint64, grid), at(a[5], np.uint32, grid), \
            at(a[6], np.int64, grid)
        cap = int(a[7])
        for b in range(grid):
            j = int(np.searchsorted(first, b, side="right") - 1)
            end = 2 * int(excl[b] - excl[first[j]] + count[b])
            if words[j] and (not cap or end <= cap):
                ctypes.memmove(int(words[j]) + 2 * int(excl[b] - excl[first[j]]),
                               int(scratch[j]) + 2 * int(boff[b]),
                               2 * int(count[b]))
    elif name == "leaf_digests":  # nseg, ptr, len, first, at, out
        nseg = int(a[0])
        ptr, ln = at(a[1], np.uint64, nseg), at(a[2], np.uint64, nseg)
        first, dst = at(a[3], np.int64, nseg + 1), at(a[4], np.int64, nseg)
        for s in range(nseg):
            data = at(ptr[s], np.uint8, ln[s]).tobytes()
            out = at(int(a[5]) + 8 * int(dst[s]), np.uint64, int(first[s + 1] - first[s]))
            for j in range(out.size):
                out[j] = xxhash.xxh3_64_intdigest(data[j << 16:(j + 1) << 16])
    elif name == "hash_roots":  # nseg, len, first, buf (digests with gaps), out, wide
        nseg, wide = int(a[0]), int(a[5])
        ln, first = at(a[1], np.uint64, nseg), at(a[2], np.int64, nseg + 1)
        buf = at(a[3], np.uint64, int(first[-1]) + nseg)
        out = at(a[4], np.uint8, (16 if wide else 8) * nseg)
        for s in range(nseg):
            lo, hi = int(first[s]) + s, int(first[s + 1]) + s + 1
            buf[lo] = ln[s]
            root = buf[lo:hi].astype("<u8").tobytes()
            if wide:
                out[16 * s:16 * (s + 1)] = np.frombuffer(xxhash.xxh3_128_digest(root), np.uint8)
            else:
                out.view(np.uint64)[s] = xxhash.xxh3_64_intdigest(root)
    elif name in ("rans_decode", "rans_decode_ahead"):
        # cta_first, cta_warps, mode, fill, words, count, states,
        # dtab (the plane's exclusive prefix sums, shared by the CTA), out, len, errors
        first, warps = at(a[0], np.uint32, grid), at(a[1], np.uint8, grid)
        nb = int(first[-1]) + int(warps[-1])
        mode, fill = at(a[2], np.uint8, nb), at(a[3], np.uint8, nb)
        words, count, states = at(a[4], np.uint64, nb), at(a[5], np.uint32, nb), \
            at(a[6], np.uint64, nb)
        dtab, out, ln = at(a[7], np.uint64, nb), at(a[8], np.uint64, nb), at(a[9], np.uint32, nb)
        errors = at(a[10], np.int32, nb)
        for c in range(grid):
            b0 = int(first[c])
            table = None
            if dtab[b0]:
                cum = at(dtab[b0], np.uint32, 256).astype(np.int64)
                table = rans._decoder_table(np.diff(np.append(cum, rans.PROB_SCALE)))
            for b in range(b0, b0 + int(warps[c])):
                if mode[b] == 2:  # its stream failed rans_blocks' checks
                    continue
                dst = at(out[b], np.uint8, ln[b])
                if mode[b] == 1:
                    dst[:] = fill[b]
                    continue
                x = at(states[b], np.uint32, rans.LANES).astype(np.int64)
                w = at(words[b], np.uint16, count[b]) if count[b] else np.zeros(0, np.uint16)
                errors[b] = rans._decode_block(w, 0, int(count[b]), x, table, dst, 0, int(ln[b]))
    elif name == "rans_blocks":  # per stream: src, stored, n, dst, nb, pos, first; the tables'
        # prefix sums and per stream its table's index, lg, mode; per block: mode, fill,
        # words, count, states, dtab, out, len; per stream: bad
        src, stored, n = at(a[0], np.uint64, grid), at(a[1], np.int64, grid), \
            at(a[2], np.int64, grid)
        dst, nb, pos = at(a[3], np.uint64, grid), at(a[4], np.int64, grid), \
            at(a[5], np.int64, grid)
        first, tab_of = at(a[6], np.int64, grid), at(a[8], np.int64, grid)
        tab = np.uint64(int(a[7])) + (1024 * tab_of).astype(np.uint64)
        lg, smode = at(a[9], np.uint8, grid), at(a[10], np.uint8, grid)
        total = int(first[-1] + nb[-1])
        bmode, fill = at(a[11], np.uint8, total), at(a[12], np.uint8, total)
        words, count = at(a[13], np.uint64, total), at(a[14], np.uint32, total)
        states, dtab = at(a[15], np.uint64, total), at(a[16], np.uint64, total)
        out, ln = at(a[17], np.uint64, total), at(a[18], np.uint32, total)
        bad = at(a[19], np.int32, grid)
        for q in range(grid):
            m, p, f0, is_rans = int(nb[q]), int(pos[q]), int(first[q]), smode[q] == 2
            j = np.arange(m, dtype=np.int64)
            start = j << int(lg[q])
            length = np.minimum(int(n[q]) - start, 1 << int(lg[q]))
            c = at(int(src[q]) + p, np.uint32, m).astype(np.int64) if is_rans \
                else np.zeros(m, np.int64)
            excl = np.cumsum(c) - c
            wbase = int(src[q]) + p + 132 * m
            sl = slice(f0, f0 + m)
            bmode[sl] = 0 if is_rans else 1
            fill[sl] = 0 if is_rans else at(int(src[q]) + p, np.uint8, m)
            count[sl] = c
            words[sl] = (wbase + 2 * excl) if is_rans else 0
            states[sl] = (int(src[q]) + p + 4 * m + 128 * j) if is_rans else 0
            dtab[sl] = tab[q] if is_rans else 0
            out[sl] = int(dst[q]) + start
            ln[sl] = length
            if (c > length).any() or (is_rans and int(stored[q]) != p + 132 * m + 2 * c.sum()):
                bmode[sl], dtab[sl], bad[q] = 2, 0, 1
    elif name in MERGE:  # cs, c0, dst, n, planes, width (5 per segment), errors, digests,
        # dfirst: the digests of each segment's full leaves (where digests and dfirst >= 0)
        lay, word = MERGE[name]
        segs = np.unique(at(a[0], np.int32, grid))  # (those of the launch's CTAs only)
        nseg = int(segs.max()) + 1
        dst, n = at(a[2], np.uint64, nseg), at(a[3], np.int64, nseg)
        table = at(a[4], np.uint64, 5 * nseg).reshape(nseg, 5)
        width, errors = at(a[5], np.uint8, 5 * nseg).reshape(nseg, 5), at(a[6], np.int32, nseg)
        dfirst = at(a[8], np.int64, nseg) if int(a[7]) else np.full(nseg, -1)
        for r in segs.tolist():
            m = int(n[r])
            bad = False
            if width[r, 0]:
                bits = at(table[r, 0], np.uint8, (m + 7) // 8)
                bad = bool(m % 8) and int(bits[-1]) >> (m % 8) != 0
                sign = np.unpackbits(bits, bitorder="little")[:m]
            else:
                sign = at(table[r, 0], np.uint8, m).copy()
            planes = [sign]
            for k in range(len(lay.fields) - 1):
                w = int(width[r, 1 + k])
                if w:  # bitpack-w: m values of w bits, LSB first
                    bits = np.unpackbits(at(table[r, 1 + k], np.uint8, (m * w + 7) // 8),
                                         bitorder="little")[:m * w].reshape(m, w)
                    planes.append(np.packbits(bits, axis=1, bitorder="little").reshape(-1))
                else:
                    planes.append(at(table[r, 1 + k], np.uint8, m).copy())
            try:
                at(dst[r], np.uint8, m * word)[:] = lay.merge(planes, m * word, word)
            except FormatError:
                bad = True
            if bad:
                errors[r] = 1
            if dfirst[r] >= 0:
                data = at(dst[r], np.uint8, m * word).tobytes()
                for j in range(m * word >> 16):
                    at(int(a[7]) + 8 * (int(dfirst[r]) + j), np.uint64, 1)[0] = \
                        xxhash.xxh3_64_intdigest(data[j << 16:(j + 1) << 16])
    elif name == "xor_ops":  # a, b, len: a[i] ^= b[i]
        for x, y, n in zip(*(at(v, np.uint64, grid).tolist() for v in a[:3])):
            at(x, np.uint8, n)[:] ^= at(y, np.uint8, n)
    elif name == "xor_bytes":  # a, b, out, n
        n = int(a[3])
        at(a[2], np.uint8, n)[:] = at(a[0], np.uint8, n) ^ at(a[1], np.uint8, n)
    else:
        raise AssertionError(f"no emulation of kernel {name}")


class Event:
    def record(self, *_a) -> None:
        pass

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class Stream(Event):
    cuda_stream = 0

    def wait_event(self, _e) -> None:
        pass


class Cuda:
    Stream = staticmethod(lambda *a, **k: Stream())
    Event = staticmethod(lambda *a, **k: Event())
    current_stream = staticmethod(lambda *a: Stream())
    stream = staticmethod(lambda s: contextlib.nullcontext())
    device = staticmethod(lambda d: contextlib.nullcontext())
    synchronize = staticmethod(lambda: None)


class Device:
    """Bytes of the emulated device tensors alive now, and the most alive at once (a tensor
    is freed when its last reference goes, as torch's caching allocator frees in stream
    order)."""
    live = 0
    peak = 0

    @classmethod
    def made(cls, t: torch.Tensor) -> torch.Tensor:
        n = t.numel() * t.element_size()
        cls.live += n
        cls.peak = max(cls.peak, cls.live)
        weakref.finalize(t, cls.freed, n)
        return t

    @classmethod
    def freed(cls, n: int) -> None:
        cls.live -= n


class Torch:
    """torch, with device tensors made on the CPU (and counted: ``Device``)."""
    cuda = Cuda()

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*a, device=None, pin_memory=False, **k):
        t = torch.empty(*a, **k)
        return Device.made(t) if device is not None else t

    @staticmethod
    def zeros(*a, device=None, **k):
        t = torch.zeros(*a, **k)
        return Device.made(t) if device is not None else t

    @staticmethod
    def cat(*a, **k):  # only ever of device tensors here
        return Device.made(torch.cat(*a, **k))


class _Properties:
    total_memory = 1 << 40
    multi_processor_count = 132


Cuda.get_device_properties = staticmethod(lambda *a: _Properties())
Cuda.current_device = staticmethod(lambda: 0)


def emulate(monkeypatch) -> None:
    """The CUDA path's modules with emulated kernels and CPU "device" tensors: every module of
    the package that imports torch gets :class:`Torch` instead."""
    import importlib
    import pkgutil

    from s4weights import gpu
    from s4weights.gpu import runtime

    for info in pkgutil.iter_modules(gpu.__path__):
        mod = importlib.import_module(f"s4weights.gpu.{info.name}")
        if getattr(mod, "torch", None) is torch:
            monkeypatch.setattr(mod, "torch", Torch())
    monkeypatch.setattr(runtime, "launch", launch)
    monkeypatch.setattr(runtime, "pinned", lambda n: torch.empty(max(n, 1), dtype=torch.uint8))
    # constant tables made here are CPU tensors: a cache of their own, gone with the test
    monkeypatch.setattr(runtime, "_CONSTANTS", {})
    monkeypatch.setattr(runtime, "_SMS", {})
