"""Checkpoint settings: one schema (``schema``), one validation (``SettingError``), one resolver for
``CKPT_<NAME>`` variables and ``--ckpt.<name>`` flags (``resolve``), and their rendering (``render``)."""

from .errors import SettingError, UnknownSettingError, describe_source
from .parse import BadValue, parse_value, type_word
from .render import log_effective_settings, redact, settings_table_markdown
from .resolve import (
    ENV_PREFIX,
    FLAG_PREFIX,
    add_ckpt_arguments,
    env_name,
    flag_name,
    pop_ckpt_flags,
    resolve_entry_point,
    resolve_settings,
    settings_from_args,
)
from .schema import (
    ASYNC_MODES,
    ERROR_POLICIES,
    IN_FLIGHT_POLICIES,
    LOCAL_TIER_OFF,
    RESUME_CHECK_POLICIES,
    VERIFY_LEVELS,
    CheckpointSettings,
    Setting,
    schema,
    setting_names,
)


def setting_help(name: str) -> str:
    """One-sentence help of a setting."""
    return schema()[name].help


__all__ = [
    "ASYNC_MODES", "ERROR_POLICIES", "IN_FLIGHT_POLICIES", "RESUME_CHECK_POLICIES", "VERIFY_LEVELS",
    "ENV_PREFIX", "FLAG_PREFIX", "LOCAL_TIER_OFF", "BadValue", "CheckpointSettings", "Setting", "SettingError",
    "UnknownSettingError", "add_ckpt_arguments", "describe_source", "env_name", "flag_name",
    "log_effective_settings", "parse_value", "pop_ckpt_flags", "redact", "resolve_entry_point", "resolve_settings",
    "schema",
    "setting_help", "setting_names", "settings_from_args", "settings_table_markdown", "type_word",
]
