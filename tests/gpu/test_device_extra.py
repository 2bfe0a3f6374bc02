"""How many device bytes the GPU decoder holds for a tensor besides its output (host only):
the loader sizes its batches by it, so it must count the staged payloads with their padding,
the decoded planes that wait for the merge, and, for a delta, the parent's tensor."""

from __future__ import annotations

import io

import numpy as np

import s4format
from s4format import codecs, layouts
from s4format.objtree import TensorRef
from s4format.writer import Writer
from s4weights.gpu.decode import device_extra


def _file(arrays: dict, parent=None, parent_id=None) -> bytes:
    buf = io.BytesIO()
    with Writer(buf, parent_id=parent_id) as w:
        for name, a in arrays.items():
            w.add(name, a, parent=None if parent is None else parent[name])
        w.set_tree({k: TensorRef(i) for i, k in enumerate(arrays)})
    return buf.getvalue()


def _want(reader, t) -> int:
    pad = max(16, reader.alignment)
    whole = t.layout.layout_id == layouts.RAW.layout_id
    return sum(p.stored_len + pad for p in t.planes) + sum(
        -(-p.decoded_len // 16) * 16 for p in t.planes
        if p.codec in (codecs.RANS, codecs.GDEFLATE) and not whole)


def test_split_and_raw_layout_tensors() -> None:
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(300_000) * 0.02).astype(np.float32)
    arrays = {"w": w, "u8": rng.geometric(0.3, 50_000).clip(0, 255).astype(np.uint8)}
    r = s4format.Reader(_file(arrays))
    for i, t in enumerate(r.tensors):
        assert device_extra(r, i) == _want(r, t), t.name
    # a split float tensor waits for the merge with its rANS planes decoded
    assert device_extra(r, 0) > sum(p.stored_len for p in r.tensors[0].planes)


def test_a_delta_counts_its_parent() -> None:
    rng = np.random.default_rng(1)
    base = {"w": (rng.standard_normal(200_000) * 0.02).astype(np.float32)}
    nxt = {"w": base["w"] + np.float32(1e-4) * (rng.random(200_000) < 0.01)}
    pblob = _file(base)
    parent = s4format.Reader(pblob)
    child = s4format.Reader(_file(nxt, parent=base, parent_id=parent.checkpoint_id),
                            parent=parent)
    t = child.tensors[0]
    assert t.is_delta
    assert device_extra(child, 0) == _want(child, t) + t.raw_nbytes + device_extra(parent, 0)
