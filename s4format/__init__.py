"""s4format: the .s4w file format — reader, writer, plane layouts, CPU codecs and CLI.

Needs numpy (no torch, no CUDA). The normative description is ``spec/`` in the repository.
"""

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
from s4format.objtree import TensorRef, Typed
from s4format.reader import Reader
from s4format.tensor import Tensor
from s4format.verify import verify
from s4format.writer import Writer, WriteResult, dumps, write

__version__ = "0.1.0"

__all__ = [
    "BadMagicError", "ChecksumError", "CodecError", "ContentHashError", "FormatError",
    "LimitError", "ParentMismatchError", "Reader", "S4Error", "StorageError", "Tensor",
    "TensorRef", "TruncatedError", "Typed", "UnsupportedCodecError", "UnsupportedDeviceError",
    "UnsupportedError",
    "UnsupportedFeatureError", "UnsupportedObjectError", "UnsupportedVersionError", "WriteResult",
    "Writer", "dumps", "verify", "write",
]
