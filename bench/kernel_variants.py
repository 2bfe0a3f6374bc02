"""The kernels' compile-time tuning (kernels/planes.cu: SPLIT_G, SPLIT_PERM, MERGE_G,
MERGE_CONSTW, MERGE_PERM) and the choice of rANS decode kernel
(``runtime.RANS_AHEAD_WARPS_PER_SM``), measured side by side on the GPU machine
(``python3 bench/kernel_variants.py``).

For each variant: the device time per call of every kernel (CUPTI, median of ``S4_BENCH_REPS``
warm calls) of a device-to-device encode and decode of 1 GiB, 256 MiB and 128 MiB of
N(0, 0.02) bf16 (8,192, 2,048 and 1,024 exponent blocks) and of 512 MiB of N(0, 0.02) fp32
(4,096 blocks), each alone in its group; the file the encoder writes (it must be the default
build's, byte for byte) and the decoded tensors (they must equal the input). A variant
rebuilds one module with its options (every other module is the default build's) or changes
the decode kernel's choice."""

from __future__ import annotations

import functools
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu

import s4format
from s4weights.gpu import decode, runtime
from s4weights.gpu.encode import Encoder, file_of

REPS = int(os.environ.get("S4_BENCH_REPS", "5"))
# (name, module to rebuild, its build options, RANS_AHEAD_WARPS_PER_SM or None)
VARIANTS = [("default", "", (), None), ("MERGE_PERM=0", "planes", ("-DMERGE_PERM=0",), None),
            ("rans_decode only", "", (), 0), ("rans_decode_ahead only", "", (), 1 << 30)]
CASES = {"bf16": ("bf16", 1 << 29), "bf16 256M": ("bf16", 1 << 27), "bf16 128M": ("bf16", 1 << 26),
         "fp32": ("fp32", 1 << 27)}
KERNELS = ("split_hist bf16", "rans_encode bf16", "merge bf16", "rans_decode bf16",
           "rans_decode bf16 256M", "rans_decode bf16 128M", "split_hist fp32", "merge fp32",
           "rans_decode fp32")
_DEFAULT = runtime._function


@functools.cache
def _build(module: str, opts: tuple[str, ...]):
    import cupy as cp
    return cp.RawModule(code=runtime.kernel_source(module),
                        options=("-std=c++17", f"-I{runtime.KERNELS}", *opts))


def use(variant: str, opts: tuple[str, ...]) -> None:
    """Launch ``variant``'s kernels from the build with ``opts``, the others' from the
    default build."""
    def function(module: str, name: str, device: int):
        if module == variant:
            return _build(module, opts).get_function(name)
        return _DEFAULT(module, name, device)
    runtime._function = function


def kernel_times(fn) -> dict[str, float]:
    """Median device ms per call of each kernel over REPS warm profiled calls."""
    from torch.profiler import ProfilerActivity, profile
    fn()
    runs: list[dict[str, float]] = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        per: dict[str, float] = {}
        for e in prof.events():
            if getattr(e, "device_type", None) is not None and "CUDA" in str(e.device_type):
                per[e.name] = per.get(e.name, 0.0) + e.device_time_total / 1e3
        runs.append(per)
    names = set().union(*runs)
    return {k: statistics.median(r.get(k, 0.0) for r in runs) for k in names}


def decode_times(blob: bytes, x: torch.Tensor) -> tuple[dict[str, float], bool]:
    """``kernel_times`` of a device-to-device decode of ``blob``'s tensor 0, and whether the
    decoded bytes (over a poisoned destination) equal ``x``'s."""
    st = decode.stage(s4format.Reader(blob), [0])
    out = [torch.full((x.numel() * x.element_size(),), 0xAB, dtype=torch.uint8, device="cuda")]
    t = kernel_times(functools.partial(decode.decode_staged, st, out))
    return t, torch.equal(out[0], x.reshape(-1).view(torch.uint8))


def main() -> None:
    torch.cuda.init()
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    cases = {case: {"w": (torch.randn(n, device="cuda") * 0.02).to(getattr(torch, (
        "bfloat16" if dt == "bf16" else "float32")))} for case, (dt, n) in CASES.items()}
    want: dict[str, bytes] = {}
    rows = []
    ahead = runtime.RANS_AHEAD_WARPS_PER_SM
    for name, module, opts, warps in VARIANTS:
        use(module, opts)
        runtime.RANS_AHEAD_WARPS_PER_SM = ahead if warps is None else warps
        row = {"variant": name, "same_file": True, "exact": True}
        for case, tensors in cases.items():
            dt = CASES[case][0]
            enc = Encoder("auto")
            blob = file_of(enc, tensors)
            row["same_file"] &= want.setdefault(case, blob) == blob
            t = kernel_times(functools.partial(enc.encode_device, gpu.s4_items(tensors)))
            row[f"split_hist {case}"] = t.get(f"split_hist_{dt}", float("nan"))
            row[f"rans_encode {case}"] = t.get("rans_encode", float("nan"))
            row[f"encode busy {case}"] = sum(t.values())
            t, exact = decode_times(blob, tensors["w"])
            row["exact"] &= exact
            row[f"merge {case}"] = t.get(f"merge_{dt}", float("nan"))
            row[f"rans_decode {case}"] = (t.get("rans_decode", 0.0)
                                          + t.get("rans_decode_ahead", 0.0))
            row[f"decode busy {case}"] = sum(t.values())
        rows.append(row)
        print(row, flush=True)
    runtime.RANS_AHEAD_WARPS_PER_SM = ahead
    runtime._function = _DEFAULT
    cols = [*KERNELS, "encode busy bf16", "decode busy bf16", "encode busy fp32",
            "decode busy fp32"]
    print(f"\n{'variant':24}" + "".join(f"{c:>22}" for c in cols) + "  same file  exact")
    for r in rows:
        print(f"{r['variant']:24}" + "".join(f"{r[c]:22.3f}" for c in cols)
              + f"  {r['same_file']!s:9}  {r['exact']}")


if __name__ == "__main__":
    main()
