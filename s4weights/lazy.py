"""``s4weights.open``: lazy access to one .s4w file, in the style of ``safetensors.safe_open``.

Opening reads the header, the footer and the index only (three reads; ranged GETs on S3).
``get_tensor`` then reads and decodes the one stored tensor a key names: for a view, the whole
storage it shares with other tensors. Keys are the key paths :func:`s4weights.save` gives
tensors: a state dict's own keys, ``"optimizer.state.0.exp_avg"`` deeper in a tree.
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Iterator
from typing import Any

import torch

import s4format
from s4format.errors import LimitError
from s4format.objtree import TensorRef, Typed, key_path
from s4format.source import ByteSource
from s4weights import api, pytypes
from s4weights.torchtree import ATTRS, VIEW, Unflattener


class S4File:
    """An open .s4w file (see :func:`open`); close it, or use it as a context manager."""

    def __init__(self, f: api.FileLike | bytes | ByteSource, *,
                 parent: api.FileLike | s4format.Reader | None = None,
                 verify: bool = True) -> None:
        with contextlib.ExitStack() as opened:
            if parent is not None and not isinstance(parent, s4format.Reader):
                parent = opened.enter_context(api.open_reader(parent, verify=verify))
            self.reader = opened.enter_context(api.open_reader(f, parent=parent,
                                                               verify=verify))
            self._closing = opened.pop_all()
        paths = _Paths(self.reader.name)
        paths.walk(self.reader.tree)
        self._nodes: dict[str, Any] = paths.out

    def keys(self) -> list[str]:
        """The key path of every tensor in the file, in the saved tree's order."""
        return list(self._nodes)

    def metadata(self) -> dict[str, str]:
        """The file's metadata (str to str), as ``save(..., metadata=)`` wrote it."""
        return dict(self.reader.metadata)

    def get_tensor(self, name: str, device: str | torch.device = "cpu") -> torch.Tensor:
        """Read and decode the tensor at key path ``name`` onto ``device``."""
        node = self._nodes.get(name)
        if node is None:
            raise KeyError(f"{self.reader.name} has no tensor at key {name!r}")
        return Unflattener(self.reader.read, map_location=device).walk(node, name)

    def __contains__(self, name: object) -> bool:
        return name in self._nodes

    def __iter__(self) -> Iterator[str]:
        return iter(self._nodes)

    def __len__(self) -> int:
        return len(self._nodes)

    def close(self) -> None:
        self._closing.close()

    def __enter__(self) -> S4File:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<s4weights.S4File {self.reader.name}: {len(self._nodes)} tensors>"


def _is_tensor_node(node: Any) -> bool:
    t = type(node)
    return t is TensorRef or (t is Typed and node.name == VIEW and isinstance(node.value, dict))


# The key paths open() builds, in characters, at most: a tensor deep under long keys has a path
# as long as all of them, and many such tensors would multiply it.
MAX_KEY_CHARS = 64 << 20


class _Paths:
    """Key path -> tensor node, for every tensor under a tree; each path built once, when a
    tensor is met (building it at every level would cost depth^2 x key length)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.keys: list[Any] = []
        self.out: dict[str, Any] = {}
        self.chars = 0

    def add(self, node: Any) -> None:
        parts: list[str] = []
        n = 0
        for k in self.keys:
            text = key_path("", k)
            if n:  # (a separator after a non-empty path only, as key_path joins)
                parts.append(".")
                n += 1
            parts.append(text)
            n += len(text)
            if self.chars + n > MAX_KEY_CHARS:
                raise LimitError(f"{self.name}: the key paths of its tensors exceed "
                                 f"{MAX_KEY_CHARS} characters; read it with s4weights.load")
        self.chars += n
        self.out.setdefault("".join(parts), node)

    def walk(self, node: Any) -> None:
        t = type(node)
        if _is_tensor_node(node):
            self.add(node)
        elif t is dict or t is OrderedDict:
            for k, v in node.items():
                self._under(k, v)
        elif t is list or t is tuple:
            for i, v in enumerate(node):
                self._under(i, v)
        elif t is Typed and node.name in pytypes.NAMES:
            for k, v in pytypes.children(node):
                self._under(k, v)
        elif t is Typed and node.name == ATTRS and isinstance(node.value, tuple) \
                and len(node.value) == 2:
            inner, attrs = node.value
            if _is_tensor_node(inner):
                self.add(node)
            else:
                self.walk(inner)
            self.walk(attrs)

    def _under(self, key: Any, node: Any) -> None:
        self.keys.append(key)
        try:
            self.walk(node)
        finally:
            self.keys.pop()


def open(f: api.FileLike | bytes | ByteSource, *,
         parent: api.FileLike | s4format.Reader | None = None,
         verify: bool = True) -> S4File:
    """Open a .s4w file (a path, an ``s3://bucket/key`` URL, bytes or a binary file object)
    for lazy access: ``keys()``, ``metadata()`` and ``get_tensor(name, device=...)``, which
    reads and decodes only that tensor. ``parent``: the parent file of a delta. ``verify``
    checks each decoded tensor's content hash (default on)."""
    return S4File(f, parent=parent, verify=verify)


__all__ = ["S4File", "open"]
