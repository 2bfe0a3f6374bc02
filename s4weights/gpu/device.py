"""Whether the CUDA path can run here, whether a call takes it, and how a device that ran out of
memory shows. Importing this module never needs CUDA, CuPy or torch."""

from __future__ import annotations

import functools

DEVICES = ("auto", "cuda", "cpu")


@functools.cache
def available() -> bool:
    """True when torch sees a CUDA device and CuPy is importable."""
    try:
        import cupy  # noqa: F401
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


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


def out_of_memory_errors() -> tuple[type[BaseException], ...]:
    """The exceptions a device allocation raises when the device's memory is exhausted."""
    import torch

    errors: tuple[type[BaseException], ...] = (torch.cuda.OutOfMemoryError,)
    try:
        from cupy.cuda.memory import OutOfMemoryError
    except ImportError:
        return errors
    return (*errors, OutOfMemoryError)


def error_text(exc: BaseException) -> str:
    """The first sentence of an error, for a warning: torch's out-of-memory errors run on for
    several lines."""
    text = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    cut = text.find(". GPU ")
    return text[:cut] if cut > 0 else text
