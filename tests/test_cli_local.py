"""``ckpt ls``'s local tier section: snapshots a real manager left in its local dir, listed without torch.

The snapshot directories come from ``CheckpointManager`` runs in this process
(world size 1); the world-size-4 case and the hostile records are forged from
those real files. The listing parses records with the local tier's own
torch-free parser (``local_record``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_core import CheckpointManager, TrainState
from ckpt_core import local_listing as listing
from ckpt_core import local_snapshot as snap
from ckpt_core import local_tier
from ckpt_core.cli import human_bytes
from helpers_ckpt import run_cli

JOB_A, JOB_B = local_tier.job_key("job-a"), local_tier.job_key("job-b")
FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _train(root: Path, local: Path, run_id: str, steps: int, every: int | None) -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(7, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    state = TrainState(model, opt)
    manager = CheckpointManager(str(root), local_every_n_steps=2, local_dir=str(local), run_id=run_id, env={},
                                argv=[], async_mode="off", local_cleanup=False, every_n_steps=every)
    for step in range(1, steps + 1):
        model(torch.randn(4, 7)).pow(2).mean().backward()
        opt.step()
        opt.zero_grad()
        manager.maybe_save(step, state)
    manager.wait()
    manager.close()


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """``run/``: durable checkpoints at steps 3 and 6; ``local/``: job-a's snapshots of steps 4 and 6 (keep 1)
    and job-b's of step 2."""
    base = tmp_path_factory.mktemp("local-tier")
    _train(base / "run", base / "local", "job-a", 6, every=3)
    _train(base / "run-b", base / "local", "job-b", 2, every=None)
    return base


@pytest.fixture
def dirs(pristine, tmp_path, monkeypatch) -> tuple[str, Path]:
    """A fresh copy: (the durable root, the local dir); ``CKPT_LOCAL_DIR`` unset."""
    monkeypatch.delenv("CKPT_LOCAL_DIR", raising=False)
    shutil.copytree(pristine, tmp_path / "copy", symlinks=True)
    return str(tmp_path / "copy" / "run"), tmp_path / "copy" / "local"


def _record(local: Path, job: str, owner: int, step: int) -> snap.SnapshotRecord:
    path = local / job / f"rank_{owner}" / f"step_{step}.json"
    return snap.parse_record(path.read_bytes(), str(path))


def _freeze(monkeypatch, now: float) -> None:
    monkeypatch.setattr(time, "time", lambda: now)


def _when(t: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t))


def _section(out: str) -> list[str]:
    """The lines of the local tier section (after the blank line that ends the durable listing)."""
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("local tier (this node: "))
    assert lines[start - 1] == ""
    return lines[start:]


HOST = local_tier._HOST
ONE_NODE = f"node 0 ({HOST}): own 0; no copy on another node"


def _row(local: Path, job: str, step: int, now: float, ranks: str = "ranks 0", world: int = 1,
         held: str = "complete", owners: tuple[int, ...] = (0,), where: str = ONE_NODE) -> str:
    recs = [_record(local, job, o, step) for o in owners]
    size = human_bytes(sum(r.data_bytes + r.extra_bytes for r in recs))
    newest = max(r.wall_time for r in recs)
    return f"  {job}  step {step}  world {world}  {ranks}  {held}  {size}  {_when(newest)} (10m ago)  {where}"


# ------------------------------------------------------------- the listing
def test_ls_lists_the_snapshots_of_every_job_after_the_durable_checkpoints(capsys, monkeypatch, dirs):
    root, local = dirs
    now = _record(local, JOB_A, 0, 6).wall_time + 600
    _freeze(monkeypatch, now)
    code, out, err = run_cli(capsys, "ls", root, "--local-dir", str(local))
    assert code == 0 and err == ""
    assert "* newest valid checkpoint (what a run resumes from): step 6" in out
    assert out.index("* newest valid checkpoint") < out.index("local tier")
    assert _section(out) == [
        f"local tier (this node: {local})",  # by job directory name (job-b's sorts first), then step
        _row(local, JOB_B, 2, now),
        _row(local, JOB_A, 4, now),
        _row(local, JOB_A, 6, now),
    ]
    assert JOB_B < JOB_A
    assert sorted(p.name for p in (local / JOB_A / "rank_0").glob("step_*.json")) == ["step_4.json", "step_6.json"]

    monkeypatch.setenv("CKPT_LOCAL_DIR", str(local))  # the training run's variable is the default
    assert run_cli(capsys, "ls", root)[1] == out


def test_run_id_shows_only_that_job(capsys, monkeypatch, dirs):
    root, local = dirs
    now = _record(local, JOB_B, 0, 2).wall_time + 600
    _freeze(monkeypatch, now)
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-b")
    assert code == 0
    assert _section(out) == [f"local tier (this node: {local})", _row(local, JOB_B, 2, now)]
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-c")
    assert code == 0
    assert _section(out) == [f"local tier (this node: {local})",
                             f"  no snapshots of run 'job-c' ({local_tier.job_key('job-c')})"]


def test_json_has_the_local_section(capsys, monkeypatch, dirs):
    root, local = dirs
    now = _record(local, JOB_A, 0, 6).wall_time + 600
    _freeze(monkeypatch, now)
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-a", "--json")
    assert code == 0
    body = json.loads(out)
    assert [c["step"] for c in body["checkpoints"]] == [3, 6]
    recs = {s: _record(local, JOB_A, 0, s) for s in (4, 6)}
    assert body["local"] == {
        "dir": str(local), "job": JOB_A, "note": None, "unreadable": [],
        "snapshots": [{"job": JOB_A, "step": s, "world_size": 1, "ranks": [0], "missing": [], "complete": True,
                       "bytes": r.data_bytes + r.extra_bytes, "wall_time": r.wall_time, "age_s": now - r.wall_time,
                       "own": [0], "replicas": [], "nodes": [0], "hosts": [HOST], "other_copies_on_nodes": []}
                      for s, r in recs.items()]}


def _forge(local: Path, job: str, owner: int, step: int, src_owner: int = 0, **changes) -> Path:
    """Copy rank ``src_owner``'s snapshot of ``step`` to ``owner`` with the record's fields changed."""
    src, dst = local / job / f"rank_{src_owner}", local / job / f"rank_{owner}"
    body = json.loads((src / f"step_{step}.json").read_bytes())
    if dst != src:
        dst.mkdir(mode=0o700, exist_ok=True)
        shutil.copy(src / f"slot_{body['slot']}.data", dst / f"slot_{body['slot']}.data")
        shutil.copy(src / f"step_{step}.extra", dst / f"step_{step}.extra")
    path = dst / f"step_{step}.json"
    path.write_text(json.dumps({**body, "owner": owner, "holder": owner, **changes}))
    return path


def test_a_node_holding_some_ranks_of_a_larger_world(capsys, monkeypatch, dirs):
    root, local = dirs
    now = _record(local, JOB_A, 0, 6).wall_time + 600
    _freeze(monkeypatch, now)
    for owner in (0, 1, 3):  # a world of 4 in which this node holds no copy of rank 2's step 6
        _forge(local, JOB_A, owner, 6, world_size=4, node_size=4)
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-a")
    assert code == 0
    rows = [_row(local, JOB_A, 4, now), _row(local, JOB_A, 6, now, "ranks 0,1,3 (missing 2)", 4, "incomplete",
                                              (0, 1, 3), f"node 0 ({HOST}): own 0,1,3; no copy on another node")]
    # the table pads the shorter cells of step 4's row to step 6's widths
    assert _section(out) == [f"local tier (this node: {local})",
                             rows[0].replace("ranks 0  complete  ", "ranks 0                  complete    "), rows[1]]
    body = json.loads(run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-a", "--json")[1])
    six = body["local"]["snapshots"][1]
    assert (six["ranks"], six["missing"], six["complete"], six["world_size"]) == ([0, 1, 3], [[2, 2]], False, 4)


# ------------------------------------------------------------ hostile files
def test_malformed_and_hostile_records_are_shown_as_unreadable(capsys, monkeypatch, dirs):
    root, local = dirs
    rank0 = local / JOB_A / "rank_0"
    good = json.loads((rank0 / "step_6.json").read_bytes())
    (rank0 / "step_8.json").write_bytes(b"{not json")
    huge = [[0, "float32", [2**40, 2**40], 0, 4, [0, 0, 1]]]
    (rank0 / "step_10.json").write_text(json.dumps({**good, "step": 10, "tensors": huge}))
    (rank0 / "step_12.json").symlink_to(rank0 / "step_6.json")
    os.mkfifo(rank0 / "step_14.json")  # opening it must not block
    (rank0 / "step_16.json").write_text(json.dumps({**good, "tensors": [[0, ["x"], [1], 0, 4, [0, 0, 1]]]}))
    (rank0 / "step_18.json").write_bytes((rank0 / "step_4.json").read_bytes())  # a record of step 4
    (rank0 / "step_20.json").write_text(json.dumps({**good, "step": 20, "slot": 7}))  # its slot file is missing
    (rank0 / "step_22.json").write_bytes(b"[" * 100_000 + b"]" * 100_000)
    (rank0 / "step_024.json").write_bytes(b"{}")
    (rank0 / "step_26.json").write_text(json.dumps({**good, "step": 26, "wall_time": 1e300}))
    shutil.copy(rank0 / "step_6.extra", rank0 / "step_26.extra")
    (local / JOB_A / "rank_5").symlink_to(rank0)
    now = good["wall_time"] + 600
    _freeze(monkeypatch, now)
    code, out, err = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-a")
    assert code == 0 and err == ""
    lines = _section(out)
    # the rows of steps 4 and 6 are padded to the width of "step 26"
    assert lines[1:3] == [_row(local, JOB_A, s, now).replace(f"step {s}  ", f"step {s}   ") for s in (4, 6)]
    assert lines[3].startswith(f"  {JOB_A}  step 26  world 1  ranks 0  complete  ")  # a valid record...
    assert "  - (0s ago)  " in lines[3] and lines[3].endswith(f"  {ONE_NODE}")  # ...saved in the year 10^292
    r = f"{JOB_A}/rank_0"
    assert lines[4:] == [
        f"  unreadable: {r}/step_024.json is not a record name the local tier writes",
        f"  unreadable: {r}/step_10.json: tensor 0 does not fit: shape (1099511627776, 1099511627776) of float32 "
        f"is not 4 bytes at offset 0 of {good['data_bytes']}",
        f"  unreadable: {r}/step_12.json is a symbolic link, not a record the local tier writes",
        f"  unreadable: {r}/step_14.json is not a regular file",
        f"  unreadable: {r}/step_16.json: tensor 0 has an unknown dtype \"['x']\"",
        f"  unreadable: {r}/step_18.json: the record is of rank 0 at step 4 of '{JOB_A}', not where it lies",
        f"  unreadable: {r}/step_20.json: slot_7.data is missing",
        f"  unreadable: {r}/step_22.json is nested too deeply to be a valid file",
        f"  unreadable: {r}/step_8.json is not valid JSON (Expecting property name enclosed in double quotes: "
        "line 1 column 2 (char 1))",
        f"  unreadable: {JOB_A}/rank_5 is a symbolic link",
    ]
    body = json.loads(run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-a", "--json")[1])
    assert [u["path"] for u in body["local"]["unreadable"]][-2:] == [f"{r}/step_8.json", f"{JOB_A}/rank_5"]
    assert [s["step"] for s in body["local"]["snapshots"]] == [4, 6, 26]


def test_an_oversized_record_is_not_read(capsys, monkeypatch, dirs):
    root, local = dirs
    monkeypatch.setattr(listing, "MAX_RECORD_BYTES", 1000)
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-b")
    path = f"{JOB_B}/rank_0/step_2.json"
    size = (local / path).stat().st_size
    assert code == 0 and _section(out)[1:] == [
        f"  unreadable: {path} is {size} bytes, more than a record holds (1000)"]


def test_a_directory_others_can_write_is_flagged(capsys, dirs):
    root, local = dirs
    local.chmod(0o777)
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(local), "--run-id", "job-b")
    assert code == 0
    assert _section(out)[1] == (f"  note: {local} is owned by uid {os.getuid()} with mode drwxrwxrwx; the local "
                                "tier only uses a directory of its own user that others cannot write")


def test_an_empty_or_missing_local_dir(capsys, monkeypatch, dirs, tmp_path):
    root, _ = dirs
    (tmp_path / "empty").mkdir()
    code, out, _ = run_cli(capsys, "ls", root, "--local-dir", str(tmp_path / "empty"))
    assert code == 0 and _section(out) == [f"local tier (this node: {tmp_path / 'empty'})", "  no snapshots"]

    code, plain, _ = run_cli(capsys, "ls", root, "--local-dir", str(tmp_path / "nowhere"))
    assert code == 0 and "local tier" not in plain and not plain.endswith("\n\n")
    assert plain.splitlines()[-1].startswith("* newest valid checkpoint")
    monkeypatch.setenv("CKPT_LOCAL_DIR", str(tmp_path / "nowhere"))
    assert run_cli(capsys, "ls", root) == (0, plain, "")
    monkeypatch.delenv("CKPT_LOCAL_DIR")
    monkeypatch.setattr(listing, "default_local_dir", lambda: str(tmp_path / "nowhere"))
    assert run_cli(capsys, "ls", root) == (0, plain, "")
    assert json.loads(run_cli(capsys, "ls", root, "--json")[1])["local"] is None


def test_the_local_section_imports_no_torch(dirs, tmp_path):
    """``ls`` of a root without committed checkpoints runs without torch, local section included (validating a
    committed checkpoint's ``.metadata`` imports it, as restore does)."""
    _, local = dirs
    (tmp_path / "empty-root").mkdir()
    code = ("import sys; from ckpt_core.cli import main; "
            f"rc = main(['ls', {str(tmp_path / 'empty-root')!r}, '--local-dir', {str(local)!r}]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    assert f"  {JOB_A}  step 6  world 1  ranks 0  complete  " in res.stdout


# ------------------------------------------------- the record parser the listing and the local tier share
def _body() -> dict:
    rec = snap.SnapshotRecord("job-x", 0, 2, 8, 1, 0, 128, 7, 10, 20, 9, "[1, {}]",
                              (snap.TensorEntry(0, "float32", (4, 4), 0, 64, (1.0, 2.0, 16)),
                               snap.TensorEntry(1, "bfloat16", (3,), 64, 6, (0.0, 0.0, 3))), 1.5)
    return json.loads(rec.to_json())


def _parses_or_refuses(text: bytes) -> None:
    """Any bytes give a record or ``SnapshotError`` (what the listing shows as unreadable), nothing else."""
    try:
        snap.parse_record(text, "r")
    except snap.SnapshotError:
        pass


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=15)


@FAST
@given(st.integers(0, 1), st.integers(0, 5), json_values | st.sampled_from(
    ["float32", "bfloat16", "float8_e5m2", [4, 4], [3], [2**40, 2**40], [-1], 0, 64, 128, 16, 6, 2**63]))
def test_any_tensor_entry_parses_or_is_refused(i, j, value):
    body = _body()
    body["tensors"][i][j] = value
    _parses_or_refuses(json.dumps(body).encode())


def test_whole_documents_parse_or_are_refused():
    for text in (b"", b"{", b"[]", b"null", b"1e999", b'{"format": 1}', b"9" * 5000, b"[" * 10**5,
                 json.dumps({**_body(), "tensors": [[0, "float32", [1] * 65, 0, 4, [0, 0, 1]]]}).encode()):
        _parses_or_refuses(text)


def test_an_unhashable_dtype_is_refused_with_snapshot_error():
    """It raised ``TypeError``, which the local tier's scan does not catch: one planted record stopped recovery."""
    body = _body()
    body["tensors"][0][1] = ["float32"]
    with pytest.raises(snap.SnapshotError, match="unknown dtype"):
        snap.parse_record(json.dumps(body).encode(), "r")


# ------------------------------------------------------------ rank ranges
@pytest.mark.parametrize("owners,world,text", [
    ([0, 1, 2, 3], 4, "ranks 0-3"),
    ([0, 1, 3], 4, "ranks 0,1,3 (missing 2)"),
    ([3, 1, 0], 8, "ranks 0,1,3 (missing 2,4-7)"),
    ([5], 2**62, f"ranks 5 (missing 0-4,6-{2**62 - 1})"),
    (list(range(0, 40, 2)), 40, "ranks 0,2,4,6,8,10,12,14,... (12 more) (missing 1,3,5,7,9,11,13,15,... (12 more))"),
])
def test_ranks_text(owners, world, text):
    g = listing.Group("job-0", 1, world, owners)
    assert g.ranks_text() == text
