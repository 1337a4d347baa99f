from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import fsspec
import pytest

from ckpt_core.cli import main
from ckpt_core.config import settings_table_markdown
from helpers_ckpt import flip_byte, garbage_manifest, make_checkpoints, step_path, tear

STEPS = (10, 20, 30)


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("pristine") / "run"
    make_checkpoints(str(root), steps=STEPS, metrics={30: {"loss": 0.5}})
    return root


@pytest.fixture(params=["local", "memory"])
def root(request, pristine, tmp_path) -> str:
    """A fresh copy of three committed checkpoints (steps 10, 20, 30), on local disk or in memory://."""
    if request.param == "local":
        dst = tmp_path / "run"
        shutil.copytree(pristine, dst)
        yield str(dst)
        return
    url = f"memory://cli-{uuid.uuid4().hex[:8]}/run"
    fs = fsspec.filesystem("memory")
    for f in pristine.rglob("*"):
        if f.is_file():
            fs.pipe_file(f"{url[len('memory://'):]}/{f.relative_to(pristine).as_posix()}", f.read_bytes())
    yield url
    fs.rm(url[len("memory://"):].split("/")[0], recursive=True)


def run(capsys, *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def exists(path: str) -> bool:
    fs, p = fsspec.core.url_to_fs(path)
    return fs.exists(p)


# ---------------------------------------------------------------------- ls
def test_ls(capsys, root):
    code, out, err = run(capsys, "ls", root)
    assert code == 0, err
    lines = out.splitlines()
    assert lines[0].split()[:4] == ["STEP", "STATE", "PERMANENT", "HEALTHY"]
    rows = {int(line.split()[1] if line.startswith("*") else line.split()[0]): line for line in lines[1:4]}
    assert set(rows) == set(STEPS)
    assert rows[30].startswith("*") and not rows[20].startswith("*")
    assert "committed" in rows[10] and "KB" in rows[10]
    assert "newest valid checkpoint (what a run resumes from): step 30" in out
    assert err == ""


def test_ls_torn_and_garbage(capsys, root):
    tear(step_path(root, 30))
    garbage_manifest(step_path(root, 10))
    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    row = {line.lstrip("* ").split()[0]: line for line in out.splitlines()[1:4]}
    assert "torn" in row["30"] and "no manifest.json" in row["30"]
    assert "bad-manifest" in row["10"] and "unusable manifest.json" in row["10"]
    assert row["20"].startswith("*")

    code, out, _ = run(capsys, "ls", root, "--json")
    body = json.loads(out)
    assert body["newest_valid"] == 20
    by_step = {c["step"]: c for c in body["checkpoints"]}
    assert by_step[30]["committed"] is False and "no manifest.json" in by_step[30]["problem"]
    assert by_step[20]["newest_valid"] is True and by_step[20]["world_size"] == 1
    assert by_step[20]["bytes"] > 0 and by_step[20]["files"] >= 3 and by_step[20]["age_s"] >= 0


def test_ls_size_mismatch_is_not_newest_valid(capsys, root):
    fs, p = fsspec.core.url_to_fs(step_path(root, 30))
    shard = sorted(f for f in fs.ls(p, detail=False) if f.endswith(".distcp"))[0]
    fs.pipe_file(shard, fs.cat_file(shard)[:-10])
    code, out, _ = run(capsys, "ls", root)
    assert code == 0
    assert "step 20" in out.splitlines()[-1]
    assert "invalid" in out and "bytes, the manifest says" in out


def test_ls_empty_and_missing(capsys, tmp_path):
    code, out, _ = run(capsys, "ls", str(tmp_path))
    assert code == 0 and "no checkpoints under" in out
    missing = str(tmp_path / "nope")
    code, _, err = run(capsys, "ls", missing)
    assert code == 2 and missing in err and "does not exist" in err


# ----------------------------------------------------------------- inspect
def test_inspect(capsys, root):
    path = step_path(root, 30)
    code, out, err = run(capsys, "inspect", path)
    assert code == 0, err
    assert "committed:   yes" in out
    assert "step:        30" in out and "world size: 1" in out
    assert "metrics:     loss=0.5" in out
    assert "schedulers:     StepLR" in out and "RNG states:     yes" in out and "optimizers:     1" in out
    model_rows = [line.split() for line in out.splitlines() if line.strip().startswith("model.")]
    shapes = {r[0]: (r[1], r[2]) for r in model_rows}
    assert shapes["model.0.weight"] == ("5x7", "float32")
    assert shapes["model.1.num_batches_tracked"] == ("scalar", "int64")
    assert "optim.state.0.weight.exp_avg" in out
    assert "ranks.0" not in out and "per-rank state blob" in out

    code, out, _ = run(capsys, "inspect", path, "--json")
    body = json.loads(out)
    assert body["step"] == 30 and body["committed"] is True
    assert body["manifest"]["world_size"] == 1 and "torch" in body["manifest"]["versions"]
    assert body["contents"]["schedulers"] == ["StepLR"] and body["contents"]["rng"] is True
    t = {x["name"]: x for x in body["tensors"]}
    assert t["model.3.weight"]["shape"] == [3, 5] and t["model.3.weight"]["chunks"] == 1
    assert t["model.3.weight"]["ranks"] == [0] and t["model.3.weight"]["dtype"] == "float32"
    assert any(n.startswith("optim.param_groups") for n in body["non_tensor_entries"])


def test_inspect_torn_still_shows_tensors(capsys, root):
    tear(step_path(root, 20))
    code, out, _ = run(capsys, "inspect", step_path(root, 20))
    assert code == 0
    assert "committed:   NO: no manifest.json" in out and "model.0.weight" in out


def test_inspect_not_a_checkpoint(capsys, root, tmp_path):
    code, _, err = run(capsys, "inspect", root)
    assert code == 2 and "checkpoint root, not a checkpoint" in err
    (tmp_path / "empty").mkdir()
    code, _, err = run(capsys, "inspect", str(tmp_path / "empty"))
    assert code == 2 and str(tmp_path / "empty") in err and "no manifest.json" in err
    code, _, err = run(capsys, "inspect", str(tmp_path / "step_000000099"))
    assert code == 2 and "step_000000099 does not exist" in err
    # a step directory that lost both its manifest and its DCP metadata
    path = step_path(root, 10)
    tear(path)
    fs, p = fsspec.core.url_to_fs(path)
    fs.rm_file(p + "/.metadata")
    code, _, err = run(capsys, "inspect", path)
    assert code == 2 and "no manifest.json" in err and "no .metadata" in err


# ------------------------------------------------------------------ verify
def test_verify_root_ok(capsys, root):
    code, out, err = run(capsys, "verify", root)
    assert code == 0, out + err
    assert out.count("OK ") == 3 and "3 of 3 checkpoint(s) valid (size check)" in out
    code, out, _ = run(capsys, "verify", root, "--checksum")
    assert code == 0 and "(checksum check)" in out
    assert capsys.readouterr().err == ""  # no progress bar when stderr is not a terminal


def test_verify_torn_and_garbage(capsys, root):
    tear(step_path(root, 30))
    garbage_manifest(step_path(root, 10))
    code, out, _ = run(capsys, "verify", root)
    assert code == 1
    lines = {line.split()[2]: line for line in out.splitlines() if line.startswith(("OK", "FAIL"))}
    assert lines["30"].startswith("FAIL") and "no manifest.json" in lines["30"]
    assert lines["10"].startswith("FAIL") and "unusable manifest.json" in lines["10"]
    assert lines["20"].startswith("OK")
    assert "1 of 3 checkpoint(s) valid" in out
    # one checkpoint at a time
    assert run(capsys, "verify", step_path(root, 20))[0] == 0
    code, out, _ = run(capsys, "verify", step_path(root, 30))
    assert code == 1 and "no manifest.json" in out
    code, out, _ = run(capsys, "verify", root, "--json")
    body = json.loads(out)
    assert body["valid"] is False and [c["valid"] for c in body["checkpoints"]] == [False, True, False]


def test_verify_flipped_byte_needs_checksum(capsys, root):
    path = step_path(root, 20)
    name = flip_byte(path)
    code, out, _ = run(capsys, "verify", path)
    assert code == 0, out  # same size: the size check cannot see it
    code, out, _ = run(capsys, "verify", path, "--checksum")
    assert code == 1 and name in out and "fail" in out and "checksum" in out
    code, out, _ = run(capsys, "verify", root, "--checksum")
    assert code == 1 and "2 of 3" in out


def test_verify_not_a_checkpoint(capsys, tmp_path):
    (tmp_path / "junk").mkdir()
    (tmp_path / "junk" / "a.txt").write_text("x")
    code, out, err = run(capsys, "verify", str(tmp_path / "junk"))
    assert code == 2 and out == ""
    assert str(tmp_path / "junk") in err and "no manifest.json" in err and "no step_<N> directories" in err


def test_progress_bar_on_a_terminal(capsys, root, monkeypatch):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True, raising=False)
    code, _, err = run(capsys, "verify", root, "--checksum")
    assert code == 0 and "verify (checksum)" in err


# ------------------------------------------------------------------- prune
def test_prune(capsys, root):
    code, out, _ = run(capsys, "prune", root, "--keep-last", "1", "--dry-run")
    assert code == 0
    assert "would delete step 10" in out and "would delete step 20" in out and "step 30" not in out.split("\n")[0]
    assert all(exists(step_path(root, s)) for s in STEPS)

    code, out, _ = run(capsys, "prune", root, "--keep-last", "1")
    assert code == 0 and "deleting step 10" in out and "deleting step 20" in out and "kept (steps 30)" in out
    assert not exists(step_path(root, 10)) and not exists(step_path(root, 20)) and exists(step_path(root, 30))
    code, out, _ = run(capsys, "verify", root)
    assert code == 0 and "1 of 1" in out


def test_prune_keeps_permanent_tier_and_removes_old_torn(capsys, root):
    tear(step_path(root, 10))
    code, out, _ = run(capsys, "prune", root, "--keep-last", "1", "--keep-every-n-steps", "20")
    assert code == 0
    assert "deleting step 10 (uncommitted" in out
    assert exists(step_path(root, 20)) and exists(step_path(root, 30)) and not exists(step_path(root, 10))


def test_prune_never_deletes_newest_valid_or_newer_torn(capsys, root):
    tear(step_path(root, 30))  # newest directory torn: maybe a save in progress, left alone
    code, out, _ = run(capsys, "prune", root, "--keep-last", "1")
    assert code == 0 and "deleting step 10" in out
    assert exists(step_path(root, 20)) and exists(step_path(root, 30))


def test_prune_bad_args(capsys, root):
    code, _, err = run(capsys, "prune", root, "--keep-last", "0")
    assert code == 2 and "keep_last=0 is invalid: expected a positive integer" in err
    code, _, err = run(capsys, "prune", root)
    assert code == 2 and "--keep-last" in err
    code, _, err = run(capsys, "prune", step_path(root, 10), "--keep-last", "1")
    assert code == 2 and "is a checkpoint, not a checkpoint root" in err
    code, _, err = run(capsys, "prune", root, "--keep-last", "1", "--keep-best", "loss,median")
    assert code == 2 and "--keep-best" in err


# ------------------------------------------------------------------ export
def test_export_cli(capsys, root, tmp_path):
    from safetensors.torch import load_file

    out_file = str(tmp_path / "model.safetensors")
    code, out, err = run(capsys, "export", step_path(root, 30), out_file, "--dtype", "bf16")
    assert code == 0, err
    assert "wrote" in out and "9 tensors" in out and "bfloat16" in out and "step 30" in out
    weights = load_file(out_file)
    assert str(weights["0.weight"].dtype) == "torch.bfloat16"
    code, _, err = run(capsys, "export", root, out_file)
    assert code == 2 and "checkpoint root, not a checkpoint" in err
    tear(step_path(root, 20))
    code, _, err = run(capsys, "export", step_path(root, 20), out_file)
    assert code == 2 and "no manifest.json" in err
    code, _, err = run(capsys, "export", step_path(root, 20), str(tmp_path / "m.pt"), "--force")
    assert code == 0, err


# ---------------------------------------------------------------- settings
def test_settings_command(capsys, monkeypatch):
    for k in [k for k in os.environ if k.startswith("CKPT_")]:
        monkeypatch.delenv(k)
    monkeypatch.setenv("CKPT_KEEP_LAST", "3")
    code, out, err = run(capsys, "settings", "--ckpt.every_n_steps=9")
    assert code == 0, err
    rows = {line.split()[0]: line for line in out.splitlines()}
    assert rows["keep_last"].split()[1:] == ["3", "env", "CKPT_KEEP_LAST"]
    assert rows["every_n_steps"].split()[1:] == ["9", "flag", "--ckpt.every_n_steps"]
    assert rows["dirpath"].split()[1:] == ['"checkpoints"', "default"]
    code, out, _ = run(capsys, "settings", "--json")
    assert json.loads(out)["keep_last"] == {"value": 3, "source": "env CKPT_KEEP_LAST"}
    code, out, _ = run(capsys, "settings", "--markdown")
    assert out == settings_table_markdown()
    monkeypatch.setenv("CKPT_KEEP_LAST", "x")
    code, _, err = run(capsys, "settings")
    assert code == 2 and "CKPT_KEEP_LAST='x'" in err
    code, _, err = run(capsys, "ls", ".", "--ckpt.keep_last=3")
    assert code == 2 and "only apply to `ckpt settings`" in err


def test_usage_errors(capsys):
    code, _, err = run(capsys)
    assert code == 2 and "usage: ckpt" in err
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "inspect" in out and "export" in out
    code, _, err = run(capsys, "frobnicate")
    assert code == 2


# -------------------------------------------------------------- subprocess
def test_console_script(pristine, tmp_path):
    exe = Path(sys.executable).with_name("ckpt")
    cmd = [str(exe)] if exe.exists() else [sys.executable, "-m", "ckpt_core.cli"]
    root = tmp_path / "run"
    shutil.copytree(pristine, root)
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    res = subprocess.run(cmd + ["ls", str(root)], capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert "* newest valid checkpoint (what a run resumes from): step 30" in res.stdout
    tear(step_path(str(root), 30))
    res = subprocess.run([sys.executable, "-m", "ckpt_core.cli", "verify", str(root)],
                         capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 1 and "FAIL  step        30" in res.stdout and "no manifest.json" in res.stdout
    assert res.stderr == ""  # quiet: no progress bar, no warnings


# ------------------------------------------------------------ misc options
def test_inspect_refuses_malicious_metadata(capsys, tmp_path):
    import pickle

    root = tmp_path / "run"
    make_checkpoints(str(root), steps=(1,))
    path = step_path(str(root), 1)
    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    (Path(path) / ".metadata").write_bytes(pickle.dumps(Evil()))
    code, out, _ = run(capsys, "inspect", path)
    assert code == 1 and ".metadata has" in out and "the manifest says" in out
    assert not marker.exists()


def test_storage_options(capsys, root):
    from fsspec.config import conf

    before = dict(conf)
    code, out, err = run(capsys, "--storage-options", '{"skip_instance_cache": false}', "ls", root)
    assert code == 0, err
    assert dict(conf) == before
    code, _, err = run(capsys, "--storage-options", "{nope", "ls", root)
    assert code == 2 and "--storage-options is not valid JSON" in err
