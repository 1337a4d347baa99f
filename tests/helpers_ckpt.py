"""Build real checkpoints for tests (and break them on purpose).

    model = make_checkpoints(root, steps=(10, 20, 30))       # 3 committed checkpoints, returns the model
    tear(step_path(root, 20))                                 # delete manifest.json: a torn save
    name = flip_byte(step_path(root, 30))                     # corrupt one .distcp shard
    garbage_manifest(step_path(root, 10))                     # an unparseable manifest
    full = make_fsdp_checkpoint(root, step=5, world_size=2)   # FSDP2 save from 2 gloo processes

``root`` may be a local path or any fsspec URL (``memory://...``), except for
``make_fsdp_checkpoint``, whose worker processes need a shared (local) root.
"""

from __future__ import annotations

import os
import socket
import tempfile
from typing import Any, Iterable, Optional

import torch
from torch import nn

from ckpt_core.storage import get_fs, join, step_dirname


def assert_same_tree(a: Any, b: Any, where: str = "") -> None:
    """Nested dicts/lists/tuples equal, every tensor ``torch.equal`` (same dtype and shape): optimizer states."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        assert isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor), where
        assert a.dtype == b.dtype and torch.equal(a, b), where
    elif isinstance(a, dict):
        assert isinstance(b, dict) and a.keys() == b.keys(), where
        for k in a:
            assert_same_tree(a[k], b[k], f"{where}.{k}")
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_same_tree(x, y, f"{where}[{i}]")
    else:
        assert a == b, (where, a, b)


def save_distinct(root: str, state: Any, model: nn.Module, steps: Iterable[int], **kwargs: Any) -> dict:
    """Synchronous checkpoints of ``state`` at ``steps``, the parameters shifted by ``0.01 * step`` before each;
    returns the model's weights at each step."""
    from ckpt_core import CheckpointManager

    weights = {}
    with CheckpointManager(str(root), async_mode="off", handle_preemption=False, **kwargs) as m:
        for step in steps:
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.01 * step)
            m.save(step, state)
            weights[step] = {k: v.clone() for k, v in model.state_dict().items()}
    return weights


def restore_warned(root: str, state: Any, **kwargs: Any) -> tuple[Any, str]:
    """Restore the newest valid checkpoint under ``root`` into ``state``: ``(info, the warnings joined by ' | ')``."""
    import warnings

    from ckpt_core import CheckpointManager

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with CheckpointManager(str(root), async_mode="off", handle_preemption=False, **kwargs) as m:
            info = m.restore(state)
    return info, " | ".join(str(w.message) for w in caught)


def run_cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    """``ckpt ARGV`` in this process: ``(exit code, stdout, stderr)``; never a traceback."""
    from ckpt_core.cli import main

    code = main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in out + err
    return code, out, err


def tiny_model(seed: int = 0) -> nn.Module:
    """A small MLP with odd sizes (uneven shards) and a BatchNorm (an int64 buffer)."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(7, 5), nn.BatchNorm1d(5), nn.ReLU(), nn.Linear(5, 3))


def _train_step(model: nn.Module, opt: torch.optim.Optimizer, sched: Optional[object] = None) -> None:
    model.train()
    opt.zero_grad()
    model(torch.randn(4, 7)).pow(2).mean().backward()
    opt.step()
    if sched is not None:
        sched.step()


def make_checkpoints(
    root: str,
    steps: Iterable[int] = (10, 20, 30),
    async_mode: str = "off",
    model: Optional[nn.Module] = None,
    metrics: Optional[dict[int, dict[str, float]]] = None,
    **manager_kwargs,
) -> nn.Module:
    """Save one checkpoint per step under ``root`` (one training step between saves); return the model.

    The state holds the model, an Adam optimizer, a StepLR scheduler and RNG
    states. After the call the model holds the weights of the last step.
    """
    from ckpt_core import CheckpointManager, TrainState

    model = model if model is not None else tiny_model()
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.9)
    state = TrainState(model=model, optimizers=opt, schedulers=sched)
    with CheckpointManager(str(root), async_mode=async_mode, **manager_kwargs) as mgr:
        for step in steps:
            _train_step(model, opt, sched)
            mgr.save(step, state, metrics=(metrics or {}).get(step))
    return model


def step_path(root: str, step: int) -> str:
    """The directory of checkpoint ``step`` under ``root``."""
    return join(str(root), step_dirname(step))


def tear(path: str) -> None:
    """Make checkpoint ``path`` torn: remove its manifest.json (the commit marker)."""
    fs, p = get_fs(path)
    fs.rm_file(join(p, "manifest.json"))


def garbage_manifest(path: str, data: bytes = b"{not json") -> None:
    """Overwrite checkpoint ``path``'s manifest.json with garbage."""
    fs, p = get_fs(path)
    fs.pipe_file(join(p, "manifest.json"), data)


def flip_byte(path: str, name: Optional[str] = None, offset: Optional[int] = None) -> str:
    """Flip one byte (in the middle by default) of file ``name`` (the first ``.distcp`` shard by default).

    The size stays the same, so only a checksum check notices. Returns the file name.
    """
    fs, p = get_fs(path)
    if name is None:
        name = sorted(os.path.basename(f) for f in fs.ls(p, detail=False) if f.endswith(".distcp"))[0]
    fpath = join(p, name)
    data = bytearray(fs.cat_file(fpath))
    i = len(data) // 2 if offset is None else offset
    data[i] ^= 0xFF
    fs.pipe_file(fpath, bytes(data))
    return name


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sharded_model_factory(rank: int, world: int, port: int, rows: int, cols: int, length: int) -> Any:
    """Join a gloo group of ``world`` on ``port`` as ``rank``; a function of a seed giving a module with a matrix
    ``w`` (``rows`` x ``cols``) and a vector ``v`` (``length``), both DTensors sharded by rows over the ranks."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,))

    def model(seed: int) -> nn.Module:
        g = torch.Generator().manual_seed(seed)
        m = nn.Module()
        m.w = nn.Parameter(distribute_tensor(torch.randn(rows, cols, generator=g), mesh, [Shard(0)]))
        m.v = nn.Parameter(distribute_tensor(torch.randn(length, generator=g), mesh, [Shard(0)]))
        return m

    return model


def _fsdp_worker(rank: int, world_size: int, port: int, root: str, step: int, full_out: str, seed: int) -> None:
    import torch.distributed as dist
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    from torch.distributed.fsdp import fully_shard

    from ckpt_core import CheckpointManager, TrainState

    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size)
    try:
        model = tiny_model(seed)
        for layer in (model[0], model[3]):
            fully_shard(layer)
        fully_shard(model)
        opt = torch.optim.Adam(model.parameters(), lr=1e-2)
        # the same batch on every rank: BatchNorm buffers are replicated, not synchronised, and DCP keeps
        # one rank's copy, so they must agree for the full state dict of rank 0 to equal the checkpoint
        torch.manual_seed(100)
        _train_step(model, opt)
        with CheckpointManager(root, async_mode="off") as mgr:
            mgr.save(step, TrainState(model=model, optimizers=opt))
        full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if rank == 0:
            torch.save({k: v.clone() for k, v in full.items()}, full_out)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def make_fsdp_checkpoint(root: str, step: int = 5, world_size: int = 2, seed: int = 0) -> dict[str, torch.Tensor]:
    """Save an FSDP2 (``fully_shard``) checkpoint from ``world_size`` gloo processes under local ``root``.

    Returns the model's full state dict as rank 0 gathered it after the save
    (``get_model_state_dict(full_state_dict=True)``), for comparisons.
    """
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as tmp:
        full_out = os.path.join(tmp, "full.pt")
        mp.spawn(_fsdp_worker, args=(world_size, free_port(), str(root), step, full_out, seed),
                 nprocs=world_size, join=True)
        return torch.load(full_out, weights_only=True)
