"""Codec choice per plane (``spec/codecs.md``, "Choosing codecs" — informative: any choice is a
valid file; this is what our writer does).

``auto`` (default) ranks the candidate codecs for a plane kind by their size estimate and codes
with the smallest (but bitpack-w wins unless an entropy coder saves more than 1/65 of its size).
Estimates come from the plane's histogram, counted in the one pass over the tensor's words;
only the LZ coders (zstd, GDeflate) need a trial encode, paid where :func:`lz_may_pay` says
they can win. ``seed`` uses the fixed assignment exponent->rANS, mantissa->GDeflate,
sign->bitpack;
``auto-1.0`` is ``auto`` without the codecs format 1.1 added, for files that format-1.0 readers
decode. Under every policy ``raw`` is the floor: a plane never stores more than its own length.
"""

from __future__ import annotations

import numpy as np

from s4format import codecs, layouts
from s4format.codecs import bitpackw
from s4format.codecs.abc import Encoded
from s4format.codecs.view import PlaneView, chance_runs
from s4format.schema import MINOR

POLICIES = ("auto", "seed", "auto-1.0")

_AUTO = {
    layouts.KIND_SIGN: (codecs.BITPACK, codecs.RANS, codecs.ZSTD),
    layouts.KIND_EXPONENT: (codecs.BITPACK_W, codecs.RANS, codecs.ZSTD, codecs.GDEFLATE),
    layouts.KIND_MANTISSA: (codecs.BITPACK_W, codecs.RANS, codecs.ZSTD, codecs.GDEFLATE),
    layouts.KIND_BYTE: (codecs.BITPACK, codecs.BITPACK_W, codecs.RANS, codecs.ZSTD,
                        codecs.GDEFLATE),
    layouts.KIND_RAW: (codecs.BITPACK, codecs.BITPACK_W, codecs.RANS, codecs.ZSTD,
                       codecs.GDEFLATE),
    layouts.KIND_MASK: (codecs.RANS, codecs.ZSTD),
}
# The entropy coders (rANS, zstd, GDeflate) must beat bitpack-w by more than this share of its
# size to be chosen over it: bitpack-w codes and decodes at memory speed, and rANS stores the
# 7-bit mantissa plane of weights only about 0.2% below 7 bits per byte (bench/ratio.py's
# rows), a full entropy-coding pass for that. As integers: bitpack-w's size s wins against
# an estimate e when 64 * s <= 65 * e. (A plane of 0s and 1s whose kind has no bitpack
# candidate, such as an exponent plane, gets bitpack-w at w = 1: bitpack's bytes, codec 8.)
PACKED_SLACK = (64, 65)
_ENTROPY = frozenset((codecs.RANS, codecs.ZSTD, codecs.GDEFLATE, codecs.RANS_SEG,
                      codecs.SEG_LZ))
_SEGMENTED = (codecs.RANS_SEG, codecs.SEG_LZ)
# On the CPU GDeflate codes about 6x slower than zstd and rarely smaller (bench/RESULTS.md),
# so auto estimates it only where zstd's estimate shows LZ-style redundancy that the order-0
# rANS misses: zstd at least this much smaller than the best so far.
_LZ_GATE = 0.99
# "auto-1.0": auto as format 1.0 had it, without the codecs 1.1 added (bitpack-w): files that
# readers of format 1.0 decode. The writer marks them 1.0 in the header.
# (Nor zstd on sign planes, added to auto with the sparse rule below on 2026-12-01.)
_AUTO_1_0 = {k: tuple(c for c in v if c != codecs.BITPACK_W
                      and not (k == layouts.KIND_SIGN and c == codecs.ZSTD))
             for k, v in _AUTO.items()}
_SEED = {
    layouts.KIND_SIGN: (codecs.BITPACK,),
    layouts.KIND_EXPONENT: (codecs.RANS,),
    layouts.KIND_MANTISSA: (codecs.GDEFLATE,),
    layouts.KIND_BYTE: (codecs.ZSTD,),
    layouts.KIND_RAW: (codecs.ZSTD,),
}

_TABLES = {"auto": _AUTO, "seed": _SEED, "auto-1.0": _AUTO_1_0}

# LZ-style coders are estimated (a trial encode of samples) on a float's planes and on masks
# only when lz_may_pay says so; on smaller planes always.
_RUNS_KINDS = frozenset((layouts.KIND_SIGN, layouts.KIND_EXPONENT, layouts.KIND_MANTISSA,
                         layouts.KIND_MASK))
LZ_ALWAYS = 16 * 1024
LZ_RUNS = 0.002
# Exponents follow the scale of their neighbours (a row's, a channel's): runs above chance
# that LZ cannot use. On bench/ratio.py's rows zstd won on exponent planes only past 34% of
# extra runs and lost on all from 0.2% to 11%.
LZ_RUNS_EXPONENT = 0.2
# A whole mantissa plane is tried past this. The kept words of a fine-tuning delta (changes of
# a unit or two in the last place) pass LZ_RUNS on their mantissa planes by 0.2-0.4% of the
# plane, where zstd stored 3-19% more than rANS; on bench/ratio.py's rows and
# bench/cpu_speed.py's states zstd won on mantissa planes from 0.95% of extra runs up
# (2026-12-06). (Codec 10's segments keep LZ_RUNS.)
LZ_RUNS_MANTISSA = 0.008
# A masked tensor's mask: where few words changed, rANS codes its bytes best (zstd stored
# 1.25-1.54 x rANS on the embedding masks of bench/checkpoints.py's fine-tuning deltas, with
# 0.4-1.1% of extra runs); where many did, zstd stored 0.4-3.6% less than rANS, the most
# where the extra runs passed 2% (2026-12-06). Its trial encode is paid only there, and rANS
# decodes a mask 1.4-2.4 x faster.
LZ_RUNS_MASK = 0.02

# A plane whose most common byte fills this share of it, but not all of it, is sparse (a
# delta's sign and exponent planes: most elements keep theirs). There zstd codes the long runs
# below the order-0 bound that rANS is held to, and decodes them 5-10 times faster than rANS
# decodes one symbol per byte (a fine-tuning delta's planes, bench/RESULTS.md), so it is tried
# on every sparse plane and preferred to rANS unless it stores more by over SPARSE_SLACK of
# the plane's length. (Under ``auto`` only: ``auto-1.0`` keeps the choices format 1.0 files
# were written with.)
SPARSE = 0.9
SPARSE_SLACK = 1 / 64
# ... except on an exponent plane tried by that rule alone (no runs that lz_may_pay counts)
# whose rANS estimate passes this share of its length: zstd would have to store under twice
# rANS there to be preferred. On the kept words of bench/checkpoints.py's CPU fine-tuning
# deltas it stored 1.18-1.79 x rANS (2026-12-06). At twice this share, zstd was tried on the
# kept top bytes of every such delta (1.3-1.8% of them non-zero) and preferred on a few, for
# 20-30 µs less decoding a plane: the trials took 2 ms of a one-thread delta save. At this
# share the 2-core delta saves of six fine-tuning states took 18.5 against 19.1-19.3 ms, the
# chain stored 0.4% less and its steps loaded as fast (15.95-16.60 against 15.81-16.12 ms on
# one thread, the slowest step of three alternated rounds). (zstd's lead in decoding has
# narrowed since the rule above was measured: on planes of 2^20 bytes, 0.5% of them 1 to 4 at
# random, it decoded in 151 µs against rANS's 418; at 3% and 8%, rANS's 315 and 295 µs beat
# zstd's 540 and 889.)
SPARSE_HOPELESS = SPARSE_SLACK

# rANS is ruled out on a plane's sample alone (the plane not counted) when the sample's
# estimate comes within this share of what it must beat, or above it. A sample's entropy errs
# low (a random byte plane's sample still estimates its raw size), so the plane counted would
# save less still; counting the low mantissa bytes of fp32 weights only to store them raw
# took a third of a save (bench/cpu_speed.py, 2026-12-02).
SAMPLE_MARGIN = 1 / 1024

# Under ``auto``, a counted plane of at least view.UNITS_MIN bytes whose histogram changes along
# it (a flat buffer of many parameters) takes rans-seg (codec 9: segments, each raw, packed or
# rANS with a table of its own) where that is estimated to store less than the best codec of
# the whole plane by more than this share. Below it the plane keeps that codec: segments cost
# a table each, and a plane of one codec is the simpler file.
SEGMENTS_GAIN = 1 / 128
# ... and is preferred to an LZ coder that stores at most this share of the plane less; seg-lz
# (codec 10) only where that is also at most SEGMENTS_SLACK_LZ of what the LZ coder stores: on
# a plane LZ shrinks far, the plane's share would let it store several times more, for no
# decoder that codec 9's GPU decoding would gain.
SEGMENTS_SLACK = 1 / 128
SEGMENTS_SLACK_LZ = 1 / 64
# seg-lz is not tried on a plane whose one zstd frame is estimated under this share of
# rans-seg's: the plane is mostly repeats, which one frame codes best, and the segments' zstd
# trials added a quarter to the save of sorted int64 token IDs, changing no byte stored.
SEG_LZ_FAR = 1 / 4

# Where a view's memo holds this key, codec 10 (seg-lz) tries zstd on a segment whose runs
# pass its value rather than LZ_RUNS: the plane kind's bar, set by _add_segments.
SEG_LZ_RUNS = "seg-lz runs"

# Below this a plane is stored raw: coding cannot win back its own bookkeeping.
MIN_CODED = 64

# A codec whose encoding comes out over its estimate by more than this share (a sample that
# misjudged the plane) does not stand untried against the next candidate: that one is coded
# too where its estimate is smaller, and the smaller encoding kept.
MISESTIMATE = 1 / 64


# The codec IDs each minor version of format 1 defines (spec/README.md, "Versioning"). 7 stays
# unassigned: the frozen conformance suite v1 uses it as its unknown codec (codec_7).
# (1.2 added typed names of Python values, no codec.)
CODECS_OF_MINOR = {0: frozenset(range(1, 7)), 1: frozenset((*range(1, 7), codecs.BITPACK_W)),
                   3: frozenset((*range(1, 7), codecs.BITPACK_W, codecs.RANS_SEG))}
CODECS_OF_MINOR[4] = CODECS_OF_MINOR[3]
CODECS_OF_MINOR[5] = CODECS_OF_MINOR[4] | {codecs.SEG_LZ}
# The first minor version with masked tensors (TensorRecord flag 0x02).
MASKED_MINOR = 4


def format_minor(policy: str) -> int:
    """The minor version a file written under ``policy`` declares: 0 for ``auto-1.0``, 1 for
    ``seed`` (whose codecs 1.1 has), 5 for ``auto`` (codecs 9 and 10, masked deltas)."""
    return {"auto-1.0": 0, "seed": 1}.get(policy, MINOR)


def check_policy(policy: str) -> str:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose one of {POLICIES}")
    return policy


def packed_wins(size, estimate):
    """Whether bitpack-w's ``size`` wins against an entropy coder's ``estimate`` (ints or
    numpy arrays): the coder saves at most 1/65 of it (:data:`PACKED_SLACK`)."""
    return PACKED_SLACK[0] * size <= PACKED_SLACK[1] * estimate


def prefer_packed(ranked: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """``ranked`` (sorted by (estimate, codec ID)) with bitpack-w moved to the front when only
    entropy coders rank before it and the best of them is within :data:`PACKED_SLACK`."""
    at = next((i for i, (_e, c) in enumerate(ranked) if c == codecs.BITPACK_W), 0)
    if at == 0 or any(c not in _ENTROPY for _e, c in ranked[:at]):
        return ranked
    if packed_wins(ranked[at][0], ranked[0][0]):
        return [ranked[at], *ranked[:at], *ranked[at + 1:]]
    return ranked


def encode_plane(plane: np.ndarray, kind: int, policy: str = "auto") -> tuple[int, Encoded]:
    """Pick a codec for ``plane`` and code it; returns ``(codec_id, encoded)``."""
    if plane.size < MIN_CODED:
        return codecs.RAW, Encoded(plane)
    return encode_view(PlaneView.of(plane), kind, policy)


def encode_view(view: PlaneView, kind: int, policy: str = "auto") -> tuple[int, Encoded]:
    """:func:`encode_plane` of a plane given as a view of a tensor's words."""
    if view.size < MIN_CODED:
        return codecs.RAW, Encoded(view.bytes())
    available = codecs.available()
    ranked = rank(view, kind, policy, available)
    best: tuple[int, Encoded] | None = None
    for i, (est, cid) in enumerate(ranked):
        enc = available[cid].encode_view(view)
        if enc is None or enc.nbytes >= view.size:
            continue
        if best is None or enc.nbytes < best[1].nbytes:
            best = cid, enc
        if enc.nbytes <= est * (1 + MISESTIMATE) or i + 1 == len(ranked) \
                or best[1].nbytes <= ranked[i + 1][0]:
            break
    return best if best is not None else (codecs.RAW, Encoded(view.bytes()))


def estimate_view(view: PlaneView, kind: int, policy: str = "auto") -> int:
    """What :func:`encode_view` would store for the plane, by the estimate of the codec it
    would try first (the plane's own size where none would store less)."""
    if view.size < MIN_CODED:
        return view.size
    ranked = rank(view, kind, policy, codecs.available())
    return min(ranked[0][0], view.size) if ranked else view.size


def rough_estimate(view: PlaneView, kind: int) -> int | None:
    """What the order-0 coders would store for the plane, judged from its sample's histogram
    (rANS) and its width (the packers) without counting it: a quick figure to compare with,
    not a codec choice. None where :func:`lz_may_pay`: the LZ coders may then store far less
    than the sample says."""
    if lz_may_pay(view, kind):
        return None
    return order0_estimate(view)


def order0_estimate(view: PlaneView, n: int | None = None) -> int:
    """What the order-0 coders (rANS by the plane's histogram or its sample's, bitpack-w by
    its width) would store for the plane, at most its length; or for a plane of ``n`` bytes
    of which ``view`` is a sample."""
    n = view.size if n is None else n
    counts, _m, _runs = view.share()
    rans = codecs.get(codecs.RANS).estimate_counts(counts, n)
    return min(rans, bitpackw.stored_len(n, view.width), n)


def rank(view: PlaneView, kind: int, policy: str, available: dict[int, codecs.Codec]
         ) -> list[tuple[int, int]]:
    """The candidates that would store less than the plane, as ``(estimate, codec ID)`` in the
    order to try them. Kept with the view: a writer that estimates a plane and then codes it
    (a delta against the tensor alone) ranks it once."""
    key = ("rank", kind, policy, frozenset(available))
    ranked = view.memo.get(key)
    if ranked is None:
        ranked = view.memo[key] = _rank(view, kind, policy, available)
    return ranked


def _rank(view: PlaneView, kind: int, policy: str, available: dict[int, codecs.Codec]
          ) -> list[tuple[int, int]]:
    n = view.size
    ranked: list[tuple[int, int]] = []
    zstd_est = None
    best = n  # (the least estimate ranked so far)
    for cid in _TABLES[policy][kind]:
        codec = available.get(cid)
        if codec is None:
            continue
        if policy != "seed" and cid == codecs.GDEFLATE and not (
                zstd_est is not None and zstd_est < _LZ_GATE * best):
            continue
        if policy != "seed" and not codec.counts_estimate and not _lz_tried(view, kind, policy):
            continue
        if cid == codecs.RANS and not view.counted and _sample_rules_out(codec, view, ranked,
                                                                         policy):
            continue
        if cid == codecs.ZSTD and policy == "auto" and _sparse_hopeless(view, kind, ranked):
            continue
        est = codec.estimate_view(view)
        if cid == codecs.ZSTD:
            zstd_est = est
        if est is not None and est < n:
            ranked.append((est, cid))
            best = min(best, est)
    if policy == "auto":
        _add_segments(view, ranked, available, kind)
    ranked.sort()
    if policy == "auto" and sparse(view):
        ranked = prefer_fast(ranked, view.size)
    if policy == "auto":
        ranked = prefer_segments(ranked, view.size)
    return prefer_packed(ranked) if policy == "auto" else ranked


def _add_segments(view: PlaneView, ranked: list[tuple[int, int]],
                  available: dict[int, codecs.Codec], kind: int) -> None:
    """rans-seg's estimate added to ``ranked`` where rANS was estimated on the counted plane
    and segments store less than the best codec but the LZ ones by over
    :data:`SEGMENTS_GAIN` (against those, :func:`prefer_segments` decides); and seg-lz's,
    the same cut with zstd in the segments where it pays, where it stores less still (not
    tried where one zstd frame stores far less: :data:`SEG_LZ_FAR`)."""
    seg = available.get(codecs.RANS_SEG)
    rans = any(c == codecs.RANS for _e, c in ranked)
    if seg is None or not rans or not view.counted or view.units is None:
        return
    est = seg.estimate_view(view)
    fast = min((e for e, c in ranked if c not in (codecs.ZSTD, codecs.GDEFLATE)),
               default=view.size)
    if est is None or est >= fast * (1 - SEGMENTS_GAIN):
        return
    ranked.append((est, codecs.RANS_SEG))
    lz = available.get(codecs.SEG_LZ)
    # (not on a sign plane, as zstd is tried on a whole one only when sparse: on bench/flat.py's
    # flat fp32 tensor its segments won back 0.03% of the tensor's bytes, for a third of the
    # segments tried)
    zstd = min((e for e, c in ranked if c == codecs.ZSTD), default=None)
    if lz is not None and kind != layouts.KIND_SIGN and not (
            zstd is not None and zstd < est * SEG_LZ_FAR):
        # (segments take the plane kind's bar for LZ: an exponent's runs come from its scale)
        view.memo[SEG_LZ_RUNS] = LZ_RUNS_EXPONENT if kind == layouts.KIND_EXPONENT \
            else LZ_RUNS
        lz_est = lz.estimate_view(view)
        if lz_est is not None and lz_est < est:
            ranked.append((lz_est, codecs.SEG_LZ))


def _lz_tried(view: PlaneView, kind: int, policy: str) -> bool:
    """Whether the LZ coders are estimated on the plane: where :func:`lz_may_pay` says so, and
    under ``auto`` on every sparse plane; a sign plane (whose LZ candidate only ``auto`` has)
    only when sparse: a dense one is as random as bits come."""
    if policy == "auto" and sparse(view):
        return True
    return kind != layouts.KIND_SIGN and lz_may_pay(view, kind)


def _sparse_hopeless(view: PlaneView, kind: int, ranked: list[tuple[int, int]]) -> bool:
    """Whether zstd is not worth its trial on an exponent plane that only the sparse rule
    sends it to (:data:`SPARSE_HOPELESS`)."""
    if kind != layouts.KIND_EXPONENT or lz_may_pay(view, kind):
        return False
    r = min((e for e, c in ranked if c == codecs.RANS), default=None)
    return r is not None and r > SPARSE_HOPELESS * view.size


def sparse(view: PlaneView) -> bool:
    """Whether the plane is sparse: of two symbols or more, its most common filling
    :data:`SPARSE` of it. (A plane of one symbol is rANS's CONST form: a few bytes that
    decode at memory speed.)"""
    # (asked up to three times a plane: kept with the view, for its sample or its histogram)
    key = ("sparse", view.counted)
    found = view.memo.get(key)
    if found is None:
        counts, m, _runs = view.share()
        top = int(counts.max()) if m else 0
        found = view.memo[key] = SPARSE * m <= top < m
    return found


def prefer_fast(ranked: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``ranked`` with zstd moved just before rANS where it stores at most
    :data:`SPARSE_SLACK` of the plane's ``n`` bytes more (for a sparse plane)."""
    at = {c: i for i, (_e, c) in enumerate(ranked)}
    z, r = at.get(codecs.ZSTD), at.get(codecs.RANS)
    if z is None or r is None or z < r or ranked[z][0] > ranked[r][0] + n * SPARSE_SLACK:
        return ranked
    return [*ranked[:r], ranked[z], *ranked[r:z], *ranked[z + 1:]]


def prefer_segments(ranked: list[tuple[int, int]], n: int) -> list[tuple[int, int]]:
    """``ranked`` with the better of rans-seg and seg-lz that qualifies moved to the front
    where an LZ coder ranks first and it stores at most :data:`SEGMENTS_SLACK` of the plane's
    ``n`` bytes more (seg-lz: and at most :data:`SEGMENTS_SLACK_LZ` of the LZ estimate): one
    zstd frame (or GDeflate stream) of a large plane codes and decodes on one core, segments
    on all of them, at memory speed where they are raw or packed."""
    if not ranked or ranked[0][1] not in (codecs.ZSTD, codecs.GDEFLATE):
        return ranked
    lz = ranked[0][0]
    s = next((i for i, (e, c) in enumerate(ranked) if c in _SEGMENTED and e <= lz + (
        n * SEGMENTS_SLACK if c == codecs.RANS_SEG
        else min(n * SEGMENTS_SLACK, lz * SEGMENTS_SLACK_LZ))), None)
    if s is None:
        return ranked
    return [ranked[s], *ranked[:s], *ranked[s + 1:]]


def lz_may_pay(view: PlaneView, kind: int, n: int | None = None) -> bool:
    """Whether an LZ coder (zstd, GDeflate) may beat the order-0 coders on this plane, judged
    from its statistics, so that a trial encode is paid only where it can win.

    A float's sign, exponent and mantissa planes are close to independent draws, where LZ
    gains nothing over order-0 coding; it wins where runs or counters show (optimizer state at
    its start, unchanged parts of a delta, tables of bit patterns). Independent draws repeat
    the byte before, or exceed it by one, with probability ``sum(p[s] * (p[s] + p[s - 1]))``;
    a plane doing so more often by :data:`LZ_RUNS` of its length (an exponent plane: by
    :data:`LZ_RUNS_EXPONENT`, a mantissa plane by :data:`LZ_RUNS_MANTISSA`, a mask by
    :data:`LZ_RUNS_MASK`) is tried. Other planes (integers, bytes) and planes up to
    :data:`LZ_ALWAYS` bytes are always tried.
    (``n``: the bytes of the plane of which ``view`` is a sample.)"""
    if kind not in _RUNS_KINDS or (view.size if n is None else n) <= LZ_ALWAYS:
        return True
    # (the excess of runs over chance is the plane's or its sample's, whatever n: kept with
    # the view, as the policy asks it once for each LZ coder)
    key = ("runs over chance", view.counted)
    excess = view.memo.get(key)
    if excess is None:
        counts, m, runs = view.share()
        excess = view.memo[key] = runs - chance_runs(counts, m)
    return excess > _LZ_BAR.get(kind, LZ_RUNS)


_LZ_BAR = {layouts.KIND_EXPONENT: LZ_RUNS_EXPONENT, layouts.KIND_MANTISSA: LZ_RUNS_MANTISSA,
           layouts.KIND_MASK: LZ_RUNS_MASK}


def _sample_rules_out(rans: codecs.Codec, view: PlaneView, ranked: list[tuple[int, int]],
                      policy: str) -> bool:
    """Whether the sample of a plane not counted yet shows that rANS saves less than
    :data:`SAMPLE_MARGIN` of what it must beat (the plane, and the codecs ranked so far,
    bitpack-w by its 1/65): then the plane need not be counted."""
    counts, _m, _runs = view.share()
    bar = min((e * PACKED_SLACK[0] / PACKED_SLACK[1] if c == codecs.BITPACK_W
               and policy == "auto" else e for e, c in ranked), default=view.size)
    return rans.estimate_counts(counts, view.size) > min(bar, view.size) * (1 - SAMPLE_MARGIN)
