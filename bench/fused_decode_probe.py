"""A measurement for the (a) decision (run on the GPU machine: ``python3
bench/fused_decode_probe.py [fused_bf16 | fused_bf16_ws]``): how fast one fused kernel
(bench/fused_decode_probe.cu: one warp per block doing it all, or decode warps handing rows to
merge warps) decodes bench/gpu.py's (a) tensor, 1 GiB of N(0, 0.02) bf16, where the codec runs
``rans_decode`` and then ``merge_bf16`` (with the content hash). The probe takes the same
staged file's rANS block tables and planes (caught from one ``decode_staged`` call), writes
the tensor's bytes and its 64 KiB leaf digests, and must match the tensor and the digests
``leaf_digests`` makes of it.
Device ms per call by CUPTI, as ``bench/kernel_variants.py``. Not part of the codec: it knows
only this case (full blocks, packed signs, 7-bit mantissas) and checks no plane's form."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
import kernel_variants as kv

import s4format
from s4weights.gpu import decode, runtime
from s4weights.gpu.encode import Encoder, file_of

SOURCE = Path(__file__).with_suffix(".cu")


def _view(ptr: int, n: int, dtype):
    import cupy as cp
    itemsize = np.dtype(dtype).itemsize
    mem = cp.cuda.UnownedMemory(int(ptr), n * itemsize, None)
    return cp.ndarray((n,), dtype, cp.cuda.MemoryPointer(mem, 0))


def main() -> None:
    import cupy as cp
    torch.cuda.init()
    x = (torch.randn(1 << 29, device="cuda", generator=torch.Generator(device="cuda")
                     .manual_seed(0)) * 0.02).to(torch.bfloat16)
    blob = file_of(Encoder("auto"), {"w": x})
    st = decode.stage(s4format.Reader(blob), [0])
    out = torch.empty(x.numel() * 2, dtype=torch.uint8, device="cuda")
    seen: dict[str, object] = {}
    real = runtime.launch

    def catch(module, name, grid, block, *args):
        # the launch's tables live only as long as the call: copied here, in stream order
        real(module, name, grid, block, *args)
        a = [int(v) for v in args]
        if name.startswith("rans_decode"):
            torch.cuda.synchronize()
            cf, cw = _view(a[0], grid, np.uint32).copy(), _view(a[1], grid, np.uint8).copy()
            n = int(cf[-1]) + int(cw[-1])
            seen["rans"] = (name, grid, n, cf, cw, _view(a[2], n, np.uint8).get(),
                            _view(a[4], n, np.uint64).copy(), _view(a[5], n, np.uint32).copy(),
                            _view(a[6], n, np.uint64).copy(), _view(a[7], n, np.uint64).get(),
                            _view(a[9], n, np.uint32).get())
            seen["cum"] = _view(int(seen["rans"][9][0]), 256, np.uint32).copy()
        elif name == "merge_bf16":
            torch.cuda.synchronize()
            seen["merge"] = (_view(a[4], 5, np.uint64).get(), _view(a[5], 5, np.uint8).get())
    runtime.launch = catch
    decode.decode_staged(st, [out])
    runtime.launch = real
    torch.cuda.synchronize()
    assert torch.equal(out, x.reshape(-1).view(torch.uint8)), "the codec's decode"
    dname, grid, nb, cf, cw, mode, words, count, states, dtab, lens = seen["rans"]
    cum = seen["cum"]
    print(f"{dname}: {grid} CTAs, {nb} blocks", flush=True)
    assert nb == 1 << 13 and not mode.any() and (lens == 1 << 16).all(), \
        "one plane of 8,192 full RANS blocks"
    assert (dtab == dtab[0]).all(), "one decoder table"
    planes, width = seen["merge"]
    assert width[0] == 1 and width[2] == 7, f"packed signs, 7-bit mantissas: {width}"
    sign = _view(int(planes[0]), (1 << 29) // 32, np.uint32) if planes[0] % 4 == 0 else None
    mant = _view(int(planes[2]), (1 << 29) * 7 // 32, np.uint32) if planes[2] % 4 == 0 else None
    if sign is None or mant is None:  # (aligned copies, outside the timing)
        sign = cp.asarray(_view(int(planes[0]), (1 << 29) // 8, np.uint8)).copy().view(np.uint32)
        mant = cp.asarray(_view(int(planes[2]), (1 << 29) * 7 // 8, np.uint8)).copy() \
            .view(np.uint32)
    # the reference digests: leaf_digests over the tensor itself
    b = runtime.Batch()
    want, _first, keep = runtime._leaf_launch([x.data_ptr()], [x.numel() * 2], b, gap=False)
    keep.append(b.run())
    torch.cuda.synchronize()
    want = want[: 1 << 14].cpu().numpy()
    ref, ok = kv.decode_times(blob, x)
    print(f"codec: {dname} {ref.get(dname, 0.0):.3f} ms + merge_bf16 "
          f"{ref.get('merge_bf16', 0.0):.3f} ms = "
          f"{ref.get(dname, 0.0) + ref.get('merge_bf16', 0.0):.3f} ms; decode busy "
          f"{sum(ref.values()):.3f} ms; exact {ok}", flush=True)
    # (kernel, CTAs per SM for __launch_bounds__, PROBE_PIPE)
    only = sys.argv[1:]
    for name, minb, pipe in (("fused_bf16", 1, 0), ("fused_bf16", 8, 0), ("fused_bf16", 1, 1),
                             ("fused_bf16", 4, 1), ("fused_bf16_ws", 1, 0),
                             ("fused_bf16_ws", 6, 0), ("fused_bf16_ws", 8, 0)):
        if only and name not in only:
            continue
        mod = cp.RawModule(code=runtime.kernel_source("", source=SOURCE), options=(
            "-std=c++17", f"-I{runtime.KERNELS}", f"-DPROBE_MINB={minb}",
            f"-DPROBE_PIPE={pipe}"))
        fn = mod.get_function(name)
        got = torch.full_like(out, 0xAB)
        bsum = cp.empty(nb * 1024, np.uint64)
        dig = cp.zeros(2 * nb, np.uint64)
        err = cp.zeros(nb, np.int32)
        rest = (words, count, states, cum, mant, sign, np.uint64(got.data_ptr()), bsum, dig, err)
        if name == "fused_bf16":
            launch = ((grid,), (256,), (cf, cw, *rest))
        else:  # 4 blocks a CTA, block b = 4 CTA + w
            launch = ((nb // 4,), (256,), rest)

        def call(fn=fn, launch=launch):
            fn(*launch, stream=runtime.stream())
        t = kv.kernel_times(call)
        torch.cuda.synchronize()
        exact = torch.equal(got, x.reshape(-1).view(torch.uint8))
        same = np.array_equal(dig.get().view(np.int64), want)
        regs = getattr(fn, "num_regs", "?")
        print(f"{name} (min {minb} CTAs per SM, pipelined {pipe}, {regs} registers): "
              f"{statistics.fsum(t.values()):.3f} ms; exact {exact}, digests {same}, "
              f"errors {int((err != 0).sum())}", flush=True)

if __name__ == "__main__":
    main()
