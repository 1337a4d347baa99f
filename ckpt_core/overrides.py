"""Layer environment variables and command-line flags over ``CheckpointSettings``.

Precedence, lowest to highest::

    dataclass defaults  <  code (arguments in the training script)  <  CKPT_<NAME> env  <  --ckpt.<name> flags

so an operator can change a run (``CKPT_RESUME_STEP=4000``, ``--ckpt.every_n_steps=500``)
without editing the script. Every environment variable whose name starts
with ``CKPT_`` is read as a setting: a misspelt one (``CKPT_EVRY_N_STEPS``)
is an error that suggests the closest name, never silently ignored.

Values given as strings are parsed by the field's type: integers, numbers,
booleans (``true/false/1/0/yes/no/on/off``), ``none``/``null`` for optional
settings, ``keep_best`` as ``metric,mode,n`` or JSON, ``storage_options`` as a
JSON object. A bad value raises ``ValueError`` naming the setting and where it
came from.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import inspect
import json
import logging
import os
import re
import typing
from typing import Any, Mapping, Optional, Sequence

from . import settings as settings_mod
from .settings import CheckpointSettings

__all__ = [
    "ENV_PREFIX",
    "FLAG_PREFIX",
    "add_ckpt_arguments",
    "describe_source",
    "env_name",
    "flag_name",
    "log_effective_settings",
    "parse_value",
    "pop_ckpt_flags",
    "resolve_settings",
    "setting_help",
    "settings_from_args",
    "settings_table_markdown",
]

ENV_PREFIX = "CKPT_"
FLAG_PREFIX = "--ckpt."

# Closed sets of strings; ``CheckpointSettings.validate`` enforces them too.
CHOICES: dict[str, tuple[str, ...]] = {
    "interval": ("auto",),
    "async_mode": settings_mod.ASYNC_MODES,
    "on_in_flight": settings_mod.IN_FLIGHT_POLICIES,
    "on_save_error": settings_mod.ERROR_POLICIES,
    "verify": settings_mod.VERIFY_LEVELS,
    "resume_check": settings_mod.RESUME_CHECK_POLICIES,
}

_TRUE = ("true", "1", "yes", "y", "on")
_FALSE = ("false", "0", "no", "n", "off")
_NONE = ("none", "null")
_SECRET_RE = re.compile(r"secret|password|passwd|token|credential|(^|_)key$|^key", re.I)
_SIZE_UNITS = {
    "": 1, "b": 1,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}


# ----------------------------------------------------------------- field facts
def _fields() -> dict[str, dataclasses.Field]:
    return {f.name: f for f in dataclasses.fields(CheckpointSettings)}


def _hints() -> dict[str, Any]:
    return typing.get_type_hints(CheckpointSettings)


def _base_type(tp: Any) -> tuple[Any, bool]:
    """``(inner type, optional?)`` of a field annotation (``Optional[int]`` -> ``(int, True)``)."""
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def env_name(name: str) -> str:
    """``every_n_steps`` -> ``CKPT_EVERY_N_STEPS``."""
    return f"{ENV_PREFIX}{name.upper()}"


def flag_name(name: str) -> str:
    """``every_n_steps`` -> ``--ckpt.every_n_steps``."""
    return f"{FLAG_PREFIX}{name}"


def describe_source(source: str) -> str:
    """Long form of a source tag, for messages: ``env CKPT_X`` -> ``environment variable CKPT_X``."""
    if source.startswith("env "):
        return "environment variable " + source[4:]
    if source.startswith("flag "):
        return "command-line flag " + source[5:]
    if source == "code":
        return "code argument"
    return source


def _docstring_help() -> dict[str, str]:
    """Per-field help text from the ``Attributes:`` section of ``CheckpointSettings``' docstring."""
    doc = inspect.cleandoc(CheckpointSettings.__doc__ or "")
    out: dict[str, str] = {}
    in_attrs = False
    current: list[str] = []
    for line in doc.splitlines():
        if line.strip() == "Attributes:":
            in_attrs = True
            continue
        if not in_attrs:
            continue
        if not line.strip():
            continue
        m = re.match(r"^    ([\w /]+?):\s+(.*)$", line)
        if m and not line.startswith("     "):
            names = [n.strip() for n in m.group(1).split("/")]
            current = names
            for n in names:
                out[n] = m.group(2).strip()
        elif line.startswith("     ") and current:
            for n in current:
                out[n] += " " + line.strip()
        elif not line.startswith(" "):
            break
    return out


_FALLBACK_HELP = {
    "storage_options": "fsspec storage options for the checkpoint root (a JSON object), e.g. an S3 endpoint.",
}


def setting_help(name: str) -> str:
    """One-sentence help of a setting, from the dataclass docstring."""
    text = _docstring_help().get(name) or _FALLBACK_HELP.get(name, "")
    return re.sub(r"``([^`]*)``", r"\1", text)


def _type_word(name: str) -> str:
    tp, optional = _base_type(_hints()[name])
    if name in CHOICES:
        word = "|".join(CHOICES[name])
    elif name == "keep_best":
        word = "METRIC,min|max,N"
    elif name == "storage_options":
        word = "JSON"
    elif name.endswith("_bytes"):
        word = "BYTES"
    else:
        word = {int: "INT", float: "FLOAT", bool: "BOOL", str: "STR"}.get(tp, "VALUE")
    return word + ("|none" if optional else "")


# ------------------------------------------------------------------- parsing
class _BadValue(ValueError):
    """A string that does not parse for its field; the message says what was expected."""


def _parse_int(text: str, name: str) -> int:
    t = text.strip()
    if name.endswith("_bytes"):
        m = re.fullmatch(r"([0-9_]+(?:\.[0-9]+)?)\s*([A-Za-z]*)", t)
        if m and m.group(2).lower() in _SIZE_UNITS:
            value = float(m.group(1).replace("_", "")) * _SIZE_UNITS[m.group(2).lower()]
            if value == int(value):
                return int(value)
        raise _BadValue("expected a number of bytes (an integer, optionally with KB/MB/GB/TB or KiB/MiB/GiB/TiB)")
    try:
        return int(t, 10)
    except ValueError:
        raise _BadValue("expected an integer") from None


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise _BadValue("expected a number") from None


def _parse_bool(text: str) -> bool:
    t = text.strip().lower()
    if t in _TRUE:
        return True
    if t in _FALSE:
        return False
    raise _BadValue("expected a boolean (true/false, 1/0, yes/no, on/off)")


def _parse_keep_best(text: str) -> tuple:
    t = text.strip()
    if t[:1] in "[{":
        try:
            body = json.loads(t)
        except ValueError as e:
            raise _BadValue(f"expected 'metric,min|max,n' or JSON ({e})") from None
        if isinstance(body, dict):
            body = [body.get("metric"), body.get("mode", "min"), body.get("n", 1)]
        if not isinstance(body, list) or len(body) not in (2, 3):
            raise _BadValue("expected 'metric,min|max,n' or a JSON list [metric, mode, n]")
        parts = [str(p) for p in body]
    else:
        parts = [p.strip() for p in t.split(",")]
    if len(parts) == 2:
        parts.append("1")
    if len(parts) != 3 or not parts[0] or parts[1] not in ("min", "max"):
        raise _BadValue("expected 'metric,min|max,n' (e.g. 'val_loss,min,3') or JSON")
    try:
        n = int(parts[2])
    except ValueError:
        raise _BadValue("expected 'metric,min|max,n' with n an integer") from None
    return (parts[0], parts[1], n)


def _parse_json_object(text: str) -> dict:
    try:
        body = json.loads(text)
    except ValueError as e:
        raise _BadValue(f"expected a JSON object ({e})") from None
    if not isinstance(body, dict):
        raise _BadValue(f"expected a JSON object, got {type(body).__name__}")
    return body


def parse_value(name: str, text: str) -> Any:
    """Parse the string ``text`` for setting ``name`` by its type; ``_BadValue`` (a ``ValueError``) if it does not fit."""
    tp, optional = _base_type(_hints()[name])
    if optional and text.strip().lower() in _NONE:
        return None
    if name == "keep_best":
        return _parse_keep_best(text)
    if name == "storage_options":
        return _parse_json_object(text)
    if tp is bool:
        return _parse_bool(text)
    if tp is int:
        return _parse_int(text, name)
    if tp is float:
        return _parse_float(text)
    if name in CHOICES:
        value = text.strip()
        if value not in CHOICES[name]:
            raise _BadValue(f"expected one of {', '.join(CHOICES[name])}" + (" or none" if optional else ""))
        return value
    if tp is str:
        return text
    if tp is dict:
        return _parse_json_object(text)
    if tp in (tuple, list):
        try:
            body = json.loads(text)
        except ValueError:
            body = [p.strip() for p in text.split(",")]
        return tp(body)
    raise _BadValue(f"no parser for type {tp!r}")  # pragma: no cover - a new field type


def _unknown(name: str, source: str) -> ValueError:
    known = list(_fields())
    if source.startswith("env "):
        candidates = {env_name(k): k for k in known}
        typed = source[4:]
    elif source.startswith("flag "):
        candidates = {flag_name(k): k for k in known}
        typed = source[5:]
    else:
        candidates = {k: k for k in known}
        typed = name
    close = difflib.get_close_matches(typed, list(candidates), n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else f"; known settings: {', '.join(known)}"
    return ValueError(f"unknown checkpoint setting {name!r} from {describe_source(source)}{hint}")


def _parsed(name: str, raw: str, source: str) -> Any:
    try:
        return parse_value(name, raw)
    except _BadValue as e:
        raise ValueError(f"invalid checkpoint setting {name} from {describe_source(source)}={raw!r}: {e}") from None


# -------------------------------------------------------------------- flags
def pop_ckpt_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Take ``--ckpt.<name>=value`` / ``--ckpt.<name> value`` out of an argv-like list.

    Returns ``({name: raw string}, remaining arguments)``; the remaining list
    can go to the script's own parser (pass ``sys.argv`` and assign the rest
    back to ``sys.argv`` if that parser reads it). Names are normalised
    (``--ckpt.every-n-steps`` is ``every_n_steps``) but not checked: unknown
    names are reported by ``resolve_settings``. A boolean setting may be given
    without a value (``--ckpt.resume`` means true). Nothing after ``--`` is
    touched. A later flag wins over an earlier one.
    """
    fields = _fields()
    hints = _hints()
    flags: dict[str, str] = {}
    rest: list[str] = []
    i = 0
    args = list(argv)
    while i < len(args):
        arg = args[i]
        if arg == "--":
            rest.extend(args[i:])
            break
        if not arg.startswith(FLAG_PREFIX):
            rest.append(arg)
            i += 1
            continue
        key, eq, value = arg[len(FLAG_PREFIX):].partition("=")
        name = key.replace("-", "_")
        if not name:
            raise ValueError(f"command-line flag {arg!r} names no setting; use --ckpt.<name>=<value>")
        if not eq:
            is_bool = name in fields and _base_type(hints[name])[0] is bool
            nxt = args[i + 1] if i + 1 < len(args) else None
            if is_bool and (nxt is None or nxt.strip().lower() not in _TRUE + _FALSE):
                value = "true"
            elif nxt is None or (nxt.startswith("--") and nxt != "--" and not _looks_negative(nxt)):
                raise ValueError(f"command-line flag {FLAG_PREFIX}{key} needs a value ({FLAG_PREFIX}{key}=<value>)")
            else:
                value = nxt
                i += 1
        flags[name] = value
        i += 1
    return flags, rest


def _looks_negative(text: str) -> bool:
    return bool(re.fullmatch(r"-\d.*", text))


# ------------------------------------------------------------------- resolve
def resolve_settings(
    code: Mapping[str, Any] = {},  # noqa: B006 - read only
    *,
    env: Optional[Mapping[str, str]] = None,
    argv: Optional[Sequence[str]] = None,
    defaults: Optional[CheckpointSettings] = None,
) -> tuple[CheckpointSettings, dict[str, str]]:
    """Effective settings and where each came from.

    Args:
        code: settings given in code (typed values, e.g. the callback's keyword arguments).
        env: environment to read ``CKPT_<NAME>`` from; ``None`` reads ``os.environ``, ``{}`` reads nothing.
        argv: argument list to read ``--ckpt.<name>`` flags from (other arguments are
            ignored); ``None`` reads no flags. Pass ``sys.argv`` to honour the command line.
        defaults: base settings to start from instead of the dataclass defaults (source ``"default"``).

    Returns:
        ``(settings, sources)``; ``sources[name]`` is ``"default"``, ``"code"``,
        ``"env CKPT_<NAME>"`` or ``"flag --ckpt.<name>"``.

    Raises:
        ValueError: an unknown setting (with the closest known name), a value
            that does not parse, or a value ``CheckpointSettings.validate``
            rejects; the message names the setting and its source.
    """
    fields = _fields()
    base = defaults if defaults is not None else None
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in fields}
    raws: dict[str, str] = {}

    for name, value in code.items():
        if name not in fields:
            raise _unknown(name, "code")
        values[name] = value
        sources[name] = "code"

    environ = os.environ if env is None else env
    for var in sorted(environ):
        if not var.startswith(ENV_PREFIX):
            continue
        name = var[len(ENV_PREFIX):].lower()
        source = f"env {var}"
        if name not in fields:
            raise _unknown(name, source)
        raws[name] = environ[var]
        values[name] = _parsed(name, environ[var], source)
        sources[name] = source

    if argv is not None:
        flags, _ = pop_ckpt_flags(argv)
        for name, raw in flags.items():
            source = f"flag {flag_name(name)}"
            if name not in fields:
                raise _unknown(name, source)
            raws[name] = raw
            values[name] = _parsed(name, raw, source)
            sources[name] = source

    return _build(base, values, sources, raws), sources


def _build(
    base: Optional[CheckpointSettings],
    values: Mapping[str, Any],
    sources: Mapping[str, str],
    raws: Mapping[str, str],
) -> CheckpointSettings:
    try:
        if base is None:
            return CheckpointSettings(**values)
        return dataclasses.replace(base, **values)
    except ValueError as e:
        raise _with_source(e, sources, raws) from None
    except TypeError as e:  # pragma: no cover - only if the dataclass grows required fields
        raise ValueError(f"invalid checkpoint settings: {e}") from None


def _with_source(err: ValueError, sources: Mapping[str, str], raws: Mapping[str, str]) -> ValueError:
    msg = str(err)
    m = re.search(r"checkpoint setting (\w+)=", msg)
    name = m.group(1) if m else None
    if name is not None and name in sources:
        src = sources[name]
        detail = describe_source(src) + (f"={raws[name]!r}" if name in raws else "")
        msg = f"{msg} (set by {detail})" if src != "default" else f"{msg} (the default value)"
    changed = [f"{n} from {describe_source(s)}" for n, s in sources.items() if s != "default" and n != name]
    if name is None or sources.get(name) == "default":
        if changed:
            msg += "; settings changed from their defaults: " + ", ".join(changed)
    return ValueError(msg)


# ------------------------------------------------------------------ argparse
def add_ckpt_arguments(parser: argparse.ArgumentParser, *, group_title: str = "checkpointing") -> argparse._ArgumentGroup:
    """Add one ``--ckpt.<name>`` option per setting (help from the dataclass docstring).

    Values stay strings (``None`` when not given); ``settings_from_args`` parses
    them with the same rules and error messages as ``resolve_settings``.
    """
    group = parser.add_argument_group(
        group_title,
        f"checkpoint settings; each can also be set with an environment variable {ENV_PREFIX}<NAME> "
        "(flags win over the environment, which wins over the script's own values)",
    )
    hints = _hints()
    for name, f in _fields().items():
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        help_text = f"{setting_help(name)} (env {env_name(name)}; default: {default!r})".replace("%", "%%")
        kwargs: dict[str, Any] = dict(dest=f"ckpt.{name}", default=None, metavar=_type_word(name), help=help_text)
        if _base_type(hints[name])[0] is bool:
            kwargs.update(nargs="?", const="true")
        group.add_argument(flag_name(name), **kwargs)
    return group


def settings_from_args(
    namespace: argparse.Namespace,
    code: Mapping[str, Any] = {},  # noqa: B006 - read only
    *,
    env: Optional[Mapping[str, str]] = None,
    defaults: Optional[CheckpointSettings] = None,
) -> tuple[CheckpointSettings, dict[str, str]]:
    """``resolve_settings`` with the flags taken from a namespace parsed with ``add_ckpt_arguments``."""
    argv: list[str] = []
    for name in _fields():
        value = getattr(namespace, f"ckpt.{name}", None)
        if value is not None:
            argv.append(f"{flag_name(name)}={value}")
    return resolve_settings(code, env=env, argv=argv, defaults=defaults)


# ------------------------------------------------------------------- logging
def _redact(name: str, value: Any) -> Any:
    if name == "storage_options" and isinstance(value, Mapping):
        return {k: ("***" if _SECRET_RE.search(str(k)) and v is not None else _redact(name, v)) for k, v in value.items()}
    if name == "dirpath" and isinstance(value, str):
        return re.sub(r"^([a-zA-Z0-9+.-]+://)[^/@]*@", r"\1***@", value)
    return value


def log_effective_settings(
    settings: CheckpointSettings,
    sources: Mapping[str, str],
    logger: Optional[logging.Logger] = None,
    level: int = logging.INFO,
) -> None:
    """Log every setting with its value and source, as one record (call it once, at start).

    Secrets in ``storage_options`` (keys, tokens, passwords) are masked.
    """
    logger = logger or logging.getLogger("ckpt_core")
    width = max(len(n) for n in _fields())
    lines = ["ckpt_core: effective checkpoint settings (value, source):"]
    for name in _fields():
        value = _redact(name, getattr(settings, name))
        lines.append(f"  {name:<{width}} = {value!r:<24} [{sources.get(name, 'default')}]")
    logger.log(level, "\n".join(lines))


# --------------------------------------------------------------------- docs
def _default_text(f: dataclasses.Field) -> str:
    default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
    if default is None:
        return "`none`"
    if isinstance(default, bool):
        return f"`{str(default).lower()}`"
    if isinstance(default, dict):
        return f"`{json.dumps(default)}`"
    return f"`{default}`"


def settings_table_markdown() -> str:
    """The settings table of the README, generated from the dataclass."""
    rows = [
        "| setting | default | environment variable | flag | values |",
        "|---|---|---|---|---|",
    ]
    for name, f in _fields().items():
        help_text = setting_help(name).replace("|", "\\|")
        values = _type_word(name).replace("|", "\\|")
        rows.append(
            f"| `{name}` | {_default_text(f)} | `{env_name(name)}` | `{flag_name(name)}` | `{values}`: {help_text} |"
        )
    return "\n".join(rows) + "\n"
