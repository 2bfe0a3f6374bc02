"""Reader-side limits and hygiene that the review asked for (spec/validation.md R0)."""

from __future__ import annotations

import io
import subprocess
import sys

import numpy as np
import pytest

import s4format
from s4format import LimitError, Reader, Writer


def _blob(name: str = "w") -> bytes:
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.add(name, np.zeros(1 << 16, dtype=np.float32))
    return buf.getvalue()


def test_tensor_over_the_allocation_limit_is_refused_before_decoding() -> None:
    # An all-zero tensor codes to a few hundred bytes; the cap is checked against the declared
    # raw size, so no plane is decoded and nothing of that size is allocated.
    with Reader(_blob(), max_tensor_bytes=1000) as r, \
            pytest.raises(LimitError, match=r"'w' declares 262144 raw bytes.*max_tensor_bytes"):
        r.read_raw(0)
    with Reader(_blob()) as r:
        assert r.max_tensor_bytes > 1 << 20
        assert not r.read_raw(0).any()


def test_negative_tensor_index_is_refused() -> None:
    with Reader(_blob()) as r, pytest.raises(IndexError, match="no tensor -1"):
        r.read_raw(-1)


def test_writer_abort_removes_the_file_it_created(tmp_path) -> None:
    path = tmp_path / "x.s4w"
    with pytest.raises(RuntimeError), Writer(path) as w:
        w.add("a", np.arange(10, dtype=np.int64))
        raise RuntimeError("caller failed mid-save")
    assert not path.exists()


def test_inspect_escapes_control_characters_in_names(tmp_path) -> None:
    path = tmp_path / "x.s4w"
    path.write_bytes(_blob("evil\x1b[2Jname"))
    out = subprocess.run([sys.executable, "-m", "s4format", "inspect", str(path)],
                         capture_output=True, text=True, check=True).stdout
    assert "\x1b" not in out and "'evil\\x1b[2Jname'" in out
    with s4format.Reader(str(path)) as r:
        assert r.tensors[0].name == "evil\x1b[2Jname"


def test_a_merged_tensor_is_not_copied_again() -> None:
    # read_raw's copy is for read-only planes and views of larger buffers; a merged tensor is
    # a fresh array already (a second copy cost a whole tensor of memory and time)
    import io

    import numpy as np

    import s4format

    rng = np.random.default_rng(1)
    buf = io.BytesIO()
    s4format.write(buf, {"a": (rng.standard_normal(100_000) * 0.02).astype(np.float32)})
    raw = s4format.Reader(buf.getvalue()).read_raw(0)
    assert raw.flags.writeable and raw.base is not None and raw.base.dtype == np.uint32


def _index_file(count: int, records: int, tail: bytes = b"") -> bytes:
    """A file whose index declares ``count`` tensors and holds ``records`` minimal records
    (then the rest of an index, then ``tail``); checksums sealed."""
    import io
    import struct

    import numpy as np

    import s4format
    from conformance import craft
    from s4format.schema import TensorRecord

    buf = io.BytesIO()
    s4format.write(buf, {"a": np.zeros(4, np.float32)})
    rec = TensorRecord.build(dict(name="", dtype=1, layout=0, transform=0, flags=0, ndim=0,
                                  shape=[], raw_nbytes=0, content_hash=bytes(16),
                                  parent_hash=None, planes=[]))
    index = (b"S4IX" + struct.pack("<I", count) + rec * records + bytes(16)
             + struct.pack("<I", 0) + struct.pack("<I", 0) + struct.pack("<H", 0) + tail)
    return craft.build(craft.parse(buf.getvalue()), index=index)


def test_the_tensor_count_is_limited_before_the_index_is_parsed() -> None:
    import time

    import pytest

    import s4format
    from s4format import reader
    from s4format.schema import Index, TensorRecord

    # the constants the pre-checks use are the schema's smallest record and index
    assert len(TensorRecord.build(dict(name="", dtype=1, layout=0, transform=0, flags=0, ndim=0,
                                       shape=[], raw_nbytes=0, content_hash=bytes(16),
                                       parent_hash=None, planes=[]))) == reader.MIN_TENSOR_RECORD
    assert len(Index.build(dict(index_magic=b"S4IX", tensors=[], parent_id=bytes(16), tree=b"",
                                metadata=b"", extensions=[]))) == reader.MIN_INDEX
    many = _index_file(300_000, 300_000)  # 9.6 MB of records
    t0 = time.perf_counter()
    with pytest.raises(s4format.LimitError, match=r"300000 tensors.*max_tensors"):
        s4format.Reader(many, max_tensors=100_000)
    assert time.perf_counter() - t0 < 1.0  # refused from the count, nothing parsed
    with pytest.raises(s4format.FormatError, match="cannot fit"):
        s4format.Reader(_index_file(2**31, 1))


def test_a_large_malformed_index_is_not_parsed_twice(monkeypatch) -> None:
    import pytest

    import s4format
    from s4format import reader

    large = _index_file(5000, 5000, tail=b"\x00")  # a byte after the extensions
    small = _index_file(500, 500, tail=b"\x00")
    calls = []
    real = reader.Index.parse
    monkeypatch.setattr(reader.Index, "parse", lambda raw: calls.append(1) or real(raw))
    monkeypatch.setattr(reader, "REPARSE_TENSORS", 1000)
    with pytest.raises(s4format.FormatError, match="malformed index"):
        s4format.Reader(large)
    assert calls == []
    with pytest.raises(s4format.FormatError, match="malformed index"):
        s4format.Reader(small)  # small: the reference parser names the fault
    assert calls == [1]
