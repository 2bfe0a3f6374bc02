"""Codec-9 (``rans-seg``) planes on the GPU decoder: each plane's segment table is read and
checked on the host, and its segments are decoded into the plane's bytes by the kernels that
decode whole planes: rANS segments as streams of the group's rANS batch, raw segments (and
RAW-mode rANS streams) as copies, bitpack and bitpack-w segments unpacked to a byte each by
``pack_ops``. The merge then reads the plane as bytes.

Nothing is queued for a plane whose table or segment forms fail: the group raises that
failure (``failures.form_failure``) before any copy or unpack runs, in the words of the CPU
decoder (``s4format.codecs.ransseg``).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from s4format import codecs
from s4format.codecs import ransseg
from s4format.errors import CodecError
from s4weights.gpu import ransparse


@dataclass
class Segments:
    """The segments of a staged group's codec-9 planes, a row each, in plane order. ``q``:
    the plane's position in the group; ``lo``: the segment's first byte in the plane;
    ``at``: its stored bytes' offset in the staged buffer; ``bad``: plane position -> the
    failure of a plane whose parameters, table or segment forms are wrong (it has no rows)."""
    q: np.ndarray
    index: np.ndarray
    count: np.ndarray
    codec: np.ndarray
    width: np.ndarray
    lo: np.ndarray
    at: np.ndarray
    stored: np.ndarray
    n: np.ndarray
    raw: np.ndarray  # rANS segments in RAW mode (copied after their header, not decoded)
    bad: dict[int, str] = field(default_factory=dict)

    def label(self, row: int) -> str:
        """Segment ``row`` as the CPU decoder names it in a failure's message."""
        return ransseg.segment_name(int(self.index[row]), int(self.count[row]),
                                    codecs.get(int(self.codec[row])).name)

    def rows(self, codec: int) -> np.ndarray:
        return np.flatnonzero(self.codec == codec)


def of(st) -> Segments:
    """The codec-9 planes of staged group ``st`` (memoised on it: its host bytes are fixed)."""
    got = st.__dict__.get("_segments")
    if got is None:
        got = st.__dict__["_segments"] = _read(st)
    return got


def _read(st) -> Segments:
    _k, _j, plane_codec, plane_n, stored, nparams = st.meta.T
    cols: list[list[int]] = [[] for _ in range(9)]
    bad: dict[int, str] = {}
    for q in np.flatnonzero(plane_codec == codecs.RANS_SEG).tolist():
        a = int(st.at[q])
        buf = st.host[a:a + int(stored[q])]
        if nparams[q]:
            bad[q] = ransseg.params_error(int(nparams[q]))
            continue
        try:
            table = ransseg.read_table(buf, int(plane_n[q]))
        except CodecError as exc:
            bad[q] = str(exc)
            continue
        msg = ransseg.form_failure(buf, table)
        if msg is not None:
            bad[q] = msg
            continue
        for i, (sn, sat, slo, c, sp, size) in enumerate(table):
            for col, v in zip(cols, (q, i, len(table), c.codec_id, sp[0] if sp else 0, slo,
                                     a + sat, size, sn)):
                col.append(v)
    q, index, count, codec, width, lo, at, size, n = (np.asarray(c, np.int64) for c in cols)
    raw = (codec == codecs.RANS) & ransparse.raw_mode(st.host, at, size)
    return Segments(q, index, count, codec, width, lo, at, size, n, raw, bad)
