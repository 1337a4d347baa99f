"""DDP's gradient bucket layout, fixed before the first step, so that a resumed run reduces exactly as the original.

DDP starts with every parameter in one bucket in parameter order and, after
the first backward, rebuilds its buckets in the order gradients became ready.
A resumed run builds a fresh DDP, so its first step reduces with the initial
layout while the original run, at that step, used the rebuilt one. With 3 or
more ranks the layout decides which ring chunk an element falls in, hence the
order in which its gradients are summed: the resumed run drifts by an ulp at
that step and never comes back (at 2 ranks a sum of two is the same in either
order, which is why this only shows at scale).

``fix_bucket_layout`` makes the first layout the final one in every run:
before the first training step it runs one backward pass of zeros through
each DDP's own reducer, touching the parameters in order, so that the
gradients become ready in reverse parameter order (the order DDP's initial
assignment assumes). DDP then rebuilds its buckets from that order at the
next forward, exactly as it would after a real first step, and never again.
Every run, fresh or resumed, trains with the same buckets; communication still
overlaps backward as in an unprimed run. The pass all-reduces one bucket of
zeros per bucket and leaves every ``.grad`` as it was.
"""

from __future__ import annotations

import logging
from typing import Any, Iterable

import torch
from torch import nn

from .pg_lifetime import hold_process_group

log = logging.getLogger("ckpt_core")


def fix_bucket_layout(*modules: Any) -> int:
    """Prime every fresh DDP instance in ``modules`` (and their submodules); returns how many were primed.

    Collective: every rank calls it at the same point, before the first
    training step (TrainState and both adapters do). DDP instances that have
    already run a backward pass, and configurations whose layout never changes
    or cannot be primed (``find_unused_parameters``, ``static_graph``, sparse
    gradients, the Python reducer), are left alone. Every DDP's process group
    is also held past the DDP (``pg_lifetime``: no hang at exit).
    """
    primed = 0
    for ddp in _ddp_instances(modules):
        hold_process_group(ddp)
        why = _why_not(ddp)
        if why is None:
            _prime(ddp)
            primed += 1
        elif why != "already primed":
            log.debug("ckpt_core: DDP bucket layout left as it is: %s", why)
    return primed


def _ddp_instances(modules: Iterable[Any]) -> list[nn.parallel.DistributedDataParallel]:
    seen: dict[int, nn.parallel.DistributedDataParallel] = {}
    for module in modules:
        if isinstance(module, nn.Module):
            for m in module.modules():
                if isinstance(m, nn.parallel.DistributedDataParallel):
                    seen.setdefault(id(m), m)
    return list(seen.values())


def _why_not(ddp: nn.parallel.DistributedDataParallel) -> Any:
    if getattr(ddp, "_ckpt_layout_fixed", False):
        return "already primed"
    if getattr(ddp, "find_unused_parameters", False):
        return "find_unused_parameters=True: DDP never rebuilds its buckets"
    if getattr(ddp, "static_graph", False) or getattr(ddp, "_use_python_reducer", False):
        return "static_graph or the Python reducer"
    if getattr(ddp, "_has_rebuilt_buckets", False) or any(ddp.reducer.get_backward_stats()):
        return ("this DDP has already run a backward pass: create the TrainState (or attach the adapter) before "
                "the first training step for a resume that is bit-exact at 3+ ranks")
    if any(isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse for m in ddp.module.modules()):
        return "a parameter has sparse gradients"
    return None


def _reducer_params(ddp: nn.parallel.DistributedDataParallel) -> list[torch.Tensor]:
    """The parameters DDP's reducer holds, in its order (as ``_build_params_for_reducer`` lists them)."""
    ignore = getattr(ddp, "parameters_to_ignore", set())
    seen: set[int] = set()
    out = []
    for module_name, module in ddp.module.named_modules():
        for name, p in module.named_parameters(recurse=False):
            full = f"{module_name}.{name}" if module_name else name
            if p.requires_grad and full not in ignore and id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def _prime(ddp: nn.parallel.DistributedDataParallel) -> None:
    params = _reducer_params(ddp)
    grads = [p.grad for p in params]
    ddp.reducer.prepare_for_backward([])
    total = None
    for p in params:  # built in parameter order: autograd reaches the last one first
        term = p.reshape(-1)[:1].sum() * 0
        total = term if total is None else total + term
    if total is not None:
        total.backward()
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g
    ddp._ckpt_layout_fixed = True
