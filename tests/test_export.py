from __future__ import annotations

import uuid

import fsspec
import pytest
import torch

import ckpt_core.export as export_mod
from ckpt_core import CheckpointManager, TrainState
from ckpt_core.cli import main
from ckpt_core.export import ExportError, export_model
from helpers_ckpt import flip_byte, make_checkpoints, make_fsdp_checkpoint, step_path, tear, tiny_model


@pytest.fixture(scope="module")
def fsdp_ckpt(tmp_path_factory):
    """An FSDP2 checkpoint saved at world size 2 (step 5) and rank 0's full state dict of the model."""
    root = tmp_path_factory.mktemp("fsdp") / "run"
    full = make_fsdp_checkpoint(str(root), step=5, world_size=2)
    return step_path(str(root), 5), full


def assert_equal_state(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k], b[k]), k


def test_fsdp2_export_safetensors_equals_full_state_dict(fsdp_ckpt, tmp_path):
    from safetensors.torch import load_file

    path, full = fsdp_ckpt
    out = tmp_path / "model.safetensors"
    result = export_model(path, str(out))
    assert result.step == 5 and result.num_tensors == len(full) and result.format == "safetensors"
    weights = load_file(str(out))
    assert_equal_state(weights, full)
    model = tiny_model(seed=123)
    model.load_state_dict(weights, strict=True)
    for k, v in model.state_dict().items():
        assert torch.equal(v, full[k])


def test_fsdp2_export_torch_format_via_cli(fsdp_ckpt, tmp_path, capsys):
    path, full = fsdp_ckpt
    out = tmp_path / "model.pt"
    assert main(["export", path, str(out)]) == 0
    assert "(torch, saved dtypes)" in capsys.readouterr().out
    weights = torch.load(out, weights_only=True)
    assert_equal_state(weights, full)
    tiny_model().load_state_dict(weights, strict=True)


def test_fsdp2_export_bf16(fsdp_ckpt, tmp_path):
    from safetensors.torch import load_file

    path, full = fsdp_ckpt
    out = tmp_path / "model.safetensors"
    result = export_model(path, str(out), dtype="bf16", batch_bytes=64)  # many small batches
    assert result.dtype == "bfloat16"
    weights = load_file(str(out))
    expected = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full.items()}
    assert_equal_state(weights, expected)
    assert weights["1.num_batches_tracked"].dtype == torch.int64


def test_export_reads_only_model_tensors(fsdp_ckpt, tmp_path, monkeypatch):
    path, full = fsdp_ckpt
    read: list[str] = []
    real = export_mod.make_reader

    def spying_reader(p, *args, **kwargs):
        reader = real(p, *args, **kwargs)
        inner = reader.read_data

        def read_data(plan, planner):
            read.extend(item.storage_index.fqn for item in plan.items)
            return inner(plan, planner)

        reader.read_data = read_data
        return reader

    monkeypatch.setattr(export_mod, "make_reader", spying_reader)
    export_model(path, str(tmp_path / "m.safetensors"))
    assert read and all(fqn.startswith("model.") for fqn in read)
    assert {fqn[len("model."):] for fqn in read} == set(full)


def test_export_memory_url_in_and_out():
    from safetensors.torch import load

    root = f"memory://export-{uuid.uuid4().hex[:8]}"
    model = make_checkpoints(root, steps=(1, 2))
    out = f"{root}/exported/model.safetensors"
    export_model(step_path(root, 2), out, dtype="fp16")
    fs, p = fsspec.core.url_to_fs(out)
    weights = load(fs.cat_file(p))
    expected = {k: v.half() if v.is_floating_point() else v for k, v in model.state_dict().items()}
    assert_equal_state(weights, expected)
    fs.rm(p.split("/")[1], recursive=True)


def test_export_errors(tmp_path):
    root = str(tmp_path / "run")
    make_checkpoints(root, steps=(1, 2, 3))
    with pytest.raises(ExportError, match=r"not a checkpoint: no \.metadata"):
        export_model(str(tmp_path), str(tmp_path / "x.safetensors"))
    with pytest.raises(ExportError, match="dtype 'int8' is not supported"):
        export_model(step_path(root, 1), str(tmp_path / "x.safetensors"), dtype="int8")
    with pytest.raises(ExportError, match="format 'onnx' is not supported"):
        export_model(step_path(root, 1), str(tmp_path / "x.onnx"), format="onnx")
    tear(step_path(root, 2))
    with pytest.raises(ExportError, match="is not committed: no manifest.json"):
        export_model(step_path(root, 2), str(tmp_path / "x.safetensors"))
    assert export_model(step_path(root, 2), str(tmp_path / "x.safetensors"), allow_uncommitted=True).step is None
    name = flip_byte(step_path(root, 3))
    export_model(step_path(root, 3), str(tmp_path / "y.safetensors"), verify="none")
    with pytest.raises(ExportError, match=f"{name} bytes .* fail their checksum"):
        export_model(step_path(root, 3), str(tmp_path / "y.safetensors"), verify="checksum")
    assert not list(tmp_path.glob("ckpt_export_tmp_*"))  # no temporary file left behind


def test_export_without_model(tmp_path):
    root = str(tmp_path / "run")
    with CheckpointManager(root, async_mode="off") as mgr:
        mgr.save(1, TrainState())
    with pytest.raises(ExportError, match="holds no model weights"):
        export_model(step_path(root, 1), str(tmp_path / "x.safetensors"))
