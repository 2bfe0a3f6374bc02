"""Python values never make a load import or call what a file names: enum and named tuple
classes and default factories are rebuilt only from classes registered in the loading process;
anything else is refused by key path or, with strict=False, comes back as an inert Typed value.
Saving refuses what it cannot store by name, and refuses it before writing."""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import io
import sys
import zoneinfo
from collections import Counter, defaultdict, namedtuple
from pathlib import Path, PurePosixPath, PureWindowsPath

import pytest
import torch

import s4format
import s4weights
from conformance.generate import write_file
from s4format import FormatError, objtree, typedvalues
from s4format.objtree import Typed
from s4weights import pytypes, torchtree
from tests.weights.test_objects_checkpoint import assert_exact


class Color(enum.Enum):
    RED = 1
    GREEN = 2


Pair = namedtuple("Pair", "a b")


@pytest.fixture
def registry(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchtree, "_CONVERTERS", dict(torchtree._CONVERTERS))


@pytest.fixture
def probe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A module on sys.path that, imported or called, creates a marker file."""
    marker = tmp_path / "ran"
    (tmp_path / "s4w_probe.py").write_text(
        "from pathlib import Path\n"
        f"Path({str(marker)!r}).touch()\n"
        f"def make():\n    Path({str(marker)!r}).touch()\n"
        "class Color:\n    RED = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return marker


def file_with(tree: dict) -> bytes:
    return write_file([], tree)


NAMING_CODE = {
    "enum": Typed("enum.Enum", ("s4w_probe.Color", "RED")),
    "namedtuple": Typed("collections.namedtuple", ("s4w_probe.Color", {"RED": [1]})),
    "factory": Typed("collections.defaultdict", ("s4w_probe.make", {"k": [1]})),
    "system": Typed("collections.defaultdict", ("os.system", {})),
    "eval": Typed("enum.Enum", ("builtins.eval", "print(1)")),
}


@pytest.mark.parametrize("key", list(NAMING_CODE))
def test_names_of_code_are_never_imported_or_called(probe: Path, key: str) -> None:
    blob = file_with({"x": NAMING_CODE[key]})
    name = NAMING_CODE[key].value[0]
    with pytest.raises(s4weights.UnsupportedObjectError,
                       match=rf"^x: .*'{name}'.* is not registered here: register it with "
                             r"s4weights.register_type, or load with strict=False"):
        s4weights.load(blob)
    got = s4weights.load(blob, strict=False)
    assert got == {"x": NAMING_CODE[key]} and type(got["x"]) is s4format.Typed
    assert not probe.exists() and "s4w_probe" not in sys.modules


@pytest.mark.parametrize("member", ["__class__", "_missing_", "mro", "RED|__init__", "red"])
def test_only_members_of_a_registered_enum_are_looked_up(registry, member: str) -> None:
    s4weights.register_type("tests.Color", Color)
    blob = file_with({"c": Typed("enum.Enum", ("tests.Color", member))})
    with pytest.raises(s4weights.UnsupportedObjectError,
                       match=r"^c: enum class 'tests.Color' registered here has no member "):
        s4weights.load(blob)
    assert s4weights.load(blob, strict=False)["c"] == Typed("enum.Enum", ("tests.Color", member))


@pytest.mark.parametrize("key", ["__dict__", "__class__", "_get_kwargs", "__init__"])
def test_a_namespace_cannot_replace_what_its_class_defines(key: str) -> None:
    blob = file_with({"run": {"args": Typed("argparse.Namespace", {"lr": 1, key: {}})}})
    for strict in (True, False):
        with pytest.raises(FormatError, match=rf"^run\.args: argparse\.Namespace attribute "
                                              rf"'{key}' is not a plain attribute name"):
            s4weights.load(blob, strict=strict)


def test_unregistered_classes_load_as_stand_ins_with_their_tensors(registry) -> None:
    s4weights.register_type("tests.Color", Color)
    s4weights.register_type("tests.Pair", Pair)
    obj = {"c": Color.GREEN, "p": Pair(torch.arange(3), 1),
           "d": defaultdict(Pair, {"k": Pair(1, 2)})}
    buf = io.BytesIO()
    s4weights.save(obj, buf)
    torchtree._CONVERTERS.clear()
    with pytest.raises(s4weights.UnsupportedObjectError,
                       match=r"^c: enum class 'tests.Color' is not registered here"):
        s4weights.load(buf.getvalue())
    got = s4weights.load(buf.getvalue(), strict=False)
    assert got["c"] == Typed("enum.Enum", ("tests.Color", "GREEN"))
    assert got["p"].name == "collections.namedtuple" and got["p"].value[0] == "tests.Pair"
    assert torch.equal(got["p"].value[1]["a"], torch.arange(3)) and got["p"].value[1]["b"] == 1
    assert got["d"] == Typed("collections.defaultdict", (
        "tests.Pair", {"k": Typed("collections.namedtuple", ("tests.Pair", {"a": 1, "b": 2}))}))


def test_a_class_that_changed_since_saving_is_refused(registry) -> None:
    s4weights.register_type("tests.Pair", Pair)
    buf = io.BytesIO()
    s4weights.save({"p": Pair(1, 2)}, buf)
    s4weights.register_type("tests.Pair", namedtuple("Pair", "a c"))
    with pytest.raises(s4weights.UnsupportedObjectError,
                       match=r"^p: named tuple class 'tests.Pair' registered here has the fields "
                             r"\('a', 'c'\); the file stores \('a', 'b'\)"):
        s4weights.load(buf.getvalue())


class Flags(enum.IntFlag):
    A = 1
    B = 2


class PairWithDict(Pair):
    pass


@pytest.mark.parametrize(("obj", "message"), [
    (dt.datetime(2026, 1, 1, tzinfo=zoneinfo.ZoneInfo("UTC")),
     r"datetime at x has the tzinfo zoneinfo.ZoneInfo\(key='UTC'\); s4weights stores fixed "
     r"offsets \(datetime.timezone\) only"),
    (defaultdict(lambda: 0), r"defaultdict at x has the default factory <function .*, which a "
                             r"file can only name"),
    (Color.RED, r"cannot save object of type .*Color at x: .*register the class with "
                r"s4weights.register_type to store it \(an enum or named tuple class needs "
                r"only a name\)"),
    (argparse.Namespace(**{"__x": 1}), r"argparse.Namespace at x has the attribute '__x'"),
    (Flags(8), r"Flags member .* at x has no name to store it by"),
])
def test_what_cannot_be_stored_by_name_is_refused_when_saved(registry, obj, message) -> None:
    s4weights.register_type("tests.Flags", Flags)
    out = io.BytesIO()
    with pytest.raises(s4weights.UnsupportedObjectError, match=message):
        s4weights.save({"x": obj}, out)
    assert out.getvalue() == b""


def test_attributes_on_containers_are_refused(registry) -> None:
    s4weights.register_type("tests.PairWithDict", PairWithDict)
    c = Counter(a=1)
    c.note = "x"
    p = PairWithDict(1, 2)
    p.extra = 3
    for obj, name in ((c, "Counter"), (p, "PairWithDict")):
        with pytest.raises(s4weights.UnsupportedObjectError,
                           match=rf"{name} at x has attributes set on it \('\w+'\)"):
            s4weights.save({"x": obj}, io.BytesIO())


@pytest.mark.parametrize("name", ["argparse.X", "datetime", "collections.deque", "enum.Color",
                                  "pathlib.P", "int", "", "torch.Foo"])
def test_register_type_refuses_reserved_names(registry, name: str) -> None:
    with pytest.raises(ValueError, match="is reserved"):
        s4weights.register_type(name, Color)


def test_register_type_needs_converters_for_other_classes(registry) -> None:
    with pytest.raises(TypeError, match="neither an enum nor a named tuple class"):
        s4weights.register_type("tests.Path", PurePosixPath)
    with pytest.raises(TypeError, match="both encode and decode, or neither"):
        s4weights.register_type("tests.Color", Color, encode=lambda c: c.value)


def test_a_windows_path_loads_as_a_pure_path_on_this_system() -> None:
    blob = file_with({"p": Typed("pathlib.WindowsPath", "C:\\x\\y")})
    got = s4weights.load(blob)["p"]
    assert type(got) is PureWindowsPath and str(got) == "C:\\x\\y"


def test_nested_namespaces_are_refused_at_save_where_readers_would_refuse_the_file() -> None:
    def nested(levels: int) -> argparse.Namespace:
        ns = argparse.Namespace(leaf=1)
        for _ in range(levels - 1):
            ns = argparse.Namespace(inner=ns)
        return ns

    # each Namespace takes two levels (the typed value and its dict): 128 put the leaf at 256
    deepest = nested(128)
    assert_exact(s4weights.load(_saved(deepest)), deepest)
    with pytest.raises(s4weights.UnsupportedObjectError, match="nests more than 256 levels"):
        _saved(nested(129))


def _saved(obj: object) -> bytes:
    out = io.BytesIO()
    s4weights.save(obj, out)
    return out.getvalue()


def test_the_tree_holds_no_name_of_a_python_module(registry) -> None:
    s4weights.register_type("tests.Color", Color)
    tree = s4format.Reader(_saved({"c": Color.RED, "n": argparse.Namespace(a=1)})).tree
    assert tree == {"c": Typed("enum.Enum", ("tests.Color", "RED")),
                    "n": Typed("argparse.Namespace", {"a": 1})}
    assert objtree.encode(tree).count(b"test_objects_safety") == 0


def test_the_torch_layer_rebuilds_exactly_the_names_the_format_checks() -> None:
    python = {n for n in typedvalues._RULES if not n.startswith(("torch.", "numpy.", "s4."))}
    assert python == pytypes.NAMES
    assert list(pytypes.FACTORIES) == list(typedvalues.DEFAULT_FACTORIES)
    assert all(n == f"collections.{c.__name__}" or n == c.__name__
               for n, c in pytypes.FACTORIES.items())
    assert list(pytypes.PATHS) == list(typedvalues.PATHS)
