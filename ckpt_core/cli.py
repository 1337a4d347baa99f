"""``ckpt``: list, inspect, verify, prune and export checkpoints (local paths or any fsspec URL).

Exit codes: 0 success; 1 a checkpoint is invalid (fails verification, is
corrupt or unsafe to read) or a deletion failed (``prune``); 2 bad usage, or a
path that is not a checkpoint (or root). Whatever a checkpoint directory
holds, a command ends with one line on stderr, never a traceback
(``--debug`` shows it).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import pickle
import re
import sys
import time
from typing import TYPE_CHECKING, Any, Iterator, Optional, Sequence

from . import __version__, signing
from .discovery import choose_for_restore, list_records, read_manifest, validate
from .errors import describe, is_fatal, one_line
from .integrity import IntegrityError
from .manifest import Manifest, ManifestError
from .records import CheckpointRecord
from .storage import DCP_METADATA_NAME, MANIFEST_NAME, basename, get_fs, join, list_dir, parse_step_dirname

if TYPE_CHECKING:
    from .local_listing import Listing

__all__ = ["main", "build_parser", "CliError"]

EXIT_OK, EXIT_INVALID, EXIT_ERROR = 0, 1, 2
_INVALID = (IntegrityError, pickle.UnpicklingError, EOFError)
"""Failures that mean "this checkpoint is corrupt or unsafe" (exit 1) rather than "not a checkpoint" (exit 2)."""
_SHARD_RE = re.compile(r"^__(\d+)_\d+\.distcp$")


class CliError(Exception):
    """An error the command reports as ``ckpt: error: ...`` with exit code ``code``."""

    def __init__(self, message: str, code: int = EXIT_ERROR) -> None:
        super().__init__(message)
        self.code = code


# ------------------------------------------------------------------ helpers
def _out(line: str = "") -> None:
    print(line, file=sys.stdout)


def _progress(total: int, desc: str, unit: str = "B") -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", disable=not sys.stderr.isatty(),
                file=sys.stderr, leave=False)


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "-"
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000.0
    return f"{n:.1f} PB"  # pragma: no cover


def human_age(seconds: Optional[float]) -> str:
    if seconds is None or not math.isfinite(seconds):
        return "-"
    s = max(0.0, seconds)
    for limit, div, unit in ((120, 1, "s"), (7200, 60, "m"), (172800, 3600, "h")):
        if s < limit:
            return f"{s / div:.0f}{unit}"
    return f"{s / 86400:.0f}d"


def _table(rows: list[list[str]], right: Sequence[int] = ()) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for r in rows:
        cells = [c.rjust(w) if i in right else c.ljust(w) for i, (c, w) in enumerate(zip(r, widths))]
        lines.append("  ".join(cells).rstrip())
    return lines


def _fs(path: str) -> tuple[Any, str]:
    try:
        return get_fs(path)
    except (ValueError, ImportError) as e:
        raise CliError(f"cannot open {path}: {e}") from None


def _exists(fs: Any, p: str) -> bool:
    try:
        return bool(fs.exists(p))
    except FileNotFoundError:
        return False


def _kind(path: str) -> str:
    """``"checkpoint"`` or ``"root"``; ``CliError`` (exit 2) naming what is missing otherwise."""
    fs, p = _fs(path)
    names = {basename(e["name"]): e for e in list_dir(fs, p)}
    if MANIFEST_NAME in names or DCP_METADATA_NAME in names:
        return "checkpoint"
    if parse_step_dirname(path) is not None:
        if not names and not _exists(fs, p):
            raise CliError(f"{path} does not exist")
        return "checkpoint"
    if any(e.get("type") == "directory" and parse_step_dirname(n) is not None for n, e in names.items()):
        return "root"
    if not names and not _exists(fs, p):
        raise CliError(f"{path} does not exist")
    raise CliError(
        f"{path} is not a checkpoint (no {MANIFEST_NAME}, no {DCP_METADATA_NAME}) "
        f"nor a checkpoint root (no step_<N> directories)"
    )


def _require_root(path: str) -> None:
    fs, p = _fs(path)
    if _exists(fs, p) and not fs.isdir(p):
        raise CliError(f"{path} is a file, not a checkpoint root (a directory holding step_<N> directories)")
    if _kind_quiet(path) == "checkpoint":
        raise CliError(f"{path} is a checkpoint, not a checkpoint root; give its parent directory "
                       f"(or use `ckpt inspect {path}`)")
    if not _exists(fs, p):
        raise CliError(f"{path} does not exist")


def _kind_quiet(path: str) -> Optional[str]:
    try:
        return _kind(path)
    except CliError:
        return None


def _signing_key(args: argparse.Namespace) -> Optional[bytes]:
    """The signing key of ``verify``/``export``/``inspect``: --signing-key-file, CKPT_SIGNING_KEY(_FILE), or None."""
    from .config import SettingError

    try:
        return signing.env_key(getattr(args, "signing_key_file", None))
    except SettingError as e:
        raise CliError(str(e)) from None


def _manifest_of(path: str) -> tuple[Optional[Manifest], Optional[str]]:
    """The manifest of checkpoint ``path``, or why there is none."""
    fs, p = _fs(path)
    try:
        return read_manifest(fs, p), None
    except FileNotFoundError:
        return None, f"no {MANIFEST_NAME} (in progress or torn)"
    except ManifestError as e:
        return None, f"unusable {MANIFEST_NAME}: {e}"


def _record_json(r: CheckpointRecord, now: float) -> dict[str, Any]:
    return {
        "step": r.step,
        "path": r.path,
        "committed": r.committed,
        "permanent": r.permanent,
        "healthy": r.healthy,
        "bytes": r.total_bytes,
        "files": r.num_files,
        "world_size": r.world_size,
        "epoch": r.epoch,
        "wall_time": r.wall_time if r.committed else None,
        "age_s": (now - r.wall_time) if r.committed and r.wall_time else None,
        "metrics": dict(r.metrics),
        "problem": r.problem,
    }


@contextlib.contextmanager
def _storage_options(options: Optional[str], paths: Sequence[str]) -> Iterator[None]:
    """Apply ``--storage-options`` to the file systems of ``paths`` (through fsspec's config) for one command."""
    if not options:
        yield
        return
    try:
        opts = json.loads(options)
    except ValueError as e:
        raise CliError(f"--storage-options is not valid JSON: {e}") from None
    if not isinstance(opts, dict):
        raise CliError("--storage-options must be a JSON object")
    from fsspec.config import conf
    from fsspec.core import split_protocol

    protocols = {split_protocol(p)[0] or "file" for p in paths if p}
    saved = {proto: conf.get(proto) for proto in protocols}
    for proto in protocols:
        conf[proto] = {**(conf.get(proto) or {}), **opts}
    try:
        yield
    finally:
        for proto, old in saved.items():
            if old is None:
                conf.pop(proto, None)
            else:
                conf[proto] = old


# --------------------------------------------------------------------- ls
def _newest_valid(records: list[CheckpointRecord]) -> tuple[Optional[int], dict[int, str]]:
    """The step a resuming run would load (checked as restore checks it by default), and why newer ones fail."""
    problems: dict[int, str] = {}
    for cand in choose_for_restore(records):
        manifest, why = _manifest_of(cand.path)
        problem = why if manifest is None else validate(cand.path, manifest, "size")
        if problem is None:
            return cand.step, problems
        problems[cand.step] = problem
    return None, problems


_AGE_UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


def parse_age(text: str) -> float:
    """``--max-age``: seconds, or a number with a suffix s, m, h or d (``90``, ``30m``, ``1.5h``, ``2d``)."""
    t = text.strip().lower()
    unit = _AGE_UNITS.get(t[-1:], None)
    try:
        value = float(t[:-1] if unit is not None else t) * (unit or 1)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not an age: seconds, or a number with s, m, h or d "
                                         "(e.g. 90, 30m, 6h, 2d)")
    return value


def _stale(root: str, age: Optional[float], newest_valid: Optional[int], max_age: Optional[float]) -> bool:
    """``--max-age``: whether the newest valid checkpoint is missing or too old (said on stderr)."""
    if max_age is None:
        return False
    if newest_valid is None:
        print(f"ckpt: no valid checkpoint under {root} (--max-age {human_age(max_age)})", file=sys.stderr)
        return True
    if age is None or age > max_age:
        print(f"ckpt: the newest valid checkpoint under {root} (step {newest_valid}) is {human_age(age)} old, more "
              f"than --max-age {human_age(max_age)}", file=sys.stderr)
        return True
    return False


def _lease(root: str) -> tuple[Optional[Any], str]:
    """The root's lease and its state (``live``, ``released``, ``expired``, ``gone``, ``none``, or a problem)."""
    from .lease import LeaseFiles, holder_alive, lease_state

    fs, path = _fs(root)
    try:
        rec, _, problem = LeaseFiles(fs, path).current()
    except OSError as e:
        return None, f"unreadable ({type(e).__name__}: {e})"
    if rec is None:
        return None, f"unreadable ({problem})" if problem else "none"
    return rec, lease_state(rec, time.time(), holder_alive(rec))


def _lease_line(root: str) -> str:
    rec, state = _lease(root)
    return f"lease: {state}" + (f", {rec.describe(time.time())}" if rec is not None else "")


def _local_dir(args: argparse.Namespace) -> str:
    """``--local-dir``, else ``CKPT_LOCAL_DIR``, else the local tier's default."""
    from .local_listing import default_local_dir

    return args.local_dir or os.environ.get("CKPT_LOCAL_DIR") or default_local_dir()


def _local_listing(args: argparse.Namespace) -> Optional[Listing]:
    """What the local tier holds on this node (None: no local dir here, so nothing to show)."""
    from .local_listing import job_key, scan

    return scan(_local_dir(args), job_key(args.run_id) if args.run_id is not None else None)


def _wall_time(t: float) -> str:
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))
    except (OverflowError, OSError, ValueError):
        return "-"


def _local_json(listing: Listing, now: float) -> dict[str, Any]:
    return {
        "dir": listing.local_dir,
        "job": listing.job,
        "note": listing.note,
        "snapshots": [{
            "job": g.job, "step": g.step, "world_size": g.world_size, "ranks": sorted(g.owners),
            "missing": [list(r) for r in g.missing()], "complete": g.complete, "bytes": g.bytes,
            "wall_time": g.wall_time, "age_s": now - g.wall_time, "own": sorted(g.own),
            "replicas": sorted(g.replicas), "nodes": sorted(g.nodes), "hosts": sorted(g.hosts),
            "other_copies_on_nodes": sorted(g.elsewhere),
        } for g in listing.groups],
        "unreadable": [{"path": u.path, "reason": u.reason} for u in listing.unreadable],
    }


def _local_lines(listing: Listing, run_id: Optional[str], now: float) -> list[str]:
    """The ``local tier`` section of ``ls``: one line per job, step and world size, then what is unusable."""
    lines = [f"local tier (this node: {listing.local_dir})"]
    if listing.note is not None:
        lines.append(f"  note: {listing.note}")
    rows = [[g.job, f"step {g.step}", f"world {g.world_size}", g.ranks_text(),
             "complete" if g.complete else "incomplete", human_bytes(g.bytes),
             f"{_wall_time(g.wall_time)} ({human_age(now - g.wall_time)} ago)", g.held_text()]
            for g in listing.groups]
    if rows:
        lines += ["  " + line for line in _table(rows, right=(5,))]
    elif not listing.unreadable:
        lines.append("  no snapshots" + (f" of run {run_id!r} ({listing.job})" if run_id is not None else ""))
    lines += [f"  unreadable: {u.reason}" for u in listing.unreadable]
    return lines


def cmd_ls(args: argparse.Namespace) -> int:
    root = args.root
    _require_root(root)
    records = list_records(root)
    now = time.time()
    newest_valid, problems = _newest_valid(records)
    newest = next((r for r in records if r.step == newest_valid), None)
    age = now - newest.wall_time if newest is not None and newest.wall_time else None
    code = EXIT_INVALID if _stale(root, age, newest_valid, args.max_age) else EXIT_OK
    local = _local_listing(args)
    if args.json:
        body = []
        for r in records:
            d = _record_json(r, now)
            d["newest_valid"] = r.step == newest_valid
            if r.step in problems:
                d["problem"] = problems[r.step]
            body.append(d)
        rec, state = _lease(root)
        lease = {"state": state, **({"run_id": rec.run_id, "host": rec.host, "pid": rec.pid,
                                     "refreshed_age_s": now - rec.refreshed} if rec is not None else {})}
        _out(json.dumps({"root": root, "newest_valid": newest_valid, "newest_valid_age_s": age,
                         "stale": code != EXIT_OK, "lease": lease, "checkpoints": body,
                         "local": _local_json(local, now) if local is not None else None}, indent=1))
        return code
    if not records:
        _out(f"no checkpoints under {root}")
    else:
        _ls_table(root, records, newest_valid, problems, age, now)
    if local is not None:
        _out()
        for line in _local_lines(local, args.run_id, now):
            _out(line)
    return code


def _ls_table(root: str, records: list[CheckpointRecord], newest_valid: Optional[int], problems: dict[int, str],
              age: Optional[float], now: float) -> None:
    rows = [["", "STEP", "STATE", "PERMANENT", "HEALTHY", "SIZE", "FILES", "WORLD", "AGE", "NOTE"]]
    for r in records:
        if r.committed:
            state = "invalid" if r.step in problems else "committed"
            note = problems.get(r.step, "")
            rows.append([
                "*" if r.step == newest_valid else "",
                str(r.step), state, "yes" if r.permanent else "no", "yes" if r.healthy else "NO",
                human_bytes(r.total_bytes), str(r.num_files), str(r.world_size or "-"),
                human_age(now - r.wall_time if r.wall_time else None), note,
            ])
        else:
            state = "unreadable" if r.unreadable else "torn" if (r.problem or "").startswith("no ") else "bad-manifest"
            rows.append(["", str(r.step), state, "-", "-", "-", "-", "-", "-", r.problem or ""])
    for line in _table(rows, right=(1, 5, 6, 7, 8)):
        _out(line)
    _out(_lease_line(root))
    if newest_valid is None:
        _out(f"no valid checkpoint under {root}: a run resuming here starts from scratch")
    else:
        _out(f"* newest valid checkpoint (what a run resumes from): step {newest_valid}, {human_age(age)} old")


# ---------------------------------------------------------------- inspect
def _tensor_rows(metadata: Any) -> tuple[list[dict[str, Any]], list[str]]:
    import torch
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    files: dict[str, set[str]] = {}
    for idx, info in (getattr(metadata, "storage_data", None) or {}).items():
        files.setdefault(idx.fqn, set()).add(str(getattr(info, "relative_path", "")))
    tensors, others = [], []
    for fqn, md in metadata.state_dict_metadata.items():
        if not isinstance(md, TensorStorageMetadata):
            others.append(fqn)
            continue
        ranks = sorted({int(m.group(1)) for f in files.get(fqn, ()) if (m := _SHARD_RE.match(f))})
        numel = 1
        for d in md.size:
            numel *= int(d)
        tensors.append({
            "name": fqn,
            "shape": [int(d) for d in md.size],
            "dtype": str(md.properties.dtype).replace("torch.", ""),
            "chunks": len(md.chunks),
            "ranks": ranks,
            "bytes": numel * torch.empty((), dtype=md.properties.dtype).element_size(),
        })
    return tensors, others


def _group(name: str) -> str:
    return name.split(".", 1)[0]


def _read_dcp_metadata(path: str, fs: Any, p: str,
                       manifest: Optional[Manifest]) -> tuple[Any, Optional[str], bool]:
    """The DCP metadata of checkpoint ``path``, why it is missing, and whether it is unreadable (invalid)."""
    if not _exists(fs, join(p, DCP_METADATA_NAME)):
        return None, f"no {DCP_METADATA_NAME} (DCP metadata)", False
    from .dcp_io import read_metadata

    try:
        return read_metadata(path, manifest=manifest), None, False
    except BaseException as e:  # noqa: BLE001 - a corrupt or crafted .metadata is reported, never run
        if is_fatal(e):
            raise
        return None, f"{DCP_METADATA_NAME} cannot be read: {describe(e)}", True


def _manifest_json(m: Manifest) -> dict[str, Any]:
    """The manifest fields ``inspect --json`` reports."""
    return {
        "version": m.version,
        "step": m.step,
        "epoch": m.epoch,
        "world_size": m.world_size,
        "wall_time": m.wall_time,
        "permanent": m.permanent,
        "healthy": m.healthy,
        "metrics": dict(m.metrics),
        "versions": dict(m.versions),
        "bytes": m.total_bytes,
        "files": {k: {"size": v.size, "crc32c": v.crc32c} for k, v in sorted(m.files.items())},
    }


def _inspect_json(path: str, step: Optional[int], manifest: Optional[Manifest], why: Optional[str],
                  md_problem: Optional[str], tensors: list[dict[str, Any]], others: list[str]) -> dict[str, Any]:
    """The body ``inspect --json`` prints: one object, so scripts need not parse the table."""
    body: dict[str, Any] = {
        "path": path,
        "step": step,
        "committed": manifest is not None,
        "problem": why,
        "metadata_problem": md_problem,
        "manifest": None,
        "contents": None,
        "tensors": tensors,
        "non_tensor_entries": others,
    }
    if manifest is not None:
        body["manifest"] = _manifest_json(manifest)
        body["contents"] = dict(manifest.contents)
    return body


def _print_manifest(m: Manifest) -> None:
    """Print the committed manifest's step, save time, flags, size, versions and metrics."""
    saved = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(m.wall_time)) if m.wall_time else "-"
    age = human_age(time.time() - m.wall_time) if m.wall_time else "-"
    _out(f"  committed:   yes (manifest format version {m.version})")
    _out(f"  step:        {m.step}    epoch: {m.epoch if m.epoch is not None else '-'}    world size: {m.world_size}")
    _out(f"  saved:       {saved} ({age} ago)")
    _out(f"  permanent:   {'yes' if m.permanent else 'no'}    healthy: "
         f"{'yes' if m.healthy else 'NO (non-finite values when saved)'}")
    _out(f"  files:       {len(m.files)}, {human_bytes(m.total_bytes)}")
    if m.versions:
        _out("  versions:    " + ", ".join(f"{k} {v}" for k, v in sorted(m.versions.items())))
    if m.metrics:
        _out("  metrics:     " + ", ".join(f"{k}={v:g}" for k, v in sorted(m.metrics.items())))


def _print_contents(c: Any) -> None:
    """Print the state a checkpoint carries, as its manifest describes it (unknown keys too)."""
    _out("state carried:")
    if not c:
        _out("  (the manifest does not describe its contents)")
        return
    _out(f"  model:          {'yes' if c.get('model') else 'no'}")
    _out(f"  optimizers:     {c.get('optimizers', 0)}")
    _out(f"  schedulers:     {', '.join(c.get('schedulers') or []) or 'none'}")
    _out(f"  grad scaler:    {c.get('scaler') or 'none'}")
    _out(f"  RNG states:     {'yes (per rank)' if c.get('rng') else 'no'}")
    _out(f"  data position:  {c.get('data_position') or 'none'}")
    _out(f"  extra state:    {', '.join(c.get('extra') or []) or 'none'}")
    known = {"model", "optimizers", "schedulers", "scaler", "rng", "data_position", "extra"}
    for k in sorted(set(c) - known):
        _out(f"  {k + ':':<15} {c[k]}")


def _print_tensors(tensors: list[dict[str, Any]], show_all: bool) -> None:
    """Print the per-group tensor summary and table; per-rank blobs only with ``--all`` (else counted)."""
    groups: dict[str, list[dict[str, Any]]] = {}
    for t in tensors:
        groups.setdefault(_group(t["name"]), []).append(t)
    summary = ", ".join(f"{g}: {len(ts)} ({human_bytes(sum(t['bytes'] for t in ts))})" for g, ts in groups.items())
    _out(f"tensors ({summary}):")
    shown = [t for t in tensors if show_all or _group(t["name"]) != "ranks"]
    if shown:
        rows = [["NAME", "SHAPE", "DTYPE", "SIZE", "CHUNKS", "RANKS"]]
        for t in shown:
            ranks = t["ranks"]
            rank_txt = ",".join(map(str, ranks)) if len(ranks) <= 8 else f"{len(ranks)} ranks"
            rows.append([t["name"], "x".join(map(str, t["shape"])) or "scalar", t["dtype"],
                         human_bytes(t["bytes"]), str(t["chunks"]), rank_txt or "-"])
        for line in _table(rows, right=(3, 4)):
            _out("  " + line)
    hidden = len(tensors) - len(shown)
    if hidden:
        _out(f"  ... and {hidden} per-rank state blob(s) (ranks.<r>: RNG, schedulers, counters, data position; "
             "--all shows them)")


def _print_non_tensors(others: list[str]) -> None:
    """Print the non-tensor entries counted by their parent key (``a.b.*``), or top-level group."""
    og: dict[str, int] = {}
    for o in others:
        key = o.rsplit(".", 1)[0] if o.count(".") >= 2 else _group(o)
        og[key] = og.get(key, 0) + 1
    _out("non-tensor entries: " + ", ".join(f"{k}.* ({n})" for k, n in og.items()))


def _print_inspect(path: str, manifest: Optional[Manifest], why: Optional[str], md_problem: Optional[str],
                   metadata: Any, tensors: list[dict[str, Any]], others: list[str], show_all: bool,
                   signed: Optional[str] = None) -> None:
    """Print ``inspect``'s human-readable report: manifest, carried state, then tensors."""
    _out(f"checkpoint {path}")
    if manifest is None:
        _out(f"  committed:   NO: {why}; it is never loaded")
    else:
        _print_manifest(manifest)
        if signed is not None:
            _out(f"  signed:      {signed}")
        _print_contents(manifest.contents)
    if md_problem:
        _out(f"  DCP metadata:  {md_problem}")
    if metadata is not None:
        _print_tensors(tensors, show_all)
        if others:
            _print_non_tensors(others)


def cmd_inspect(args: argparse.Namespace) -> int:
    """Show one checkpoint's manifest, carried state and tensors; exit 1 when it is corrupt or unsafe."""
    path = args.path.rstrip("/")
    if _kind(path) != "checkpoint":
        raise CliError(f"{path} is a checkpoint root, not a checkpoint; pick one of its step directories "
                       f"(`ckpt ls {path}`)")
    fs, p = _fs(path)
    key = _signing_key(args)
    manifest, why = _manifest_of(path)
    unusable = manifest is None and why is not None and why.startswith("unusable")
    metadata, md_problem, md_invalid = _read_dcp_metadata(path, fs, p, manifest)
    signed = signing.status(manifest, key) if manifest is not None else None
    invalid = unusable or md_invalid or (signed is not None and "REFUSED" in signed)
    if manifest is None and metadata is None:
        raise CliError(f"{path} is not a checkpoint: {why}; {md_problem}")
    tensors, others = _tensor_rows(metadata) if metadata is not None else ([], [])
    step = manifest.step if manifest is not None else parse_step_dirname(path)
    if args.json:
        body = _inspect_json(path, step, manifest, why, md_problem, tensors, others)
        body["signed"] = signed
        _out(json.dumps(body, indent=1, allow_nan=True))
        return EXIT_INVALID if invalid else EXIT_OK
    _print_inspect(path, manifest, why, md_problem, metadata, tensors, others, args.all, signed)
    return EXIT_INVALID if invalid else EXIT_OK


# ----------------------------------------------------------------- verify
def cmd_verify(args: argparse.Namespace) -> int:
    target = args.path.rstrip("/") or args.path
    level = "checksum" if args.checksum else "size"
    key = _signing_key(args)
    if _kind(target) == "root":
        records = list_records(target)
    else:
        manifest, why = _manifest_of(target)
        dir_step = parse_step_dirname(target)
        step = manifest.step if manifest is not None else (-1 if dir_step is None else dir_step)
        records = [CheckpointRecord(step=step, path=target, committed=manifest is not None, problem=why,
                                    total_bytes=manifest.total_bytes if manifest else 0)]
    results: list[dict[str, Any]] = []
    total = sum(r.total_bytes for r in records if r.committed) if level == "checksum" else 0
    with _progress(total, f"verify ({level})") as bar:
        for r in records:
            problem = r.problem
            if r.committed:
                manifest, why = _manifest_of(r.path)
                if manifest is not None and key is not None:
                    try:
                        manifest = signing.authenticate(manifest, key, MANIFEST_NAME)
                    except signing.SignatureError as e:
                        manifest, why = None, str(e)
                problem = why if manifest is None else validate(
                    r.path, manifest, level, progress=bar.update if level == "checksum" else None)
            results.append({"step": r.step, "path": r.path, "valid": problem is None, "problem": problem})
    valid = [x for x in results if x["valid"]]
    if args.json:
        _out(json.dumps({"level": level, "valid": len(valid) == len(results), "checkpoints": results}, indent=1))
    else:
        for x in results:
            if x["valid"]:
                _out(f"OK    step {x['step']:>9}  {x['path']}")
            else:
                _out(f"FAIL  step {x['step']:>9}  {x['path']}: {x['problem']}")
        if not results:
            _out(f"no checkpoints under {target}")
        else:
            _out(f"{len(valid)} of {len(results)} checkpoint(s) valid ({level} check)")
    return EXIT_OK if len(valid) == len(results) else EXIT_INVALID


# ------------------------------------------------------------------ prune
def _keep_best(text: Optional[str]) -> Optional[tuple]:
    if text is None:
        return None
    from .config import parse_value

    try:
        return parse_value("keep_best", text)
    except ValueError as e:
        raise CliError(f"--keep-best {text!r}: {e}") from None


def cmd_prune(args: argparse.Namespace) -> int:
    from .retention import build_policy, records_to_delete
    from .storage import remove_tree

    root = args.root.rstrip("/") or args.root
    _require_root(root)
    try:
        policy = build_policy(
            keep_last=args.keep_last,
            keep_every_n_steps=args.keep_every_n_steps,
            keep_every_seconds=args.keep_every_seconds,
            keep_best=_keep_best(args.keep_best),
        )
    except ValueError as e:
        raise CliError(str(e)) from None
    records = list_records(root)
    newest_valid, _ = _newest_valid(records)
    doomed = records_to_delete(records, policy, protected=() if newest_valid is None else (newest_valid,))
    holder, state = _lease(root)
    if state == "live" and any(not r.committed for r in doomed):  # they may be saves of that job in progress
        _out(f"a live job holds the lease ({holder.describe(time.time())}): uncommitted directories are kept")
        doomed = [r for r in doomed if r.committed]
    kept = [r.step for r in records if r not in doomed]
    verb = "would delete" if args.dry_run else "deleting"
    fs, _ = _fs(root)
    failed = []
    freed = 0
    with _progress(len(doomed) if not args.dry_run else 0, "prune", unit="ckpt") as bar:
        for r in doomed:
            what = "committed" if r.committed else "uncommitted"
            _out(f"{verb} step {r.step} ({what}, {human_bytes(r.total_bytes) if r.committed else '-'}): {r.path}")
            if args.dry_run:
                freed += r.total_bytes
                continue
            try:
                remove_tree(fs, _fs(r.path)[1])
                freed += r.total_bytes
            except OSError as e:
                failed.append(r.step)
                print(f"ckpt: could not delete {r.path}: {type(e).__name__}: {e}", file=sys.stderr)
            bar.update(1)
    summary = "would free" if args.dry_run else "freed"
    _out(f"{len(doomed)} to delete, {len(kept)} kept (steps {', '.join(map(str, kept)) or 'none'}); "
         f"{summary} {human_bytes(freed)}")
    if failed:
        _out(f"failed to delete steps {failed}")
        return EXIT_INVALID
    return EXIT_OK


# ----------------------------------------------------------------- export
def cmd_export(args: argparse.Namespace) -> int:
    from .export import ExportError, InvalidCheckpointError, export_model

    path = args.path.rstrip("/")
    if _kind(path) != "checkpoint":
        raise CliError(f"{path} is a checkpoint root, not a checkpoint; pick one of its step directories "
                       f"(`ckpt ls {path}`)")
    fmt = args.format
    if fmt is None:
        suffix = args.out.lower()
        fmt = "torch" if suffix.endswith((".pt", ".pth", ".bin")) else "lightning" if suffix.endswith(".ckpt") else (
            "safetensors")
    try:
        result = export_model(path, args.out, format=fmt, dtype=args.dtype,
                              verify="checksum" if args.checksum else "size",
                              allow_uncommitted=args.force, signing_key=_signing_key(args))
    except InvalidCheckpointError as e:
        raise CliError(str(e), EXIT_INVALID) from None
    except ExportError as e:
        raise CliError(str(e)) from None
    dtype = result.dtype or "saved dtypes"
    step = f"step {result.step}" if result.step is not None else "an uncommitted checkpoint"
    _out(f"wrote {result.out}: {result.num_tensors} tensors, {human_bytes(result.bytes)} ({fmt}, {dtype}) "
         f"from {step}")
    if result.skipped:
        _out(f"skipped non-tensor entries: {', '.join(result.skipped)}")
    return EXIT_OK


# --------------------------------------------------------------- settings
def cmd_settings(args: argparse.Namespace, flags: list[str]) -> int:
    from .config import resolve_settings, settings_table_markdown

    if args.markdown:
        sys.stdout.write(settings_table_markdown())
        return EXIT_OK
    try:
        settings, sources = resolve_settings(env=os.environ, argv=flags)
    except ValueError as e:
        raise CliError(str(e)) from None
    import dataclasses

    values = dataclasses.asdict(settings)
    from .config import redact

    values = {k: redact(k, v) for k, v in values.items()}
    if args.json:
        _out(json.dumps({k: {"value": v, "source": sources[k]} for k, v in values.items()}, indent=1, default=str))
        return EXIT_OK
    rows = [["SETTING", "VALUE", "SOURCE"]] + [[k, json.dumps(v, default=str), sources[k]] for k, v in values.items()]
    for line in _table(rows):
        _out(line)
    return EXIT_OK


# ----------------------------------------------------------------- parser
def _add_ls(sub: Any) -> None:
    """The ``ls`` subcommand: list the checkpoints under a root."""
    p = sub.add_parser("ls", help="list the checkpoints under a root", description="List the checkpoints under ROOT, "
                       "oldest first; * marks the newest valid one (what a resuming run loads). With --max-age, "
                       "exit 1 when there is none or it is older (cron-style monitoring). Then the local tier's "
                       "snapshots on this node, when its local dir exists.")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--max-age", type=parse_age, default=None, metavar="AGE",
                   help="exit 1 when the newest valid checkpoint is older than AGE: seconds, or with a suffix "
                        "s, m, h or d (e.g. 6h)")
    p.add_argument("--local-dir", metavar="DIR", default=None,
                   help="the local tier's directory on this node (default: $CKPT_LOCAL_DIR, else "
                        "/dev/shm/ckpt-<uid>); nothing is shown when it does not exist")
    p.add_argument("--run-id", metavar="ID", default=None,
                   help="show only the local snapshots of the job with this job id (as the lease line shows it, "
                        "e.g. slurm:4711)")
    p.set_defaults(func=cmd_ls, paths=lambda a: [a.root])


def _add_inspect(sub: Any) -> None:
    """The ``inspect`` subcommand: one checkpoint's manifest, tensors and carried state."""
    p = sub.add_parser("inspect", help="show a checkpoint's manifest, tensors and carried state",
                       description="Show the manifest, the tensors (shape, dtype, sharding) and the state a "
                       "checkpoint carries.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--all", action="store_true", help="also list the per-rank state blobs")
    _add_signing_key_file(p)
    p.set_defaults(func=cmd_inspect, paths=lambda a: [a.path])


def _add_verify(sub: Any) -> None:
    """The ``verify`` subcommand: validate a checkpoint or every checkpoint under a root."""
    p = sub.add_parser("verify", help="validate a checkpoint or every checkpoint under a root",
                       description="Check that checkpoints are committed and complete: file sizes against the "
                       "manifest, or CRC32C checksums of every byte with --checksum. Exit 0 when all are valid, 1 "
                       "otherwise.")
    p.add_argument("path", metavar="PATH|ROOT")
    p.add_argument("--checksum", action="store_true", help="read every file and compare CRC32C checksums")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    _add_signing_key_file(p)
    p.set_defaults(func=cmd_verify, paths=lambda a: [a.path])


def _add_signing_key_file(p: Any) -> None:
    p.add_argument("--signing-key-file", metavar="FILE", default=None,
                   help="refuse checkpoints not signed with the key in FILE (or set CKPT_SIGNING_KEY; "
                        "CKPT_SIGNING_KEY_FILE)")


def _add_prune(sub: Any) -> None:
    """The ``prune`` subcommand: delete checkpoints by the retention policy."""
    p = sub.add_parser("prune", help="delete checkpoints by the retention policy",
                       description="Delete the checkpoints the training-side retention policy would delete. "
                       "Never deleted: the newest valid (what a resuming run loads), newest committed and newest "
                       "healthy checkpoints, permanent ones, and "
                       "uncommitted directories newer than the newest committed one (a save may be in progress).")
    p.add_argument("root", metavar="ROOT")
    p.add_argument("--keep-last", type=int, required=True, metavar="K", help="keep the newest K healthy checkpoints")
    p.add_argument("--keep-every-n-steps", type=int, metavar="N", help="also keep steps that are multiples of N")
    p.add_argument("--keep-every-seconds", type=float, metavar="T", help="also keep one checkpoint per T seconds")
    p.add_argument("--keep-best", metavar="METRIC,MODE,N", help="also keep the N best by a metric, e.g. val_loss,min,2")
    p.add_argument("--dry-run", action="store_true", help="print what would be deleted, delete nothing")
    p.set_defaults(func=cmd_prune, paths=lambda a: [a.root])


def _add_export(sub: Any) -> None:
    """The ``export`` subcommand: consolidate the model weights into one file."""
    p = sub.add_parser("export", help="consolidate the model weights into one file for inference",
                       description="Write the model weights (keys under 'model.', prefix stripped) of a sharded "
                       "checkpoint to one safetensors or torch file. Needs no process group; the optimizer state "
                       "is not read.")
    p.add_argument("path", metavar="PATH")
    p.add_argument("out", metavar="OUT")
    p.add_argument("--format", choices=("safetensors", "torch", "lightning"), default=None,
                   help="output format (default: torch for .pt/.pth/.bin, lightning for .ckpt "
                        "(LightningModule.load_from_checkpoint), else safetensors)")
    p.add_argument("--dtype", choices=("bf16", "fp16", "fp32"), default=None,
                   help="cast floating-point weights (default: keep the saved dtypes)")
    p.add_argument("--checksum", action="store_true", help="verify CRC32C checksums before exporting")
    p.add_argument("--force", action="store_true", help="export even an uncommitted (torn) checkpoint")
    _add_signing_key_file(p)
    p.set_defaults(func=cmd_export, paths=lambda a: [a.path, a.out])


def _add_settings(sub: Any) -> None:
    """The ``settings`` subcommand: the effective settings and their sources (``main`` dispatches it)."""
    p = sub.add_parser("settings", help="show the effective checkpoint settings and where each comes from",
                       description="Resolve the checkpoint settings from CKPT_<NAME> environment variables and "
                       "--ckpt.<name>=value flags, as a training run would (without its code arguments).")
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--markdown", action="store_true", help="print the settings reference table (docs/settings.md)")
    p.set_defaults(func=None, paths=lambda a: [])


def build_parser() -> argparse.ArgumentParser:
    """The ``ckpt`` argument parser: global options, then one subparser per command."""
    parser = argparse.ArgumentParser(
        prog="ckpt",
        description="Inspect and manage fault-tolerant checkpoints (local paths or fsspec URLs: s3://, gs://, memory://).",
        epilog="exit codes: 0 ok, 1 verification failed, 2 usage error or not a checkpoint",
    )
    parser.add_argument("--version", action="version", version=f"ckpt {__version__}")
    parser.add_argument("--storage-options", metavar="JSON", default=os.environ.get("CKPT_STORAGE_OPTIONS"),
                        help="fsspec storage options as a JSON object, e.g. '{\"endpoint_url\": \"http://...\"}' "
                             "(default: $CKPT_STORAGE_OPTIONS)")
    parser.add_argument("--debug", action="store_true", help="show tracebacks instead of short error messages")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for add in (_add_ls, _add_inspect, _add_verify, _add_prune, _add_export, _add_settings):
        add(sub)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Run the ``ckpt`` command line; returns the exit code."""
    from .config import pop_ckpt_flags

    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    try:
        ckpt_flags_raw, rest = pop_ckpt_flags(argv)
    except ValueError as e:
        parser.print_usage(sys.stderr)
        print(f"ckpt: error: {e}", file=sys.stderr)
        return EXIT_ERROR
    ckpt_flags = [f"--ckpt.{k}={v}" for k, v in ckpt_flags_raw.items()]
    try:
        args = parser.parse_args(rest)
    except SystemExit as e:  # argparse: --help, --version, usage errors
        return int(e.code) if isinstance(e.code, int) else (EXIT_ERROR if e.code else EXIT_OK)
    if ckpt_flags_raw and args.command != "settings":
        print(f"ckpt: error: --ckpt.<name> flags only apply to `ckpt settings`, got {' '.join(ckpt_flags)}",
              file=sys.stderr)
        return EXIT_ERROR
    try:
        with _storage_options(args.storage_options, args.paths(args)):
            if args.command == "settings":
                return cmd_settings(args, ckpt_flags)
            return args.func(args)
    except CliError as e:
        if args.debug:
            raise
        print(f"ckpt: error: {one_line(str(e))}", file=sys.stderr)
        return e.code
    except KeyboardInterrupt:
        print("ckpt: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        with contextlib.suppress(OSError):
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - silence the flush at exit
        return EXIT_OK
    except BaseException as e:  # noqa: BLE001 - one line for anything, whatever the checkpoint holds
        if args.debug or isinstance(e, (SystemExit, GeneratorExit)):
            raise
        print(f"ckpt: error: {describe(e)}", file=sys.stderr)
        return EXIT_INVALID if isinstance(e, _INVALID) else EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
