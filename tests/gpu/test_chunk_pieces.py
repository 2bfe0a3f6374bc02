"""Host side of the chunked GPU load (``s4weights.gpu.decode_chunks.Level``), no CUDA needed: for
any chunk of a tensor, the pieces it stages (plane byte ranges, rANS final states and words, CONST
fills) rebuild exactly that chunk of every decoded plane, checked with the CPU decoder; and the
chunk length respects the workspace."""

from __future__ import annotations

import io

import numpy as np
import pytest

torch = pytest.importorskip("torch")

import s4format  # noqa: E402
import s4weights  # noqa: E402
from s4format import codecs  # noqa: E402
from s4format.codecs import rans  # noqa: E402
from s4weights.gpu import decode_chunks, decode_large, ranshost  # noqa: E402

MIB = 1 << 20


def _blob() -> bytes:
    g = torch.Generator().manual_seed(2)
    n = 3 * 65536 * 4 + 1234
    w = torch.randn(n, generator=g) * 0.02
    signs = torch.where(torch.rand(n, generator=g) < 0.02, -1.0, 1.0)
    blocks = torch.arange(n) // 65536
    state = {
        "bf16": w.bfloat16(), "fp16": w.half(), "fp32": w,
        "skewed-sign": (w.abs() * signs).bfloat16(),
        "adam-v": (w * w) * 1e-3,
        "per-block": (blocks.float() * 0.125).bfloat16(),
        "zeros": torch.zeros(n),
        "u8": torch.randint(0, 4, (4 * n,), generator=g, dtype=torch.uint8),
    }
    buf = io.BytesIO()
    s4weights.save(state, buf, device="cpu")
    return buf.getvalue()


def _file() -> s4format.Reader:
    return s4format.Reader(_blob())


def _rebuild(lv: decode_chunks.Level, piece, e0: int, e1: int) -> np.ndarray:
    """The decoded bytes [e0, e1) of a piece's plane, from the piece alone."""
    form, j, arrays, extra = piece
    p = lv.t.planes[j]
    if form == "plain":
        a = arrays[0]
        if p.codec == codecs.BITPACK:
            return np.unpackbits(a, bitorder="little")[:e1 - e0]
        if p.codec == codecs.BITPACK_W:
            return codecs.get(codecs.BITPACK_W).decode(a, e1 - e0, p.params)
        return a
    if form != "seg":
        return _stream(lv, form, lv.row_of[j], arrays, extra, e0, e1)
    out = np.full(e1 - e0, 0xA5, np.uint8)
    covered = 0
    for part, row, first, n, ext, off in extra[2]:
        if part == "copy":
            got = arrays[first]
        elif part == "unpack":
            got = (np.unpackbits(arrays[first], bitorder="little")[:n] if ext[0] == 1
                   else codecs.get(codecs.BITPACK_W).decode(arrays[first], n, bytes(ext)))
        else:
            got = _stream(lv, part, row, arrays[first:first + 2], ext, e0 + off, e0 + off + n)
        out[off:off + n] = got
        covered += n
    assert covered == e1 - e0  # (the parts tile the range)
    return out


def _stream(lv: decode_chunks.Level, form: str, q: int, arrays, extra, e0: int, e1: int
            ) -> np.ndarray:
    """Symbols [e0, e1) of the plane from rANS stream q's "rans" or "const" piece."""
    s = lv.streams
    b0, b1 = extra[:2]
    if form == "const":
        _start, length = lv.span(np.arange(b0, b1), e0, e1)
        return np.repeat(s.fill[b0:b1], length.astype(np.int64))
    freqs = s.freqs[int(s.table[b0])]
    stream = (ranshost.header(rans.MODE_RANS, lv.lg[q], e1 - e0) + rans.table_bytes(freqs)
              + s.count[b0:b1].astype("<u4").tobytes() + arrays[0].tobytes()
              + arrays[1].tobytes())
    return codecs.get(codecs.RANS).decode(np.frombuffer(stream, np.uint8), e1 - e0, b"")


def test_pieces_rebuild_every_chunk_of_every_plane() -> None:
    r = _file()
    forms = set()
    for i, t in enumerate(r.tensors):
        if not decode_large.chunkable(r, i):
            continue
        lv = decode_chunks.Level(r, i)
        planes = [r.read_plane(t, j) for j in range(len(t.planes))]
        n = planes[0].size if lv.whole else t.raw_nbytes // lv.word
        for step in (65536, 2 * 65536, 3 * 65536):
            for e0 in range(0, n, step):
                e1 = min(n, e0 + step)
                for piece in lv.pieces(e0 * lv.word, e1 * lv.word):
                    forms.add((piece[0], t.planes[piece[1]].codec))
                    got = _rebuild(lv, piece, e0, e1)
                    assert np.array_equal(got, planes[piece[1]][e0:e1]), (t.name, piece[:2], e0)
    assert {("rans", codecs.RANS), ("const", codecs.RANS), ("plain", codecs.BITPACK),
            ("plain", codecs.RAW), ("plain", codecs.BITPACK_W),
            ("seg", codecs.RANS_SEG)} <= forms, forms


def test_chunk_length_fits_the_workspace() -> None:
    r = _file()
    for i, _t in enumerate(r.tensors):
        if not decode_large.chunkable(r, i):
            continue
        lv = decode_chunks.Level(r, i)
        nbytes = lv.t.raw_nbytes
        align = lv.align()
        lgs = [lv.lg[q] for q in range(len(lv.srow)) if lv.streams.mode[q] == rans.MODE_RANS]
        assert align == lv.word << max([16, *lgs])  # whole rANS blocks, 2^16 elements at least
        for ws in (1, MIB // 2, 4 * MIB, 6 * MIB, 64 * MIB):
            c = decode_large._load_chunk([lv], nbytes, ws)
            assert c % align == 0 and c >= align
            worst = max(lv.need(lo, min(nbytes, lo + c)) for lo in range(0, nbytes, c))
            assert worst <= ws or c == align


def test_damaged_plane_is_refused_on_the_host() -> None:
    blob = bytearray(_blob())
    r = s4format.Reader(bytes(blob))
    i = next(i for i, t in enumerate(r.tensors) if t.name == "bf16")
    p = max(r.tensors[i].planes, key=lambda p: p.stored_len)
    blob[p.offset + 7] ^= 1
    with pytest.raises(s4format.ChecksumError):
        decode_chunks.Level(s4format.Reader(bytes(blob)), i)
