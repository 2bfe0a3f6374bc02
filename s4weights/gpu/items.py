"""What the GPU coders take and give: an :class:`Item` is one tensor's raw bytes on the device,
a :class:`Coded` its ``CodedTensor`` and content hash, ready for ``Writer.add_coded``."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from s4format import dtypes
from s4format.dtypes import DType
from s4format.layouts import Layout
from s4format.writer import CodedTensor


@dataclass
class Item:
    """One tensor to code: raw bytes on the device (flat, contiguous uint8)."""
    dtype: DType
    shape: tuple[int, ...]
    data: torch.Tensor
    layout: Layout | None = None  # set by the encoder: GPU split layout, None = CPU coder
    # a delta coded without a device copy of the XOR: the item is ``data ^ parent``, formed
    # chunk by chunk by the chunked coder; such items never share a group
    parent: torch.Tensor | None = None

    @functools.cached_property
    def nbytes(self) -> int:
        return int(self.data.numel())

    @classmethod
    def of(cls, t: torch.Tensor) -> Item:
        """The item of a contiguous tensor: its dtype, shape and bytes."""
        return cls(dtypes.BY_NAME[str(t.dtype).removeprefix("torch.")], tuple(t.shape),
                   t.reshape(-1).view(torch.uint8))


@dataclass
class Coded:
    coded: CodedTensor
    content_hash: bytes
