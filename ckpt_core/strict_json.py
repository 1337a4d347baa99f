"""Total JSON decoding for files read from storage (manifests, sidecars, loss records).

Every function maps any input to a value of the expected type or raises the
caller's error class (a ``ValueError``) with a message naming the field: no
``OverflowError``, ``RecursionError``, ``KeyError`` or ``TypeError`` escapes,
whatever a checkpoint directory holds.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any, Mapping, Optional

MAX_INT = 2**63 - 1
"""Largest count, size or step accepted (what an int64 holds)."""

_SAFE_NAME = re.compile(r"^[A-Za-z0-9_.\-]{1,255}$")


def loads_object(text: str | bytes, what: str, error: type[ValueError]) -> dict[str, Any]:
    """Decode ``text`` as a JSON object, or raise ``error`` naming ``what``."""
    try:
        body = json.loads(text)
    except RecursionError:
        raise error(f"{what} is nested too deeply to be a valid file") from None
    except (ValueError, UnicodeDecodeError, TypeError) as e:
        raise error(f"{what} is not valid JSON ({str(e)[:200]})") from None
    if not isinstance(body, dict):
        raise error(f"{what} is not a JSON object")
    return body


class Fields:
    """Typed access to the fields of a decoded JSON object; every miss raises ``error``."""

    def __init__(self, body: Mapping[str, Any], what: str, error: type[ValueError]) -> None:
        self.body, self.what, self.error = body, what, error

    def fail(self, key: str, why: str) -> ValueError:
        return self.error(f"{self.what}: field {key!r} {why}")

    def int(self, key: str, minimum: int = 0, maximum: int = MAX_INT, default: Any = ...) -> Any:
        return as_int(self._get(key, default), lambda why: self.fail(key, why), minimum, maximum, default)

    def float(self, key: str, finite: bool = True, minimum: Optional[float] = None, default: Any = ...) -> float:
        value = self._get(key, default)
        return as_float(value, lambda why: self.fail(key, why), finite, minimum)

    def bool(self, key: str, default: Any = ...) -> bool:
        value = self._get(key, default)
        if not isinstance(value, bool):
            raise self.fail(key, f"must be true or false, not {_show(value)}")
        return value

    def str(self, key: str, pattern: Optional[re.Pattern] = None, default: Any = ...) -> Any:
        value = self._get(key, default)
        if value is None and default is None:
            return None
        if not isinstance(value, str) or (pattern is not None and not pattern.match(value)):
            raise self.fail(key, f"must be a string{' of the form ' + pattern.pattern if pattern else ''}, "
                                 f"not {_show(value)}")
        return value

    def object(self, key: str, default: Any = ...) -> dict[str, Any]:
        value = self._get(key, default)
        if not isinstance(value, dict):
            raise self.fail(key, f"must be a JSON object, not {_show(value)}")
        return value

    def _get(self, key: str, default: Any) -> Any:
        if key in self.body:
            return self.body[key]
        if default is ...:
            raise self.fail(key, "is missing")
        return default


def as_int(value: Any, fail: Any, minimum: int = 0, maximum: int = MAX_INT, default: Any = ...) -> Any:
    """``value`` as an int in ``[minimum, maximum]`` (``None`` passes when it is the default)."""
    if value is None and default is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise fail(f"must be an integer, not {_show(value)}")
    if not minimum <= value <= maximum:
        raise fail(f"must be between {minimum} and {maximum}, not {_show(value)}")
    return value


def as_float(value: Any, fail: Any, finite: bool = True, minimum: Optional[float] = None) -> float:
    """``value`` (a JSON number) as a float; finite unless ``finite=False``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise fail(f"must be a number, not {_show(value)}")
    try:
        out = float(value)
    except OverflowError:
        raise fail(f"is out of range ({_show(value)})") from None
    if finite and not math.isfinite(out):
        raise fail(f"must be a finite number, not {out!r}")
    if minimum is not None and not out >= minimum:
        raise fail(f"must be at least {minimum}, not {out!r}")
    return out


def is_safe_name(name: Any) -> bool:
    """A plain file name inside a checkpoint directory: no separators, no ``..``, printable ASCII."""
    return isinstance(name, str) and bool(_SAFE_NAME.match(name)) and name not in (".", "..")


def _show(value: Any) -> str:
    text = repr(value) if not isinstance(value, (dict, list)) else type(value).__name__
    return text if len(text) <= 60 else text[:57] + "..."
