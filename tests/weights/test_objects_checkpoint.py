"""Training checkpoints as people write them, with ``args`` from a real ``argparse`` parser,
Lightning hyperparameters, timestamps, paths, registered enums and named tuples and
``collections`` containers next to the model and optimizer state: they round-trip exactly,
type and value, through ``s4weights.save``/``load`` (spec/objects.md, "Python values")."""

from __future__ import annotations

import argparse
import datetime as dt
import enum
import io
import warnings
from collections import Counter, OrderedDict, defaultdict, deque, namedtuple
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

import s4format
import s4weights
from s4weights import torchtree
from tests.weights.common import Trainer, assert_same, roundtrip


class Precision(enum.Enum):
    FP32 = "32"
    BF16 = "bf16-mixed"


class Stage(enum.IntEnum):
    WARMUP = 0
    MAIN = 1


class Perm(enum.Flag):
    R = 1
    W = 2
    X = 4


Best = namedtuple("Best", "step loss weight")


class Split(NamedTuple):
    train: float
    val: float


CLASSES = {"tests.Precision": Precision, "tests.Stage": Stage, "tests.Perm": Perm,
           "tests.Best": Best, "tests.Split": Split}


@pytest.fixture
def registered(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torchtree, "_CONVERTERS", dict(torchtree._CONVERTERS))
    for name, cls in CLASSES.items():
        s4weights.register_type(name, cls)


def assert_exact(got: Any, want: Any, path: str = "<root>") -> None:
    """``got`` is ``want`` loaded back: the same types all the way down, the same values (floats
    by their bits, tensors by :func:`assert_same`), the same enum members, deque maxlens,
    default factories, folds and timezones (offset and name)."""
    assert type(got) is type(want), f"{path}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor | np.ndarray | np.generic | float):
        assert_same(got, want, path)
    elif isinstance(want, enum.Enum):
        assert got is want, f"{path}: {got!r} is not {want!r}"
    elif isinstance(want, argparse.Namespace):
        assert_exact(vars(got), vars(want), path)
    elif isinstance(want, dict):
        assert list(got) == list(want), f"{path}: keys {list(got)} != {list(want)}"
        assert getattr(got, "default_factory", None) is getattr(want, "default_factory", None)
        for k in want:
            assert_exact(got[k], want[k], f"{path}.{k}")
    elif isinstance(want, list | tuple | deque):
        assert getattr(got, "maxlen", None) == getattr(want, "maxlen", None), path
        assert len(got) == len(want), f"{path}: length {len(got)} != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            assert_exact(g, w, f"{path}.{i}")
    elif isinstance(want, dt.time | dt.datetime):
        assert (got, got.fold) == (want, want.fold), f"{path}: {got!r} != {want!r}"
        assert_exact(got.tzinfo, want.tzinfo, f"{path}.tzinfo")
    elif isinstance(want, dt.timezone):
        assert got.__getinitargs__() == want.__getinitargs__(), f"{path}: {got!r} != {want!r}"
    else:
        assert got == want, f"{path}: {got!r} != {want!r}"


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--data-dir", type=Path, default=Path("/data"))
    ap.add_argument("--precision", type=Precision, choices=list(Precision),
                    default=Precision.BF16)
    ap.add_argument("--stage", type=Stage.__getitem__, default=Stage.MAIN)
    ap.add_argument("--layers", type=int, nargs="+", default=[2, 2])
    ap.add_argument("--resume", type=Path)
    ap.add_argument("--tag", action="append")
    ap.add_argument("--no-compile", dest="compile", action="store_false")
    return ap.parse_args(["--lr", "0.001", "--data-dir", "runs/exp 1", "--precision", "32",
                          "--stage", "WARMUP", "--layers", "3", "4", "--tag", "a", "--tag",
                          "b", "--no-compile"])


def training_checkpoint() -> dict[str, Any]:
    """A torch.save-style dict of two real training steps and what scripts keep beside them."""
    tr = Trainer()
    tr.step()
    tr.step()
    od = OrderedDict(a=1, b=2, c=3)
    od.move_to_end("a")
    return {
        "epoch": 3, "global_step": tr.step_no, **tr.state(), "args": parse_args(),
        "saved_at": dt.datetime(2026, 12, 1, 15, 4, 5, 123456, tzinfo=dt.timezone.utc),
        "started": dt.datetime(2026, 11, 1, 1, 30, fold=1,
                               tzinfo=dt.timezone(dt.timedelta(hours=-5), "EST")),
        "naive": dt.datetime(2026, 12, 1, 9), "deadline": dt.date(2028, 2, 29),
        "daily_at": dt.time(3, 0, tzinfo=dt.timezone(dt.timedelta(hours=5, minutes=30))),
        "elapsed": dt.timedelta(hours=3, microseconds=17), "budget": dt.timedelta(-2),
        "paths": [Path("/ckpt/last.s4w"), PurePosixPath("rel/x"),
                  PureWindowsPath("C:\\runs\\exp 1")],
        "loss_history": deque([torch.tensor(0.5), 0.25], maxlen=100),
        "tokens": Counter({"the": 10, "a": 3, "zero": 0}),
        "per_class": defaultdict(list, {0: [torch.ones(2)], 7: []}),
        "nested": defaultdict(Counter, {"x": Counter(a=1)}),
        "best": Best(2, 0.125, tr.model.fc1.weight.detach()),
        "split": Split(0.9, 0.1), "perm": Perm.R | Perm.W, "none": Perm(0),
        "od": od,
    }


def test_a_training_checkpoint_round_trips_exactly(registered) -> None:
    ckpt = training_checkpoint()
    got = roundtrip(ckpt)
    assert_exact(got, ckpt)
    # a tensor inside a named tuple still shares its storage with the model's weight
    assert got["best"].weight.untyped_storage().data_ptr() \
        == got["model"]["fc1.weight"].untyped_storage().data_ptr()
    assert got["args"].data_dir == Path("runs/exp 1") and got["args"].precision is Precision.FP32


def test_contents_keep_the_key_paths_of_the_python_values(registered) -> None:
    buf = io.BytesIO()
    s4weights.save(training_checkpoint(), buf)
    with s4format.Reader(buf.getvalue()) as r:
        names = {t.name for t in r.tensors}
    assert {"loss_history.0", "per_class.0.0"} <= names


def test_into_fills_tensors_inside_python_containers(registered) -> None:
    ckpt = training_checkpoint()
    buf = io.BytesIO()
    s4weights.save(ckpt, buf)
    dest = training_checkpoint()
    for t in (dest["loss_history"][0], dest["per_class"][0][0]):
        t.zero_()
    got = s4weights.load(buf.getvalue(), into=dest)
    assert got["loss_history"][0] is dest["loss_history"][0]
    assert_exact(got, ckpt)


def test_lightning_hyperparameters_round_trip_through_a_real_fit(registered,
                                                                 tmp_path: Path) -> None:
    L = pytest.importorskip("lightning")
    from torch.utils.data import DataLoader, TensorDataset

    from s4weights.lightning import S4CheckpointIO

    class Module(L.LightningModule):
        def __init__(self, args: argparse.Namespace, lr: float, data_dir: Path,
                     precision: Precision, warmup: dt.timedelta, started: dt.datetime,
                     split: Split, class_weights: dict) -> None:
            super().__init__()
            self.save_hyperparameters()
            self.net = torch.nn.Linear(4, 1)

        def training_step(self, batch, _index):
            return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=self.hparams.lr)

    args = parse_args()
    model = Module(args, 0.01, Path("/data/x"), Precision.BF16, dt.timedelta(minutes=5),
                   dt.datetime(2026, 12, 1, tzinfo=dt.timezone.utc), Split(0.8, 0.2),
                   defaultdict(float, {"cat": 2.0}))
    data = DataLoader(TensorDataset(torch.randn(4, 4), torch.randn(4, 1)), batch_size=4)
    trainer = L.Trainer(max_epochs=1, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        default_root_dir=tmp_path, plugins=[S4CheckpointIO()])
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Lightning's advice on workers and logging
        trainer.fit(model, data)
    [path] = (tmp_path / "checkpoints").iterdir()
    ckpt = s4weights.load(path)
    assert_exact(ckpt["hyper_parameters"], dict(model.hparams))
    assert_exact(ckpt["hyper_parameters"]["args"], args)
    assert list(ckpt["hyper_parameters"]) == ["args", "lr", "data_dir", "precision", "warmup",
                                              "started", "split", "class_weights"]
