"""s4weights: lossless checkpoints for PyTorch on top of the .s4w format.

``save``/``load`` are drop-in for ``torch.save``/``torch.load``; ``save_checkpoint`` and
``load_checkpoint`` keep a base and XOR deltas in a store (a local directory, ``file://`` URL,
or with the ``s3`` extra ``s3://bucket/prefix``); ``open`` reads single tensors lazily.

The torch-facing names are imported on first use, so ``s4weights.store`` (used by the
``s4format`` CLI for ``s3://`` files) works without torch, and a missing torch is reported
with the command that installs it.
"""

import importlib as _importlib

from s4format.errors import ParentMismatchError, S4Error, StorageError, UnsupportedObjectError

__version__ = "0.1.0"

_LAZY = {
    "save": "s4weights.api", "load": "s4weights.api", "open": "s4weights.lazy",
    "CheckpointInfo": "s4weights.manifests", "list_checkpoints": "s4weights.manifests",
    "load_checkpoint": "s4weights.checkpoints", "retain": "s4weights.manifests",
    "save_checkpoint": "s4weights.checkpoints", "register_type": "s4weights.torchtree",
    "IntoMismatchError": "s4weights.torchtree",
}

_TORCH_MISSING = ("{what} needs PyTorch, which is not installed here: "
                 "pip install 's4weights[torch]' (on a GPU machine, install the torch build "
                 "for your CUDA version first)")

__all__ = ["ParentMismatchError", "S4Error", "StorageError", "UnsupportedObjectError",
           "__version__", *_LAZY]


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 's4weights' has no attribute {name!r}")
    try:
        value = getattr(_importlib.import_module(module), name)
    except ModuleNotFoundError as exc:
        if exc.name != "torch":
            raise
        raise ModuleNotFoundError(_TORCH_MISSING.format(what=f"s4weights.{name}"),
                                  name="torch") from None
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)
