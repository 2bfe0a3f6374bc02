"""Hugging Face integration: :class:`S4Trainer` (``transformers.Trainer``) and
:class:`S4Accelerator` (``accelerate.Accelerator``) write the model's weights and the optimizer's
state as .s4w files in their checkpoint folders, and read them back on resume.

    trainer = S4Trainer(model=model, args=args, train_dataset=ds)   # as transformers.Trainer
    trainer.train(resume_from_checkpoint=True)

    accelerator = S4Accelerator()                                   # as accelerate.Accelerator
    accelerator.save_state("ckpt"); accelerator.load_state("ckpt")

Everything else in a checkpoint folder (config, trainer state, RNG states, scaler, samplers)
stays as the libraries write it. Setups that save their own sharded way (DeepSpeed, FSDP, XLA,
SageMaker model parallel, Megatron-LM) keep the libraries' own files. Needs the ``hf`` extra;
the rest of s4weights never imports this module.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import accelerate
import transformers
from accelerate.utils import DistributedType
from transformers.utils import is_sagemaker_mp_enabled, is_torch_xla_available

import s4weights
from s4format.errors import StorageError

MODEL = "model"
OPTIMIZER = "optimizer"
SCHEDULER = "scheduler"


def _file(folder: str | os.PathLike[str], kind: str, i: int = 0) -> str:
    """``model.s4w``, ``model_1.s4w``, ... as accelerate numbers its files."""
    return os.path.join(folder, f"{kind}{f'_{i}' if i else ''}.s4w")


class S4Trainer(transformers.Trainer):
    """A ``transformers.Trainer`` whose checkpoints hold ``model.s4w``, ``optimizer.s4w`` and
    ``scheduler.s4w`` in place of the weights' safetensors and the optimizer's and
    scheduler's ``torch.save`` files; ``train(resume_from_checkpoint=...)`` and
    ``load_best_model_at_end`` read them. The model's config and the processing class are
    saved as usual, the training arguments as ``training_args.json``."""

    def _s4_saves(self) -> bool:
        return not (self.is_deepspeed_enabled or self.is_fsdp_enabled
                    or is_torch_xla_available() or is_sagemaker_mp_enabled())

    def _save(self, output_dir: str | None = None, state_dict: dict | None = None) -> None:
        if not self._s4_saves():
            return super()._save(output_dir, state_dict)
        output_dir = output_dir if output_dir is not None else self.args.output_dir
        if not self.args.should_save:
            return None
        os.makedirs(output_dir, exist_ok=True)
        model = self.accelerator.unwrap_model(self.model)
        s4weights.save(model.state_dict() if state_dict is None else state_dict,
                       _file(output_dir, MODEL))
        config = getattr(model, "config", None)
        if hasattr(config, "save_pretrained"):
            config.save_pretrained(output_dir)
        processor = getattr(self, "processing_class", None) or getattr(self, "tokenizer", None)
        if processor is not None:
            processor.save_pretrained(output_dir)
        with open(os.path.join(output_dir, "training_args.json"), "w") as fh:
            fh.write(self.args.to_json_string())
        return None

    def _load_s4_model(self, folder: str, model: Any) -> bool:
        path = _file(folder, MODEL)
        if not (self._s4_saves() and os.path.isfile(path)):
            return False
        target = self.accelerator.unwrap_model(model if model is not None else self.model)
        target.load_state_dict(s4weights.load(path, map_location="cpu"))
        return True

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model: Any = None) -> None:
        if not self._load_s4_model(resume_from_checkpoint, model):
            super()._load_from_checkpoint(resume_from_checkpoint, model)

    def _load_best_model(self) -> None:
        if not self._load_s4_model(self.state.best_model_checkpoint, None):
            super()._load_best_model()

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        if not self._s4_saves():
            return super()._save_optimizer_and_scheduler(output_dir)
        if self.args.should_save:
            s4weights.save(self.optimizer.state_dict(), _file(output_dir, OPTIMIZER))
            s4weights.save(self.lr_scheduler.state_dict(), _file(output_dir, SCHEDULER))
        return None

    def _load_optimizer_and_scheduler(self, checkpoint: str | None) -> None:
        if checkpoint is None or not self._s4_saves() \
                or not os.path.isfile(_file(checkpoint, OPTIMIZER)):
            return super()._load_optimizer_and_scheduler(checkpoint)
        self.optimizer.load_state_dict(s4weights.load(_file(checkpoint, OPTIMIZER),
                                                      map_location="cpu"))
        self.lr_scheduler.load_state_dict(s4weights.load(_file(checkpoint, SCHEDULER)))
        return None


_OWN_SAVERS = (DistributedType.DEEPSPEED, DistributedType.FSDP, DistributedType.XLA,
               DistributedType.MEGATRON_LM)


class S4Accelerator(accelerate.Accelerator):
    """An ``accelerate.Accelerator`` whose ``save_state``/``load_state`` write and read each
    prepared model's weights (``model.s4w``, ``model_1.s4w``, ...) and each optimizer's state
    (``optimizer.s4w``, ...) through s4weights. The models go through accelerate's
    ``register_save_state_pre_hook``/``register_load_state_pre_hook``; the optimizers, which
    accelerate has no hook for, are kept out of its own files while it saves and loads."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._s4_held: list[Any] = []
        self.register_save_state_pre_hook(self._s4_save)
        self.register_load_state_pre_hook(self._s4_load)

    @contextmanager
    def _optimizers_through_s4(self) -> Iterator[None]:
        if self.distributed_type in _OWN_SAVERS:
            yield
            return
        self._s4_held, self._optimizers = self._optimizers, []
        try:
            yield
        finally:
            self._optimizers, self._s4_held = self._s4_held, []

    def save_state(self, output_dir: str | None = None, safe_serialization: bool = True,
                   **save_model_func_kwargs: Any) -> Any:
        with self._optimizers_through_s4():
            return super().save_state(output_dir, safe_serialization, **save_model_func_kwargs)

    def load_state(self, input_dir: str | None = None, load_kwargs: dict | None = None,
                   **load_model_func_kwargs: Any) -> Any:
        with self._optimizers_through_s4():
            return super().load_state(input_dir, load_kwargs, **load_model_func_kwargs)

    def _s4_save(self, models: list, weights: list, output_dir: str) -> None:
        if self.is_main_process:
            for i, state in enumerate(weights):
                s4weights.save(state, _file(output_dir, MODEL, i))
            for i, opt in enumerate(self._s4_held):
                s4weights.save(opt.state_dict(), _file(output_dir, OPTIMIZER, i))
        weights.clear()  # saved: accelerate writes no safetensors file for them

    def _s4_load(self, models: list, input_dir: str) -> None:
        files = [_file(input_dir, MODEL, i) for i in range(len(models))]
        if files and all(os.path.isfile(f) for f in files):
            for model, path in zip(models, files):
                model.load_state_dict(s4weights.load(path, map_location="cpu"))
            models.clear()  # loaded: accelerate reads no file for them
        for i, opt in enumerate(self._s4_held):
            path = _file(input_dir, OPTIMIZER, i)
            if not os.path.isfile(path):
                raise StorageError(f"{input_dir} holds no {os.path.basename(path)}: it was "
                                   "not written by S4Accelerator.save_state (load it with an "
                                   "accelerate.Accelerator)")
            opt.load_state_dict(s4weights.load(path, map_location="cpu"))


__all__ = ["S4Accelerator", "S4Trainer"]
