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
