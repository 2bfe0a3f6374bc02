"""Codec registry: codec ID -> codec instance, as in the table of ``spec/codecs.md``.

IDs are never reused. A reader that meets an ID it does not know raises
:class:`~s4format.errors.UnsupportedCodecError`; a known codec whose optional library is missing
raises the same error naming the extra to install.
"""

from __future__ import annotations

import contextlib
import threading

from s4format.codecs.abc import Codec, Encoded
from s4format.codecs.registry import (
    _REGISTRY,
    BITPACK,
    BITPACK_W,
    GDEFLATE,
    NAMES,
    NVCOMP_ANS,
    RANS,
    RANS_SEG,
    RAW,
    SEG_LZ,
    ZSTD,
    register,
)
from s4format.errors import UnsupportedCodecError


def get(codec_id: int) -> Codec:
    _load_builtin()
    try:
        return _REGISTRY[codec_id]
    except KeyError:
        name = NAMES.get(codec_id)
        if name is None:
            raise UnsupportedCodecError(
                f"unknown codec ID {codec_id}; this reader decodes codec IDs "
                f"{sorted(_REGISTRY)}") from None
        raise UnsupportedCodecError(
            f"codec {name!r} (ID {codec_id}) is not available in this installation") from None


def available() -> dict[int, Codec]:
    _load_builtin()
    return dict(_REGISTRY)


def name_of(codec_id: int) -> str:
    return NAMES.get(codec_id, f"unknown-{codec_id}")


_loaded = False
_loading = threading.Lock()


def _load_builtin() -> None:
    # Imported lazily: importing a codec imports the package first. Worker
    # threads may ask at once: none may see the registry before every codec is in it.
    global _loaded
    if _loaded:
        return
    with _loading:
        if _loaded:
            return
        from s4format.codecs import bitpack, raw, zstd  # noqa: F401
        for optional in ("rans", "ransseg", "bitpackw", "gdeflate"):
            with contextlib.suppress(ImportError):
                __import__(f"s4format.codecs.{optional}")
        _loaded = True


__all__ = [
    "BITPACK",
    "BITPACK_W",
    "GDEFLATE",
    "NAMES",
    "NVCOMP_ANS",
    "RANS",
    "RANS_SEG",
    "RAW",
    "SEG_LZ",
    "ZSTD",
    "Codec",
    "Encoded",
    "available",
    "get",
    "name_of",
    "register",
]
