"""``CheckpointSettings``: every setting of the checkpointing core, declared once.

Each field carries, next to its type and default, its help text, its allowed
values, whether it holds secrets and the check of its value (``metadata``).
Validation, parsing of ``CKPT_*``/``--ckpt.*`` strings, ``--help`` text, the
log line and the generated settings table all read this one declaration.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from .errors import SettingError

ASYNC_MODES = ("bytes", "process", "thread", "off")
IN_FLIGHT_POLICIES = ("wait", "skip")
ERROR_POLICIES = ("raise", "warn")
VERIFY_LEVELS = ("none", "size", "checksum")
RESUME_CHECK_POLICIES = ("warn", "raise", "off")


def _int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _keep_best(v: Any) -> bool:
    return (isinstance(v, (tuple, list)) and len(v) == 3 and isinstance(v[0], str) and bool(v[0])
            and v[1] in ("min", "max")
            and _int(v[2]) and v[2] > 0)


def _spec(default: Any, help: str, check: Callable[[Any], bool], expected: str, *,
          choices: tuple = (), secret: bool = False, factory: Optional[Callable[[], Any]] = None) -> Any:
    meta = {"help": help, "check": check, "expected": expected, "choices": choices, "secret": secret}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


def _pos_int(default: Optional[int], help: str) -> Any:
    return _spec(default, help, lambda v: v is None or (_int(v) and v > 0), "a positive integer or None")


def _pos_num(default: Optional[float], help: str, unit: str = "seconds/hours") -> Any:
    return _spec(default, help, lambda v: v is None or (_num(v) and v > 0), f"a positive number of {unit} or None")


def _clamp(default: float, help: str) -> Any:
    return _spec(default, help, lambda v: _num(v) and v > 0, "a positive number of seconds")


def _count(default: int, help: str, low: int = 0, high: Optional[int] = None) -> Any:
    expected = f"an integer in [{low}, {high}]" if high is not None else f"an integer >= {low}"
    return _spec(default, help, lambda v: _int(v) and low <= v and (high is None or v <= high), expected)


def _choice(default: str, help: str, choices: tuple) -> Any:
    return _spec(default, help, lambda v: v in choices, f"one of {', '.join(choices)}", choices=choices)


def _flag(default: bool, help: str) -> Any:
    return _spec(default, help, lambda v: isinstance(v, bool), "true or false")


@dataclass
class CheckpointSettings:
    """Settings of one checkpointed run. Construction validates every value (``SettingError``).

    ``ckpt settings`` lists them; ``docs/settings.md`` is generated from the
    declarations below.
    """

    dirpath: str = _spec("checkpoints", "checkpoint root, a local path or any fsspec URL (s3://, memory://).",
                         lambda v: isinstance(v, str) and bool(v), "a non-empty path or fsspec URL")
    every_n_steps: Optional[int] = _pos_int(None, "save when step % every_n_steps == 0.")
    every_seconds: Optional[float] = _pos_num(None, "save when this many seconds passed since the last save.")
    interval: Optional[str] = _spec(None, '"auto" for the Young/Daly interval from the measured save cost and MTBF.',
                                    lambda v: v in (None, "auto"), "'auto' or None", choices=("auto",))
    device_mtbf_hours: Optional[float] = _pos_num(
        None, 'per-device mean time between failures, for interval="auto".')
    n_devices: Optional[int] = _pos_int(None, "devices that fail independently; defaults to the world size.")
    min_interval_s: float = _clamp(60.0, "lower clamp of the automatic interval.")
    max_interval_s: float = _clamp(3600.0, "upper clamp of the automatic interval; a measured write time above "
                                           "it wins (a shorter interval would only queue saves), with a warning.")
    keep_last: Optional[int] = _pos_int(None, "keep the newest K healthy checkpoints (None keeps all).")
    keep_every_n_steps: Optional[int] = _pos_int(
        None, "permanent tier: checkpoints at multiples of N are never deleted.")
    keep_every_seconds: Optional[float] = _pos_num(None, "keep one checkpoint per window of this many seconds.")
    keep_best: Optional[tuple] = _spec(None, '(metric, "min"|"max", n): keep the n best by a metric.',
                                       lambda v: v is None or _keep_best(v),
                                       "(metric, 'min'|'max', n) with n a positive integer")
    async_mode: str = _choice("bytes", "bytes (default: DCP serializes on a thread, a small process without torch "
                                      "writes, checksums and sums the bytes; a non-local root is written on the "
                                      "thread), process (DCP's background process, with torch), thread or off.",
                              ASYNC_MODES)
    on_in_flight: str = _choice("wait", "when a save is due while the previous is still writing: wait or skip "
                                        "(a local snapshot too, while the previous one is sealed or replicated).",
                                IN_FLIGHT_POLICIES)
    on_save_error: str = _choice("raise", "a failed background write raises on the training side or warns.",
                                 ERROR_POLICIES)
    max_checkpoint_age_s: Optional[float] = _pos_num(
        None, "with on_save_error=warn: a failed save when the newest committed checkpoint is older than this many "
              "seconds does what on_stale_checkpoint says.", unit="seconds")
    max_checkpoint_age_steps: Optional[int] = _pos_int(
        None, "the same limit in steps since the newest committed checkpoint.")
    on_stale_checkpoint: str = _choice("raise", "when saves fail past max_checkpoint_age_*: raise "
                                                "(StaleCheckpointError) or warn.", ERROR_POLICIES)
    verify: str = _choice("size", "check before loading: none, size (default) or checksum.", VERIFY_LEVELS)
    signing_key: Optional[str] = field(default=None, repr=False, metadata={
        "help": "HMAC-SHA256 key: saves are signed; restore refuses unsigned or wrongly signed checkpoints. "
                "Never stored or logged.",
        "check": lambda v: v is None or (isinstance(v, (str, bytes)) and len(v) > 0),
        "expected": "a non-empty key or None", "choices": (), "secret": True})
    signing_key_file: Optional[str] = _spec(None, "a file holding the signing key (instead of signing_key).",
                                            lambda v: v is None or (isinstance(v, str) and bool(v)),
                                            "a path or None")
    collective_timeout_s: float = _clamp(
        300.0, "bound on every collective of a save or restore (and of the background writer's process group): "
               "a rank that dies or hangs makes the others fail within this time, naming it (RankLostError).")
    lease: bool = _flag(True, "take a lease on the root while saving, so that no other job writes or prunes it "
                              "at the same time (a second job is refused, naming the holder).")
    lease_ttl_s: float = _clamp(120.0, "a lease not refreshed for this many seconds (its job crashed) is taken over "
                                       "with a warning; refreshed every lease_ttl_s / 4.")
    run_id: Optional[str] = _spec(None, "the job's id for the lease: the same id is the same job (a restart), never "
                                        "refused. Default: TORCHELASTIC_RUN_ID, then SLURM_JOB_ID, then the torchrun "
                                        "agent, else one per process.",
                                  lambda v: v is None or (isinstance(v, str) and 0 < len(v) <= 200),
                                  "a non-empty string of at most 200 characters or None")
    local_every_n_steps: Optional[int] = _pos_int(
        None, "local tier: snapshot every N steps into node memory (local_dir), replicated to a peer node; "
              "recovery takes it when it is newer than the durable tier. None: off.")
    local_every_seconds: Optional[float] = _pos_num(
        None, "local tier: snapshot when this many seconds passed since the last snapshot (rank 0's clock).",
        unit="seconds")
    local_interval: Optional[str] = _spec(
        None, 'local tier: "auto" for the Young/Daly interval from the measured snapshot stall and the MTBF '
              "(device_mtbf_hours), never below the measured checksum+replication time.",
        lambda v: v in (None, "auto"), "'auto' or None", choices=("auto",))
    local_dir: Optional[str] = _spec(None, "local tier: the node-local directory of snapshots (default "
                                           "/dev/shm/ckpt-<uid>: node memory that outlives the process, not the node).",
                                     lambda v: v is None or (isinstance(v, str) and bool(v)), "a path or None")
    local_keep: int = _count(1, "local tier: snapshots kept per rank (one more slot is written while they stay).",
                             low=1)
    replication_factor: Optional[int] = _pos_int(
        None, "local tier: copies of each snapshot, each on another node (default 2 when the job spans nodes, "
              "else 1).")
    local_node_size: Optional[int] = _pos_int(
        None, "local tier: ranks per node (the failure domain); default LOCAL_WORLD_SIZE (torchrun), else all.")
    local_cleanup: bool = _flag(True, "local tier: remove the job's snapshots when training ends without error.")
    max_host_memory_bytes: Optional[int] = _pos_int(
        None, "bound on host memory per rank for checkpoints: the durable tier's staging copy plus the local "
              "tier's slots; when both do not fit, durable saves are synchronous (slots alone over it: an error "
              "at start).")
    writer_threads: int = _count(4, "DCP writer threads (and files) per rank; 4 measured fastest "
                                    "(benchmarks/save.py).", low=1)
    writer_nice: int = _count(0, "async_mode=process or bytes: the nice value of the background writer process "
                                 "(0 to 19; never below the trainer's). 0 measured best with every core training "
                                 "(benchmarks/save.py: +4.7 % against +10.6 % at nice 10). Thread mode is never "
                                 "reniced: a thread holding the GIL at low priority would stall training.", high=19)
    direct_io: bool = _flag(True, "write and read a checkpoint's data files on a local file system with O_DIRECT: "
                                  "no copy into the page cache (a save: 0.85 s of CPU per GiB against 1.43 "
                                  "buffered, benchmarks/save.py; a restore reads regions of 1 MiB and more "
                                  "through a 4 MiB aligned buffer per thread, benchmarks/recovery.py); buffered "
                                  "where the file system refuses O_DIRECT.")
    write_retries: int = _count(3, "retries of a write that failed with a transient storage error (backoff doubles).")
    retry_backoff_s: float = _spec(0.5, "the first retry's delay in seconds.", lambda v: _num(v) and v >= 0,
                                   "a number of seconds >= 0")
    resume: bool = _flag(True, "restore the newest valid checkpoint at start.")
    resume_step: Optional[int] = _spec(None, "restore exactly this step (a rollback) instead of the newest.",
                                       lambda v: v is None or (_int(v) and v >= 0), "an integer >= 0 or None")
    restore_in_place: bool = _flag(True, "load a checkpoint straight into the live model and optimizer tensors: no "
                                         "second copy of the state in memory during a restore (1.05x the state "
                                         "against 2.02x, benchmarks/recovery.py). A failed load that no older "
                                         "checkpoint replaces leaves them partly overwritten, and saving them is "
                                         "refused until a restore succeeds; False loads into separate buffers "
                                         "first, so a failed restore leaves them as they were.")
    resume_check: str = _choice("warn", "compare the first losses after a resume with the recorded ones: warn, "
                                        "raise or off.", RESUME_CHECK_POLICIES)
    resume_check_steps: int = _count(3, "how many losses after each checkpoint are recorded and compared.")
    handle_preemption: bool = _flag(True, "on SIGTERM/SIGUSR1, save at the next step boundary and exit.")
    preemption_exit_code: int = _count(143, "the exit code after a preemption save (143 = 128 + SIGTERM).", high=255)
    storage_options: dict = _spec(None, "fsspec storage options for the checkpoint root (a JSON object), e.g. an S3 "
                                        "endpoint.", lambda v: isinstance(v, dict), "a dict (a JSON object)",
                                  secret=True, factory=dict)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise ``SettingError`` naming the first bad setting and what it accepts."""
        check_values(**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)})
        if self.keep_best is not None:
            self.keep_best = tuple(self.keep_best)

    def replace(self, **changes: Any) -> "CheckpointSettings":
        """A copy with ``changes`` applied (validated)."""
        return dataclasses.replace(self, **changes)


LOCAL_TIER_OFF = {"local_every_n_steps": None, "local_every_seconds": None, "local_interval": None}
"""``settings.replace(**LOCAL_TIER_OFF)``: a manager that only reads or writes one root (no node-memory snapshots)."""


def check_values(**values: Any) -> None:
    """Check settings given by name against their declarations (and each other): ``SettingError`` on the first bad.

    The one validation of settings: ``CheckpointSettings`` runs it on every
    field, and the objects built from settings (``SaveSchedule``,
    ``build_policy``) on the settings they take.
    """
    fields = {f.name: f for f in dataclasses.fields(CheckpointSettings)}
    for name, value in values.items():
        meta = fields[name].metadata
        if not meta["check"](value):
            raise SettingError(name, value, meta["expected"])
    low, high = values.get("min_interval_s"), values.get("max_interval_s")
    if low is not None and high is not None and low > high:
        raise SettingError("min_interval_s", low, f"at most max_interval_s={high}")
    if values.get("interval") == "auto" and "device_mtbf_hours" in values and values["device_mtbf_hours"] is None:
        raise SettingError("device_mtbf_hours", None, "a number of hours when interval='auto'")
    if values.get("local_interval") == "auto" and "device_mtbf_hours" in values and values["device_mtbf_hours"] is None:
        raise SettingError("device_mtbf_hours", None, "a number of hours when local_interval='auto'")


@dataclass(frozen=True)
class Setting:
    """What the schema says about one setting (read-only view of a field)."""

    name: str
    type: Any
    optional: bool
    default: Any
    help: str
    choices: tuple
    secret: bool


def _base_type(tp: Any) -> tuple[Any, bool]:
    if typing.get_origin(tp) is typing.Union:
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else str), True
    return tp, False


def schema() -> dict[str, Setting]:
    """Every setting by name, in declaration order."""
    hints = typing.get_type_hints(CheckpointSettings)
    out = {}
    for f in dataclasses.fields(CheckpointSettings):
        tp, optional = _base_type(hints[f.name])
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        m = f.metadata
        out[f.name] = Setting(f.name, tp, optional, default, m["help"], m["choices"], m["secret"])
    return out


def setting_names() -> list[str]:
    return list(schema())
