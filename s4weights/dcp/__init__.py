"""S4 storage for ``torch.distributed.checkpoint``: sharded checkpoints as .s4w files.

``dcp.save(state, storage_writer=S4StorageWriter(url))`` writes one .s4w file per rank and DCP's
metadata; ``dcp.load(state, storage_reader=S4StorageReader(url))`` reads it back into any world
size and placement. ``url`` is a directory, ``file://`` or ``s3://bucket/prefix`` URL. A
checkpoint exists once its ``.metadata`` does, which the coordinator writes last (docs/dcp.md).
"""

from __future__ import annotations

from s4weights.dcp.checkpoint import S4StorageInfo
from s4weights.dcp.reader import S4StorageReader
from s4weights.dcp.writer import S4StorageWriter

__all__ = ["S4StorageInfo", "S4StorageReader", "S4StorageWriter"]
