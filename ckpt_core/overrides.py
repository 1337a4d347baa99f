"""``CKPT_<NAME>`` environment variables and ``--ckpt.<name>`` flags; implemented in ``ckpt_core.config``."""

from .config import (  # noqa: F401 - the import path users and older code know
    ENV_PREFIX,
    FLAG_PREFIX,
    add_ckpt_arguments,
    describe_source,
    env_name,
    flag_name,
    log_effective_settings,
    parse_value,
    pop_ckpt_flags,
    resolve_settings,
    setting_help,
    settings_from_args,
    settings_table_markdown,
)
