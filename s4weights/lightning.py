"""Lightning integration: :class:`S4CheckpointIO` makes ``lightning.Trainer`` write and read its
checkpoints as .s4w files (``s4weights.save``/``load``: atomic, lossless, no pickle).

    trainer = lightning.Trainer(plugins=[S4CheckpointIO()])
    trainer = lightning.Trainer(plugins=[S4AsyncCheckpointIO()])  # saves in a thread

Lightning's own ``AsyncCheckpointIO(S4CheckpointIO())`` works too, but it removes old
checkpoints at once, before the saves queued ahead of the removal have written them: a
checkpoint ``ModelCheckpoint`` dropped while it was still being written stays on disk (with any
CheckpointIO). :class:`S4AsyncCheckpointIO` queues removals behind those saves.

Checkpoints keep Lightning's names (``epoch=0-step=10.ckpt``); the files are .s4w.
Needs the ``lightning`` extra; the rest of s4weights never imports this module.
"""

from __future__ import annotations

import os
from typing import Any

from lightning.fabric.plugins import CheckpointIO
from lightning.pytorch.plugins.io import AsyncCheckpointIO

import s4weights
from s4weights.api import _store_and_name


class S4CheckpointIO(CheckpointIO):
    """Lightning's checkpoint I/O through s4weights. ``policy`` and ``device`` are
    :func:`s4weights.save`'s; loading always checks every tensor's content hash."""

    def __init__(self, *, policy: str = "auto", device: str = "auto") -> None:
        self.policy, self.device = policy, device

    def save_checkpoint(self, checkpoint: dict[str, Any], path: str | os.PathLike[str],
                        storage_options: Any | None = None) -> None:
        if storage_options is not None:
            raise TypeError("S4CheckpointIO.save_checkpoint takes no storage_options "
                            f"(got {storage_options!r}); pass policy= or device= to "
                            "S4CheckpointIO() instead")
        if not os.fspath(path).startswith("s3://"):
            os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        s4weights.save(checkpoint, path, policy=self.policy, device=self.device)

    def load_checkpoint(self, path: str | os.PathLike[str], map_location: Any | None = None,
                        weights_only: bool | None = None) -> dict[str, Any]:
        # weights_only changes nothing: an .s4w file never makes its reader run code
        return s4weights.load(path, map_location=map_location, device=self.device)

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        store, name = _store_and_name(os.fspath(path))
        store.delete(name)


class S4AsyncCheckpointIO(AsyncCheckpointIO):
    """Lightning's ``AsyncCheckpointIO`` around :class:`S4CheckpointIO` (or ``checkpoint_io``)
    whose removals run on its save thread, after every save queued before them."""

    def __init__(self, checkpoint_io: CheckpointIO | None = None) -> None:
        super().__init__(checkpoint_io if checkpoint_io is not None else S4CheckpointIO())

    def remove_checkpoint(self, path: str | os.PathLike[str]) -> None:
        self._ensure_setup()

        def remove() -> None:
            try:
                self.checkpoint_io.remove_checkpoint(path)
            except BaseException as exc:  # raised on the next save or at teardown, as saves
                self._error = exc

        self._executor.submit(remove)
        if self._error:
            raise self._error


__all__ = ["S4AsyncCheckpointIO", "S4CheckpointIO"]
