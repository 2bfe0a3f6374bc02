"""The reader and writer use construct's compiled form of the index schema: on every
conformance vector whose index parses, both forms read the same records and write back the
same bytes (bases, deltas, every dtype and codec, extensions)."""

from __future__ import annotations

from pathlib import Path

import pytest
from construct import ConstructError

from s4format.schema import Index, compiled_index
from tests.format.common import index_of

SUITES = Path(__file__).parents[2] / "conformance"
VECTORS = sorted(SUITES.glob("v1/*.s4w")) + sorted(SUITES.glob("v1.1/*.s4w"))


def test_compiled_index_reads_and_writes_what_the_interpreted_one_does() -> None:
    checked = deltas = 0
    for path in VECTORS:
        raw = index_of(path.read_bytes())
        if raw is None:
            continue
        try:
            want = Index.parse(raw)
        except ConstructError:
            with pytest.raises(Exception):  # noqa: B017 - bare struct/codec errors
                compiled_index().parse(raw)
            continue
        got = compiled_index().parse(raw)
        assert got == want, path.name
        assert compiled_index().build(want) == Index.build(want) == raw, path.name
        checked += 1
        deltas += any(t.parent_hash is not None for t in want.tensors)
    assert checked >= 100 and deltas >= 1, (checked, deltas)


def test_extension_data_cut_short_is_refused() -> None:
    # the compiled parser does not check a length-prefixed field's bytes are all there: an
    # index whose last extension's data runs past the end must still be refused (spec I2)
    import s4format
    from conformance import craft

    blob = (SUITES / "v1" / "extension_optional.s4w").read_bytes()
    parts = craft.parse(blob)
    index = craft.index_bytes(parts.index)
    s4format.Reader(craft.build(parts, index=index))  # as crafted: opens
    with pytest.raises(s4format.FormatError, match="malformed index"):
        s4format.Reader(craft.build(parts, index=index[:-1]))


def test_writer_refuses_ids_and_hashes_of_the_wrong_length() -> None:
    import io

    import numpy as np

    import s4format
    from s4format.writer import code_tensor

    with pytest.raises(ValueError, match="16 bytes"):
        s4format.Writer(io.BytesIO(), parent_id=bytes(20))
    w = s4format.Writer(io.BytesIO())
    raw = np.zeros(64, np.uint8)
    coded = code_tensor(raw, s4format.dtypes.BY_NAME["uint8"])
    with pytest.raises(ValueError, match="16 bytes"):
        w.add_coded("t", s4format.dtypes.BY_NAME["uint8"], (64,), coded, bytes(15))
