"""CUDA path of s4weights: tensors on the GPU are split into planes, coded and hashed on the
device, and decoded and merged back there (``spec/planes.md``, ``spec/rans.md``,
``spec/gdeflate.md``). Files are the same format the CPU path writes and reads; rANS, bitpack
and raw plane bytes are identical to what the CPU coder produces for the same codec choice.

Kernels live in ``kernels/*.cu`` and are compiled at first use with NVRTC through CuPy; they run
on torch's current stream with memory from torch's caching allocator. Importing this package
never needs CUDA: :func:`available` says whether the path can run.
"""

from __future__ import annotations

import functools


@functools.cache
def available() -> bool:
    """True when torch sees a CUDA device and CuPy is importable."""
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


DEVICES = ("auto", "cuda", "cpu")


def use_gpu(device: str, wanted: bool) -> bool:
    """Whether to take the GPU path: ``wanted`` says CUDA tensors are involved."""
    if device not in DEVICES:
        raise ValueError(f"device must be one of {DEVICES}, got {device!r}")
    if device == "cpu" or not wanted:
        return False
    if not available():
        if device == "cuda":
            raise RuntimeError("device='cuda' needs torch with a CUDA device and CuPy "
                               "(pip install 's4weights[gpu]')")
        return False
    return True


def coded_in_order(tensors: list, policy: str, device: str, skip: set[str]) -> dict:
    """The save hook: name -> iterator for every CUDA tensor the GPU codes (not those in
    ``skip``, which have a delta parent); ``next()`` on it, in flat order, gives the
    ``(CodedTensor, content_hash)`` to pass to ``Writer.add_coded``."""
    from s4weights.torchtree import DeviceTensor

    chosen = [(name, t) for name, t in tensors
              if isinstance(t, DeviceTensor) and name not in skip]
    if not use_gpu(device, bool(chosen)):
        return {}
    from s4weights.gpu.encode import Encoder, Item

    items = [Item(t.dtype, t.shape, t.device_bytes) for _, t in chosen]
    stream = ((r.coded, r.content_hash) for r in Encoder(policy).code(items))
    return {name: stream for name, _ in chosen}


def loader_for(reader, device: str, update=None):
    """The load hook: ``f(i, cuda_device)`` decoding stored tensor i on that device as a typed,
    shaped torch tensor, or None when the GPU path is off.

    Decoding is batched: the first request for a GPU-decodable tensor decodes it together with
    the following GPU-decodable tensors (up to a workspace of raw bytes) on the same device, and
    later requests take theirs from that batch. Tensors are requested in stored order, so each
    batch is used up before the next; one never requested stays held until the loader goes."""
    if not use_gpu(device, True):
        return None
    ready: dict[tuple[int, str], object] = {}
    sizes = [t.raw_nbytes for t in reader.tensors]
    budget = min(1 << 30, max(256 << 20, sum(sizes) // 4))

    def load(i: int, dev):
        import torch

        from s4weights.gpu.decode import decodable, read_tensors

        t = reader.tensors[i]
        key = (i, str(dev))
        raw = ready.pop(key, None)
        if raw is None:
            idx = [i]
            if decodable(reader, i):
                used = sizes[i]
                for j in range(i + 1, len(sizes)):
                    if used + sizes[j] > budget:
                        break
                    if (j, str(dev)) not in ready and decodable(reader, j):
                        idx.append(j)
                        used += sizes[j]
            with torch.cuda.device(dev):
                outs = read_tensors(reader, idx)
            raw = outs[0]
            for j, o in zip(idx[1:], outs[1:]):
                ready[(j, str(dev))] = o
        if update is not None:
            update(t.raw_nbytes)
        return raw.view(getattr(torch, t.dtype.name)).reshape(t.shape)

    return load
