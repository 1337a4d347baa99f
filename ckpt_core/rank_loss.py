"""A rank lost in the middle of a save or restore: tell it from other failures, name it, fail fast.

Every collective of the checkpoint code runs on gloo groups whose timeout is
``collective_timeout_s`` (``collectives.checkpoint_groups``, and the writer
process's group in ``background``). When a rank dies, the others' collective
fails at once (its sockets close); when a node hangs or drops off the
network, it fails after that timeout. Either way the error gloo raises names
a socket, not a rank, and a retry, a fallback to an older checkpoint or
``on_save_error="warn"`` would only walk into the next collective with the
same missing peer. So such failures become ``RankLostError``: the surviving
ranks call the roll of the job through the rendezvous store (never a
collective), name the ranks that do not answer, and the run stops for the
launcher to restart it.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable, Optional

import torch.distributed as dist

from .coordination import _default_store
from .errors import causes, describe, is_fatal

log = logging.getLogger("ckpt_core")

ROLL_CALL_WINDOW_S = 10.0
"""How long survivors wait for each other at the roll call (at most ``collective_timeout_s``)."""


class RankLostError(RuntimeError):
    """A collective of a save or restore failed or timed out: a rank died or hangs. The job must be restarted."""

    def __init__(self, stage: str, step: Optional[int], missing: Optional[list[int]], cause: BaseException,
                 timeout_s: float) -> None:
        at = f"{stage} at step {step}" if step is not None else stage
        if missing:
            who = f"rank{'s' if len(missing) > 1 else ''} {', '.join(map(str, missing))} did not answer"
        elif missing is None:
            who = "the ranks lost could not be named (the rendezvous store did not answer: the rank hosting it, " \
                  "rank 0 outside torchrun, may be the one lost)"
        else:
            who = "every rank answered the roll call afterwards (a network fault between ranks)"
        super().__init__(
            f"the checkpoint {at} cannot complete: {who}; a collective failed (collective_timeout_s="
            f"{timeout_s:g}): {describe(cause)}. Restart the job (torchrun --max-restarts, a SLURM requeue): it "
            "resumes from the newest committed checkpoint")
        self.stage, self.step, self.missing, self.cause = stage, step, missing, cause


def is_collective_failure(exc: BaseException) -> bool:
    """Whether ``exc`` is (or wraps) a failed or timed-out collective: gloo's transport errors, ``DistError``."""
    for e in causes(exc):
        if isinstance(e, dist.DistError):
            return True
        if type(e) is RuntimeError and "gloo" in str(e) and any(
                s in str(e) for s in ("Connection closed", "Connection reset", "Timed out", "Broken pipe",
                                      "Connection refused", "Socket closed")):
            return True
    return False


def missing_ranks(tag: str, window_s: float, store: Any = None) -> Optional[list[int]]:
    """The ranks that do not answer a roll call under ``tag`` within ``window_s``; None if the store does not answer.

    Every surviving rank calls it after the same failure (``tag`` names the stage and
    step); it runs on a daemon thread, so that a store whose host hangs cannot hang it.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    store = store if store is not None else _default_store()
    if store is None:
        return None
    rank, world = dist.get_rank(), dist.get_world_size()
    out: dict[str, Any] = {}

    def roll_call() -> None:
        keys = [f"ckpt_core/alive/{tag}/{r}" for r in range(world)]
        store.set(keys[rank], b"1")
        deadline = time.monotonic() + window_s
        while True:
            missing = [r for r, k in enumerate(keys) if not store.check([k])]
            if not missing or time.monotonic() >= deadline:
                out["missing"] = missing
                return
            time.sleep(0.05)

    t = threading.Thread(target=_quietly, args=(roll_call,), name="ckpt-roll-call", daemon=True)
    t.start()
    t.join(window_s + 5.0)
    return out.get("missing")


def _quietly(fn: Any) -> None:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - a store that fails means: the ranks cannot be named
        log.debug("ckpt_core: roll call failed: %s", e)


def rank_lost(stage: str, step: Optional[int], cause: BaseException, timeout_s: float) -> RankLostError:
    """The ``RankLostError`` for ``cause``, naming the ranks that miss the roll call."""
    missing = missing_ranks(f"{stage}/{step}", min(ROLL_CALL_WINDOW_S, timeout_s))
    err = RankLostError(stage, step, missing, cause, timeout_s)
    log.error("ckpt_core: %s", err)
    return err


class FailFast:
    """``with FailFast(stage, step, timeout_s):`` turns a collective failure inside into ``RankLostError``."""

    def __init__(self, stage: str, step: "Optional[int] | Callable[[], Optional[int]]", timeout_s: float) -> None:
        self.stage, self.step, self.timeout_s = stage, step, timeout_s

    def __enter__(self) -> "FailFast":
        return self

    def __exit__(self, exc_type: Any, exc: Optional[BaseException], tb: Any) -> None:
        if exc is None or isinstance(exc, RankLostError) or is_fatal(exc) or not is_collective_failure(exc):
            return
        step = self.step() if callable(self.step) else self.step
        step = getattr(exc, "step", None) if step is None else step
        raise rank_lost(self.stage, step, exc, self.timeout_s) from exc
