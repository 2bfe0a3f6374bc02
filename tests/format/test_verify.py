"""verify(): every plane, content hash and padding byte; problems named by tensor and plane."""

from __future__ import annotations

import pytest

import s4format
from conformance import craft
from s4format import Reader, layouts
from s4format.verify import Problem
from tests.format.common import small_file

BLOB = small_file()


def test_valid_file_has_no_problems_and_decodes_each_plane_once(monkeypatch) -> None:
    calls = []
    real, real_merged = Reader._decode_plane, layouts.merge_stored

    def counting(self, t, k, stored):
        calls.append((t.name, k))
        return real(self, t, k, stored)

    def merged(layout, itemsize, raw_nbytes, planes, xor_into=None, leaves=None):  # in pieces
        raw = real_merged(layout, itemsize, raw_nbytes, planes, xor_into, leaves)
        calls.extend([("merged", k) for k in range(len(planes))] if raw is not None else [])
        return raw
    monkeypatch.setattr(Reader, "_decode_plane", counting)
    monkeypatch.setattr(layouts, "merge_stored", merged)
    with Reader(BLOB) as r:
        assert s4format.verify(r) == []
        planes = [k for t in r.tensors for k in range(len(t.planes))]
    assert [k for _name, k in calls] == planes


def test_damaged_planes_of_several_tensors_are_all_listed() -> None:
    parts = craft.parse(BLOB)
    blob = bytearray(BLOB)
    for t, k in ((0, 0), (3, 0), (3, 2)):
        p = parts.tensors[t]["planes"][k]
        blob[p["offset"] + p["stored_len"] - 1] ^= 0x80
    with Reader(bytes(blob)) as r:
        problems = s4format.verify(r)
    assert [(p.tensor, p.plane) for p in problems] == \
        [("model.w", "raw"), ("emb", "sign"), ("emb", "mantissa0")]
    assert all("checksum of the" in p.message for p in problems)


def test_unaccounted_bytes_between_planes() -> None:
    # Move the data section's last plane 128 bytes later: a hole no alignment padding explains.
    parts = craft.parse(BLOB)
    exponent, last = parts.tensors[3]["planes"][1:]
    at = last["offset"] - 32
    parts.data = parts.data[:at] + bytes(128) + parts.data[at:]
    last["offset"] += 128
    hole_start = exponent["offset"] + exponent["stored_len"]
    with Reader(craft.build(parts)) as r:
        assert r.read("emb").data.tobytes() == Reader(BLOB).read("emb").data.tobytes()
        problems = s4format.verify(r)
    assert [str(p) for p in problems] == \
        [f"<buffer>: {last['offset'] - hole_start} unaccounted bytes at offset {hole_start} "
         "(more than alignment padding)"]


def test_delta_without_parent_is_reported_not_checked() -> None:
    parent = Reader(BLOB)
    child = craft.parse(BLOB)
    w = child.tensors[0]
    w["transform"], w["parent_hash"] = 1, w["content_hash"]
    child.index["parent_id"] = parent.checkpoint_id
    with Reader(craft.build(child)) as r:
        problems = s4format.verify(r)
    assert problems == [Problem("model.w", None, "<buffer>: tensor 'model.w' is a delta and was "
                                                 "not checked: give its parent (--parent)")]


@pytest.mark.parametrize("check_hashes", [True, False])
def test_content_hash_is_checked_whatever_the_reader_was_opened_with(check_hashes: bool) -> None:
    # model.w's raw plane rewritten with a valid plane checksum: only its content hash can tell.
    parts = craft.parse(BLOB)
    payload = bytearray(craft.plane_bytes(parts, 0, 0))
    payload[0] ^= 1
    craft.set_plane_bytes(parts, 0, 0, bytes(payload))
    with Reader(craft.build(parts), verify=check_hashes) as r:
        if not check_hashes:
            assert r.read("model.w").data.tobytes() == bytes(payload)
        problems = s4format.verify(r)
    assert [(p.tensor, p.plane) for p in problems] == [("model.w", None)]
    assert "<buffer>: tensor 'model.w' content hash mismatch after decoding" in problems[0].message


def test_problem_prints_as_its_message() -> None:
    assert str(Problem("t", "raw", "bad")) == "bad"


@pytest.mark.parametrize("align_log2", [0, 12])
def test_files_of_any_alignment_verify_clean(align_log2: int, tmp_path) -> None:
    path = tmp_path / "a.s4w"
    with s4format.Writer(path, align_log2=align_log2) as w:
        w.add("a", Reader(BLOB).read("emb"))
        w.add("b", Reader(BLOB).read("model.mask"))
    with Reader(path) as r:
        assert s4format.verify(r) == []


def test_a_tensor_is_fetched_in_one_read(monkeypatch) -> None:
    # One ranged GET per tensor on S3, not one per plane.
    reads = []
    with Reader(BLOB) as r:
        real = r.source.read_at

        def counting(offset, length):
            reads.append((offset, length))
            return real(offset, length)
        monkeypatch.setattr(r.source, "read_at", counting)
        for i, t in enumerate(r.tensors):
            reads.clear()
            r.read_raw(i)
            assert len(reads) == (1 if t.planes else 0), t.name
