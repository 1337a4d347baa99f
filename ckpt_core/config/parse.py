"""Strings from ``CKPT_<NAME>`` variables and ``--ckpt.<name>`` flags, parsed by each setting's declared type."""

from __future__ import annotations

import json
import re
from typing import Any

from .schema import Setting, schema

TRUE = ("true", "1", "yes", "y", "on")
FALSE = ("false", "0", "no", "n", "off")
NONE = ("none", "null")
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


class BadValue(ValueError):
    """A string that does not parse for its setting; the message says what was expected."""


def _parse_int(text: str, name: str) -> int:
    t = text.strip()
    if name.endswith("_bytes"):
        m = re.fullmatch(r"([0-9_]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", t)
        if m and m.group(2).lower() in _SIZE_UNITS:
            value = float(m.group(1).replace("_", "")) * _SIZE_UNITS[m.group(2).lower()]
            if value == int(value):
                return int(value)
        raise BadValue("expected a number of bytes (an integer, optionally with KB/MB/GB/TB or KiB/MiB/GiB/TiB)")
    try:
        return int(t, 10)
    except ValueError:
        raise BadValue("expected an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise BadValue("expected a number") from None


def parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in TRUE:
        return True
    if t in FALSE:
        return False
    raise BadValue("expected a boolean (true/false, 1/0, yes/no, on/off)")


def _keep_best_parts(t: str) -> list[str]:
    if t[:1] not in "[{":
        return [p.strip() for p in t.split(",")]
    try:
        body = json.loads(t)
    except ValueError as e:
        raise BadValue(f"expected 'metric,min|max,n' or JSON ({e})") from None
    if isinstance(body, dict):
        body = [body.get("metric"), body.get("mode", "min"), body.get("n", 1)]
    if not isinstance(body, list) or len(body) not in (2, 3):
        raise BadValue("expected 'metric,min|max,n' or a JSON list [metric, mode, n]")
    return [str(p) for p in body]


def _parse_keep_best(text: str) -> tuple:
    parts = _keep_best_parts(text.strip())
    if len(parts) == 2:
        parts.append("1")
    if len(parts) != 3 or not parts[0] or parts[1] not in ("min", "max"):
        raise BadValue("expected 'metric,min|max,n' (e.g. 'val_loss,min,3') or JSON")
    try:
        n = int(parts[2])
    except ValueError:
        raise BadValue("expected 'metric,min|max,n' with n an integer") from None
    return (parts[0], parts[1], n)


def _parse_json_object(text: str) -> dict:
    try:
        body = json.loads(text)
    except ValueError as e:
        raise BadValue(f"expected a JSON object ({e})") from None
    if not isinstance(body, dict):
        raise BadValue(f"expected a JSON object, got {type(body).__name__}")
    return body


def _parse_choice(s: Setting, text: str) -> str:
    value = text.strip()
    if value not in s.choices:
        raise BadValue(f"expected one of {', '.join(s.choices)}" + (" or none" if s.optional else ""))
    return value


def parse_value(name: str, text: str) -> Any:
    """Parse the string ``text`` for setting ``name`` by its type; ``BadValue`` (a ``ValueError``) if it does not fit."""
    s = schema()[name]
    if s.optional and text.strip().lower() in NONE:
        return None
    if name == "keep_best":
        return _parse_keep_best(text)
    if s.type is dict:
        return _parse_json_object(text)
    if s.type is bool:
        return parse_bool(text)
    if s.type is int:
        return _parse_int(text, name)
    if s.type is float:
        return _parse_float(text)
    if s.choices:
        return _parse_choice(s, text)
    return text


def type_word(name: str) -> str:
    """How a value of ``name`` is written on a command line (``INT|none``, ``wait|skip``...)."""
    s = schema()[name]
    if s.choices:
        word = "|".join(s.choices)
    elif name == "keep_best":
        word = "METRIC,min|max,N"
    elif s.type is dict:
        word = "JSON"
    elif name.endswith("_bytes"):
        word = "BYTES"
    else:
        word = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}.get(s.type, "VALUE")
    return word + ("|none" if s.optional else "")
