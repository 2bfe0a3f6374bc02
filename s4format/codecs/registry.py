"""The codec IDs of ``spec/codecs.md`` and the table of registered codecs; codec modules
register themselves here, and :mod:`s4format.codecs` loads them."""

from __future__ import annotations

from s4format.codecs.abc import Codec

# The registered IDs of .s4w v1 (spec/codecs.md). 0 is never a valid ID; 7 is held unassigned
# (the frozen conformance suite v1 uses it as its unknown codec, vector codec_7).
RAW = 1
BITPACK = 2
ZSTD = 3
RANS = 4
GDEFLATE = 5
NVCOMP_ANS = 6
BITPACK_W = 8
RANS_SEG = 9  # format 1.3
SEG_LZ = 10  # format 1.5

NAMES = {RAW: "raw", BITPACK: "bitpack", ZSTD: "zstd", RANS: "rans", GDEFLATE: "gdeflate",
         NVCOMP_ANS: "nvcomp-ans", BITPACK_W: "bitpack-w",
         RANS_SEG: "rans-seg", SEG_LZ: "seg-lz"}

_REGISTRY: dict[int, Codec] = {}


def register(codec: Codec) -> Codec:
    if codec.codec_id in _REGISTRY:
        raise ValueError(f"codec ID {codec.codec_id} registered twice")
    _REGISTRY[codec.codec_id] = codec
    return codec
