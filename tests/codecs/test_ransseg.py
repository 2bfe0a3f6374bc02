"""rans-seg (codec 9): the codec contract on flat-buffer planes, a reference decoder written
from the payload description, every decoding rule, hostile segment tables, and the writer's
choice of it for flat buffers (stored size, round trips, thread count)."""

from __future__ import annotations

import io
import itertools
import re
import struct
import time
import tracemalloc
from collections.abc import Callable
from functools import cache

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import s4format
from s4format import Reader, Tensor, UnsupportedCodecError, codecs, dtypes, layouts, threads
from s4format.codecs.rans import MODE_CONST, MODE_RANS, MODE_RAW, RansCodec
from s4format.codecs.ransseg import RansSegCodec
from s4format.errors import CodecError
from s4format.writer import code_tensor
from tests.codecs.common import as_array, check_corruption_raises, check_encode_decode

CODEC = codecs.get(codecs.RANS_SEG)
RANS = codecs.get(codecs.RANS)
UNIT = 1 << 16  # a segment other than the last holds a multiple of this many symbols


# ---------------------------------------------------------------------------------------------
# A second, deliberately naive decoder written from the payload description alone: u32 k,
# k x (u64 symbols, u64 stored), then the k codec-4 streams back to back.


def ref_table(payload: bytes) -> list[tuple[int, int]]:
    (k,) = struct.unpack_from("<I", payload)
    return [struct.unpack_from("<QQ", payload, 4 + 16 * i) for i in range(k)]


def ref_decode(payload: bytes, decoded_len: int) -> bytes:
    """Decode a valid payload (the rules asserted, not reported: the reference for good
    payloads only)."""
    table = ref_table(payload)
    k = len(table)
    assert k >= 1 and sum(n for n, _ in table) == decoded_len
    assert 4 + 16 * k + sum(s for _, s in table) == len(payload)
    out, at = bytearray(), 4 + 16 * k
    for i, (n, stored) in enumerate(table):
        assert n >= 1 and (i == k - 1 or n % UNIT == 0)
        out += RANS.decode(np.frombuffer(payload[at:at + stored], np.uint8), n, b"").tobytes()
        at += stored
    return bytes(out)


def stream_of(plane: np.ndarray, codec: RansCodec = RANS) -> bytes:
    return as_array(codec.encode(plane).payload).tobytes()


def assemble(segments: list[tuple[int, bytes]]) -> bytes:
    """A payload of ``(symbols, codec-4 stream)`` segments, as the description lays it out."""
    head = struct.pack("<I", len(segments))
    head += b"".join(struct.pack("<QQ", n, len(s)) for n, s in segments)
    return head + b"".join(s for _, s in segments)


def decode(payload: bytes, decoded_len: int, params: bytes = b"") -> bytes:
    return CODEC.decode(np.frombuffer(payload, np.uint8), decoded_len, params).tobytes()


# ---------------------------------------------------------------------------------------------
# Planes


def exponents(n: int, scale: float, seed: int) -> np.ndarray:
    """Exponent bytes of N(0, scale) floats: one distribution per scale, a few octaves apart."""
    values = np.random.default_rng(seed).standard_normal(n, dtype=np.float32)
    return (((values * np.float32(scale)).view(np.uint32) >> 23) & 0xFF).astype(np.uint8)


@cache
def flat(name: str) -> np.ndarray:
    """Planes of a flat buffer: differently distributed runs end to end, >= 4 x 65,536 bytes."""
    rng = np.random.default_rng(9)
    parts = {
        "three_scales": [exponents(150_000, 0.02, 1), exponents(150_000, 1e-3, 2),
                         exponents(100_001, 1.0, 3)],
        "const_and_random_runs": [exponents(130_000, 0.02, 4), np.full(140_000, 0x3F, np.uint8),
                                  rng.integers(0, 256, 120_000, dtype=np.uint8),
                                  exponents(70_000, 1e-4, 5)],
        "unit_aligned": [exponents(2 * UNIT, 0.02, 1), exponents(2 * UNIT, 1.0, 2),
                         exponents(UNIT + 17, 1e-3, 3)],
    }[name]
    plane = np.concatenate(parts)
    plane.flags.writeable = False
    return plane


FLAT = ("three_scales", "const_and_random_runs", "unit_aligned")


def modes(payload: bytes) -> list[int]:
    """The codec-4 mode of each segment's stream."""
    table = ref_table(payload)
    at = 4 + 16 * len(table) + np.cumsum([0] + [s for _, s in table[:-1]])
    return [payload[int(a)] for a in at]


# ---------------------------------------------------------------------------------------------
# The codec contract


def test_registered_as_codec_9() -> None:
    assert isinstance(CODEC, RansSegCodec)
    assert (CODEC.codec_id, CODEC.name, codecs.name_of(9)) == (9, "rans-seg", "rans-seg")


@pytest.mark.parametrize("name", FLAT)
def test_flat_planes_round_trip_and_corruption_raises_or_decodes(name: str) -> None:
    plane = flat(name)
    payload = check_encode_decode(CODEC, plane)
    assert payload is not None and len(ref_table(payload.tobytes())) >= 2
    check_corruption_raises(CODEC, plane, np.random.default_rng(len(name)), trials=100)


@pytest.mark.parametrize("kind", ["one_distribution", "one_symbol", "random_bytes",
                                  "mixed_but_under_4_units"])
def test_a_plane_of_one_segment_is_declined(kind: str) -> None:
    n = 6 * UNIT + 5
    plane = {
        "one_distribution": exponents(n, 0.02, 7),
        "one_symbol": np.full(n, 0x7E, np.uint8),
        "random_bytes": np.random.default_rng(7).integers(0, 256, n, dtype=np.uint8),
        "mixed_but_under_4_units": np.concatenate([exponents(2 * UNIT, 0.02, 1),
                                                   exponents(2 * UNIT - 1, 1.0, 2)]),
    }[kind]
    assert CODEC.encode(plane) is None
    assert CODEC.estimate(plane) is None


def test_4_units_is_the_shortest_plane_cut() -> None:
    plane = np.concatenate([exponents(2 * UNIT, 0.02, 1), exponents(2 * UNIT, 1.0, 2)])
    payload = check_encode_decode(CODEC, plane).tobytes()
    assert [n for n, _ in ref_table(payload)] == [2 * UNIT, 2 * UNIT]


@pytest.mark.parametrize("name", FLAT)
def test_the_reference_decoder_agrees_and_the_estimate_is_close(name: str) -> None:
    plane = flat(name)
    payload = as_array(CODEC.encode(plane).payload).tobytes()
    table = ref_table(payload)
    assert all(n % UNIT == 0 for n, _ in table[:-1]) and table[-1][0] >= 1
    assert ref_decode(payload, plane.size) == decode(payload, plane.size) == plane.tobytes()
    assert abs(CODEC.estimate(plane) / len(payload) - 1) < 0.01
    assert len(payload) < RANS.encode(plane).nbytes * (1 - 1 / 64)


def test_cuts_fall_on_the_run_boundaries_and_every_mode_is_used() -> None:
    aligned = as_array(CODEC.encode(flat("unit_aligned")).payload).tobytes()
    assert [n for n, _ in ref_table(aligned)] == [2 * UNIT, 2 * UNIT, UNIT + 17]
    mixed = as_array(CODEC.encode(flat("const_and_random_runs")).payload).tobytes()
    assert {MODE_RANS, MODE_CONST, MODE_RAW} <= set(modes(mixed))


def test_views_of_a_tensors_words_code_as_their_bytes() -> None:
    bits = bf16_bits(np.concatenate(runs_of((200_000, 150_000, 120_000))))
    for view in layouts.BF16.views(bits.view(np.uint8), 2):
        alone = view.bytes().copy()
        enc, est = CODEC.encode_view(view), CODEC.estimate_view(view)
        again = CODEC.encode(alone)
        assert (enc is None) == (again is None) and est == CODEC.estimate(alone)
        if enc is not None:
            assert as_array(enc.payload).tobytes() == as_array(again.payload).tobytes()
    exponent = layouts.BF16.views(bits.view(np.uint8), 2)[1]
    assert CODEC.encode_view(exponent) is not None


def test_max_decoded_len_is_a_tight_bound() -> None:
    assert [CODEC.max_decoded_len(s) for s in (0, 31, 32, 33, 1000)] == \
        [0, 0, 0, 1 << 20, 968 << 20]
    plane = np.full(3 << 20, 5, np.uint8)   # one CONST segment: the densest payload
    payload = assemble([(plane.size, stream_of(plane))])
    assert CODEC.max_decoded_len(len(payload)) == plane.size
    assert decode(payload, plane.size) == plane.tobytes()


# ---------------------------------------------------------------------------------------------
# Decoding rules: hand-built payloads of real codec-4 streams, each case breaking one rule


@cache
def good() -> tuple[bytes, bytes]:
    """A payload of three segments, one per codec-4 mode, and the plane it decodes to."""
    planes = [exponents(UNIT, 0.02, 11), np.full(2 * UNIT, 0x7E, np.uint8),
              np.random.default_rng(11).integers(0, 256, 1000, dtype=np.uint8)]
    payload = assemble([(p.size, stream_of(p)) for p in planes])
    assert modes(payload) == [MODE_RANS, MODE_CONST, MODE_RAW]
    return payload, np.concatenate(planes).tobytes()


def with_entry(payload: bytes, i: int, symbols: int | None = None,
               stored: int | None = None) -> bytes:
    """``payload`` with segment ``i``'s table entry changed."""
    bad = bytearray(payload)
    n, s = struct.unpack_from("<QQ", bad, 4 + 16 * i)
    struct.pack_into("<QQ", bad, 4 + 16 * i, n if symbols is None else symbols,
                     s if stored is None else stored)
    return bytes(bad)


def test_the_hand_built_payload_decodes() -> None:
    payload, plane = good()
    assert ref_decode(payload, len(plane)) == decode(payload, len(plane)) == plane


def rule_cases() -> dict[str, tuple[bytes, int, bytes, str]]:
    """Case -> (payload, decoded_len, params, the whole error message or its start)."""
    payload, plane = good()
    n, size, body = len(plane), len(payload), 4 + 16 * 3
    (n0, s0), (n1, s1), (n2, s2) = ref_table(payload)
    stored = s0 + s1 + s2
    store = "rans-seg segments store {} bytes after a 52-byte table, the payload has {}"
    mode_3 = bytearray(payload)
    mode_3[body + s0] = 3
    return {
        "empty": (b"", n, b"", "rans-seg payload of 0 bytes is shorter than its count"),
        "3 bytes": (payload[:3], n, b"", "rans-seg payload of 3 bytes is shorter than its count"),
        "k = 0": (bytes(4) + payload[4:], n, b"", "rans-seg payload holds 0 segments"),
        "table past payload": (payload[:body - 1], n, b"", "rans-seg segment table of 3 "
                               "segments needs 52 bytes, the payload has 51"),
        "first of 0 symbols": (with_entry(payload, 0, symbols=0), n, b"",
                               "rans-seg segment 0 holds 0 symbols"),
        "last of 0 symbols": (with_entry(payload, 2, symbols=0), n, b"",
                              "rans-seg segment 2 holds 0 symbols"),
        "first not a multiple": (with_entry(with_entry(payload, 0, n0 + 1), 2, n2 - 1), n, b"",
                                 f"rans-seg segment 0 holds {n0 + 1} symbols, not a multiple "
                                 "of 65536 (only the last segment may)"),
        "middle not a multiple": (with_entry(with_entry(payload, 1, n1 - 1), 2, n2 + 1), n,
                                  b"", f"rans-seg segment 1 holds {n1 - 1} symbols, not a "
                                  "multiple of 65536 (only the last segment may)"),
        "plane one longer": (payload, n + 1, b"",
                             f"rans-seg segments hold {n} symbols, plane declares {n + 1}"),
        "plane one shorter": (payload, n - 1, b"",
                              f"rans-seg segments hold {n} symbols, plane declares {n - 1}"),
        "last one symbol more": (with_entry(payload, 2, n2 + 1), n, b"",
                                 f"rans-seg segments hold {n + 1} symbols, plane declares {n}"),
        "stored one more": (with_entry(payload, 2, stored=s2 + 1), n, b"",
                            store.format(stored + 1, size)),
        "stored one less": (with_entry(payload, 0, stored=s0 - 1), n, b"",
                            store.format(stored - 1, size)),
        "payload one longer": (payload + b"\0", n, b"", store.format(stored, size + 1)),
        "payload one shorter": (payload[:-1], n, b"", store.format(stored, size - 1)),
        "params": (payload, n, b"\0", "rans-seg takes no parameters, got 1 bytes"),
        "stream 1 in mode 3": (bytes(mode_3), n, b"",
                               "rans-seg segment 1 of 3: rans mode 3 is not RAW (0)"),
        "a byte moved from stream 1 to 0": (with_entry(with_entry(payload, 0, stored=s0 + 1),
                                                       1, stored=s1 - 1), n, b"",
                                            "rans-seg segment 0 of 3: "),
        "a byte moved from stream 0 to 1": (with_entry(with_entry(payload, 0, stored=s0 - 1),
                                                       1, stored=s1 + 1), n, b"",
                                            "rans-seg segment 0 of 3: "),
        "stream 2 holds another count": (with_entry(payload, 2, n2 - 1), n - 1, b"",
                                         f"rans-seg segment 2 of 3: rans stream holds {n2} "
                                         f"symbols, plane declares {n2 - 1}"),
        # a decoder summing in u64 would take these wrapped sums for the right ones
        "symbols wrap at 2^64": (with_entry(with_entry(payload, 0, n0 + (1 << 63)), 1,
                                            n1 + (1 << 63)), n, b"",
                                 f"rans-seg segments hold {n + (1 << 64)} symbols, plane "
                                 f"declares {n}"),
        "stored wraps at 2^64": (with_entry(with_entry(payload, 0, stored=s0 + (1 << 63)), 1,
                                            stored=s1 + (1 << 63)), n, b"",
                                 store.format(stored + (1 << 64), size)),
    }


@pytest.mark.parametrize("case", sorted(rule_cases()))
def test_each_broken_rule_raises_a_named_codec_error(case: str) -> None:
    payload, decoded_len, params, message = rule_cases()[case]
    with pytest.raises(CodecError, match="^" + re.escape(message)):
        decode(payload, decoded_len, params)


# ---------------------------------------------------------------------------------------------
# Hostile tables: refused at once, before the plane is allocated


def test_a_count_of_2_32_minus_1_with_a_short_payload_is_refused_at_once() -> None:
    payload = struct.pack("<I", (1 << 32) - 1) + bytes(60)
    start = time.perf_counter()
    with pytest.raises(CodecError, match=r"table of 4294967295 segments needs 68719476724 "
                                         r"bytes, the payload has 64$"):
        decode(payload, CODEC.max_decoded_len(len(payload)), b"")
    assert time.perf_counter() - start < 0.5


def test_huge_symbol_counts_are_refused_before_allocating_the_plane() -> None:
    stream = stream_of(np.full(16 << 20, 1, np.uint8))   # a CONST stream of 16 blocks
    for symbols in ((1 << 64) - 1, 1 << 63, (16 << 20) + 1):
        payload = assemble([(symbols, stream)])
        decoded_len = CODEC.max_decoded_len(len(payload))
        assert decoded_len == 16 << 20
        tracemalloc.start()
        try:
            with pytest.raises(CodecError, match=f"hold {symbols} symbols, plane declares "
                                                 f"{decoded_len}$"):
                decode(payload, decoded_len)
            peak = tracemalloc.get_traced_memory()[1]
        finally:
            tracemalloc.stop()
        assert peak < decoded_len // 16


def test_a_long_segment_table_is_refused_in_linear_time() -> None:
    k = 32_000   # 512 KB of table, every segment declaring 65,536 symbols and no bytes
    payload = struct.pack("<I", k) + struct.pack("<QQ", UNIT, 0) * k
    start = time.perf_counter()
    with pytest.raises(CodecError, match=f"hold {k * UNIT} symbols, plane declares 1$"):
        decode(payload, 1)
    assert time.perf_counter() - start < 0.3


# ---------------------------------------------------------------------------------------------
# Random segmentations built by hand from random codec-4 streams


def segment(kind: str, n: int, seed: int) -> tuple[np.ndarray, bytes]:
    """A plane of ``n`` bytes and its codec-4 stream: RANS, CONST or RAW, in 64K-symbol
    blocks or (``small_blocks``) 512-symbol ones."""
    rng = np.random.default_rng(seed)
    if kind == "const":
        plane = np.full(n, seed % 256, np.uint8)
    elif kind == "raw":
        plane = rng.integers(0, 256, n, dtype=np.uint8)
    else:
        plane = exponents(n, 10.0 ** -int(rng.integers(0, 5)), seed)
    return plane, stream_of(plane, RansCodec(9) if kind == "small_blocks" else RANS)


KINDS = st.sampled_from(["rans", "const", "raw", "small_blocks"])


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(head=st.lists(st.tuples(KINDS, st.integers(1, 2), st.integers(0, 2**32)), max_size=3),
       last=st.tuples(KINDS, st.integers(1, 3 * UNIT), st.integers(0, 2**32)))
def test_property_hand_built_segmentations_decode(head: list[tuple[str, int, int]],
                                                  last: tuple[str, int, int]) -> None:
    parts = [segment(kind, units * UNIT, seed) for kind, units, seed in head]
    parts.append(segment(*last))
    plane = np.concatenate([p for p, _ in parts]).tobytes()
    payload = assemble([(p.size, s) for p, s in parts])
    assert CODEC.max_decoded_len(len(payload)) >= len(plane)
    assert ref_decode(payload, len(plane)) == plane
    assert decode(payload, len(plane)) == plane


# ---------------------------------------------------------------------------------------------
# The writer on flat buffers


def runs_of(lengths: tuple[int, ...], seed: int = 0) -> list[np.ndarray]:
    """fp32 runs as a flat buffer holds them, in turn: N(0, 0.02), N(0, 1e-3) and N(0, 1)
    weights, ones (a norm's weight) and small integers kept as floats."""
    rng = np.random.default_rng(seed)
    makers: list[Callable[[int], np.ndarray]] = [
        lambda n: rng.standard_normal(n, dtype=np.float32) * np.float32(0.02),
        lambda n: rng.standard_normal(n, dtype=np.float32) * np.float32(1e-3),
        lambda n: rng.standard_normal(n, dtype=np.float32),
        lambda n: np.ones(n, np.float32),
        lambda n: rng.integers(-8, 9, n).astype(np.float32),
    ]
    return [make(n).astype("<f4") for make, n in zip(itertools.cycle(makers), lengths)]


def bf16_bits(values: np.ndarray) -> np.ndarray:
    return (values.view("<u4") >> 16).astype("<u2")


UNALIGNED = (300_000, 250_001, 300_000, 280_000, 300_000)
ALIGNED = (4 * UNIT, 4 * UNIT, 4 * UNIT, 4 * UNIT, 250_000)
DTYPES = {"bfloat16": bf16_bits, "float32": lambda v: v}


def raw_of(values: np.ndarray, dtype: str) -> np.ndarray:
    return DTYPES[dtype](values).view(np.uint8).reshape(-1)


@cache
def flat_buffer(dtype: str, lengths: tuple[int, ...] = UNALIGNED) -> np.ndarray:
    raw = raw_of(np.concatenate(runs_of(lengths)), dtype)
    raw.flags.writeable = False
    return raw


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_auto_takes_codec_9_for_a_flat_buffer_and_no_other_policy_does(dtype: str) -> None:
    raw = flat_buffer(dtype)
    chosen = {p.kind: p.codec for p in code_tensor(raw, dtypes.by_name(dtype), "auto").planes}
    assert chosen[layouts.KIND_EXPONENT] == codecs.RANS_SEG
    for policy in ("auto-1.0", "seed"):
        coded = code_tensor(raw, dtypes.by_name(dtype), policy)
        assert codecs.RANS_SEG not in {p.codec for p in coded.planes}, policy


def flat_and_apart(dtype: str, lengths: tuple[int, ...]) -> tuple[int, int]:
    """Stored bytes of the runs as one flat tensor and coded each apart."""
    dt = dtypes.by_name(dtype)
    apart = sum(code_tensor(raw_of(r, dtype), dt).stored for r in runs_of(lengths))
    return code_tensor(flat_buffer(dtype, lengths), dt).stored, apart


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_flat_buffer_of_unit_aligned_runs_stores_within_1_5_percent_of_its_parts(
        dtype: str) -> None:
    together, apart = flat_and_apart(dtype, ALIGNED)
    assert together <= apart * 1.015


@pytest.mark.parametrize("dtype", sorted(DTYPES))
def test_a_run_boundary_inside_a_unit_costs_at_most_a_bit_per_symbol_of_it(dtype: str) -> None:
    # Segments start on multiples of 65,536 symbols, so a unit straddling two runs is coded
    # with one table: at most one bit per symbol above its two parts, plus a table's bytes.
    together, apart = flat_and_apart(dtype, UNALIGNED)
    boundaries = sum(1 for at in itertools.accumulate(UNALIGNED[:-1]) if at % UNIT)
    planes = len(layouts.preferred(dtype, dtypes.by_name(dtype).itemsize).planes(
        dtypes.by_name(dtype).itemsize))
    assert together <= apart + boundaries * planes * (UNIT // 8 + 1024)


@cache
def flat_state() -> dict[str, Tensor]:
    state = {}
    for name in DTYPES:
        dt = dtypes.by_name(name)
        raw = flat_buffer(name)
        state[f"flat_{name}"] = Tensor(dt, (raw.size // dt.itemsize,), raw)
    return state


def test_a_file_of_flat_buffers_round_trips_and_declares_format_1_3(monkeypatch) -> None:
    state = flat_state()
    blob = s4format.dumps(state)
    with Reader(blob) as r:
        assert r.version == (1, 3)
        for t in r.tensors:
            assert codecs.RANS_SEG in {p.codec for p in t.planes}, t.name
        got = r.load()
    assert {k: v.data.tobytes() for k, v in got.items()} == \
        {k: v.data.tobytes() for k, v in state.items()}
    for policy, minor in (("seed", 1), ("auto-1.0", 0)):
        with Reader(s4format.dumps(state, policy=policy)) as r:
            assert r.version == (1, minor)
    codecs.get(codecs.RANS_SEG)  # loaded, so that removing it below sticks
    monkeypatch.delitem(codecs._REGISTRY, codecs.RANS_SEG)  # what a format 1.1 reader knows
    with pytest.raises(UnsupportedCodecError, match="'rans-seg' \\(ID 9\\)"):
        Reader(blob)


def test_s4weights_round_trips_flat_torch_tensors() -> None:
    torch = pytest.importorskip("torch")
    import s4weights

    state = {"flat_bf16": torch.from_numpy(flat_buffer("bfloat16").view(np.int16).copy())
             .view(torch.bfloat16),
             "flat_fp32": torch.from_numpy(flat_buffer("float32").view(np.float32).copy()),
             "step": 7}
    buf = io.BytesIO()
    s4weights.save(state, buf)
    with Reader(buf.getvalue()) as r:
        assert all(codecs.RANS_SEG in {p.codec for p in t.planes} for t in r.tensors)
    got = s4weights.load(buf.getvalue())
    assert got["step"] == 7 and got["flat_bf16"].dtype == torch.bfloat16
    assert torch.equal(got["flat_bf16"].view(torch.int16), state["flat_bf16"].view(torch.int16))
    assert torch.equal(got["flat_fp32"].view(torch.int32), state["flat_fp32"].view(torch.int32))


def _with_threads(monkeypatch, n: int) -> None:
    monkeypatch.setenv("S4_THREADS", str(n))
    monkeypatch.setattr(threads, "_pool", None)
    assert threads.pool().threads == n


def test_coded_bytes_do_not_depend_on_the_thread_count(monkeypatch) -> None:
    out = []
    for n in (1, 2):
        _with_threads(monkeypatch, n)
        planes = [(p.codec, as_array(p.payload).tobytes())
                  for dt in DTYPES for p in code_tensor(flat_buffer(dt), dtypes.by_name(dt)).planes]
        out.append((planes, s4format.dumps(flat_state())))
    assert out[0] == out[1]
    assert codecs.RANS_SEG in {cid for cid, _ in out[0][0]}
    with Reader(out[0][1]) as r:   # decoded on two threads, segments in parallel
        assert r.read_raw(0).tobytes() == flat_buffer("bfloat16").tobytes()


# ---------------------------------------------------------------------------------------------
# Slices (the reader merges a plane a piece at a time)


@pytest.mark.parametrize("name", FLAT)
def test_slices_of_every_piece_size_are_the_plane(name: str) -> None:
    plane = flat(name)
    payload = as_array(CODEC.encode(plane).payload)
    s = CODEC.slicer(payload, plane.size, b"")
    assert s is not None and s.align == UNIT
    for piece in (UNIT, 3 * UNIT, 1 << 20):
        got = [s.get(lo, min(plane.size, lo + piece)) for lo in range(0, plane.size, piece)]
        assert np.concatenate(got).tobytes() == plane.tobytes()


def test_a_corrupt_segment_spoils_only_its_slices() -> None:
    plane = flat("unit_aligned")
    payload = as_array(CODEC.encode(plane).payload).copy()
    payload[-3] ^= 0x10  # inside the last segment's words
    s = CODEC.slicer(payload, plane.size, b"")
    got = [s.get(lo, min(plane.size, lo + UNIT)) for lo in range(0, plane.size, UNIT)]
    # the last segment holds pieces 4 and 5: only its slices may fail
    assert [g is None for g in got[:4]] == [False] * 4 and any(g is None for g in got[4:])
    assert got[0].tobytes() == plane[:UNIT].tobytes()


def test_no_slicer_for_a_broken_table_and_wide_blocks_decoded_whole() -> None:
    plane = flat("unit_aligned")
    payload = as_array(CODEC.encode(plane).payload)
    assert CODEC.slicer(payload, plane.size + 1, b"") is None
    assert CODEC.slicer(payload, plane.size, b"\x00") is None
    wide = RansCodec(log2_block=17)  # blocks of 2^17 do not start on every segment start
    payload = assemble([(UNIT, stream_of(plane[:UNIT], wide)),
                        (plane.size - UNIT, stream_of(plane[UNIT:], wide))])
    s = CODEC.slicer(np.frombuffer(payload, np.uint8), plane.size, b"")
    assert s is not None and s.align == 1
    got = [s.get(lo, min(plane.size, lo + 1000)) for lo in range(0, plane.size, 1000)]
    assert np.concatenate(got).tobytes() == plane.tobytes() == decode(payload, plane.size)
