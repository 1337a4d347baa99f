"""Settings shown to people: the log line at start, the generated docs table, secrets masked."""

from __future__ import annotations

import json
import logging
import re
from typing import Any, Mapping, Optional

from .parse import type_word
from .resolve import env_name, flag_name
from .schema import CheckpointSettings, schema

_SECRET_KEY = re.compile(r"secret|password|passwd|token|credential|(^|_)key$|^key", re.I)


def redact(name: str, value: Any) -> Any:
    """``value`` with secrets masked: keys, tokens and passwords in a secret setting, credentials in a URL."""
    if schema()[name].secret and isinstance(value, Mapping):
        return {k: ("***" if _SECRET_KEY.search(str(k)) and v is not None else redact(name, v))
                for k, v in value.items()}
    if schema()[name].secret and schema()[name].type is not dict and isinstance(value, (str, bytes)):
        return "***"  # a secret that is a string: a key
    if isinstance(value, str) and "://" in value:
        return re.sub(r"^([a-zA-Z0-9+.-]+://)[^/@]*@", r"\1***@", value)
    return value


def log_effective_settings(
    settings: CheckpointSettings,
    sources: Mapping[str, str],
    logger: Optional[logging.Logger] = None,
    level: int = logging.INFO,
) -> None:
    """Log every setting with its value and source, as one record (call it once, at start); secrets masked."""
    logger = logger or logging.getLogger("ckpt_core")
    names = list(schema())
    width = max(len(n) for n in names)
    lines = ["ckpt_core: effective checkpoint settings (value, source):"]
    for name in names:
        value = redact(name, getattr(settings, name))
        lines.append(f"  {name:<{width}} = {value!r:<24} [{sources.get(name, 'default')}]")
    logger.log(level, "\n".join(lines))


def _default_text(default: Any) -> str:
    if default is None:
        return "`none`"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, dict):
        return f"`{json.dumps(default)}`"
    return f"`{default}`"


def settings_table_markdown() -> str:
    """The settings table of ``docs/settings.md``, generated from the schema."""
    rows = [
        "| setting | default | environment variable | flag | values |",
        "|---|---|---|---|---|",
    ]
    for name, s in schema().items():
        help_text = s.help.replace("|", "\\|")
        values = type_word(name).replace("|", "\\|")
        rows.append(
            f"| `{name}` | {_default_text(s.default)} | `{env_name(name)}` | `{flag_name(name)}` | `{values}`: {help_text} |"
        )
    return "\n".join(rows) + "\n"
