"""Recovery from the local tier: find, agree on, move, check and apply the newest complete snapshot.

Every rank reports the committed snapshots it finds on its node (its share of
the owner directories, ``local_layout.owners_scanned_by``); the ranks agree on
the newest step that every rank's snapshot is held for (``choose_recovery``),
a rank reads its own from its node or receives it from the holder, checks it
into fresh buffers (record, CRC32C, fingerprint, step and epoch) and only then
applies it. A bad copy is excluded and the choice made again; nothing usable
leaves the durable tier to decide.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Optional

import torch

from . import fingerprint as fp
from . import local_layout as layout
from . import local_snapshot as snap
from .collectives import first_problem
from .errors import RestoreError, describe
from .local_transfer import Outgoing, exchange
from .state import RANK_KEY, StateMismatchError, TrainState

if TYPE_CHECKING:
    from .local_tier import LocalTier

log = logging.getLogger("ckpt_core")


class Recovery:
    """One recovery attempt of ``tier``'s rank (collective: every rank runs it at once)."""

    def __init__(self, tier: "LocalTier") -> None:
        self.tier = tier
        self.rank, self.world_size, self.node_size = tier.rank, tier.world_size, tier.node_size
        self.job, self.root = tier.job, tier.root
        self._group, self.process_group = tier._group, tier.process_group
        self.owner_dir = tier.owner_dir
        self._other_worlds: set[int] = set()
        self.timings: dict[str, float] = {}
        """Seconds to discover, load (read or receive, check, rebuild), apply and verify after applying."""

    def run(self, state: TrainState, durable_step: Optional[int]) -> Optional[snap.SnapshotRecord]:
        """Restore the newest step every rank can restore from node memory, if newer than ``durable_step``
        (collective). None: the durable tier decides (the log says why)."""
        t0 = time.monotonic()
        found = self._scan()
        holdings = [layout.Holding(o, s, h) for h, mine in enumerate(self._group.all_gather(sorted(found)))
                    for o, s in mine]
        excluded: list[tuple[int, int]] = []
        while True:
            choice = layout.choose_recovery(holdings, self.world_size, self.node_size, durable_step, excluded)
            if choice is None:
                self._say_why_not(holdings, durable_step, excluded)
                return None
            step, sources = choice
            t1 = time.monotonic()
            self.timings["discover"] = t1 - t0
            loaded, rec, bad = self._fetch(step, sources, found, state)
            problems = [p for p in self._group.all_gather(bad) if p is not None]
            self.timings["load"] = time.monotonic() - t1  # read or received, checked into fresh buffers
            if not problems:
                assert loaded is not None and rec is not None
                return self._apply(loaded, rec, state)
            for owner, node, why in problems:
                if self.rank == 0:
                    log.warning("ckpt_core: local snapshot of rank %d at step %d on node %d is not usable: %s",
                                owner, step, node, why)
                excluded.append((owner, node))

    def _scan(self) -> dict[tuple[int, int], snap.SnapshotRecord]:
        """The committed snapshots of this job and world size that this rank looks for on its node (the world
        sizes of the job's other snapshots go to ``_other_worlds``)."""
        found = {}
        for owner in layout.owners_scanned_by(self.rank, self.world_size, self.node_size):
            for step, path in snap.list_records(self.owner_dir(owner)).items():
                rec = snap.read_record(path)
                if rec is None or (rec.job, rec.owner, rec.step) != (self.job, owner, step):
                    continue
                if rec.world_size == self.world_size:
                    found[(owner, step)] = rec
                else:
                    self._other_worlds.add(rec.world_size)
        return found

    def _say_why_not(self, holdings: list[layout.Holding], durable_step: Optional[int],
                     excluded: list[tuple[int, int]]) -> None:
        if self.rank != 0:
            return
        complete = layout.complete_steps(holdings, self.world_size)
        if excluded:
            log.warning("ckpt_core: local tier: no complete snapshot newer than the durable tier's step %s is "
                        "usable (%d bad copies, named above); restoring from the durable tier", durable_step,
                        len(excluded))
        elif not holdings and self._other_worlds:
            log.warning("ckpt_core: local tier: the snapshots of this job are for world size %s, this run has %d: "
                        "resharding goes through the durable tier", "/".join(map(str, sorted(self._other_worlds))),
                        self.world_size)
        elif not holdings:
            log.info("ckpt_core: local tier: no snapshot of this job at world size %d in %s; restoring from the "
                     "durable tier (another world size reshards through the durable tier)", self.world_size,
                     self.root)
        elif not complete:
            log.warning("ckpt_core: local tier: no step has a snapshot of every rank (lost nodes or replicas); "
                        "restoring from the durable tier")
        else:
            log.info("ckpt_core: local tier: newest complete snapshot is step %d, the durable tier has step %s; "
                     "restoring from the durable tier", complete[0], durable_step)

    def _fetch(self, step: int, sources: dict[int, int], found: dict, state: TrainState
               ) -> tuple[Optional[dict], Optional[snap.SnapshotRecord], Optional[tuple[int, int, str]]]:
        """Read or receive this rank's snapshot of ``step`` and rebuild it into fresh buffers; the problem
        ``(owner, node, why)`` when it is not usable."""
        outgoing = [self._outgoing(found.get((o, step)), o) for o, h in sorted(sources.items())
                    if h == self.rank and o != self.rank]
        src = sources[self.rank]
        remote = [src] if src != self.rank else []
        node = layout.node_of(src, self.node_size)
        try:
            incoming = exchange(self.process_group, outgoing, remote, lambda _s, _r, n: torch.empty(n, dtype=torch.uint8))
            if incoming:
                inc = incoming[0]
                if not inc.record:
                    return None, None, (self.rank, node, "the holder could not read it")
                rec = snap.parse_record(inc.record, f"rank {self.rank}'s snapshot at step {step} from rank {src}")
                data, extra = inc.data, inc.extra
            else:
                rec, data, extra = self._read_own(step)
            if (rec.job, rec.owner, rec.step, rec.world_size) != (self.job, self.rank, step, self.world_size):
                raise snap.SnapshotError(f"the record is rank {rec.owner}'s snapshot at step {rec.step}")
            snap.check_bytes(rec, data, extra, f"rank {self.rank}'s snapshot at step {step}")
            return snap.rebuild(rec, data, extra, state), rec, None
        except (snap.SnapshotError, StateMismatchError, OSError) as e:
            return None, None, (self.rank, node, describe(e))

    def _outgoing(self, rec: Optional[snap.SnapshotRecord], owner: int) -> Outgoing:
        if rec is None:
            return Outgoing(owner)
        try:
            directory = self.owner_dir(owner)
            with open(os.path.join(directory, f"step_{rec.step}.json"), "rb") as f:
                body = f.read()
            data = snap.map_readonly(snap.slot_path(directory, rec.slot), rec.data_bytes)
            with open(os.path.join(directory, f"step_{rec.step}.extra"), "rb") as f:
                extra = f.read()
            return Outgoing(owner, body, data, extra)
        except (OSError, snap.SnapshotError) as e:
            log.warning("ckpt_core: cannot send rank %d's snapshot at step %d: %s", owner, rec.step, describe(e))
            return Outgoing(owner)

    def _read_own(self, step: int) -> tuple[snap.SnapshotRecord, torch.Tensor, bytes]:
        directory = self.owner_dir(self.rank)
        path = os.path.join(directory, f"step_{step}.json")
        with open(path, "rb") as f:
            rec = snap.parse_record(f.read(), path)
        data = snap.map_readonly(snap.slot_path(directory, rec.slot), rec.data_bytes)  # rebuild copies out of it
        with open(os.path.join(directory, f"step_{step}.extra"), "rb") as f:
            extra = f.read()
        return rec, data, extra

    def _apply(self, loaded: dict, rec: snap.SnapshotRecord, state: TrainState) -> Optional[snap.SnapshotRecord]:
        """Every rank holds a checked snapshot: rank 0's small state to all, check the progress, apply, verify."""
        zero = self._group.broadcast(bytes(loaded[RANK_KEY][str(0)].numpy()) if self.rank == 0 else None)
        loaded[RANK_KEY]["0"] = torch.frombuffer(bytearray(zero), dtype=torch.uint8)
        wanted = {"own": self.rank, "zero": 0}
        problem = None
        try:
            if state.saved_progress(loaded, wanted) != (rec.step, rec.epoch):
                problem = ("progress", f"rank {self.rank}'s snapshot is not at step {rec.step}, epoch {rec.epoch}")
        except ValueError as e:
            problem = ("progress", str(e))
        agreed = first_problem(self._group, problem)
        if agreed is not None:
            log.warning("ckpt_core: local snapshot at step %d is not usable: %s", rec.step, agreed[1])
            return None
        t0 = time.monotonic()
        state.apply(loaded, wanted, self.world_size)
        t1 = time.monotonic()
        diffs = fp.compare(snap.expected_fingerprint(rec), snap.live_fingerprint(state))
        self.timings.update(apply=t1 - t0, verify=time.monotonic() - t1)
        if diffs:
            raise RestoreError(f"after restoring step {rec.step} from the local tier the state differs from the "
                               f"snapshot: {'; '.join(diffs[:5])}")
        return rec
