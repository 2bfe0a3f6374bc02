"""The object tree: exact encodings, round trips, every refusal, and no code execution ever —
a pickle stream or a typed value naming a builtin comes back refused or as inert data."""

from __future__ import annotations

import builtins
import math
import pickle
import struct
from collections import OrderedDict, defaultdict, namedtuple
from enum import IntEnum

import numpy as np
import pytest

import s4format
from conformance import craft
from s4format import FormatError, LimitError, Reader, TensorRef, Typed, UnsupportedObjectError
from s4format.objtree import MAX_DEPTH, decode, encode
from tests.format.common import assert_same_tree, small_file

BLOB = small_file()


class _Level(IntEnum):
    HIGH = 1


_Pair = namedtuple("_Pair", "a b")


@pytest.mark.parametrize(("value", "encoded"), [
    (None, b"\x00"),
    (False, b"\x01"),
    (True, b"\x02"),
    (-2, b"\x03" + struct.pack("<q", -2)),
    (2**63, b"\x04\x09\x00\x00\x00" + (2**63).to_bytes(9, "little", signed=True)),
    (1.5, b"\x05" + struct.pack("<d", 1.5)),
    ("é", b"\x06\x02\x00\x00\x00\xc3\xa9"),
    (b"\x00\xff", b"\x07\x02\x00\x00\x00\x00\xff"),
    ([None], b"\x08\x01\x00\x00\x00\x00"),
    ((), b"\x09\x00\x00\x00\x00"),
    ({"a": 1}, b"\x0a\x01\x00\x00\x00\x06\x01\x00\x00\x00a\x03" + struct.pack("<q", 1)),
    (TensorRef(3), b"\x0b\x03\x00\x00\x00"),
    (Typed("torch.Size", (2,)), b"\x0c\x0a\x00torch.Size\x09\x01\x00\x00\x00\x03"
                                + struct.pack("<q", 2)),
    (OrderedDict(), b"\x0d\x00\x00\x00\x00"),
])
def test_encoding_is_as_specified(value, encoded: bytes) -> None:
    assert encode(value) == encoded
    assert_same_tree(decode(encoded, 4), value)


@pytest.mark.parametrize("value", [
    0, -1, 2**63 - 1, -(2**63), 2**63, -(2**63) - 1, 2**64, 2**1000 + 1, -(2**1000),
    0.0, -0.0, math.inf, -math.inf, math.nan, 5e-324, -1.7976931348623157e308,
    "", "ünïcödé 🙂", "\x00", b"", bytes(range(256)),
    [1, [2, [3, ()]]], (1, "a", None), {(1, "k"): [b"v"], None: 1.0, 2: {}, b"b": True},
    OrderedDict([("z", 1), ("a", 2)]), Typed("x.unknown", {"nested": Typed("y", None)}),
])
def test_values_round_trip(value) -> None:
    assert_same_tree(decode(encode(value), 0), value)


@pytest.mark.parametrize("bits", [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF0000000000001,
                                  0xFFF00000DEADBEEF, 0x7FFFFFFFFFFFFFFF, 0x0000000000000001])
def test_float_bit_patterns_are_kept(bits: int) -> None:
    value = struct.unpack("<d", struct.pack("<Q", bits))[0]
    back = decode(encode(value), 0)
    assert struct.pack("<d", back) == struct.pack("<Q", bits)


def test_nan_keys_are_never_duplicates() -> None:
    nan = struct.pack("<d", math.nan)
    data = b"\x0a\x02\x00\x00\x00" + (b"\x05" + nan + b"\x00") * 2
    back = decode(data, 0)
    assert len(back) == 2 and all(math.isnan(k) for k in back)
    assert encode(back) == data


def test_tensor_references_must_be_below_the_tensor_count() -> None:
    assert encode([TensorRef(0), TensorRef(2)], 3) == \
        b"\x08\x02\x00\x00\x00\x0b\x00\x00\x00\x00\x0b\x02\x00\x00\x00"
    with pytest.raises(UnsupportedObjectError, match=r"tensor reference 3 at <root>\[1\] is out "
                                                     r"of range \(3 tensors\)"):
        encode([TensorRef(0), TensorRef(3)], 3)


def test_ordered_dict_and_dict_keep_their_type_and_order() -> None:
    tree = [{"b": 1, "a": 2}, OrderedDict([("b", 1), ("a", 2)])]
    back = decode(encode(tree), 0)
    assert type(back[0]) is dict and type(back[1]) is OrderedDict
    assert list(back[0]) == ["b", "a"] and list(back[1]) == ["b", "a"]


def _nested(depth: int) -> list:
    tree: list = []
    for _ in range(depth):
        tree = [tree]
    return tree


def test_nesting_up_to_the_limit_round_trips() -> None:
    tree = _nested(MAX_DEPTH)
    assert decode(encode(tree), 0) == tree


def test_writer_refuses_nesting_beyond_the_limit() -> None:
    with pytest.raises(UnsupportedObjectError, match="object tree deeper than 256 at <root>"):
        encode(_nested(MAX_DEPTH + 1))


@pytest.mark.parametrize("depth", [MAX_DEPTH + 1, 10_000, 1_000_000])
@pytest.mark.parametrize(("level", "leaf"), [
    (b"\x08\x01\x00\x00\x00", b"\x00"),  # lists
    (b"\x0a\x01\x00\x00\x00\x06\x01\x00\x00\x00k", b"\x02"),  # dicts of a str key
    (b"\x08\x01\x00\x00\x00", b"\x03" + bytes(8)),  # lists, an int at the bottom
])
def test_reader_refuses_nesting_beyond_the_limit(depth: int, level: bytes, leaf: bytes) -> None:
    with pytest.raises(LimitError, match="object tree nested deeper than 256"):
        decode(level * depth + leaf, 0)


@pytest.mark.parametrize("leaf", [b"\x02", b"\x03" + bytes(8), b"\x06\x01\x00\x00\x00v"])
def test_dicts_of_scalars_decode_at_the_depth_limit(leaf: bytes) -> None:
    level = b"\x0a\x01\x00\x00\x00\x06\x01\x00\x00\x00k"
    # the root is depth 0: MAX_DEPTH dicts put the deepest one's key and value at the limit
    tree = decode(level * MAX_DEPTH + leaf, 0)
    for _ in range(MAX_DEPTH):
        tree = tree["k"]
    assert tree == decode(leaf, 0)
    with pytest.raises(LimitError):
        decode(level * (MAX_DEPTH + 1) + leaf, 0)


@pytest.mark.parametrize(("data", "message"), [
    (b"\x08\xff\xff\xff\xff", "declares 4294967295 items at tree offset 1, more than its "
                              "remaining bytes can hold"),
    (b"\x09\x00\x00\x00\x10" + bytes(10), "declares 268435456 items"),
    (b"\x0a\xff\xff\xff\x7f\x00\x00", "declares 2147483647 items"),
    (b"\x0d\x02\x00\x00\x00\x00\x00\x00", "declares 2 items"),
    (b"\x06\xff\xff\xff\xff", "object tree truncated: needs 4294967295 bytes at tree offset 5"),
    (b"\x07\x10\x00\x00\x00abc", "object tree truncated: needs 16 bytes"),
    (b"\x04\xff\xff\xff\xff", "object tree truncated"),
    (b"\x03\x01", "object tree truncated: needs 8 bytes"),
    (b"", "object tree truncated: needs 1 bytes at tree offset 0"),
    (b"\x0e", "unknown object tag 14 at tree offset 0"),
    (b"\x08\x01\x00\x00\x00\xff", "unknown object tag 255 at tree offset 5"),
    (b"\x00\x00", "object tree has 1 trailing bytes"),
    (b"\x04\x01\x00\x00\x00\x05", "non-canonical big integer at tree offset 0"),
    (b"\x04\x09\x00\x00\x00" + (5).to_bytes(9, "little"), "non-canonical big integer"),
    (b"\x04\x0a\x00\x00\x00" + (2**63).to_bytes(10, "little"), "non-canonical big integer"),
    (b"\x04\x00\x00\x00\x00", "non-canonical big integer"),
    (b"\x06\x02\x00\x00\x00\xc3\x28", "string at tree offset 0 is not valid UTF-8"),
    (b"\x0c\x01\x00\xff\x00", "typed-value name at tree offset 0 is not UTF-8"),
    (b"\x0a\x02\x00\x00\x00\x00\x00\x00\x02", "duplicate dict key None at tree offset 0"),
    (b"\x0a\x01\x00\x00\x00\x08\x00\x00\x00\x00\x00",
     "a list at tree offset 5 in a dict key"),
    (b"\x0a\x01\x00\x00\x00\x0c\x01\x00k\x00\x00",
     "a typed value at tree offset 5 in a dict key"),
    (b"\x0a\x01\x00\x00\x00\x09\x01\x00\x00\x00\x0a\x00\x00\x00\x00\x00",
     "a dict at tree offset 10 in a dict key"),
    (b"\x0b\x04\x00\x00\x00", "tensor reference 4 at tree offset 0 is out of range (4 tensors)"),
    # str keys and scalar values of dicts, and ints of lists, are read without node()
    (b"\x0a\x01\x00\x00\x00\x06\xff\xff\xff\xff",
     "<root>: object tree truncated: needs 4294967295 bytes at tree offset 10"),
    (b"\x0a\x01\x00\x00\x00\x06\x01\x00", "object tree truncated: needs 4 bytes at tree offset 6"),
    (b"\x0a\x01\x00\x00\x00\x06\x02\x00\x00\x00\xc3\x28\x00",
     "string at tree offset 5 is not valid UTF-8"),
    (b"\x0a\x01\x00\x00\x00\x06\x01\x00\x00\x00k\x06\x05\x00\x00\x00ab",
     "k: object tree truncated: needs 5 bytes at tree offset 16"),
    (b"\x0a\x01\x00\x00\x00\x06\x01\x00\x00\x00k\x06\x02\x00\x00\x00\xc3\x28",
     "k: string at tree offset 11 is not valid UTF-8"),
    (b"\x0a\x01\x00\x00\x00\x06\x01\x00\x00\x00k\x03\x01",
     "k: object tree truncated: needs 8 bytes at tree offset 12"),
    (b"\x0a\x02\x00\x00\x00\x06\x01\x00\x00\x00k\x02\x06\x01\x00\x00\x00k\x01",
     "duplicate dict key 'k' at tree offset 0"),
    (b"\x08\x02\x00\x00\x00\x03" + bytes(8) + b"\x03\x01",
     "1: object tree truncated: needs 8 bytes at tree offset 15"),
    # Keys are equal as Python values: True == 1 == 1.0, 0 == -0.0.
    (b"\x0a\x02\x00\x00\x00\x02\x00\x03" + struct.pack("<q", 1) + b"\x00",
     "duplicate dict key 1 at tree offset 0"),
    (b"\x0a\x02\x00\x00\x00\x05" + struct.pack("<d", 0.0) + b"\x00\x05"
     + struct.pack("<d", -0.0) + b"\x00", "duplicate dict key -0.0"),
    (b"\x0d\x02\x00\x00\x00\x09\x01\x00\x00\x00\x02\x00\x09\x01\x00\x00\x00\x05"
     + struct.pack("<d", 1.0) + b"\x00", r"duplicate dict key (1.0,)"),
])
def test_malformed_trees(data: bytes, message: str) -> None:
    with pytest.raises(FormatError, match=message.replace("(", r"\(").replace(")", r"\)")):
        decode(data, 4)


@pytest.mark.parametrize(("value", "message"), [
    ({1, 2}, "type builtins.set at <root>"),
    ([object()], r"type builtins.object at <root>\[0\]"),
    ({"k": np.float64(1.0)}, r"numpy.float64 at <root>\['k'\]"),
    ({"k": defaultdict(int)}, "collections.defaultdict"),
    ({frozenset(): 1}, "dict key of type frozenset at <root>"),
    ({(1, (2, frozenset())): 1}, "dict key of type tuple at <root> is not stored"),
    ("\ud800", "string at <root> is not valid Unicode"),
    (_Level.HIGH, "type tests.format.test_objtree._Level at <root>"),
    (_Pair(1, 2), "type tests.format.test_objtree._Pair at <root>"),
    ([1j], "type builtins.complex"),
    ({"f": len}, "builtin_function_or_method"),
    ({"m": math}, "type builtins.module"),
    ({"c": int}, "type builtins.type"),
    ({"r": TensorRef(-1)}, r"tensor reference -1 at <root>\['r'\] is out of range"),
    ({"r": TensorRef(2**32)}, "tensor reference 4294967296 at"),
    (Typed("\ud800", 1), r"typed-value name '\\ud800' at <root> is not a valid Unicode str"),
    (Typed(b"torch.Size", 1), "typed-value name b'torch.Size' at <root> is not a valid"),
    ([Typed("x" * 65536, 1)], r"typed-value name at <root>\[0\] is over 65535 bytes"),
])
def test_unstorable_objects_are_refused_with_their_path(value, message: str) -> None:
    with pytest.raises(UnsupportedObjectError, match=message):
        encode(value)


@pytest.mark.parametrize(("value", "path"), [
    ({"a": [Typed("t", {("x", 1): [0, object()]})]}, "<root>['a'][0]<t>[('x', 1)][1]"),
    ({(1, "\ud800"): 1}, "<root>.<key (1, '\\ud800')>[1]"),
    (OrderedDict([(2, {"k" * 90: {3.5: set()}})]),
     "<root>[2][" + repr("k" * 90)[:77] + "...][3.5]"),
])
def test_a_path_is_shown_whole_however_deep(value, path: str) -> None:
    # (the encoder builds the path only for the message, as the error unwinds)
    with pytest.raises(UnsupportedObjectError) as got:
        encode(value)
    assert f" at {path}" in str(got.value), str(got.value)


# -- a tree from a file is data, never code ----------------------------------------------------

class _Armed:
    """Unpickling this creates ``path``: proof that a pickle stream ran code."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return (builtins.open, (self.path, "w"))


def _payload(path) -> bytes:
    return pickle.dumps(_Armed(str(path)), protocol=2)


def test_the_payload_is_armed(tmp_path) -> None:
    marker = tmp_path / "ran"
    pickle.loads(_payload(marker)).close()
    assert marker.exists()


def _with_tree(tree: bytes) -> bytes:
    parts = craft.parse(BLOB)
    parts.index["tree"] = tree
    return craft.build(parts)


@pytest.mark.parametrize("protocol", [0, 2, 5])
def test_pickle_stream_in_place_of_the_tree_is_refused(tmp_path, protocol: int) -> None:
    marker = tmp_path / "ran"
    payload = pickle.dumps(_Armed(str(marker)), protocol=protocol)
    with pytest.raises(FormatError, match=f"unknown object tag {payload[0]} at tree offset 0"):
        Reader(_with_tree(payload))
    assert not marker.exists()


def test_pickle_stream_in_metadata_is_refused(tmp_path) -> None:
    marker = tmp_path / "ran"
    parts = craft.parse(BLOB)
    parts.index["metadata"] = _payload(marker)
    with pytest.raises(FormatError, match="unknown object tag 128"):
        Reader(craft.build(parts))
    assert not marker.exists()


def test_pickle_stream_stored_as_bytes_comes_back_as_bytes(tmp_path) -> None:
    marker = tmp_path / "ran"
    payload = _payload(marker)
    with Reader(_with_tree(encode({"blob": payload, "w": TensorRef(0)}))) as r:
        tree = r.load()
    assert tree["blob"] == payload
    assert isinstance(tree["w"], s4format.Tensor)
    assert not marker.exists()


@pytest.mark.parametrize("name", ["builtins.eval", "builtins.exec", "builtins.open",
                                  "os.system", "posix.system", "pickle.loads"])
def test_typed_values_naming_callables_come_back_inert(tmp_path, name: str) -> None:
    marker = tmp_path / "ran"
    code = f"open({str(marker)!r}, 'w')"
    argument = {"eval": code, "args": (str(marker), "w"), "pickle": _payload(marker)}
    with Reader(_with_tree(encode(Typed(name, argument)))) as r:
        loaded = r.load()
    assert type(loaded) is Typed
    assert loaded.name == name
    assert_same_tree(loaded.value, argument)
    assert not marker.exists()


@pytest.mark.parametrize(("old", "path"), [
    (b"xy", "a.1.b: string at tree offset 36"),
    (b"zz", "a.1.('k', 2): string at tree offset 63"),
    (b"\x06\x01\x00\x00\x00k", "a.1.0: string at tree offset 48"),  # inside a tuple key
])
def test_decode_errors_name_the_key_path(old: bytes, path: str) -> None:
    """The decoder keeps no path while it works; an error collects it as it unwinds."""
    data = encode({"a": [1, {"b": "xy", ("k", 2): "zz"}]})
    bad = data.replace(old, old[:-2] + b"\xc3\x28" if len(old) == 2 else old[:-1] + b"\xff")
    with pytest.raises(FormatError) as info:
        decode(bad, 4)
    assert str(info.value).startswith(path + " is not valid UTF-8")
