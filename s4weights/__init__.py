"""s4weights: lossless checkpoints for PyTorch on top of the .s4w format.

``save``/``load`` are drop-in for ``torch.save``/``torch.load``; ``save_checkpoint`` and
``load_checkpoint`` keep a base and XOR deltas in a store (a local directory, ``file://`` URL,
or with the ``s3`` extra ``s3://bucket/prefix``).
"""

from s4format.errors import (
    ParentMismatchError,
    S4Error,
    StorageError,
    UnsupportedObjectError,
)
from s4weights.api import load, save
from s4weights.chain import (
    CheckpointInfo,
    list_checkpoints,
    load_checkpoint,
    retain,
    save_checkpoint,
)
from s4weights.torchtree import register_type

__version__ = "0.1.0"

__all__ = [
    "CheckpointInfo", "ParentMismatchError", "S4Error", "StorageError",
    "UnsupportedObjectError", "list_checkpoints", "load", "load_checkpoint", "register_type",
    "retain", "save", "save_checkpoint",
]
