"""Restore memory: the RSS that building the state and restoring a checkpoint into it adds, per byte of state.

    python -m benchmarks.restore_memory                     # 256 MiB and 1 GiB, model / model+AdamW, 1 rank
    python -m benchmarks.restore_memory --ranks 1 2         # also 2 ranks over gloo (state sharded)
    python -m benchmarks.restore_memory --size-gib 0.25 --optim none init lazy --phases

For each case a fresh process saves a checkpoint of the benchmarked state
(``_common.build_model``: fp32 tensors of ``--tensor-mib``, sharded over the
ranks; with ``--optim init`` or ``lazy`` also an AdamW whose state was
initialised by one step, i.e. 3x the model's bytes in all), then another fresh
process, per rank:

1. takes the baseline RSS after its imports (``_common.import_lazy_modules``
   included) and process group;
2. builds the same state (``init``: AdamW state initialised by a step, as in a
   run that is restored into after it trained; ``lazy``: AdamW with no state
   yet, which ``get_state_dict`` initialises during the restore; ``none``: the
   model only);
3. creates a ``CheckpointManager`` and restores the checkpoint;

while a thread samples the RSS (``/proc/self/statm``) every 2 ms. The figure is
``restore_rss_ratio = (peak RSS - baseline) / state bytes``, state bytes being
the rank's model + optimizer tensors after the restore; the column
*restore* is what the restore alone added: the peak RSS after the manager
was created above the RSS then, over the same bytes (building an AdamW
state by a training step peaks above the state by itself: its gradients and
temporaries). ``--load in_place`` (the default ``restore_in_place``) loads
into the live tensors: the floor is 1.0 for the whole and 0 for the restore
alone, plus the read's buffers. ``--load fresh`` (``restore_in_place=False``)
loads into fresh buffers applied only after the fingerprint matched: the
floor is 2.0, and 1.0 for the restore alone. Both run by default. ``--phases``
adds the RSS at the boundaries of ``CheckpointManager._load_and_apply``
(template, dcp.load, fingerprint, apply, fingerprint) to find what lies
above that floor.
"""

from __future__ import annotations

import argparse
import itertools
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _common as C  # noqa: E402

OPTIM_MODES = ("none", "init", "lazy")


# ------------------------------------------------------------- worker side
def build_state(size_bytes: int, tensor_bytes: int, rank: int, world: int, optim: str = "none"):
    """The benchmarked model (``C.build_model``, seed 1) and, unless ``optim='none'``, an AdamW over it.

    ``init`` initialises the AdamW state (exp_avg, exp_avg_sq: 2x the model's
    bytes) with one step on made-up gradients, which are freed again.
    Returns ``(model, optimizers)``.
    """
    import torch

    model, _, _ = C.build_model(size_bytes, tensor_bytes, rank, world, seed=1)
    if optim == "none":
        return model, []
    params = list(model.parameters())
    for p in params:
        p.requires_grad_(True)
    opt = torch.optim.AdamW(params, lr=1e-3)
    if optim == "init":
        for p in params:
            p.grad = p.detach() * 0.5 + 0.25
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, [opt]


def install_phase_marks(meter: "C.RssMeter") -> None:
    """Mark the RSS at the phase boundaries of ``CheckpointManager._load_and_apply`` (diagnostic wrappers)."""
    import torch.distributed.checkpoint as dcp

    from ckpt_core import fingerprint as fp
    from ckpt_core.state import TrainState

    def wrap(owner: Any, name: str, label: Any) -> None:
        inner = getattr(owner, name)

        def wrapper(*a: Any, **k: Any) -> Any:
            out = inner(*a, **k)
            meter.mark(label() if callable(label) else label)
            return out

        setattr(owner, name, wrapper)

    n_fp = [0]

    def fp_label() -> str:
        n_fp[0] += 1
        return f"fingerprint.{n_fp[0]}"

    wrap(TrainState, "load_template", "template")
    wrap(dcp, "load", "dcp.load")
    wrap(fp, "global_entries", fp_label)
    wrap(TrainState, "apply", "apply")


def rank_main(rank: int, world: int, rdzv: Any, spec: dict) -> None:
    import torch
    import torch.distributed as dist

    from ckpt_core import CheckpointManager, TrainState

    C.import_lazy_modules(world, spec["optim"] != "none")
    C.init_dist(rank, world, rdzv)
    torch.set_num_threads(spec["threads"])
    out: dict = {"rank": rank}
    if spec["role"] == "save":
        model, opts = build_state(spec["size_bytes"], spec["tensor_bytes"], rank, world, spec["optim"])
        mgr = CheckpointManager(spec["root"], async_mode="off", keep_last=1)
        mgr.save(1, TrainState(model=model, optimizers=opts))
        mgr.close()
    else:
        meter = C.RssMeter(spec["interval_s"]).start()
        model, opts = build_state(spec["size_bytes"], spec["tensor_bytes"], rank, world, spec["optim"])
        meter.mark("build")
        mgr = CheckpointManager(spec["root"], async_mode="off", restore_in_place=spec["in_place"])
        state = TrainState(model=model, optimizers=opts)
        meter.mark("manager")
        if spec["phases"]:
            install_phase_marks(meter)
        rec = mgr.restore(state)
        meter.mark("restored")
        meter.stop()
        out.update(meter.result(C.tensor_bytes(state._model_optim()), after="manager"))
        out["restored_step"] = None if rec is None else rec.step
        mgr.close()
    gathered = [None] * world
    if world > 1:
        dist.all_gather_object(gathered, out)
    else:
        gathered = [out]
    if rank == 0:
        C.write_result(spec, gathered)
    C.barrier()
    C.finish_rank(world)


def worker_main(spec_path: str) -> None:
    C.worker(spec_path, rank_main)


# -------------------------------------------------------------- harness side
def measure(size_bytes: int, tensor_bytes: int, ranks: int = 1, optim: str = "none", phases: bool = False,
            root: Optional[str] = None, log_path: Optional[Path] = None, timeout: float = 900,
            interval_s: float = 0.002, save_ranks: Optional[int] = None, load: str = "in_place") -> dict:
    """Save a checkpoint in one fresh process, restore it in another; the restoring ranks' RSS figures.

    ``save_ranks`` (default ``ranks``) saves at another world size: the restore reshards.
    Returns the worst rank's ``restore_rss_ratio`` and every rank's figures.
    """
    save_ranks = save_ranks or ranks
    log_path = log_path or C.RESULTS_DIR / f"restore_memory_{C.timestamp()}.log"
    threads = max(1, (os.cpu_count() or 1) // ranks)
    with tempfile.TemporaryDirectory(prefix="ckpt-bench-rmem-", dir=root) as tmp:
        base = {"ranks": ranks, "threads": threads, "size_bytes": size_bytes, "tensor_bytes": tensor_bytes,
                "optim": optim, "phases": phases, "interval_s": interval_s, "root": os.path.join(tmp, "ckpt"),
                "in_place": load == "in_place"}
        label = f"{size_bytes / C.MiB:.0f} MiB, {ranks} rank(s), optim={optim}, load={load}"
        C.run_worker("restore_memory", {**base, "ranks": save_ranks, "threads": max(1, (os.cpu_count() or 1) // save_ranks),
                                        "role": "save", "label": "save " + label}, timeout, log_path)
        ranks_out = C.run_worker("restore_memory", {**base, "role": "restore", "label": "restore " + label},
                                 timeout, log_path)
    worst = max(ranks_out, key=lambda r: r["rss_ratio"])
    restore_worst = max(ranks_out, key=lambda r: r["added_after_ratio"])
    return {"size_bytes": size_bytes, "tensor_bytes": tensor_bytes, "ranks": ranks, "save_ranks": save_ranks,
            "optim": optim, "load": load,
            "restore_rss_ratio": worst["rss_ratio"], "restore_only_ratio": restore_worst["added_after_ratio"],
            "restore_only_added": restore_worst["added_after"], "maxrss_ratio": max(r["maxrss_ratio"] for r in ranks_out),
            "state_bytes": worst["state_bytes"], "peak_rss_added": worst["peak_rss_added"], "per_rank": ranks_out}


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.restore_memory", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    p.add_argument("--size-gib", type=float, nargs="+", default=[0.25, 1.0])
    p.add_argument("--tensor-mib", type=float, default=64)
    p.add_argument("--ranks", type=int, nargs="+", default=[1])
    p.add_argument("--save-ranks", type=int, default=None,
                   help="save at this many ranks (default: as many as restore; otherwise the restore reshards)")
    p.add_argument("--optim", nargs="+", default=["none", "init"], choices=OPTIM_MODES)
    p.add_argument("--load", nargs="+", default=["in_place", "fresh"], choices=("in_place", "fresh"),
                   help="restore into the live tensors (restore_in_place=True, the default) or into fresh buffers")
    p.add_argument("--phases", action="store_true", help="also mark the RSS at the restore's phase boundaries")
    p.add_argument("--dir", default=None, help="where the checkpoints go (a temporary directory under it)")
    p.add_argument("--out", default=None)
    return p.parse_args(argv)


def main(argv: Optional[list] = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker)
        return 0
    C.exit_on_sigterm()
    stamp = C.timestamp()
    log_path = C.RESULTS_DIR / f"restore_memory_{stamp}.log"
    results = []
    print(f"{'state':>9} {'ranks':>5}{' (saved at %d)' % args.save_ranks if args.save_ranks else ''} {'optim':>5} {'load':>8} {'state/rank':>10} {'peak added':>10} {'ratio':>6} "
          f"{'maxrss':>6} {'restore':>7}", flush=True)
    for size, ranks, optim, load in itertools.product(args.size_gib, args.ranks, args.optim, args.load):
        r = measure(int(size * C.GiB), int(args.tensor_mib * C.MiB), ranks, optim, args.phases,
                    args.dir, log_path, save_ranks=args.save_ranks, load=load)
        results.append(r)
        print(f"{size * 1024:>6.0f}MiB {ranks:>5} {optim:>5} {load:>8} {r['state_bytes'] / C.MiB:>7.0f}MiB "
              f"{r['peak_rss_added'] / C.MiB:>7.0f}MiB {r['restore_rss_ratio']:>6.2f} "
              f"{r['maxrss_ratio']:>6.2f} {r['restore_only_ratio']:>7.2f}", flush=True)
        if args.phases:
            for pr in r["per_rank"]:
                print("      rank %d: %s" % (pr["rank"], ", ".join(
                    f"{p['phase']} {p['rss']:.0f} (peak {p['peak']:.0f}, anon {p['anon']:.0f})" for p in pr["phases_mib"])))
    payload = {"benchmark": "restore_memory", "timestamp": stamp, "machine": C.machine_info(),
               "config": {k: v for k, v in vars(args).items() if k != "worker"}, "results": results}
    paths = C.save_json(f"restore_memory_{stamp}.json", payload, args.out)
    print(f"wrote {', '.join(map(str, paths))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
