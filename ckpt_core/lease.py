"""One root, one job: the lease a saving run holds on its checkpoint root.

The lease is a small hidden JSON file in the root, one file per
*generation* (``.ckpt-lease.000000000001.json``, ...); the highest generation
is the lease. A file, not a directory: scripts that list a root's directories
(Accelerate's examples take the newest one) see only checkpoints. A clean end
deletes it, so nothing is left behind. Taking a lease creates the next generation with a conditional create
(``If-None-Match: *`` on S3, an atomic hard link on local disk): two jobs
racing for one root cannot both create the same generation, so exactly one
wins, on storage that has no atomic rename and no lock. The holder rewrites
only its own generation (the refresh, every ``lease_ttl_s / 4``); a holder
that finds a higher generation than its own has lost the lease and stops
saving and deleting.

Who may take a lease held by another (``decide``, a pure function):

* the same run id (a torchrun restart, a SLURM requeue, a relaunch with
  ``run_id`` set): a restart of the same job, never refused;
* a lease released by a clean end, or not refreshed for its ``ttl_s``
  (its job crashed): taken over, with a warning;
* a holder on this machine whose process is gone (same host, boot and PID
  namespace, so that a PID means the same process): taken over at once;
* anything else is refused with ``LeaseHeldError``, naming the holder.

Expiry compares the holder's wall clock (in the file) with the reader's:
hosts must agree on the time to well within ``lease_ttl_s`` (NTP does).
Within one process the lease is re-entrant: every manager on the same root
shares it (several ``Accelerator`` objects, a notebook).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import time
import uuid
from dataclasses import asdict, dataclass
from typing import Any, Mapping, Optional

from .storage import is_local, join, list_dir, write_bytes_durable
from .strict_json import Fields, loads_object

log = logging.getLogger("ckpt_core")

LEASE_PREFIX = ".ckpt-lease."
FORMAT = "ckpt-lease"
_PROCESS_TOKEN = uuid.uuid4().hex
"""This process's identity in a lease (a PID alone can be reused)."""


class LeaseError(RuntimeError):
    """The root's lease cannot be taken or was lost: another job writes this root."""


class LeaseHeldError(LeaseError):
    """Another live job holds the lease on the root."""


class LeaseLostError(LeaseError):
    """Another job took over the lease while this one ran: this job must stop writing the root."""


class LeaseFormatError(ValueError):
    """A lease file that does not parse."""


@dataclass(frozen=True)
class LeaseRecord:
    """One generation of a root's lease, as stored."""

    run_id: str
    holder: str  # the holding process's token
    host: str
    machine: str  # host, boot and PID namespace: where ``pid`` names a process
    pid: int
    pid_start: int  # the process's start time in clock ticks since boot (0: unknown)
    started: float  # wall time the lease was taken
    refreshed: float  # wall time of the last refresh
    ttl_s: float
    released: bool = False
    generation: int = 0  # from the file name, not stored in the body

    def describe(self, now: float) -> str:
        state = "released" if self.released else f"refreshed {max(now - self.refreshed, 0.0):.0f}s ago"
        return (f"run {self.run_id!r} (pid {self.pid} on {self.host}, since "
                f"{time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime(self.started))} UTC, {state}, ttl "
                f"{self.ttl_s:g}s)")


def render(rec: LeaseRecord) -> bytes:
    body = {k: v for k, v in asdict(rec).items() if k != "generation"}
    return json.dumps({"format": FORMAT, "version": 1, **body}, sort_keys=True).encode()


def parse(data: bytes, generation: int) -> LeaseRecord:
    """The ``LeaseRecord`` in ``data``, or ``LeaseFormatError`` naming the field."""
    body = loads_object(data, f"lease generation {generation}", LeaseFormatError)
    f = Fields(body, f"lease generation {generation}", LeaseFormatError)
    if f.str("format") != FORMAT or f.int("version") != 1:
        raise LeaseFormatError(f"lease generation {generation} is not a version 1 {FORMAT} file")
    return LeaseRecord(run_id=f.str("run_id"), holder=f.str("holder"), host=f.str("host"),
                       machine=f.str("machine"), pid=f.int("pid"), pid_start=f.int("pid_start"),
                       started=f.float("started"), refreshed=f.float("refreshed"),
                       ttl_s=f.float("ttl_s", minimum=0.0), released=f.bool("released"), generation=generation)


def generation_name(generation: int) -> str:
    return f"{LEASE_PREFIX}{generation:012d}.json"


def parse_generation(name: str) -> Optional[int]:
    """The generation of a lease file name (``.ckpt-lease.<12 digits>.json``), else None."""
    base = name.rpartition("/")[2]
    if not (base.startswith(LEASE_PREFIX) and base.endswith(".json")):
        return None
    stem = base[len(LEASE_PREFIX):-len(".json")]
    return int(stem) if len(stem) == 12 and stem.isascii() and stem.isdigit() else None


# ----------------------------------------------------------------- identity
def job_run_id(setting: Optional[str], env: Mapping[str, str]) -> tuple[str, str]:
    """``(run id, where it came from)``: the same id across restarts of one job, another for any other job."""
    if setting:
        return setting, "the run_id setting"
    elastic = env.get("TORCHELASTIC_RUN_ID")
    if elastic and elastic != "none":
        return f"torchelastic:{elastic}", "TORCHELASTIC_RUN_ID"
    slurm = env.get("SLURM_JOB_ID")
    if slurm:
        return f"slurm:{slurm}", "SLURM_JOB_ID"
    if elastic == "none":  # torchrun without --rdzv-id: its agent (this process's parent) outlives worker restarts
        return f"torchrun:{socket.gethostname()}:{os.getppid()}", "the torchrun agent"
    return f"process:{socket.gethostname()}:{os.getpid()}:{_PROCESS_TOKEN[:8]}", "this process"


def this_machine() -> str:
    """Host name, boot id and PID namespace: two processes with equal values see the same PIDs."""
    def read(path: str, link: bool = False) -> str:
        try:
            if link:
                return os.readlink(path)
            with open(path) as f:
                return f.read().strip()
        except OSError:
            return "?"
    return f"{socket.gethostname()}|{read('/proc/sys/kernel/random/boot_id')}|{read('/proc/self/ns/pid', True)}"


def process_start(pid: int) -> int:
    """The start time of ``pid`` in clock ticks since boot (``/proc``), 0 when unknown."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return 0


def holder_alive(rec: LeaseRecord) -> Optional[bool]:
    """Whether the lease's process still runs: known only on its own machine (else None)."""
    if rec.machine != this_machine() or "?" in rec.machine.split("|"):
        return None
    try:
        with open(f"/proc/{rec.pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except FileNotFoundError:
        return False
    except OSError:
        return None
    if fields[0] in ("Z", "X"):  # a zombie: dead, not yet reaped
        return False
    return rec.pid_start == 0 or int(fields[19]) == rec.pid_start


# ----------------------------------------------------------------- decision
TAKE, REENTER, REFUSE = "take", "reenter", "refuse"


@dataclass(frozen=True)
class Claim:
    """Who asks for the lease."""

    run_id: str
    holder: str


def decide(current: Optional[LeaseRecord], claim: Claim, now: float,
           alive: Optional[bool]) -> tuple[str, str, bool]:
    """``(action, reason, warn)`` for ``claim`` on a root whose lease is ``current``.

    ``alive``: whether ``current``'s process runs (None: not known from here).
    """
    if current is None:
        return TAKE, "the root has no lease", False
    if current.holder == claim.holder:
        return REENTER, "this process holds the lease", False
    if current.released:
        return TAKE, f"the lease of {current.describe(now)} was released", False
    if current.run_id == claim.run_id:
        return TAKE, f"a restart of the same run ({current.describe(now)})", False
    if alive is False:
        return TAKE, f"taking over the lease of {current.describe(now)}: that process is gone", True
    if now - current.refreshed > current.ttl_s:
        return TAKE, f"taking over the expired lease of {current.describe(now)}", True
    return REFUSE, current.describe(now), False


def refusal(root: str, current: str, claim: Claim, ttl_s: float) -> str:
    return (f"checkpoint root {root} is in use by another job: {current}. Two jobs on one root delete each "
            f"other's checkpoints. Give this job its own dirpath; or, if that job has stopped, wait until its "
            f"lease expires (lease_ttl_s, {ttl_s:g}s after its last refresh); or, if it is this same job, set "
            f"run_id (CKPT_RUN_ID) to that job's id. This job's run id: {claim.run_id!r}")


def lease_state(rec: LeaseRecord, now: float, alive: Optional[bool]) -> str:
    """``live``, ``released``, ``expired`` or ``gone`` (its process ended on this machine)."""
    if rec.released:
        return "released"
    if alive is False:
        return "gone"
    return "expired" if now - rec.refreshed > rec.ttl_s else "live"


# ------------------------------------------------------------------ storage
class LeaseFiles:
    """The lease generations in one root on one file system."""

    def __init__(self, fs: Any, root_path: str) -> None:
        self.fs, self.dir = fs, root_path.rstrip("/") or "/"

    def current(self) -> tuple[Optional[LeaseRecord], int, Optional[str]]:
        """``(lease, highest generation, problem)``: the highest generation's record (None if absent or bad)."""
        gens = sorted(g for g in (parse_generation(e["name"]) for e in list_dir(self.fs, self.dir)) if g is not None)
        if not gens:
            return None, 0, None
        try:
            return parse(self.fs.cat_file(join(self.dir, generation_name(gens[-1]))), gens[-1]), gens[-1], None
        except FileNotFoundError:
            return None, gens[-1], f"lease generation {gens[-1]} vanished while read"
        except (LeaseFormatError, OSError) as e:
            return None, gens[-1], str(e)

    def create(self, rec: LeaseRecord) -> bool:
        """Create generation ``rec.generation``; False if it exists already (another job won the race)."""
        path, data = join(self.dir, generation_name(rec.generation)), render(rec)
        if is_local(self.fs):
            return _create_local(path, data)
        try:
            self.fs.pipe_file(path, data, mode="create")
        except FileExistsError:
            return False
        except OSError as e:
            if "PreconditionFailed" in str(e) or "412" in str(e):
                return False
            raise
        return True

    def overwrite(self, rec: LeaseRecord) -> None:
        write_bytes_durable(self.fs, join(self.dir, generation_name(rec.generation)), render(rec))

    def delete(self, generation: int) -> None:
        self.fs.rm_file(join(self.dir, generation_name(generation)))

    def delete_below(self, generation: int) -> None:
        """Remove generations older than ``generation`` (best effort: they decide nothing)."""
        for e in list_dir(self.fs, self.dir):
            g = parse_generation(e["name"])
            if g is not None and g < generation:
                try:
                    self.fs.rm_file(join(self.dir, generation_name(g)))
                except OSError:
                    pass


def _create_local(path: str, data: bytes) -> bool:
    """Write ``data`` to a temporary file, then hard-link it to ``path``: atomic, complete, never overwriting."""
    directory = os.path.dirname(path)
    os.makedirs(directory, exist_ok=True)
    tmp = join(directory, f".tmp-{uuid.uuid4().hex}")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    try:
        os.link(tmp, path)
    except FileExistsError:
        return False
    except OSError:  # a file system without hard links: an exclusive create (complete once the write returns)
        return _create_exclusive(path, data)
    finally:
        os.unlink(tmp)
    return True


def _create_exclusive(path: str, data: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    return True
