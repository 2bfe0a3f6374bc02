"""The error hierarchy of the .s4w format, rooted in :class:`S4Error`.

Every problem a reader or writer detects in data it was handed raises one of these, never a
bare ``ValueError``/``IndexError``/``struct.error``. Messages say what was wrong, where (file,
tensor, plane, offset) and, where useful, what the user can do. The spec (``spec/validation.md``)
names the class each validation rule raises.
"""

from __future__ import annotations


class S4Error(Exception):
    """Root of every error raised for bad input, bad files or failed storage."""


class FormatError(S4Error):
    """The bytes are not a well-formed .s4w file (structure, sizes, offsets, encodings)."""


class BadMagicError(FormatError):
    """The file does not start with the .s4w magic (not .s4w, or damaged in transit). A missing
    end magic is a :class:`TruncatedError`: the save that wrote the file did not finish."""


class TruncatedError(FormatError):
    """The file is shorter than its own structures say it must be, or has no end magic."""


class LimitError(FormatError):
    """A declared size, count or depth exceeds a limit of the spec or of the reader."""


class CodecError(FormatError):
    """A plane's stored bytes are not a valid stream for its codec."""


class ChecksumError(S4Error):
    """A checksum over stored bytes (header, index, footer or plane) does not match."""


class ContentHashError(ChecksumError):
    """A tensor's decoded raw bytes do not match the content hash in its record."""


class UnsupportedError(S4Error):
    """The file is valid but uses something this reader does not implement."""


class UnsupportedVersionError(UnsupportedError):
    """The file's major version is not one this reader understands."""


class UnsupportedFeatureError(UnsupportedError):
    """Something this reader must understand is unknown to it: a required header flag, a
    required index extension, a tensor flag, or a dtype, layout or transform ID."""


class UnsupportedCodecError(UnsupportedError):
    """A plane names a codec ID this reader does not know, or whose extra is not installed."""


class UnsupportedObjectError(UnsupportedError):
    """An object in the tree cannot be encoded (writer) or is of a refused kind (reader)."""


class UnsupportedDeviceError(UnsupportedError, RuntimeError):
    """A tensor is to be loaded onto a device this machine or this torch cannot use (saved on
    ``mps`` or ``xla:0`` and loaded elsewhere, or CUDA without a GPU). Also a RuntimeError,
    the class torch.load raises for it."""


class ParentMismatchError(S4Error):
    """A delta's parent is missing or is not the checkpoint the delta was made against."""


class StorageError(S4Error):
    """Reading or committing bytes to a store (local disk, S3) failed."""
