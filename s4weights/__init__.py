"""s4weights: lossless checkpoints for PyTorch on top of the .s4w format.

``save``/``load`` are drop-in for ``torch.save``/``torch.load``; ``save_checkpoint`` and
``load_checkpoint`` keep a base and XOR deltas in a store (a local directory, ``file://`` URL,
or with the ``s3`` extra ``s3://bucket/prefix``).

The torch-facing names are imported on first use, so ``s4weights.store`` (used by the
``s4format`` CLI for ``s3://`` files) works without torch.
"""

from __future__ import annotations

import importlib
from typing import Any

from s4format.errors import ParentMismatchError, S4Error, StorageError, UnsupportedObjectError

__version__ = "0.1.0"

_LAZY = {
    "save": "s4weights.api", "load": "s4weights.api",
    "CheckpointInfo": "s4weights.chain", "list_checkpoints": "s4weights.chain",
    "load_checkpoint": "s4weights.chain", "retain": "s4weights.chain",
    "save_checkpoint": "s4weights.chain", "register_type": "s4weights.torchtree",
    "IntoMismatchError": "s4weights.torchtree",
}

__all__ = ["ParentMismatchError", "S4Error", "StorageError", "UnsupportedObjectError",
           *_LAZY]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 's4weights' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value
