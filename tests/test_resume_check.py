"""The resume check on plain data: what is recorded after a save, what a resumed run is compared with."""

from __future__ import annotations

import json

import pytest

from ckpt_core.errors import RestoreError
from ckpt_core.resume_check import ResumeCheck, parse_losses


def test_records_the_losses_after_a_save_then_writes_them_once():
    written = []
    check = ResumeCheck("warn", 3, lambda step, body: written.append((step, json.loads(body))))
    assert not check.wants(5)
    check.saved(4)
    for step, loss in [(5, 0.5), (6, 0.25), (7, 0.125), (8, 1.0)]:
        assert check.wants(step) == (step <= 7)
        check.record(step, loss)
    assert written == [(4, {"step": 4, "losses": [[5, 0.5], [6, 0.25], [7, 0.125]]})]
    assert parse_losses(json.dumps(written[0][1]).encode()) == {5: 0.5, 6: 0.25, 7: 0.125}


def test_a_resumed_run_with_other_losses_warns_or_raises():
    check = ResumeCheck("warn", 3, lambda *_: None)
    check.resumed({5: 0.5, 6: 0.25})
    assert check.wants(5) and check.wants(6) and not check.wants(7)
    check.record(5, 0.5)
    with pytest.warns(UserWarning, match="loss at step 6 is 0.3 after the resume, 0.25 in the original run"):
        check.record(6, 0.3)
    assert len(check.failures) == 1 and not check.wants(6)

    strict = ResumeCheck("raise", 3, lambda *_: None)
    strict.resumed({5: 0.5})
    with pytest.raises(RestoreError, match="diverged"):
        strict.record(5, 0.5000001 * 1.01)

    off = ResumeCheck("off", 3, lambda *_: None)
    off.resumed({5: 0.5})
    assert not off.wants(5)


def test_zero_steps_records_nothing():
    written = []
    check = ResumeCheck("warn", 0, lambda *a: written.append(a))
    check.saved(4)
    assert not check.wants(5)
    check.record(5, 1.0)
    assert written == []
