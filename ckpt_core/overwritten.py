"""Live objects a restore has started to write into and not finished: their state is never saved.

A restore loads a checkpoint into the live model and optimizer tensors
(``restore_in_place``, the default) and then applies the rest. When it fails
after the first byte went in and no older checkpoint restores, the model and
optimizers hold a mix of what they held and what was read. They are marked
here before the first write and unmarked once a whole checkpoint has been
restored into them, so a run that catches the ``RestoreError`` and goes on
cannot commit that mix as a checkpoint. Marks are weak: they go with the
objects.
"""

from __future__ import annotations

import weakref
from typing import Iterable, Optional

_MARKS: "weakref.WeakKeyDictionary[object, str]" = weakref.WeakKeyDictionary()


class OverwrittenStateError(RuntimeError):
    """A save of a model or optimizer that a failed restore left partly overwritten."""


def mark(objects: Iterable[object], what: str) -> None:
    """``objects`` are about to be written by ``what`` (a restore of a named checkpoint)."""
    for obj in objects:
        _MARKS[obj] = what


def clear(objects: Iterable[object]) -> None:
    """A whole checkpoint was restored into ``objects``: their state is consistent again."""
    for obj in objects:
        _MARKS.pop(obj, None)


def problem(objects: Iterable[object]) -> Optional[str]:
    """What left one of ``objects`` partly overwritten, or None."""
    if not _MARKS:
        return None
    return next((_MARKS[o] for o in objects if o in _MARKS), None)


def refuse(objects: Iterable[object], step: int) -> None:
    """Raise ``OverwrittenStateError`` if one of ``objects`` is marked (before saving them as ``step``)."""
    what = problem(objects)
    if what is not None:
        raise OverwrittenStateError(
            f"not saving step {step}: the model/optimizer state was partly overwritten by {what}, which failed; "
            "restore a checkpoint into it (restore()/resume()) or build the model and optimizer again before saving "
            "(restore_in_place=False loads into separate buffers, so that a failed restore leaves the state as it was)")
