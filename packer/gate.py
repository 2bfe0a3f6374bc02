"""The image build's GPU gate: ``python3 packer/gate.py [--report FILE] [--break-plane-merge]``.

Exit 0 only when a CUDA GPU is usable, ``python -m s4format conformance --device cuda`` passes
(run in this process, on the repository's vectors) and GPU save -> load round trips are
bit-exact for the adversarial sets: all 65,536 bf16 and fp16 bit patterns, fp32 specials and
random fp32 words, and a small trained model with its AdamW state (one file, and a base -> delta
checkpoint chain), loaded back on the GPU and on the CPU. Exit 3 without a GPU, 1 on any
mismatch or error.

``--break-plane-merge`` is a test switch, never used by the build: after every GPU plane merge it
flips the lowest bit of the first byte the merge wrote, so the gate can be shown to fail. The
merge hashes the full leaves it writes before the flip, so in a large tensor the error passes
every check of the decoder: only the gate's own byte comparison sees it.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parent.parent
SUITES = [REPO / "conformance" / v for v in ("v1", "v1.1", "v1.2", "v1.3", "v1.4", "v1.5")]
EXIT_FAIL, EXIT_NO_GPU = 1, 3
FLIP_SOURCE = r"""
extern "C" __global__ void gate_flip_first_bit(const int* chunk_seg, const long long* chunk_start,
                                               const unsigned long long* dst,
                                               const long long* nelem) {
    const int seg = chunk_seg[blockIdx.x];
    if (threadIdx.x == 0 && chunk_start[blockIdx.x] == 0 && nelem[seg] > 0)
        ((unsigned char*)dst[seg])[0] ^= 1;
}
"""


def gpu_problem() -> str | None:
    """Why the GPU path cannot run here, or None."""
    try:
        import torch
    except ImportError as exc:
        return f"cannot import torch ({exc})"
    if not torch.cuda.is_available():
        return "torch sees no CUDA device"
    try:
        import s4weights.gpu as gpu
    except ImportError as exc:
        return f"cannot import s4weights' GPU path ({exc})"
    if not gpu.available():
        return "s4weights.gpu.available() is False (CuPy missing?)"
    return None


def break_plane_merge() -> None:
    """Make every GPU plane merge wrong by one bit (the test switch)."""
    import cupy as cp

    from s4weights.gpu import runtime

    flip = cp.RawModule(code=FLIP_SOURCE).get_function("gate_flip_first_bit")
    launch = runtime.launch

    def broken(module: str, name: str, grid: int, block: int, *args: object) -> None:
        launch(module, name, grid, block, *args)
        if module == "planes" and name.startswith("merge_") and grid > 0:
            flip((grid,), (1,), tuple(args[:4]), stream=runtime.stream())

    runtime.launch = broken


def adversarial_sets() -> dict[str, Any]:
    import torch

    every16 = torch.from_numpy(np.arange(65536, dtype=np.uint16).view(np.int16).copy())
    exps = np.arange(256, dtype=np.uint32) << 23
    mants = np.array([0, 1, 0x2AAAAA, 0x400000, 0x7FFFFE, 0x7FFFFF], np.uint32)
    grid = (exps[:, None] | mants[None, :]).reshape(-1)
    specials = np.concatenate([grid, grid | 0x80000000]).view(np.int32)
    words = np.random.default_rng(20261201).integers(0, 2**32, 1 << 20, dtype=np.uint32)
    out = {
        "bf16_all_patterns": every16.view(torch.bfloat16),
        "fp16_all_patterns": every16.view(torch.float16),
        "bf16_patterns_odd_2d": every16[:65531].view(torch.bfloat16).reshape(19, 3449),
        "fp16_patterns_transposed": every16.view(torch.float16).reshape(256, 256).t(),
        "fp32_specials": torch.from_numpy(specials.copy()).view(torch.float32),
        "fp32_random_words": torch.from_numpy(words.view(np.int32).copy()).view(torch.float32),
    }
    return {k: v.cuda() for k, v in out.items()}


def trained_state(steps: int = 60) -> tuple[Any, Any, Any]:
    """A small MLP trained with AdamW on the GPU: (model, optimizer, its state)."""
    import torch

    torch.manual_seed(20261201)
    model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                torch.nn.Linear(512, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    train(model, opt, steps)
    return model, opt, state_of(model, opt)


def train(model: Any, opt: Any, steps: int) -> None:
    import torch

    for _ in range(steps):
        x = torch.randn(64, 256, device="cuda")
        loss = (model(x) - x.flip(1)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()


def state_of(model: Any, opt: Any) -> dict[str, Any]:
    """A deep copy of what a training job checkpoints, with a bf16 copy of the weights."""
    import copy

    model_state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return {"model": model_state, "optim": copy.deepcopy(opt.state_dict()),
            "model_bf16": {k: v.bfloat16() for k, v in model_state.items()}}


def first_difference(want: Any, got: Any, path: str = "") -> str | None:
    """Where ``got`` differs from ``want`` (tensors compared byte for byte), or None."""
    import torch

    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{path}: a {type(got).__name__}, not a tensor"
        if got.dtype != want.dtype or got.shape != want.shape:
            return f"{path}: {got.dtype}{list(got.shape)} != {want.dtype}{list(want.shape)}"
        a = want.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        b = got.detach().contiguous().reshape(-1).view(torch.uint8).cpu()
        if torch.equal(a, b):
            return None
        i = int((a != b).nonzero()[0])
        return f"{path}: byte {i} is {int(b[i]):#04x}, want {int(a[i]):#04x}"
    if isinstance(want, dict):
        if not isinstance(got, dict) or list(got) != list(want):
            return f"{path}: keys differ"
        for k in want:
            if (d := first_difference(want[k], got[k], f"{path}/{k}")) is not None:
                return d
        return None
    if isinstance(want, (list, tuple)):
        if type(got) is not type(want) or len(got) != len(want):
            return f"{path}: {type(got).__name__} of {len(got)} != {len(want)}"
        for i, (w, g) in enumerate(zip(want, got)):
            if (d := first_difference(w, g, f"{path}/{i}")) is not None:
                return d
        return None
    return None if want == got or (want != want and got != got) else f"{path}: {got!r} != {want!r}"


def round_trips(work: Path) -> list[tuple[str, str | None]]:
    """(check, problem or None) for each GPU save -> load round trip."""
    import s4weights

    results = []
    sets = adversarial_sets()
    model, opt, state1 = trained_state()
    for name, obj in (("adversarial sets", sets), ("trained state", state1)):
        path = work / f"{name.replace(' ', '_')}.s4w"
        s4weights.save(obj, str(path), device="cuda")
        results.append((f"{name}: GPU save -> GPU load",
                        first_difference(obj, s4weights.load(str(path), map_location="cuda",
                                                             device="cuda"))))
        results.append((f"{name}: GPU save -> CPU load",
                        first_difference(obj, s4weights.load(str(path), map_location="cpu",
                                                             device="cpu"))))
    run = str(work / "run")
    s4weights.save_checkpoint(state1, run, 1, device="cuda")
    train(model, opt, 5)
    state2 = state_of(model, opt)
    # (read_budget=None: an AdamW state's delta does not pay under the default budget, and the
    # gate is here to decode a GPU-coded delta)
    info = s4weights.save_checkpoint(state2, run, 2, device="cuda", read_budget=None)
    kinds = {1: "base", 2: "base" if info.is_base else "delta"}
    for step, want in ((1, state1), (2, state2)):
        got = s4weights.load_checkpoint(run, step, map_location="cuda")
        results.append((f"checkpoint step {step} ({kinds[step]}): GPU save -> GPU load",
                        first_difference(want, got)))
    results.append(("checkpoint step 2 is a delta", None if kinds[2] == "delta"
                    else "saved as a base, so no delta was decoded"))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="packer/gate.py", description=__doc__.split("\n\n")[0])
    ap.add_argument("--report", type=Path, help="also write the results as JSON here")
    ap.add_argument("--break-plane-merge", action="store_true",
                    help="TEST SWITCH: corrupt every GPU plane merge by one bit; the gate "
                         "must then fail")
    args = ap.parse_args(argv)
    problem = gpu_problem()
    if problem is not None:
        print(f"gate: FAIL: no usable GPU: {problem}", file=sys.stderr)
        return EXIT_NO_GPU
    import torch

    print(f"gate: GPU {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"CUDA {torch.version.cuda}")
    if args.break_plane_merge:
        print("gate: TEST SWITCH --break-plane-merge: every GPU plane merge flips a bit")
        break_plane_merge()
    t0 = time.monotonic()
    from s4format import cli

    suites = [a for s in SUITES if s.is_dir() for a in ("--suite", str(s))]
    conformance = cli.main(["conformance", "--device", "cuda", *suites])
    checks: list[tuple[str, str | None]] = [
        ("python -m s4format conformance --device cuda",
         None if conformance == 0 else f"exit status {conformance}")]
    with tempfile.TemporaryDirectory(prefix="s4-gate-") as work:
        try:
            checks += round_trips(Path(work))
        except Exception as exc:  # an error is a failed gate, reported like a mismatch
            traceback.print_exc()
            checks.append(("GPU round trips", f"raised {type(exc).__name__}: {exc}"))
    failed = [c for c in checks if c[1] is not None]
    print()
    for name, problem in checks:
        print(f"{'PASS' if problem is None else 'FAIL'}  {name}" + (f": {problem}" if problem
                                                                     else ""))
    verdict = "FAIL" if failed else "PASS"
    print(f"gate: {verdict}: {len(checks) - len(failed)}/{len(checks)} checks passed in "
          f"{time.monotonic() - t0:.0f} s")
    if args.report:
        args.report.write_text(json.dumps({
            "verdict": verdict, "gpu": torch.cuda.get_device_name(),
            "break_plane_merge": args.break_plane_merge,
            "checks": [{"check": n, "problem": p} for n, p in checks]}, indent=1))
    return EXIT_FAIL if failed else 0


if __name__ == "__main__":
    sys.exit(main())
