"""Signed checkpoints: with a signing key, only checkpoints signed with it are restored, verified or exported.

A forger with write access to the bucket rewrites a shard and recomputes every
CRC32C the sidecar and the manifest hold (``hostile.forge_item``): without a
key that checkpoint is accepted (``ckpt inspect`` says it is not checked);
with the key the manifest's signature or its SHA-256 of the sidecar no longer
matches, and restore falls back to the older signed checkpoint.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import crc32c
import pytest
import torch

import hostile
from ckpt_core import TrainState
from ckpt_core import fingerprint as fp
from ckpt_core.config import SettingError, log_effective_settings, resolve_settings
from ckpt_core.signing import sign
from helpers_ckpt import restore_warned, run_cli as _cli, save_distinct, tiny_model

KEY = "correct horse battery staple"
OTHER = "another key entirely"
STEPS = (10, 20)


def _state(seed: int = 0):
    model = tiny_model(seed)
    return TrainState(model=model, optimizers=torch.optim.Adam(model.parameters(), lr=1e-2)), model


def _save(root: Path, steps=STEPS, **kwargs) -> dict[int, dict[str, torch.Tensor]]:
    return save_distinct(root, *_state(), steps, **kwargs)


def _restore(root: Path, **kwargs):
    state, model = _state(seed=99)
    info, said = restore_warned(root, state, **kwargs)
    return info, model, said


def _same(model, weights) -> bool:
    return all(torch.equal(v, weights[k]) for k, v in model.state_dict().items())


def _ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:09d}"


@pytest.fixture(scope="module")
def pristine(tmp_path_factory):
    base = tmp_path_factory.mktemp("signing")
    return base / "signed", _save(base / "signed", signing_key=KEY), base / "unsigned", _save(base / "unsigned")


@pytest.fixture
def signed(pristine, tmp_path):
    """A fresh copy of signed checkpoints 10 and 20."""
    shutil.copytree(pristine[0], tmp_path / "run")
    return tmp_path / "run", pristine[1]


def _forge_shard(ckpt: Path, weights_20: dict) -> torch.Tensor:
    """Rewrite model.0.weight in the shard as a forger would (every checksum recomputed); the forged tensor."""
    name, offset, length = hostile.item_of(ckpt, "model.0.weight")
    data = bytearray((ckpt / name).read_bytes()[offset:offset + length])
    target = weights_20["0.weight"].contiguous().view(torch.uint8).numpy().tobytes()
    at = bytes(data).find(target)
    assert at >= 0
    forged = torch.full_like(weights_20["0.weight"], 42.0)
    data[at:at + len(target)] = forged.contiguous().view(torch.uint8).numpy().tobytes()
    hostile.forge_item(ckpt, name, offset, length, bytes(data))
    body = json.loads((ckpt / "manifest.json").read_text())  # and the fingerprint, as the forger does
    body["fingerprint"]["model.0.weight"] = list(fp.tensor_entry(forged))
    (ckpt / "manifest.json").write_text(json.dumps(body))
    return forged


def test_forged_shard_is_refused_with_the_key_and_accepted_without(signed, capsys, monkeypatch):
    root, weights = signed
    ckpt = _ckpt(root, 20)
    forged = _forge_shard(ckpt, weights[20])

    monkeypatch.delenv("CKPT_SIGNING_KEY", raising=False)
    info, model, said = _restore(root)  # no key: as before, the forgery is loaded
    assert info.step == 20 and torch.equal(model.state_dict()["0.weight"], forged)
    code, out, _ = _cli(capsys, "inspect", str(ckpt))
    assert code == 0 and "signed:      yes (not checked: no key)" in out
    assert _cli(capsys, "verify", str(ckpt), "--checksum")[0] == 0

    info, model, said = _restore(root, signing_key=KEY)
    assert info.step == 10 and _same(model, weights[10])
    assert "step 20" in said and "not usable" in said and "does not match the signing key" in said, said

    monkeypatch.setenv("CKPT_SIGNING_KEY", KEY)
    code, out, err = _cli(capsys, "verify", str(ckpt))
    assert code == 1 and "FAIL" in out and "does not match the signing key" in out
    code, out, err = _cli(capsys, "verify", str(root))
    assert code == 1 and "1 of 2 checkpoint(s) valid" in out
    code, out, err = _cli(capsys, "export", str(ckpt), str(root.parent / "w.safetensors"))
    assert code == 1 and err.count("\n") == 1 and "does not match the signing key" in err
    code, out, err = _cli(capsys, "inspect", str(ckpt))
    assert code == 1 and "DOES NOT MATCH" in out


def _force_crc(data: bytearray, positions: list[tuple[int, int]], target: int) -> None:
    """Flip some of the bits at ``positions`` (byte, bit) so that CRC32C(data) == ``target``: a CRC is linear."""
    n = len(data)
    zero = crc32c.crc32c(bytes(n))
    basis: dict[int, tuple[int, int]] = {}
    for i, (b, bit) in enumerate(positions):
        e = bytearray(n)
        e[b] = 1 << bit
        v, combo = crc32c.crc32c(bytes(e)) ^ zero, 1 << i
        while v:
            top = v.bit_length() - 1
            if top not in basis:
                basis[top] = (v, combo)
                break
            v, combo = v ^ basis[top][0], combo ^ basis[top][1]
    need, combo = crc32c.crc32c(bytes(data)) ^ target, 0
    while need:
        top = need.bit_length() - 1
        need, combo = need ^ basis[top][0], combo ^ basis[top][1]
    for i, (b, bit) in enumerate(positions):
        if combo >> i & 1:
            data[b] ^= 1 << bit
    assert crc32c.crc32c(bytes(data)) == target


def test_shard_forged_with_the_same_crc32c_is_refused_by_its_sha256(signed, capsys, monkeypatch):
    """Reverse a weight matrix in place (sums unchanged) and keep the item's CRC32C: manifest and sidecar untouched."""
    root, weights = signed
    ckpt = _ckpt(root, 20)
    name, offset, length = hostile.item_of(ckpt, "model.0.weight")
    shard = bytearray((ckpt / name).read_bytes())
    item = bytearray(shard[offset:offset + length])
    original = weights[20]["0.weight"]
    raw = original.contiguous().view(torch.uint8).numpy().tobytes()
    at = bytes(item).find(raw)
    assert at >= 0
    item[at:at + len(raw)] = original.flatten().flip(0).reshape(original.shape).contiguous().view(
        torch.uint8).numpy().tobytes()
    _force_crc(item, [(at + 4 * i, bit) for i in range(original.numel()) for bit in (0, 1)],
               crc32c.crc32c(bytes(shard[offset:offset + length])))
    shard[offset:offset + length] = item
    (ckpt / name).write_bytes(bytes(shard))

    monkeypatch.delenv("CKPT_SIGNING_KEY", raising=False)
    info, model, said = _restore(root)  # without a key the CRC32Cs and the fingerprint all pass
    assert info.step == 20 and not torch.equal(model.state_dict()["0.weight"], original), said
    assert _cli(capsys, "verify", str(ckpt), "--checksum")[0] == 0
    info, model, said = _restore(root, signing_key=KEY)
    assert info.step == 10 and _same(model, weights[10])
    assert "do not match their SHA-256 in the signed checkpoint" in said, said
    monkeypatch.setenv("CKPT_SIGNING_KEY", KEY)
    code, out, _ = _cli(capsys, "verify", str(ckpt), "--checksum")
    assert code == 1 and "SHA-256" in out


def test_sidecar_forged_with_the_same_crc32c_is_refused_by_its_sha256(signed, capsys, monkeypatch):
    root, weights = signed
    ckpt = _ckpt(root, 20)
    side = ckpt / "__0_.ckptpart.json"
    raw = bytearray(side.read_bytes())
    target = crc32c.crc32c(bytes(raw))
    digits = [m.start(1) + k for m in re.finditer(rb"\.([0-9]+)", bytes(raw)) for k in range(len(m.group(1)))]
    raw[digits[0]] ^= 1  # a fingerprint digit of the sidecar changed ...
    _force_crc(raw, [(i, 0) for i in digits[1:]], target)  # ... and its CRC32C kept, the manifest untouched
    side.write_bytes(bytes(raw))
    info, _, said = _restore(root)
    assert info.step == 20
    info, model, said = _restore(root, signing_key=KEY)
    assert info.step == 10 and "does not match its SHA-256 in the signed manifest" in said, said


def test_manifest_resigned_with_another_key_is_refused(signed, capsys, monkeypatch, tmp_path):
    root, weights = signed
    ckpt = _ckpt(root, 20)
    _forge_shard(ckpt, weights[20])
    body = json.loads((ckpt / "manifest.json").read_text())
    import hashlib

    for name in body["digests"]:
        body["digests"][name] = hashlib.sha256((ckpt / name).read_bytes()).hexdigest()
    from ckpt_core.signing import canonical

    body["signature"] = sign(canonical(body), OTHER.encode())
    (ckpt / "manifest.json").write_text(json.dumps(body))
    info, model, said = _restore(root, signing_key=KEY)
    assert info.step == 10 and _same(model, weights[10]) and "does not match the signing key" in said, said
    key_file = tmp_path / "key"
    key_file.write_text(KEY + "\n")
    monkeypatch.delenv("CKPT_SIGNING_KEY", raising=False)
    code, out, _ = _cli(capsys, "verify", str(ckpt), "--signing-key-file", str(key_file))
    assert code == 1 and "does not match the signing key" in out


def test_unsigned_checkpoint_is_refused_when_a_key_is_set(pristine, tmp_path, capsys, monkeypatch):
    root = tmp_path / "mixed"
    shutil.copytree(pristine[0], root)  # signed 10 and 20
    weights_unsigned = pristine[3]
    shutil.rmtree(_ckpt(root, 20))
    shutil.copytree(_ckpt(pristine[2], 20), _ckpt(root, 20))  # an unsigned (but intact) step 20
    info, model, said = _restore(root, signing_key=KEY)
    assert info.step == 10 and _same(model, pristine[1][10])
    assert "step 20" in said and "unsigned" in said, said
    info, model, said = _restore(root)  # without a key: as today
    assert info.step == 20 and _same(model, weights_unsigned[20]) and "not usable" not in said

    monkeypatch.delenv("CKPT_SIGNING_KEY", raising=False)
    code, out, _ = _cli(capsys, "inspect", str(_ckpt(root, 20)))
    assert code == 0 and "signed:      no" in out
    monkeypatch.setenv("CKPT_SIGNING_KEY", KEY)
    code, out, _ = _cli(capsys, "verify", str(_ckpt(root, 20)))
    assert code == 1 and "unsigned" in out
    code, _, err = _cli(capsys, "export", str(_ckpt(root, 20)), str(tmp_path / "w.pt"))
    assert code == 1 and "unsigned" in err and err.count("\n") == 1
    code, out, err = _cli(capsys, "export", str(_ckpt(root, 10)), str(tmp_path / "w.pt"))
    assert code == 0 and "from step 10" in out, err
    code, out, _ = _cli(capsys, "inspect", str(_ckpt(root, 10)))
    assert code == 0 and "signed:      yes (signature valid)" in out


def test_the_key_is_stored_nowhere_and_never_logged(pristine, caplog, tmp_path):
    for path in pristine[0].rglob("*"):
        if path.is_file():
            data = path.read_bytes()
            assert KEY.encode() not in data, path
    manifest = json.loads((_ckpt(pristine[0], 20) / "manifest.json").read_text())
    assert len(manifest["signature"]) == 64 and "__0_.ckptpart.json" in manifest["digests"]
    assert ".metadata" in manifest["digests"]
    unsigned = json.loads((_ckpt(pristine[2], 20) / "manifest.json").read_text())
    assert "signature" not in unsigned and "digests" not in unsigned  # unsigned manifests are as before

    settings, sources = resolve_settings(env={"CKPT_SIGNING_KEY": KEY}, argv=[])
    assert settings.signing_key == KEY and KEY not in repr(settings)
    with caplog.at_level(logging.INFO, logger="ckpt_core"):
        log_effective_settings(settings, sources)
    assert KEY not in caplog.text and "signing_key" in caplog.text and "***" in caplog.text


def test_key_file_and_both_sources(pristine, tmp_path, capsys, monkeypatch):
    key_file = tmp_path / "signing.key"
    key_file.write_text(KEY + "\n")
    info, model, said = _restore(pristine[0], signing_key_file=str(key_file))
    assert info.step == 20 and "not usable" not in said
    settings, _ = resolve_settings(env={"CKPT_SIGNING_KEY_FILE": str(key_file)}, argv=[])
    assert settings.signing_key_file == str(key_file)
    with pytest.raises(SettingError, match="give the key one way") as e:
        _restore(pristine[0], signing_key=KEY, signing_key_file=str(key_file))
    assert KEY not in str(e.value)
    with pytest.raises(SettingError, match="readable file"):
        _restore(pristine[0], signing_key_file=str(tmp_path / "missing"))

    monkeypatch.delenv("CKPT_SIGNING_KEY", raising=False)
    code, out, _ = _cli(capsys, "verify", str(pristine[0]), "--signing-key-file", str(key_file))
    assert code == 0 and "2 of 2" in out
    monkeypatch.setenv("CKPT_SIGNING_KEY_FILE", str(key_file))
    assert _cli(capsys, "verify", str(pristine[2]))[0] == 1  # unsigned checkpoints, key from the file
    monkeypatch.setenv("CKPT_SIGNING_KEY", KEY)
    code, _, err = _cli(capsys, "verify", str(pristine[0]))
    assert code == 2 and "one way" in err and KEY not in err
