"""The resume check: the first losses after a save are recorded; after a resume they must come out the same.

A resumed run that is not the run that was saved (another data order, a
missing RNG state, a changed model) shows in its first losses. Rank 0 keeps,
after each save, the next ``steps`` losses next to that checkpoint
(``first_losses.json``, written by the ``write`` side effect the caller
passes); a run resumed from it at the same world size compares its own first
losses with them and warns or raises (``policy``). Plain data in, decisions
out: testable without storage or ``torch.distributed``.
"""

from __future__ import annotations

import json
import logging
import warnings
from typing import Any, Callable, Mapping, Optional

from .errors import RestoreError
from .strict_json import as_float, as_int, loads_object

LOSSES_NAME = "first_losses.json"

log = logging.getLogger("ckpt_core")


def parse_losses(text: bytes) -> dict[int, float]:
    """The losses recorded after a save (``first_losses.json``): ``{step: loss}``, or ``ValueError``."""
    body = loads_object(text, LOSSES_NAME, ValueError)
    losses = body.get("losses")
    if not isinstance(losses, list):
        raise ValueError(f"{LOSSES_NAME} has no list of losses")
    out = {}
    for entry in losses:
        if not isinstance(entry, list) or len(entry) != 2:
            raise ValueError(f"{LOSSES_NAME} entries must be [step, loss]")
        out[as_int(entry[0], ValueError)] = as_float(entry[1], ValueError, finite=False)
    return out


def losses_match(loss: float, expected: float) -> bool:
    """Equal, or within a relative 1e-6 (a loss printed and parsed back may differ in its last digit)."""
    return loss == expected or abs(loss - expected) <= 1e-6 * max(abs(expected), 1e-12)


class ResumeCheck:
    """Rank 0's record of the losses after each save, and their comparison after a resume."""

    def __init__(self, policy: str, steps: int, write: Callable[[int, bytes], None]) -> None:
        self.policy, self.steps, self._write = policy, steps, write
        self._window: Optional[tuple[int, list]] = None
        self._expected: dict[int, float] = {}
        self.failures: list[str] = []

    def saved(self, step: int) -> None:
        """A checkpoint of ``step`` was started: record the next ``steps`` losses for it."""
        if self.steps:
            self._window = (step, [])

    def resumed(self, expected: dict[int, float]) -> None:
        """Resumed from a checkpoint whose recorded losses are ``expected`` (empty: nothing to compare)."""
        self._expected = dict(expected) if self.policy != "off" else {}

    def wants(self, step: int) -> bool:
        """Whether the loss of ``step`` is used (lets callers skip a device sync otherwise)."""
        return step in self._expected or (self._window is not None and step > self._window[0])

    def record(self, step: int, loss: float) -> None:
        """The training loss of ``step``: compared when expected, kept when a window is open."""
        loss = float(loss)
        if step in self._expected:
            self._compare(step, loss, self._expected.pop(step))
        window = self._window
        if window is not None and step > window[0]:
            window[1].append([step, loss])
            if len(window[1]) >= self.steps:
                self._window = None
                self._write(window[0], json.dumps({"step": window[0], "losses": window[1]}).encode())

    def _compare(self, step: int, loss: float, expected: float) -> None:
        if losses_match(loss, expected):
            if not self._expected:
                log.info("ckpt_core: resume check passed: the first losses match the original run")
            return
        msg = (f"resume check: loss at step {step} is {loss!r} after the resume, {expected!r} in the "
               f"original run: the resumed run diverged from the saved one")
        self.failures.append(msg)
        if self.policy == "raise":
            raise RestoreError(msg)
        warnings.warn(msg, stacklevel=3)
        log.warning("ckpt_core: %s", msg)


def recorded_losses(checkpoint_path: str, storage_options: Optional[Mapping[str, Any]] = None) -> dict[int, float]:
    """The losses recorded after the checkpoint at ``checkpoint_path``; empty when there are none or they are bad."""
    from .storage import get_fs, join

    try:
        fs, path = get_fs(checkpoint_path, **dict(storage_options or {}))
        return parse_losses(fs.cat_file(join(path, LOSSES_NAME)))
    except (OSError, ValueError):
        return {}
