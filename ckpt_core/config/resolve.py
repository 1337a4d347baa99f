"""One rule for every entry point: defaults < code < ``CKPT_<NAME>`` environment < ``--ckpt.<name>`` flags.

An operator changes a run (``CKPT_RESUME_STEP=4000``, ``--ckpt.every_n_steps=500``)
without editing the script, whether it uses ``CheckpointManager``, the
Lightning callback or the Accelerate plugin. Every environment variable whose
name starts with ``CKPT_`` is read as a setting: a misspelt one is a
``SettingError`` that suggests the closest name, never silently ignored.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
from typing import Any, Mapping, Optional, Sequence

from .errors import SettingError, UnknownSettingError
from .parse import FALSE, TRUE, BadValue, parse_value, type_word
from .schema import CheckpointSettings, schema

ENV_PREFIX = "CKPT_"
FLAG_PREFIX = "--ckpt."


def env_name(name: str) -> str:
    """``every_n_steps`` -> ``CKPT_EVERY_N_STEPS``."""
    return f"{ENV_PREFIX}{name.upper()}"


def flag_name(name: str) -> str:
    """``every_n_steps`` -> ``--ckpt.every_n_steps``."""
    return f"{FLAG_PREFIX}{name}"


def unknown(name: str, source: str) -> UnknownSettingError:
    """The error for a name that is no setting, suggesting the closest one in the source's own spelling."""
    known = list(schema())
    if source.startswith("env "):
        candidates, typed = [env_name(k) for k in known], source[4:]
    elif source.startswith("flag "):
        candidates, typed = [flag_name(k) for k in known], source[5:]
    else:
        candidates, typed = known, name
    close = difflib.get_close_matches(typed, candidates, n=1, cutoff=0.6)
    hint = f"; did you mean {close[0]}?" if close else f"; known settings: {', '.join(known)}"
    return UnknownSettingError(name, source, hint)


def _parsed(name: str, raw: str, source: str) -> Any:
    try:
        return parse_value(name, raw)
    except BadValue as e:
        raise SettingError(name, None, str(e), source, raw, unparsed=True) from None


def _flag_value(args: list[str], i: int, key: str, name: str) -> tuple[str, int]:
    """The value of ``--ckpt.<key>`` given without ``=`` and the index after it."""
    s = schema().get(name)
    nxt = args[i + 1] if i + 1 < len(args) else None
    if s is not None and s.type is bool and (nxt is None or nxt.strip().lower() not in TRUE + FALSE):
        return "true", i + 1
    if nxt is None or (nxt.startswith("--") and nxt != "--" and not re.fullmatch(r"-\d.*", nxt)):
        raise SettingError(name, None, f"command-line flag {FLAG_PREFIX}{key} needs a value "
                                       f"({FLAG_PREFIX}{key}=<value>)", f"flag {FLAG_PREFIX}{key}", "",
                           unparsed=True)
    return nxt, i + 2


def pop_ckpt_flags(argv: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """Take ``--ckpt.<name>=value`` / ``--ckpt.<name> value`` out of an argv-like list.

    Returns ``({name: raw string}, remaining arguments)``; the remaining list
    can go to the script's own parser. Names are normalised
    (``--ckpt.every-n-steps`` is ``every_n_steps``) but not checked: unknown
    names are reported by ``resolve_settings``. A boolean setting may be given
    without a value (``--ckpt.resume`` means true). Nothing after ``--`` is
    touched. A later flag wins over an earlier one.
    """
    flags: dict[str, str] = {}
    rest: list[str] = []
    args, i = list(argv), 0
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
        if eq:
            i += 1
        else:
            value, i = _flag_value(args, i, key, name)
        flags[name] = value
    return flags, rest


def _env_layer(environ: Mapping[str, str]) -> list[tuple[str, str, str]]:
    out = []
    for var in sorted(environ):
        if var.startswith(ENV_PREFIX):
            out.append((var[len(ENV_PREFIX):].lower(), environ[var], f"env {var}"))
    return out


def _flag_layer(argv: Optional[Sequence[str]]) -> list[tuple[str, str, str]]:
    if argv is None:
        return []
    flags, _ = pop_ckpt_flags(argv)
    return [(name, raw, f"flag {flag_name(name)}") for name, raw in flags.items()]


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
        defaults: base settings to start from instead of the declared defaults (source ``"default"``).

    Returns:
        ``(settings, sources)``; ``sources[name]`` is ``"default"``, ``"code"``,
        ``"env CKPT_<NAME>"`` or ``"flag --ckpt.<name>"``.

    Raises:
        SettingError: an unknown setting (with the closest known name), a value
            that does not parse, or a value the schema rejects; the message
            names the setting and its source.
    """
    known = schema()
    values: dict[str, Any] = {}
    sources: dict[str, str] = {name: "default" for name in known}
    raws: dict[str, str] = {}
    for name, value in code.items():
        if name not in known:
            raise unknown(name, "code")
        values[name], sources[name] = value, "code"
    for name, raw, source in _env_layer(os.environ if env is None else env) + _flag_layer(argv):
        if name not in known:
            raise unknown(name, source)
        values[name], sources[name], raws[name] = _parsed(name, raw, source), source, raw
    try:
        base = defaults if defaults is not None else CheckpointSettings()
        return dataclasses.replace(base, **values), sources
    except SettingError as e:
        raise e.with_source(sources, raws) from None


def add_ckpt_arguments(parser: argparse.ArgumentParser, *, group_title: str = "checkpointing") -> argparse._ArgumentGroup:
    """Add one ``--ckpt.<name>`` option per setting (help from the schema).

    Values stay strings (``None`` when not given); ``settings_from_args`` parses
    them with the same rules and error messages as ``resolve_settings``.
    """
    group = parser.add_argument_group(
        group_title,
        f"checkpoint settings; each can also be set with an environment variable {ENV_PREFIX}<NAME> "
        "(flags win over the environment, which wins over the script's own values)",
    )
    for name, s in schema().items():
        help_text = f"{s.help} (env {env_name(name)}; default: {s.default!r})".replace("%", "%%")
        kwargs: dict[str, Any] = dict(dest=f"ckpt.{name}", default=None, metavar=type_word(name), help=help_text)
        if s.type is bool:
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
    argv = [f"{flag_name(name)}={getattr(namespace, f'ckpt.{name}')}" for name in schema()
            if getattr(namespace, f"ckpt.{name}", None) is not None]
    return resolve_settings(code, env=env, argv=argv, defaults=defaults)


def resolve_entry_point(
    code: Mapping[str, Any],
    settings: Optional[CheckpointSettings] = None,
    *,
    env: Optional[Mapping[str, str]] = None,
    argv: Optional[Sequence[str]] = None,
) -> tuple[CheckpointSettings, dict[str, str]]:
    """The rule of every entry point (``CheckpointManager``, the Lightning callback, the Accelerate plugin).

    Declared defaults < ``settings`` < ``code`` (arguments given in the script) < ``CKPT_<NAME>`` variables
    of ``env`` (default ``os.environ``) < ``--ckpt.<name>`` flags of ``argv`` (default ``sys.argv[1:]``).
    Pass ``env={}`` and ``argv=[]`` for settings that are already resolved.
    """
    return resolve_settings(code, env=os.environ if env is None else env,
                            argv=list(sys.argv[1:] if argv is None else argv), defaults=settings)
