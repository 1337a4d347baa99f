"""Duck-typed questions about datasets and loaders: is it sized, does it keep its own position."""

from __future__ import annotations

from typing import Any, Optional


def sized_len(obj: Any) -> Optional[int]:
    """``len(obj)``, or None when ``obj`` has no length (an iterable dataset or a loader over one)."""
    try:
        return len(obj)
    except (TypeError, NotImplementedError):
        return None


def has_own_state(obj: Any) -> bool:
    """Whether ``obj`` saves and restores its own position (``state_dict``/``load_state_dict``)."""
    return callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))
