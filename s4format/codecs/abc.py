"""The codec contract. Every codec in ``s4format.codecs`` implements :class:`Codec`.

A codec turns one *plane* (a flat run of bytes, ``np.ndarray`` of ``uint8``) into stored bytes
and back. The contract, which the shared checks in ``tests/codecs/common.py`` enforce on every
codec:

* ``encode(plane)`` returns an :class:`Encoded` (payload + codec parameters) or ``None`` when the
  codec cannot represent this plane (bitpack on bytes other than 0/1) or would not pay. It is a
  pure function of its input: the same plane gives the same bytes on every machine.
* ``decode(payload, decoded_len, params)`` returns exactly ``decoded_len`` bytes, or raises an
  :class:`~s4format.errors.S4Error` subclass (``CodecError`` for a bad stream). It never reads
  outside ``payload``, never hangs and never allocates more than ``decoded_len`` plus a bounded
  workspace: callers have checked ``decoded_len`` against :meth:`max_decoded_len` first.
* ``encode_view`` and ``estimate_view`` give the same as ``encode`` and ``estimate`` on the
  view's bytes (:class:`~s4format.codecs.view.PlaneView`).
* ``max_decoded_len(stored_len)`` is the largest plane the codec can produce from ``stored_len``
  stored bytes; the reader refuses larger declared lengths before allocating anything.

Codec IDs come from the registry table in ``spec/codecs.md`` and are never reused.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar

import numpy as np

if TYPE_CHECKING:
    from s4format.codecs.view import PlaneView


@dataclass(frozen=True)
class Encoded:
    payload: bytes | np.ndarray
    params: bytes = b""

    @property
    def nbytes(self) -> int:
        return len(self.payload) if isinstance(self.payload, bytes) else int(self.payload.nbytes)


@dataclass(frozen=True)
class Slicer:
    """Decodes a plane a slice at a time, so that a reader merges slices into the tensor as
    they come: ``get(lo, hi)`` gives the decoded bytes [lo, hi) for ``lo`` a multiple of
    ``align`` and ``hi`` one or the plane's end, or None where the stream is corrupt.
    ``packed``: ``(payload, w)`` where the plane is stored as its bytes' ``w`` low bits
    (bitpack-w's form, checked), which a merge may read in place of ``get``'s bytes. ``packs``:
    for a plane not stored in that form but cheaply put in it (a rANS CONST stream of 0s and
    1s), the function that makes it, called when a merge asks (:meth:`packed_form`)."""
    align: int
    get: Callable[[int, int], np.ndarray | None]
    packed: tuple[np.ndarray, int] | None = None
    packs: Callable[[], tuple[np.ndarray, int] | None] | None = None

    def packed_form(self) -> tuple[np.ndarray, int] | None:
        """``packed``, or what ``packs`` makes; None where there is neither."""
        if self.packed is not None or self.packs is None:
            return self.packed
        return self.packs()


class Codec(ABC):
    codec_id: ClassVar[int]
    name: ClassVar[str]

    @abstractmethod
    def encode(self, plane: np.ndarray) -> Encoded | None:
        """Code a contiguous ``uint8`` plane; ``None`` if this codec does not apply to it."""

    @abstractmethod
    def decode(self, payload: np.ndarray, decoded_len: int, params: bytes) -> np.ndarray:
        """Return the ``decoded_len`` plane bytes (``uint8``) coded in ``payload``."""

    @abstractmethod
    def max_decoded_len(self, stored_len: int) -> int:
        """Upper bound on the decoded length of a plane stored in ``stored_len`` bytes."""

    def estimate(self, plane: np.ndarray) -> int | None:
        """Cheap estimate of the stored size, for choosing codecs; default: encode for real."""
        enc = self.encode(plane)
        return None if enc is None else enc.nbytes

    # The CPU writer's entry points: a plane given as a view of a tensor's words with its
    # statistics. A codec that can estimate from the histogram alone sets ``counts_estimate``
    # (choosing among such codecs needs no trial encode); one that can read the words in place
    # overrides ``encode_view``. Both must give what estimate and encode give on the bytes.
    counts_estimate: ClassVar[bool] = False

    def estimate_view(self, view: PlaneView) -> int | None:
        return self.estimate(view.bytes())

    def encode_view(self, view: PlaneView) -> Encoded | None:
        return self.encode(view.bytes())

    def slicer(self, payload: np.ndarray, decoded_len: int, params: bytes) -> Slicer | None:
        """A :class:`Slicer` of a stored plane, or None where this codec decodes whole planes
        only or the stream's form is wrong (:meth:`decode` then says what is wrong)."""
        return None
