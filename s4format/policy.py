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
    layouts.KIND_EXPONENT: (codecs.RANS, codecs.ZSTD, codecs.GDEFLATE),
    layouts.KIND_MANTISSA: (codecs.RANS, codecs.ZSTD, codecs.GDEFLATE),
    layouts.KIND_BYTE: (codecs.BITPACK, codecs.RANS, codecs.ZSTD, codecs.GDEFLATE),
    layouts.KIND_RAW: (codecs.BITPACK, codecs.RANS, codecs.ZSTD, codecs.GDEFLATE),
}
# On the CPU GDeflate codes about 6x slower than zstd and rarely smaller (bench/RESULTS.md),
# so auto estimates it only where zstd's estimate shows LZ-style redundancy that the order-0
# rANS misses: zstd at least this much smaller than the best so far.
_LZ_GATE = 0.99
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
    ranked: list[tuple[int, int]] = []
    zstd_est = None
    for cid in table[kind]:
        codec = available.get(cid)
        if codec is None:
            continue
        best = min((e for e, _ in ranked), default=plane.size)
        if policy == "auto" and cid == codecs.GDEFLATE and not (
                zstd_est is not None and zstd_est < _LZ_GATE * best):
            continue
        est = codec.estimate(plane)
        if cid == codecs.ZSTD:
            zstd_est = est
        if est is not None and est < plane.size:
            ranked.append((est, cid))
    for _est, cid in sorted(ranked):
        enc = available[cid].encode(plane)
        if enc is not None and enc.nbytes < plane.size:
            return cid, enc
    return raw
