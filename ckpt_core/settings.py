"""``CheckpointSettings`` and its allowed values; declared in ``ckpt_core.config.schema``."""

from .config.schema import (  # noqa: F401 - the import path users and older code know
    ASYNC_MODES,
    ERROR_POLICIES,
    IN_FLIGHT_POLICIES,
    RESUME_CHECK_POLICIES,
    VERIFY_LEVELS,
    CheckpointSettings,
    setting_names,
)
