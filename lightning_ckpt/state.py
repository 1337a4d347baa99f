"""Lightning's own training state as one ``Stateful`` for ``ckpt_core.TrainState(extra=...)``.

What ``Trainer.save_checkpoint`` would write besides the module, optimizers
and schedulers: the fit loop's progress (global step, epoch, batch index),
the precision plugin (grad scaler), other callbacks' ``state_dict`` and the
datamodule's ``state_dict``. It travels in the per-rank blob, which is read
back with ``weights_only=True``: states that would need arbitrary unpickling
are left out with a warning instead of making the checkpoint unloadable.
"""

from __future__ import annotations

import copy
import io
import logging
from typing import Any

import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

log = logging.getLogger("lightning_ckpt")


def weights_only_loadable(obj: Any) -> bool:
    """Whether ``obj`` survives ``torch.save`` + ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    try:
        torch.save(obj, buf)
        buf.seek(0)
        torch.load(buf, weights_only=True)
    except Exception:  # noqa: BLE001 - any failure means: not loadable safely
        return False
    return True


class LightningTrainerState:
    """``state_dict``/``load_state_dict`` over the trainer's loop, precision plugin, callbacks and datamodule."""

    def __init__(self, trainer: Any, owner: Any = None) -> None:
        self.trainer = trainer
        self.owner = owner
        self._skipped: set[str] = set()

    def _safe(self, name: str, state: Any) -> bool:
        if weights_only_loadable(state):
            return True
        if name not in self._skipped:
            self._skipped.add(name)
            rank_zero_warn(f"DistributedCheckpoint: the state of {name} holds objects that cannot be loaded with "
                           "weights_only=True; it is left out of the checkpoint")
        return False

    def state_dict(self) -> dict[str, Any]:
        trainer = self.trainer
        loop = dict(trainer.fit_loop.state_dict())
        # The data position is saved by TrainState (global, reshardable); drop Lightning's copy of it.
        loop["state_dict"] = {k: v for k, v in loop.get("state_dict", {}).items() if k != "combined_loader"}
        callbacks = {}
        for cb in trainer.callbacks:
            if cb is self.owner:
                continue
            state = cb.state_dict()
            if state and self._safe(f"callback {cb.state_key}", state):
                callbacks[cb.state_key] = state
        datamodule = {}
        if trainer.datamodule is not None:
            state = trainer.datamodule.state_dict()
            if state and self._safe("the datamodule", state):
                datamodule = state
        precision = trainer.precision_plugin.state_dict()
        return {"fit_loop": loop, "precision": precision, "callbacks": callbacks, "datamodule": datamodule,
                **self._module_description()}

    def _module_description(self) -> dict[str, Any]:
        """What ``ckpt export --format lightning`` needs for ``load_from_checkpoint``: hyperparameters, version."""
        import lightning

        module = self.trainer.lightning_module
        out: dict[str, Any] = {"lightning_version": lightning.__version__}
        hparams = dict(getattr(module, "hparams", None) or {})
        if hparams and self._safe("the LightningModule's hyperparameters", hparams):
            out["hyper_parameters"] = hparams
            if getattr(module, "_hparams_name", None):
                out["hparams_name"] = module._hparams_name
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        trainer = self.trainer
        trainer.fit_loop.load_state_dict(state["fit_loop"])
        if state.get("precision"):
            trainer.precision_plugin.load_state_dict(state["precision"])
        saved = state.get("callbacks", {})
        for cb in trainer.callbacks:
            if cb is not self.owner and cb.state_key in saved:
                cb.load_state_dict(copy.deepcopy(saved[cb.state_key]))
        if trainer.datamodule is not None and state.get("datamodule"):
            trainer.datamodule.load_state_dict(state["datamodule"])


def validation_follows(trainer: Any) -> bool:
    """Whether Lightning validates right after the batch that just ended (asked in ``on_train_batch_end``).

    The same test the training epoch loop makes after the batch, over the same counters, so every rank
    answers alike. A time-based ``val_check_interval`` answers "no": the clock moves between the two checks.
    """
    if getattr(trainer, "_val_check_time_interval", None) is not None or not trainer.enable_validation:
        return False
    loop = trainer.fit_loop.epoch_loop
    return bool(loop._should_check_val_fx(trainer.fit_loop._data_fetcher))
