"""The CPU kernels built ahead of time, so that a fresh process runs them without numba.

numba caches its compiled kernels, yet a process still pays for importing numba and for starting
its compiler before the first cached kernel runs: about half a second on two cores
(bench/RESULTS.md), on the first save or load of every fresh process. ``python -m s4format
kernels build`` compiles every kernel once, with numba's ahead-of-time compiler, into an
extension module for this machine; :mod:`s4format.jit` then binds each kernel to it, and loads
numba only for a call whose argument types were not built (the built code does not check types,
so a call runs it only where its arguments' types are exactly the ones it was built for).

:mod:`s4format.kernelbuild` builds them. They are kept in a folder named by what they depend
on (:func:`identity`: the kernels' sources, this CPU, Python and numpy), under ``S4_KERNEL_DIR``
or the user's cache folder; a change to any of these leaves them unused until built again.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

# The modules that mark kernels (tests/format/test_kernels_built.py checks the list).
KERNEL_MODULES = ("s4format.hashing", "s4format.layouts", "s4format.masked",
                  "s4format.codecs.rans", "s4format.codecs.ransseg", "s4format.codecs.bitpackw",
                  "s4format.codecs.view")
_PACKAGE = Path(__file__).resolve().parent
_SOURCES = ("jit.py", "kernels.py", "kernelbuild.py", "hashing.py", "layouts.py", "masked.py",
            "codecs/rans.py", "codecs/ransseg.py", "codecs/bitpackw.py", "codecs/view.py")
TABLE = "kernels.json"
_SUFFIX = importlib.machinery.EXTENSION_SUFFIXES[0]


def root() -> Path:
    """The folder of every build: ``S4_KERNEL_DIR``, else ``s4format/kernels`` in the user's
    cache folder (``XDG_CACHE_HOME`` or ``~/.cache``)."""
    env = os.environ.get("S4_KERNEL_DIR")
    if env:
        return Path(env)
    cache = os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache"
    return Path(cache) / "s4format" / "kernels"


def _cpu() -> str:
    """This CPU as far as compiled code depends on it: its model and instruction sets."""
    if sys.platform.startswith("linux"):
        with contextlib.suppress(OSError), open("/proc/cpuinfo", encoding="utf-8",
                                                errors="replace") as f:
            first = f.read(1 << 16).split("\n\n")[0]  # the first processor's block
            return "\n".join(line for line in first.splitlines()
                             if line.startswith(("vendor_id", "model name", "flags", "Features",
                                                 "CPU implementer", "CPU part")))
    return platform.processor()


def host_specific() -> bool:
    """Whether builds here are compiled for this CPU's instruction sets (Linux, where
    :func:`_cpu` reads them), not a generic one."""
    return sys.platform.startswith("linux") and bool(_cpu())


def _version_file(package: str) -> bytes:
    spec = importlib.util.find_spec(package)
    for folder in (spec and spec.submodule_search_locations) or ():
        with contextlib.suppress(OSError):
            return (Path(folder) / "_version.py").read_bytes()
    return b"-"


def identity() -> str:
    """What the built kernels depend on, hashed: their sources, this CPU, Python's ABI and
    numpy's, numba's and llvmlite's versions."""
    h = hashlib.sha256()
    for part in (sys.implementation.cache_tag, _SUFFIX, platform.machine(), _cpu(),
                 np.__version__):
        h.update(str(part).encode() + b"\0")
    for package in ("numba", "llvmlite"):
        h.update(_version_file(package) + b"\0")
    for name in _SOURCES:
        h.update((_PACKAGE / name).read_bytes() + b"\0")
    return h.hexdigest()[:24]


def array_flags(layout: str, readonly: bool) -> str:
    """numba's layout of an array ("C", "F" or "A"), with "r" where it is read-only. (numba
    types an unaligned array as an aligned one, and runs it so.)"""
    return layout + "r" * readonly


def _runtime_key(key: list[Any]) -> tuple:
    """:func:`s4format.jit.arguments_key`'s form of a key as the table stores it."""
    return tuple(map(_runtime_item, key))


def _runtime_item(item: Any) -> Any:
    if isinstance(item, str):
        return item
    if item[0] == "a":
        return (np.dtype(item[1]), item[2], item[3])
    return ("t", *map(_runtime_item, item[1:]))


def load(folder: Path | None = None) -> dict[str, dict[tuple, Callable[..., Any]]]:
    """The kernels built for this machine and these sources, by kernel (``module.name``) and
    argument types (:func:`s4format.jit.arguments_key`); empty where none are built."""
    ident = identity()
    folder = (folder or root()) / ident
    try:
        table = json.loads((folder / TABLE).read_text(encoding="utf-8"))
        if table.get("identity") != ident:
            return {}
        name = table["module"]
        spec = importlib.util.spec_from_file_location(name, folder / (name + _SUFFIX))
        if spec is None or spec.loader is None:
            return {}
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return {qualname: {_runtime_key(key): getattr(module, symbol) for key, symbol in entries}
                for qualname, entries in table["kernels"].items()}
    except (OSError, ValueError, KeyError, TypeError, ImportError, AttributeError):
        return {}  # none built here, or a build left unfinished: numba's kernels serve


def status(folder: Path | None = None) -> dict[str, Any]:
    """Where this machine's build is and whether it loads: what ``kernels`` prints."""
    path = (folder or root()) / identity()
    built = load(folder)
    return {"folder": str(path), "built": bool(built), "kernels": len(built),
            "signatures": sum(len(v) for v in built.values())}
