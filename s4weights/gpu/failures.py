"""How the GPU load reports a failure: the error is marked with the tensor it is about, and the
one raised is the one the CPU reader would meet first, reading tensors and planes in order.

The GPU path finds some failures before it decodes (checksums, stored forms, stream headers)
and others after (a corrupt bitstream, a content hash), so where the order can differ, the
tensor is read again with the CPU reader, on the error path only.
"""

from __future__ import annotations

import numpy as np

from s4format import codecs
from s4format.codecs import bitpackw
from s4format.errors import S4Error
from s4format.reader import Reader
from s4weights.gpu import segdecode
from s4weights.gpu.staging import Staged


def about(exc: S4Error, reader: Reader, i: int) -> S4Error:
    """``exc``, marked as the failure of ``reader``'s tensor i."""
    exc.s4_tensor = (reader, i)
    return exc


def plane_named(reader: Reader, i: int, exc: Exception) -> int | None:
    """Which plane of ``reader``'s tensor i an error message is about (its index; -1: the
    tensor, no plane), or None when the message is not about that tensor."""
    t = reader.tensors[i]
    head = f"{reader.name}: tensor {t.name!r}"
    msg = str(exc)
    if not msg.startswith(head):
        return None
    rest = msg[len(head):]
    for j, p in enumerate(t.planes):
        label = f" plane {p.label}"
        if rest.startswith(label) and rest[len(label):len(label) + 1] in (":", " "):
            return j
    return -1 if rest[:1] in (":", " ") else None


def raise_as_cpu(reader: Reader, i: int, exc: S4Error) -> None:
    """On a failure ``exc`` about tensor i, read it with the CPU reader (only on this error
    path) and raise its failure: ``exc`` itself when both name the same plane, else the CPU
    reader's (the GPU paths find some failures before decoding and others after, so the
    first plane to fail can differ), and the CPU reader's too where ``exc`` names no plane.
    Returns if the CPU reader reads the tensor."""
    try:
        reader.read_raw(i)
    except S4Error as first:
        ours = plane_named(reader, i, exc)
        # (within a codec-9 plane the GPU path checks segment forms before it decodes rANS
        # segments, so another segment may fail first for the CPU reader: its words then)
        if ours is not None and ours >= 0 and plane_named(reader, i, first) == ours and (
                reader.tensors[i].planes[ours].codec != codecs.RANS_SEG
                or str(first) == str(exc)):
            raise exc from None
        # (a failure the GPU path names by tensor only, such as a merge that found values
        # wider than a field, takes the CPU reader's words, which name what it found)
        raise about(first, reader, i) from None


def plane_form_error(p, payload: np.ndarray, j: int) -> str | None:
    """What is wrong with the stored form of plane j (its record ``p``, its bytes ``payload``)
    for a raw, bitpack or rANS plane, as far as it shows without decoding; None if nothing."""
    n = p.decoded_len
    if p.codec == codecs.RAW and (p.params or p.stored_len != n):
        return f"raw plane with parameters, or storing {p.stored_len} bytes for {n}"
    if p.codec == codecs.BITPACK:
        if p.params or len(payload) != (n + 7) // 8 or (n % 8 and int(payload[-1]) >> (n % 8)):
            return "bitpack payload is malformed"
        if j != 0:
            return "bitpack on a plane other than the sign plane"
    if p.codec == codecs.RANS and p.params:
        return "rans takes no parameters"
    if p.codec == codecs.BITPACK_W:
        return bitpackw.form_error(n, p.params, len(payload),
                                   int(payload[-1]) if len(payload) else 0)
    return None


def form_failure(st: Staged, whole: np.ndarray) -> tuple[int, str, np.ndarray]:
    """The stored forms of the group's planes (``whole``: of a raw-layout tensor), as
    plane_form_error checks them one by one: (the first plane in a bad form, or the number of
    planes; its first failing check's message; each bitpack-w plane's width, else 0). The CPU
    reader meets the planes in order, so the first failing plane (and its first failing check)
    is the one reported."""
    nq = len(st.planes)
    _k, j, codec, n, stored, nparams = st.meta.T
    at = np.asarray(st.at, np.int64)
    raw, bp = codec == codecs.RAW, codec == codecs.BITPACK
    rn, gd = codec == codecs.RANS, codec == codecs.GDEFLATE
    last = st.host[np.clip(at + stored - 1, 0, max(st.host.size - 1, 0))] if st.host.size \
        else np.zeros(nq, np.uint8)
    tail = np.where(n % 8 > 0, last.astype(np.int64) >> (n % 8), 0)
    bad_bp = bp & ((nparams > 0) | (stored != (n + 7) // 8) | (tail != 0))
    errors = [(raw & ((nparams > 0) | (stored != n)), lambda q: "raw plane with parameters, "
               f"or storing {int(stored[q])} bytes for {int(n[q])}"),
              (bad_bp, lambda q: "bitpack payload is malformed"),
              (bp & ~bad_bp & (j != 0), lambda q: "bitpack on a plane other than the sign plane"),
              (rn & (nparams > 0), lambda q: "rans takes no parameters"),
              (gd & ~whole & (nparams > 1), lambda q: "gdeflate parameters are at most 1 byte")]
    # bitpack-w planes (codec 8): their width, and their form as the codec checks it
    width = np.zeros(nq, np.int64)
    bw_msg: dict[int, str] = {}
    for q in np.flatnonzero(codec == codecs.BITPACK_W).tolist():
        prm = st.planes[q][2].params
        msg = bitpackw.form_error(int(n[q]), prm, int(stored[q]), int(last[q]))
        if msg is None:
            width[q] = prm[0]
        else:
            bw_msg[q] = msg
    bad_bw = np.zeros(nq, bool)
    bad_bw[list(bw_msg)] = True
    errors.append((bad_bw, lambda q: bw_msg[q]))
    seg_msg = segdecode.of(st).bad  # codec-9 planes: parameters, segment table, segment forms
    bad_seg = np.zeros(nq, bool)
    bad_seg[list(seg_msg)] = True
    errors.append((bad_seg, lambda q: seg_msg[q]))
    first_bad = min((int(np.argmax(m)) for m, _ in errors if m.any()), default=nq)
    if first_bad == nq:
        return nq, "", width
    return first_bad, next(m(first_bad) for bad, m in errors if bad[first_bad]), width
