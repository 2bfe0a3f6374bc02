"""Masked tensors (format 1.4, spec/planes.md "Masked tensors"): the kernels against a plain
numpy rendering of the spec, the writer's choice, exact round trips of every 16-bit pattern,
and files that break the mask's rules."""

from __future__ import annotations

import io

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance import craft, generate
from s4format import FormatError, Reader, Tensor, Writer, dtypes, hashing, layouts, masked, verify
from s4format.errors import ChecksumError, ContentHashError
from s4format.writer import CodedPlane, CodedTensor

UINT = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def spec_mask(words: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The mask and kept words as planes.md defines them, in plain numpy."""
    nonzero = words != 0
    return np.packbits(nonzero, bitorder="little"), words[nonzero]


def byte_planes(kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """2-byte kept words as the bytes layout's two planes: low bytes, then high bytes."""
    b = kept.view(np.uint8)
    return b[0::2].copy(), b[1::2].copy()


@settings(max_examples=150, deadline=None)
@given(word=st.sampled_from([1, 2, 4, 8]), n=st.integers(0, 3000),
       share=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1), xor=st.booleans())
def test_gather_and_expand_follow_the_spec(word: int, n: int, share: float, seed: int,
                                           xor: bool) -> None:
    rng = np.random.default_rng(seed)
    words = rng.integers(1, 1 << (8 * word) - 1, n, dtype=np.uint64, endpoint=True) \
        .astype(UINT[word])
    words[rng.random(n) >= share] = 0
    mask, starts = masked.mask_of(words)
    kept = masked.kept_words(words, mask, starts)
    want_mask, want_kept = spec_mask(words)
    assert int(starts[-1]) == want_kept.size
    assert mask.tobytes() == want_mask.tobytes() and kept.tobytes() == want_kept.tobytes()
    # the mask of a delta, from the tensor and its parent without their XOR
    parent = rng.integers(0, 256, n * word, dtype=np.uint8).view(UINT[word])
    tensor = parent ^ words
    d_mask, d_starts = masked.mask_of(tensor, parent)
    d_kept = masked.kept_words(tensor, d_mask, d_starts, parent)
    assert (d_mask.tobytes(), d_kept.tobytes()) == (mask.tobytes(), kept.tobytes())
    base = rng.integers(0, 256, n * word, dtype=np.uint8) if xor else np.zeros(n * word,
                                                                                 np.uint8)
    out = base.copy()
    masked.expand(mask, kept.view(np.uint8), out, word, xor)
    assert out.tobytes() == (base ^ words.view(np.uint8)).tobytes()


def test_pieces_cut_the_mask_at_whole_words() -> None:
    """Over several pieces of work (each with its start among the kept words), at a partial
    last mask byte."""
    n = 3 * masked.PIECE + 13
    rng = np.random.default_rng(1)
    words = np.where(rng.random(n) < 0.3, rng.integers(1, 2**16, n), 0).astype(np.uint16)
    words[-1] = 7  # the last word kept: the last mask byte's bit 4
    mask, starts = masked.mask_of(words)
    kept = masked.kept_words(words, mask, starts)
    assert (mask.tobytes(), kept.tobytes()) == tuple(a.tobytes() for a in spec_mask(words))
    parent = rng.integers(0, 2**16, n).astype(np.uint16)
    d_mask, d_starts = masked.mask_of(parent ^ words, parent)
    assert (d_starts == starts).all() and d_mask.tobytes() == mask.tobytes()
    assert masked.kept_words(parent ^ words, d_mask, d_starts, parent).tobytes() == \
        kept.tobytes()
    out = np.zeros(n * 2, np.uint8)
    masked.expand(mask, kept.view(np.uint8), out, 2, False)
    assert out.tobytes() == words.tobytes()


@pytest.mark.parametrize("word", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("xor", [False, True])
def test_expand_hashes_the_leaves_it_writes(word: int, xor: bool) -> None:
    """The leaf digests ``expand`` fills as it puts words in place (a piece's leaves while its
    bytes are in cache; words of 16 bytes after) are those of the bytes it leaves, over several
    pieces and a partial last leaf."""
    n = (2 * masked.PIECE + 4099) // max(1, word // 4)
    rng = np.random.default_rng(word)
    rows = rng.integers(1, 256, (n, word), dtype=np.uint8)
    rows[rng.random(n) < 0.7] = 0
    keep = rows.any(axis=1)
    mask = np.packbits(keep, bitorder="little")
    base = rng.integers(0, 256, n * word, dtype=np.uint8) if xor else np.zeros(n * word,
                                                                                 np.uint8)
    out = base.copy()
    leaves = hashing.leaves_for(out.size)
    masked.expand(mask, rows[keep].reshape(-1), out, word, xor, leaves)
    assert out.tobytes() == (base ^ rows.reshape(-1)).tobytes()
    assert leaves.tolist() == hashing.leaf_digests(out).tolist()
    assert hashing.content_hash_of(out.size, leaves) == hashing.content_hash(out)


def test_words_of_sixteen_bytes_take_the_numpy_path() -> None:
    rng = np.random.default_rng(2)
    rows = rng.integers(0, 256, (501, 16), dtype=np.uint8)
    rows[rng.random(501) < 0.6] = 0
    keep = rows.any(axis=1)
    mask = np.packbits(keep, bitorder="little")
    out = np.zeros(rows.size, np.uint8)
    masked.expand(mask, rows[keep].reshape(-1), out, 16, False)
    assert out.tobytes() == rows.tobytes()
    bad = rows[keep].copy()
    bad[0] = 0
    with pytest.raises(FormatError, match="keeps is zero"):
        masked.expand(mask, bad.reshape(-1), np.zeros(rows.size, np.uint8), 16, False)


@pytest.mark.parametrize(("change", "match"), [
    (lambda m, k: (np.concatenate([m[:-1], [m[-1] | 0x80]]), k), "past its last word"),
    (lambda m, k: (m, k[1:]), "sets .* bits, its planes hold"),
    (lambda m, k: (m, np.concatenate([[0], k[1:]]).astype(k.dtype)), "keeps is zero"),
])
def test_expand_refuses_a_mask_that_breaks_a_rule(change, match: str) -> None:
    words = np.array([0, 5, 0, 0, 9, 1, 0, 0, 0, 4, 0], np.uint16)  # 11 words
    mask, kept = change(*spec_mask(words))
    with pytest.raises(FormatError, match=match):
        masked.expand(mask, kept.view(np.uint8), np.zeros(22, np.uint8), 2, False)


@settings(max_examples=150, deadline=None)
@given(n=st.integers(0, 5000), share=st.floats(0.0, 1.0), seed=st.integers(0, 2**32 - 1),
       xor=st.booleans())
def test_expand_bytes_equals_expand(n: int, share: float, seed: int, xor: bool) -> None:
    """The one-call form for 2-byte words kept as two byte planes writes what ``expand`` does
    with their words, and the same leaf digests."""
    rng = np.random.default_rng(seed)
    words = rng.integers(1, 2**16, n).astype(np.uint16)
    words[rng.random(n) >= share] = 0
    mask, kept = spec_mask(words)
    base = rng.integers(0, 256, 2 * n, dtype=np.uint8) if xor else np.zeros(2 * n, np.uint8)
    want, got = base.copy(), base.copy()
    want_leaves, leaves = hashing.leaves_for(2 * n), hashing.leaves_for(2 * n)
    masked.expand(mask, kept.view(np.uint8), want, 2, xor, want_leaves)
    assert masked.expand_bytes(mask, *byte_planes(kept), got, xor, leaves)
    assert got.tobytes() == want.tobytes() == (base ^ words.view(np.uint8)).tobytes()
    assert leaves.tolist() == want_leaves.tolist()


def test_expand_bytes_through_a_reused_buffer() -> None:
    """Kept words past 32K (their buffer reused from :mod:`s4format.scratch`), every mask
    byte's bits, a partial last byte."""
    n = 200_003
    rng = np.random.default_rng(4)
    words = np.where(rng.random(n) < 0.4, rng.integers(1, 2**16, n), 0).astype(np.uint16)
    words[-1] = 3
    mask, kept = spec_mask(words)
    out = np.zeros(2 * n, np.uint8)
    for _ in range(2):  # (the second call takes the first one's buffer)
        out[:] = 0
        assert masked.expand_bytes(mask, *byte_planes(kept), out, False)
        assert out.tobytes() == words.tobytes()


@pytest.mark.parametrize("change", [
    lambda m, lo, hi: (np.concatenate([m[:-1], [m[-1] | 0x80]]), lo, hi),  # past the last word
    lambda m, lo, hi: (m, lo[1:], hi[1:]),  # fewer kept words than set bits
    lambda m, lo, hi: (m, lo, hi[1:]),  # planes of two lengths
    lambda m, lo, hi: (m[:-1], lo, hi),  # a mask of another length
    lambda m, lo, hi: (m, np.concatenate([[0], lo[1:]]).astype(np.uint8),
                       np.concatenate([[0], hi[1:]]).astype(np.uint8)),  # a zero word kept
])
def test_expand_bytes_refuses_what_expand_refuses(change) -> None:
    """False where ``expand`` raises (the reader then decodes plane by plane, which names the
    rule), and nothing written where the count is wrong."""
    words = np.array([0, 5, 0, 0, 9, 1, 0, 0, 0, 4, 0], np.uint16)  # 11 words
    mask, kept = spec_mask(words)
    m, lo, hi = change(mask, *byte_planes(kept))
    out = np.full(22, 0xAB, np.uint8)
    assert not masked.expand_bytes(m, lo, hi, out, True)
    if lo.size == hi.size and lo.size != kept.size:
        assert (out == 0xAB).all()


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_a_level_past_a_piece_is_placed_in_one_call_up_to_its_bound(monkeypatch,
                                                                    dtype: str) -> None:
    """A masked level of more than a piece's words but at most ``ONE_CALL_WORDS`` goes
    through ``expand_bytes``; past the bound, a piece at a time: the same bytes both ways,
    read whole and as the level alone."""
    n = masked.PIECE + 4099
    rng = np.random.default_rng(8)
    parent = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    xor = np.where(rng.random(n) < 0.45, rng.integers(1, 1 << 16, n), 0).astype(np.uint16)
    dt = dtypes.by_name(dtype)
    base = {"w": Tensor(dt, (n,), parent.view(np.uint8))}
    child = {"w": Tensor(dt, (n,), (parent ^ xor).view(np.uint8))}
    parent_blob, parent_result = _save(base)
    blob, _result = _save(child, base, parent_result.checkpoint_id)
    calls = []
    one_call = masked.expand_bytes
    monkeypatch.setattr(masked, "expand_bytes", lambda *a: calls.append(1) or one_call(*a))
    got = {}
    for bound in (masked.ONE_CALL_WORDS, n - 1):
        monkeypatch.setattr(masked, "ONE_CALL_WORDS", bound)
        calls.clear()
        with Reader(blob, parent=parent_blob) as r:
            assert r.tensors[0].masked and r.tensors[0].layout is layouts.BYTES
            got[bound] = r.read_raw(0).tobytes(), r.read_own(0).tobytes()
        assert len(calls) == (2 if bound >= n else 0)
    assert set(got.values()) == {(child["w"].data.tobytes(), xor.tobytes())}


# -- the writer --------------------------------------------------------------------------------

def _bf16(x: np.ndarray) -> np.ndarray:
    return (x.astype("<f4").view("<u4") >> 16).astype("<u2")


def _save(tensors: dict[str, Tensor], parents: dict[str, Tensor] | None = None,
          parent_id: bytes | None = None, policy: str = "auto"):
    buf = io.BytesIO()
    with Writer(buf, parent_id=parent_id, policy=policy) as w:
        for name, t in tensors.items():
            w.add(name, t, parent=None if parents is None else parents[name])
        result = w.close()
    return buf.getvalue(), result


def _chain(changed: float, policy: str = "auto", n: int = 40000):
    rng = np.random.default_rng(3)
    base = {"w": Tensor.from_numpy(_bf16(rng.standard_normal(n)), "bfloat16"),
            "f": Tensor.from_numpy(rng.standard_normal(n).astype("<f4")),
            "h": Tensor.from_numpy(rng.standard_normal(n).astype("<f2")),
            "q": Tensor.from_numpy(rng.integers(-1000, 1000, n).astype("<i8"))}
    child = {}
    for name, t in base.items():
        raw = np.array(t.data, copy=True).view(UINT[t.dtype.itemsize])
        at = rng.random(raw.size) < changed
        raw[at] ^= rng.integers(1, 128, int(at.sum())).astype(raw.dtype)  # low bits move
        child[name] = Tensor(t.dtype, t.shape, raw.view(np.uint8))
    parent_blob, parent = _save(base, policy=policy)
    blob, result = _save(child, base, parent.checkpoint_id, policy)
    return parent_blob, blob, result, child


@pytest.mark.parametrize("changed", [0.0, 0.01, 0.2, 0.45, 0.7])
def test_sparse_deltas_are_masked_and_read_back_exactly(changed: float) -> None:
    parent_blob, blob, result, child = _chain(changed)
    assert result.delta_count == 4
    with Reader(blob, parent=parent_blob) as r:
        assert [(t.name, t.masked, t.planes[0].label) for t in r.tensors] == [
            (name, True, "mask") for name in child]
        for i, t in enumerate(r.tensors):
            assert r.read_raw(i).tobytes() == child[t.name].data.tobytes(), t.name
        assert verify(r) == []
        assert r.version >= (1, 4)


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_every_16_bit_change_round_trips_as_kept_bytes(dtype: str) -> None:
    """A bf16 or fp16 delta's kept words are stored as two byte planes: each of the 65,535
    non-zero XOR patterns, among three times as many unchanged words, reads back exactly, on
    every parent word."""
    rng = np.random.default_rng(11)
    n = 4 * 65536
    parent = rng.integers(0, 1 << 16, n, dtype=np.uint16)
    xor = np.zeros(n, np.uint16)
    xor[rng.permutation(n)[:65536]] = np.arange(65536, dtype=np.uint16)
    base = {"w": Tensor(dtypes.by_name(dtype), (n,), parent.view(np.uint8))}
    child = {"w": Tensor(dtypes.by_name(dtype), (n,), (parent ^ xor).view(np.uint8))}
    parent_blob, parent_result = _save(base)
    blob, _result = _save(child, base, parent_result.checkpoint_id)
    with Reader(blob, parent=parent_blob) as r:
        t = r.tensors[0]
        assert (t.masked, t.layout, [p.label for p in t.planes]) == (
            True, layouts.BYTES, ["mask", "byte0", "byte1"])
        assert t.planes[1].decoded_len == 65535
        assert r.read_raw(0).tobytes() == child["w"].data.tobytes()
        assert verify(r) == []


def test_a_kept_low_byte_of_noise_gets_no_zstd_trial(monkeypatch) -> None:
    """A bf16 delta's kept low byte is chosen for by a mantissa's rules (zstd only where runs
    show), not an integer byte's (zstd tried on every plane). (Here the changes stay in the
    low byte: the top byte is all zero, one symbol, which no coder is tried on.)"""
    from s4format.codecs.zstd import ZstdCodec

    tried = []
    original = ZstdCodec.estimate_view

    def spy(self, view):
        tried.append(view.size)
        return original(self, view)
    monkeypatch.setattr(ZstdCodec, "estimate_view", spy)
    _parent_blob, blob, _result, _child = _chain(0.3, n=200_000)
    with Reader(blob) as r:
        w = r.tensors[r.index_of("w")]
    assert [p.label for p in w.planes] == ["mask", "byte0", "byte1"]
    assert w.planes[1].decoded_len not in tried


def test_fp32_kept_words_keep_their_layout() -> None:
    _parent_blob, blob, _result, _child = _chain(0.2)
    with Reader(blob) as r:
        assert [(t.name, t.layout.name) for t in r.tensors] == [
            ("w", "bytes"), ("f", "fp32"), ("h", "bytes"), ("q", "bytes")]


def test_a_delta_that_changed_most_words_is_not_masked() -> None:
    parent_blob, blob, _result, child = _chain(0.85)
    with Reader(blob, parent=parent_blob) as r:
        assert not any(t.masked for t in r.tensors)
        assert all(r.read_raw(i).tobytes() == child[t.name].data.tobytes()
                   for i, t in enumerate(r.tensors))


@pytest.mark.parametrize("policy", ["auto-1.0", "seed"])
def test_policies_of_earlier_minors_never_mask(policy: str) -> None:
    parent_blob, blob, _result, child = _chain(0.05, policy)
    with Reader(blob, parent=parent_blob) as r:
        assert r.version < (1, 4)
        assert not any(t.masked for t in r.tensors)
        assert all(r.read_raw(i).tobytes() == child[t.name].data.tobytes()
                   for i, t in enumerate(r.tensors))


def test_an_unchanged_tensor_is_a_mask_and_empty_planes() -> None:
    parent_blob, blob, _result, child = _chain(0.0)
    with Reader(blob, parent=parent_blob) as r:
        t = r.tensors[0]
        assert t.layout is layouts.BYTES  # (a bf16 tensor's kept words: two byte planes)
        assert [p.decoded_len for p in t.planes] == [5000, 0, 0]
        assert t.stored_nbytes < 64
        assert r.read_raw(0).tobytes() == child["w"].data.tobytes()


def test_masking_stores_less_than_the_plain_delta() -> None:
    """On deltas like a fine-tuning step's (a fifth of the words changed in their low bits)
    the masked form stores less than the unmasked XOR under ``auto``."""
    _p, _blob, masked_result, _c = _chain(0.2)
    from s4format import writer

    before = writer.MASKED_MAX
    try:
        writer.MASKED_MAX = -1.0  # nothing masked
        _p, _blob, plain, _c = _chain(0.2)
    finally:
        writer.MASKED_MAX = before
    assert masked_result.stored_nbytes < plain.stored_nbytes


def test_every_16_bit_pattern_round_trips_as_a_masked_delta() -> None:
    """All 65,536 bf16 and fp16 patterns, NaN payloads and -0.0 included, as parent and as
    child (every third pattern changed in two bits)."""
    every = np.arange(1 << 16, dtype=np.uint16)
    other = every.copy()
    other[::3] ^= 0x0101  # a mantissa bit and an exponent bit of every third pattern
    for name in ("bfloat16", "float16"):
        dt = dtypes.by_name(name)
        a, b = Tensor(dt, (every.size,), every.view(np.uint8)), \
            Tensor(dt, (every.size,), other.view(np.uint8))
        parent_blob, parent = _save({"x": a})
        blob, _ = _save({"x": b}, {"x": a}, parent.checkpoint_id)
        with Reader(blob, parent=parent_blob) as r:
            assert r.tensors[0].masked
            assert r.read_raw(0).tobytes() == other.tobytes()
        # and the other way round: the parent is the changed one
        parent_blob, parent = _save({"x": b})
        blob, _ = _save({"x": a}, {"x": b}, parent.checkpoint_id)
        with Reader(blob, parent=parent_blob) as r:
            assert r.read_raw(0).tobytes() == every.tobytes()


def test_a_writer_of_an_earlier_minor_refuses_a_masked_tensor() -> None:
    raw = np.zeros(64, np.uint8)
    coded = CodedTensor(layouts.RAW, (
        CodedPlane(layouts.KIND_MASK, 0, 1, 8, bytes(8)),
        CodedPlane(layouts.KIND_RAW, 0, 1, 0, b"")), masked=True)
    with Writer(io.BytesIO(), policy="seed") as w, pytest.raises(ValueError, match="masked"):
        w.add_coded("t", dtypes.by_name("uint8"), (64,), coded, b"\0" * 16)
    with Writer(io.BytesIO()) as w:  # auto: 1.5
        from s4format import hashing
        w.add_coded("t", dtypes.by_name("uint8"), (64,), coded, hashing.content_hash(raw))


# -- files that break the rules, read through a chain ------------------------------------------

def test_a_damaged_mask_plane_is_named() -> None:
    parent_blob, blob, _result, _child = _chain(0.1)

    def damage(p: craft.Parts) -> None:
        rec = p.tensors[0]["planes"][0]
        at = rec["offset"] - 32
        p.data = p.data[:at] + bytes([p.data[at] ^ 1]) + p.data[at + 1:]
    bad = craft.build(_edited(blob, damage))
    with Reader(bad, parent=parent_blob) as r:
        with pytest.raises(ChecksumError, match="tensor 'w' plane mask: checksum"):
            r.read_raw(0)
        assert [p.plane for p in verify(r)] == ["mask"]


@pytest.mark.parametrize("through_parent", [True, False])
def test_a_masked_tensor_unlike_its_content_hash_is_refused(through_parent: bool) -> None:
    """A masked tensor of several leaves whose recorded content hash is not that of its bytes
    (as a wrong parent would leave it) is refused: a delta read through its parent, and the
    same planes as a whole tensor (every record made whole, no parent)."""
    parent_blob, blob, _result, child = _chain(0.2, n=100_000)

    def rehash(p: craft.Parts) -> None:
        t = p.tensors[0]
        t["content_hash"] = bytes(a ^ 1 for a in t["content_hash"])
        if not through_parent:  # the same masks and kept words, as whole tensors
            for each in p.tensors:
                each["transform"], each["parent_hash"] = 0, None
            p.index["parent_id"] = bytes(16)
    bad = craft.build(_edited(blob, rehash))
    with Reader(bad, parent=parent_blob if through_parent else None) as r:
        assert r.tensors[0].masked and r.tensors[0].raw_nbytes > 2 * hashing.LEAF_SIZE
        with pytest.raises(ContentHashError, match="tensor 'w' content hash mismatch"):
            r.read_raw(0)
        if through_parent:  # (the other tensors are read as before)
            assert r.read_raw(1).tobytes() == child["f"].data.tobytes()


def _edited(blob: bytes, edit) -> craft.Parts:
    parts = craft.parse(blob)
    edit(parts)
    return parts


def test_a_bad_mask_in_the_middle_of_a_chain_is_named() -> None:
    """Base, a masked delta whose mask sets a bit past its words (checksum recomputed), and a
    delta on top: reading the top names the middle file's rule (R4), found level by level."""
    n = 3001
    rng = np.random.default_rng(5)
    dt = dtypes.by_name("bfloat16")
    a = _bf16(rng.standard_normal(n))
    b, c = a.copy(), a.copy()
    b[::5] ^= 1
    c[::5] ^= 1
    c[::7] ^= 2
    ta, tb, tc = (Tensor(dt, (n,), x.view(np.uint8)) for x in (a, b, c))
    blob_a, ra = _save({"x": ta})
    blob_b, rb = _save({"x": tb}, {"x": ta}, ra.checkpoint_id)
    blob_c, _rc = _save({"x": tc}, {"x": tb}, rb.checkpoint_id)
    xor = (a ^ b).view(np.uint8)
    mask, _kept = spec_mask(a ^ b)
    mask[-1] |= 0x80  # bit 3007, past word 3000
    coded = generate.force_masked(xor, "bfloat16", layouts.BF16, 1, [1, 1, 1], mask=mask)
    bad = io.BytesIO()
    with Writer(bad, parent_id=ra.checkpoint_id) as w:
        from s4format import hashing
        w.add_coded("x", dt, (n,), coded, hashing.content_hash(b.view(np.uint8)),
                    parent_hash=hashing.content_hash(a.view(np.uint8)))
        assert w.close().checkpoint_id == rb.checkpoint_id
    with Reader(blob_c, parent=Reader(bad.getvalue(), parent=blob_a)) as r, \
            pytest.raises(FormatError, match="tensor 'x': the mask sets bits past its last"):
        r.read_raw(0)
    with Reader(blob_c, parent=Reader(blob_b, parent=blob_a)) as r:
        assert r.read_raw(0).tobytes() == c.tobytes()


def _unchanged_chain(n: int = 200_000):
    """A base and a delta on it of one bf16 tensor "x" unchanged (several leaves) and one
    "y" changed: the base's blob and reader, the delta's blob, and the bytes of x."""
    rng = np.random.default_rng(11)
    dt = dtypes.by_name("bfloat16")
    x, y = _bf16(rng.standard_normal(n)), _bf16(rng.standard_normal(n))
    y2 = y.copy()
    y2[::3] ^= 1
    base = {"x": Tensor(dt, (n,), x.view(np.uint8)), "y": Tensor(dt, (n,), y.view(np.uint8))}
    child = {"x": base["x"], "y": Tensor(dt, (n,), y2.view(np.uint8))}
    blob_a, ra = _save(base)
    blob_b, _rb = _save(child, base, ra.checkpoint_id)
    return blob_a, ra, blob_b, x, y2


@pytest.mark.parametrize("verify", [True, False])
def test_an_unchanged_level_is_not_hashed_again(monkeypatch, verify: bool) -> None:
    """A delta that keeps no word leaves its parent's bytes, checked as they were merged: its
    own hash, equal to theirs, is taken as checked without another pass over them. With the
    base read unchecked (verify=False), the delta's hash is still computed (R6)."""
    blob_a, _ra, blob_b, x, y2 = _unchanged_chain()
    hashes = []  # the content hashes computed, of bytes hashed whole or leaf by leaf
    whole, of_leaves = hashing.content_hash, hashing.content_hash_of
    monkeypatch.setattr(hashing, "content_hash", lambda raw: hashes.append("whole")
                        or whole(raw))
    monkeypatch.setattr(hashing, "content_hash_of", lambda nbytes, leaves: hashes.append(
        "leaves") or of_leaves(nbytes, leaves))
    with Reader(blob_b, parent=Reader(blob_a, verify=verify), verify=verify) as r:
        assert r.tensors[0].masked and r.tensors[0].stored_nbytes < 64
        assert r.read_raw(0).tobytes() == x.tobytes()
        # the base's, as it was merged; or the delta's alone
        assert hashes == (["leaves"] if verify else ["whole"])
        assert r.read_raw(1).tobytes() == y2.tobytes()


@pytest.mark.parametrize("change", ["mask bit", "content hash"])
def test_an_unchanged_level_that_breaks_a_rule_is_named(change: str) -> None:
    """A delta that keeps no word but whose mask sets a bit (its checksum made right), or whose
    content hash is not its parent's: the fault is named as level by level."""
    blob_a, ra, _blob_b, x, _y2 = _unchanged_chain()
    dt = dtypes.by_name("bfloat16")
    mask = np.zeros(masked.mask_len(x.size), np.uint8)
    content = hashing.content_hash(x.view(np.uint8))
    if change == "mask bit":
        mask[7] = 0x10
    else:
        content = bytes(a ^ 1 for a in content)
    coded = generate.force_masked(np.zeros(x.nbytes, np.uint8), "bfloat16", layouts.BYTES, 1,
                                  [1, 1], mask=mask, kept=np.zeros(0, np.uint8))
    bad = io.BytesIO()
    with Writer(bad, parent_id=ra.checkpoint_id) as w:
        w.add_coded("x", dt, (x.size,), coded, content,
                    parent_hash=hashing.content_hash(x.view(np.uint8)))
        w.close()
    error, match = (FormatError, "tensor 'x': the mask sets 1 bits, its planes hold 0") \
        if change == "mask bit" else (ContentHashError, "tensor 'x' content hash mismatch")
    with Reader(bad.getvalue(), parent=blob_a) as r:
        assert r.tensors[0].planes[1].decoded_len == 0
        with pytest.raises(error, match=match):
            r.read_raw(0)
