"""The chunked encoder's coding pass (``encode_large.code_large``, pass 2) without a GPU: every
chunk is queued with no synchronisation, its rANS words go down to a slot of a byte per symbol, and
the host moves them together after the one synchronisation. Its planes must equal the
one-group path's byte for byte, including where a chunk's words outgrow their slot (the pass
runs again with slots of two bytes per symbol), where streams reach the plane's raw size, and
for deltas. Kernels and device are emulated (tests/gpu/emulated.py); the GPU tests
(test_gpu_chunked.py) run the same cases on the H200."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from s4format import codecs, dtypes
from s4weights.gpu import encode, encode_large
from tests.gpu.emulated import Device, emulate

BIG = 1 << 34  # a workspace that takes any tensor here in one group
N = 4 * 65536 + 4321  # five chunks of the smallest length, the last one short


@pytest.fixture
def emulated(monkeypatch):
    emulate(monkeypatch)


def _item(t: torch.Tensor, parent: torch.Tensor | None = None) -> encode.Item:
    it = encode.Item(dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape),
                     t.reshape(-1).view(torch.uint8))
    if parent is not None:
        it.parent = parent.reshape(-1).view(torch.uint8)
    encode.Encoder._layouts([it])
    return it


def _same(a, b) -> None:
    assert a.layout.layout_id == b.layout.layout_id
    assert [(p.kind, p.index, p.codec, p.decoded_len) for p in a.planes] == \
        [(p.kind, p.index, p.codec, p.decoded_len) for p in b.planes]
    for p, q in zip(a.planes, b.planes):
        assert bytes(p.payload) == bytes(q.payload), (p.kind, p.index, p.codec)


def _smallest_workspace(t: torch.Tensor, lg: int = 16, xor: bool = False) -> int:
    """A workspace whose chunks are of the smallest length for ``t`` (every plane counted as
    rANS-coded, at the wider slots)."""
    from s4weights.gpu import plan

    it = _item(t)
    lay = it.layout
    return plan.large_need(lay, it.dtype.itemsize, plan.large_align(lg), len(lay.fields),
                           xor, lg, 1, slot=2) + (1 << 16)


def _chunked(t: torch.Tensor, parent: torch.Tensor | None = None, passes: list | None = None,
             lg: int = 16):
    """``code_large``'s result at the smallest workspace, its emulated device peak checked
    against it; ``passes`` gets (slot, chunk length, fitted) of every coding pass."""
    ws = _smallest_workspace(t, lg, parent is not None)
    enc = encode.Encoder("auto", workspace=ws, log2_block=lg)
    spy = encode_large._code_chunks

    def counted(enc_, ch, st, width, tables):
        ok = spy(enc_, ch, st, width, tables)
        if passes is not None:
            passes.append((st.slot, ch.chunk, ok))
        return ok

    encode_large._code_chunks = counted
    try:
        Device.live = Device.peak = 0
        out = encode_large.code_large(enc, _item(t, parent), ws)
        assert Device.peak <= ws, (Device.peak, ws)
        return out
    finally:
        encode_large._code_chunks = spy


def _whole(t: torch.Tensor, parent: torch.Tensor | None = None, lg: int = 16):
    (out,) = encode.Encoder("auto", workspace=BIG, log2_block=lg).code([_item(t, parent)])
    return out


def _cases() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    w = torch.randn(N, generator=g) * 0.02
    blocks = torch.arange(N) // 65536
    return {
        "bf16": w.bfloat16(),
        "fp16": w.half(),
        "fp32": w,
        "per-block": (blocks.float() * 0.125).bfloat16(),  # every block one symbol: CONST
        "zeros": torch.zeros(N, dtype=torch.bfloat16),
    }


@pytest.mark.parametrize("name", list(_cases()))
def test_chunked_pass_equals_the_one_group_path(emulated, name) -> None:
    t = _cases()[name]
    passes: list = []
    part = _chunked(t, passes=passes)
    whole = _whole(t)
    assert part.content_hash == whole.content_hash
    _same(part.coded, whole.coded)
    # one pass, in chunks, at slots of a byte per symbol
    assert [(s, ok) for s, _c, ok in passes] == [(1, True)]
    assert passes[0][1] < N


@pytest.mark.parametrize("window", [1, 2, 8])
def test_windows_of_chunks_give_the_same_bytes(emulated, monkeypatch, window) -> None:
    # the launch tables of a window of chunks go up in one upload; the chunks' launches run
    # from it one chunk at a time, a delta's XOR made right before its chunk's
    from s4weights.gpu import ranshost, runtime

    monkeypatch.setattr(encode_large, "WINDOW_CHUNKS", window)
    calls: list[list[int]] = []  # per coding pass: the tables of each upload it made
    now: list[list[int]] = []
    real, coding = runtime.upload, encode_large._code_chunks
    monkeypatch.setattr(runtime, "upload",
                        lambda *a: (now[0].append(len(a)) if now else None) or real(*a))
    runtime.constant("word_cost", ranshost.WORD_COST)  # (uploaded once per process)

    def marked(*a):
        calls.append([])
        now.append(calls[-1])
        try:
            return coding(*a)
        finally:
            now.clear()

    monkeypatch.setattr(encode_large, "_code_chunks", marked)
    g = torch.Generator().manual_seed(14)
    parent = (torch.randn(N, generator=g) * 0.02).bfloat16()
    child = (parent.float() + torch.randn(N, generator=g) * 1e-4).bfloat16()
    passes: list = []
    part = _chunked(child, parent, passes=passes)
    _same(part.coded, _whole(child, parent).coded)
    chunks = -(-N // passes[0][1])
    assert chunks >= 3
    # the frequency tables, then one upload per window
    assert len(calls[0]) == 1 + -(-chunks // window), calls[0]


def _retry_tensor() -> torch.Tensor:
    """bf16 whose first 2^17 exponents are spread over 256 values and the other ~1.4M over
    two. The whole plane's table makes the spread ones rare (~13 bits each): the first chunk
    (of at most 2^17 elements at the smallest workspace) codes to more than a byte per symbol,
    while the plane codes to far less than its raw size."""
    g = torch.Generator().manual_seed(12)
    n = 11 * 131072 + 99
    e = torch.full((n,), 120, dtype=torch.int32)
    e += torch.randint(0, 2, (n,), generator=g, dtype=torch.int32)
    e[:131072] = torch.randint(0, 256, (131072,), generator=g, dtype=torch.int32)
    m = torch.randint(0, 128, (n,), generator=g, dtype=torch.int32)
    return ((e << 7) | m).to(torch.int16).view(torch.bfloat16)


def test_a_chunk_that_outgrows_its_slot_is_coded_again_with_wider_slots(emulated) -> None:
    t = _retry_tensor()
    passes: list = []
    part = _chunked(t, passes=passes)
    whole = _whole(t)
    _same(part.coded, whole.coded)
    assert [(s, ok) for s, _c, ok in passes] == [(1, False), (2, True)], passes
    assert passes[1][1] <= passes[0][1]  # wider slots: chunks no longer
    exp = [p for p in part.coded.planes if p.codec == codecs.RANS]
    assert exp and all(p.stored_len < p.decoded_len for p in exp)


def test_streams_that_reach_the_raw_size_are_stored_raw(emulated, monkeypatch) -> None:
    t = _cases()["bf16"]
    whole = _whole(t).coded
    sizes = {(p.kind, p.index): p.stored_len for p in whole.planes if p.codec == codecs.RANS}
    assert sizes
    monkeypatch.setattr(encode_large, "_room", lambda n: n // 4)
    part = _chunked(t).coded
    for p in part.planes:
        if sizes.get((p.kind, p.index), 0) >= p.decoded_len // 4:
            assert p.codec != codecs.RANS, (p.kind, p.index)


def test_a_delta_is_coded_in_chunks_as_in_one_group(emulated) -> None:
    g = torch.Generator().manual_seed(13)
    parent = (torch.randn(N, generator=g) * 0.02).bfloat16()
    child = (parent.float() + torch.randn(N, generator=g) * 1e-4).bfloat16()
    part = _chunked(child, parent)
    whole = _whole(child, parent)
    assert part.content_hash == whole.content_hash
    _same(part.coded, whole.coded)


def test_collect_moves_each_chunks_words_behind_the_one_before(emulated) -> None:
    # the host side of the pass on its own: two chunks of one job, their words in slots of a
    # byte per symbol, moved together behind the counts and states
    from s4format import layouts
    from s4weights.gpu.planes import Planes

    n, lg = 3 * 65536, 16
    hist = np.zeros(1024, np.int64)
    hist[:4] = [n // 4] * 4  # exponent plane: four symbols
    hist[256:256 + 128] = n // 128
    pl = Planes.of_tensor(layouts.BF16, n, hist, n // 2)
    encode.Encoder("auto").candidates(pl)
    jobs = [1]
    freqs = np.zeros((1, 256), np.int64)
    freqs[0, :4] = 1024
    st = encode_large._Streams(pl, jobs, freqs, n, lg, slot=1)
    lengths = [2 * 65536, 65536]
    counts = [np.array([100, 200], np.uint32), np.array([50], np.uint32)]
    meta = []
    for c in counts:
        t = c.size
        block = np.zeros(134 * t, np.uint8)
        block[:4 * t] = c.view(np.uint8)
        block[4 * t:132 * t] = 7
        block[133 * t:] = 1  # varied
        meta.append(block)
    w0 = st.words_at(1)
    st.hnp[w0:w0 + 600] = np.arange(600) % 251
    st.hnp[w0 + 2 * 65536:w0 + 2 * 65536 + 100] = 42
    assert st.collect(np.concatenate(meta), lengths)
    assert st.words[1] == 2 * (100 + 200 + 50)
    assert (st.hnp[w0:w0 + 600] == np.arange(600) % 251).all()
    assert (st.hnp[w0 + 600:w0 + 700] == 42).all()
    s0 = st.stream_at(1) + len(st.prefix[1])
    assert st.hnp[s0:s0 + 12].view(np.uint32).tolist() == [100, 200, 50]
