"""Python standard-library values <-> the registry's typed values (``spec/objects.md``,
"Python values"): ``argparse.Namespace``, members of registered enums, ``pathlib`` paths,
``datetime`` values and ``collections`` containers, which training checkpoints hold next to
their tensors.

Saving gives :class:`Stored`: the typed name, the user values inside (walked by the caller like
any other values) and the typed value's form around them. Loading rebuilds only classes this
module names and classes the user registered, looked up by name in the caller's registry; it
never imports or calls anything a file names. A name not registered here raises
:class:`NotHere`, which the caller turns into an error or an opaque stand-in.
"""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import functools
import operator
import pathlib
from collections import Counter, OrderedDict, defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from s4format.errors import FormatError, UnsupportedObjectError
from s4format.objtree import Typed
from s4format.typedvalues import TIMEZONE

NAMESPACE, ENUM, COUNTER, DEQUE, DEFAULTDICT, NAMEDTUPLE = (
    "argparse.Namespace", "enum.Enum", "collections.Counter", "collections.deque",
    "collections.defaultdict", "collections.namedtuple")
DATE, TIME, DATETIME, TIMEDELTA = ("datetime.date", "datetime.time", "datetime.datetime",
                                   "datetime.timedelta")
PATHS: dict[str, type] = {f"pathlib.{c.__name__}": c for c in (
    pathlib.PurePosixPath, pathlib.PureWindowsPath, pathlib.PosixPath, pathlib.WindowsPath)}
_PURE = {pathlib.PosixPath: pathlib.PurePosixPath, pathlib.WindowsPath: pathlib.PureWindowsPath}
FACTORIES: dict[str, type] = {
    "int": int, "float": float, "str": str, "bytes": bytes, "bool": bool, "list": list,
    "tuple": tuple, "dict": dict, "collections.OrderedDict": OrderedDict,
    "collections.Counter": Counter, "collections.deque": deque,
    "collections.defaultdict": defaultdict}
_FACTORY_NAMES = {cls: name for name, cls in FACTORIES.items()}
NAMES = frozenset((NAMESPACE, ENUM, COUNTER, DEQUE, DEFAULTDICT, NAMEDTUPLE, DATE, TIME,
                   DATETIME, TIMEDELTA, TIMEZONE, *PATHS))
_CONTAINERS = (argparse.Namespace, Counter, defaultdict, deque)

ClassLookup = Callable[[str], type | None]  # a registered name -> its class
NameLookup = Callable[[type], str | None]  # a class -> the name it is registered under


class NotHere(Exception):
    """The value names a class that is not registered here, or no longer fits the registered
    one: the caller refuses it or keeps it opaque."""


@dataclass(frozen=True)
class Stored:
    """A value as a typed value: ``form(walked)`` is its value given its ``items`` (key-path
    key, value) as the caller stored them. Items sit ``level`` levels below the typed value;
    the form's own nodes go ``height`` levels down. ``keys``: the dict whose keys it stores."""
    name: str
    form: Callable[[list[Any]], Any]
    items: list[tuple[Any, Any]]
    level: int = 0
    height: int = 1
    keys: dict | None = None


def is_class_by_name(cls: type) -> bool:
    """Enum and named-tuple classes are stored by name, without a converter of the user's."""
    return isinstance(cls, type) and (issubclass(cls, enum.Enum) or (
        issubclass(cls, tuple) and hasattr(cls, "_fields") and hasattr(cls, "_make")))


def handles(cls: type) -> bool:
    """Whether :func:`stored` may store instances of ``cls`` (cheap: called for every leaf)."""
    return cls in _FIXED or cls in _CONTAINERS or is_class_by_name(cls)


def stored(obj: Any, path: str, name_of: NameLookup) -> Stored | None:
    """How ``obj`` is stored, or None if it is none of these values (nor of a class registered
    to be stored by name). Raises UnsupportedObjectError naming ``path`` for what such a value
    cannot hold (a tzinfo other than a fixed offset, attributes on a container)."""
    t = type(obj)
    fixed = _FIXED.get(t)
    if fixed is not None:
        value = fixed[1](obj, path)
        return Stored(fixed[0], lambda _: value, [], height=_height(value))
    if t in _CONTAINERS:
        return _container(obj, path, name_of)
    name = name_of(t) if is_class_by_name(t) else None
    if name is None:
        return None
    if isinstance(obj, enum.Enum):
        return Stored(ENUM, lambda _: (name, _member_name(obj, path)), [], height=2)
    _no_attributes(obj, path)
    fields = t._fields
    return Stored(NAMEDTUPLE, lambda walked: (name, dict(zip(fields, walked))),
                  list(enumerate(obj)), level=3, height=2)


def _container(obj: Any, path: str, name_of: NameLookup) -> Stored:
    t = type(obj)
    if t is deque:
        return Stored(DEQUE, lambda w: (w, obj.maxlen), list(enumerate(obj)), level=3, height=2)
    if t is argparse.Namespace:
        keyed = vars(obj)
        bad = next((k for k in keyed if not plain_name(k)), None)
        if bad is not None:
            raise UnsupportedObjectError(
                f"argparse.Namespace at {path or '<root>'} has the attribute {bad!r}, which "
                "is not a plain attribute name: readers refuse it")
    else:
        _no_attributes(obj, path)
        keyed = obj
    keys = list(keyed)
    if t is defaultdict:
        factory = _factory_name(obj.default_factory, path, name_of)
        return Stored(DEFAULTDICT, lambda w: (factory, dict(zip(keys, w))), list(keyed.items()),
                      level=3, height=2, keys=keyed)
    return Stored(NAMESPACE if t is argparse.Namespace else COUNTER,
                  lambda w: dict(zip(keys, w)), list(keyed.items()), level=2, keys=keyed)


def _no_attributes(obj: Any, path: str) -> None:
    if getattr(obj, "__dict__", None):
        raise UnsupportedObjectError(
            f"{type(obj).__name__} at {path or '<root>'} has attributes set on it "
            f"({', '.join(map(repr, vars(obj)))}), which s4weights does not store")


def _factory_name(factory: Any, path: str, name_of: NameLookup) -> str | None:
    if factory is None:
        return None
    name = None
    if isinstance(factory, type):
        name = _FACTORY_NAMES.get(factory) or name_of(factory)
    if name is None:
        raise UnsupportedObjectError(
            f"defaultdict at {path or '<root>'} has the default factory {factory!r}, which a "
            "file can only name: use None, a builtin type (int, list, dict, ...) or a class "
            "registered with s4weights.register_type, or save it as a dict")
    return name


def _member_name(member: enum.Enum, path: str) -> str:
    cls = type(member)
    if cls.__members__.get(member.name) is member:
        return member.name
    if isinstance(member, enum.Flag):  # a combination of flags, or none: named by its parts
        parts = [m for m in cls if m in member]
        if functools.reduce(operator.or_, parts, cls(0)) == member:
            return "|".join(m.name for m in parts)
    raise UnsupportedObjectError(f"{cls.__name__} member {member!r} at {path or '<root>'} has "
                                 "no name to store it by")


def _height(value: Any) -> int:
    """Levels of nodes below a typed value whose value is ``value``."""
    if type(value) is tuple:
        return 1 + max(map(_height, value), default=0)
    if type(value) is Typed:
        return 1 + _height(value.value)
    return 1


def _path(obj: pathlib.PurePath, _where: str) -> str:
    return str(obj)


def plain_name(name: Any) -> bool:
    """Whether a Namespace attribute may be set on loading: a str, no dunder, nothing the class
    has (a file must not replace ``__dict__`` or ``_get_kwargs``)."""
    return isinstance(name, str) and not name.startswith("__") \
        and not hasattr(argparse.Namespace, name)


def _timezone(obj: dt.timezone, _where: str) -> Typed:
    args = obj.__getinitargs__()  # (offset,) or (offset, name): the name given, if any
    return Typed(TIMEZONE, (_microseconds(args[0]), args[1] if len(args) > 1 else None))


def _microseconds(d: dt.timedelta) -> int:
    return (d.days * 86_400 + d.seconds) * 1_000_000 + d.microseconds


def _tz(value: dt.time | dt.datetime, path: str) -> Typed | None:
    tz = value.tzinfo
    if tz is None:
        return None
    if type(tz) is not dt.timezone:
        raise UnsupportedObjectError(
            f"{type(value).__name__} at {path or '<root>'} has the tzinfo {tz!r}; s4weights "
            "stores fixed offsets (datetime.timezone) only: convert it with "
            ".astimezone(datetime.timezone.utc), or register a converter")
    return _timezone(tz, path)


def _clock(v: dt.time | dt.datetime, path: str) -> tuple:
    return (v.hour, v.minute, v.second, v.microsecond, v.fold, _tz(v, path))


_FIXED: dict[type, tuple[str, Callable[[Any, str], Any]]] = {
    **{cls: (name, _path) for name, cls in PATHS.items()},
    dt.date: (DATE, lambda v, _p: (v.year, v.month, v.day)),
    dt.time: (TIME, _clock),
    dt.datetime: (DATETIME, lambda v, p: (v.year, v.month, v.day, *_clock(v, p))),
    dt.timedelta: (TIMEDELTA, lambda v, _p: (v.days, v.seconds, v.microseconds)),
    dt.timezone: (TIMEZONE, lambda v, p: _timezone(v, p).value),
}


# -- loading ----------------------------------------------------------------------------------

def children(node: Typed) -> list[tuple[Any, Any]]:
    """(key-path key, node) of the user values inside a typed value of :data:`NAMES`, as
    :func:`stored` keyed them; its form was checked when the file was opened (rule O12)."""
    name, v = node.name, node.value
    if name in (NAMESPACE, COUNTER):
        return list(v.items())
    if name == DEFAULTDICT:
        return list(v[1].items())
    if name == DEQUE:
        return list(enumerate(v[0]))
    if name == NAMEDTUPLE:
        return list(enumerate(v[1].values()))
    return []


def opaque(node: Typed, items: list[Any]) -> Typed:
    """The stand-in for a value not rebuilt here: its typed value, the user values in it as
    loaded."""
    name, v = node.name, node.value
    if name in (NAMESPACE, COUNTER):
        return Typed(name, dict(zip(v, items)))
    if name in (DEFAULTDICT, NAMEDTUPLE):
        return Typed(name, (v[0], dict(zip(v[1], items))))
    if name == DEQUE:
        return Typed(name, (items, v[1]))
    return node


def rebuild(node: Typed, items: list[Any], class_of: ClassLookup) -> Any:
    """The Python value of a typed value of :data:`NAMES` whose user values loaded as
    ``items``. Raises :class:`NotHere` for a class not registered here, FormatError for a
    Namespace attribute that is not a plain name."""
    name, v = node.name, node.value
    if name in PATHS:
        try:
            return PATHS[name](v)
        except NotImplementedError:  # a Windows path on Linux, or the reverse
            return _PURE[PATHS[name]](v)
    if name in _LOADERS:
        return _LOADERS[name](v)
    if name == NAMESPACE:
        bad = next((k for k in v if not plain_name(k)), None)
        if bad is not None:
            raise FormatError(f"argparse.Namespace attribute {bad!r} is not a plain attribute "
                              "name")
        return argparse.Namespace(**dict(zip(v, items)))
    if name == COUNTER:
        out: Counter = Counter()
        dict.update(out, zip(v, items))  # as stored: Counter.update would add
        return out
    if name == DEQUE:
        return deque(items, v[1])
    if name == DEFAULTDICT:
        return defaultdict(_factory(v[0], class_of), zip(v[1], items))
    if name == ENUM:
        return _member(*v, class_of)
    return _namedtuple(*v, items, class_of)


def _timezone_of(v: Any) -> dt.timezone | None:
    if v is None:
        return None
    offset, name = v.value
    d = dt.timedelta(microseconds=offset)
    return dt.timezone(d) if name is None else dt.timezone(d, name)


_LOADERS: dict[str, Callable[[Any], Any]] = {
    DATE: lambda v: dt.date(*v),
    TIME: lambda v: dt.time(*v[:4], tzinfo=_timezone_of(v[5]), fold=v[4]),
    DATETIME: lambda v: dt.datetime(*v[:7], tzinfo=_timezone_of(v[8]), fold=v[7]),
    TIMEDELTA: lambda v: dt.timedelta(days=v[0], seconds=v[1], microseconds=v[2]),
    TIMEZONE: lambda v: _timezone_of(Typed(TIMEZONE, v)),
}


def _factory(name: str | None, class_of: ClassLookup) -> type | None:
    if name is None or name in FACTORIES:
        return None if name is None else FACTORIES[name]
    cls = class_of(name)
    if cls is None:
        raise NotHere(f"the default factory {name!r} of a defaultdict is not registered here")
    return cls


def _member(cls_name: str, member: str, class_of: ClassLookup) -> enum.Enum:
    cls = class_of(cls_name)
    if not (isinstance(cls, type) and issubclass(cls, enum.Enum)):
        raise NotHere(f"enum class {cls_name!r} is not registered here")
    found = cls.__members__.get(member)
    if found is not None:
        return found
    parts = member.split("|") if member else []
    if issubclass(cls, enum.Flag) and all(p in cls.__members__ for p in parts):
        return functools.reduce(operator.or_, (cls[p] for p in parts), cls(0))
    raise NotHere(f"enum class {cls_name!r} registered here has no member {member!r}")


def _namedtuple(cls_name: str, fields: dict, items: list[Any], class_of: ClassLookup) -> tuple:
    cls = class_of(cls_name)
    if not is_class_by_name(cls) or issubclass(cls, enum.Enum):
        raise NotHere(f"named tuple class {cls_name!r} is not registered here")
    if tuple(fields) != cls._fields:
        raise NotHere(f"named tuple class {cls_name!r} registered here has the fields "
                      f"{cls._fields}; the file stores {tuple(fields)}")
    return cls._make(items)
