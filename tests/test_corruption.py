"""Silent corruption: non-finite state is saved but marked unhealthy, never auto-resumed; rollbacks by step."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from torch import nn

from ckpt_core import CheckpointManager, TrainState
from ckpt_core.discovery import list_records


def _setup():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.1)
    return model, opt, TrainState(model=model, optimizers=opt)


def _step(model, opt, poison: bool = False):
    model(torch.randn(2, 4)).sum().backward()
    opt.step()
    opt.zero_grad()
    if poison:
        with torch.no_grad():
            model[0].weight[0, 0] = float("nan")


def test_nonfinite_state_is_saved_unhealthy_and_never_auto_resumed(tmp_path, caplog):
    root = str(tmp_path)
    model, opt, state = _setup()
    saved = {}
    with caplog.at_level(logging.WARNING, logger="ckpt_core"):
        with CheckpointManager(root, async_mode="thread", keep_last=2, handle_preemption=False) as m:
            for step in (10, 20, 30, 40):
                _step(model, opt, poison=step == 30)
                m.save(step, state)
                m.wait()
                saved[step] = model[1].weight.detach().clone()
    assert any("step 30 holds non-finite values" in r.getMessage() for r in caplog.records)
    recs = {r.step: (r.committed, r.healthy) for r in list_records(root)}
    # the unhealthy 30 and 40 did not push the healthy 10 and 20 out of keep_last=2
    assert recs == {10: (True, True), 20: (True, True), 30: (True, False), 40: (True, False)}
    manifest = json.loads((tmp_path / "step_000000030" / "manifest.json").read_text())
    assert manifest["healthy"] is False and manifest["fingerprint"]["model.0.weight"][0] != manifest["fingerprint"]["model.0.weight"][0]

    fresh, fresh_opt, fresh_state = _setup()
    with CheckpointManager(root, async_mode="off", handle_preemption=False) as m:
        assert m.restore(fresh_state).step == 20  # newest *healthy*
    assert torch.equal(fresh[1].weight, saved[20])

    # an explicit request loads even an unhealthy checkpoint (inspection, bisecting)
    _, _, inspect_state = _setup()
    with CheckpointManager(root, async_mode="off", handle_preemption=False) as m:
        assert m.restore(inspect_state, step=30).step == 30
    assert torch.isnan(inspect_state.model[0].weight[0, 0])


def test_rollback_moves_the_abandoned_timeline_aside(tmp_path):
    root = str(tmp_path)
    model, opt, state = _setup()
    with CheckpointManager(root, async_mode="off", handle_preemption=False) as m:
        for step in (10, 20, 30, 40):
            _step(model, opt)
            m.save(step, state)
    old_30 = (tmp_path / "step_000000030" / "manifest.json").read_bytes()
    fresh, fresh_opt, fresh_state = _setup()
    with CheckpointManager(root, async_mode="off", resume_step=20, keep_last=1, handle_preemption=False) as m:
        assert m.resume(fresh_state).step == 20
        _step(fresh, fresh_opt)
        m.save(30, fresh_state)  # the new timeline's step 30 cannot collide with the old one
    assert [r.step for r in list_records(root)] == [20, 30]  # 20: resumed from, protected
    aside = list((tmp_path / "rolled_back").iterdir())
    assert len(aside) == 1
    assert sorted(p.name for p in aside[0].iterdir()) == ["step_000000030", "step_000000040"]
    assert (aside[0] / "step_000000030" / "manifest.json").read_bytes() == old_30  # never overwritten
    assert (tmp_path / "step_000000030" / "manifest.json").read_bytes() != old_30


@pytest.mark.parametrize("policy", ["warn", "raise"])
def test_resume_check_compares_first_losses_after_resume(tmp_path, policy):
    from ckpt_core import RestoreError

    root = str(tmp_path)
    model, opt, state = _setup()
    with CheckpointManager(root, async_mode="off", resume_check_steps=3, handle_preemption=False) as m:
        m.save(10, state)
        for step, loss in ((11, 0.5), (12, 0.25), (13, 0.125), (14, 9.0)):
            m.record_loss(step, loss)
    recorded = json.loads((tmp_path / "step_000000010" / "first_losses.json").read_text())
    assert recorded == {"step": 10, "losses": [[11, 0.5], [12, 0.25], [13, 0.125]]}
    _, _, fresh_state = _setup()
    with CheckpointManager(root, async_mode="off", resume_check=policy, handle_preemption=False) as m:
        m.restore(fresh_state)
        m.record_loss(11, 0.5)
        if policy == "raise":
            with pytest.raises(RestoreError, match=r"loss at step 12 is 0.3 after the resume, 0.25 in the original"):
                m.record_loss(12, 0.3)
        else:
            with pytest.warns(UserWarning, match=r"loss at step 12 is 0.3 after the resume, 0.25"):
                m.record_loss(12, 0.3)
            m.record_loss(13, 0.125)
            assert len(m.resume_check_failures) == 1
