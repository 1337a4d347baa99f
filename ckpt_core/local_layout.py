"""The local tier's pure decisions: which ranks share a node, where replicas go, which step to recover.

Plain functions over plain data (no files, no ``torch.distributed``): the
local tier (``local_tier``) feeds them what each rank found on its node.

Ranks are laid out as torchrun lays them out: node ``n`` runs ranks
``n * node_size .. n * node_size + node_size - 1``. Rank ``r``'s snapshot is
replicated to the ranks ``r + j * node_size`` (``j = 1 .. factor - 1``, modulo
the world size): each replica on another node, as NVIDIA Resiliency
Extension's cliques with ``replication_jump = node_size``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Mapping, Optional


@dataclass(frozen=True)
class Holding:
    """A committed snapshot of ``owner``'s state at ``step``, found on the node of rank ``holder``."""

    owner: int
    step: int
    holder: int


def node_of(rank: int, node_size: int) -> int:
    return rank // node_size


def layout_problem(world_size: int, node_size: int, factor: int) -> Optional[str]:
    """Why these settings cannot lay out replicas (None when they can)."""
    if node_size < 1 or world_size % node_size:
        return (f"the world size {world_size} is not a multiple of local_node_size={node_size} (ranks per node); "
                "set local_node_size to the number of ranks on each node")
    nodes = world_size // node_size
    if factor > nodes:
        return (f"replication_factor={factor} needs {factor} nodes, the job has {nodes} "
                f"({world_size} ranks, {node_size} per node); use replication_factor <= {nodes}")
    return None


def default_factor(world_size: int, node_size: int) -> int:
    """2 when the job spans more than one node (one replica on a peer node), else 1."""
    return 2 if world_size // max(node_size, 1) > 1 else 1


def replica_targets(rank: int, world_size: int, node_size: int, factor: int) -> list[int]:
    """The ranks that keep a replica of ``rank``'s snapshots, one per other node, in send order."""
    return [(rank + j * node_size) % world_size for j in range(1, factor)]


def replica_sources(rank: int, world_size: int, node_size: int, factor: int) -> list[int]:
    """The ranks whose snapshots ``rank`` keeps a replica of, in the order ``replica_targets`` sends them."""
    return [(rank - j * node_size) % world_size for j in range(1, factor)]


def copy_nodes(owner: int, world_size: int, node_size: int, factor: int) -> list[int]:
    """The nodes that keep a copy of ``owner``'s snapshots: its own node first, then its replicas' nodes."""
    return [node_of(r, node_size) for r in [owner] + replica_targets(owner, world_size, node_size, factor)]


def owners_scanned_by(rank: int, world_size: int, node_size: int) -> list[int]:
    """The owners whose snapshots ``rank`` looks for on its node: the ranks of its node share the work."""
    return [o for o in range(world_size) if o % node_size == rank % node_size]


def complete_steps(holdings: Iterable[Holding], world_size: int) -> list[int]:
    """Steps for which every rank's snapshot is held somewhere, newest first."""
    owners: dict[int, set[int]] = {}
    for h in holdings:
        if 0 <= h.owner < world_size:
            owners.setdefault(h.step, set()).add(h.owner)
    return sorted((s for s, o in owners.items() if len(o) == world_size), reverse=True)


def choose_sources(holdings: Iterable[Holding], step: int, world_size: int, node_size: int,
                   excluded: Iterable[tuple[int, int]] = ()) -> Optional[dict[int, int]]:
    """For each owner, the rank whose node serves its snapshot of ``step`` (the owner itself when its own node holds
    one, else the lowest holder); None when some owner has no usable copy.

    ``excluded``: ``(owner, node)`` copies already found bad.
    """
    bad = set(excluded)
    holders: dict[int, list[int]] = {}
    for h in holdings:
        if h.step == step and (h.owner, node_of(h.holder, node_size)) not in bad:
            holders.setdefault(h.owner, []).append(h.holder)
    out: dict[int, int] = {}
    for owner in range(world_size):
        ranks = sorted(set(holders.get(owner, ())))
        if not ranks:
            return None
        same_node = [r for r in ranks if node_of(r, node_size) == node_of(owner, node_size)]
        out[owner] = owner if same_node else ranks[0]
    return out


def choose_recovery(holdings: Iterable[Holding], world_size: int, node_size: int, not_below: Optional[int],
                    excluded: Iterable[tuple[int, int]] = ()) -> Optional[tuple[int, dict[int, int]]]:
    """The newest step (at least ``not_below``, the durable tier's newest) every rank can be restored from, with
    its sources (``choose_sources``); None when the durable tier is as new or no step is complete."""
    held = list(holdings)
    bad = list(excluded)
    for step in complete_steps(held, world_size):
        if not_below is not None and step < not_below:
            return None
        sources = choose_sources(held, step, world_size, node_size, bad)
        if sources is not None:
            return step, sources
    return None


def slot_to_reuse(slots: Mapping[int, Optional[int]]) -> int:
    """Of the slots (index -> step it holds, None when empty), the one to overwrite: an empty one, else the oldest.

    With ``keep + 1`` slots this never overwrites the ``keep`` newest snapshots.
    """
    empty = [k for k, step in sorted(slots.items()) if step is None]
    if empty:
        return empty[0]
    return min(slots, key=lambda k: (slots[k], k))


def space_needed(own_bytes: int, keep: int, factor: int, ranks_on_node: int) -> int:
    """Bytes a node's ``local_dir`` holds at most: ``keep + 1`` slots per snapshot kept, own and replicas."""
    return ranks_on_node * host_bytes_per_rank(own_bytes, keep, factor)


def host_bytes_per_rank(own_bytes: int, keep: int, factor: int) -> int:
    """Host memory one rank's slots take: ``keep + 1`` slots of its own snapshot and of each replica it keeps
    (``factor - 1`` of them), each about its own state's size."""
    return (keep + 1) * factor * own_bytes


def budget_problem(own_bytes: int, keep: int, factor: int, limit: Optional[int]) -> Optional[str]:
    """Why the local tier's slots do not fit in ``max_host_memory_bytes`` (None: they fit, or no limit)."""
    need = host_bytes_per_rank(own_bytes, keep, factor)
    if limit is None or need <= limit:
        return None
    return (f"the local tier's slots need {size_text(need)} of host memory per rank ((local_keep {keep} + 1) x "
            f"{factor} copies x {size_text(own_bytes)}), more than max_host_memory_bytes allows "
            f"({size_text(limit)}); raise max_host_memory_bytes, or lower local_keep or replication_factor")


def size_text(nbytes: int) -> str:
    """``812 bytes`` below 1 MiB, else ``3.5 MiB``."""
    return f"{nbytes} bytes" if nbytes < 2**20 else f"{nbytes / 2**20:.1f} MiB"
