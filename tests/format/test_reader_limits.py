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
