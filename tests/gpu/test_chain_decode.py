"""The GPU decoder reads a delta's chain one level at a time (``decode._apply_parents``), under
the CPU emulation of tests/gpu/emulated.py: whole chains as deep as a default keyframe interval
allows decode byte for byte as the CPU reader reads them (tensors stored whole partway up,
two deltas of one parent, empty tensors, fp32 next to bf16); a batch holds no more device
memory than its tensors' ``device_extra``, which no longer grows with the depth; damage at any
level fails with the CPU reader's words."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import s4format
from s4format import dtypes, hashing, objtree
from s4format.errors import ContentHashError
from s4format.writer import CodedPlane, CodedTensor, Writer
from s4weights.gpu import decode, encode
from tests.gpu.emulated import Device, emulate
from tests.gpu.test_decode_host import _first_cpu_failure


@pytest.fixture(autouse=True)
def on_the_cpu(monkeypatch):
    emulate(monkeypatch)


def _coded(x: np.ndarray, dtype: str, n: int):
    it = encode.Item(dtypes.BY_NAME[dtype], (n,), torch.from_numpy(x))
    return it, next(iter(encode.Encoder().code([it])))


def _levels(depth: int, seed: int = 0, scale: int = 1
            ) -> list[dict[str, tuple[str, np.ndarray]]]:
    """A state (name -> (dtype, raw bytes)) at every level of a chain ``depth`` deltas deep:
    each level flips a few bits of most tensors; "jump" is replaced whole at level 2 (its
    delta would not pay, so it is stored whole there), "twin_a"/"twin_b" start equal (two
    deltas of one parent tensor) and "empty" has no bytes."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    first = {
        "w": ("bfloat16", (torch.randn(90_000 * scale, generator=g) * .02).bfloat16()),
        "m": ("float32", torch.randn(30_000, generator=g) * 1e-3),
        "jump": ("bfloat16", (torch.randn(20_000, generator=g) * .02).bfloat16()),
        "twin_a": ("float16", (torch.randn(12_000, generator=g) * .1).half()),
        "empty": ("bfloat16", torch.zeros(0, dtype=torch.bfloat16)),
    }
    state = {k: (d, t.view(torch.uint8).numpy().copy()) for k, (d, t) in first.items()}
    state["twin_b"] = ("float16", state["twin_a"][1].copy())
    out = [state]
    for level in range(1, depth + 1):
        nxt = {}
        for name, (d, b) in out[-1].items():
            x = b.copy()
            if name == "jump" and level == 2:
                x = rng.integers(0, 256, x.size, dtype=np.uint8)
            elif x.size:
                x[rng.integers(0, x.size, max(1, x.size // 500))] ^= np.uint8(1 << level % 7)
            nxt[name] = (d, x)
        out.append(nxt)
    return out


def _chain(levels, full_at=lambda level, name: False, damage=None, wrong_hash=None
           ) -> list[bytes]:
    """The files of ``levels`` (base first), every tensor after the base an XOR delta of its
    own at the level before unless ``full_at`` says it is stored whole there, coded by the
    (emulated) GPU encoder. ``damage`` (level, name): one byte of that tensor's largest
    plane flipped there, its checksum made for it (only decoding or a content hash finds it).
    ``wrong_hash`` (level, name): that tensor's content hash there is not its bytes', and the
    next level's delta names that hash as its parent (only a content check finds it)."""
    blobs, parent_id = [], None
    bogus = hashing.content_hash(b"not these bytes")
    for level, state in enumerate(levels):
        buf = io.BytesIO()
        with Writer(buf, parent_id=parent_id) as w:
            for name, (d, x) in state.items():
                n = x.size // dtypes.BY_NAME[d].itemsize
                delta = level > 0 and not full_at(level, name)
                base = levels[level - 1][name][1] if delta else None
                it, c = _coded(x if base is None else np.bitwise_xor(x, base), d, n)
                planes = list(c.coded.planes)
                if damage == (level, name):
                    j = max(range(len(planes)), key=lambda k: len(planes[k].payload))
                    q = planes[j]
                    stored = np.array(q.payload, np.uint8, copy=True)
                    stored[stored.size // 2] ^= 0x5A
                    planes[j] = CodedPlane(q.kind, q.index, q.codec, q.decoded_len, stored,
                                           q.params)
                parent_hash = None if base is None else hashing.content_hash(base.tobytes())
                if wrong_hash == (level - 1, name) and parent_hash is not None:
                    parent_hash = bogus
                w.add_coded(name, it.dtype, (n,), CodedTensor(c.coded.layout, tuple(planes)),
                            bogus if wrong_hash == (level, name)
                            else hashing.content_hash(x.tobytes()), parent_hash=parent_hash)
            w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(state)})
        blobs.append(buf.getvalue())
        parent_id = s4format.Reader(blobs[-1]).checkpoint_id
    return blobs


def _open(blobs: list[bytes]) -> s4format.Reader:
    r = None
    for b in blobs:
        r = s4format.Reader(b, parent=r)
    return r


def _full_at(level: int, name: str) -> bool:
    return name == "jump" and level == 2


@pytest.mark.parametrize("depth", [1, 2, 5, 9])
def test_a_chain_decodes_as_the_cpu_reader_reads_it(depth: int) -> None:
    levels = _levels(depth)
    r = _open(_chain(levels, _full_at))
    assert sum(t.is_delta for t in r.tensors) >= len(r.tensors) - 1
    idx = list(range(len(r.tensors)))
    outs = decode.read_tensors(r, idx)
    for i, o in zip(idx, outs):
        t = r.tensors[i]
        want = levels[-1][t.name][1]
        assert np.array_equal(o.numpy(), want), t.name
        assert np.array_equal(r.read_raw(i), want), t.name


def test_every_level_below_is_read_ahead_and_taken(monkeypatch) -> None:
    from s4weights.gpu import staging

    taken: list[bool] = []
    real = staging.Ahead.take
    monkeypatch.setattr(staging.Ahead, "take", lambda self, r, idx: taken.append(
        (got := real(self, r, idx)) is not None) or got)
    levels = _levels(4)
    r = _open(_chain(levels, _full_at))
    idx = list(range(len(r.tensors)))
    outs = decode.read_tensors(r, idx)
    for i, o in zip(idx, outs):
        assert np.array_equal(o.numpy(), r.read_raw(i)), r.tensors[i].name
    assert taken == [True] * 4  # each level below the newest, as one batch, read ahead
    assert staging._AHEAD.held == 0


def test_a_batch_of_deep_deltas_holds_no_more_than_its_device_extra() -> None:
    levels = _levels(6)
    blobs = _chain(levels, _full_at)
    r = _open(blobs)
    idx = [i for i, t in enumerate(r.tensors) if t.raw_nbytes]
    outs = [decode.runtime.device_empty(r.tensors[i].raw_nbytes) for i in idx]
    base = Device.live
    Device.peak = Device.live
    decode.read_tensors(r, idx, outs)
    extra = sum(decode.device_extra(r, i) for i in idx)
    assert Device.peak - base <= extra
    # one level at a time: a delta six deep counts no more than one of depth one, give or take
    # the levels' own coded sizes, where the whole chain would count six levels' bytes
    shallow = _open(blobs[:2])
    for i in idx:
        t = r.tensors[i]
        one = decode.device_extra(shallow, shallow.index_of(t.name))
        assert decode.device_extra(r, i) <= 1.5 * one + 2 * t.raw_nbytes, t.name
        assert decode.device_extra(r, i) < 4 * t.raw_nbytes + 65536, t.name


def _flip_in_place(blob: bytes, name: str) -> bytes:
    """``blob`` with one stored byte of ``name``'s largest plane flipped and its checksum left
    as it was: the plane fails R1 (the file's identity and index unchanged)."""
    r = s4format.Reader(blob)
    t = r.tensors[r.index_of(name)]
    p = max(t.planes, key=lambda q: q.stored_len)
    out = bytearray(blob)
    out[p.offset + p.stored_len // 2] ^= 0x5A
    return bytes(out)


def _fails_as_the_cpu_reader(blobs: list[bytes]) -> s4format.S4Error:
    """Assert that the chain of ``blobs`` read on the GPU fails with the CPU reader's first
    failure, and return it."""
    cpu = _first_cpu_failure(_open(blobs))
    assert cpu is not None
    r = _open(blobs)
    with pytest.raises(s4format.S4Error) as got:
        decode.read_tensors(r, list(range(len(r.tensors))))
    assert type(got.value) is type(cpu) and str(got.value) == str(cpu), (cpu, got.value)
    return cpu


@pytest.mark.parametrize("level", [0, 2, 4])
@pytest.mark.parametrize("how", ["decoding finds it", "its checksum finds it"])
@pytest.mark.parametrize("name", ["w", "twin_a"])
def test_damage_at_any_level_fails_as_the_cpu_reader_reads_it(level: int, how: str,
                                                                name: str) -> None:
    levels = _levels(5, seed=1)
    if how == "decoding finds it":
        blobs = _chain(levels, _full_at, damage=(level, name))
    else:
        blobs = _chain(levels, _full_at)
        blobs[level] = _flip_in_place(blobs[level], name)
    cpu = _first_cpu_failure(_open(blobs))
    r = _open(blobs)
    idx = list(range(len(r.tensors)))
    if cpu is None:
        # the twins' base tensors share one content hash, so both deltas of level 1 read the
        # later twin: damage to the other in the base is never read, by either reader
        assert (level, name) == (0, "twin_a")
        for i, o in zip(idx, decode.read_tensors(r, idx)):
            assert np.array_equal(o.numpy(), r.read_raw(i))
        return
    with pytest.raises(s4format.S4Error) as got:
        decode.read_tensors(r, idx)
    assert type(got.value) is type(cpu) and str(got.value) == str(cpu), (cpu, got.value)


@pytest.mark.parametrize("upper,lower", [(3, 1), (4, 2), (2, 0)])
def test_damage_at_two_levels_fails_with_the_upper_one_as_the_cpu_reader(upper: int,
                                                                          lower: int) -> None:
    # one plane damaged at two levels (decoding finds the upper one, the checksum the lower):
    # the GPU meets the lower first, the CPU reader (top down) the upper (a review found the
    # lower's raised: the files' names, all "<buffer>", could not tell the levels apart)
    blobs = _chain(_levels(5, seed=1), _full_at, damage=(upper, "w"))
    blobs[lower] = _flip_in_place(blobs[lower], "w")
    _fails_as_the_cpu_reader(blobs)


@pytest.mark.parametrize("level", [1, 2, 3])
def test_a_wrong_hash_partway_up_is_found_at_its_level(level: int) -> None:
    # a tensor partway up whose content hash is not its bytes' (and the next delta names that
    # hash as its parent): the CPU reader checks every level, and so does the GPU, though the
    # chain's last level would come out right
    levels = _levels(4, seed=2)
    blobs = _chain(levels, _full_at, wrong_hash=(level, "m"))
    cpu = _first_cpu_failure(_open(blobs))
    assert isinstance(cpu, ContentHashError)
    r = _open(blobs)
    with pytest.raises(ContentHashError) as got:
        decode.read_tensors(r, list(range(len(r.tensors))))
    assert str(got.value) == str(cpu)


@pytest.mark.parametrize("depth", [0, 3])
def test_chunks_copied_down_to_a_host_destination(monkeypatch, depth: int) -> None:
    # decode_large.load_large(on_host=True): each chunk is built in a device buffer within the
    # workspace and copied into host memory (a restarted process's parent read)
    from s4weights.gpu import decode_chunks, decode_large

    levels = _levels(depth, seed=3, scale=8)
    r = _open(_chain(levels, _full_at))
    i = r.index_of("w")
    assert decode_large.chunkable(r, i)
    out = torch.empty(r.tensors[i].raw_nbytes, dtype=torch.uint8)
    ws = 1 << 20
    level = decode_chunks.Level(r, i)
    assert decode_large._load_chunk([level], out.numel(), ws, True) < out.numel()
    base = Device.live
    Device.peak = Device.live
    decode_large.load_large(r, i, out, ws, on_host=True)
    assert Device.peak - base <= ws
    assert np.array_equal(out.numpy(), levels[-1]["w"][1])


@pytest.mark.parametrize("lgs", [(18, 16), (16, 20), (12, 12)])
def test_chunks_hold_whole_blocks_of_every_level(monkeypatch, lgs) -> None:
    # a chain whose levels were coded with other rANS block sizes: the chunks of a small
    # workspace are whole blocks of the largest (2^16 elements at least), and decode exactly
    from s4weights.gpu import decode_chunks, decode_large

    rng = np.random.default_rng(5)
    n = 700_000
    base = (torch.from_numpy(rng.standard_normal(n).astype(np.float32)) * .02).bfloat16()
    x = [base.view(torch.uint8).numpy().copy()]
    x.append(x[0].copy())
    x[1][rng.integers(0, x[1].size, 3000)] ^= np.uint8(4)
    blobs, parent_id = [], None
    for level, lg in enumerate(lgs):
        data = x[level] if level == 0 else np.bitwise_xor(x[level], x[level - 1])
        it = encode.Item(dtypes.BY_NAME["bfloat16"], (n,), torch.from_numpy(data))
        c = next(iter(encode.Encoder(log2_block=lg).code([it])))
        assert any(p.codec == s4format.codecs.RANS and p.payload[1] == lg
                   for p in c.coded.planes)  # (a rANS plane coded at that block size)
        buf = io.BytesIO()
        with Writer(buf, parent_id=parent_id) as w:
            w.add_coded("w", it.dtype, (n,), c.coded, hashing.content_hash(x[level].tobytes()),
                        parent_hash=None if level == 0
                        else hashing.content_hash(x[level - 1].tobytes()))
            w.set_tree({"w": objtree.TensorRef(0)})
        blobs.append(buf.getvalue())
        parent_id = s4format.Reader(blobs[-1]).checkpoint_id
    r = _open(blobs)
    levels = [decode_chunks.Level(r, 0), decode_chunks.Level(r.parent, 0)]
    align = 2 << max(16, *lgs)
    assert max(lv.align() for lv in levels) == align
    chunks = []
    real = decode_large._load_chunk

    def spy(*a, **k):
        got = real(*a, **k)
        chunks.append(got[0] if isinstance(got, tuple) else got)  # (chunk, plans)
        return got

    monkeypatch.setattr(decode_large, "_load_chunk", spy)
    out = torch.empty(2 * n, dtype=torch.uint8)
    decode_large.load_large(r, 0, out, 1 << 20)
    assert chunks and all(c % align == 0 for c in chunks)
    assert chunks[0] < 2 * n or align > 2 * n  # (in chunks, where blocks allow)
    assert np.array_equal(out.numpy(), x[-1])


@pytest.mark.parametrize("source", ["file", "buffer"])
@pytest.mark.parametrize("compact", [True, False])
def test_chunked_levels_read_their_planes_in_pieces_or_one_by_one(monkeypatch, tmp_path,
                                                                 compact: bool,
                                                                 source: str) -> None:
    # a compact tensor's span is read from a file in parallel pieces (staging.read_into), or
    # taken as a view of a source already in memory; planes far apart (compact_bounds None)
    # one by one; every way decodes the chain exactly
    from s4weights.gpu import decode_large, staging

    monkeypatch.setattr(staging, "READ_PIECE", 1 << 14)  # (pieces of a small span)
    pieces = []
    real = staging.read_into
    monkeypatch.setattr(staging, "read_into",
                        lambda r, o, d: pieces.append(d.size) or real(r, o, d))
    if not compact:
        monkeypatch.setattr(s4format.Reader, "compact_bounds", lambda self, t: None)
    spans = []  # whether each plane came from the span read (else read alone)
    real_stored = s4format.Reader.read_stored
    monkeypatch.setattr(s4format.Reader, "read_stored", lambda self, t, j, span=None: (
        spans.append(span is not None), real_stored(self, t, j, span))[1])
    levels = _levels(2, seed=6, scale=8)
    blobs = _chain(levels, _full_at)
    if source == "file":
        r = None
        for k, b in enumerate(blobs):
            (tmp_path / f"{k}.s4w").write_bytes(b)
            r = s4format.Reader(tmp_path / f"{k}.s4w", parent=r)
    else:
        r = _open(blobs)
    i = r.index_of("w")
    out = torch.empty(r.tensors[i].raw_nbytes, dtype=torch.uint8)
    decode_large.load_large(r, i, out, 2 << 20, on_host=True)
    assert np.array_equal(out.numpy(), levels[-1]["w"][1])
    assert spans and all(x == compact for x in spans)
    if source == "buffer":
        assert not pieces  # (views)
        return
    assert (len(pieces) == 3) == compact  # one span per level
    assert not compact or max(pieces) >= 2 * (1 << 14)  # (the base's: large enough to go
    # in pieces)


# -- a restarted process's parent read (chain._read_on_gpu), emulated ----------------------

@pytest.fixture()
def read_on_gpu(monkeypatch):
    """chain._read_on_gpu under the emulation (its torch and the loader's CUDA calls)."""
    import contextlib

    from s4weights import chain
    from s4weights.gpu import device
    from tests.gpu.emulated import Torch

    monkeypatch.setattr(chain, "torch", Torch())
    monkeypatch.setattr(device, "available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device", lambda *a, **k: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    return lambda r, ws: chain._read_on_gpu(r, "cuda", ws)


def _file(tensors: dict[str, tuple[str, np.ndarray]], hashes: dict | None = None) -> bytes:
    """A file of ``tensors`` (name -> (dtype, raw bytes); "int64" ones coded by the CPU
    writer, which the GPU does not decode), coded by the (emulated) GPU encoder; ``hashes``
    overrides content hashes by name."""
    buf = io.BytesIO()
    with Writer(buf) as w:
        for name, (d, x) in tensors.items():
            if d == "int64":
                w.add(name, x.view(np.int64))
                continue
            n = x.size // dtypes.BY_NAME[d].itemsize
            it, c = _coded(x, d, n)
            w.add_coded(name, it.dtype, (n,), c.coded,
                        (hashes or {}).get(name, hashing.content_hash(x.tobytes())))
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(tensors)})
    return buf.getvalue()


def test_a_parent_read_holds_no_more_than_the_workspace(read_on_gpu, monkeypatch) -> None:
    from s4weights.gpu import decode_large

    # tensors that decode with little room (all-zero bytes) still count their decoded bytes
    # until each is copied down (a review found 32 MiB held under a 4 MiB workspace)
    zeros = {f"z{k}": ("uint8", np.zeros(1 << 20, np.uint8)) for k in range(32)}
    ws = 4 << 20
    r = s4format.Reader(_file(zeros))
    base = Device.live
    Device.peak = Device.live
    out, _host = read_on_gpu(r, ws)
    assert Device.peak - base <= ws
    assert all(not np.asarray(out[k].data).any() for k in zeros)
    # and a chain, batches and chunks (its "w" needs more than the workspace)
    levels = _levels(3, seed=4, scale=8)
    r = _open(_chain(levels, _full_at))
    ws = 2 << 20
    large = []
    real = decode_large.load_large
    monkeypatch.setattr(decode_large, "load_large", lambda *a, **k: large.append(a[0].tensors[
        a[1]].name) or real(*a, **k))
    base = Device.live
    Device.peak = Device.live
    out, _host = read_on_gpu(r, ws)
    assert Device.peak - base <= ws
    assert large == ["w"]
    for name, (_d, x) in levels[-1].items():
        assert np.asarray(out[name].data).tobytes() == x.tobytes(), name


@pytest.mark.parametrize("case", ["empty tensor's hash", "a CPU tensor before a GPU one"])
def test_a_parent_read_fails_as_the_cpu_reader_reads_it(read_on_gpu, case: str) -> None:
    g = torch.Generator().manual_seed(5)

    def bf16(n: int) -> tuple[str, np.ndarray]:
        return "bfloat16", (torch.randn(n, generator=g) * .02).bfloat16().view(
            torch.uint8).numpy().copy()

    if case == "empty tensor's hash":  # never decoded, still checked
        blob = _file({"e": ("bfloat16", np.zeros(0, np.uint8)), "a": bf16(1000)},
                     {"e": hashing.content_hash(b"not empty")})
    else:  # the GPU's batch decodes "c" before the CPU reads "b": both damaged
        blob = _file({"a": bf16(50_000), "b": ("int64", np.arange(50_000).view(np.uint8)),
                      "c": bf16(50_000)})
        blob = _flip_in_place(_flip_in_place(blob, "b"), "c")
    cpu = _first_cpu_failure(s4format.Reader(blob, verify=True))
    assert cpu is not None
    with pytest.raises(s4format.S4Error) as got:
        read_on_gpu(s4format.Reader(blob, verify=True), 4 << 20)
    assert type(got.value) is type(cpu) and str(got.value) == str(cpu), (cpu, got.value)


def test_masked_levels_decode_on_the_host_within_a_gpu_chain() -> None:
    """Levels written by the CPU coder, whose sparse deltas are masked (format 1.4), between
    levels the GPU coded: the GPU decoder leaves a masked tensor's own level to the CPU reader
    and applies the levels below and above it on the GPU, byte for byte as the CPU reader
    reads them."""
    levels = _levels(4, seed=2)
    blobs = _mixed_chain(levels, cpu_at=(1, 2))
    r = _open(blobs)
    masked = [t.name for t in r.parent.parent.tensors if t.masked]
    assert "w" in masked and "m" in masked
    idx = list(range(len(r.tensors)))
    assert not any(decode.decodable(r.parent.parent, i) for i, t in
                   enumerate(r.parent.parent.tensors) if t.masked)
    for i, o in zip(idx, decode.read_tensors(r, idx)):
        want = levels[-1][r.tensors[i].name][1]
        assert np.array_equal(o.numpy(), want), r.tensors[i].name
        assert np.array_equal(r.read_raw(i), want), r.tensors[i].name


def _mixed_chain(levels, cpu_at=None, parents=None) -> list[bytes]:
    """The files of ``levels`` (base first), each level a delta of the one before: coded by
    the CPU coder (masking where few words changed) at the levels ``cpu_at`` (all: None),
    by the (emulated) GPU coder at the others. ``parents`` (level -> {name: bytes}): the
    parent a tensor's delta is taken against there instead (one the level below may not
    hold; CPU levels only)."""
    blobs, parent_id = [], None
    for level, state in enumerate(levels):
        buf = io.BytesIO()
        with Writer(buf, parent_id=parent_id) as w:
            for name, (d, x) in state.items():
                dt, n = dtypes.BY_NAME[d], x.size // dtypes.BY_NAME[d].itemsize
                base = (parents or {}).get(level, {}).get(name)
                if base is None and level:
                    base = levels[level - 1][name][1]
                if cpu_at is None or level in cpu_at:
                    w.add(name, s4format.Tensor(dt, (n,), x),
                          parent=None if base is None else s4format.Tensor(dt, (n,), base))
                    continue
                it, c = _coded(x if base is None else np.bitwise_xor(x, base), d, n)
                w.add_coded(name, it.dtype, (n,), c.coded, hashing.content_hash(x.tobytes()),
                            parent_hash=None if base is None
                            else hashing.content_hash(base.tobytes()))
            w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(state)})
        blobs.append(buf.getvalue())
        parent_id = s4format.Reader(blobs[-1]).checkpoint_id
    return blobs


@pytest.mark.parametrize("depth", [1, 3])
def test_a_delta_the_gpu_does_not_decode_has_its_parents_decoded_on_the_gpu(monkeypatch,
                                                                             depth: int) -> None:
    # A chain the CPU coder wrote (masked deltas, zstd planes) loaded on the GPU: the CPU
    # reader decodes each such delta's own level, the GPU the tensors below it, stored whole.
    levels = _levels(depth, seed=3)
    r = _open(_mixed_chain(levels))
    calls: list[tuple[s4format.Reader, int, bool]] = []
    real = decode.read_on_cpu
    monkeypatch.setattr(decode, "read_on_cpu", lambda reader, i, out, own=False: (
        calls.append((reader, i, own)), real(reader, i, out, own))[1])
    idx = list(range(len(r.tensors)))
    for i, o in zip(idx, decode.read_tensors(r, idx)):
        assert np.array_equal(o.numpy(), levels[-1][r.tensors[i].name][1]), r.tensors[i].name
    masked = [i for i, t in enumerate(r.tensors) if t.masked]
    assert masked and not any(decode.decodable(r, i) for i in masked)
    assert {(r, i, True) for i in masked} <= set(calls)
    # no delta is read whole (parents and all) by the CPU reader, and no tensor stored whole
    # that the GPU decodes is read by it either
    whole = [(reader.tensors[i].name, own) for reader, i, own in calls
             if not own and reader.tensors[i].raw_nbytes
             and (reader.tensors[i].is_delta or decode.decodable(reader, i))]
    assert whole == []


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("name", ["w", "m"])
def test_damage_below_or_in_a_level_the_cpu_decodes_fails_as_the_cpu_reader(level: int,
                                                                              name: str) -> None:
    blobs = _mixed_chain(_levels(1, seed=3))
    assert s4format.Reader(blobs[1]).tensors[0].masked
    blobs[level] = _flip_in_place(blobs[level], name)
    _fails_as_the_cpu_reader(blobs)


def test_a_level_the_cpu_decodes_against_a_parent_the_base_lacks_fails_as_the_cpu_reader(
        ) -> None:
    levels = _levels(1, seed=3)
    other = levels[0]["w"][1].copy()
    other[:64] ^= np.uint8(1)  # (a "w" the base does not hold)
    blobs = _mixed_chain(levels, parents={1: {"w": other}})
    assert not decode.decodable(_open(blobs), 0)
    assert isinstance(_fails_as_the_cpu_reader(blobs), s4format.errors.ParentMismatchError)


@pytest.fixture
def as_tasks(monkeypatch) -> list[tuple[str, int]]:
    """Every tensor the CPU decodes in a GPU batch decoded as a task of a pool of four threads
    (a tensor under ``threads.SHARE_MIN`` is decoded at once, on the batch's thread); returns,
    for each task submitted, the tensor's name and how many of the batch's tasks were in
    flight before it."""
    from s4format import threads

    monkeypatch.setattr(threads, "SHARE_MIN", 0)
    pool = threads.Pool(4)
    monkeypatch.setattr(threads, "_pool", pool)
    submitted: list[tuple[str, int]] = []
    real = pool.submit

    def submit(fn, *args):
        host = getattr(fn, "__self__", None)
        if isinstance(host, decode._OnHost):
            submitted.append((host.reader.tensors[host.idx[args[0]]].name, len(host.tasks)))
        return real(fn, *args)
    monkeypatch.setattr(pool, "submit", submit)
    return submitted


@pytest.mark.parametrize("depth", [1, 3])
def test_levels_the_cpu_decodes_side_by_side_read_as_the_cpu_reader(
        as_tasks: list[tuple[str, int]], depth: int) -> None:
    levels = _levels(depth, seed=3)
    r = _open(_mixed_chain(levels, cpu_at=(depth,)))
    idx = list(range(len(r.tensors)))
    for i, o in zip(idx, decode.read_tensors(r, idx)):
        assert np.array_equal(o.numpy(), levels[-1][r.tensors[i].name][1]), r.tensors[i].name
    assert {"w", "m"} <= {name for name, _ in as_tasks}
    assert max(before for _name, before in as_tasks) > 0  # (side by side)


def test_levels_the_cpu_decodes_side_by_side_hold_at_most_the_bytes_allowed(
        as_tasks: list[tuple[str, int]], monkeypatch) -> None:
    # with room for one tensor's bytes, each task waits for the one before it to be taken
    monkeypatch.setattr(decode, "AHEAD", 1)
    levels = _levels(3, seed=3)
    r = _open(_mixed_chain(levels))
    idx = list(range(len(r.tensors)))
    for i, o in zip(idx, decode.read_tensors(r, idx)):
        assert np.array_equal(o.numpy(), levels[-1][r.tensors[i].name][1]), r.tensors[i].name
    assert len(as_tasks) > 1 and all(before == 0 for _name, before in as_tasks)


@pytest.mark.parametrize("level", [0, 1])
@pytest.mark.parametrize("name", ["w", "m", "twin_b"])
def test_levels_the_cpu_decodes_side_by_side_fail_as_the_cpu_reader(
        as_tasks: list[tuple[str, int]], level: int, name: str) -> None:
    blobs = _mixed_chain(_levels(1, seed=3))
    blobs[level] = _flip_in_place(blobs[level], name)
    _fails_as_the_cpu_reader(blobs)
