"""``S4CheckpointIO`` under a real ``lightning.Trainer`` on the CPU: checkpoints are .s4w files,
old ones are removed through it, and a run resumed from one (also one written in a thread, by
``S4AsyncCheckpointIO`` or Lightning's ``AsyncCheckpointIO``) takes the same next steps, bit for
bit, as a run never stopped."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

L = pytest.importorskip("lightning")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.io import AsyncCheckpointIO  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

import s4weights  # noqa: E402
from s4weights.lightning import S4AsyncCheckpointIO, S4CheckpointIO  # noqa: E402
from tests.weights.common import tensor_bytes  # noqa: E402

MAGIC = b"\x89S4W"


class Tiny(L.LightningModule):
    def __init__(self, width: int = 8) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, width), torch.nn.Tanh(),
                                       torch.nn.Linear(width, 1))

    def training_step(self, batch, _index):
        x, y = batch
        return torch.nn.functional.mse_loss(self.net(x), y)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=1e-2)
        return {"optimizer": opt, "lr_scheduler": torch.optim.lr_scheduler.StepLR(opt, 1, 0.5)}


def _data() -> DataLoader:
    g = torch.Generator().manual_seed(1)
    return DataLoader(TensorDataset(torch.randn(16, 4, generator=g), torch.randn(16, 1,
                                                                            generator=g)),
                      batch_size=4)


def _fit(root: Path, epochs: int, io, ckpt_path: Path | None = None, seed: int = 0) -> Tiny:
    L.seed_everything(seed, verbose=False)
    model = Tiny()
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=root, plugins=[io],
                        callbacks=[ModelCheckpoint(dirpath=root / "ckpt")])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(model, _data(), ckpt_path=ckpt_path)
    return model


def _state(model: Tiny) -> dict[str, bytes]:
    out = {k: tensor_bytes(v) for k, v in model.state_dict().items()}
    opt = model.trainer.optimizers[0].state_dict()["state"]
    out.update({f"opt.{i}.{k}": tensor_bytes(v) for i, s in opt.items() for k, v in s.items()})
    return out


@pytest.mark.parametrize(("io", "removes_in_order"), [
    (S4CheckpointIO, True), (S4AsyncCheckpointIO, True),
    # Lightning's own wrapper may remove a checkpoint before its queued save has written it
    (lambda: AsyncCheckpointIO(S4CheckpointIO()), False)],
    ids=["sync", "s4-async", "lightning-async"])
def test_fit_saves_s4w_and_resumes_bit_exact(tmp_path: Path, io, removes_in_order) -> None:
    _fit(tmp_path / "a", 2, io())
    saved = sorted((tmp_path / "a" / "ckpt").iterdir())
    if removes_in_order:
        # epoch 0's checkpoint was removed through S4CheckpointIO when epoch 1's was saved
        assert [p.name for p in saved] == ["epoch=1-step=8.ckpt"]
    saved = [p for p in saved if p.name == "epoch=1-step=8.ckpt"]
    assert saved[0].read_bytes()[:4] == MAGIC
    ckpt = s4weights.load(saved[0])
    assert (ckpt["epoch"], ckpt["global_step"], ckpt["hyper_parameters"]) == (1, 8, {"width": 8})

    resumed = _fit(tmp_path / "b", 3, io(), ckpt_path=saved[0], seed=5)
    straight = _fit(tmp_path / "c", 3, S4CheckpointIO())
    assert resumed.trainer.global_step == straight.trainer.global_step == 12
    assert _state(resumed) == _state(straight)


def test_storage_options_are_refused(tmp_path: Path) -> None:
    with pytest.raises(TypeError, match="takes no storage_options"):
        S4CheckpointIO().save_checkpoint({}, tmp_path / "x.ckpt", storage_options={"a": 1})
