"""The registered typed values of ``spec/objects.md`` and the form each value must have (rule
O12), checked as a tree is decoded, so that a torch layer never hands torch or Python a value it
cannot take (a size of 2^70, a flag that is not a bool, February 30). Unregistered names are
opaque: not checked.

Errors are raised without a location: the reader passes :func:`check` to the decoder, which adds
the key path and tree offset.
"""

from __future__ import annotations

import calendar
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any, Protocol

from s4format import dtypes
from s4format.errors import FormatError, LimitError
from s4format.objtree import VIEW, VIEW_KEYS, TensorRef, Typed
from s4format.records import MAX_NDIM, MAX_RAW_NBYTES, extent_nbytes

MAX_INT64 = (1 << 63) - 1  # torch's sizes, strides and offsets are signed 64-bit
ATTRS = "s4.attrs"
_VIEW_KEY_SET = frozenset(VIEW_KEYS)  # (equal keys are all str: no other type equals a str)
_VIEW_OFFSET, _VIEW_SHAPE, _VIEW_STRIDE = (f"{VIEW} {k}" for k in ("offset", "shape", "stride"))
# Names under these prefixes are the registry's (format 1.2 added the Python ones): a name a user
# registers must not take one, so that every file means the same by it.
RESERVED_PREFIXES = ("torch.", "numpy.", "s4.", "argparse.", "enum.", "pathlib.", "datetime.",
                     "collections.")
# A defaultdict's default factory by name: these builtins, or a name a user registered.
DEFAULT_FACTORIES = ("int", "float", "str", "bytes", "bool", "list", "tuple", "dict",
                     "collections.OrderedDict", "collections.Counter", "collections.deque",
                     "collections.defaultdict")
PATHS = ("pathlib.PurePosixPath", "pathlib.PureWindowsPath", "pathlib.PosixPath",
         "pathlib.WindowsPath")
TIMEZONE = "datetime.timezone"
MAX_TZ_OFFSET = 86_400_000_000 - 1  # microseconds: a UTC offset is within a day, exclusive
MAX_DAYS = 999_999_999  # Python's timedelta


class StoredTensor(Protocol):
    shape: tuple[int, ...]
    raw_nbytes: int


def check(name: str, value: Any, tensors: Sequence[StoredTensor] | None) -> None:
    """Raise FormatError (LimitError for sizes over torch's limits) if ``value`` is not of the
    form registered for ``name``. ``tensors``: the file's tensor records, for the checks that
    need a referenced tensor's size (None: those are skipped)."""
    rule = _RULES.get(name)
    if rule is not None:
        rule(value, tensors)


def shown(value: Any) -> str:
    """A value in a message: its repr cut to 60 characters (ints of any size included)."""
    try:
        text = repr(value)
    except ValueError:  # an int of more than 4300 digits
        text = f"<int of {value.bit_length()} bits>"
    return text if len(text) <= 60 else text[:57] + "..."


def _int_in_range(x: Any, what: str) -> None:
    if type(x) is not int:
        raise FormatError(f"{what} must be an int, not {shown(x)}")
    if x < 0:
        raise FormatError(f"{what} must be >= 0, not {shown(x)}")
    if x > MAX_INT64:
        raise LimitError(f"{what} {shown(x)} is over 2^63 - 1, the largest torch takes")


def _sizes(value: Any, what: str) -> tuple[int, ...]:
    if type(value) is not tuple:
        raise FormatError(f"{what} must be a tuple of ints, not {shown(value)}")
    for x in value:
        if type(x) is not int or not 0 <= x <= MAX_INT64:  # (the message only when refused)
            _int_in_range(x, f"{what} entry")
    return value


def _size(value: Any, _tensors: Any) -> None:
    _sizes(value, "torch.Size")


def _str(name: str) -> Callable[[Any, Any], None]:
    def rule(value: Any, _tensors: Any) -> None:
        if type(value) is not str:
            raise FormatError(f"{name} value must be a str, not {shown(value)}")
    return rule


def _array(name: str, zero_d: bool) -> Callable[[Any, Any], None]:
    def rule(value: Any, tensors: Sequence[StoredTensor] | None) -> None:
        if type(value) is not TensorRef:
            raise FormatError(f"{name} value must be a tensor reference, not {shown(value)}")
        if zero_d and tensors is not None and tensors[value.index].shape != ():
            raise FormatError(f"{name} refers to tensor {value.index} of shape "
                              f"{list(tensors[value.index].shape)}; a scalar is 0-d")
    return rule


def _view(value: Any, tensors: Sequence[StoredTensor] | None) -> None:
    if type(value) is not dict or value.keys() != _VIEW_KEY_SET:
        keys = list(value) if type(value) is dict else shown(value)
        raise FormatError(f"{VIEW} value must be a dict of the keys {', '.join(VIEW_KEYS)}; "
                          f"it has {shown(keys)}")
    v = value
    if type(v["storage"]) is not TensorRef:
        raise FormatError(f"{VIEW} storage must be a tensor reference, not {shown(v['storage'])}")
    dt = dtypes.BY_NAME.get(v["dtype"]) if type(v["dtype"]) is str else None
    if dt is None:
        raise FormatError(f"{VIEW} dtype {shown(v['dtype'])} is not a dtype name of the format")
    if type(v["device"]) is not str:
        raise FormatError(f"{VIEW} device must be a str, not {shown(v['device'])}")
    for key in ("requires_grad", "parameter"):
        if type(v[key]) is not bool:
            raise FormatError(f"{VIEW} {key} must be a bool, not {shown(v[key])}")
    _int_in_range(v["offset"], _VIEW_OFFSET)
    shape, stride = _sizes(v["shape"], _VIEW_SHAPE), _sizes(v["stride"], _VIEW_STRIDE)
    if len(shape) != len(stride) or len(shape) > MAX_NDIM:
        raise FormatError(f"{VIEW} shape and stride must have one length, at most "
                          f"{MAX_NDIM}: {len(shape)} and {len(stride)}")
    if extent_nbytes(shape, dt.itemsize) > MAX_RAW_NBYTES:
        raise LimitError(f"{VIEW} shape {shown(list(shape))} of {dt.name}: its sizes, zeros "
                         "counted as 1, multiply to over 2^62 bytes")
    if tensors is not None:
        check_view_bounds(v["offset"], shape, stride, dt.itemsize,
                          tensors[v["storage"].index].raw_nbytes)


def check_view_bounds(offset: int, shape: tuple[int, ...], stride: tuple[int, ...],
                      itemsize: int, nbytes: int) -> None:
    """FormatError if a view of ``itemsize``-byte elements reaches past ``nbytes``."""
    if offset * itemsize > nbytes:
        raise FormatError(f"{VIEW} offset {offset} is beyond its storage of {nbytes} bytes")
    if 0 in shape:
        return
    last = offset + sum((n - 1) * s for n, s in zip(shape, stride))
    if (last + 1) * itemsize > nbytes:
        raise FormatError(f"{VIEW} reaches element {shown(last)}, beyond its storage of "
                          f"{nbytes} bytes")


def _attrs(value: Any, _tensors: Any) -> None:
    if type(value) is not tuple or len(value) != 2:
        raise FormatError(f"{ATTRS} value must be a pair (object, attributes), not "
                          f"{shown(value)}")
    obj, attrs = value
    if not (type(obj) in (dict, OrderedDict, TensorRef)
            or (type(obj) is Typed and obj.name == VIEW)):
        raise FormatError(f"{ATTRS} holds {shown(obj)}; only a dict, an ordered dict, a "
                          f"tensor reference or an {VIEW} takes attributes")
    if type(attrs) not in (dict, OrderedDict):
        raise FormatError(f"{ATTRS} attributes must be a dict, not {shown(attrs)}")
    for k in attrs:
        if type(k) is not str:
            raise FormatError(f"{ATTRS} attribute names must be str, not {shown(k)}")


def _pair(value: Any, name: str, n: int) -> tuple:
    if type(value) is not tuple or len(value) != n:
        raise FormatError(f"{name} value must be a tuple of {n}, not {shown(value)}")
    return value


def _user_name(x: Any, what: str) -> None:
    if type(x) is not str or not x:
        raise FormatError(f"{what} must be a non-empty str, not {shown(x)}")
    if x.startswith(RESERVED_PREFIXES) or x in DEFAULT_FACTORIES:
        raise FormatError(f"{what} {shown(x)} is a name the registry reserves; names users "
                          "register have no reserved prefix and name no builtin factory")


def _dict(value: Any, what: str, keys: str | None = None) -> None:
    """A dict (tag 0A); with ``keys`` (what they are called), of str keys."""
    if type(value) is not dict:
        raise FormatError(f"{what} must be a dict, not {shown(value)}")
    for k in value if keys else ():
        if type(k) is not str:
            raise FormatError(f"{keys} must be str, not {shown(k)}")


def _between(x: Any, lo: int, hi: int, what: str) -> None:
    if type(x) is not int or not lo <= x <= hi:
        raise FormatError(f"{what} must be an int in [{lo}, {hi}], not {shown(x)}")


def _namespace(value: Any, _tensors: Any) -> None:
    _dict(value, "argparse.Namespace value", "argparse.Namespace attribute names")


def _enum(value: Any, _tensors: Any) -> None:
    cls, member = _pair(value, "enum.Enum", 2)
    _user_name(cls, "enum.Enum class name")
    if type(member) is not str:
        raise FormatError(f"enum.Enum member name must be a str, not {shown(member)}")


def _ymd(y: Any, m: Any, d: Any, name: str) -> None:
    _between(y, 1, 9999, f"{name} year")
    _between(m, 1, 12, f"{name} month")
    _between(d, 1, calendar.monthrange(y, m)[1], f"{name} day of {y:04}-{m:02}")


def _clock(h: Any, mi: Any, s: Any, us: Any, fold: Any, tz: Any, name: str) -> None:
    for x, hi, what in ((h, 23, "hour"), (mi, 59, "minute"), (s, 59, "second"),
                        (us, 999_999, "microsecond"), (fold, 1, "fold")):
        _between(x, 0, hi, f"{name} {what}")
    if tz is not None and not (type(tz) is Typed and tz.name == TIMEZONE):
        raise FormatError(f"{name} tzinfo must be None or a {TIMEZONE}, not {shown(tz)}")


def _date(value: Any, _tensors: Any) -> None:
    _ymd(*_pair(value, "datetime.date", 3), "datetime.date")


def _time(value: Any, _tensors: Any) -> None:
    _clock(*_pair(value, "datetime.time", 6), "datetime.time")


def _datetime(value: Any, _tensors: Any) -> None:
    y, m, d, *clock = _pair(value, "datetime.datetime", 9)
    _ymd(y, m, d, "datetime.datetime")
    _clock(*clock, "datetime.datetime")


def _timedelta(value: Any, _tensors: Any) -> None:
    days, seconds, us = _pair(value, "datetime.timedelta", 3)
    _between(days, -MAX_DAYS, MAX_DAYS, "datetime.timedelta days")
    _between(seconds, 0, 86_399, "datetime.timedelta seconds")
    _between(us, 0, 999_999, "datetime.timedelta microseconds")


def _timezone(value: Any, _tensors: Any) -> None:
    offset, name = _pair(value, TIMEZONE, 2)
    _between(offset, -MAX_TZ_OFFSET, MAX_TZ_OFFSET, f"{TIMEZONE} offset in microseconds")
    if name is not None and type(name) is not str:
        raise FormatError(f"{TIMEZONE} name must be None or a str, not {shown(name)}")


def _counter(value: Any, _tensors: Any) -> None:
    _dict(value, "collections.Counter value")


def _deque(value: Any, _tensors: Any) -> None:
    items, maxlen = _pair(value, "collections.deque", 2)
    if type(items) is not list:
        raise FormatError(f"collections.deque items must be a list, not {shown(items)}")
    if maxlen is not None:
        if type(maxlen) is int and maxlen > MAX_INT64:
            raise LimitError(f"collections.deque maxlen {shown(maxlen)} is over 2^63 - 1, the "
                             "largest Python takes")
        _between(maxlen, 0, MAX_INT64, "collections.deque maxlen")
        if len(items) > maxlen:
            raise FormatError(f"collections.deque holds {len(items)} items, over its maxlen "
                              f"{maxlen}")


def _defaultdict(value: Any, _tensors: Any) -> None:
    factory, items = _pair(value, "collections.defaultdict", 2)
    if factory is not None and factory not in DEFAULT_FACTORIES:
        _user_name(factory, "collections.defaultdict default factory")
    _dict(items, "collections.defaultdict items")


def _namedtuple(value: Any, _tensors: Any) -> None:
    cls, fields = _pair(value, "collections.namedtuple", 2)
    _user_name(cls, "collections.namedtuple class name")
    _dict(fields, "collections.namedtuple fields", "collections.namedtuple field names")


_RULES: dict[str, Callable[[Any, Sequence[StoredTensor] | None], None]] = {
    "torch.Size": _size,
    "torch.dtype": _str("torch.dtype"),
    "torch.device": _str("torch.device"),
    "numpy.ndarray": _array("numpy.ndarray", zero_d=False),
    "numpy.scalar": _array("numpy.scalar", zero_d=True),
    VIEW: _view,
    ATTRS: _attrs,
    "argparse.Namespace": _namespace,
    "enum.Enum": _enum,
    **{name: _str(name) for name in PATHS},
    "datetime.date": _date,
    "datetime.time": _time,
    "datetime.datetime": _datetime,
    "datetime.timedelta": _timedelta,
    TIMEZONE: _timezone,
    "collections.Counter": _counter,
    "collections.deque": _deque,
    "collections.defaultdict": _defaultdict,
    "collections.namedtuple": _namedtuple,
}
