"""Torch objects <-> the s4format object tree (``spec/objects.md``, "Typed values").

Saving walks the caller's object and replaces each tensor by a stored tensor: a plain CPU tensor
that owns its whole storage becomes a bare tensor reference; anything else (views, tensors
sharing storage, non-contiguous or CUDA tensors, Parameters) becomes an ``s4.view`` of its
storage, so storage shared on save is shared again on load. Known torch and numpy values, and
the standard-library values of :mod:`s4weights.pytypes`, map to registered typed names.
Everything else is refused with its key path, unless the caller registered its type with
:func:`register_type` — loading only ever runs such registered converters and rebuilds only
registered classes, never code named by the file.
"""

from __future__ import annotations

import argparse
import math
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from s4format import dtypes, objtree, typedvalues
from s4format.errors import (
    FormatError,
    S4Error,
    UnsupportedDeviceError,
    UnsupportedObjectError,
)
from s4format.objtree import TensorRef, Typed
from s4format.tensor import Tensor
from s4format.typedvalues import ATTRS, VIEW
from s4weights import pytypes


@dataclass(frozen=True)
class _Converter:
    """A registered class: with ``encode``/``decode``, stored under the typed name ``name``;
    without (an enum or named tuple class), stored in the registry's form naming ``name``."""
    name: str
    cls: type
    encode: Callable[[Any], Any] | None
    decode: Callable[[Any], Any] | None


_CONVERTERS: dict[str, _Converter] = {}
_RESERVED = {p.rstrip(".") for p in typedvalues.RESERVED_PREFIXES}


def register_type(name: str, cls: type, encode: Callable[[Any], Any] | None = None,
                  decode: Callable[[Any], Any] | None = None) -> None:
    """Opt in to storing instances of ``cls``: ``encode(obj)`` returns a storable value (which
    may hold tensors), ``decode(value)`` rebuilds the object on load; stored under the typed
    name ``name``. An enum or named tuple class needs neither: its members or instances are
    stored by ``name`` and field or member names, and rebuilt where ``name`` is registered.
    ``name`` must not start with a prefix the format reserves (``torch.``, ``numpy.``, ``s4.``,
    ``argparse.``, ``enum.``, ``pathlib.``, ``datetime.``, ``collections.``)."""
    if not isinstance(name, str) or not name or name.split(".")[0] in _RESERVED \
            or name in pytypes.FACTORIES:
        raise ValueError(f"typed name {name!r} is reserved (or empty)")
    if (encode is None) != (decode is None):
        raise TypeError("register_type takes both encode and decode, or neither")
    if encode is None and not pytypes.is_class_by_name(cls):
        raise TypeError(f"{getattr(cls, '__qualname__', cls)!r} is neither an enum nor a named "
                        "tuple class: register it with encode and decode")
    _CONVERTERS[name] = _Converter(name, cls, encode, decode)


def _converter_of(cls: type) -> _Converter | None:
    return next((c for c in _CONVERTERS.values() if c.cls is cls), None)


def _name_of(cls: type) -> str | None:
    conv = _converter_of(cls)
    return None if conv is None else conv.name


def _class_of(name: str) -> type | None:
    conv = _CONVERTERS.get(name)
    return None if conv is None else conv.cls


def torch_dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def raw_bytes(t: torch.Tensor) -> np.ndarray:
    """The tensor's elements in C order as a uint8 numpy array (copied off the GPU if needed)."""
    flat = t.detach().reshape(-1)
    if flat.device.type != "cpu":
        flat = flat.cpu()
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.numel() == 0:
        return np.zeros(0, dtype=np.uint8)
    return flat.view(torch.uint8).numpy()


def _storage_bytes(t: torch.Tensor) -> np.ndarray:
    storage = t.untyped_storage()
    if storage.device.type != "cpu":
        storage = storage.cpu()
    return torch.empty(0, dtype=torch.uint8).set_(storage).numpy()


@dataclass(frozen=True, eq=False)
class DeviceTensor:
    """A stored tensor whose bytes still live on a CUDA device (the storage of CUDA tensors),
    so the GPU coder can code it in place; ``to_host()`` is the :class:`Tensor` for the CPU
    coder. Typed by the tensor viewing it when the storage holds whole elements."""
    dtype: dtypes.DType
    shape: tuple[int, ...]
    device_bytes: torch.Tensor  # flat uint8 view of the whole storage

    @property
    def nbytes(self) -> int:
        return int(self.device_bytes.numel())

    @property
    def data(self) -> np.ndarray:
        return self.device_bytes.cpu().numpy()

    def to_host(self) -> Tensor:
        return Tensor(self.dtype, self.shape, self.data)


def _device_storage(t: torch.Tensor, dt: dtypes.DType) -> DeviceTensor:
    storage = t.untyped_storage()
    flat = torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage)
    typed = storage_dtype(storage.nbytes(), dt)
    return DeviceTensor(typed, (storage.nbytes() // typed.itemsize,), flat)


def storage_dtype(nbytes: int, dt: dtypes.DType) -> dtypes.DType:
    """A storage is stored typed by the first tensor viewing it when it holds whole elements,
    so its bytes get that dtype's plane layout; readers use only its bytes."""
    return dt if nbytes % dt.itemsize == 0 else dtypes.BY_NAME["uint8"]


@dataclass
class Flattened:
    """What :func:`flatten` produced: the tree and the tensors to store, in order."""
    tree: Any
    tensors: list[tuple[str, Tensor | DeviceTensor]]


class _Flattener:
    def __init__(self) -> None:
        self.tensors: list[tuple[str, Tensor | DeviceTensor]] = []
        self.names: set[str] = set()
        self.encoded: dict[int, tuple[Any, Any]] = {}
        self.storages: dict[tuple[str, int], TensorRef] = {}
        self.owners: dict[tuple[str, int], int] = {}
        # count_owners' walk: nodes under each object met, the objects on the way down (with
        # their paths), the key path's keys, and the nodes written again for repeats
        self.sizes: dict[int, int] = {}
        self.active: dict[int, int] = {}  # object on the way down -> its path's length
        self.stack: list[Any] = []
        self.repeated = 0  # nodes met again, inside objects met before
        self.distinct = 0  # nodes met once
        self.inside_repeat = 0

    def count_owners(self, obj: Any, depth: int = 0) -> int:
        """First pass: how many tensors point at each storage, so that only an unshared storage
        is stored as a plain tensor. Returns the number of nodes ``obj`` becomes in the file.

        The file stores a tree, so an object met at several places (a shared dict, a tensor
        held twice) is written at each: this pass walks every such place too, and refuses,
        before anything else is done, an object that contains itself, or one whose repeats
        write more than ``MAX_REPEATED`` nodes and more than ``REPEAT_FACTOR`` times the
        nodes it holds once (sixteen levels of dicts that each hold the next twice write 2^16
        copies; a long list held at two places is written twice, as it is). Too deep trees are
        refused by walk()."""
        if not self.inside_repeat:
            self.distinct += 1
        if depth > objtree.MAX_DEPTH:
            return 1
        kids = self.children(obj)
        if kids is None:
            return 1
        i = id(obj)
        if i in self.active:
            raise UnsupportedObjectError(
                f"the object contains itself: {type(obj).__name__} at "
                f"{self.path() or '<root>'} is the one at "
                f"{self.path(self.active[i]) or '<root>'}; s4weights stores a tree")
        known = self.sizes.get(i)
        if known is not None:
            self.repeated += known
            if self.repeated > max(MAX_REPEATED, REPEAT_FACTOR * self.distinct):
                raise UnsupportedObjectError(
                    f"the object holds the same containers at too many places (the "
                    f"{type(obj).__name__} at {self.path() or '<root>'} is one): s4weights "
                    f"stores a tree, so it would write a copy of each, {self.repeated} nodes "
                    f"again for {self.distinct}")
            self.inside_repeat += 1
        self.active[i] = len(self.stack)
        n = 1
        try:
            for key, x in kids:
                self.stack.append(key)
                n += self.count_owners(x, depth + 1)
                self.stack.pop()
        finally:
            if known is not None:
                self.inside_repeat -= 1
        del self.active[i]
        self.sizes[i] = n
        return n

    def children(self, obj: Any) -> list[tuple[Any, Any]] | None:
        """(key, value) of what walk() stores inside ``obj`` (the same tests, in the same
        order); None for a leaf. Counts a tensor's storage on the way."""
        if _stored_as_tensor(obj):
            key = _storage_key_or_none(obj)
            if key is not None:  # else refused by tensor(), with its path
                self.owners[key] = self.owners.get(key, 0) + 1
            attrs = _attrs_of(obj)
            return list(attrs.items()) if attrs else None
        t = type(obj)
        if t is list or t is tuple:
            return list(enumerate(obj))
        if t is dict or t is OrderedDict:
            return [*obj.items(), *(getattr(obj, "__dict__", None) or {}).items()]
        conv = _converter_of(t)
        if conv is not None and conv.encode is not None:
            return [(None, self.encode(obj, conv))]
        if not pytypes.handles(t):
            return None
        enc = pytypes.stored(obj, self.path(), _name_of)
        return enc.items if enc is not None and enc.items else None

    def path(self, length: int | None = None) -> str:
        out = ""
        for key in self.stack[:length]:
            if key is not None:
                out = _join(out, key)
        return out

    def encode(self, obj: Any, conv: _Converter) -> Any:
        # Once per object: count_owners must see the tensors a converter returns, and walk must
        # store those same tensors. The object is kept so its id stays unique.
        if id(obj) not in self.encoded:
            self.encoded[id(obj)] = (obj, conv.encode(obj))
        return self.encoded[id(obj)][1]

    def add(self, path: str, tensor: Tensor | DeviceTensor) -> TensorRef:
        # Key paths can collide ("a.b" as one key and as a nested path, 1 and "1") while
        # tensor names must be unique: a later tensor on a taken path gets a "#n" suffix.
        name, n = path or "<root>", 1
        while name in self.names:
            n += 1
            name = f"{path or '<root>'}#{n}"
        self.names.add(name)
        self.tensors.append((name, tensor))
        return TensorRef(len(self.tensors) - 1)

    def tensor(self, t: torch.Tensor, path: str) -> Any:
        where = path or "<root>"
        name = torch_dtype_name(t.dtype)
        if t.is_nested:
            raise UnsupportedObjectError(f"tensor at {where} is a nested tensor, which "
                                         "s4weights does not store: save its components")
        if name not in dtypes.BY_NAME or t.layout != torch.strided or t.is_quantized:
            raise UnsupportedObjectError(f"tensor at {where} has unsupported "
                                         f"dtype/layout {t.dtype}/{t.layout}")
        if type(t) not in (torch.Tensor, torch.nn.Parameter):
            # a subclass carries state a plain tensor cannot (DTensor, quantized parameters,
            # masked tensors): stored as a plain tensor it would load as something else
            raise UnsupportedObjectError(
                f"tensor at {where} is a {type(t).__module__}.{type(t).__qualname__}, a "
                "subclass of torch.Tensor; register a converter with s4weights.register_type "
                "or save a plain tensor")
        if t.device.type == "meta":
            raise UnsupportedObjectError(f"tensor at {where} is on the meta device: it has no "
                                         "data to save")
        if t.is_conj() or t.is_neg():
            # a lazily conjugated/negated view: its storage does not hold its values, so it is
            # stored resolved (as a tensor of its own; sharing with the original is not kept)
            t = t.resolve_conj().resolve_neg()
        if t.numel() == 0 and t.storage_offset():
            t = t.as_strided(t.shape, t.stride(), 0)  # no elements: the offset means nothing
        dt = dtypes.BY_NAME[name]
        key = _storage_key_or_none(t)
        if key is None:
            raise UnsupportedObjectError(f"tensor at {where} has no storage s4weights can read "
                                         "(a wrapper or lazy tensor)")
        storage_nbytes = t.untyped_storage().nbytes()
        plain = (t.device.type == "cpu" and type(t) is torch.Tensor and not t.requires_grad
                 and self.owners.get(key, 1) == 1 and t.storage_offset() == 0
                 and t.is_contiguous() and t.numel() * dt.itemsize == storage_nbytes)
        if plain:
            return self.add(path, Tensor(dt, tuple(t.shape), raw_bytes(t)))
        ref = self.storages.get(key)
        if ref is None:
            if t.device.type == "cuda":
                ref = self.add(path, _device_storage(t, dt))
            else:
                data = _storage_bytes(t)
                typed = storage_dtype(data.size, dt)
                ref = self.add(path, Tensor(typed, (data.size // typed.itemsize,), data))
            self.storages[key] = ref
        return Typed(VIEW, {
            "storage": ref, "dtype": name, "offset": t.storage_offset(),
            "shape": tuple(t.shape), "stride": tuple(t.stride()), "device": str(t.device),
            "requires_grad": bool(t.requires_grad),
            "parameter": isinstance(t, torch.nn.Parameter)})

    @staticmethod
    def check_depth(depth: int, path: str) -> None:
        if depth > objtree.MAX_DEPTH:
            raise UnsupportedObjectError(f"the object nests more than {objtree.MAX_DEPTH} levels "
                                         f"deep at {path or '<root>'} (counting the levels a "
                                         "view or attributes add in the file)")

    def with_attrs(self, obj: Any, value: Any, attrs: dict, path: str, depth: int) -> Typed:
        """``value`` (what ``obj`` stores as) with ``obj``'s Python attributes, as torch.save
        keeps them: ``s4.attrs`` at ``depth``, its pair one level down, the attributes' values
        three."""
        for k in attrs:
            if not _plain_attribute(type(obj), k):
                raise UnsupportedObjectError(
                    f"{type(obj).__name__} at {path or '<root>'} has the attribute "
                    f"{objtree._shown(k)}, which is not a plain attribute name (or is one its "
                    "class defines)")
        d = depth + _WRAP + 1
        return Typed(ATTRS, (value, {k: self.walk(v, _join(path, k), d)
                                     for k, v in attrs.items()}))

    def walk(self, obj: Any, path: str, depth: int = 0) -> Any:
        self.check_depth(depth, path)
        t = type(obj)
        if _stored_as_tensor(obj):
            attrs = _attrs_of(obj)
            inner = depth + (_WRAP if attrs else 0)
            out = self.tensor(obj, path)
            if type(out) is Typed:  # an s4.view: its dict's values 2 levels down, and the
                # items of its shape and stride tuples 3 (none for a 0-d tensor)
                self.check_depth(inner + (3 if obj.dim() else 2), path)
            return self.with_attrs(obj, out, attrs, path, depth) if attrs else out
        if obj is None or t in (bool, int, float, str, bytes):
            return obj
        if t in (torch.Size, torch.dtype, torch.device, np.ndarray) \
                or isinstance(obj, np.generic):
            # a typed value's value sits one level down, a Size's ints two
            self.check_depth(depth + (2 if t is torch.Size and len(obj) else 1), path)
        if t is torch.Size:
            if any(n < 0 for n in obj):  # torch.Size([-5]) is constructible, and useless
                raise UnsupportedObjectError(f"torch.Size at {path or '<root>'} holds a negative "
                                             f"size {list(obj)}; readers refuse it "
                                             "(spec/objects.md, O12)")
            return Typed("torch.Size", tuple(obj))
        if t is torch.dtype:
            return Typed("torch.dtype", torch_dtype_name(obj))
        if t is torch.device:
            return Typed("torch.device", str(obj))
        if isinstance(obj, np.ndarray) and t is np.ndarray:
            return Typed("numpy.ndarray", self.add(path, _from_numpy(obj, path)))
        if isinstance(obj, np.generic):
            return Typed("numpy.scalar", self.add(path, _from_numpy(np.asarray(obj), path)))
        d = depth + 1
        if t is list or t is tuple:
            return t(self.walk(x, _join(path, i), d) for i, x in enumerate(obj))
        if t is dict or t is OrderedDict:
            _check_key_hashes(obj, path)
            attrs = getattr(obj, "__dict__", None)
            if attrs:
                d += _WRAP  # the dict sits inside an s4.attrs value
            out = t((k, self.walk(v, _join(path, k), d)) for k, v in obj.items())
            return self.with_attrs(obj, out, attrs, path, depth) if attrs else out
        conv = _converter_of(t)
        if conv is not None and conv.encode is not None:
            return Typed(conv.name, self.walk(self.encode(obj, conv), path, d))
        enc = pytypes.stored(obj, path, _name_of)
        if enc is not None:
            return self.python(enc, path, depth)
        raise UnsupportedObjectError(
            f"cannot save object of type {t.__module__}.{t.__qualname__} at "
            f"{path or '<root>'}: s4weights stores tensors, numpy arrays, dicts, lists, tuples, "
            "str, int, float, bool, None, bytes, torch.Size/dtype/device, argparse.Namespace, "
            "pathlib paths, datetime values and collections containers; register the class "
            "with s4weights.register_type to store it (an enum or named tuple class needs only "
            "a name)")

    def python(self, enc: pytypes.Stored, path: str, depth: int) -> Typed:
        """A standard-library value as its typed value, the user values in it walked."""
        self.check_depth(depth + enc.height, path)
        if enc.keys is not None:
            _check_key_hashes(enc.keys, path)
        walked = [self.walk(x, _join(path, k), depth + enc.level) for k, x in enc.items]
        return Typed(enc.name, enc.form(walked))


MAX_REPEATED = 1 << 22  # nodes a save may write again for objects it meets at several places,
REPEAT_FACTOR = 8  # or this many times the nodes it holds once, whichever is more
_PLAIN_TENSORS = (torch.Tensor, torch.nn.Parameter)  # stored as tensors, never by a converter
_WRAP = 2  # levels s4.attrs puts between an object's place and the object: Typed, pair


def _stored_as_tensor(obj: Any) -> bool:
    """Whether the walk stores ``obj`` as a tensor: a tensor, unless it is of a subclass with
    a registered converter."""
    return isinstance(obj, torch.Tensor) and (type(obj) in _PLAIN_TENSORS
                                              or _converter_of(type(obj)) is None)


def _check_key_hashes(d: dict, path: str) -> None:
    """Refuse, before anything is written, a dict that readers refuse for the keys its
    hashes share (spec/objects.md, O13)."""
    hashes = objtree.KeyHashes()
    for key in d:
        if not hashes.add(key):
            raise UnsupportedObjectError(
                f"dict at {path or '<root>'} has more than {objtree.MAX_KEYS_PER_HASH} keys "
                f"of one hash ({objtree._shown(key)} is one): readers refuse it "
                "(spec/objects.md, O13)")


def _attrs_of(t: torch.Tensor) -> dict:
    """A tensor's Python attributes (``t.flag = ...``; torch.save keeps them)."""
    return getattr(t, "__dict__", None) or {}


def _plain_attribute(cls: type, name: Any) -> bool:
    """Whether ``name`` may be set as an attribute on loading: a str that is no dunder and
    names nothing of the class (a file must not replace ``keys`` of a dict or ``data`` of a
    tensor)."""
    return isinstance(name, str) and not name.startswith("__") and not hasattr(cls, name)


def _from_numpy(arr: np.ndarray, path: str) -> Tensor:
    try:
        return Tensor.from_numpy(arr)
    except FormatError:
        raise UnsupportedObjectError(f"cannot save numpy array of dtype {arr.dtype} at "
                                     f"{path or '<root>'}: numpy arrays of bool, int, uint, "
                                     "float and complex dtypes are stored") from None


def _storage_key(t: torch.Tensor) -> tuple[str, int, int]:
    # the size too: two storages can start at one address (numpy views wrapped by
    # torch.from_numpy, torch.frombuffer with different counts), and only one is stored
    storage = t.untyped_storage()
    return (str(t.device), storage.data_ptr(), storage.nbytes())


def _storage_key_or_none(t: torch.Tensor) -> tuple[str, int, int] | None:
    """The storage key, or None for tensors without a storage to read (sparse and other
    layouts, meta tensors, wrapper subclasses whose storage access fails)."""
    if t.layout != torch.strided or t.device.type == "meta":
        return None
    try:
        return _storage_key(t)
    except (RuntimeError, ValueError, NotImplementedError):
        return None


_join = objtree.key_path


def flatten(obj: Any) -> Flattened:
    f = _Flattener()
    f.count_owners(obj)
    return Flattened(f.walk(obj, ""), f.tensors)


MapLocation = Any


class IntoMismatchError(S4Error, ValueError):
    """A tensor passed in ``into=`` does not fit the stored tensor at its key path (dtype,
    shape or device), or the file holds no tensor at that path. Raised before anything is
    decoded, naming the key path."""


@dataclass(frozen=True)
class _Site:
    """Where the tree stores a torch tensor: a bare ref or an ``s4.view`` of a storage."""
    index: int                  # stored tensor (the storage, for a view)
    dtype: str
    shape: tuple[int, ...]
    whole: bool                 # the tensor is all of its stored bytes, in C order
    view: bool = False          # an s4.view (rebuilt over the decoded storage)


def tensor_leaves(obj: Any, path: str = "", out: dict[str, torch.Tensor] | None = None
                  ) -> dict[str, torch.Tensor]:
    """Key path -> tensor for every tensor in ``obj`` (dicts, lists, tuples), with the paths
    :func:`flatten` gives them."""
    out = {} if out is None else out
    if isinstance(obj, torch.Tensor):
        out.setdefault(path, obj)
    elif isinstance(obj, dict | argparse.Namespace):
        for k, v in (obj if isinstance(obj, dict) else vars(obj)).items():
            tensor_leaves(v, _join(path, k), out)
    elif isinstance(obj, list | tuple | deque):
        for i, v in enumerate(obj):
            tensor_leaves(v, _join(path, i), out)
    return out


def _sites(tree: Any, info: Callable[[int], Any], limit: int
           ) -> tuple[dict[str, _Site | None], Counter]:
    """Key path -> tensor site of the stored tree (None where a path holds a numpy array), for
    paths of at most ``limit`` characters (the longest ``into=`` path: no longer one can
    match), and how many sites use each stored tensor, at any path. ``info(i)`` gives stored
    tensor i's ``dtype``/``shape``/``raw_nbytes``."""
    out: dict[str, _Site | None] = {}
    uses: Counter = Counter()
    path = objtree.KeyPath(limit=limit)

    def site(node: Any) -> _Site | None:
        if type(node) is TensorRef:
            ti = info(node.index)
            return _Site(node.index, ti.dtype.name, tuple(ti.shape), True)
        v = node.value
        shape, stride, itemsize = v["shape"], v["stride"], dtypes.BY_NAME[v["dtype"]].itemsize
        whole = v["offset"] == 0 and _c_strides(shape) == stride \
            and math.prod(shape) * itemsize == info(v["storage"].index).raw_nbytes
        return _Site(v["storage"].index, v["dtype"], shape, whole, True)

    def visit(node: Any) -> None:
        t = type(node)
        if t is TensorRef or (t is Typed and node.name == VIEW):
            found = site(node)
            uses[found.index] += 1
            if path.exact() is not None:
                out.setdefault(path.exact(), found)
        elif t is list or t is tuple or t is dict or t is OrderedDict:
            for k, v in (node.items() if t is dict or t is OrderedDict else enumerate(node)):
                path.push(k)
                visit(v)
                path.pop()
        elif t is Typed and node.name in ("numpy.ndarray", "numpy.scalar"):
            if path.exact() is not None:
                out.setdefault(path.exact(), None)
        elif t is Typed and node.name == ATTRS:
            visit(node.value[0])
            visit(node.value[1])
        elif t is Typed and node.name in pytypes.NAMES:
            for k, v in pytypes.children(node):
                path.push(k)
                visit(v)
                path.pop()
        elif t is Typed and node.name not in ("torch.Size", "torch.dtype", "torch.device"):
            visit(node.value)

    visit(tree)
    return out, uses


def _c_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, n = [], 1
    for d in reversed(shape):
        out.append(n)
        n *= max(d, 1)
    return tuple(reversed(out))


@dataclass
class IntoPlan:
    """How a load fills the caller's tensors: ``by_path`` maps a key path to the tensor the
    loaded tree returns there; ``direct`` maps a stored tensor index to the flat uint8 bytes of
    the destination the GPU decoder writes straight into (whole, contiguous CUDA tensors)."""
    by_path: dict[str, torch.Tensor]
    direct: dict[int, torch.Tensor]


def plan_into(tree: Any, info: Callable[[int], Any], into: Any) -> IntoPlan:
    """Match ``into``'s tensors to the stored tree by key path and check each one fits; raise
    :class:`IntoMismatchError` naming the first path that does not."""
    leaves = tensor_leaves(into)
    sites, uses = _sites(tree, info, max(map(len, leaves), default=-1))
    # destinations sharing a storage with another (tied weights, views of one buffer) are
    # decoded apart and copied in, in tree order, as on the CPU path: decoding one in place
    # ahead of its turn would let the other's copy land on it (or both decode into it)
    storages = Counter(d.untyped_storage().data_ptr() for d in leaves.values()
                       if d.device.type == "cuda")
    direct: dict[int, torch.Tensor] = {}
    for path, dest in leaves.items():
        where = path or "<root>"
        site = sites.get(path)
        if site is None:
            what = "a numpy array" if path in sites else "no tensor"
            raise IntoMismatchError(f"into= has a tensor at {where}, where the file stores {what}")
        if torch_dtype_name(dest.dtype) != site.dtype:
            raise IntoMismatchError(f"into= tensor at {where} is {torch_dtype_name(dest.dtype)}, "
                                    f"the file stores {site.dtype}")
        if tuple(dest.shape) != site.shape:
            raise IntoMismatchError(f"into= tensor at {where} has shape {tuple(dest.shape)}, "
                                    f"the file stores {site.shape}")
        if dest.device.type == "meta" or dest.layout != torch.strided or dest.is_quantized \
                or dest.is_nested:
            raise IntoMismatchError(f"into= tensor at {where} ({dest.device}, {dest.layout}) "
                                    "cannot be written in place")
        # A view is rebuilt over the storage it was decoded into: only a destination that is
        # its whole storage can be that storage.
        owns = not site.view or (dest.storage_offset() == 0 and dest.untyped_storage().nbytes()
                                 == dest.numel() * dest.element_size())
        if dest.device.type == "cuda" and site.whole and uses[site.index] == 1 and owns \
                and dest.is_contiguous() and dest.numel() \
                and storages[dest.untyped_storage().data_ptr()] == 1:
            direct[site.index] = dest.detach().reshape(-1).view(torch.uint8)
    return IntoPlan(leaves, direct)


def _target_device(saved: str, map_location: MapLocation) -> torch.device:
    if map_location is None:
        return torch.device(saved)
    if callable(map_location) and not isinstance(map_location, (str, torch.device, dict)):
        # torch.load's convention: called with (storage, location); we hand an empty CPU
        # storage and the saved location string; a returned storage's or tensor's device is
        # used, or a device (string) itself, or None for the saved location.
        result = map_location(torch.UntypedStorage(0), saved)
        if result is None:
            return torch.device(saved)
        if isinstance(result, (torch.Tensor, torch.UntypedStorage, torch.TypedStorage)):
            return result.device
        return torch.device(result)
    if isinstance(map_location, dict):
        return torch.device(map_location.get(saved, saved))
    if not isinstance(map_location, (str, torch.device)):
        raise TypeError("map_location must be a str, torch.device, dict or callable, not "
                        f"{type(map_location).__name__}")
    return torch.device(map_location)


def _on(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` on ``device``: ``t`` itself when it is there already (no torch call)."""
    return t if t.device == device else t.to(device)


def _usable(device: torch.device, path: objtree.KeyPath | None = None) -> torch.device:
    """``device``, or UnsupportedDeviceError naming it where this machine or this torch cannot
    load onto it (CUDA without a GPU, ``mps`` off a Mac, ``xla`` without torch_xla)."""
    if device.type in ("cpu", "meta"):
        return device
    if device.type == "cuda" and torch.cuda.is_available() \
            and (device.index is None or device.index < torch.cuda.device_count()):
        return device
    if device.type == "mps":
        if torch.backends.mps.is_available():
            return device
    elif device.type != "cuda":
        available = getattr(getattr(torch, device.type, None), "is_available", None)
        if callable(available) and available():
            return device
    at = f" at {path.shown()}" if path is not None else ""
    if device.type != "cuda":
        why = f"which this machine or this torch {torch.__version__} cannot use"
    elif torch.cuda.is_available():
        why = f"but this machine has {torch.cuda.device_count()} CUDA devices"
    else:
        why = "but CUDA is not available here"
    raise UnsupportedDeviceError(f"a tensor{at} is to be loaded onto {device}, {why}: load "
                                 "with map_location='cpu' (or another device this machine has)")


def _device_key(device: torch.device) -> str:
    """One storage per device: every spelling of the CPU (``cpu:3``) is the CPU."""
    return device.type if device.type in ("cpu", "meta") else str(device)


class Unflattener:
    """Rebuilds torch objects from a decoded tree; ``tensor(i)`` yields stored tensor ``i``.

    One pass over the tree, in time and memory linear in it: key paths are built only for
    messages and ``into=`` lookups (:class:`~s4format.objtree.KeyPath`), and each stored tensor
    is decoded once however many references, of whatever kind, the tree holds to it. With
    ``uses`` (references per stored tensor, :attr:`s4format.Reader.tensor_uses`) a decoded
    tensor is dropped after its last reference; without, it is kept for the whole walk."""

    def __init__(self, tensor: Callable[[int], Tensor], map_location: MapLocation = None,
                 strict: bool = True,
                 device_tensor: Callable[[int, torch.device], torch.Tensor] | None = None,
                 into: IntoPlan | None = None, uses: list[int] | None = None) -> None:
        self._tensor = tensor
        # Tensors the caller passed (``into=``): filled in place and returned at their paths.
        self._into = into.by_path if into is not None else {}
        # Decodes stored tensor i straight onto a CUDA device (the GPU path), when given.
        self._device_tensor = device_tensor
        self._map_location = map_location
        self._strict = strict
        self._left = dict(enumerate(uses)) if uses is not None else None
        self._decoded: dict[int, Tensor] = {}
        self._storages: dict[tuple[int, str], torch.UntypedStorage] = {}
        self._protos: dict[tuple[torch.dtype, str], torch.Tensor] = {}  # (dtype, device key)
        self._plain: dict[int, torch.Tensor] = {}
        self._arrays: dict[int, np.ndarray] = {}
        self._devices: dict[tuple[str, torch.device | None], tuple[torch.device, str]] = {}
        self._path = objtree.KeyPath()

    def _host(self, i: int) -> Tensor:
        """Stored tensor i decoded on the host: decoded once, kept while references remain."""
        t = self._decoded.get(i)
        if t is None:
            t = self._tensor(i)
            if self._left is None or self._left.get(i, 0) > 1:
                self._decoded[i] = t
        return t

    def _used(self, i: int) -> None:
        """One reference to stored tensor i is rebuilt: the last one drops its decoded bytes."""
        if self._left is not None:
            self._left[i] = left = self._left.get(i, 0) - 1
            if left <= 0:
                self._decoded.pop(i, None)

    def _stored(self, i: int, device: torch.device | None = None) -> torch.Tensor:
        if device is not None and device.type == "cuda" and self._device_tensor is not None:
            return self._device_tensor(i, device)
        t = self._host(i)
        dt = getattr(torch, t.dtype.name, None)
        if not isinstance(dt, torch.dtype):
            raise UnsupportedObjectError(f"this torch has no dtype {t.dtype.name}")
        if not t.data.size:
            return torch.empty(t.shape, dtype=dt)
        # Shaped and typed in numpy where it can: each torch call releases and retakes the GIL,
        # which costs a wait whenever the decoding threads hold it.
        data = torch.from_numpy(t.to_numpy())
        return data if data.dtype == dt else data.view(dt)

    def _dest(self) -> torch.Tensor | None:
        """The caller's ``into=`` tensor at the current key path, if any."""
        return self._into.get(self._path.exact()) if self._into else None

    def _fill(self, dest: torch.Tensor, build: Callable[[torch.device], torch.Tensor]
              ) -> torch.Tensor:
        """Write the loaded value into the caller's ``dest`` and return ``dest``.
        ``build(device)`` makes the loaded value on a device; a whole, contiguous CUDA
        destination is decoded into directly by the GPU loader (no copy then)."""
        got = build(dest.device)
        same = got.data_ptr() == dest.data_ptr() and got.device == dest.device and (
            got.stride() == dest.stride() or (got.is_contiguous() and dest.is_contiguous()))
        if not same:
            with torch.no_grad():
                dest.copy_(got)
        return dest

    def plain(self, ref: TensorRef) -> torch.Tensor:
        try:
            dest = self._dest()
            if dest is not None:
                return self._fill(dest, lambda dev: _on(self._stored(ref.index, dev), dev))
            if ref.index not in self._plain:
                dev = self._view_device("cpu", None)[0]  # (where a bare tensor was saved)
                self._plain[ref.index] = _on(self._stored(ref.index, dev), dev)
            return self._plain[ref.index]
        finally:
            self._used(ref.index)

    def view(self, v: dict[str, Any]) -> torch.Tensor:
        try:
            dest = self._dest()
            if dest is not None:
                return self._fill(dest, lambda dev: self._view(v, dev))
            return self._view(v)
        finally:
            self._used(v["storage"].index)

    def _view(self, v: dict[str, Any], on: torch.device | None = None) -> torch.Tensor:
        """A view as the file describes it; its fields have the forms of spec/objects.md
        (checked when the file was opened)."""
        ref, dname, offset, saved = v["storage"], v["dtype"], v["offset"], v["device"]
        shape, stride = v["shape"], v["stride"]
        device, dkey = self._view_device(saved, on)
        # only the .s4w dtype names (spec/objects.md), not torch's aliases ("float", "long")
        # or dtypes torch cannot build views of (quantized, sub-byte)
        dt = getattr(torch, dname, None)
        if not isinstance(dt, torch.dtype):
            raise UnsupportedObjectError(f"{self._path.shown()}: this torch has no dtype {dname}")
        grad = v["requires_grad"]
        if grad and not (dt.is_floating_point or dt.is_complex):
            raise FormatError(f"{self._path.shown()}: {VIEW}: requires_grad on a {dname} "
                              "tensor")
        key = (ref.index, dkey)
        if key not in self._storages:
            # Tensor.to, not UntypedStorage.to: the latter fails for devices without a
            # storage module (e.g. "meta").
            self._storages[key] = _on(self._stored(ref.index, device), device).untyped_storage()
        storage = self._storages[key]
        itemsize = dt.itemsize
        try:
            typedvalues.check_view_bounds(offset, shape, stride, itemsize, storage.nbytes())
        except FormatError as exc:
            raise FormatError(f"{self._path.shown()}: {exc}") from None
        try:
            # (an empty tensor made from another takes its dtype and device without parsing
            # them again: half the cost of torch.empty, once per view of thousands)
            proto = self._protos.get((dt, dkey))
            if proto is None:
                proto = self._protos[(dt, dkey)] = torch.empty(0, dtype=dt, device=device)
            out = proto.new_empty(0).set_(storage, offset, shape, stride)
        except (RuntimeError, TypeError, ValueError, NotImplementedError) as exc:
            raise FormatError(f"{self._path.shown()}: {VIEW}: torch cannot build this view "
                              f"({exc})") from None
        if v["parameter"]:
            return torch.nn.Parameter(out, requires_grad=grad)
        if grad:
            out.requires_grad_(True)
        return out

    def _view_device(self, saved: str, on: torch.device | None
                     ) -> tuple[torch.device, str]:
        """The device a view saved on ``saved`` is rebuilt on (``on`` where given), checked
        usable, and its storage key. A tree has a few devices and thousands of views: each
        is resolved once per load, except through a callable map_location, which is asked
        for every view as torch.load asks it for every storage."""
        got = self._devices.get((saved, on))
        if got is not None:
            return got
        try:
            # a device string torch cannot parse is the file's fault...
            device = on if on is not None or self._map_location is not None \
                else torch.device(saved)
        except RuntimeError as exc:
            raise FormatError(f"{self._path.shown()}: malformed {VIEW} value: {exc}") from None
        if device is None:  # ...while the caller's map_location errors are the caller's
            device = _target_device(saved, self._map_location)
        got = _usable(device, self._path), _device_key(device)
        if on is not None or not callable(self._map_location):
            self._devices[(saved, on)] = got
        return got

    def walk(self, obj: Any, path: str = "") -> Any:
        """``obj`` rebuilt; ``path``: its key path in the whole tree (for messages and
        ``into=``)."""
        self._path = objtree.KeyPath(path, max(map(len, self._into), default=-1))
        return self._walk(obj)

    def _walk(self, obj: Any) -> Any:
        t = type(obj)
        if t is TensorRef:
            return self.plain(obj)
        if t is list or t is tuple:
            items = []
            for i, x in enumerate(obj):
                self._path.push(i)
                items.append(self._walk(x))
                self._path.pop()
            return items if t is list else tuple(items)
        if t is dict or t is OrderedDict:
            out = t()
            for k, v in obj.items():
                self._path.push(k)
                out[k] = self._walk(v)
                self._path.pop()
            return out
        if t is Typed:
            return self.typed(obj)
        return obj

    def typed(self, obj: Typed) -> Any:
        """A typed value rebuilt; its value is walked once, whatever becomes of it."""
        name, value = obj.name, obj.value
        if name == VIEW:
            return self.view(value)
        try:
            if name == "torch.Size":
                return torch.Size(value)
            if name == "torch.dtype" and isinstance(getattr(torch, value, None), torch.dtype):
                return getattr(torch, value)
            if name == "torch.device":
                return torch.device(value)
        except (RuntimeError, TypeError, ValueError, OverflowError) as exc:
            raise FormatError(f"{self._path.shown()}: malformed {name} value "
                              f"{objtree._shown(value)}: {exc}") from None
        if name in ("numpy.ndarray", "numpy.scalar"):
            return self.array(value, name == "numpy.scalar")
        if name == ATTRS:
            return self.attrs(value)
        if name in pytypes.NAMES:
            return self.python(obj)
        conv = _CONVERTERS.get(name)
        if conv is not None and conv.decode is not None:
            return conv.decode(self._walk(value))
        if self._strict:
            raise UnsupportedObjectError(f"{self._path.shown()}: stored object of type {name!r} "
                                         "is not known "
                                         "here: register it with s4weights.register_type, or "
                                         "load with strict=False to get it as an opaque Typed "
                                         "value")
        return Typed(name, self._walk(value))

    def python(self, obj: Typed) -> Any:
        """A standard-library value rebuilt (:mod:`s4weights.pytypes`); one of a class not
        registered here is refused or, with strict=False, kept as an opaque Typed value."""
        items = []
        for k, v in pytypes.children(obj):
            self._path.push(k)
            items.append(self._walk(v))
            self._path.pop()
        try:
            return pytypes.rebuild(obj, items, _class_of)
        except FormatError as exc:
            raise FormatError(f"{self._path.shown()}: {exc}") from None
        except pytypes.NotHere as exc:
            if self._strict:
                raise UnsupportedObjectError(
                    f"{self._path.shown()}: {exc}: register it with s4weights.register_type, "
                    "or load with strict=False to get it as an opaque Typed value") from None
            return pytypes.opaque(obj, items)

    def array(self, ref: TensorRef, scalar: bool) -> Any:
        """A numpy array (one copy per stored tensor, off the decoded bytes a torch tensor may
        share) or, of a 0-d one, its scalar."""
        try:
            arr = self._arrays.get(ref.index)
            if arr is None:
                arr = self._arrays[ref.index] = self._host(ref.index).to_numpy().copy()
        finally:
            self._used(ref.index)
        return arr[()] if scalar else arr

    def attrs(self, value: tuple[Any, Any]) -> Any:
        """An object with its Python attributes set, from its ``s4.attrs`` pair."""
        inner, attrs = self._walk(value[0]), self._walk(value[1])
        if not isinstance(inner, (OrderedDict, torch.Tensor)):
            if self._strict:
                raise UnsupportedObjectError(
                    f"{self._path.shown()}: {ATTRS} gives attributes to a "
                    f"{type(inner).__name__}, which takes none here: load with strict=False to "
                    "get it as an opaque Typed value")
            return Typed(ATTRS, (inner, attrs))
        for k, v in attrs.items():
            if not _plain_attribute(type(inner), k):
                raise FormatError(f"{self._path.shown()}: {ATTRS} attribute name {k!r} is not "
                                  "a plain attribute name (or is one its "
                                  f"{type(inner).__name__} class defines)")
            setattr(inner, k, v)
        return inner
