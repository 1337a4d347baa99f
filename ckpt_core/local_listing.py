"""What the local tier holds on this node, read without torch (for ``ckpt ls``).

``local_snapshot`` and ``local_tier`` import torch; ``ckpt ls`` does not. This
module reads the same files (``<local_dir>/job-<16 hex>/rank_<owner>/step_<N>.json``)
with the standard library and the torch-free record parser the local tier
itself uses (``local_record``), so a record refused here is shown with the
reason the local tier would give.

A listing checks each record, that it sits where its job, owner and step say,
and the sizes of its slot and extra files; it reads no data and checks no
checksum (recovery does). Nothing a directory holds makes it raise: every
problem becomes an ``Unreadable`` entry naming the file and why.
"""

from __future__ import annotations

import errno
import os
import re
import stat
from dataclasses import dataclass, field
from typing import Iterable, Optional

from . import local_layout as layout
from .local_record import (RECORD_RE, SnapshotError, SnapshotRecord, default_local_dir, job_key,  # noqa: F401
                           parse_record)

MAX_RECORD_BYTES = 64 * 2**20
"""Larger ``step_<N>.json`` files are refused unread (a record is a few hundred bytes per tensor)."""
_JOB_RE = re.compile(r"job-[0-9a-f]{16}", re.ASCII)
_OWNER_RE = re.compile(r"rank_([0-9]+)", re.ASCII)
_SHOWN_RANGES = 8

ListingError = SnapshotError
"""A record is malformed, misplaced, or its files do not match it."""


# ------------------------------------------------------------------ listing
@dataclass(frozen=True)
class Unreadable:
    """A file or directory the listing could not use: ``path`` relative to the local dir, ``reason`` naming it."""

    path: str
    reason: str


@dataclass
class Group:
    """The committed snapshots of one job at one step and world size found on this node."""

    job: str
    step: int
    world_size: int
    owners: list[int] = field(default_factory=list)
    bytes: int = 0
    wall_time: float = 0.0
    own: list[int] = field(default_factory=list)
    """Owners whose copy here is their own snapshot (written by the owner on this node)."""
    replicas: list[int] = field(default_factory=list)
    """Owners whose copy here is a replica received from another node."""
    nodes: set[int] = field(default_factory=set)
    """The node index (rank // ranks per node) of the ranks holding these copies: this node."""
    hosts: set[str] = field(default_factory=set)
    elsewhere: set[int] = field(default_factory=set)
    """The other nodes that keep a copy of the owners held here (from the run's replica placement)."""

    def add(self, rec: SnapshotRecord) -> None:
        """Count one committed copy found on this node."""
        self.owners.append(rec.owner)
        self.bytes += rec.data_bytes + rec.extra_bytes
        self.wall_time = max(self.wall_time, rec.wall_time)
        if rec.holder < 0:
            return  # written before records said who holds them
        (self.own if rec.holder == rec.owner else self.replicas).append(rec.owner)
        self.hosts.update([rec.host] if rec.host else [])
        if rec.node_size > 0 and rec.factor > 0 and rec.world_size % rec.node_size == 0:
            here = layout.node_of(rec.holder, rec.node_size)
            self.nodes.add(here)
            self.elsewhere.update(layout.copy_nodes(rec.owner, rec.world_size, rec.node_size, rec.factor))
        self.elsewhere -= self.nodes

    def held_text(self) -> str:
        """``node 1 (host b): own 2,3, replicas of 0,1; other copies on node 0`` (empty when not recorded)."""
        if not self.own and not self.replicas:
            return ""
        where = "node " + ",".join(map(str, sorted(self.nodes))) if self.nodes else "this node"
        where += f" ({','.join(sorted(self.hosts))})" if self.hosts else ""
        parts = ([f"own {spans(ranges(self.own))}"] if self.own else []) + \
            ([f"replicas of {spans(ranges(self.replicas))}"] if self.replicas else [])
        other = ("other copies on node " + ",".join(map(str, sorted(self.elsewhere))) if self.elsewhere
                 else "no copy on another node") if self.nodes else ""
        return f"{where}: {', '.join(parts)}" + (f"; {other}" if other else "")

    @property
    def complete(self) -> bool:
        """Whether this node holds the snapshot of every rank of the world size."""
        return len(set(self.owners)) == self.world_size

    def missing(self) -> list[tuple[int, int]]:
        """The ranks of the world size not held here, as inclusive ``(first, last)`` ranges."""
        out, nxt = [], 0
        for lo, hi in ranges(self.owners):
            if lo > nxt:
                out.append((nxt, lo - 1))
            nxt = hi + 1
        if nxt < self.world_size:
            out.append((nxt, self.world_size - 1))
        return out

    def ranks_text(self) -> str:
        """``ranks 0-3`` or ``ranks 0,1,3 (missing 2)``."""
        text = "ranks " + spans(ranges(self.owners))
        return text if self.complete else f"{text} (missing {spans(self.missing())})"


@dataclass
class Listing:
    """What ``scan`` found: snapshot groups (by job, step, world size), unusable entries, and a note on the
    directory itself (``None`` when the local tier would use it)."""

    local_dir: str
    job: Optional[str]
    groups: list[Group]
    unreadable: list[Unreadable]
    note: Optional[str] = None


def ranges(values: Iterable[int]) -> list[tuple[int, int]]:
    """Sorted distinct ``values`` as inclusive ``(first, last)`` runs of consecutive integers."""
    out: list[tuple[int, int]] = []
    for v in sorted(set(values)):
        if out and v == out[-1][1] + 1:
            out[-1] = (out[-1][0], v)
        else:
            out.append((v, v))
    return out


def spans(runs: list[tuple[int, int]], limit: int = _SHOWN_RANGES) -> str:
    """``0-3,5,6``: runs of three or more as ``a-b``; after ``limit`` runs, ``,...`` and the count left out."""
    parts: list[str] = []
    for lo, hi in runs[:limit]:
        parts += [str(lo)] if lo == hi else [str(lo), str(hi)] if hi == lo + 1 else [f"{lo}-{hi}"]
    text = ",".join(parts)
    if len(runs) > limit:
        text += f",... ({sum(hi - lo + 1 for lo, hi in runs[limit:])} more)"
    return text


def scan(local_dir: str, job: Optional[str] = None) -> Optional[Listing]:
    """The snapshots under ``local_dir`` (only job directory ``job`` when given); None when ``local_dir`` does
    not exist. Never raises for what the directory holds."""
    root = os.path.abspath(local_dir)
    try:
        st = os.stat(root)
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        return Listing(root, job, [], [Unreadable(".", f"{root}: {_os_reason(e)}")])
    out = Listing(root, job, [], [])
    if not stat.S_ISDIR(st.st_mode):
        out.unreadable.append(Unreadable(".", f"{root} is not a directory"))
        return out
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        out.note = (f"{root} is owned by uid {st.st_uid} with mode {stat.filemode(st.st_mode)}; the local tier only "
                    "uses a directory of its own user that others cannot write")
    groups: dict[tuple[str, int, int], Group] = {}
    for name, is_dir, problem in _entries(root, out, "."):
        if not _JOB_RE.fullmatch(name) or (job is not None and name != job):
            continue
        if not is_dir:
            out.unreadable.append(Unreadable(name, f"{name} {problem or 'is not a directory'}"))
            continue
        _scan_job(root, name, groups, out)
    out.groups = [groups[k] for k in sorted(groups)]
    return out


def _entries(root: str, out: Listing, rel: str) -> list[tuple[str, bool, Optional[str]]]:
    """``(name, is a real directory, why not)`` of the entries of ``root/rel``, by name; a listing failure is
    recorded in ``out``."""
    try:
        with os.scandir(os.path.join(root, rel)) as it:
            found = []
            for e in it:
                try:
                    is_dir = e.is_dir(follow_symlinks=False)
                    problem = "is a symbolic link" if e.is_symlink() else None
                except OSError as err:
                    is_dir, problem = False, _os_reason(err)
                found.append((e.name, is_dir, problem))
    except FileNotFoundError:
        return []  # removed meanwhile (a job that ended cleans up)
    except OSError as e:
        out.unreadable.append(Unreadable(rel, f"{rel}: {_os_reason(e)}"))
        return []
    return sorted(found)


def _scan_job(root: str, job: str, groups: dict[tuple[str, int, int], Group], out: Listing) -> None:
    for name, is_dir, problem in _entries(root, out, job):
        m = _OWNER_RE.fullmatch(name)
        if m is None:
            continue
        rel = f"{job}/{name}"
        if not is_dir:
            out.unreadable.append(Unreadable(rel, f"{rel} {problem or 'is not a directory'}"))
            continue
        if len(m.group(1)) > 19 or name != f"rank_{int(m.group(1))}":
            out.unreadable.append(Unreadable(rel, f"{rel} is not a directory name the local tier writes"))
            continue
        owner = int(m.group(1))
        for fname, _, _ in _entries(root, out, rel):
            r = RECORD_RE.fullmatch(fname)
            if r is None:
                continue
            path = f"{rel}/{fname}"
            step = int(r.group(1))
            if fname != f"step_{step}.json":
                out.unreadable.append(Unreadable(path, f"{path} is not a record name the local tier writes"))
                continue
            try:
                rec = _read(root, path, job, owner, step)
            except ListingError as e:
                out.unreadable.append(Unreadable(path, " ".join(str(e).split())))
                continue
            if rec is None:
                continue
            groups.setdefault((job, rec.step, rec.world_size), Group(job, rec.step, rec.world_size)).add(rec)


def _read(root: str, path: str, job: str, owner: int, step: int) -> Optional[SnapshotRecord]:
    """The record at ``root/path`` and the checks of where it is and what its files hold; None when it was
    removed meanwhile (the local tier rotates its slots)."""
    full = os.path.join(root, path)
    body = _read_file(full, path)
    if body is None:
        return None
    rec = parse_record(body, path)
    if (rec.job, rec.owner, rec.step) != (job, owner, step):
        raise ListingError(f"{path}: the record is of rank {rec.owner} at step {rec.step} of "
                           f"{_short(rec.job)}, not where it lies")
    directory = os.path.dirname(full)
    problem = (_size_problem(os.path.join(directory, f"slot_{rec.slot}.data"), rec.data_bytes, exact=False)
               or _size_problem(os.path.join(directory, f"step_{step}.extra"), rec.extra_bytes, exact=True))
    if problem is not None:
        if not os.path.lexists(full):
            return None  # uncommitted while it was read
        raise ListingError(f"{path}: {problem}")
    return rec


def _read_file(full: str, path: str) -> Optional[bytes]:
    """The bytes of a regular file (no symbolic link, no FIFO, at most ``MAX_RECORD_BYTES``); None when gone."""
    try:
        fd = os.open(full, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ListingError(f"{path} is a symbolic link, not a record the local tier writes") from None
        raise ListingError(f"{path}: {_os_reason(e)}") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise ListingError(f"{path} is not a regular file")
        if st.st_size > MAX_RECORD_BYTES:
            raise ListingError(f"{path} is {st.st_size} bytes, more than a record holds ({MAX_RECORD_BYTES})")
        chunks, left = [], MAX_RECORD_BYTES + 1
        while left > 0:
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                break
            chunks.append(chunk)
            left -= len(chunk)
        if left <= 0:
            raise ListingError(f"{path} grew past {MAX_RECORD_BYTES} bytes while read")
        return b"".join(chunks)
    except OSError as e:
        raise ListingError(f"{path}: {_os_reason(e)}") from None
    finally:
        os.close(fd)


def _size_problem(full: str, want: int, exact: bool) -> Optional[str]:
    name = os.path.basename(full)
    try:
        st = os.lstat(full)
    except FileNotFoundError:
        return f"{name} is missing"
    except OSError as e:
        return f"{name}: {_os_reason(e)}"
    if not stat.S_ISREG(st.st_mode):
        return f"{name} is not a regular file"
    if st.st_size != want if exact else st.st_size < want:
        return f"{name} holds {st.st_size} bytes, the record says {want}"
    return None


def _short(value: str) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _os_reason(e: BaseException) -> str:
    why = getattr(e, "strerror", None) or str(e)
    return " ".join(f"{type(e).__name__}: {why}".split())
