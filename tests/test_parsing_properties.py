"""Property-based tests: every parser of checkpoint files is total, and the pure decisions keep their promises.

Any input gives a valid value or the parser's own error (a ``ValueError``),
never ``OverflowError``, ``RecursionError``, ``KeyError``, ``TypeError``...
"""

from __future__ import annotations

import json
import os
import pickle
import string

import crc32c
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckpt_core.crc_combine import crc32c_combine
from ckpt_core.manifest import FileEntry, Manifest, ManifestError, build_manifest, parse_manifest
from ckpt_core.records import CheckpointRecord
from ckpt_core.retention import KeepLast, records_to_delete
from ckpt_core.safe_pickle import load_dcp_metadata
from ckpt_core.sidecar import Sidecar, SidecarError, parse_sidecar
from ckpt_core.storage import parse_step_dirname, step_dirname

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=20,
)


def _valid_manifest_body() -> dict:
    m = build_manifest(step=5, world_size=2, files={".metadata": FileEntry(10, 7)},
                       fingerprint={"model.w": (1.0, 2.0, 3)}, epoch=1, metrics={"loss": 0.5}, wall_time=100.0)
    return json.loads(m.to_json())


MANIFEST_KEYS = sorted(_valid_manifest_body())


def _total(parse, text, error):
    try:
        return parse(text)
    except error:
        return None


@FAST
@given(st.binary(max_size=300))
def test_manifest_parser_is_total_on_bytes(data):
    out = _total(parse_manifest, data, ManifestError)
    assert out is None or isinstance(out, Manifest)


@FAST
@given(json_values)
def test_manifest_parser_is_total_on_json(value):
    out = _total(parse_manifest, json.dumps(value, allow_nan=True), ManifestError)
    assert out is None or isinstance(out, Manifest)


@FAST
@given(st.sampled_from(MANIFEST_KEYS), json_values)
def test_any_field_of_a_valid_manifest_replaced_by_anything(key, value):
    body = _valid_manifest_body()
    body[key] = value
    out = _total(parse_manifest, json.dumps(body, allow_nan=True), ManifestError)
    if out is not None:
        assert isinstance(out, Manifest) and out.world_size >= 1 and out.step >= 0
        assert all(f.size >= 0 for f in out.files.values())


@FAST
@given(st.sampled_from(["step", "world_size", "wall_time", "epoch"]),
       st.sampled_from(["1e999", "-1e999", "NaN", "Infinity", "-0", "1" * 5000, "1e308", "-1", "0.5", "true"]))
def test_numbers_out_of_range_are_manifest_errors(key, raw):
    body = _valid_manifest_body()
    body[key] = "@@"
    text = json.dumps(body).replace('"@@"', raw)
    out = _total(parse_manifest, text, ManifestError)
    if out is not None:
        assert out.world_size >= 1 and out.step >= 0 and out.wall_time >= 0


@FAST
@given(st.integers(min_value=0, max_value=2**63 - 1), st.integers(min_value=1, max_value=2**31 - 1),
       st.dictionaries(st.from_regex(r"\A[a-z_]{1,12}\.distcp\Z"), st.tuples(
           st.integers(min_value=0, max_value=2**40), st.integers(min_value=0, max_value=2**32 - 1)), min_size=1),
       st.floats(min_value=0, max_value=4e9, allow_nan=False))
def test_valid_manifests_round_trip(step, world, files, wall):
    m = build_manifest(step=step, world_size=world, files={k: FileEntry(*v) for k, v in files.items()},
                       fingerprint={}, wall_time=wall)
    assert parse_manifest(m.to_json()) == m


def test_deep_nesting_is_a_manifest_error():
    for text in ("[" * 100_000 + "]" * 100_000, '{"a":' * 100_000 + "1" + "}" * 100_000):
        with pytest.raises(ManifestError, match="nested too deeply|not a JSON object"):
            parse_manifest(text)


@FAST
@given(json_values)
def test_sidecar_parser_is_total(value):
    out = _total(parse_sidecar, json.dumps(value, allow_nan=True), SidecarError)
    assert out is None or isinstance(out, Sidecar)


@FAST
@given(st.sampled_from(["prefix", "files", "items", "checkpoint_id", "step", "fingerprint", "format"]), json_values)
def test_any_field_of_a_valid_sidecar_replaced_by_anything(key, value):
    side = Sidecar(prefix="__1_", files={"__1_0.distcp": (30, 5)}, fingerprint={},
                   items={("__1_0.distcp", 0, 10): 1, ("__1_0.distcp", 10, 20): 2},
                   checkpoint_id="0123456789abcdef-4", step=4)
    body = json.loads(side.to_json())
    body[key] = value
    out = _total(parse_sidecar, json.dumps(body, allow_nan=True), SidecarError)
    if out is not None:
        for (name, offset, length) in out.items:
            assert name in out.files and offset + length <= out.files[name][0]


@FAST
@given(st.text(max_size=30))
def test_directory_names(name):
    n = parse_step_dirname(name)
    if n is not None:
        digits = name.split("_", 1)[1]
        assert name.startswith(("step_", "checkpoint_")) and digits.isascii() and digits.isdigit()
        assert n == int(digits)


@FAST
@given(st.integers(min_value=0, max_value=10**18))
def test_step_dirnames_round_trip(step):
    assert parse_step_dirname(step_dirname(step)) == step
    assert parse_step_dirname(f"checkpoint_{step}") == step


@pytest.mark.parametrize("name", ["step_\u0662\u0660", "step_\uff11", "step_1\u200b", "step_", "step_-1", "Step_1",
                                  "step_1.tmp", "checkpoint-1", "step_" + "9" * 20, "step_1\n", "step_ 1",
                                  "checkpoint_7\n"])
def test_names_that_are_not_checkpoint_directories(name):
    assert parse_step_dirname(name) is None


@FAST
@given(st.binary(max_size=200), st.binary(max_size=200))
def test_crc_combine(a, b):
    assert crc32c_combine(crc32c.crc32c(a), crc32c.crc32c(b), len(b)) == crc32c.crc32c(a + b)


@settings(max_examples=300, deadline=None)
@given(st.binary(max_size=400))
def test_metadata_unpickler_is_total(data):
    try:
        load_dcp_metadata(data, "x/.metadata")
    except pickle.UnpicklingError:
        pass


MARKER = "/tmp/ckpt-property-pwned"
_CMD = f"touch {MARKER}".encode()


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from([b"\x80\x04", b"\x95\x08\x00\x00\x00\x00\x00\x00\x00", b"(", b"]", b"}", b"e",
                                 b"u", b"N", b"K\x01", b"\x8c\x05posix\x8c\x06system\x93", b"R", b"b", b"0",
                                 b"\x8c" + bytes([len(_CMD)]) + _CMD + b"\x85", b"cposix\nsystem\n", b"h\x00",
                                 b"\x94", b"\x8c\x08builtins\x8c\x04eval\x93", b"."]), max_size=30))
def test_metadata_unpickler_refuses_opcode_soup(parts):
    """Random sequences of real opcodes (globals, REDUCE, BUILD, memo) never run anything and never crash."""
    marker = MARKER
    try:
        load_dcp_metadata(b"".join(parts), "x/.metadata")
    except pickle.UnpicklingError:
        pass
    assert not os.path.exists(marker)


@FAST
@given(st.lists(st.tuples(st.integers(min_value=0, max_value=50), st.booleans(), st.booleans(),
                          st.sampled_from(["step_", "checkpoint_", "x/step_"])), max_size=12),
       st.integers(min_value=1, max_value=3))
def test_retention_never_deletes_the_newest_committed(recs, k):
    records = [CheckpointRecord(step=s, path=f"r/{p}{s}-{i}", committed=c, healthy=h)
               for i, (s, c, h, p) in enumerate(recs)]
    doomed = records_to_delete(records, KeepLast(k))
    committed = [r for r in records if r.committed]
    if committed:
        newest = max(r.step for r in committed)
        assert not any(r.step == newest for r in doomed)
    else:
        assert doomed == []
    assert all(r in records for r in doomed)
    assert len({id(r) for r in doomed}) == len(doomed)


def test_printable_names_only_in_manifests():
    body = _valid_manifest_body()
    for bad in ["a/b", "..", ".", "", "x\x00", "é.distcp", "a" * 300] + list(string.whitespace):
        body["files"] = {bad: {"size": 1}}
        with pytest.raises(ManifestError):
            parse_manifest(json.dumps(body))
