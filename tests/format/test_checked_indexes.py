"""Indexes found valid by their bytes (``s4format.reader._CheckedIndexes``): an index seen
before is not parsed or checked again where everything its rules read is the same (its bytes,
the data area's end, the alignment, the tensor limit, the codecs' libraries), and each reader
still holds records of its own."""

from __future__ import annotations

import io

import numpy as np
import pytest
import torch

import s4weights
from s4format import Reader, reader
from s4format.errors import LimitError, UnsupportedCodecError


@pytest.fixture(autouse=True)
def _fresh(monkeypatch):
    monkeypatch.setattr(reader, "_CHECKED_INDEXES", reader._CheckedIndexes())


def _file(seed: int = 0) -> bytes:
    g = torch.Generator().manual_seed(seed)
    state = {f"w{i}": torch.randn(64 + i, generator=g) for i in range(5)}
    state["b"] = torch.randn(300, generator=g).bfloat16()
    buf = io.BytesIO()
    s4weights.save(state, buf)
    return buf.getvalue()


def _parses(monkeypatch) -> list[str]:
    """The names of the files whose indexes are parsed from now on."""
    calls: list[str] = []
    real = Reader._parse_index

    def counted(self, raw):
        calls.append(self.name)
        return real(self, raw)
    monkeypatch.setattr(Reader, "_parse_index", counted)
    return calls


def test_an_index_seen_before_is_not_parsed_again(monkeypatch) -> None:
    blob = _file()
    parses = _parses(monkeypatch)
    first, again = Reader(blob), Reader(blob)
    assert len(parses) == 1
    assert first.tensors == again.tensors and first.tensors is not again.tensors
    assert (first.parent_id, first.metadata, first.checkpoint_id) == \
        (again.parent_id, again.metadata, again.checkpoint_id)
    for i in range(len(first.tensors)):
        assert np.array_equal(first.read_raw(i), again.read_raw(i))
    again.tensors.pop()  # (a reader's list is its own)
    assert len(Reader(blob).tensors) == len(first.tensors)
    Reader(_file(seed=1))  # another index is parsed
    assert len(parses) == 2


def test_a_lower_tensor_limit_is_checked_though_the_index_was_seen(monkeypatch) -> None:
    blob = _file()
    n = len(Reader(blob).tensors)
    with pytest.raises(LimitError, match="max_tensors"):
        Reader(blob, max_tensors=n - 1)
    assert len(Reader(blob, max_tensors=n).tensors) == n


def test_a_codec_whose_library_stopped_loading_is_refused_though_the_index_was_seen(
        monkeypatch) -> None:
    blob = _file()
    used = {p.codec for t in Reader(blob).tensors for p in t.planes}
    gone = max(used)

    def decodable(codec_id: int):
        if codec_id == gone:
            raise UnsupportedCodecError(f"codec {codec_id}'s library does not load here")
        return real(codec_id)
    real = reader.decodable_codec
    monkeypatch.setattr(reader, "decodable_codec", decodable)
    with pytest.raises(UnsupportedCodecError, match="does not load here"):
        Reader(blob)


def test_only_indexes_up_to_the_largest_kept_are_remembered(monkeypatch) -> None:
    blob = _file()
    monkeypatch.setattr(reader._CheckedIndexes, "LARGEST", 8)
    parses = _parses(monkeypatch)
    Reader(blob), Reader(blob)
    assert len(parses) == 2
