"""Writer behaviour: codec policies, alignment, name rules, size guarantees, misuse."""

from __future__ import annotations

import io

import numpy as np
import pytest

import s4format
from s4format import FormatError, Reader, Tensor, Writer, codecs, layouts
from s4format.schema import FOOTER_SIZE, HEADER_SIZE
from tests.format.common import POLICIES, assert_same_tree, small_tree


@pytest.mark.parametrize("policy", POLICIES)
def test_policies_round_trip_the_same_tree(policy: str) -> None:
    blob = s4format.dumps(small_tree(), policy=policy)
    with Reader(blob) as r:
        assert_same_tree(r.load(), small_tree())
        assert s4format.verify(r) == []


def test_seed_policy_uses_its_fixed_assignment() -> None:
    rng = np.random.default_rng(0)
    a = rng.standard_normal(8192).astype("<f4")
    with Reader(s4format.dumps({"a": a}, policy="seed")) as r:
        t = r.tensors[0]
        assert t.layout is layouts.FP32
        by_label = {p.label: p.codec for p in t.planes}
    assert by_label["sign"] == codecs.BITPACK
    seed_choice = codecs.RANS if codecs.RANS in codecs.available() else codecs.RAW
    assert by_label["exponent"] == seed_choice
    gdeflate = codecs.GDEFLATE in codecs.available()
    assert all(by_label[m] in ((codecs.GDEFLATE, codecs.RAW) if gdeflate else (codecs.RAW,))
               for m in ("mantissa0", "mantissa1", "mantissa2"))


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown policy 'best'"):
        Writer(io.BytesIO(), policy="best")


@pytest.mark.parametrize("align_log2", [0, 1, 6, 12, 16])
def test_alignment_round_trips_and_offsets_are_aligned(align_log2: int) -> None:
    buf = io.BytesIO()
    tree = small_tree()
    with Writer(buf, align_log2=align_log2) as w:
        w.set_tree(s4format.writer._attach(tree, w, "", {}))
    blob = buf.getvalue()
    with Reader(blob) as r:
        assert r.alignment == 1 << align_log2
        assert r.header.align_log2 == align_log2
        offsets = [p.offset for t in r.tensors for p in t.planes]
        assert all(o % (1 << align_log2) == 0 for o in offsets)
        assert_same_tree(r.load(), tree)
        assert s4format.verify(r) == []
    if align_log2 == 0:
        # No padding at all: planes follow the header and each other back to back.
        with Reader(blob) as r:
            stored = sum(t.stored_nbytes for t in r.tensors)
            assert r.data_end == HEADER_SIZE + stored


@pytest.mark.parametrize("align_log2", [-1, 17])
def test_alignment_out_of_range_is_refused(align_log2: int) -> None:
    with pytest.raises(ValueError, match=r"align_log2 must be in 0\.\.16"):
        Writer(io.BytesIO(), align_log2=align_log2)


def test_duplicate_tensor_names_are_refused() -> None:
    with Writer(io.BytesIO()) as w:
        w.add("x", np.zeros(3, dtype="<f4"))
        with pytest.raises(FormatError, match="tensor name 'x' is used twice"):
            w.add("x", np.ones(3, dtype="<f4"))
        w.add("y", np.ones(3, dtype="<f4"))


def test_key_paths_that_collide_still_write_distinct_tensors() -> None:
    # "a.b" as one key and as a nested path, 1 and "1", are different places in the tree.
    tree = {"a.b": np.zeros(2, "<i4"), "a": {"b": np.ones(2, "<i4")},
            1: np.full(2, 7, "<i2"), "1": np.full(2, 9, "<i2")}
    with Reader(s4format.dumps(tree)) as r:
        assert len({t.name for t in r.tensors}) == 4
        assert_same_tree(r.load(), tree)


def test_tensor_names_follow_key_paths() -> None:
    with Reader(s4format.dumps(small_tree())) as r:
        assert [t.name for t in r.tensors] == ["model.w", "model.steps", "model.mask", "emb"]
    with Reader(s4format.dumps(np.zeros(3, "<f4"))) as r:
        assert [t.name for t in r.tensors] == ["<root>"]


def test_add_after_close_and_double_close_are_refused() -> None:
    w = Writer(io.BytesIO())
    w.add("x", np.zeros(1, "<f4"))
    w.close()
    with pytest.raises(ValueError, match="writer is closed"):
        w.add("y", np.zeros(1, "<f4"))
    with pytest.raises(ValueError, match="writer is closed"):
        w.close()


def test_metadata_must_map_str_to_str() -> None:
    with Writer(io.BytesIO()) as w, pytest.raises(TypeError, match="metadata must map str"):
        w.set_metadata({"epoch": 3})


def test_tree_referring_to_a_tensor_that_was_not_added_is_refused() -> None:
    with pytest.raises(s4format.UnsupportedObjectError,
                       match=r"tensor reference 5 at <root>\['x'\] is out of range \(0 tensors\)"):
        s4format.dumps({"x": s4format.TensorRef(5)})
    w = Writer(io.BytesIO())
    w.set_tree([w.add("a", np.zeros(2, "<f4")), s4format.TensorRef(1)])
    with pytest.raises(s4format.UnsupportedObjectError,
                       match=r"reference 1 at <root>\[1\] is out of range \(1 tensors\)"):
        w.close()
    w.abort()


def test_empty_tensor_name() -> None:
    buf = io.BytesIO()
    with Writer(buf) as w:
        w.set_tree(w.add("", np.arange(3, dtype="<i2")))
    with Reader(buf.getvalue()) as r:
        assert [t.name for t in r.tensors] == [""]
        assert r.load().data.tobytes() == np.arange(3, dtype="<i2").tobytes()


def test_unstorable_object_names_its_key_path() -> None:
    with pytest.raises(s4format.UnsupportedObjectError,
                       match=r"builtins.set at <root>\['opt'\]\[0\]"):
        s4format.dumps({"opt": [{1, 2}]})


def test_numpy_dtype_without_s4w_dtype_is_refused() -> None:
    with pytest.raises(FormatError, match=r"has no \.s4w dtype; wrap it in a Tensor"):
        s4format.dumps({"t": np.array(["x"])})


def test_tensor_with_mismatched_itemsize_is_refused() -> None:
    with pytest.raises(FormatError, match="cannot hold bfloat16 elements"):
        Tensor.from_numpy(np.zeros(4, "<f4"), dtype="bfloat16")


def test_exception_inside_writer_context_leaves_no_index() -> None:
    buf = io.BytesIO()
    with pytest.raises(RuntimeError), Writer(buf) as w:
        w.add("x", np.zeros(4, "<f4"))
        raise RuntimeError("interrupted")
    with pytest.raises(s4format.TruncatedError, match="did not finish"):
        Reader(buf.getvalue() + bytes(FOOTER_SIZE))


@pytest.mark.parametrize("policy", POLICIES)
def test_stored_never_exceeds_raw_on_incompressible_data(policy: str) -> None:
    rng = np.random.default_rng(9)
    tensors = {f"t{n}": rng.integers(0, 256, n, dtype=np.uint8).view("<f4")
               for n in (4, 64, 4096, 4096 * 5)}
    with Reader(s4format.dumps(tensors, policy=policy)) as r:
        for t in r.tensors:
            assert t.stored_nbytes <= t.raw_nbytes, t.name
            assert all(p.stored_len <= p.decoded_len for p in t.planes), t.name


def test_short_writes_of_a_raw_file_are_completed(tmp_path) -> None:
    # An unbuffered file (or socket) may take part of a write; Linux caps one write() at about
    # 2 GiB. Every byte must still reach the file, at the offsets the index records.
    import io

    import s4format

    class Trickle(io.RawIOBase):
        def __init__(self) -> None:
            self.data = bytearray()

        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            take = bytes(b[:777])
            self.data += take
            return len(take)

    rng = np.random.default_rng(3)
    arrays = {"a": rng.standard_normal(10_000).astype(np.float32),
              "b": rng.integers(0, 255, 5_001, dtype=np.uint8)}
    sink = Trickle()
    s4format.write(sink, arrays)
    back = s4format.Reader(bytes(sink.data)).load()
    for k, v in arrays.items():
        got = back[k].to_numpy()
        assert np.array_equal(got, v) and got.dtype == v.dtype


def test_a_file_object_that_takes_nothing_is_a_storage_error() -> None:
    import io

    import pytest

    import s4format
    from s4format.errors import StorageError

    class Stuck(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b) -> int:
            return 0

    with pytest.raises(StorageError, match="no progress"):
        s4format.write(Stuck(), {"a": np.zeros(10, np.float32)})


def test_a_non_blocking_raw_sink_that_would_block_is_a_storage_error() -> None:
    # RawIOBase.write returns None when a non-blocking stream takes nothing: counting those
    # bytes as written would leave the index pointing past what the sink holds
    import pytest

    import s4format
    from s4format.errors import StorageError

    class WouldBlock(io.RawIOBase):
        def writable(self) -> bool:
            return True

        def write(self, b):
            return None

    with pytest.raises(StorageError, match="would block"):
        s4format.write(WouldBlock(), {"a": np.zeros(10, np.float32)})


def test_the_writer_refuses_what_readers_refuse() -> None:
    # a conforming writer produces only files that pass every rule (spec/README.md): planes in
    # the wrong place, of an unknown codec, and an all-zero parent ID (X3) are refused before
    # a byte is written
    import pytest

    from s4format import UnsupportedCodecError, dtypes
    from s4format.writer import CodedPlane, CodedTensor

    u8 = dtypes.BY_NAME["uint8"]
    data = np.arange(100, dtype=np.uint8)
    cases = [
        (CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_SIGN, 0, codecs.RAW, 100, data),)),
         FormatError, "expects plane"),
        (CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, 99, 100, data),)),
         UnsupportedCodecError, "99"),
        (CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, codecs.RAW, 99, data[:99]),)),
         FormatError, "decoded length 99"),
    ]
    for coded, exc, match in cases:
        buf = io.BytesIO()
        w = Writer(buf)
        with pytest.raises(exc, match=match):
            w.add_coded("t", u8, (100,), coded, bytes(16))
    with pytest.raises(ValueError, match="no parent"):
        Writer(io.BytesIO(), parent_id=bytes(16))


def test_an_unregistered_nvcomp_ans_plane_is_written() -> None:
    # codec 6 is optional and GPU-only: a process that coded with nvCOMP may not have
    # registered a decoder for it; its planes are still written (P1/P2 still checked)
    from s4format import dtypes
    from s4format.writer import CodedPlane, CodedTensor

    assert codecs.NVCOMP_ANS not in codecs.available()
    data = np.arange(100, dtype=np.uint8)
    coded = CodedTensor(layouts.RAW, (CodedPlane(layouts.KIND_RAW, 0, codecs.NVCOMP_ANS, 100,
                                                 data[:40], b"\x00"),))
    w = Writer(io.BytesIO())
    w.add_coded("t", dtypes.BY_NAME["uint8"], (100,), coded, bytes(16))
