"""The chunked loader plans every chunk before staging the first (``decode_chunks.Run``) and uploads
the launch tables of a window of chunks at once, under the CPU emulation of tests/gpu/emulated.py:
tensors decode byte for byte whether one window holds every chunk or each chunk is a window of
its own; a corrupt rANS block or a field overflow in a later chunk (and a later window) is
found and named as the CPU reader names it; the chunk fits the workspace with its tables."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import s4format
from s4format import codecs, dtypes, hashing, layouts, objtree
from s4format.codecs import rans
from s4format.writer import Writer
from s4weights.gpu import decode_chunks, decode_large, encode
from tests.gpu.emulated import Device, emulate
from tests.gpu.test_decode_host import _rewrite

N = 700_000  # bf16 elements: 11 rANS blocks of 2^16


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    emulate(monkeypatch)


def _blob(x: np.ndarray, dtype: str = "bfloat16", parent: tuple | None = None,
          mantissa: str = "auto") -> bytes:
    """One tensor "w" of raw bytes ``x``, coded by the (emulated) GPU encoder; ``parent``:
    (its file's checkpoint id, its raw bytes): stored as the XOR delta against them."""
    n = x.size // dtypes.BY_NAME[dtype].itemsize
    data = x if parent is None else np.bitwise_xor(x, parent[1])
    it = encode.Item(dtypes.BY_NAME[dtype], (n,), torch.from_numpy(data))
    c = next(iter(encode.Encoder(mantissa=mantissa).code([it])))
    buf = io.BytesIO()
    with Writer(buf, parent_id=None if parent is None else parent[0]) as w:
        w.add_coded("w", it.dtype, (n,), c.coded, hashing.content_hash(x.tobytes()),
                    parent_hash=None if parent is None
                    else hashing.content_hash(parent[1].tobytes()))
        w.set_tree({"w": objtree.TensorRef(0)})
    return buf.getvalue()


def _weights(seed: int = 0) -> np.ndarray:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(N, generator=g) * .02).bfloat16().view(torch.uint8).numpy().copy()


def _chunks_seen(monkeypatch) -> list[int]:
    seen: list[int] = []
    real = decode_large._load_chunk

    def spy(*a, **k):
        got = real(*a, **k)
        seen.append(got[0] if isinstance(got, tuple) else got)
        return got

    monkeypatch.setattr(decode_large, "_load_chunk", spy)
    return seen


@pytest.mark.parametrize("windows", ["one", "one per chunk"])
@pytest.mark.parametrize("delta", [False, True])
def test_every_chunk_decodes_exactly_in_one_window_or_many(monkeypatch, windows: str,
                                                           delta: bool) -> None:
    if windows == "one per chunk":  # (a window holds at least one chunk)
        monkeypatch.setattr(decode_large, "TABLE_SHARE", 1 << 40)
    x = _weights()
    blob = _blob(x)
    r = s4format.Reader(blob)
    want = x
    if delta:
        y = x.copy()
        y[np.random.default_rng(1).integers(0, y.size, 5000)] ^= np.uint8(8)
        r = s4format.Reader(_blob(y, parent=(r.checkpoint_id, x)), parent=r)
        want = y
    seen = _chunks_seen(monkeypatch)
    out = torch.full((2 * N,), 0xAB, dtype=torch.uint8)
    decode_large.load_large(r, 0, out, 1 << 19)
    assert seen and seen[0] * 3 <= 2 * N  # (several chunks)
    assert np.array_equal(out.numpy(), want)


def _plane(blob: bytes, codec: int, kind: int | None = None) -> int:
    t = s4format.Reader(blob).tensors[0]
    return next(j for j, p in enumerate(t.planes)
                if p.codec == codec and (kind is None or p.kind == kind))


@pytest.mark.parametrize("windows", ["one", "one per chunk"])
@pytest.mark.parametrize("where", [0.1, 0.6, 0.95])
def test_a_corrupt_block_in_any_chunk_is_named_as_the_cpu_reader_names_it(
        monkeypatch, windows: str, where: float) -> None:
    if windows == "one per chunk":
        monkeypatch.setattr(decode_large, "TABLE_SHARE", 1 << 40)
    blob = _blob(_weights(2))
    j = _plane(blob, codecs.RANS)

    def damage(stored: np.ndarray) -> np.ndarray:
        # a word of a block that many chunks come before when ``where`` is late
        k = int(stored.size * where)
        stored[k] ^= 0x5A
        stored[k + 1] ^= 0x11
        return stored

    bad = _rewrite(blob, "w", j, damage)
    with pytest.raises(s4format.S4Error) as cpu:
        s4format.Reader(bad).read_raw(0)
    seen = _chunks_seen(monkeypatch)
    with pytest.raises(s4format.S4Error) as got:
        decode_large.load_large(s4format.Reader(bad), 0, torch.empty(2 * N, dtype=torch.uint8),
                           1 << 19)
    assert seen and seen[0] * 3 <= 2 * N
    assert type(got.value) is type(cpu.value) and str(got.value) == str(cpu.value)


@pytest.mark.parametrize("windows", ["one", "one per chunk"])
def test_a_field_overflow_in_a_late_chunk_is_flagged(monkeypatch, windows: str) -> None:
    # a mantissa value wider than its 7 bits near the tensor's end: the merge of a late chunk
    # (the merge flag of a late window) finds it, and the CPU reader words it
    if windows == "one per chunk":
        monkeypatch.setattr(decode_large, "TABLE_SHARE", 1 << 40)
    blob = _blob(_weights(3), mantissa="raw")
    t = s4format.Reader(blob).tensors[0]
    j = next(k for k, p in enumerate(t.planes) if p.kind == layouts.KIND_MANTISSA)
    assert t.planes[j].codec == codecs.RAW

    def wide(stored: np.ndarray) -> np.ndarray:
        stored[stored.size - 1000] |= 0x80
        return stored

    bad = _rewrite(blob, "w", j, wide)
    with pytest.raises(s4format.FormatError) as cpu:
        s4format.Reader(bad).read_raw(0)
    with pytest.raises(s4format.FormatError) as got:
        decode_large.load_large(s4format.Reader(bad), 0, torch.empty(2 * N, dtype=torch.uint8),
                           1 << 19)
    assert str(got.value) == str(cpu.value)


@pytest.mark.parametrize("ws", [1 << 18, 1 << 19, 3 << 19, 1 << 22])
@pytest.mark.parametrize("chain", [False, True])
def test_a_chunk_with_its_tables_fits_the_workspace(ws: int, chain: bool) -> None:
    # the planned decode's device bytes (_need: staging, decoded planes, a window's tables,
    # error codes, the XOR buffer of a chain) fit the workspace unless the chunk is one align
    x = _weights(4)
    r = s4format.Reader(_blob(x))
    if chain:
        r = s4format.Reader(_blob(x ^ np.uint8(1), parent=(r.checkpoint_id, x)), parent=r)
    levels = [decode_chunks.Level(r, 0)]
    if chain:
        levels.append(decode_chunks.Level(r.parent, 0))
    chunk, runs = decode_large._load_chunk(levels, 2 * N, ws, plans=True)
    align = max(lv.align() for lv in levels)
    need = decode_large._need(runs, chunk, 2 * N, chain, False, ws, len(levels))
    assert chunk % align == 0
    assert need <= ws or chunk == align, (need, ws, chunk)
    assert runs[0].bounds[-1][1] == 2 * N and all(
        hi - lo == chunk for lo, hi in runs[0].bounds[:-1])
    # every rANS block of the base tensor is a row of exactly one chunk (a CONST block, as
    # the delta's here, is a row of each chunk that cuts it)
    base = runs[-1]
    assert rans.MODE_RANS in levels[-1].streams.mode
    assert sorted(base.blk.tolist()) == list(range(base.rows))


@pytest.mark.parametrize("delta", [False, True])
def test_an_empty_tensor_has_no_chunks_and_its_hash_is_checked(delta: bool) -> None:
    x = np.zeros(0, np.uint8)
    r = s4format.Reader(_blob(x))
    if delta:
        r = s4format.Reader(_blob(x, parent=(r.checkpoint_id, x)), parent=r)
    decode_large.load_large(r, 0, torch.empty(0, dtype=torch.uint8), 1 << 19)


@pytest.mark.parametrize("on_host", [False, True])
def test_the_device_holds_no_more_than_the_need_it_counts(monkeypatch, on_host: bool) -> None:
    # a chain of three levels of 64 MB, every one hashed, in a few chunks of a 16 MiB
    # workspace: the emulated device's peak stays within what _need counts for the chunk
    # chosen, without its 4 KiB to spare. Each level's leaf digests (24 KB at this size) and
    # the copy _check reads back are counted (a review found both missing). Zeros: CONST
    # streams, quick to emulate.
    n = 32 << 20
    x = np.zeros(2 * n, np.uint8)
    r = s4format.Reader(_blob(x))
    for _ in range(2):
        r = s4format.Reader(_blob(x, parent=(r.checkpoint_id, x)), parent=r)
    ws = 16 << 20
    seen = {}
    real = decode_large._load_chunk

    def spy(levels, nbytes, workspace, on_host=False, plans=False, hashed=None):
        got = real(levels, nbytes, workspace, on_host, plans, hashed)
        chunk, runs = got
        seen["need"] = decode_large._need(runs, chunk, nbytes, len(levels) > 1, on_host, workspace,
                                     hashed)
        seen["chunks"] = len(runs[0].bounds)
        seen["hashed"] = hashed
        return got

    monkeypatch.setattr(decode_large, "_load_chunk", spy)
    out = torch.full((2 * n,), 0xAB, dtype=torch.uint8)
    Device.peak = base = Device.live
    decode_large.load_large(r, 0, out, ws, on_host=on_host)
    assert not out.numpy().any()
    assert seen["chunks"] > 2 and seen["hashed"] == 3
    assert Device.peak - base <= seen["need"] - 4096 and seen["need"] <= ws, (
        Device.peak - base, seen, ws)
