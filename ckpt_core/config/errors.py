"""``SettingError``: a checkpoint setting that is unknown, does not parse or is out of range."""

from __future__ import annotations

from typing import Any, Mapping, Optional


def describe_source(source: str) -> str:
    """Long form of a source tag, for messages: ``env CKPT_X`` -> ``environment variable CKPT_X``."""
    if source.startswith("env "):
        return "environment variable " + source[4:]
    if source.startswith("flag "):
        return "command-line flag " + source[5:]
    if source == "code":
        return "code argument"
    return source


class SettingError(ValueError):
    """One bad setting: its ``name``, the ``value`` given, where it came from (``source``) and what is ``expected``.

    A ``ValueError``, so callers that catch that keep working; the message
    names the setting, the source and the fix. ``source`` is None when the
    value was checked on its own (a ``CheckpointSettings`` built in code).
    """

    def __init__(self, name: str, value: Any, expected: str, source: Optional[str] = None,
                 raw: Optional[str] = None, *, unparsed: bool = False, detail: str = "") -> None:
        self.name, self.value, self.expected, self.source, self.raw = name, value, expected, source, raw
        self.unparsed = unparsed
        super().__init__(self._message(detail))

    def _message(self, detail: str) -> str:
        if self.unparsed:  # the string itself did not parse
            return (f"invalid checkpoint setting {self.name} from {describe_source(self.source or 'code')}"
                    f"={self.raw!r}: {self.expected}")
        msg = f"checkpoint setting {self.name}={self.value!r} is invalid: expected {self.expected}"
        if self.source == "default":
            msg += " (the default value)"
        elif self.source is not None:
            given = f"={self.raw!r}" if self.raw is not None else ""
            msg += f" (set by {describe_source(self.source)}{given})"
        return msg + detail

    def with_source(self, sources: Mapping[str, str], raws: Mapping[str, str]) -> "SettingError":
        """The same error, naming where its setting (and, for a default, every changed setting) came from."""
        source = sources.get(self.name, "default")
        changed = [f"{n} from {describe_source(s)}" for n, s in sources.items() if s != "default" and n != self.name]
        detail = "; settings changed from their defaults: " + ", ".join(changed) if source == "default" and changed else ""
        return SettingError(self.name, self.value, self.expected, source, raws.get(self.name), detail=detail)


class UnknownSettingError(SettingError):
    """A name that is no setting (a misspelt ``CKPT_`` variable, flag or keyword), with the closest known one."""

    def __init__(self, name: str, source: str, hint: str) -> None:
        self.name, self.value, self.expected, self.source, self.raw, self.unparsed = name, None, hint, source, None, False
        ValueError.__init__(self, f"unknown checkpoint setting {name!r} from {describe_source(source)}{hint}")
