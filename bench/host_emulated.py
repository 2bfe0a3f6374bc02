"""The GPU encoder's host time on (b)'s shapes, on any machine (no GPU): ``python
bench/host_emulated.py [--profile]``. The CUDA path runs on the emulation of tests/gpu/emulated.py
with its kernels replaced by fast stand-ins (histograms scaled from templates of N(0, 0.02)
fp32 bytes; each rANS block codes 30% of its bytes; copies, hashes and splits do nothing), and
the stand-ins' own time is left out: what remains is the host's work per
``Encoder.encode_device`` call, the part of (b)'s encode that bench/gpu.py finds host-bound.
Tensors are empty CPU buffers of the shapes of bench/gpu.py's transformer (bf16 weights, fp32
master weights, AdamW's two moments: 588 tensors, 1.75 GiB), coded with its 1 GiB workspace.
Informative: a lent H200's host ran the same work 1.5-3x slower than the dev machine."""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parents[1]))

from s4weights.gpu import encode, runtime
from s4weights.gpu.plan import TABLE_STRIDE
from tests.gpu import emulated
from tests.gpu.emulated import at

STAND_IN = [0.0]  # seconds spent in the kernels' stand-ins, left out of the host time
_TEMPLATE: dict[str, np.ndarray] = {}
_SCALED: dict[tuple[str, int], np.ndarray] = {}
_NORMALISED: dict[tuple, tuple[np.ndarray, ...]] = {}
_FIELDS = {"bf16": ("exp", "m0"), "fp16": ("exp", "m0", "m1"),
           "fp32": ("exp", "m0", "m1", "m2")}


def _templates() -> None:
    x = (np.random.default_rng(0).standard_normal(1 << 20) * 0.02).astype(np.float32)
    u = x.view(np.uint32)
    for name, shift, mask in (("exp", 23, 0xFF), ("m0", 16, 0x7F), ("m1", 8, 0xFF),
                              ("m2", 0, 0xFF)):
        _TEMPLATE[name] = np.bincount((u >> shift) & mask, minlength=256)


def _scaled(name: str, n: int) -> np.ndarray:
    """Template ``name``'s histogram scaled to ``n`` symbols."""
    if (name, n) not in _SCALED:
        t = _TEMPLATE[name]
        h = (t * (n / t.sum())).astype(np.int64)
        h[np.argmax(h)] += n - h.sum()
        _SCALED[name, n] = h.astype(np.uint64)
    return _SCALED[name, n]


def stand_in(module: str, name: str, grid: int, block: int, *a) -> None:
    t0 = time.perf_counter()
    if grid <= 0:
        pass
    elif name in emulated.LAYOUT and emulated.LAYOUT[name][2]:  # histograms (+ split)
        nseg = int(at(a[0], np.int32, grid).max()) + 1
        n = at(a[3], np.int64, nseg)
        fields = _FIELDS[name.rsplit("_", 1)[1]]
        for r in range(nseg):
            h = at(int(a[6]) + 8192 * r, np.uint64, 1024)
            for k, f in enumerate(fields):
                h[256 * k:256 * (k + 1)] += _scaled(f, int(n[r]))
            at(int(a[7]) + 8 * r, np.uint64, 1)[0] += int(n[r]) // 2
    elif name == "rans_normalise":  # the emulation's, once per distinct histogram
        hist, ones = at(a[0], np.uint64, grid), at(a[1], np.uint64, grid)
        n = at(a[2], np.int64, grid)
        fc = at(a[4], np.uint32, 512 * grid).reshape(grid, 512)
        stats = at(a[5], np.uint64, 4 * grid).reshape(grid, 4)
        tb = at(a[6], np.uint8, TABLE_STRIDE * grid).reshape(grid, TABLE_STRIDE)
        bound = at(a[9], np.uint64, grid)
        for q in range(grid):
            key = (at(hist[q], np.uint64, 256).tobytes() if hist[q]
                   else int(at(ones[q], np.uint64, 1)[0]), int(n[q]))
            if key not in _NORMALISED:
                h1, o1 = np.array([hist[q]], np.uint64), np.array([ones[q]], np.uint64)
                n1 = np.array([n[q]], np.int64)
                f1, s1 = np.zeros(512, np.uint32), np.zeros(4, np.uint64)
                t1, b1 = np.zeros(TABLE_STRIDE, np.uint8), np.zeros(1, np.uint64)
                emulated.launch(module, name, 1, block, h1.ctypes.data, o1.ctypes.data,
                                n1.ctypes.data, a[3], f1.ctypes.data, s1.ctypes.data,
                                t1.ctypes.data, a[7], a[8], b1.ctypes.data)
                _NORMALISED[key] = (f1, s1, t1, b1[0])
            fc[q], stats[q], tb[q], bound[q] = _NORMALISED[key]
    elif name == "rans_jobs":
        emulated.launch(module, name, grid, block, *a)
    elif name == "rans_encode":  # every block codes 30% of its bytes, in 16-bit words (the
        # sizes only: nothing is written)
        cplane = at(a[0], np.uint32, grid)
        nq = int(cplane.max()) + 1
        n, pfirst = at(a[4], np.int64, nq), at(a[7], np.int64, nq)
        lg = int(a[9])
        nb = int(pfirst[-1] + -(-int(n[-1]) >> lg))
        at(a[10], np.uint32, nb)[:] = (1 << lg) * 3 // 10
        at(a[12], np.uint8, nb)[:] = 0
        at(a[13], np.uint8, nb)[:] = 1
        at(a[17], np.uint64, nb)[:] = 0  # (rans_place's stand-in moves nothing)
    STAND_IN[0] += time.perf_counter() - t0


class _Patch:
    def setattr(self, obj, name, value) -> None:
        setattr(obj, name, value)


def state_items() -> list[encode.Item]:
    d, layers, vocab = 768, 12, 32000  # bench/gpu.py's transformer, on the meta device
    layer = torch.nn.TransformerEncoderLayer(d, 12, 4 * d, batch_first=True, norm_first=True,
                                             device="meta")
    model = torch.nn.ModuleDict({
        "emb": torch.nn.Embedding(vocab, d, device="meta"),
        "body": torch.nn.TransformerEncoder(layer, layers, enable_nested_tensor=False),
        "head": torch.nn.Linear(d, vocab, device="meta")})
    shapes = [tuple(v.shape) for v in model.state_dict().values()]
    want = ([(s, torch.bfloat16) for s in shapes] + [(s, torch.float32) for s in shapes]
            + [(s, torch.float32) for s in shapes for _ in range(2)])
    return [encode.Item.of(torch.empty(s, dtype=dt)) for s, dt in want if int(np.prod(s)) > 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--workspace", type=int, default=1 << 30)
    ap.add_argument("--profile", action="store_true", help="also a cProfile of one call")
    ap.add_argument("--large", type=float, default=0, help="instead: one bf16 tensor of this "
                    "many MB through Encoder.code (chunked when over the workspace)")
    args = ap.parse_args()
    _templates()
    emulated.emulate(_Patch())
    runtime.launch = stand_in
    enc = encode.Encoder("auto", workspace=args.workspace)
    if args.large:
        return _large(enc, int(args.large * 1e6) // 2, args)
    items = state_items()
    groups = enc.encode_device(items)
    raw = sum(it.nbytes for it in items)
    print(f"{len(items)} tensors, {raw / 2**30:.2f} GiB, workspace {args.workspace}: "
          f"{len(groups)} groups, {sum(len(g.planes) for g in groups)} planes")
    del groups
    times = []
    for _ in range(args.reps):
        STAND_IN[0] = 0.0
        t0 = time.perf_counter()
        g = enc.encode_device(items)
        times.append(time.perf_counter() - t0 - STAND_IN[0])
        del g
    print(f"host time per encode_device call: median {1e3 * statistics.median(times):.2f} ms, "
          f"min {1e3 * min(times):.2f} ms (the kernels' stand-ins left out)")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        enc.encode_device(items)
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


def _large(enc: encode.Encoder, n: int, args) -> None:
    """Host time of ``Encoder.code`` on one bf16 tensor of ``n`` elements."""
    items = [encode.Item.of(torch.zeros(n, dtype=torch.bfloat16))]
    times = []
    for _ in range(args.reps):
        STAND_IN[0] = 0.0
        t0 = time.perf_counter()
        list(enc.code(items))
        times.append(time.perf_counter() - t0 - STAND_IN[0])
    print(f"one bf16 tensor of {2 * n / 1e6:.1f} MB, workspace {args.workspace}: host time per "
          f"Encoder.code call: median {1e3 * statistics.median(times):.2f} ms, min "
          f"{1e3 * min(times):.2f} ms (the kernels' stand-ins left out)")
    if args.profile:
        pr = cProfile.Profile()
        pr.enable()
        list(enc.code(items))
        pr.disable()
        pstats.Stats(pr).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
