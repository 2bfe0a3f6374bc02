"""Rule O12 for the typed names of Python values (spec/objects.md, "Python values"): each form is
checked as the tree is decoded, accepts exactly what Python's own constructors accept, and an
error names the key path and tree offset."""

from __future__ import annotations

import datetime as dt
import re
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from conformance.generate import tree_bytes
from s4format import FormatError, LimitError, objtree, typedvalues
from s4format.objtree import Typed

SPEC = Path(__file__).resolve().parents[2] / "spec" / "objects.md"
SETTINGS = dict(max_examples=200, deadline=None, derandomize=True)


def decode(tree: Any) -> Any:
    """``tree`` written without the writer's checks, decoded as the reader does."""
    return objtree.decode(tree_bytes(tree), 0,
                          check_typed=lambda name, v: typedvalues.check(name, v, None))


def accepted(name: str, value: Any) -> bool:
    try:
        decode(Typed(name, value))
    except FormatError:
        return False
    return True


def python_accepts(build: Any) -> bool:
    try:
        build()
    except (ValueError, OverflowError, TypeError):
        return False
    return True


def test_the_spec_table_and_the_checks_name_the_same_typed_names() -> None:
    section = SPEC.read_text().split("### Python values")[1].split("#### User names")[0]
    names = {n for row in re.findall(r"^\| (`[^|]+`) \|", section, re.M)
             for n in re.findall(r"`([a-z]+\.[A-Za-z]+)`", row)}
    python = {n for n in typedvalues._RULES if n.split(".")[0] in
              ("argparse", "enum", "pathlib", "datetime", "collections")}
    assert names == python and len(names) == 15


@settings(**SETTINGS)
@given(y=st.integers(-1, 10_001), m=st.integers(-1, 13), d=st.integers(-1, 32))
def test_dates_are_what_python_accepts(y: int, m: int, d: int) -> None:
    assert accepted("datetime.date", (y, m, d)) == python_accepts(lambda: dt.date(y, m, d))


@settings(**SETTINGS)
@given(fields=st.tuples(st.integers(-1, 24), st.integers(-1, 60), st.integers(-1, 60),
                        st.integers(-1, 1_000_000), st.integers(-1, 2)))
def test_times_are_what_python_accepts(fields: tuple[int, ...]) -> None:
    h, mi, s, us, fold = fields
    assert accepted("datetime.time", (*fields, None)) \
        == python_accepts(lambda: dt.time(h, mi, s, us, fold=fold))
    assert accepted("datetime.datetime", (2024, 2, 29, *fields, None)) \
        == python_accepts(lambda: dt.datetime(2024, 2, 29, h, mi, s, us, fold=fold))


@settings(**SETTINGS)
@given(days=st.one_of(st.integers(-2, 2), st.integers(-10**9, 10**9)),
       seconds=st.integers(-1, 86_401), us=st.integers(-1, 1_000_001))
def test_timedeltas_are_python_normalised_triples(days: int, seconds: int, us: int) -> None:
    def normal() -> None:
        d = dt.timedelta(days=days, seconds=seconds, microseconds=us)
        if (d.days, d.seconds, d.microseconds) != (days, seconds, us):
            raise ValueError("not normalised")
    assert accepted("datetime.timedelta", (days, seconds, us)) == python_accepts(normal)


@settings(**SETTINGS)
@given(offset=st.one_of(st.integers(-86_400_000_001, -86_399_999_998),
                        st.integers(86_399_999_998, 86_400_000_001),
                        st.integers(-10**12, 10**12)))
def test_timezone_offsets_are_what_python_accepts(offset: int) -> None:
    assert accepted("datetime.timezone", (offset, None)) \
        == python_accepts(lambda: dt.timezone(dt.timedelta(microseconds=offset)))


@pytest.mark.parametrize(("value", "error"), [
    (([], None), None), (([1, 2], 2), None), (([], 2**63 - 1), None),
    (([1, 2], 1), FormatError), (([], 2**63), LimitError), (([], -1), FormatError),
    (([], True), FormatError), (([], 1.0), FormatError), (((), None), FormatError),
])
def test_deque_maxlen_bounds_its_items(value: tuple, error: type | None) -> None:
    if error is None:
        assert decode(Typed("collections.deque", value)) == Typed("collections.deque", value)
    else:
        with pytest.raises(error, match=r"collections\.deque") as info:
            decode(Typed("collections.deque", value))
        assert type(info.value) is error


@pytest.mark.parametrize("name", ["int", "collections.defaultdict", "my.Factory", None])
def test_default_factories_are_builtins_or_user_names(name: str | None) -> None:
    assert accepted("collections.defaultdict", (name, {}))


@pytest.mark.parametrize("name", ["", "torch.zeros", "s4.view", "collections.UserDict",
                                  "datetime.now", 3])
def test_reserved_or_empty_names_are_no_user_names(name: Any) -> None:
    assert not accepted("collections.defaultdict", (name, {}))
    assert not accepted("enum.Enum", (name, "A"))
    assert not accepted("collections.namedtuple", (name, {}))


def test_a_builtin_factory_name_is_no_class_name() -> None:
    assert accepted("collections.defaultdict", ("int", {}))
    with pytest.raises(FormatError, match=r"^x: enum\.Enum class name 'int' is a name the "
                                          r"registry reserves"):
        decode({"x": Typed("enum.Enum", ("int", "A"))})
    assert not accepted("collections.namedtuple", ("list", {}))


def test_a_timezone_inside_a_datetime_is_checked_first_and_named() -> None:
    bad = Typed("datetime.timezone", (86_400_000_000, None))
    tree = {"run": [Typed("datetime.datetime", (2026, 1, 1, 0, 0, 0, 0, 0, bad))]}
    with pytest.raises(FormatError, match=r"^run\.0\.8: datetime\.timezone offset in microseconds "
                                          r"must be an int in .*\(typed value at tree offset "
                                          r"\d+\)$"):
        decode(tree)


def test_errors_name_the_key_path() -> None:
    tree = {"ckpt": {"args": Typed("argparse.Namespace", {"lr": 0.1, 1: 2})}}
    with pytest.raises(FormatError, match=r"^ckpt\.args: argparse\.Namespace attribute names "
                                          r"must be str, not 1 \(typed value at tree offset"):
        decode(tree)


def test_unregistered_names_stay_opaque_and_unchecked() -> None:
    value = ("not", "a", "date")
    assert decode({"x": Typed("datetime.Date", value)}) == {"x": Typed("datetime.Date", value)}
