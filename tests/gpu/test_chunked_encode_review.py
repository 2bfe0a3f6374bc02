"""More cases for the chunked encoder's coding pass (``encode_large.code_large``, pass 2) without
a GPU, beyond test_chunked_encode_host.py: awkward lengths (a last chunk of under 8
elements), every split dtype, sign planes coded by rANS, bitpack-w planes, CONST planes,
block sizes other than 2^16, a delta whose chunk outgrows its slot, planes over their raw
size decoded back (raw and bitpack-w fallbacks), every copy inside its region (pinned host
streams, rans_place's slots), the host's move of overlapping words, and windows bounded by
the table share. Kernels and device are emulated (tests/gpu/emulated.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from s4format import codecs
from s4weights.gpu import encode, encode_large
from tests.gpu.emulated import emulate
from tests.gpu.test_chunked_encode_host import _chunked, _retry_tensor, _same, _whole


@pytest.fixture
def emulated(monkeypatch):
    emulate(monkeypatch)


def _run(t, parent=None, lg=16, passes=None):
    """(chunked result at the smallest workspace, its emulated device peak checked against
    it; one-group result)."""
    return _chunked(t, parent, passes, lg), _whole(t, parent, lg)


def _cases():
    g = torch.Generator().manual_seed(5)
    out = {}
    for n in (3 * 65536 + 5, 2 * 65536 + 1, 2 * 65536 + 7, 65536 * 2 + 8):
        w = torch.randn(n, generator=g) * 0.02
        out[f"bf16-{n}"] = w.bfloat16()
        out[f"fp16-{n}"] = w.half()
        out[f"fp32-{n}"] = w
    n = 3 * 65536 + 3
    w = torch.randn(n, generator=g).abs() * 0.02
    w[torch.rand(n, generator=g) < 0.02] *= -1  # skewed signs: rANS on the sign plane
    out["skew-sign"] = w.bfloat16()
    out["skew-sign-fp32"] = w
    vals = torch.tensor([0.5, 0.75, 1.0, -1.25, 1.5, 0.625])
    out["few-mant"] = vals[torch.randint(0, 6, (n,), generator=g)].bfloat16()
    out["few-mant-fp16"] = vals[torch.randint(0, 6, (n,), generator=g)].half()
    bits = torch.randint(-(1 << 15), 1 << 15, (n,), generator=g, dtype=torch.int32)
    out["random-bits"] = bits.to(torch.int16).view(torch.bfloat16)
    out["ones"] = torch.ones(n, dtype=torch.bfloat16)
    out["neg-zero-mix"] = torch.where(torch.rand(n, generator=g) < 0.5, -0.0, 0.0).bfloat16()
    return out


CASES = _cases()


@pytest.mark.parametrize("name", list(CASES))
def test_awkward_shapes_equal_the_one_group_path(emulated, name):
    # lengths not a multiple of 8 (a last chunk of under 8 elements), every split dtype, rANS
    # sign planes, bitpack-w and CONST planes, a tensor stored raw: the one-group path's bytes
    out, whole = _run(CASES[name])
    assert out.content_hash == whole.content_hash
    _same(out.coded, whole.coded)


@pytest.mark.parametrize("lg", [12, 17])
def test_other_block_sizes(emulated, lg):
    t = CASES["bf16-196613"]
    out, whole = _run(t, lg=lg)
    _same(out.coded, whole.coded)


def test_a_delta_whose_chunk_outgrows_its_slot(emulated):
    child = _retry_tensor()
    n = child.numel()
    parent = torch.zeros(n, dtype=torch.int16)
    parent[::3] = 5
    parent = parent.view(torch.bfloat16)
    passes = []
    out, whole = _run(child, parent, passes=passes)
    _same(out.coded, whole.coded)
    assert [(s, ok) for s, _c, ok in passes] == [(1, False), (2, True)], passes


def _decoded(coded, nbytes: int, itemsize: int) -> np.ndarray:
    planes = [codecs.get(p.codec).decode(np.asarray(p.payload, np.uint8), p.decoded_len,
                                         p.params) for p in coded.planes]
    return coded.layout.merge(planes, nbytes, itemsize)


def _bw3():
    """bf16 whose mantissas take 8 values: stored as bitpack-w at 3 bits (ranked first)."""
    g = torch.Generator().manual_seed(7)
    n = 4 * 65536 + 6
    e = torch.randint(100, 130, (n,), generator=g, dtype=torch.int32)
    m = torch.randint(0, 8, (n,), generator=g, dtype=torch.int32)
    return ((e << 7) | m).to(torch.int16).view(torch.bfloat16)


@pytest.mark.parametrize("name", ["bw3", "few-mant-fp16", "skew-sign-fp32", "fp32-131079"])
@pytest.mark.parametrize("div", [2, 4, 64])
def test_over_planes_decode_to_the_tensor(emulated, monkeypatch, name, div):
    # streams that reach a (lowered) raw size fall back to raw, bitpack-w or bitpack (pass 3):
    # the planes still decode to the tensor
    t = _bw3() if name == "bw3" else CASES[name]
    monkeypatch.setattr(encode_large, "_room", lambda n: n // div)
    out, _w = _run(t)
    raw = t.reshape(-1).view(torch.uint8).numpy()
    got = _decoded(out.coded, raw.size, t.element_size())
    assert (got == raw).all()


@pytest.mark.parametrize("name", ["retry", "bw3", "skew-sign-fp32", "fp16-196613"])
def test_copies_stay_in_their_regions(emulated, monkeypatch, name):
    # every D2H into the pinned streams lies inside one plane's region (a rANS plane's words
    # inside its slots), and rans_place writes inside [words[j], words[j] + cap) with cap > 0
    from s4weights.gpu import runtime
    from tests.gpu import emulated as em

    t = {"retry": _retry_tensor, "bw3": _bw3}.get(name, lambda: CASES[name])()
    seen = {"d2h": 0, "place": 0, "on": False}
    real_large = encode_large.code_large

    def large(*a):
        seen["on"] = True
        try:
            return real_large(*a)
        finally:
            seen["on"] = False

    monkeypatch.setattr(encode_large, "code_large", large)
    real_d2h = encode_large._Streams.d2h

    def d2h(self, off, src):
        ends = [*self.at[1:], self.host.numel()]
        i = int(np.searchsorted(self.at, off, side="right") - 1)
        assert off + src.numel() <= ends[i], (i, off, src.numel(), ends[i])
        if i in self.job and off >= self.words_at(i):
            assert off + src.numel() <= self.words_at(i) + self.slot * self.n
        seen["d2h"] += 1
        return real_d2h(self, off, src)

    monkeypatch.setattr(encode_large._Streams, "d2h", d2h)
    real_launch = runtime.launch

    def launch(module, name_, grid, block, *a):
        if name_ == "rans_place" and grid > 0 and seen["on"]:
            nj, cap = int(a[0]), int(a[7])
            assert cap > 0
            first = em.at(a[1], np.int64, nj + 1)
            words = em.at(a[3], np.uint64, nj).astype(np.int64)
            count = em.at(a[5], np.uint32, grid).astype(np.int64)
            excl = em.at(a[6], np.int64, grid)
            assert (np.diff(words) >= cap).all()
            for b in range(grid):
                j = int(np.searchsorted(first, b, side="right") - 1)
                lo = 2 * int(excl[b] - excl[first[j]])
                if lo + 2 * count[b] <= cap:
                    seen["place"] += 1
                else:  # left out: and so is every later block of its job
                    assert all(2 * int(excl[c] - excl[first[j]] + count[c]) > cap
                               for c in range(b, int(first[j + 1])))
        return real_launch(module, name_, grid, block, *a)

    monkeypatch.setattr(runtime, "launch", launch)
    out, whole = _run(t)
    _same(out.coded, whole.coded)
    assert seen["d2h"] and seen["place"]


def test_collect_moves_overlapping_words(emulated):
    # a chunk's words moved down over its own slot (the gap behind the chunk before is
    # shorter than the words): the move must read before it writes
    from s4format import layouts
    from s4weights.gpu.planes import Planes

    n, lg = 3 * 65536, 16
    hist = np.zeros(1024, np.int64)
    hist[:200] = n // 200
    hist[256:256 + 128] = n // 128
    pl = Planes.of_tensor(layouts.BF16, n, hist, n // 2)
    encode.Encoder("auto").candidates(pl)
    freqs = np.zeros((1, 256), np.int64)
    freqs[0, :200] = 4096 // 200
    freqs[0, 0] += 4096 - freqs[0].sum()
    st = encode_large._Streams(pl, [1], freqs, n, lg, slot=1)
    st.room = 10 * n  # (kept whatever its size)
    lengths = [65536, 65536, 65536]
    counts = [32000, 30000, 32700]
    meta = []
    for c in counts:
        block = np.zeros(134, np.uint8)
        block[:4] = np.array([c], np.uint32).view(np.uint8)
        block[133] = 1
        meta.append(block)
    w0 = st.words_at(1)
    rng = np.random.default_rng(0)
    want = []
    for k, c in enumerate(counts):
        words = rng.integers(0, 256, 2 * c, dtype=np.uint8)
        st.hnp[w0 + 65536 * k:w0 + 65536 * k + 2 * c] = words
        want.append(words)
    assert st.collect(np.concatenate(meta), lengths)
    assert st.words[1] == 2 * sum(counts)
    assert (st.hnp[w0:w0 + st.words[1]] == np.concatenate(want)).all()


@pytest.mark.parametrize("share", [64, 886, 4096, 1 << 40])
def test_windows_bounded_by_the_table_share(emulated, monkeypatch, share):
    # a window's upload holds at most workspace // TABLE_SHARE bytes unless it is one chunk's
    from s4weights.gpu import runtime

    monkeypatch.setattr(encode_large, "TABLE_SHARE", share)
    real_run, windows, budget, chunk, seen = runtime.Batch.run, [], [], [], []

    def run(self, stop=None):
        if self._arrays and budget:
            chunks = sum(1 for x in self._launches if x[1].startswith("split"))
            windows.append((self.table_bytes(), chunks))
        return real_run(self, stop)

    real_code = encode_large._code_chunks

    def code(enc, ch, st, width, tables):
        budget.append(tables)
        seen.append(tables)
        chunk.append(ch.chunk)
        try:
            return real_code(enc, ch, st, width, tables)
        finally:
            budget.clear()

    monkeypatch.setattr(runtime.Batch, "run", run)
    monkeypatch.setattr(encode_large, "_code_chunks", code)
    g = torch.Generator().manual_seed(21)
    t = (torch.randn(20 * 65536 + 3, generator=g) * 0.02).bfloat16()
    out, whole = _run(t)
    _same(out.coded, whole.coded)
    (tables,) = seen
    assert len(chunk) == 1
    assert sum(c for _b, c in windows) == -(-t.numel() // chunk[0]) >= 8
    assert all(b <= tables or c == 1 for b, c in windows), (tables, windows)
    assert all(c <= encode_large.WINDOW_CHUNKS for _b, c in windows)
    if share == 1 << 40:
        assert all(c == 1 for _b, c in windows)
