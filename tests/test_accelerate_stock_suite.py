"""Accelerate's own checkpointing tests, run with a ``CheckpointPlugin`` attached to every ``Accelerator``.

``tests/test_state_checkpointing.py`` of the installed accelerate release is
taken from its source distribution (downloaded once from the package index
into a cache, never copied into this repository), imported, and its
``Accelerator`` replaced by one that attaches a plugin. Its test classes are
collected here as they are, each test under a timeout. Tests that need a GPU
skip themselves as they do with stock Accelerate.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
import tarfile
import tempfile
import unittest
from pathlib import Path
from types import ModuleType

import pytest

accelerate = pytest.importorskip("accelerate")
pytest.importorskip("parameterized")

from accelerate_ckpt import CheckpointPlugin  # noqa: E402

CACHE = Path(os.environ.get("CKPT_TEST_CACHE", Path.home() / ".cache" / "ckpt-tests"))
MEMBER = "tests/test_state_checkpointing.py"


def stock_test_file(version: str = accelerate.__version__) -> Path:
    """The release's ``tests/test_state_checkpointing.py``, from its sdist (downloaded on first use)."""
    target = CACHE / f"accelerate-{version}" / Path(MEMBER).name
    if target.exists():
        return target
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "pip", "download", f"accelerate=={version}", "--no-binary",
                               ":all:", "--no-deps", "-q", "-d", tmp],
                              capture_output=True, text=True, timeout=300)
        sdists = list(Path(tmp).glob("accelerate-*.tar.gz"))
        if proc.returncode != 0 or not sdists:
            pytest.skip(f"could not download the accelerate {version} sdist: {proc.stderr.strip()[-300:]}")
        with tarfile.open(sdists[0]) as tar:
            member = tar.getmember(f"accelerate-{version}/{MEMBER}")
            data = tar.extractfile(member).read()
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".part")
    partial.write_bytes(data)
    partial.replace(target)
    return target


class PluginAccelerator(accelerate.Accelerator):
    """What a user gets by adding one line to code that builds an ``Accelerator``: a plugin attached."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        CheckpointPlugin(env={}, argv=[]).attach(self)


def load_stock_module() -> ModuleType:
    spec = importlib.util.spec_from_file_location("accelerate_stock_state_checkpointing", stock_test_file())
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # parameterized_class registers its classes in the module's namespace
    spec.loader.exec_module(module)
    module.Accelerator = PluginAccelerator
    return module


_stock = load_stock_module()
for _name, _obj in vars(_stock).items():
    if (isinstance(_obj, type) and issubclass(_obj, unittest.TestCase) and _obj.__module__ == _stock.__name__
            and getattr(_obj, "__test__", True)):
        _obj.pytestmark = [pytest.mark.timeout(120)]
        globals()[_name] = _obj
