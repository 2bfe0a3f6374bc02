"""A payload held as pieces (s4format.pieces): its checksum is the checksum of the pieces'
concatenation, whatever the cut (leaves across pieces, empty pieces, one piece), and the
writer stores the same file as for the joined bytes."""

from __future__ import annotations

import io
import itertools

import numpy as np
import pytest

from s4format import codecs, dtypes, hashing, layouts
from s4format.pieces import Pieces
from s4format.writer import CodedPlane, CodedTensor, Writer


@pytest.mark.parametrize("sizes", [[0], [5], [70000], [65536, 65536], [1, 65535, 3, 200000, 7],
                                   [100] * 2000, [3 << 20, 0, 5, 1 << 20], [0, 0]])
def test_the_checksum_of_pieces_is_that_of_their_bytes(sizes) -> None:
    rng = np.random.default_rng(len(sizes))
    parts = [rng.integers(0, 256, s, dtype=np.uint8) for s in sizes]
    whole = np.concatenate(parts)
    got = Pieces(parts)
    assert got.nbytes == whole.size and np.array_equal(np.asarray(got), whole)
    assert hashing.plane_checksum(got) == hashing.plane_checksum(whole)


def test_a_plane_of_pieces_is_written_as_its_bytes() -> None:
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 256, 300_001, dtype=np.uint8)
    cut = [0, 7, 65536 + 3, 200_000, raw.size]
    files = []
    for payload in (raw, Pieces([raw[a:b] for a, b in itertools.pairwise(cut)])):
        buf = io.BytesIO()
        with Writer(buf) as w:
            coded = CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, codecs.RAW,
                                                         raw.size, payload),))
            w.set_tree({"x": w.add_coded("x", dtypes.by_name("uint8"), (raw.size,), coded,
                                         hashing.content_hash(raw))})
        files.append(buf.getvalue())
    assert files[0] == files[1]
