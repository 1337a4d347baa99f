"""``TrainState``: everything a run needs to continue, as one DCP ``Stateful``.

Layout of what is handed to DCP (keys of the top-level dict):

* ``model`` / ``optim``: from ``torch.distributed.checkpoint.state_dict``
  (``get_state_dict``), so plain modules, DDP and FSDP2 shard and reshard;
* ``ranks.<r>``: per rank, one byte tensor holding that rank's small state
  (RNG, schedulers, scaler, counters, data position, extras), serialised with
  ``torch.save`` and read back with ``weights_only=True``. Small Python state
  keeps its exact structure this way (int keys, empty dicts, tuples), which
  DCP's own flattening would not.
"""

from __future__ import annotations

import functools
import io
import logging
import warnings
from typing import Any, Mapping, Optional, Sequence, Union

import torch
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from . import rng as rng_mod
from .ddp_layout import fix_bucket_layout
from .inplace_read import aligned_empty_like
from .data import ResumableLoader, find_resumable_sampler

log = logging.getLogger("ckpt_core")

RANK_KEY = "ranks"


class StateMismatchError(ValueError):
    """The checkpoint does not fit the state being restored (other model, other shapes)."""


def _rank_world(group: Any = None) -> tuple[int, int]:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(group), dist.get_world_size(group)
    return 0, 1


def _to_blob(obj: Any) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_blob(t: torch.Tensor) -> Any:
    return torch.load(io.BytesIO(t.numpy().tobytes()), weights_only=True)


def _empty_like_tree(obj: Any) -> Any:
    """Fresh buffers shaped like the tensors of ``obj`` (large ones block-aligned, for direct reads)."""
    if isinstance(obj, torch.Tensor):
        return aligned_empty_like(obj)
    if isinstance(obj, Mapping):
        return {k: _empty_like_tree(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_empty_like_tree(v) for v in obj]
    return obj


class TrainState(Stateful):
    """Holds model, optimizers, schedulers, scaler, data position, RNG, counters and extras.

    ``dataloader`` may be a ``ResumableLoader``, a DataLoader built on
    ``ResumableDistributedSampler`` (position is then global and survives a
    world-size change), a torchdata ``StatefulDataLoader`` or any object with
    ``state_dict``/``load_state_dict`` (kept per rank). ``extra`` objects are
    saved from every rank and restored from the same rank (rank 0's at a new
    world size).

    Create it before the first training step, on every rank: a DDP model's
    gradient buckets are fixed here (``ddp_layout``), so that a resumed run
    sums gradients in the same order as the original at every step.
    """

    def __init__(
        self,
        model: Optional[nn.Module] = None,
        optimizers: Union[torch.optim.Optimizer, Sequence[torch.optim.Optimizer], None] = None,
        schedulers: Union[Any, Sequence[Any], None] = None,
        scaler: Optional[Any] = None,
        dataloader: Optional[Any] = None,
        rng: bool = True,
        step: int = 0,
        epoch: int = 0,
        extra: Optional[Mapping[str, Any]] = None,
        state_dict_options: Optional[StateDictOptions] = None,
    ) -> None:
        if optimizers is not None and model is None:
            raise ValueError("TrainState(optimizers=...) needs model=...: optimizer state is keyed by parameter names")
        self.model = model
        self.optimizers = _as_list(optimizers)
        self.schedulers = _as_list(schedulers)
        self.scaler = scaler
        self.dataloader = dataloader
        self.rng = rng
        self.step = int(step)
        self.epoch = int(epoch)
        self.extra = dict(extra or {})
        for name, obj in [("scaler", scaler), ("dataloader", dataloader), *self.extra.items()]:
            if obj is not None and not (hasattr(obj, "state_dict") and hasattr(obj, "load_state_dict")):
                raise TypeError(f"TrainState {name}={type(obj).__name__} has no state_dict()/load_state_dict()")
        self.options = state_dict_options or StateDictOptions()
        fix_bucket_layout(model)

    # --- capture -------------------------------------------------------------
    def _model_optim(self) -> dict[str, Any]:
        if self.model is None:
            return {}
        # DCP initialises an optimizer that has not stepped yet (a step with zero gradients and lr 0) to know
        # its state's shape; that state is saved, then taken off the live optimizer again, so a save before
        # the first step does not change training (Adam would count one step more).
        self._fresh_optimizers = [not opt.state for opt in self.optimizers]
        model_sd, optim_sd = get_state_dict(self.model, self.optimizers, options=self.options)
        _forget_initialised_state(self.optimizers, self._fresh_optimizers)
        out: dict[str, Any] = {"model": model_sd}
        if self.optimizers:
            out["optim"] = optim_sd
        return out

    def _data_state(self) -> Optional[dict[str, Any]]:
        if self.dataloader is None:
            return None
        sampler = find_resumable_sampler(getattr(self.dataloader, "loader", self.dataloader))
        if sampler is not None:
            return {"kind": "global", "state": sampler.state_dict()}
        return {"kind": "per_rank", "state": self.dataloader.state_dict()}

    def small_state(self) -> dict[str, Any]:
        """Everything but model/optimizer, as plain Python and tensors."""
        return {
            "progress": {"step": self.step, "epoch": self.epoch},
            "schedulers": [s.state_dict() for s in self.schedulers],
            "scaler": None if self.scaler is None else self.scaler.state_dict(),
            "data": self._data_state(),
            "rng": rng_mod.capture() if self.rng else None,
            "extra": {k: v.state_dict() for k, v in self.extra.items()},
            "fresh_optimizers": list(getattr(self, "_fresh_optimizers", [])),
        }

    def state_dict(self) -> dict[str, Any]:
        rank, _ = _rank_world()
        out = self._model_optim()
        out[RANK_KEY] = {str(rank): _to_blob(self.small_state())}
        return out

    def contents(self) -> dict[str, Any]:
        """A JSON summary of what a checkpoint of this state carries (for the manifest)."""
        data = self._data_state()
        return {
            "model": self.model is not None,
            "optimizers": len(self.optimizers),
            "schedulers": [type(s).__name__ for s in self.schedulers],
            "scaler": None if self.scaler is None else type(self.scaler).__name__,
            "rng": self.rng,
            "data_position": None if data is None else data["kind"],
            "extra": sorted(self.extra),
        }

    # --- restore -------------------------------------------------------------
    def live_objects(self) -> list[Any]:
        """The objects whose tensors a restore writes into: the model and the optimizers."""
        return [o for o in (self.model, *self.optimizers) if o is not None]

    def load_template(self, metadata: Any, saved_world_size: int, in_place: bool = False
                      ) -> tuple[dict[str, Any], dict[str, int]]:
        """What DCP loads into, and which saved ranks' small state we need.

        ``in_place``: the model and optimizer entries are the live tensors
        themselves (their state dict, as DCP loads), so a restore needs no
        second copy of the state and touches no fresh memory; a load that fails
        half-way leaves them partly overwritten (``overwritten``). Otherwise they
        are fresh buffers, and a failed load leaves the run untouched.
        """
        rank, world = _rank_world()
        live = self._model_optim()
        template = live if in_place else _empty_like_tree(live)
        if "model" in template:
            _check_keys(template, metadata)
        source, _ = rng_mod.remap_rng_source(rank, saved_world_size)
        wanted = {"own": source, "zero": 0}
        blobs = {}
        for r in set(wanted.values()):
            md = metadata.state_dict_metadata.get(f"{RANK_KEY}.{r}")
            if md is None:
                raise StateMismatchError(f"the checkpoint has no per-rank state for rank {r}")
            blobs[str(r)] = torch.empty(md.size, dtype=torch.uint8)
        template[RANK_KEY] = blobs
        return template, wanted

    def saved_progress(self, loaded: Mapping[str, Any], wanted: Mapping[str, int]) -> tuple[int, int]:
        """``(step, epoch)`` of a loaded checkpoint, after checking the shape of the small state ``apply`` uses.

        Raises ``ValueError`` for a blob that does not decode (``weights_only``)
        or lacks what ``apply`` needs, before anything is applied.
        """
        blobs = {}
        for key in sorted(set(wanted.values())):
            try:
                blobs[key] = _from_blob(loaded[RANK_KEY][str(key)])
            except Exception as e:  # noqa: BLE001 - an undecodable blob: the checkpoint is not loadable
                raise ValueError(f"the state of rank {key} does not decode: {type(e).__name__}: {e}") from None
            _check_small_state(blobs[key], key)
        progress = blobs[wanted["zero"]]["progress"]
        return progress["step"], progress["epoch"]

    def apply(self, loaded: Mapping[str, Any], wanted: Mapping[str, int], saved_world_size: int,
              weights_only: bool = False) -> None:
        """Apply a fully loaded checkpoint (from ``load_template`` buffers) to the live objects.

        ``weights_only``: the model's weights and the step/epoch counters only (evaluation, inference).
        """
        rank, world = _rank_world()
        same_world = saved_world_size == world
        own = _from_blob(loaded[RANK_KEY][str(wanted["own"])])
        zero = _from_blob(loaded[RANK_KEY][str(wanted["zero"])])
        if self.model is not None:
            set_state_dict(
                self.model,
                self.optimizers,
                model_state_dict=loaded["model"],
                optim_state_dict=loaded.get("optim", {}),
                options=self.options,
            )
            fresh = zero.get("fresh_optimizers") or []
            _forget_initialised_state(self.optimizers, [bool(f) for f in fresh][: len(self.optimizers)])
        self.step = int(zero["progress"]["step"])
        self.epoch = int(zero["progress"]["epoch"])
        if weights_only:
            return
        if len(zero["schedulers"]) != len(self.schedulers):
            raise StateMismatchError(
                f"the checkpoint has {len(zero['schedulers'])} scheduler(s), this run has {len(self.schedulers)}"
            )
        for sched, sd in zip(self.schedulers, zero["schedulers"]):
            sched.load_state_dict(sd)
        if self.scaler is not None and zero["scaler"] is not None:
            self.scaler.load_state_dict(zero["scaler"])
        for name, obj in self.extra.items():
            src = own if same_world else zero
            if name not in src["extra"]:
                raise StateMismatchError(f"the checkpoint has no extra state named {name!r}")
            obj.load_state_dict(src["extra"][name])
        self._apply_data(own, zero, same_world)
        if self.rng and own["rng"] is not None:
            restore_rng = functools.partial(self.apply_rng, own["rng"], same_world, rank, saved_world_size)
            if isinstance(self.dataloader, ResumableLoader):
                self.dataloader.defer(restore_rng)
            else:
                restore_rng()

    def _apply_data(self, own: Mapping[str, Any], zero: Mapping[str, Any], same_world: bool) -> None:
        if self.dataloader is None or zero["data"] is None:
            return
        data = zero["data"] if zero["data"]["kind"] == "global" else own["data"]
        sampler = find_resumable_sampler(getattr(self.dataloader, "loader", self.dataloader))
        if data["kind"] == "global" and sampler is not None:
            sampler.load_state_dict(data["state"])
        elif data["kind"] == "per_rank" and sampler is None:
            if not same_world:
                warnings.warn(
                    "the data loader position was saved per rank at another world size and cannot be "
                    "resharded; the epoch restarts. Use ResumableDistributedSampler to keep the global order.",
                    stacklevel=3,
                )
                return
            self.dataloader.load_state_dict(data["state"])
        else:
            raise StateMismatchError(
                f"the checkpoint's data position is {data['kind']!r} but this run's data loader "
                f"{'uses' if sampler else 'does not use'} a ResumableDistributedSampler"
            )

    @staticmethod
    def apply_rng(state: Mapping[str, torch.Tensor], same_world: bool, rank: int, saved_world_size: int) -> None:
        rng_mod.apply(dict(state))
        if not same_world:
            _, times = rng_mod.remap_rng_source(rank, saved_world_size)
            rng_mod.decorrelate(times)
            if rank == 0:
                warnings.warn(
                    f"resuming at a different world size than the checkpoint's ({saved_world_size}): RNG states "
                    "were remapped (rank r takes saved rank r % saved_world_size); the run is not bit-exact",
                    stacklevel=3,
                )

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Stateful protocol: apply a state dict produced by ``state_dict()`` at the same world size."""
        _, world = _rank_world()
        key = int(next(iter(state_dict[RANK_KEY])))
        self.apply(state_dict, {"own": key, "zero": key}, world)


_SMALL_STATE_TYPES = {"progress": dict, "schedulers": list, "extra": dict}


def _forget_initialised_state(optimizers: list, fresh: list) -> None:
    """Empty the state of the optimizers that had none before DCP initialised it (``fresh``)."""
    for opt, was_fresh in zip(optimizers, fresh):
        if was_fresh:
            opt.state.clear()


def _check_small_state(blob: Any, rank: int) -> None:
    """What ``small_state`` wrote: the keys and types ``apply`` relies on."""
    if not isinstance(blob, dict):
        raise ValueError(f"the state of rank {rank} is a {type(blob).__name__}, not a dict")
    for key, kind in _SMALL_STATE_TYPES.items():
        if not isinstance(blob.get(key), kind):
            raise ValueError(f"the state of rank {rank} has no {key!r} {kind.__name__}")
    for key in ("step", "epoch"):
        value = blob["progress"].get(key)
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"the state of rank {rank} has no valid progress {key!r}")
    for key in ("scaler", "data", "rng"):
        if key not in blob:
            raise ValueError(f"the state of rank {rank} has no {key!r} entry")


def _as_list(x: Any) -> list[Any]:
    if x is None:
        return []
    if isinstance(x, (list, tuple)):
        return list(x)
    return [x]


def _check_keys(template: Mapping[str, Any], metadata: Any) -> None:
    """Name the missing/unexpected keys and mismatched shapes of a checkpoint of another model."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict({"model": template["model"]})
    saved = {k for k in metadata.state_dict_metadata if k.startswith("model.")}
    missing = sorted(set(flat) - saved)
    unexpected = sorted(saved - set(flat))
    shapes = []
    for k in sorted(set(flat) & saved):
        md = metadata.state_dict_metadata[k]
        if isinstance(md, TensorStorageMetadata) and isinstance(flat[k], torch.Tensor):
            if tuple(md.size) != tuple(flat[k].shape):
                shapes.append(f"{k[6:]}: checkpoint {tuple(md.size)}, model {tuple(flat[k].shape)}")
    if missing or unexpected or shapes:
        parts = []
        if missing:
            parts.append(f"missing keys: {', '.join(m[6:] for m in missing[:20])}")
        if unexpected:
            parts.append(f"unexpected keys: {', '.join(u[6:] for u in unexpected[:20])}")
        if shapes:
            parts.append(f"mismatched shapes: {'; '.join(shapes[:20])}")
        raise StateMismatchError("the checkpoint does not fit this model: " + " | ".join(parts))
