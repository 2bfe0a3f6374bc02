"""The split and merge kernels' compile-time tuning (kernels/planes.cu: SPLIT_G, SPLIT_PERM,
MERGE_G, MERGE_CONSTW), measured side by side on the GPU machine
(``python3 bench/kernel_variants.py``).

For each variant: the device time per call of every kernel (CUPTI, median of ``S4_BENCH_REPS``
warm calls) of a device-to-device encode and decode of (a) 1 GiB of N(0, 0.02) bf16 and of
512 MiB of N(0, 0.02) fp32, each alone in its group; the file the encoder writes (it must be
the default build's, byte for byte) and the decoded tensors (they must equal the input). The
variants change only the planes module; every other kernel is the default build's."""

from __future__ import annotations

import functools
import io
import os
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
import gpu

import s4format
from s4format import objtree
from s4format.writer import Writer
from s4weights.gpu import decode, runtime
from s4weights.gpu.encode import Encoder

REPS = int(os.environ.get("S4_BENCH_REPS", "5"))
VARIANTS = [(), ("-DSPLIT_PERM=0",), ("-DMERGE_CONSTW=0",)]
KERNELS = ("split_hist_bf16", "merge_bf16", "split_hist_fp32", "merge_fp32")
_DEFAULT = runtime._function


@functools.cache
def _planes(opts: tuple[str, ...]):
    import cupy as cp
    return cp.RawModule(code=runtime.kernel_source("planes"),
                        options=("-std=c++17", f"-I{runtime.KERNELS}", *opts))


def use(opts: tuple[str, ...]) -> None:
    """Launch the planes module's kernels from the build with ``opts``."""
    def function(module: str, name: str, device: int):
        if module == "planes":
            return _planes(opts).get_function(name)
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


def file_of(enc: Encoder, tensors: dict[str, torch.Tensor]) -> bytes:
    items = gpu.s4_items(tensors)
    buf = io.BytesIO()
    with Writer(buf) as w:
        for (name, t), it, c in zip(tensors.items(), items, enc.code(items)):
            w.add_coded(name, it.dtype, tuple(t.shape), c.coded, c.content_hash)
        w.set_tree({k: objtree.TensorRef(i) for i, k in enumerate(tensors)})
    return buf.getvalue()


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
    cases = {"bf16": {"w": (torch.randn(1 << 29, device="cuda") * 0.02).to(torch.bfloat16)},
             "fp32": {"w": torch.randn(1 << 27, device="cuda") * 0.02}}
    want: dict[str, bytes] = {}
    rows = []
    for opts in VARIANTS:
        use(opts)
        row = {"variant": " ".join(opts) or "default", "same_file": True, "exact": True}
        for case, tensors in cases.items():
            enc = Encoder("auto")
            blob = file_of(enc, tensors)
            row["same_file"] &= want.setdefault(case, blob) == blob
            t = kernel_times(functools.partial(enc.encode_device, gpu.s4_items(tensors)))
            row[f"split_hist_{case}"] = t.get(f"split_hist_{case}", float("nan"))
            row[f"encode busy {case}"] = sum(t.values())
            t, exact = decode_times(blob, tensors["w"])
            row["exact"] &= exact
            row[f"merge_{case}"] = t.get(f"merge_{case}", float("nan"))
            row[f"decode busy {case}"] = sum(t.values())
        rows.append(row)
        print(row, flush=True)
    runtime._function = _DEFAULT
    cols = [*KERNELS, "encode busy bf16", "decode busy bf16", "encode busy fp32",
            "decode busy fp32"]
    print(f"\n{'variant':34}" + "".join(f"{c:>18}" for c in cols) + "  same file  exact")
    for r in rows:
        print(f"{r['variant']:34}" + "".join(f"{r[c]:18.3f}" for c in cols)
              + f"  {r['same_file']!s:9}  {r['exact']}")


if __name__ == "__main__":
    main()
