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
    shaped torch tensor, or None when the GPU path is off."""
    if not use_gpu(device, True):
        return None

    def load(i: int, dev):
        import torch

        from s4weights.gpu.decode import read_tensor

        t = reader.tensors[i]
        with torch.cuda.device(dev):
            raw = read_tensor(reader, i)
        if update is not None:
            update(t.raw_nbytes)
        return raw.view(getattr(torch, t.dtype.name)).reshape(t.shape)

    return load
