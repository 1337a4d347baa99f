"""The GPU save benchmark runs end to end (here on the CPU, at a size where the figures mean nothing), so it
is ready when a GPU is lent: every round has its four timings, the JSON holds them, and the RNG check holds."""

from __future__ import annotations

import json

from benchmarks import gpu


def test_the_gpu_benchmark_runs_on_the_cpu_and_its_rng_check_holds(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    gpu.main(["--device", "cpu", "--sizes-gib", "0.03125", "--tensor-mib", "8", "--repeats", "2",
              "--dir", str(tmp_path / "ck"), "--out", str(out)])
    result = json.loads(out.read_text())
    assert result["rng_resume_exact"] is True
    (size,) = result["sizes"]
    assert size["bytes"] == 32 << 20 and len(size["rounds"]) == 2
    for r in size["rounds"]:
        assert all(r[k] > 0 for k in ("copy_s", "stall_s", "persist_s", "write_s"))
        assert r["persist_s"] >= r["stall_s"]
    assert "stall/copy" in capsys.readouterr().out


def test_the_rng_check_fails_when_a_restore_does_not_bring_the_generators_back(tmp_path, monkeypatch):
    from ckpt_core import rng

    monkeypatch.setattr(rng, "apply", lambda state: None)
    assert gpu.rng_resume_exact("cpu", str(tmp_path)) is False
