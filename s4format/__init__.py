"""s4format: the .s4w file format — reader, writer, plane layouts, CPU codecs and CLI.

Needs numpy (no torch, no CUDA). The normative description is ``spec/`` in the repository.
"""

import importlib
from typing import TYPE_CHECKING

from s4format.errors import (
    BadMagicError,
    ChecksumError,
    CodecError,
    ContentHashError,
    FormatError,
    LimitError,
    ParentMismatchError,
    S4Error,
    StorageError,
    TruncatedError,
    UnsupportedCodecError,
    UnsupportedDeviceError,
    UnsupportedError,
    UnsupportedFeatureError,
    UnsupportedObjectError,
    UnsupportedVersionError,
)

# (the function shadows its module's name, so it is bound here, not on first use)
from s4format.verify import verify

if TYPE_CHECKING:
    from s4format.objtree import TensorRef, Typed
    from s4format.reader import Reader
    from s4format.tensor import Tensor
    from s4format.writer import Writer, WriteResult, dumps, write

__version__ = "0.1.0"

# Imported on first use: the reader and writer need numpy, which the CLIs' --help and the
# modules that only name the errors do not.
_LAZY = {
    "TensorRef": "s4format.objtree", "Typed": "s4format.objtree", "Reader": "s4format.reader",
    "Tensor": "s4format.tensor", "Writer": "s4format.writer",
    "WriteResult": "s4format.writer", "dumps": "s4format.writer", "write": "s4format.writer",
}

__all__ = [
    "BadMagicError", "ChecksumError", "CodecError", "ContentHashError", "FormatError",
    "LimitError", "ParentMismatchError", "Reader", "S4Error", "StorageError", "Tensor",
    "TensorRef", "TruncatedError", "Typed", "UnsupportedCodecError", "UnsupportedDeviceError",
    "UnsupportedError",
    "UnsupportedFeatureError", "UnsupportedObjectError", "UnsupportedVersionError", "WriteResult",
    "Writer", "dumps", "verify", "write",
]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 's4format' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
