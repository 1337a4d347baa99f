from __future__ import annotations

import argparse
import dataclasses
import logging
import re

import pytest

from ckpt_core.config import (
    add_ckpt_arguments,
    flag_name,
    log_effective_settings,
    parse_value,
    pop_ckpt_flags,
    resolve_settings,
    setting_help,
    settings_from_args,
)
from ckpt_core.config import CheckpointSettings

FIELDS = [f.name for f in dataclasses.fields(CheckpointSettings)]


# ---------------------------------------------------------------- precedence
@pytest.mark.parametrize(
    "code, env, argv, expected, source",
    [
        ({}, {}, [], None, "default"),
        ({"every_n_steps": 10}, {}, [], 10, "code"),
        ({}, {"CKPT_EVERY_N_STEPS": "20"}, [], 20, "env CKPT_EVERY_N_STEPS"),
        ({"every_n_steps": 10}, {"CKPT_EVERY_N_STEPS": "20"}, [], 20, "env CKPT_EVERY_N_STEPS"),
        ({}, {}, ["--ckpt.every_n_steps=30"], 30, "flag --ckpt.every_n_steps"),
        ({"every_n_steps": 10}, {"CKPT_EVERY_N_STEPS": "20"}, ["--ckpt.every_n_steps", "30"], 30,
         "flag --ckpt.every_n_steps"),
        ({"every_n_steps": 10}, {}, ["--ckpt.every_n_steps=30"], 30, "flag --ckpt.every_n_steps"),
        # a later flag wins over an earlier one; hyphens are accepted
        ({}, {}, ["--ckpt.every_n_steps=30", "--ckpt.every-n-steps=40"], 40, "flag --ckpt.every_n_steps"),
        # explicitly back to None from the environment
        ({"every_n_steps": 10}, {"CKPT_EVERY_N_STEPS": "none"}, [], None, "env CKPT_EVERY_N_STEPS"),
    ],
)
def test_precedence(code, env, argv, expected, source):
    settings, sources = resolve_settings(code, env=env, argv=argv)
    assert settings.every_n_steps == expected
    assert sources["every_n_steps"] == source
    assert set(sources) == set(FIELDS)
    assert all(sources[n] == "default" for n in FIELDS if n != "every_n_steps")


def test_precedence_across_fields_and_defaults_object():
    base = CheckpointSettings(dirpath="/base", keep_last=7, writer_threads=2)
    settings, sources = resolve_settings(
        {"dirpath": "/code", "async_mode": "thread"},
        env={"CKPT_DIRPATH": "s3://bucket/run", "CKPT_RESUME_STEP": "40", "PATH": "/bin", "XCKPT_FOO": "1"},
        argv=["train.py", "--lr", "0.1", "--ckpt.async_mode=off", "--ckpt.resume", "false"],
        defaults=base,
    )
    assert settings.dirpath == "s3://bucket/run" and sources["dirpath"] == "env CKPT_DIRPATH"
    assert settings.resume_step == 40 and sources["resume_step"] == "env CKPT_RESUME_STEP"
    assert settings.async_mode == "off" and sources["async_mode"] == "flag --ckpt.async_mode"
    assert settings.resume is False and sources["resume"] == "flag --ckpt.resume"
    assert settings.keep_last == 7 and sources["keep_last"] == "default"
    assert settings.writer_threads == 2


def test_env_defaults_to_os_environ(monkeypatch):
    monkeypatch.setenv("CKPT_KEEP_LAST", "4")
    settings, sources = resolve_settings()
    assert settings.keep_last == 4 and sources["keep_last"] == "env CKPT_KEEP_LAST"
    settings, sources = resolve_settings(env={})
    assert settings.keep_last is None


# -------------------------------------------------------------------- parsing
@pytest.mark.parametrize(
    "name, text, expected",
    [
        ("every_n_steps", "100", 100),
        ("every_n_steps", " 1_000 ", 1000),
        ("every_n_steps", "None", None),
        ("every_n_steps", "null", None),
        ("every_seconds", "1.5", 1.5),
        ("every_seconds", "600", 600.0),
        ("min_interval_s", "30", 30.0),
        ("resume", "true", True),
        ("resume", "YES", True),
        ("resume", "1", True),
        ("resume", "off", False),
        ("resume", "0", False),
        ("resume", "no", False),
        ("interval", "auto", "auto"),
        ("interval", "none", None),
        ("async_mode", "thread", "thread"),
        ("verify", "checksum", "checksum"),
        ("keep_best", "val_loss,min,3", ("val_loss", "min", 3)),
        ("keep_best", "acc, max, 2", ("acc", "max", 2)),
        ("keep_best", "val_loss,min", ("val_loss", "min", 1)),
        ("keep_best", '["val_loss", "max", 2]', ("val_loss", "max", 2)),
        ("keep_best", '{"metric": "loss", "mode": "min", "n": 4}', ("loss", "min", 4)),
        ("keep_best", "none", None),
        ("storage_options", '{"endpoint_url": "http://127.0.0.1:5000", "anon": false}',
         {"endpoint_url": "http://127.0.0.1:5000", "anon": False}),
        ("max_host_memory_bytes", "1048576", 1048576),
        ("max_host_memory_bytes", "8GiB", 8 * 2**30),
        ("max_host_memory_bytes", "2 GB", 2 * 10**9),
        ("dirpath", "s3://bucket/run-1", "s3://bucket/run-1"),
    ],
)
def test_parse_value(name, text, expected):
    assert parse_value(name, text) == expected


def test_every_string_setting_roundtrips_through_env():
    env = {
        "CKPT_DIRPATH": "memory://x",
        "CKPT_EVERY_SECONDS": "5",
        "CKPT_INTERVAL": "auto",
        "CKPT_DEVICE_MTBF_HOURS": "1000",
        "CKPT_N_DEVICES": "8",
        "CKPT_MIN_INTERVAL_S": "10",
        "CKPT_MAX_INTERVAL_S": "100",
        "CKPT_KEEP_LAST": "2",
        "CKPT_KEEP_EVERY_N_STEPS": "1000",
        "CKPT_KEEP_EVERY_SECONDS": "3600",
        "CKPT_KEEP_BEST": "loss,min,2",
        "CKPT_ON_IN_FLIGHT": "skip",
        "CKPT_ON_SAVE_ERROR": "warn",
        "CKPT_VERIFY": "none",
        "CKPT_WRITER_THREADS": "4",
        "CKPT_RESUME_CHECK": "raise",
    }
    settings, sources = resolve_settings(env=env)
    assert settings.interval == "auto" and settings.device_mtbf_hours == 1000.0
    assert settings.keep_best == ("loss", "min", 2) and settings.on_in_flight == "skip"
    assert all(sources[k[5:].lower()] == f"env {k}" for k in env)


# ------------------------------------------------------------------ errors
@pytest.mark.parametrize(
    "kwargs, must_contain",
    [
        (dict(env={"CKPT_EVERY_N_STEPS": "abc"}),
         ["every_n_steps", "environment variable CKPT_EVERY_N_STEPS='abc': expected an integer"]),
        (dict(argv=["--ckpt.every_n_steps=abc"]),
         ["every_n_steps", "command-line flag --ckpt.every_n_steps='abc'", "expected an integer"]),
        (dict(env={"CKPT_EVERY_N_STEPS": "-5"}),
         ["every_n_steps", "positive", "environment variable CKPT_EVERY_N_STEPS='-5'"]),
        (dict(argv=["--ckpt.every_seconds", "-1"]),
         ["every_seconds", "command-line flag --ckpt.every_seconds='-1'"]),
        (dict(code={"keep_last": 0}), ["keep_last", "code argument"]),
        (dict(env={"CKPT_RESUME": "maybe"}), ["resume", "CKPT_RESUME='maybe'", "expected a boolean"]),
        (dict(env={"CKPT_ASYNC_MODE": "fork"}), ["async_mode", "CKPT_ASYNC_MODE='fork'", "bytes, process, thread, off"]),
        (dict(env={"CKPT_KEEP_BEST": "loss,median,2"}), ["keep_best", "CKPT_KEEP_BEST", "metric,min|max,n"]),
        (dict(env={"CKPT_STORAGE_OPTIONS": "[1, 2]"}), ["storage_options", "CKPT_STORAGE_OPTIONS", "JSON object"]),
        (dict(env={"CKPT_STORAGE_OPTIONS": "{bad"}), ["storage_options", "JSON object"]),
        (dict(env={"CKPT_MAX_HOST_MEMORY_BYTES": "lots"}), ["max_host_memory_bytes", "number of bytes"]),
        (dict(env={"CKPT_EVRY_N_STEPS": "5"}),
         ["unknown checkpoint setting", "CKPT_EVRY_N_STEPS", "did you mean CKPT_EVERY_N_STEPS?"]),
        (dict(argv=["--ckpt.keep_lst=3"]), ["--ckpt.keep_lst", "did you mean --ckpt.keep_last?"]),
        (dict(code={"keeplast": 3}), ["'keeplast'", "code argument", "did you mean keep_last?"]),
        (dict(env={"CKPT_ZZZZZZZZ": "1"}), ["CKPT_ZZZZZZZZ", "known settings:"]),
        # a cross-field error names the setting changed away from its default
        (dict(env={"CKPT_INTERVAL": "auto"}), ["device_mtbf_hours", "interval from environment variable CKPT_INTERVAL"]),
        (dict(argv=["--ckpt.min_interval_s=500", "--ckpt.max_interval_s=100"]),
         ["min_interval_s", "command-line flag --ckpt.min_interval_s='500'"]),
    ],
)
def test_errors_name_setting_and_source(kwargs, must_contain):
    kwargs.setdefault("env", {})
    code = kwargs.pop("code", {})
    with pytest.raises(ValueError) as info:
        resolve_settings(code, **kwargs)
    msg = str(info.value)
    for part in must_contain:
        assert part in msg, f"{part!r} not in {msg!r}"


def test_flag_without_value_is_an_error():
    with pytest.raises(ValueError, match=r"--ckpt.keep_last needs a value"):
        resolve_settings(env={}, argv=["--ckpt.keep_last"])
    with pytest.raises(ValueError, match=r"--ckpt.keep_last needs a value"):
        resolve_settings(env={}, argv=["--ckpt.keep_last", "--other"])


# ------------------------------------------------------------------ popping
def test_pop_ckpt_flags():
    argv = ["train.py", "--lr", "0.1", "--ckpt.keep_last=3", "--ckpt.dirpath", "/ckpt", "--ckpt.resume",
            "--epochs", "2", "--ckpt.every_n_steps", "-5", "--", "--ckpt.verify=none"]
    flags, rest = pop_ckpt_flags(argv)
    assert flags == {"keep_last": "3", "dirpath": "/ckpt", "resume": "true", "every_n_steps": "-5"}
    assert rest == ["train.py", "--lr", "0.1", "--epochs", "2", "--", "--ckpt.verify=none"]
    # the user's own parser is happy with the rest
    parser = argparse.ArgumentParser()
    parser.add_argument("--lr", type=float)
    parser.add_argument("--epochs", type=int)
    parser.add_argument("extra", nargs="*")
    ns = parser.parse_args(rest[1:])
    assert ns.lr == 0.1 and ns.epochs == 2


def test_pop_bool_flag_takes_a_bool_literal_only():
    flags, rest = pop_ckpt_flags(["--ckpt.resume", "no", "data.txt"])
    assert flags == {"resume": "no"} and rest == ["data.txt"]
    flags, rest = pop_ckpt_flags(["--ckpt.resume", "data.txt"])
    assert flags == {"resume": "true"} and rest == ["data.txt"]


# ----------------------------------------------------------------- argparse
def test_add_ckpt_arguments_and_settings_from_args(capsys):
    parser = argparse.ArgumentParser(prog="train")
    parser.add_argument("--lr", type=float, default=0.1)
    add_ckpt_arguments(parser)
    ns = parser.parse_args(["--lr", "0.5", "--ckpt.every_n_steps", "50", "--ckpt.resume", "--ckpt.keep_best",
                            "loss,min,2"])
    settings, sources = settings_from_args(ns, code={"keep_last": 3, "every_n_steps": 10},
                                           env={"CKPT_KEEP_LAST": "5"})
    assert settings.every_n_steps == 50 and sources["every_n_steps"] == "flag --ckpt.every_n_steps"
    assert settings.keep_last == 5 and sources["keep_last"] == "env CKPT_KEEP_LAST"
    assert settings.resume is True and settings.keep_best == ("loss", "min", 2)
    assert sources["dirpath"] == "default"

    with pytest.raises(SystemExit):
        parser.parse_args(["--help"])
    help_text = capsys.readouterr().out
    for name in FIELDS:
        assert flag_name(name) in help_text
    assert "save when step % every_n_steps == 0" in help_text
    assert "CKPT_EVERY_N_STEPS" in help_text

    ns = parser.parse_args(["--ckpt.every_n_steps", "x"])
    with pytest.raises(ValueError, match=r"command-line flag --ckpt.every_n_steps='x': expected an integer"):
        settings_from_args(ns, env={})


def test_every_setting_has_help():
    for name in FIELDS:
        assert setting_help(name), f"no help text for {name}: document it in CheckpointSettings' docstring"


# ------------------------------------------------------------------ logging
def test_log_effective_settings(caplog):
    settings, sources = resolve_settings(
        {"keep_last": 3},
        env={"CKPT_STORAGE_OPTIONS": '{"key": "AKIA", "secret": "shh", "endpoint_url": "http://s3"}'},
        argv=["--ckpt.every_n_steps=7"],
    )
    logger = logging.getLogger("test.ckpt.settings")
    with caplog.at_level(logging.INFO, logger="test.ckpt.settings"):
        log_effective_settings(settings, sources, logger)
    assert len(caplog.records) == 1
    text = caplog.records[0].getMessage()
    for name in FIELDS:
        assert re.search(rf"^\s+{name}\s+=", text, re.M), name
    assert re.search(r"keep_last\s+= 3\s+\[code\]", text)
    assert re.search(r"every_n_steps\s+= 7\s+\[flag --ckpt.every_n_steps\]", text)
    assert re.search(r"dirpath\s+= 'checkpoints'\s+\[default\]", text)
    assert "env CKPT_STORAGE_OPTIONS" in text and "http://s3" in text
    assert "AKIA" not in text and "shh" not in text
