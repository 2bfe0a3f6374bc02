"""GDeflate codec (ID 5): round trips, page-table layout and validation, hostile pages, and the
behaviour without nvCOMP's CPU library."""

from __future__ import annotations

import struct
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from s4format import codecs
from s4format.codecs import gdeflate
from s4format.codecs.gdeflate import PAGE_SIZE, RAW_PAGE, GDeflateCodec, parse_page_table
from s4format.errors import CodecError, UnsupportedCodecError
from tests.codecs.common import as_array, check_corruption_raises, check_encode_decode

CODEC = GDeflateCodec()
# Every test but those of TestWithoutLibrary needs the library.
requires_library = pytest.mark.skipif(
    not CODEC.available(),
    reason="nvCOMP's CPU library is not installed (pip install 's4weights[gdeflate]')")


def bf16_planes(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """(mantissa, exponent) planes of bf16 values drawn from N(0, 0.02)."""
    rng = np.random.default_rng(seed)
    bits = (rng.normal(0, 0.02, n).astype(np.float32).view(np.uint32) >> 16).astype(np.uint16)
    return (bits & 0x7F).astype(np.uint8), ((bits >> 7) & 0xFF).astype(np.uint8)


def table(payload) -> tuple[int, np.ndarray]:
    buf = as_array(payload)
    count = struct.unpack_from("<I", buf.tobytes(), 4)[0]
    return count, buf[8:8 + 4 * count].view("<u4").copy()


def with_table(payload, entries: np.ndarray, body: bytes | None = None) -> np.ndarray:
    buf = as_array(payload)
    count = len(entries)
    rest = buf[8 + 4 * count:].tobytes() if body is None else body
    return np.frombuffer(buf[:8].tobytes() + entries.astype("<u4").tobytes() + rest,
                         dtype=np.uint8).copy()


# -- round trips -----------------------------------------------------------------------------

@requires_library
class TestRoundTrip:
    @pytest.mark.parametrize("n", [0, 1, 2, PAGE_SIZE - 1, PAGE_SIZE, PAGE_SIZE + 1,
                                   3 * PAGE_SIZE - 1, 3 * PAGE_SIZE, 3 * PAGE_SIZE + 1])
    def test_round_trip_sizes(self, n: int) -> None:
        plane = np.random.default_rng(n).integers(0, 8, n).astype(np.uint8)
        payload = check_encode_decode(CODEC, plane)
        count, _ = table(payload)
        assert count == -(-n // PAGE_SIZE)
        assert len(payload) <= 8 + 4 * count + n

    def test_round_trip_incompressible_is_stored_raw(self) -> None:
        plane = np.random.default_rng(1).integers(0, 256, 2 * PAGE_SIZE + 10, dtype=np.uint8)
        payload = check_encode_decode(CODEC, plane)
        _, entries = table(payload)
        assert (entries & RAW_PAGE).all()
        assert len(payload) == 8 + 4 * 3 + plane.size  # never worse than raw plus the table

    def test_round_trip_mixed_raw_and_coded_pages(self) -> None:
        rng = np.random.default_rng(2)
        plane = np.concatenate([np.zeros(PAGE_SIZE, np.uint8),
                                rng.integers(0, 256, PAGE_SIZE, dtype=np.uint8),
                                np.zeros(1000, np.uint8)])
        _, entries = table(check_encode_decode(CODEC, plane))
        assert [bool(e & RAW_PAGE) for e in entries] == [False, True, False]

    def test_round_trip_all_zero(self) -> None:
        payload = check_encode_decode(CODEC, np.zeros(5 * PAGE_SIZE, np.uint8))
        assert len(payload) < 5 * 200

    def test_round_trip_bf16_planes(self) -> None:
        mantissa, exponent = bf16_planes(4 * PAGE_SIZE + 123)
        for plane in (mantissa, exponent):
            payload = check_encode_decode(CODEC, plane)
            assert len(payload) < plane.size
        assert len(CODEC.encode(exponent).payload) < 0.5 * exponent.size

    def test_round_trip_every_level(self) -> None:
        _, exponent = bf16_planes(PAGE_SIZE + 7, seed=3)
        for level in range(gdeflate.MIN_LEVEL, gdeflate.MAX_LEVEL + 1):
            enc = GDeflateCodec(level).encode(exponent)
            assert enc.params == bytes([level])
            check_encode_decode(GDeflateCodec(level), exponent)

    def test_rejects_bad_level(self) -> None:
        with pytest.raises(ValueError, match="level"):
            GDeflateCodec(13)

    def test_accepts_bytes_payload(self) -> None:
        plane = np.arange(1000, dtype=np.uint8)
        enc = CODEC.encode(plane)
        assert np.array_equal(CODEC.decode(bytes(enc.payload), plane.size, b""), plane)

    @settings(max_examples=60, deadline=None)
    @given(st.binary(max_size=3 * PAGE_SIZE // 2), st.integers(0, 255))
    def test_round_trip_hypothesis(self, data: bytes, mask: int) -> None:
        # The mask makes most examples compressible, so coded and raw pages both occur.
        check_encode_decode(CODEC, np.frombuffer(data, np.uint8) & np.uint8(mask))

    def test_registered_under_id_5(self) -> None:
        assert isinstance(codecs.get(codecs.GDEFLATE), GDeflateCodec)
        assert codecs.GDEFLATE == 5

    def test_max_decoded_len_bounds_every_payload(self) -> None:
        assert CODEC.max_decoded_len(0) == 0
        assert CODEC.max_decoded_len(8) == 0
        assert CODEC.max_decoded_len(13) == PAGE_SIZE
        plane = np.zeros(10 * PAGE_SIZE, np.uint8)
        payload = CODEC.encode(plane).payload
        assert CODEC.max_decoded_len(len(payload)) >= plane.size

    def test_estimate(self) -> None:
        mantissa, exponent = bf16_planes(20 * PAGE_SIZE + 5)
        for plane in (mantissa, exponent):
            real = CODEC.encode(plane).nbytes
            assert abs(CODEC.estimate(plane) - real) < 0.02 * real
        small = np.zeros(100, np.uint8)
        assert CODEC.estimate(small) == CODEC.encode(small).nbytes


# -- page table validation (before the library sees a byte) ----------------------------------

def coded_three_pages() -> tuple[np.ndarray, np.ndarray]:
    plane = np.zeros(3 * PAGE_SIZE - 5, np.uint8)
    plane[::7] = 3
    return plane, as_array(CODEC.encode(plane).payload)


@requires_library
class TestPageTable:
    @pytest.mark.parametrize(("mutate", "message"), [
        (lambda p: p[:5], "shorter than its 8-byte header"),
        (lambda p: np.concatenate([[15], p[1:]]).astype(np.uint8), "page size 2\\*\\*15"),
        (lambda p: np.concatenate([p[:1], [1], p[2:]]).astype(np.uint8), "reserved"),
        (lambda p: np.concatenate([p[:4], [2, 0, 0, 0], p[8:]]).astype(np.uint8), "has 2 pages"),
        (lambda p: p[:14], "page table of 3 pages needs 20 bytes"),
        (lambda p: p[:-1], "sum to"),
        (lambda p: np.concatenate([p, [0]]).astype(np.uint8), "sum to"),
    ])
    def test_table_validation(self, mutate, message: str) -> None:
        plane, payload = coded_three_pages()
        with pytest.raises(CodecError, match=message):
            CODEC.decode(mutate(payload), plane.size, b"")

    def test_table_rejects_wrong_decoded_len(self) -> None:
        _, payload = coded_three_pages()
        with pytest.raises(CodecError, match="needs 4"):
            CODEC.decode(payload, 3 * PAGE_SIZE + 1, b"")

    @pytest.mark.parametrize(("entry", "message"), [
        (0, "GDeflate size 0 must be at least 1"),
        (PAGE_SIZE, "GDeflate size 65536 must be at least 1 and shorter than its 65536"),
        (RAW_PAGE | 100, "raw size 100 must equal its 65536"),
        (RAW_PAGE | (RAW_PAGE - 1), "raw size 2147483647"),
    ])
    def test_table_rejects_bad_page_sizes(self, entry: int, message: str) -> None:
        plane, payload = coded_three_pages()
        _, entries = table(payload)
        entries[0] = entry
        with pytest.raises(CodecError, match=message):
            CODEC.decode(with_table(payload, entries), plane.size, b"")

    def test_parse_page_table_offsets(self) -> None:
        plane, payload = coded_three_pages()
        entries, offsets = parse_page_table(payload, plane.size)
        assert offsets[0] == 8 + 12 and offsets[-1] == payload.size
        assert list(np.diff(offsets)) == [int(e) & (RAW_PAGE - 1) for e in entries]

    def test_rejects_long_params(self) -> None:
        plane, payload = coded_three_pages()
        with pytest.raises(CodecError, match="at most 1 byte"):
            CODEC.decode(payload, plane.size, b"\x01\x02")


# -- hostile pages (the table is valid, the stream is not) -----------------------------------

_SWEEP = textwrap.dedent("""
    import ctypes, mmap
    import numpy as np
    from s4format.codecs.gdeflate import _INPUT_PAD, RAW_PAGE, GDeflateCodec, NvcompCpu
    from s4format.errors import CodecError

    libc = ctypes.CDLL(None)
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]

    def fenced(nbytes):
        # nbytes of fresh memory that end right where an unmapped (PROT_NONE) page begins.
        pages = -(-nbytes // mmap.PAGESIZE)
        region = mmap.mmap(-1, (pages + 1) * mmap.PAGESIZE)
        base = ctypes.addressof(ctypes.c_char.from_buffer(region))
        assert libc.mprotect(base + pages * mmap.PAGESIZE, mmap.PAGESIZE, 0) == 0
        return np.frombuffer(region, np.uint8, nbytes, pages * mmap.PAGESIZE - nbytes)

    real = NvcompCpu.decompress_page

    def decompress_fenced(self, handle, src, src_len, dst):
        # The library gets exactly the page plus the padding decode promises, then a fence: a
        # read past the padding or a write past the page faults instead of going unnoticed.
        span = src_len + _INPUT_PAD
        assert src.size >= span and not src[src_len:span].any()
        inp, out = fenced(span), fenced(dst.size)
        inp[:] = src[:span]
        result = real(self, handle, inp, src_len, out)
        dst[:] = out
        return result

    NvcompCpu.decompress_page = decompress_fenced
    codec = GDeflateCodec()
    rng = np.random.default_rng(0)
    bits = (rng.normal(0, 0.02, 65536).astype(np.float32).view(np.uint32) >> 23).astype(np.uint8)
    outcomes = {"error": 0, "bytes": 0}
    for plane in (bits, (np.arange(40000) % 251 // 3).astype(np.uint8)):
        payload = np.frombuffer(codec.encode(plane).payload, np.uint8)
        assert not int(payload[8:12].view("<u4")[0]) & RAW_PAGE
        stream = payload[12:]
        for trial in range(300):
            bad = stream.copy()
            if trial % 3 == 0:
                bad = bad[: 1 + int(rng.integers(bad.size - 1))]
            elif trial % 3 == 1:
                for _ in range(1 + trial % 4):
                    bad[rng.integers(bad.size)] ^= np.uint8(1 << int(rng.integers(8)))
            else:
                bad = rng.integers(0, 256, 1 + int(rng.integers(bad.size - 1)), dtype=np.uint8)
            head = payload[:8].tobytes() + np.uint32(bad.size).tobytes()
            try:
                codec.decode(np.frombuffer(head + bad.tobytes(), np.uint8), plane.size, b"")
                outcomes["bytes"] += 1
            except CodecError:
                outcomes["error"] += 1
    print(outcomes["error"], outcomes["bytes"])
""")



@requires_library
class TestHostilePages:
    def test_page_decoding_to_more_than_its_length(self) -> None:
        """A stream of a longer page passed off as a shorter last page."""
        long_page = CODEC.encode(np.zeros(PAGE_SIZE, np.uint8)).payload
        _, entries = table(long_page)
        payload = with_table(long_page, entries)
        with pytest.raises(CodecError, match=r"page 0 .* insufficient space"):
            CODEC.decode(payload, PAGE_SIZE - 1, b"")

    def test_page_decoding_to_less_than_its_length(self) -> None:
        short = as_array(CODEC.encode(np.zeros(PAGE_SIZE - 1, np.uint8)).payload)
        with pytest.raises(CodecError, match=r"page 0 .*after 65535 of 65536 bytes"):
            CODEC.decode(short, PAGE_SIZE, b"")

    def test_truncated_page_stream_raises(self) -> None:
        """The library reads past the end of a truncated stream; the zero padding keeps that read
        inside our buffer and turns it into an error or some bytes, never a crash."""
        plane, payload = coded_three_pages()
        _, entries = table(payload)
        size0 = int(entries[0])
        body = as_array(payload)[20:]
        for cut in (1, 2, 64, 128, size0 // 2, size0 - 1):
            cut_entries = entries.copy()
            cut_entries[0] = cut
            bad = with_table(payload, cut_entries, body[:cut].tobytes() + body[size0:].tobytes())
            try:
                out = CODEC.decode(bad, plane.size, b"")
            except CodecError as exc:
                assert "page 0" in str(exc)
            else:
                assert out.shape == (plane.size,)

    def test_corruption_in_process(self) -> None:
        # Safe in-process only because decode pads every page (see test_hostile_sweep_subprocess).
        mantissa, exponent = bf16_planes(2 * PAGE_SIZE + 99, seed=5)
        rng = np.random.default_rng(6)
        for plane in (exponent, mantissa, np.arange(5000, dtype=np.uint8)):
            check_corruption_raises(CODEC, plane, rng, trials=150)

    def test_hostile_sweep_subprocess(self) -> None:
        """Bit flips, truncations and random bytes in a page, each behind a valid page table,
        with every library call fenced by unmapped memory, in a child process: an over-read past
        the padding (or any crash of the library) fails this test instead of killing the run."""
        done = subprocess.run([sys.executable, "-c", _SWEEP], capture_output=True, text=True,
                              timeout=120)
        assert done.returncode == 0, f"decoder crashed (rc {done.returncode}): {done.stderr[-500:]}"
        errors, decoded = map(int, done.stdout.split())
        assert errors + decoded == 600 and errors > 300


# -- without the library ---------------------------------------------------------------------

class TestWithoutLibrary:
    def test_missing_library(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.setattr(gdeflate, "find_library", lambda: None)
        codec = GDeflateCodec()
        assert not codec.available()
        assert codec.encode(np.zeros(1000, np.uint8)) is None
        assert codec.estimate(np.zeros(1000, np.uint8)) is None
        with pytest.raises(UnsupportedCodecError, match=r"pip install 's4weights\[gdeflate\]'"):
            codec.decode(np.zeros(20, np.uint8), 10, b"")

    def test_unloadable_library(self, monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
        bogus = tmp_path / "libnvcomp_cpu.so.6"
        bogus.write_bytes(b"not an ELF file")
        monkeypatch.setenv(gdeflate.ENV_LIBRARY, str(bogus))
        codec = GDeflateCodec()
        assert codec.encode(np.zeros(10, np.uint8)) is None
        with pytest.raises(UnsupportedCodecError, match=r"could not load .*s4weights\[gdeflate\]"):
            codec.decode(np.zeros(20, np.uint8), 10, b"")

    @requires_library
    def test_env_override_is_used(self, monkeypatch: pytest.MonkeyPatch) -> None:
        real = gdeflate.find_library()
        monkeypatch.setenv(gdeflate.ENV_LIBRARY, str(real))
        assert gdeflate.find_library() == real
        assert GDeflateCodec().library().path == real

    @requires_library
    def test_library_found_in_nvidia_package(self, monkeypatch: pytest.MonkeyPatch) -> None:
        monkeypatch.delenv(gdeflate.ENV_LIBRARY, raising=False)
        path = gdeflate.find_library()
        assert path is not None and path.name.startswith("libnvcomp_cpu.so")
        assert path.parent.parent.name == "libnvcomp"

    def test_import_without_library_registers_codec(self) -> None:
        """A fresh interpreter whose library lookup finds nothing still imports and registers."""
        code = textwrap.dedent("""
            import os
            os.environ["S4_NVCOMP_CPU_LIB"] = "/nonexistent/libnvcomp_cpu.so.6"
            from s4format import codecs
            from s4format.errors import UnsupportedCodecError
            c = codecs.get(5)
            assert c.encode(b"") is None
            try:
                c.decode(b"", 0, b"")
            except UnsupportedCodecError as exc:
                print(exc)
        """)
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=60)
        assert done.returncode == 0, done.stderr
        assert "s4weights[gdeflate]" in done.stdout


@requires_library
def test_incompressible_pages_do_not_overrun_the_output_slots() -> None:
    # nvCOMP's compressCPUGetMaxOutputChunkSize under-reports: random pages compressed past it
    # and corrupted the heap (glibc abort). Run in a child so a regression shows as a crash.
    code = textwrap.dedent("""
        import numpy as np
        from s4format.codecs.gdeflate import GDeflateCodec
        codec = GDeflateCodec()
        for seed in range(4):
            plane = np.random.default_rng(seed).integers(0, 256, 64 * 65536, dtype=np.uint8)
            enc = codec.encode(plane)
            out = codec.decode(np.frombuffer(bytes(enc.payload), np.uint8), plane.size, b"")
            assert np.array_equal(out, plane)
        print("ok")
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stderr[-2000:]
