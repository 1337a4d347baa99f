"""The restorer: discover, choose, load, verify, apply; fall back past what cannot be used.

Rank 0 lists the candidates (newest valid first, or exactly the one asked
for) and checks each; every rank reads the manifest and ``.metadata`` and
loads through DCP (resharding) into the live model and optimizer tensors
(``restore_in_place``, the default) or into fresh buffers; the rest of the
state is applied only once the loaded tensors match the saved fingerprint and
the state's own step and epoch match the manifest. A problem on any rank is
agreed on by all, so every rank falls back to the same older checkpoint,
which overwrites whatever the failed attempt loaded. The model and optimizers
stay marked as partly overwritten (``overwritten``) from the first write into
them until a whole checkpoint is in.

The fingerprint of the loaded tensors is summed while the load reads
(``early_sums``); after the load only what that could not sum is summed.
After the apply, a tensor that is still the memory it was loaded into keeps
the fingerprint entry it was given after the load; the others are summed
again.
"""

from __future__ import annotations

import logging
import time
import warnings
from typing import Any, Optional

import torch
import torch.distributed.checkpoint as dcp

from . import fingerprint as fp
from . import overwritten, signing
from .collectives import RankGroup, first_problem
from .config import CheckpointSettings
from .dcp_io import SafeLoadPlanner, make_reader
from .discovery import choose_for_restore, list_records, read_manifest, record_at, validate
from .early_sums import EarlySums
from .errors import RestoreError, describe, is_fatal, release_frames
from .manifest import Manifest, ManifestError
from .rank_loss import is_collective_failure
from .records import CheckpointInfo
from .state import RANK_KEY, StateMismatchError, TrainState
from .storage import MANIFEST_NAME, get_fs, join

log = logging.getLogger("ckpt_core")


class Unloadable(Exception):
    """This checkpoint cannot be used (every rank agrees); the restorer falls back to an older one."""


class Restorer:
    """Restores checkpoints under ``root`` (or at any path) into a ``TrainState``; collective."""

    def __init__(self, root: str, settings: CheckpointSettings, group: RankGroup, process_group: Any) -> None:
        self.root, self.settings, self._group, self._pg = root, settings, group, process_group
        self.fs, self.root_path = get_fs(root, **settings.storage_options)
        self.timings: dict[str, float] = {}
        self.fallbacks = 0  # checkpoints skipped at the last restore (rank 0 also counts those passed over unread)
        self.loading: Optional[int] = None  # the step of the checkpoint being read (error messages)
        self.summed_early = 0  # local tensors of the last load summed while it read (``early_sums``)
        self._weights_only = False
        self._signing_key = signing.settings_key(settings)

    def restore(self, state: TrainState, step: Optional[int], path: Optional[str], weights_only: bool = False,
                listed: Optional[list[CheckpointInfo]] = None) -> tuple[Optional[CheckpointInfo], set[int]]:
        """The checkpoint restored into ``state`` (None: nothing to restore) and the committed steps listed.

        ``step``/``path`` ask for exactly one checkpoint: a problem with it raises ``RestoreError``;
        otherwise problems fall back to the next older candidate, with a warning naming them.
        ``weights_only``: ``state`` asks for the model alone (evaluation, inference), so only the model's
        part of the fingerprint must match; a full restore must restore everything the checkpoint holds.
        """
        self._weights_only = weights_only
        t0 = time.monotonic()
        self.timings = {}
        self.fallbacks = 0
        explicit = step is not None or path is not None
        candidates, committed = self._group.broadcast(
            self._candidates(step, path, listed) if self._group.rank == 0 else None)
        if explicit and not candidates:
            raise RestoreError(f"no committed checkpoint at step {step} under {self.root}")
        for rec in candidates:
            self.loading = rec.step
            problem = self._group.broadcast(self._problem(rec) if self._group.rank == 0 else None)
            self.timings["discover"] = time.monotonic() - t0
            if problem is None:
                try:
                    self._load_and_apply(rec, state)
                    overwritten.clear(state.live_objects())
                    log.info("ckpt_core: restored step %d from %s in %.2fs %s", rec.step, rec.path,
                             time.monotonic() - t0, self.timings)
                    return rec, committed
                except Unloadable as e:
                    problem = str(e)
            self._fall_back(rec, problem, explicit, state)
        if candidates:
            raise RestoreError(f"no checkpoint under {self.root} could be restored (tried steps "
                               f"{[r.step for r in candidates]}); see the warnings above" + _left_over(state))
        return None, committed

    def _fall_back(self, rec: CheckpointInfo, problem: str, explicit: bool, state: TrainState) -> None:
        msg = f"checkpoint {rec.path} (step {rec.step}) is not usable: {problem}"
        if explicit:
            raise RestoreError(msg + _left_over(state))
        self.fallbacks += 1
        if self._group.rank == 0:
            warnings.warn(msg + "; falling back to an older checkpoint", stacklevel=4)
        log.warning("ckpt_core: %s; falling back", msg)

    def owns(self, rec: CheckpointInfo) -> bool:
        """Whether ``rec`` lies directly under the root (a rollback may then move newer ones aside)."""
        _, rec_path = get_fs(rec.path, **self.settings.storage_options)
        return rec_path.rstrip("/").rsplit("/", 1)[0] == self.root_path.rstrip("/")

    def set_aside_newer(self, step: int) -> list[int]:
        """After a rollback to ``step``, move newer checkpoints to ``rolled_back/<time>/`` (never delete them).

        Rank 0 moves; every rank returns the steps moved (collective).
        """
        moved: list[int] = []
        if self._group.rank == 0:
            newer = [r for r in list_records(self.root, self.settings.storage_options) if r.step > step]
            if newer:
                dest = join(self.root_path, "rolled_back", time.strftime("%Y%m%dT%H%M%S", time.gmtime()))
                self.fs.makedirs(dest, exist_ok=True)
                for r in newer:
                    src = get_fs(r.path, **self.settings.storage_options)[1]
                    self.fs.mv(src, join(dest, src.rstrip("/").rsplit("/", 1)[-1]), recursive=True)
                    moved.append(r.step)
                log.warning("ckpt_core: rolled back to step %d; moved newer checkpoints %s to %s", step, moved, dest)
        return self._group.broadcast(moved)

    # ---------------------------------------------------------------- rank 0
    def _candidates(self, step: Optional[int], path: Optional[str], listed: Optional[list[CheckpointInfo]]
                    ) -> tuple[list[CheckpointInfo], set[int]]:
        if path is not None:
            fs, fs_path = get_fs(path, **self.settings.storage_options)
            return [record_at(fs, path.rstrip("/"), fs_path)], set()
        records = listed if listed is not None else list_records(self.root, self.settings.storage_options)
        chosen = choose_for_restore(records, step)
        if step is None:
            self.fallbacks += _report_skipped(records, chosen[0].step if chosen else -1)
        return chosen, {r.step for r in records if r.committed}

    def _read_manifest(self, rec: CheckpointInfo, authenticate: bool = True) -> Manifest:
        """The manifest of ``rec``; with a signing key, authenticated (``SignatureError`` if not signed with it)."""
        fs, fs_path = get_fs(rec.path, **self.settings.storage_options)
        manifest = read_manifest(fs, fs_path)
        if self._signing_key is None or not authenticate:
            return manifest
        return signing.authenticate(manifest, self._signing_key, MANIFEST_NAME)

    def _problem(self, rec: CheckpointInfo) -> Optional[str]:
        if not rec.committed:
            return rec.problem or "not committed"
        try:
            manifest = self._read_manifest(rec, authenticate=False)
        except (FileNotFoundError, ManifestError) as e:
            return f"manifest: {e}"
        if (manifest.step, manifest.checkpoint_id) != (rec.step, rec.checkpoint_id):
            return "its manifest changed while it was being restored"
        if self._signing_key is not None:
            try:
                manifest = signing.authenticate(manifest, self._signing_key, MANIFEST_NAME)
            except signing.SignatureError as e:
                return str(e)
        try:
            # every rank unpickles .metadata next (_prepare_load), under the same allowlist
            return validate(rec.path, manifest, self.settings.verify, self.settings.storage_options,
                            unpickle_metadata=False)
        except BaseException as e:  # noqa: BLE001 - any failure to check it means: fall back
            if is_fatal(e):
                raise
            return f"cannot be checked: {describe(e)}"

    # ------------------------------------------------------------- every rank
    def _prepare_load(self, rec: CheckpointInfo, state: TrainState) -> tuple[Any, Manifest, dict, dict]:
        """Read and check the manifest and ``.metadata``, build what DCP loads into; agree on problems."""
        problem = None
        try:
            manifest = self._read_manifest(rec)
            reader = make_reader(rec.path, self.settings.storage_options,
                                 manifest if self.settings.verify != "none" else None, self.settings.direct_io)
            metadata = reader.read_metadata()
            check_world_size(manifest, metadata)
            template, wanted = state.load_template(metadata, manifest.world_size, self.settings.restore_in_place)
        except StateMismatchError as e:
            problem = ("mismatch", str(e))
        except BaseException as e:  # noqa: BLE001 - CheckpointException is a BaseException: fall back on it too
            if is_fatal(e) or is_collective_failure(e):  # a lost rank: no older checkpoint would load either
                raise
            problem = ("unloadable", f"{describe(e)}")
        agreed = first_problem(self._group, problem)
        if agreed is not None:
            kind, msg = agreed
            raise StateMismatchError(msg) if kind == "mismatch" else Unloadable(msg)
        return reader, manifest, template, wanted

    def _load(self, rec: CheckpointInfo, state: TrainState) -> tuple[Manifest, dict, dict, dict, dict]:
        """Load ``rec`` and check it; the manifest, the loaded template, the ranks wanted, the loaded model and
        optimizer tensors (flat) and the local entries of their fingerprint."""
        t0 = time.monotonic()
        reader, manifest, template, wanted = self._prepare_load(rec, state)
        if self.settings.restore_in_place:
            overwritten.mark(state.live_objects(), _restoring(rec))
        targets = _tensors(template)
        reader.early_sums = early = EarlySums(
            {k: t for k, (t, _) in fp.local_jobs(targets, fp.group_rank(self._pg)).items()})
        try:
            self._read(template, reader)
            t1 = time.monotonic()
            self.timings["load"] = t1 - t0
            flat, summed = _tensors(template), {}
            known = _unmoved(early.entries(), targets, flat)  # waits for the sums still running
            self.timings["fingerprint"] = time.monotonic() - t1
            self.summed_early = len(known)
            diffs = fp.compare(self._expected(manifest), self._fingerprint(flat, known, summed))
        finally:
            early.close()
        if diffs:
            raise Unloadable("loaded tensors do not match the saved fingerprint: " + "; ".join(diffs[:5]))
        try:
            check_progress(manifest, state.saved_progress(template, wanted))
        except ValueError as e:
            raise Unloadable(str(e)) from None
        self.timings["verify"] = time.monotonic() - t1
        return manifest, template, wanted, flat, summed

    def _read(self, template: dict, reader: Any) -> None:
        """``dcp.load`` into ``template``; a failure that an older checkpoint might not have is ``Unloadable``."""
        try:
            dcp.load(template, storage_reader=reader, planner=SafeLoadPlanner(), process_group=self._pg)
        except BaseException as e:  # noqa: BLE001 - any load failure means: fall back
            if is_fatal(e) or is_collective_failure(e):
                raise
            release_frames(e)  # the fallback must not keep this attempt's buffers and groups alive
            raise Unloadable(f"loading failed: {describe(e)}") from e

    def _fingerprint(self, flat: dict, known: dict, summed: Optional[dict] = None) -> dict:
        """The fingerprint of ``flat`` (all ranks; ``fp.global_entries``'s ``known`` and ``summed``); its time adds
        up in ``timings["fingerprint"]``, part of verify."""
        t0 = time.monotonic()
        try:
            return fp.global_entries(flat, self._pg, intra_op=True, known=known, summed=summed)  # no training runs
        finally:
            self.timings["fingerprint"] += time.monotonic() - t0

    def _expected(self, manifest: Manifest) -> dict:
        if not self._weights_only:
            return manifest.fingerprint
        return {k: v for k, v in manifest.fingerprint.items() if k.startswith("model.")}

    def _load_and_apply(self, rec: CheckpointInfo, state: TrainState) -> None:
        manifest, template, wanted, loaded, summed = self._load(rec, state)
        t0 = time.monotonic()
        overwritten.mark(state.live_objects(), _restoring(rec))
        state.apply(template, wanted, manifest.world_size, weights_only=self._weights_only)
        t1 = time.monotonic()
        after = _tensors(state._model_optim())
        diffs = fp.compare(self._expected(manifest), self._fingerprint(after, _unmoved(summed, loaded, after)))
        self.timings.update(apply=t1 - t0, verify=self.timings["verify"] + time.monotonic() - t1)
        if diffs:
            raise RestoreError(
                f"after restoring step {rec.step} the model/optimizer state differs from what was saved: "
                + "; ".join(diffs[:5]))


def _tensors(tree: dict) -> dict:
    """The model and optimizer entries of a state dict, flattened as DCP names them (``model.<fqn>``...)."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    flat, _ = flatten_state_dict({k: v for k, v in tree.items() if k in ("model", "optim")})
    return flat


def _local(flat: dict) -> dict:
    """Each tensor of ``flat`` as the read fills it: a DTensor's local shard, a plain tensor itself."""
    from torch.distributed.tensor import DTensor

    return {k: v.to_local() if isinstance(v, DTensor) else v for k, v in flat.items() if isinstance(v, torch.Tensor)}


def _unmoved(summed: dict, loaded: dict, after: dict) -> dict:
    """The entries of ``summed`` whose tensor the apply left where it was loaded: the same memory, dtype, shape
    and strides under the same name (a load into the live tensors; an optimizer keeping the tensors loaded
    for it). Their bytes are the ones summed; every other tensor is summed again."""
    before, now = _local(loaded), _local(after)
    return {k: e for k, e in summed.items() if k in before and k in now and _same_memory(before[k], now[k])}


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.device, a.dtype, tuple(a.shape), a.stride(), a.data_ptr()) == \
        (b.device, b.dtype, tuple(b.shape), b.stride(), b.data_ptr())


def _restoring(rec: CheckpointInfo) -> str:
    return f"the restore of step {rec.step} from {rec.path}"


def _left_over(state: TrainState) -> str:
    """What a failed restore says about the live state it leaves."""
    what = overwritten.problem(state.live_objects())
    if what is None:
        return ""
    return (f"; the model/optimizer state was partly overwritten by {what} and is not saved until a restore "
            "succeeds (restore_in_place=False loads into separate buffers and leaves it as it was)")


def _report_skipped(records: list[CheckpointInfo], newest: int) -> int:
    """Say why each checkpoint newer than the one chosen was passed over; how many were checkpoints (not torn)."""
    skipped = 0
    for r in records:
        if r.step <= newest:
            continue
        if r.unreadable or (r.problem and "unusable" in r.problem):
            skipped += 1
            warnings.warn(f"checkpoint {r.path} (step {r.step}) is skipped: {r.problem}", stacklevel=5)
        elif r.committed and not r.healthy:
            skipped += 1
            log.warning("ckpt_core: skipping %s (step %d): saved with non-finite values (unhealthy); "
                        "restore(step=%d) loads it explicitly", r.path, r.step, r.step)
        elif not r.committed:
            log.info("ckpt_core: ignoring %s (step %d): %s", r.path, r.step, r.problem)
    return skipped


def check_world_size(manifest: Manifest, metadata: Any) -> None:
    """The manifest's world size is the number of ranks whose state the checkpoint holds."""
    ranks = {k.split(".")[1] for k in metadata.state_dict_metadata if k.startswith(f"{RANK_KEY}.")}
    if ranks and len(ranks) != manifest.world_size:
        raise Unloadable(f"the manifest says world size {manifest.world_size}, the checkpoint holds the state of "
                         f"{len(ranks)} rank(s)")


def check_progress(manifest: Manifest, saved: tuple[int, int]) -> None:
    """The restored step and epoch are the manifest's (a manifest or a shard copied from elsewhere is not)."""
    step, epoch = saved
    if step != manifest.step or (manifest.epoch is not None and epoch != manifest.epoch):
        raise Unloadable(f"the checkpoint's state is at step {step}, epoch {epoch}, its manifest says step "
                         f"{manifest.step}, epoch {manifest.epoch}: its files do not belong together")
