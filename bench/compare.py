"""Same-run comparison of two checkouts' GPU codec (run on the GPU machine):

    python3 bench/compare.py OLD_ROOT NEW_ROOT [rounds]

Each root is a copy of the repository (at least ``s4format/``, ``s4weights/`` and ``bench/``),
for instance ``git worktree add /tmp/old <commit>``. Every round runs one process per root, in
turn, so both see the same machine at about the same time: device-to-device encode of (b), the
training state of bench/gpu.py (saved once to /tmp and reloaded by every process), at 1 and 2
GiB workspaces, and of (a), one 1 GiB bf16 tensor; then (b)'s device-to-device decode, batched
as s4weights.load batches it. Timing is each root's own ``bench/gpu.timed`` (a median after
warm-up), so compare roots whose timing is the same. Prints one line per figure.
"""

from __future__ import annotations

import io
import os
import subprocess
import sys

STATE = "/tmp/s4-compare-state.pt"


def one(root: str, label: str) -> None:
    """The figures of one root, in this process (``root`` first on sys.path)."""
    root = os.path.abspath(root)
    sys.path[:0] = [os.path.join(root, "bench"), root]
    import gpu
    import torch

    import s4format
    from s4format.writer import Writer
    from s4weights.gpu import decode
    from s4weights.gpu.encode import Encoder

    for mod in (gpu, decode):
        if not os.path.abspath(mod.__file__).startswith(root):
            raise SystemExit(f"{mod.__name__} imported from {mod.__file__}, not {root}")
    if not os.path.exists(STATE):
        torch.save(gpu.flat_tensors(gpu.trained_state(50)), STATE)
    tensors = torch.load(STATE)
    items = gpu.s4_items(tensors)
    raw = sum(t.numel() * t.element_size() for t in tensors.values())
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(1 << 29, device="cuda", generator=g) * 0.02).bfloat16()
    for case, its, nbytes, spaces in (("(b)", items, raw, (1 << 30, 2 << 30)),
                                      ("(a)", gpu.s4_items({"a": a}), 1 << 30, (1 << 30,))):
        for ws in spaces:
            enc = Encoder("auto", workspace=ws)
            s, groups = gpu.timed(lambda enc=enc, its=its: enc.encode_device(its), 7)
            print(f"{label} {case} encode, workspace {ws >> 20} MiB: {len(groups)} groups, "
                  f"{nbytes / s / 1e9:.1f} GB/s", flush=True)
            del groups
    enc = Encoder("auto", workspace=1 << 30)
    buf = io.BytesIO()
    with Writer(buf) as w:
        for (name, t), it, c in zip(tensors.items(), items, enc.code(items)):
            w.add_coded(name, it.dtype, tuple(t.shape), c.coded, c.content_hash)
        w.set_tree({k: s4format.objtree.TensorRef(i) for i, k in enumerate(tensors)})
    reader = s4format.Reader(buf.getvalue())
    outs = [torch.empty(t.numel() * t.element_size(), dtype=torch.uint8, device="cuda")
            for t in tensors.values()]
    # batches as bench/gpu.py's s4_case forms them (repeated here: an older checkout's
    # bench/gpu.py has no shared helper to call)
    batches, used, cur = [], 0, []
    for i in range(len(outs)):
        need = decode.device_extra(reader, i)
        if cur and used + need > 1 << 30:
            batches.append(cur)
            cur, used = [], 0
        cur.append(i)
        used += need
    batches.append(cur)
    on_gpu = [[i for i in b if decode.decodable(reader, i)] for b in batches]
    staged = [(b, decode.stage(reader, b)) for b in on_gpu if b]

    def dec() -> None:
        for b, st in staged:
            decode.decode_staged(st, [outs[i] for i in b])

    s, _ = gpu.timed(dec, 7)
    exact = all(torch.equal(o, t.reshape(-1).view(torch.uint8))
                for o, t in zip(outs, tensors.values()) if o.numel())
    print(f"{label} (b) decode: {len(staged)} batches, {raw / s / 1e9:.1f} GB/s, "
          f"bit-exact {exact}", flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--one":
        one(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) < 3:
        raise SystemExit(__doc__)
    roots = sys.argv[1:3]
    rounds = int(sys.argv[3]) if len(sys.argv) > 3 else 2
    for _ in range(rounds):
        for label, root in zip(("old", "new"), roots):
            subprocess.run([sys.executable, __file__, "--one", root, label], check=True)


if __name__ == "__main__":
    main()
