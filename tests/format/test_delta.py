"""Deltas: XOR against a parent checkpoint, chosen only when it codes smaller; reading needs
the very parent it was made against."""

from __future__ import annotations

import io

import numpy as np
import pytest

import s4format
from conformance import craft
from s4format import ChecksumError, ContentHashError, ParentMismatchError, Reader, Tensor, Writer


def _base() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(21)
    return {"w": rng.standard_normal(20000).astype("<f4"),
            "noise": rng.integers(0, 256, 8192, dtype=np.uint8),
            "bias": rng.standard_normal(300).astype("<f4")}


def _child(base: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(22)
    w = base["w"].copy()
    w[rng.integers(0, w.size, 50)] += 1e-3  # a fine-tuning step: few elements change
    return {"w": w, "noise": rng.integers(0, 256, 8192, dtype=np.uint8),  # unrelated
            "bias": base["bias"].copy()}


def _write(tensors: dict[str, np.ndarray], parent: Reader | None = None,
           parents: dict[str, Tensor | np.ndarray] | None = None) -> tuple[bytes, object]:
    buf = io.BytesIO()
    with Writer(buf, parent_id=parent.checkpoint_id if parent else None) as w:
        for name, a in tensors.items():
            w.add(name, a, parent=parents[name] if parents else None)
        result = w.close()
    return buf.getvalue(), result


@pytest.fixture(scope="module")
def chain() -> dict[str, object]:
    base = _base()
    base_blob, base_result = _write(base)
    base_reader = Reader(base_blob)
    child = _child(base)
    child_blob, child_result = _write(child, base_reader, base)
    alone_blob, _ = _write(child)
    return dict(base=base, base_blob=base_blob, base_result=base_result, child=child,
                child_blob=child_blob, child_result=child_result, alone_blob=alone_blob)


def test_xor_is_chosen_only_where_it_codes_smaller(chain) -> None:
    with Reader(chain["child_blob"]) as delta, Reader(chain["alone_blob"]) as alone:
        kinds = {t.name: t.is_delta for t in delta.tensors}
        assert kinds == {"w": True, "noise": False, "bias": True}
        for t in delta.tensors:
            full = alone.tensors[alone.index_of(t.name)]
            if t.is_delta:
                assert t.stored_nbytes < full.stored_nbytes, t.name
                assert t.parent_hash is not None
            else:
                assert t.stored_nbytes == full.stored_nbytes, t.name
                assert t.parent_hash is None
    result = chain["child_result"]
    assert result.delta_count == 2
    assert result.parent_id == chain["base_result"].checkpoint_id
    assert result.stored_nbytes < result.full_stored_nbytes
    # the result names each tensor's content hash (a delta's of its own bytes, not the XOR's)
    with Reader(chain["child_blob"], parent=Reader(chain["base_blob"])) as r:
        assert result.content_hashes == {t.name: t.content_hash for t in r.tensors}
        assert list(result.content_hashes) == [t.name for t in r.tensors]
        assert all(s4format.hashing.content_hash(r.read_raw(i)) == t.content_hash
                   for i, t in enumerate(r.tensors))


def test_delta_reads_back_exactly_with_its_parent(chain) -> None:
    with Reader(chain["child_blob"], parent=Reader(chain["base_blob"])) as r:
        assert r.parent_id == chain["base_result"].checkpoint_id
        for name, a in chain["child"].items():
            assert r.read(name).data.tobytes() == a.tobytes(), name
        assert s4format.verify(r) == []


def test_equal_sizes_do_not_choose_xor() -> None:
    # Incompressible either way: the delta would cost as much as the tensor, so it is not used.
    rng = np.random.default_rng(3)
    parent = rng.integers(0, 256, 5000, dtype=np.uint8)
    child = rng.integers(0, 256, 5000, dtype=np.uint8)
    blob, result = _write({"x": child}, Reader(_write({"x": parent})[0]), {"x": parent})
    assert result.delta_count == 0
    assert result.parent_id is None
    with Reader(blob) as r:
        assert not r.tensors[0].is_delta
        assert r.parent_id is None  # nothing depends on the parent: the file is a base
        assert r.read("x").data.tobytes() == child.tobytes()


def test_chain_of_two_deltas(chain) -> None:
    base_reader = Reader(chain["base_blob"])
    child_reader = Reader(chain["child_blob"], parent=base_reader)
    grandchild = {k: v.copy() for k, v in chain["child"].items()}
    grandchild["w"][:10] = 0
    blob, result = _write(grandchild, child_reader, chain["child"])
    assert result.delta_count >= 1
    with Reader(blob, parent=child_reader) as r:
        for name, a in grandchild.items():
            assert r.read(name).data.tobytes() == a.tobytes(), name
        assert s4format.verify(r) == []


def test_wrong_parent_is_refused_on_open(chain) -> None:
    other = Reader(s4format.dumps({"w": np.zeros(3, "<f4")}))
    with pytest.raises(ParentMismatchError, match="is a delta against checkpoint"):
        Reader(chain["child_blob"], parent=other)


def test_parent_given_to_a_base_is_refused(chain) -> None:
    with pytest.raises(ParentMismatchError, match="is not a delta; it takes no parent"):
        Reader(chain["base_blob"], parent=Reader(chain["base_blob"]))


def test_delta_without_parent_opens_but_its_tensors_do_not_read(chain) -> None:
    with Reader(chain["child_blob"]) as r:
        assert r.read("noise").data.tobytes() == chain["child"]["noise"].tobytes()
        with pytest.raises(ParentMismatchError, match="'w' is a delta; open the file with its "
                                                      "parent checkpoint"):
            r.read("w")
        problems = s4format.verify(r)
    assert [(p.tensor, p.plane) for p in problems] == [("w", None), ("bias", None)]
    assert all("--parent" in p.message for p in problems)


def test_parent_without_the_referenced_tensor(chain) -> None:
    # Same checkpoint ID but the record's parent hash names a tensor the parent lacks.
    parts = craft.parse(chain["child_blob"])
    w = next(t for t in parts.tensors if t["name"] == "w")
    w["parent_hash"] = bytes(16)
    with Reader(craft.build(parts), parent=Reader(chain["base_blob"])) as r:
        with pytest.raises(ParentMismatchError, match="holds no tensor with hash 0000"):
            r.read("w")
        assert r.read("noise").data.tobytes() == chain["child"]["noise"].tobytes()


def test_corrupted_delta_plane_fails_its_checksum(chain) -> None:
    parts = craft.parse(chain["child_blob"])
    i = next(i for i, t in enumerate(parts.tensors) if t["name"] == "bias")
    at = parts.tensors[i]["planes"][0]["offset"] - 32
    data = bytearray(parts.data)
    data[at] ^= 0x10
    parts.data = bytes(data)
    with Reader(craft.build(parts), parent=Reader(chain["base_blob"])) as r:
        with pytest.raises(ChecksumError, match=r"tensor 'bias' plane .*: checksum of the"):
            r.read("bias")
        assert [(p.tensor, p.plane) for p in s4format.verify(r)] == \
            [("bias", r.tensors[i].planes[0].label)]


def test_delta_with_valid_checksum_but_wrong_bytes_fails_its_content_hash(chain) -> None:
    parts = craft.parse(chain["child_blob"])
    i = next(i for i, t in enumerate(parts.tensors) if t["name"] == "bias")
    # Replace the delta by a raw plane of XOR bytes that differ in one bit from the true ones
    # (bias is unchanged, so its true delta is all zero), with a correct plane checksum.
    rec = parts.tensors[i]
    xor = np.zeros(rec["raw_nbytes"], dtype=np.uint8)
    xor[5] = 1
    parts.data += bytes(-(32 + len(parts.data)) % 64) + xor.tobytes()
    rec["layout"] = 0
    rec["planes"] = [dict(kind=0, index=0, codec=s4format.codecs.RAW, params=b"",
                          offset=32 + len(parts.data) - xor.size, stored_len=xor.size,
                          decoded_len=xor.size, checksum=0)]
    craft.set_plane_bytes(parts, i, 0, xor.tobytes())
    with Reader(craft.build(parts), parent=Reader(chain["base_blob"])) as r:
        with pytest.raises(ContentHashError, match="'bias' content hash mismatch"):
            r.read("bias")
        assert r.read("w").data.tobytes() == chain["child"]["w"].tobytes()
        problems = s4format.verify(r)
    # verify also notices the old delta plane, now bytes that no record accounts for.
    assert [(p.tensor, p.plane) for p in problems] == [("bias", None), (None, None)]
    assert "content hash mismatch" in problems[0].message
    assert "unaccounted bytes" in problems[1].message
