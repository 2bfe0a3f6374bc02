"""The vectors of format 1.2 (``conformance/v1.2/``): the typed names of Python values
(``spec/objects.md``, "Python values"), valid trees that use each form at its limits and one
must-fail vector per departure from a form (rule O12).

Every file declares minor 2 but ``py_values_in_minor_1``: readers go by the names a tree holds,
not by the minor. Trees are written here from the spec's tables as typed values, never by the
torch layer that maps Python objects to them.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any

import numpy as np

from conformance import generate as g
from s4format import codecs, layouts
from s4format.objtree import TensorRef, Typed

RULES = ["objects.md#python-values", "objects.md#rules", "validation.md#X4"]
MINOR = 2
FACTORIES = ("int", "float", "str", "bytes", "bool", "list", "tuple", "dict",
             "collections.OrderedDict", "collections.Counter", "collections.deque",
             "collections.defaultdict")
MAX_OFFSET = 86_400_000_000 - 1


def tz(offset: int, name: str | None = None) -> Typed:
    return Typed("datetime.timezone", (offset, name))


def tensors() -> list[g.TensorSpec]:
    """Two tensors stored raw: these vectors test trees, whatever a writer's codecs choose."""
    t = np.arange(4, dtype="<f4").view(np.uint8)
    s = np.array([7], "<i8").view(np.uint8)
    return [g.TensorSpec("t", "float32", (2, 2), t,
                         g.force(t, "float32", layouts.RAW, [codecs.RAW])),
            g.TensorSpec("s", "int64", (), s, g.force(s, "int64", layouts.RAW, [codecs.RAW]))]


def every_name() -> dict[str, Any]:
    """Each name once, tensors inside the containers, as a training checkpoint holds them."""
    t, s = TensorRef(0), TensorRef(1)
    return {
        "args": Typed("argparse.Namespace", {"lr": 0.001, "data_dir": Typed(
            "pathlib.PosixPath", "/data/run 1"), "w": t, "seed": 7}),
        "enum": Typed("enum.Enum", ("example.Color", "RED")),
        "flags": Typed("enum.Enum", ("example.Perm", "R|W")),
        "paths": [Typed("pathlib.PurePosixPath", "a/b"),
                  Typed("pathlib.PureWindowsPath", "C:\\data\\x.bin"),
                  Typed("pathlib.PosixPath", "/tmp"), Typed("pathlib.WindowsPath", "D:\\")],
        "date": Typed("datetime.date", (2026, 12, 1)),
        "time": Typed("datetime.time", (15, 4, 5, 123456, 0, None)),
        "started": Typed("datetime.datetime", (2026, 12, 1, 15, 4, 5, 6, 0, tz(0))),
        "local": Typed("datetime.datetime", (2026, 11, 1, 1, 30, 0, 0, 1,
                                             tz(-18_000_000_000, "EST"))),
        "elapsed": Typed("datetime.timedelta", (1, 3600, 500)),
        "counts": Typed("collections.Counter", {"a": 5, "b": 2, ("pair", 1): -1}),
        "recent": Typed("collections.deque", ([1.5, t, None], 10)),
        "by_key": Typed("collections.defaultdict", ("list", {"x": [s], 3: []})),
        "point": Typed("collections.namedtuple", ("example.Point", {"x": 1, "y": t})),
    }


def at_limits() -> dict[str, Any]:
    return {
        "dates": [Typed("datetime.date", d) for d in
                  ((1, 1, 1), (9999, 12, 31), (2000, 2, 29), (2024, 2, 29), (2023, 4, 30))],
        "times": [Typed("datetime.time", (0, 0, 0, 0, 0, tz(-MAX_OFFSET, ""))),
                  Typed("datetime.time", (23, 59, 59, 999_999, 1, tz(MAX_OFFSET, "far")))],
        "datetimes": [Typed("datetime.datetime", (1, 1, 1, 0, 0, 0, 0, 0, None)),
                      Typed("datetime.datetime", (9999, 12, 31, 23, 59, 59, 999_999, 1, tz(1)))],
        "deltas": [Typed("datetime.timedelta", (-999_999_999, 0, 0)),
                   Typed("datetime.timedelta", (999_999_999, 86_399, 999_999)),
                   Typed("datetime.timedelta", (-1, 86_399, 999_999))],
        "zones": [tz(0), tz(0, "UTC"), tz(MAX_OFFSET), tz(-MAX_OFFSET, "\u00e9t\u00e9")],
        "deques": [Typed("collections.deque", ([], 0)), Typed("collections.deque", ([1, 2], 2)),
                   Typed("collections.deque", ([], (1 << 63) - 1)),
                   Typed("collections.deque", ([], None))],
        "factories": [Typed("collections.defaultdict", (f, {})) for f in
                      (None, *FACTORIES, "example.Thing")],
        "empty": [Typed("argparse.Namespace", {}), Typed("collections.Counter", {}),
                  Typed("collections.namedtuple", ("example.Empty", {}))],
        "flags": [Typed("enum.Enum", ("example.Perm", "")),
                  Typed("enum.Enum", ("e", "not a member: a reader does not know"))],
        "paths": [Typed("pathlib.PurePosixPath", ""), Typed("pathlib.PosixPath", "a\x00b")],
    }


def valid_vectors() -> list[g.Vector]:
    out = []
    for vid, description, tree in (
            ("py_values", "every typed name of Python values once, as a training checkpoint "
             "holds them: args as a Namespace holding a path and a tensor, enum members (one a "
             "flag combination), the four path classes, date, time, datetimes with a UTC and a "
             "named offset, a timedelta, a Counter, a deque, a defaultdict and a named tuple "
             "holding tensors", every_name()),
            ("py_values_at_limits", "each form at its limits: the first and last dates, 29 "
             "February of 2000 and 2024, the extreme times and UTC offsets, timedelta's "
             "extremes, a deque at maxlen 0, at its length and at 2^63 - 1, a defaultdict of "
             "every default factory and of a user name, empty containers, the empty flag",
             at_limits())):
        vector = g.valid(vid, description, RULES, tensors(), tree, policy="auto")
        vector.data = g.edited(vector.data, lambda p: p.header.update(minor=MINOR))
        out.append(vector)
    first = out[0]
    out.append(g.Vector("py_values_in_minor_1", "py_values in a file whose header says minor "
                        "1: typed names are decoded by name, whatever minor a file declares",
                        ["README.md#versioning", *RULES],
                        g.edited(first.data, lambda p: p.header.update(minor=1)),
                        tensors=first.tensors, tree=first.tree))
    return out


def _cases() -> list[tuple[str, str, str, Any]]:
    """(id, description, error, the typed value) of one departure each."""
    def t(name: str, value: Any) -> Typed:
        return Typed(name, value)

    dt = "datetime.datetime"
    return [
        ("namespace_list", "an argparse.Namespace of a list", "FormatError",
         t("argparse.Namespace", [1])),
        ("namespace_int_key", "an argparse.Namespace with the key 1", "FormatError",
         t("argparse.Namespace", {1: 2})),
        ("namespace_odict", "an argparse.Namespace of an ordered dict (0D), not a dict",
         "FormatError", t("argparse.Namespace", OrderedDict(a=1))),
        ("enum_single", "an enum.Enum of a 1-tuple", "FormatError",
         t("enum.Enum", ("example.Color",))),
        ("enum_empty_class", "an enum.Enum of the class name ''", "FormatError",
         t("enum.Enum", ("", "RED"))),
        ("enum_reserved_class", "an enum.Enum naming the class 'torch.Color', a reserved "
         "prefix", "FormatError", t("enum.Enum", ("torch.Color", "RED"))),
        ("enum_int_member", "an enum.Enum whose member is the int 1, not a name",
         "FormatError", t("enum.Enum", ("example.Color", 1))),
        ("path_bytes", "a pathlib.PosixPath of bytes", "FormatError",
         t("pathlib.PosixPath", b"/tmp")),
        ("date_1900_02_29", "the date 1900-02-29 (1900 is not a leap year)", "FormatError",
         t("datetime.date", (1900, 2, 29))),
        ("date_month_13", "the date 2026-13-01", "FormatError", t("datetime.date", (2026, 13, 1))),
        ("date_year_0", "the date 0000-01-01", "FormatError", t("datetime.date", (0, 1, 1))),
        ("date_day_true", "a date whose day is True (a bool, not an int)", "FormatError",
         t("datetime.date", (2026, 1, True))),
        ("time_hour_24", "the time 24:00", "FormatError",
         t("datetime.time", (24, 0, 0, 0, 0, None))),
        ("time_fold_2", "a time of fold 2", "FormatError",
         t("datetime.time", (1, 0, 0, 0, 2, None))),
        ("time_tz_str", "a time whose tzinfo is the str 'UTC'", "FormatError",
         t("datetime.time", (1, 0, 0, 0, 0, "UTC"))),
        ("time_tz_timedelta", "a time whose tzinfo is a datetime.timedelta", "FormatError",
         t("datetime.time", (1, 0, 0, 0, 0, t("datetime.timedelta", (0, 0, 0))))),
        ("datetime_8_fields", "a datetime without its tzinfo field", "FormatError",
         t(dt, (2026, 1, 1, 0, 0, 0, 0, 0))),
        ("datetime_second_60", "a datetime at second 60 (a leap second)", "FormatError",
         t(dt, (2016, 12, 31, 23, 59, 60, 0, 0, None))),
        ("timedelta_seconds_86400", "a timedelta of (0, 86400, 0), not normalised",
         "FormatError", t("datetime.timedelta", (0, 86_400, 0))),
        ("timedelta_days_1e9", "a timedelta of 10^9 days", "FormatError",
         t("datetime.timedelta", (10**9, 0, 0))),
        ("timezone_24h", "a timezone offset of exactly 24 hours", "FormatError",
         tz(MAX_OFFSET + 1)),
        ("timezone_name_bytes", "a timezone whose name is bytes", "FormatError",
         tz(0, b"UTC")),
        ("counter_list", "a collections.Counter of a list", "FormatError",
         t("collections.Counter", [("a", 1)])),
        ("deque_over_maxlen", "a deque of 3 items and maxlen 2", "FormatError",
         t("collections.deque", ([1, 2, 3], 2))),
        ("deque_maxlen_2p63", "a deque of maxlen 2^63", "LimitError",
         t("collections.deque", ([], 1 << 63))),
        ("deque_maxlen_negative", "a deque of maxlen -1", "FormatError",
         t("collections.deque", ([], -1))),
        ("deque_tuple_items", "a deque whose items are a tuple, not a list", "FormatError",
         t("collections.deque", ((1,), None))),
        ("defaultdict_factory_int", "a defaultdict whose factory is the int 5", "FormatError",
         t("collections.defaultdict", (5, {}))),
        ("defaultdict_factory_reserved", "a defaultdict whose factory is "
         "'collections.UserDict': reserved, and not a factory of the table", "FormatError",
         t("collections.defaultdict", ("collections.UserDict", {}))),
        ("defaultdict_factory_empty", "a defaultdict whose factory is ''", "FormatError",
         t("collections.defaultdict", ("", {}))),
        ("defaultdict_items_list", "a defaultdict whose items are a list", "FormatError",
         t("collections.defaultdict", ("list", []))),
        ("namedtuple_int_field", "a named tuple with the field name 0", "FormatError",
         t("collections.namedtuple", ("example.Point", {0: 1}))),
        ("namedtuple_tuple_fields", "a named tuple whose fields are a tuple of values",
         "FormatError", t("collections.namedtuple", ("example.Point", (1, 2)))),
    ]


def must_fail_vectors() -> list[g.Vector]:
    base = g.write_file(tensors(), {"t": TensorRef(0)}, policy="auto")

    def with_tree(obj: Any) -> bytes:
        return g.edited(base, lambda p: (p.index.update(tree=g.tree_bytes(obj)),
                                         p.header.update(minor=MINOR)))

    return [g.fail(f"py_{vid}", description, RULES, error, with_tree({"x": value}))
            for vid, description, error, value in _cases()]


def vectors() -> list[g.Vector]:
    return valid_vectors() + must_fail_vectors()
