"""Codec choice per plane (``spec/codecs.md``, "Choosing codecs" — informative: any choice is a
valid file; this is what our writer does).

``auto`` (default) ranks the candidate codecs for a plane kind by their size estimate and codes
with the smallest; ``seed`` uses the fixed assignment exponent->rANS, mantissa->GDeflate,
sign->bitpack. Either way ``raw`` is the floor: a plane never stores more than its own length.
"""

from __future__ import annotations

import numpy as np

from s4format import codecs, layouts
from s4format.codecs.abc import Encoded

POLICIES = ("auto", "seed")

_AUTO = {
    layouts.KIND_SIGN: (codecs.BITPACK, codecs.RANS),
    layouts.KIND_EXPONENT: (codecs.RANS, codecs.ZSTD),
    layouts.KIND_MANTISSA: (codecs.GDEFLATE, codecs.RANS, codecs.ZSTD),
    layouts.KIND_BYTE: (codecs.RANS, codecs.GDEFLATE, codecs.ZSTD, codecs.BITPACK),
    layouts.KIND_RAW: (codecs.ZSTD, codecs.RANS, codecs.BITPACK),
}
_SEED = {
    layouts.KIND_SIGN: (codecs.BITPACK,),
    layouts.KIND_EXPONENT: (codecs.RANS,),
    layouts.KIND_MANTISSA: (codecs.GDEFLATE,),
    layouts.KIND_BYTE: (codecs.ZSTD,),
    layouts.KIND_RAW: (codecs.ZSTD,),
}

# Below this a plane is stored raw: coding cannot win back its own bookkeeping.
MIN_CODED = 64


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    return policy


def encode_plane(plane: np.ndarray, kind: int, policy: str = "auto") -> tuple[int, Encoded]:
    """Pick a codec for ``plane`` and code it; returns ``(codec_id, encoded)``."""
    raw = (codecs.RAW, Encoded(plane))
    if plane.size < MIN_CODED:
        return raw
    available = codecs.available()
    table = _SEED if policy == "seed" else _AUTO
    ranked = []
    for cid in table[kind]:
        codec = available.get(cid)
        if codec is None:
            continue
        est = codec.estimate(plane)
        if est is not None and est < plane.size:
            ranked.append((est, cid))
    for _est, cid in sorted(ranked):
        enc = available[cid].encode(plane)
        if enc is not None and enc.nbytes < plane.size:
            return cid, enc
    return raw
