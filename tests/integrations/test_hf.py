"""``S4Trainer`` and ``S4Accelerator`` with the real transformers and accelerate on the CPU: the
checkpoint folders hold .s4w files for the model and the optimizer (and none of the files
they replace), and a run resumed from one takes the same next steps, bit for bit, as a run
never stopped."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
accelerate = pytest.importorskip("accelerate")

import s4weights  # noqa: E402
from s4weights.hf import S4Accelerator, S4Trainer  # noqa: E402
from tests.weights.common import tensor_bytes  # noqa: E402

MAGIC = b"\x89S4W"


class Regressor(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(),
                                       torch.nn.Linear(8, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        out = self.net(x)
        return {"loss": torch.nn.functional.mse_loss(out, labels), "logits": out}


def _dataset() -> list[dict[str, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [{"x": torch.randn(4, generator=g), "labels": torch.randn(1, generator=g)}
            for _ in range(16)]


def _bytes(model: torch.nn.Module, opt: torch.optim.Optimizer) -> dict[str, bytes]:
    out = {k: tensor_bytes(v) for k, v in model.state_dict().items()}
    for i, s in opt.state_dict()["state"].items():
        out.update({f"opt.{i}.{k}": tensor_bytes(v) for k, v in s.items()})
    return out


def _trainer(out: Path, seed: int) -> S4Trainer:
    torch.manual_seed(seed)
    args = transformers.TrainingArguments(
        output_dir=str(out), max_steps=6, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="linear", warmup_steps=1, save_strategy="steps", save_steps=3,
        logging_strategy="no", report_to=[], use_cpu=True, seed=0, disable_tqdm=True,
        remove_unused_columns=False, dataloader_num_workers=0)
    return S4Trainer(model=Regressor(), args=args, train_dataset=_dataset())


def test_trainer_checkpoints_are_s4w_and_resume_bit_exact(tmp_path: Path) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        straight = _trainer(tmp_path / "a", seed=0)
        straight.train()
        ckpt = tmp_path / "a" / "checkpoint-3"
        names = {p.name for p in ckpt.iterdir()}
        assert {"model.s4w", "optimizer.s4w", "scheduler.s4w", "trainer_state.json"} <= names
        assert not names & {"model.safetensors", "optimizer.pt", "scheduler.pt"}
        assert (ckpt / "optimizer.s4w").read_bytes()[:4] == MAGIC
        assert s4weights.load(ckpt / "scheduler.s4w")["last_epoch"] == 3

        resumed = _trainer(tmp_path / "b", seed=7)  # other initial weights
        resumed.train(resume_from_checkpoint=str(ckpt))
    assert resumed.state.global_step == straight.state.global_step == 6
    assert _bytes(resumed.model, resumed.optimizer) == _bytes(straight.model,
                                                              straight.optimizer)


def _run(acc: S4Accelerator, model, opt, sched, steps: range) -> None:
    for step in steps:
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 4, generator=g), torch.randn(8, 1, generator=g)
        loss = torch.nn.functional.mse_loss(model(x, y)["logits"], y)
        acc.backward(loss)
        opt.step()
        sched.step()
        opt.zero_grad()


def _prepared(acc: S4Accelerator, seed: int):
    torch.manual_seed(seed)
    model = Regressor()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    return acc.prepare(model, opt, sched)


def test_accelerator_save_state_through_s4_resumes_bit_exact(tmp_path: Path) -> None:
    acc = S4Accelerator(cpu=True)
    model, opt, sched = _prepared(acc, seed=0)
    _run(acc, model, opt, sched, range(3))
    acc.save_state(str(tmp_path / "state"))
    _run(acc, model, opt, sched, range(3, 6))
    names = {p.name for p in (tmp_path / "state").iterdir()}
    assert {"model.s4w", "optimizer.s4w", "scheduler.bin"} <= names
    assert not names & {"model.safetensors", "pytorch_model.bin", "optimizer.bin"}
    assert (tmp_path / "state" / "model.s4w").read_bytes()[:4] == MAGIC

    acc2 = S4Accelerator(cpu=True)
    model2, opt2, sched2 = _prepared(acc2, seed=9)
    acc2.load_state(str(tmp_path / "state"))
    _run(acc2, model2, opt2, sched2, range(3, 6))
    assert _bytes(model2, opt2) == _bytes(model, opt)
    assert len(acc2._optimizers) == 1  # given back after loading


def test_a_plain_accelerate_folder_is_refused_with_what_to_do(tmp_path: Path) -> None:
    plain = accelerate.Accelerator(cpu=True)
    model = Regressor()
    plain.prepare(model, torch.optim.AdamW(model.parameters()))
    plain.save_state(str(tmp_path / "plain"))
    acc = S4Accelerator(cpu=True)
    model = Regressor()
    acc.prepare(model, torch.optim.AdamW(model.parameters()))
    with pytest.raises(s4weights.StorageError, match=r"holds no optimizer\.s4w: it was not "
                                                     r"written by S4Accelerator\.save_state"):
        acc.load_state(str(tmp_path / "plain"))
