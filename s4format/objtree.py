"""The object tree around tensors (``spec/objects.md``): a safe, spec'd encoding, no pickle.

Encodes None, bool, int (any size), float (bit-exact, NaN payloads included), str, bytes, list,
tuple, dict, ``collections.OrderedDict``, tensor references and *typed* values — a registered name
plus a value — which the torch layer uses for ``torch.Size``, dtypes, devices, views and Python
values such as ``argparse.Namespace`` (forms: :mod:`s4format.typedvalues`). Anything else is
refused with the key path of the offending object. Decoding never constructs anything but
these types; every typed value comes back as a :class:`Typed`. Decoding is
linear in the tree's bytes: the decoder keeps no key path (an error collects its keys as it
unwinds, and :class:`KeyPath` builds the message), and a dict holds at most
``MAX_KEYS_PER_HASH`` keys of one hash.
"""

from __future__ import annotations

import struct
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from s4format.errors import FormatError, LimitError, UnsupportedObjectError

MAX_DEPTH = 256
# Keys of one dict that may share one hash (rule O13): CPython's hash of ints, floats and
# tuples is not keyed, and a dict of keys that all collide costs quadratic time to build.
MAX_KEYS_PER_HASH = 64

T_NONE, T_FALSE, T_TRUE, T_INT, T_BIGINT, T_FLOAT, T_STR, T_BYTES = range(8)
T_LIST, T_TUPLE, T_DICT, T_TENSOR, T_TYPED, T_ODICT = range(8, 14)

_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
# Tags a dict key may have (rule O7), at its root and inside a tuple key: a key of any other
# tag is refused at that tag, before its payload is decoded.
_KEY_TAGS = frozenset((T_NONE, T_FALSE, T_TRUE, T_INT, T_BIGINT, T_FLOAT, T_STR, T_BYTES,
                       T_TUPLE, T_TENSOR))
_NOT_KEYS = {T_LIST: "a list", T_DICT: "a dict", T_TYPED: "a typed value",
             T_ODICT: "an ordered dict"}


@dataclass(frozen=True)
class TensorRef:
    """A reference to entry ``index`` of the file's tensor table."""
    index: int


@dataclass(frozen=True)
class Typed:
    """A value of a registered type (spec/objects.md, "Typed values"), e.g. ``torch.Size``."""
    name: str
    value: Any


def encode(obj: Any, tensor_count: int = 1 << 32) -> bytes:
    """Encode a tree whose tensor references are all below ``tensor_count``."""
    out = bytearray()
    try:
        _encode(obj, out, 0, tensor_count)
    except _Unstored as exc:
        path = "<root>" + "".join(reversed(exc.parts))
        raise UnsupportedObjectError(f"{exc.before}{path}{exc.after}") from None
    return bytes(out)


class _Unstored(Exception):
    """An UnsupportedObjectError about the node at a path, its message ``before`` and
    ``after`` the path: the encoder keeps no path while it works (built for every node, the
    paths cost more than the encoding), the error collects its parts as it unwinds."""

    def __init__(self, before: str, after: str = "") -> None:
        super().__init__(before)
        self.before, self.after = before, after
        self.parts: list[str] = []


def _encode(obj: Any, out: bytearray, depth: int, refs: int) -> None:
    if depth > MAX_DEPTH:
        raise _Unstored(f"object tree deeper than {MAX_DEPTH} at ")
    t = type(obj)
    if obj is None:
        out.append(T_NONE)
    elif t is bool:
        out.append(T_TRUE if obj else T_FALSE)
    elif t is int:
        if _I64_MIN <= obj <= _I64_MAX:
            out.append(T_INT)
            out += _I64.pack(obj)
        else:
            raw = obj.to_bytes((obj.bit_length() + 8) // 8, "little", signed=True)
            out.append(T_BIGINT)
            out += _U32.pack(len(raw))
            out += raw
    elif t is float:
        out.append(T_FLOAT)
        out += _F64.pack(obj)
    elif t is str:
        try:
            raw = obj.encode("utf-8")
        except UnicodeEncodeError:
            raise _Unstored("string at ", " is not valid Unicode") from None
        out.append(T_STR)
        out += _U32.pack(len(raw))
        out += raw
    elif t is bytes:
        out.append(T_BYTES)
        out += _U32.pack(len(obj))
        out += obj
    elif t is list or t is tuple:
        out.append(T_LIST if t is list else T_TUPLE)
        out += _U32.pack(len(obj))
        for i, item in enumerate(obj):
            try:
                _encode(item, out, depth + 1, refs)
            except _Unstored as exc:
                exc.parts.append(f"[{i}]")
                raise
    elif t is dict or t is OrderedDict:
        out.append(T_DICT if t is dict else T_ODICT)
        out += _U32.pack(len(obj))
        # (a dict of at most MAX_KEYS_PER_HASH keys cannot hold more of one hash)
        hashes = KeyHashes() if len(obj) > MAX_KEYS_PER_HASH else None
        for key, value in obj.items():
            if not _is_key(key):
                raise _Unstored(f"dict key of type {type(key).__name__} at ", " is not stored")
            if hashes is not None and not hashes.add(key):
                raise _Unstored(
                    "dict at ", f" has more than {MAX_KEYS_PER_HASH} keys of one hash "
                    f"({_shown(key)} is one): readers refuse it (spec/objects.md, O13)")
            try:
                _encode(key, out, depth + 1, refs)
            except _Unstored as exc:
                exc.parts.append(f".<key {_shown(key)}>")
                raise
            try:
                _encode(value, out, depth + 1, refs)
            except _Unstored as exc:
                exc.parts.append(f"[{_shown(key)}]")
                raise
    elif t is TensorRef:
        if type(obj.index) is not int or not 0 <= obj.index < refs:
            raise _Unstored(f"tensor reference {obj.index!r} at ",
                            f" is out of range ({refs} tensors)")
        out.append(T_TENSOR)
        out += _U32.pack(obj.index)
    elif t is Typed:
        try:
            name = obj.name.encode("utf-8")
        except (AttributeError, UnicodeEncodeError):
            raise _Unstored(f"typed-value name {obj.name!r} at ",
                            " is not a valid Unicode str") from None
        if len(name) > 0xFFFF:
            raise _Unstored("typed-value name at ", " is over 65535 bytes")
        out.append(T_TYPED)
        out += _U16.pack(len(name))
        out += name
        if obj.name == VIEW and depth + 3 <= MAX_DEPTH and _view_into(obj.value, out, refs):
            return
        try:
            _encode(obj.value, out, depth + 1, refs)
        except _Unstored as exc:
            exc.parts.append(f"<{obj.name}>")
            raise
    else:
        raise _Unstored(
            f"cannot store object of type {t.__module__}.{t.__qualname__} at ",
            ": only None, bool, int, float, str, bytes, list, tuple, dict, OrderedDict and "
            "tensors are stored")


def _view_into(v: Any, out: bytearray, refs: int) -> bool:
    """Append a view's dict in the form writers give it (:data:`VIEW_KEYS` in order, a tensor
    reference, a str, an int, two tuples of at most ``_VIEW_DIMS`` ints, a str and two bools,
    all within the format's ranges): the bytes :func:`_encode` writes for it, in one go.
    False, having appended nothing, for any other value (_encode then writes it, or refuses
    it with its path)."""
    # (keys' types first: a str subclass is no key, and another key's __eq__ may raise)
    if type(v) is not dict or len(v) != len(VIEW_KEYS) or any(type(k) is not str for k in v) \
            or tuple(v) != VIEW_KEYS:
        return False
    ref, dtype, offset, shape, stride, device, grad, parameter = v.values()
    if type(ref) is not TensorRef or type(ref.index) is not int or not 0 <= ref.index < refs \
            or type(dtype) is not str or type(device) is not str or type(offset) is not int \
            or not _I64_MIN <= offset <= _I64_MAX or type(grad) is not bool \
            or type(parameter) is not bool:
        return False
    for dims in (shape, stride):
        if type(dims) is not tuple or len(dims) > _VIEW_DIMS or not all(
                type(x) is int and _I64_MIN <= x <= _I64_MAX for x in dims):
            return False
    try:
        dt, dev = dtype.encode("utf-8"), device.encode("utf-8")
    except UnicodeEncodeError:
        return False
    out += _VIEW_HEAD
    out += _U32.pack(ref.index)
    out += _DTYPE_KEY
    out.append(T_STR)
    out += _U32.pack(len(dt))
    out += dt
    out += _OFFSET_KEY
    out += _I64.pack(offset)
    for key, dims in ((_SHAPE_KEY, shape), (_STRIDE_KEY, stride)):
        out += key
        out.append(T_TUPLE)
        out += _U32.pack(len(dims))
        out += _INTS[len(dims)].pack(*(x for d in dims for x in (T_INT, d)))
    out += _DEVICE_KEY
    out.append(T_STR)
    out += _U32.pack(len(dev))
    out += dev
    out += _GRAD_KEY
    out.append(T_TRUE if grad else T_FALSE)
    out += _PARAMETER_KEY
    out.append(T_TRUE if parameter else T_FALSE)
    return True


def _shown(key: Any, form: Callable[[Any], str] = repr) -> str:
    """A dict key as messages show it: its repr (or ``form``), cut to 80 characters. Never
    raises: the repr of an int of more than 4300 digits does (ValueError), and such an int is
    a valid key."""
    try:
        text = form(key)
    except ValueError:
        text = f"<{type(key).__name__} too large to show>"
    return text if len(text) <= 80 else text[:77] + "..."


def key_path(path: str, key: Any) -> str:
    """``path.key`` as key paths show it (``key`` alone at the root); an int of more than 4300
    digits (a valid key, whose str() raises) is shown shortened."""
    try:
        text = str(key)
    except ValueError:
        text = _shown(key)
    return f"{path}.{text}" if path else text


class KeyHashes:
    """Counts a dict's keys by hash, to refuse more than MAX_KEYS_PER_HASH of one before the
    dict is built (each insertion then probes at most that many keys)."""

    def __init__(self) -> None:
        # a hash value below 2^61 is its own hash: this count cannot be flooded in turn
        self.counts: dict[int, int] = {}

    def add(self, key: Any) -> bool:
        """Count ``key``; False when its hash already has MAX_KEYS_PER_HASH keys."""
        h = hash(key)
        n = self.counts.get(h, 0)
        if n >= MAX_KEYS_PER_HASH:
            return False
        self.counts[h] = n + 1
        return True


class KeyPath:
    """The key path of the node a walk is at, kept as its keys: the string is built for a
    message only (a path built at every level costs depth^2 x key length), and exactly, for
    lookups, only while it is at most ``limit`` characters long (never when ``limit`` < 0)."""

    def __init__(self, base: str = "", limit: int = -1) -> None:
        self.base = base
        self.keys: list[Any] = []
        self.limit = limit
        self.exacts = [base if len(base) <= limit else None] if limit >= 0 else None

    def push(self, key: Any) -> None:
        self.keys.append(key)
        if self.exacts is not None:
            parent = self.exacts[-1]
            path = None if parent is None else key_path(parent, key)
            self.exacts.append(path if path is not None and len(path) <= self.limit else None)

    def pop(self) -> None:
        self.keys.pop()
        if self.exacts is not None:
            self.exacts.pop()

    def exact(self) -> str | None:
        """The path as :func:`key_path` builds it, or None when it is longer than the limit."""
        return None if self.exacts is None else self.exacts[-1]

    def shown(self) -> str:
        """The path for a message, each key cut to 80 characters; ``<root>`` when empty."""
        path = self.base
        for key in self.keys:
            path = key_path(path, _shown(key, str))
        return path or "<root>"


def _is_key(key: Any) -> bool:
    """Dict keys: None, bool, int, float, str, bytes, tensor references and tuples of these."""
    if key is None or type(key) in (str, int, float, bool, bytes, TensorRef):
        return True
    return type(key) is tuple and all(_is_key(k) for k in key)


_U16, _U32, _I64, _F64 = (struct.Struct(f) for f in ("<H", "<I", "<q", "<d"))
_u32_at, _i64_at = _U32.unpack_from, _I64.unpack_from

# A view of a stored tensor (spec/objects.md, "s4.view") as writers encode it: a dict of these
# keys in this order. The decoder reads that form in one go (:meth:`_Decoder._view`); any other
# form of the value is read node by node, to the same result or error.
VIEW = "s4.view"
VIEW_KEYS = ("storage", "dtype", "offset", "shape", "stride", "device", "requires_grad",
             "parameter")
_VIEW_KEY = {k: bytes((T_STR,)) + _U32.pack(len(k)) + k.encode() for k in VIEW_KEYS}
_VIEW_HEAD = bytes((T_DICT,)) + _U32.pack(len(VIEW_KEYS)) + _VIEW_KEY["storage"] \
    + bytes((T_TENSOR,))
_DTYPE_KEY, _OFFSET_KEY, _SHAPE_KEY, _STRIDE_KEY, _DEVICE_KEY, _GRAD_KEY, _PARAMETER_KEY = (
    _VIEW_KEY[k] for k in VIEW_KEYS[1:])
_OFFSET_KEY += bytes((T_INT,))
_VIEW_DIMS = 64  # views of more dimensions are read node by node
_INTS = [struct.Struct("<" + "Bq" * n) for n in range(_VIEW_DIMS + 1)]


def _below(exc: FormatError, key: Any) -> None:
    """Record on ``exc``, unwinding, that it was raised under ``key``: the decoder keeps no
    key path while it works (it is a message's only use), the error collects it."""
    keys = getattr(exc, "tree_keys", None)
    if keys is None:
        keys = exc.tree_keys = []  # type: ignore[attr-defined]
    keys.append(key)


class _Decoder:
    # The hot paths read their fixed-size fields inline (a bounds check, then unpack_from):
    # trees of views decode in tens of thousands of nodes on every load.
    def __init__(self, data: bytes, tensor_count: int,
                 check_typed: Callable[[str, Any], None] | None,
                 uses: list[int] | None) -> None:
        self.data = memoryview(data)
        self.raw = bytes(data)  # (views are read from it: bytes' startswith copies nothing)
        self.end = len(self.data)
        self.pos = 0
        self.tensor_count = tensor_count
        self.check_typed = check_typed
        self.uses = uses

    def take(self, n: int) -> memoryview:
        pos = self._need(n)
        self.pos = pos + n
        return self.data[pos:pos + n]

    def _need(self, n: int) -> int:
        """The current offset, after checking that ``n`` bytes follow it."""
        pos = self.pos
        if n > self.end - pos:
            raise FormatError(f"object tree truncated: needs {n} bytes at tree offset {pos}, "
                              f"{self.end - pos} left")
        return pos

    def _unpack(self, fmt: struct.Struct) -> Any:
        pos = self._need(fmt.size)
        self.pos = pos + fmt.size
        return fmt.unpack_from(self.data, pos)[0]

    def u32(self) -> int:
        pos = self._need(4)
        self.pos = pos + 4
        return _u32_at(self.data, pos)[0]

    def count(self, min_item: int) -> int:
        n = self.u32()
        # Every item takes at least min_item bytes: refuse counts the remaining bytes cannot hold
        # before building anything of that size.
        if n * min_item > self.end - self.pos:
            raise FormatError(f"object tree declares {n} items at tree offset {self.pos - 4}, "
                              "more than its remaining bytes can hold")
        return n

    def node(self, depth: int, key: bool = False) -> Any:
        """The node at ``pos``; ``key``: it is a dict key or inside one."""
        if depth > MAX_DEPTH:
            raise LimitError(f"object tree nested deeper than {MAX_DEPTH}")
        at = self._need(1)
        data = self.data
        tag = data[at]
        self.pos = at + 1
        if key and tag not in _KEY_TAGS:
            raise FormatError(f"{_NOT_KEYS.get(tag, f'a node of tag {tag:#04x}')} at tree "
                              f"offset {at} in a dict key: keys are None, bool, int, float, "
                              "str, bytes, tensor references and tuples of these (rule O7)")
        if tag == T_STR:
            return self._text(at)
        if tag == T_INT:
            pos = self._need(8)
            self.pos = pos + 8
            return _i64_at(data, pos)[0]
        if tag == T_NONE:
            return None
        if tag in (T_FALSE, T_TRUE):
            return tag == T_TRUE
        if tag in (T_TUPLE, T_LIST):
            items = self.items(depth, key)
            return items if tag == T_LIST else tuple(items)
        if tag in (T_DICT, T_ODICT):
            return self.pairs(depth, {} if tag == T_DICT else OrderedDict(), at)
        if tag == T_TENSOR:
            index = self.u32()
            if index >= self.tensor_count:
                raise FormatError(f"tensor reference {index} at tree offset {at} is out of "
                                  f"range ({self.tensor_count} tensors)")
            if self.uses is not None:
                self.uses[index] += 1
            return TensorRef(index)
        if tag == T_TYPED:
            return self.typed(depth, at)
        if tag == T_FLOAT:
            return self._unpack(_F64)
        if tag == T_BIGINT:
            raw = self.take(self.u32())
            value = int.from_bytes(raw, "little", signed=True)
            if _I64_MIN <= value <= _I64_MAX or len(raw) != (value.bit_length() + 8) // 8:
                raise FormatError(f"non-canonical big integer at tree offset {at}")
            return value
        if tag == T_BYTES:
            return bytes(self.take(self.u32()))
        raise FormatError(f"unknown object tag {tag} at tree offset {at}")

    def _text(self, at: int) -> str:
        """The str whose tag is at ``at``."""
        data, left = self.data, self.end - at - 5
        size = _u32_at(data, at + 1)[0] if left >= 0 else left + 1
        try:
            if 0 <= size <= left:
                self.pos = at + 5 + size
                return str(data[at + 5:at + 5 + size], "utf-8")
            self.pos = at + 1
            return str(self.take(self.u32()), "utf-8")  # (raises: too short)
        except UnicodeDecodeError:
            raise FormatError(f"string at tree offset {at} is not valid UTF-8") from None

    def items(self, depth: int, key: bool) -> list[Any]:
        items = []
        node, depth = self.node, depth + 1
        data, end, inline = self.data, self.end, depth <= MAX_DEPTH
        for i in range(self.count(1)):
            pos = self.pos
            if inline and end - pos >= 9 and data[pos] == T_INT:  # (sizes and strides)
                self.pos = pos + 9
                items.append(_i64_at(data, pos + 1)[0])
                continue
            try:
                items.append(node(depth, key))
            except FormatError as exc:
                _below(exc, i)
                raise
        return items

    def pairs(self, depth: int, result: dict, at: int) -> dict:
        n = self.count(2)
        # (a dict of at most MAX_KEYS_PER_HASH keys cannot hold more of one hash)
        hashes = KeyHashes() if n > MAX_KEYS_PER_HASH else None
        node, depth = self.node, depth + 1
        # str keys and scalar values are read here rather than by node(): the dicts of views
        # hold most of a tree's nodes
        data, end, inline = self.data, self.end, depth <= MAX_DEPTH
        for _ in range(n):
            pos = self.pos
            key = self._text(pos) if inline and pos < end and data[pos] == T_STR \
                else node(depth, True)
            if hashes is not None and not hashes.add(key):
                raise LimitError(f"dict at tree offset {at} has more than {MAX_KEYS_PER_HASH} "
                                 "keys of one hash (rule O13)")
            if key in result:
                raise FormatError(f"duplicate dict key {_shown(key)} at tree offset {at}")
            pos = self.pos
            tag = data[pos] if inline and pos < end else None
            try:
                if tag == T_INT and end - pos >= 9:
                    self.pos = pos + 9
                    result[key] = _i64_at(data, pos + 1)[0]
                elif tag in (T_TRUE, T_FALSE):
                    self.pos = pos + 1
                    result[key] = tag == T_TRUE
                elif tag == T_STR:
                    result[key] = self._text(pos)
                else:
                    result[key] = node(depth)
            except FormatError as exc:
                _below(exc, key)
                raise
        return result

    def _view(self) -> dict | None:
        """The dict of a view at ``pos`` in the form writers give it (:data:`VIEW_KEYS` in
        order; a tensor reference, a str, an int, two tuples of ints, a str and two bools),
        read in one go: what :meth:`node` reads from those bytes. None, having read nothing,
        for any other bytes (node() then reads them, and raises what is wrong)."""
        raw, pos = self.raw, self.pos
        at = raw.startswith
        try:
            if not at(_VIEW_HEAD, pos):
                return None
            pos += len(_VIEW_HEAD)
            index = _u32_at(raw, pos)[0]
            if index >= self.tensor_count:
                return None
            dtype, pos = self._str_at(pos + 4, _DTYPE_KEY)
            if dtype is None or not at(_OFFSET_KEY, pos):
                return None
            offset = _i64_at(raw, pos + len(_OFFSET_KEY))[0]
            shape, pos = self._ints_at(pos + len(_OFFSET_KEY) + 8, _SHAPE_KEY)
            if shape is None:
                return None
            stride, pos = self._ints_at(pos, _STRIDE_KEY)
            if stride is None:
                return None
            device, pos = self._str_at(pos, _DEVICE_KEY)
            if device is None or not at(_GRAD_KEY, pos):
                return None
            pos += len(_GRAD_KEY)
            grad, end = raw[pos], pos + 1 + len(_PARAMETER_KEY)
            if not at(_PARAMETER_KEY, pos + 1) or end >= self.end:
                return None
            parameter = raw[end]
            if grad not in (T_TRUE, T_FALSE) or parameter not in (T_TRUE, T_FALSE):
                return None
        except (struct.error, IndexError):
            return None
        if self.uses is not None:
            self.uses[index] += 1
        self.pos = end + 1
        return {"storage": TensorRef(index), "dtype": dtype, "offset": offset, "shape": shape,
                "stride": stride, "device": device, "requires_grad": grad == T_TRUE,
                "parameter": parameter == T_TRUE}

    def _str_at(self, pos: int, key: bytes) -> tuple[str | None, int]:
        """After ``key`` at ``pos``, a str node and the offset after it; (None, pos) if that
        is not what lies there."""
        raw = self.raw
        pos += len(key)
        if not raw.startswith(key, pos - len(key)) or pos >= self.end or raw[pos] != T_STR:
            return None, pos
        size = _u32_at(raw, pos + 1)[0]
        if size > self.end - pos - 5:
            return None, pos
        try:
            return raw[pos + 5:pos + 5 + size].decode(), pos + 5 + size
        except UnicodeDecodeError:
            return None, pos

    def _ints_at(self, pos: int, key: bytes) -> tuple[tuple[int, ...] | None, int]:
        """After ``key`` at ``pos``, a tuple node of int nodes (at most ``_VIEW_DIMS``) and the
        offset after it; (None, pos) if that is not what lies there."""
        raw = self.raw
        pos += len(key)
        if not raw.startswith(key, pos - len(key)) or pos >= self.end or raw[pos] != T_TUPLE:
            return None, pos
        dims = _u32_at(raw, pos + 1)[0]
        if dims > _VIEW_DIMS:
            return None, pos
        got = _INTS[dims].unpack_from(raw, pos + 5)
        if got[::2].count(T_INT) != dims:
            return None, pos
        return got[1::2], pos + 5 + 9 * dims

    def typed(self, depth: int, at: int) -> Typed:
        n = self._unpack(_U16)
        try:
            name = str(self.take(n), "utf-8")
        except UnicodeDecodeError:
            raise FormatError(f"typed-value name at tree offset {at} is not UTF-8") from None
        # (a view's dict, tuples and their ints lie three levels below)
        view = self._view() if name == VIEW and depth + 3 <= MAX_DEPTH else None
        value = Typed(name, self.node(depth + 1) if view is None else view)
        if self.check_typed is not None:
            try:
                self.check_typed(name, value.value)
            except FormatError as exc:
                raise type(exc)(f"{exc} (typed value at tree offset {at})") from None
        return value


def decode(data: bytes, tensor_count: int, *,
           check_typed: Callable[[str, Any], None] | None = None,
           uses: list[int] | None = None) -> Any:
    """Decode a tree; every tensor reference must be below ``tensor_count``. Errors name the
    key path and tree offset. ``check_typed(name, value)`` is called on each typed value as it
    is decoded (the reader checks the registered forms, rule O12); ``uses[i]`` is incremented
    for each reference to tensor i."""
    dec = _Decoder(data, tensor_count, check_typed, uses)
    try:
        obj = dec.node(0)
    except FormatError as exc:
        path = KeyPath()
        for key in reversed(getattr(exc, "tree_keys", ())):
            path.push(key)
        raise type(exc)(f"{path.shown()}: {exc}") from None
    if dec.pos != dec.end:
        raise FormatError(f"object tree has {dec.end - dec.pos} trailing bytes")
    return obj
