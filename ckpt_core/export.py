"""Export the model weights of a (sharded) checkpoint as one file for inference.

No process group is needed and the optimizer state is never read: the DCP
metadata says which tensors live under ``model.`` and their full shapes;
empty full-size tensors are allocated for just those, and DCP fills them from
every rank's shards (resharding to "one rank holds everything"). Tensors are
loaded in batches of ``batch_bytes`` and cast right after loading, so the
peak memory is the exported weights plus one batch at the saved precision.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import tempfile
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import BytesStorageMetadata, Metadata, TensorStorageMetadata

from . import signing
from .dcp_io import SafeLoadPlanner, make_reader, read_metadata
from .discovery import read_manifest, validate
from .errors import describe, is_fatal
from .manifest import Manifest, ManifestError
from .storage import DCP_METADATA_NAME, MANIFEST_NAME, get_fs, is_local, join

log = logging.getLogger("ckpt_core")

__all__ = ["DTYPES", "FORMATS", "ExportError", "ExportResult", "InvalidCheckpointError", "export_model",
           "lightning_checkpoint", "model_tensor_metadata"]

MODEL_PREFIX = "model."
FORMATS = ("safetensors", "torch", "lightning")
DTYPES: dict[str, torch.dtype] = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "half": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
    "float": torch.float32,
}
DEFAULT_BATCH_BYTES = 1 << 30


class ExportError(ValueError):
    """The checkpoint cannot be exported (not a checkpoint, no model weights, bad option)."""


class InvalidCheckpointError(ExportError):
    """The checkpoint exists but fails verification or cannot be read (corrupt, tampered, unsafe)."""


@dataclass
class ExportResult:
    """What ``export_model`` wrote."""

    out: str
    format: str
    step: Optional[int]
    num_tensors: int
    bytes: int
    dtype: Optional[str] = None
    skipped: list[str] = field(default_factory=list)


def model_tensor_metadata(metadata: Metadata) -> tuple[dict[str, TensorStorageMetadata], list[str]]:
    """The ``model.*`` tensors of a checkpoint (full name -> metadata) and the non-tensor ``model.*`` entries."""
    tensors: dict[str, TensorStorageMetadata] = {}
    skipped: list[str] = []
    for fqn, md in metadata.state_dict_metadata.items():
        if not fqn.startswith(MODEL_PREFIX):
            continue
        if isinstance(md, TensorStorageMetadata):
            tensors[fqn] = md
        elif isinstance(md, BytesStorageMetadata):
            skipped.append(fqn)
    return tensors, sorted(skipped)


def _resolve_dtype(dtype: Any) -> Optional[torch.dtype]:
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    try:
        return DTYPES[str(dtype).lower()]
    except KeyError:
        raise ExportError(f"dtype {dtype!r} is not supported; use one of bf16, fp16, fp32") from None


def _nbytes(md: TensorStorageMetadata) -> int:
    n = 1
    for d in md.size:
        n *= int(d)
    return n * torch.empty((), dtype=md.properties.dtype).element_size()


def _batches(tensors: dict[str, TensorStorageMetadata], budget: int) -> list[list[str]]:
    out: list[list[str]] = []
    current: list[str] = []
    size = 0
    for fqn, md in tensors.items():
        nb = _nbytes(md)
        if current and size + nb > budget:
            out.append(current)
            current, size = [], 0
        current.append(fqn)
        size += nb
    if current:
        out.append(current)
    return out


def _check_checkpoint(path: str, verify: str, allow_uncommitted: bool,
                      storage_options: dict, signing_key: Optional[bytes] = None) -> Optional[Manifest]:
    """The manifest of checkpoint ``path`` after checking it is one (signed with ``signing_key``, valid at ``verify``)."""
    fs, dir_path = get_fs(path, **storage_options)
    if not fs.exists(join(dir_path, DCP_METADATA_NAME)):
        what = "a checkpoint directory" if fs.isdir(dir_path) else "an existing directory"
        raise ExportError(f"{path} is not a checkpoint: no {DCP_METADATA_NAME} (DCP metadata); expected {what} "
                          f"holding {DCP_METADATA_NAME}, *.distcp shards and {MANIFEST_NAME}")
    try:
        manifest = read_manifest(fs, dir_path)
    except FileNotFoundError:
        if not allow_uncommitted:
            raise ExportError(f"{path} is not committed: no {MANIFEST_NAME} (an interrupted or in-progress save); "
                              "its shards may be incomplete") from None
        if signing_key is not None:
            raise InvalidCheckpointError(f"{path} is not committed, so unsigned, and a signing key is set") from None
        return None
    except ManifestError as e:
        if not allow_uncommitted or signing_key is not None:
            raise InvalidCheckpointError(f"{path} has an unusable {MANIFEST_NAME}: {e}") from None
        return None
    if signing_key is not None:
        try:
            manifest = signing.authenticate(manifest, signing_key, f"{path}/{MANIFEST_NAME}")
        except signing.SignatureError as e:
            raise InvalidCheckpointError(str(e)) from None
    problem = validate(path, manifest, verify, storage_options)
    if problem is not None:
        raise InvalidCheckpointError(f"{path} failed verification ({verify}): {problem}")
    return manifest


def _check_options(format: str, dtype: Any) -> Optional[torch.dtype]:  # noqa: A002 - the user-facing name
    """The target dtype, after checking the format is known and its writer is installed (before any I/O)."""
    if format not in FORMATS:
        raise ExportError(f"format {format!r} is not supported; use one of {', '.join(FORMATS)}")
    target = _resolve_dtype(dtype)
    if format == "safetensors":
        try:
            import safetensors.torch  # noqa: F401
        except ImportError:
            raise ExportError("format 'safetensors' needs the safetensors package: pip install 'ckpt[export]' "
                              "(or export with format='torch')") from None
    return target


def _model_metadata(path: str, opts: dict,
                    checked: Optional[Manifest]) -> tuple[dict[str, TensorStorageMetadata], list[str]]:
    """The ``model.*`` tensors and skipped entries of ``path``'s DCP metadata; an error when there are none."""
    try:
        metadata = read_metadata(path, opts, checked)
    except BaseException as e:  # noqa: BLE001 - an unreadable or unsafe .metadata: one clear error
        if is_fatal(e):
            raise
        raise InvalidCheckpointError(f"{path}: {DCP_METADATA_NAME} cannot be read: {describe(e)}") from None
    tensors, skipped = model_tensor_metadata(metadata)
    if not tensors:
        raise ExportError(f"{path} holds no model weights: no tensors under '{MODEL_PREFIX}' in its DCP metadata")
    for fqn in skipped:
        log.warning("ckpt export: %s is not a tensor (%s); it is not exported", fqn, type(metadata.state_dict_metadata[fqn]).__name__)
    return tensors, skipped


def _load_cast_batch(batch: list[str], tensors: dict[str, TensorStorageMetadata], path: str, opts: dict,
                     checked: Optional[Manifest], target: Optional[torch.dtype],
                     weights: dict[str, torch.Tensor]) -> int:
    """Load one batch into ``weights`` (prefix stripped, cast to ``target``); the bytes loaded at saved precision."""
    buffers = {
        fqn: torch.empty(tuple(tensors[fqn].size), dtype=tensors[fqn].properties.dtype) for fqn in batch
    }
    _load_batch(buffers, path, opts, checked)
    loaded = 0
    for fqn in batch:
        t = buffers.pop(fqn)
        loaded += t.numel() * t.element_size()
        if target is not None and t.is_floating_point() and t.dtype != target:
            t = t.to(target)
        weights[fqn[len(MODEL_PREFIX):]] = t
    return loaded


def _load_weights(tensors: dict[str, TensorStorageMetadata], path: str, opts: dict, checked: Optional[Manifest],
                  target: Optional[torch.dtype], batch_bytes: int, progress: Optional[bool],
                  on_progress: Optional[Callable[[int], None]]) -> dict[str, torch.Tensor]:
    """All model weights, loaded batch by batch so peak memory stays at the output plus one saved-precision batch."""
    from tqdm.auto import tqdm

    total = sum(_nbytes(md) for md in tensors.values())
    show = sys.stderr.isatty() if progress is None else progress
    weights: dict[str, torch.Tensor] = {}
    with tqdm(total=total, unit="B", unit_scale=True, desc="export", disable=not show) as bar:
        for batch in _batches(tensors, batch_bytes):
            loaded = _load_cast_batch(batch, tensors, path, opts, checked, target, weights)
            bar.update(loaded)
            if on_progress is not None:
                on_progress(loaded)
    return weights


def _save(weights: dict[str, torch.Tensor], out: str, format: str, path: str,  # noqa: A002
          step: Optional[int], opts: dict) -> None:
    """Write ``weights`` to ``out`` with source metadata; ``opts`` apply only when ``out`` is on ``path``'s store."""
    extra = {"format": "pt", "ckpt.source": str(path)}
    if step is not None:
        extra["ckpt.step"] = str(step)
    from fsspec.core import split_protocol

    same_store = (split_protocol(str(out))[0] or "file") == (split_protocol(str(path))[0] or "file")
    _write(weights, out, format, extra, opts if same_store else {})


def export_model(
    path: str,
    out: str,
    format: str = "safetensors",  # noqa: A002 - the user-facing name
    dtype: Any = None,
    *,
    verify: str = "size",
    allow_uncommitted: bool = False,
    batch_bytes: int = DEFAULT_BATCH_BYTES,
    progress: Optional[bool] = None,
    on_progress: Optional[Callable[[int], None]] = None,
    storage_options: Optional[dict] = None,
    signing_key: Optional[str | bytes] = None,
) -> ExportResult:
    """Write the model weights of checkpoint ``path`` (keys under ``model.``, prefix stripped) to ``out``.

    Args:
        path: a checkpoint directory (``<root>/step_<N>``), local or any fsspec URL.
        out: the file to write (local path or fsspec URL); written to a
            temporary name and renamed into place on local disk.
        format: ``"safetensors"`` (``safetensors.torch.load_file``), ``"torch"``
            (``torch.load(out, weights_only=True)``) or ``"lightning"`` (a ``.ckpt``
            that ``LightningModule.load_from_checkpoint`` accepts: the weights as
            ``state_dict``, the module's hyperparameters, step and epoch).
        dtype: cast floating-point tensors to ``bf16``/``fp16``/``fp32`` (or a
            ``torch.dtype``); integer tensors and ``None`` keep the saved dtype.
        verify: check the checkpoint first: ``none``, ``size`` or ``checksum``.
        allow_uncommitted: export even without a valid ``manifest.json`` (a torn save).
        batch_bytes: tensors are loaded in batches of about this many bytes.
        progress: show a tqdm bar; ``None`` shows one when stderr is a terminal.
        on_progress: called with the bytes loaded after each batch.
        storage_options: fsspec options for ``path`` (e.g. an S3 endpoint); also used for
            ``out`` when it is on the same kind of storage.
        signing_key: refuse a checkpoint that is not signed with this key (see ``ckpt_core.signing``).

    Raises:
        ExportError: ``path`` is not a (valid) checkpoint, holds no model weights, or an option is bad.
    """
    target = _check_options(format, dtype)
    opts = dict(storage_options or {})
    key = signing.load_key(signing_key, None)
    manifest = _check_checkpoint(path, verify, allow_uncommitted, opts, key)
    step = None if manifest is None else manifest.step
    checked = manifest if verify != "none" else None
    tensors, skipped = _model_metadata(path, opts, checked)
    weights = _load_weights(tensors, path, opts, checked, target, batch_bytes, progress, on_progress)
    if format == "lightning":
        _save(lightning_checkpoint(weights, _rank0_small_state(path, opts, checked)), out, "torch", path, step, opts)
    else:
        _save(weights, out, format, path, step, opts)
    nbytes = sum(t.numel() * t.element_size() for t in weights.values())
    log.info("ckpt export: wrote %d tensors (%d bytes) from %s to %s", len(weights), nbytes, path, out)
    dtype_name = None if target is None else str(target).replace("torch.", "")
    return ExportResult(out=str(out), format=format, step=step, num_tensors=len(weights), bytes=nbytes,
                        dtype=dtype_name, skipped=skipped)


def _rank0_small_state(path: str, opts: dict, manifest: Optional[Manifest]) -> dict:
    """Rank 0's small state (progress, extras) of checkpoint ``path``, decoded with ``weights_only=True``."""
    from .state import RANK_KEY, _from_blob

    metadata = make_reader(path, opts, manifest).read_metadata()
    entry = metadata.state_dict_metadata.get(f"{RANK_KEY}.0")
    if entry is None:
        raise InvalidCheckpointError(f"{path} holds no per-rank state")
    buffers = {RANK_KEY: {"0": torch.empty(entry.size, dtype=torch.uint8)}}
    _load_batch(buffers, path, opts, manifest)
    try:
        return _from_blob(buffers[RANK_KEY]["0"])
    except Exception as e:  # noqa: BLE001 - a blob that does not decode: not a usable checkpoint
        raise InvalidCheckpointError(f"{path}: rank 0's state does not decode: {describe(e)}") from None


def lightning_checkpoint(weights: dict[str, torch.Tensor], small: dict) -> dict:
    """The dict Lightning's ``load_from_checkpoint`` reads, from the model weights and rank 0's small state."""
    extra = small.get("extra") if isinstance(small, dict) else None
    saved = (extra or {}).get("lightning") or {}
    progress = small.get("progress", {}) if isinstance(small, dict) else {}
    out: dict[str, Any] = {
        "state_dict": weights,
        "epoch": int(progress.get("epoch", 0)),
        "global_step": int(progress.get("step", 0)),
        "pytorch-lightning_version": saved.get("lightning_version", "2.0.0"),
        "hyper_parameters": dict(saved.get("hyper_parameters") or {}),
    }
    if saved.get("hparams_name"):
        out["hparams_name"] = saved["hparams_name"]
    return out


def _load_batch(buffers: dict[str, torch.Tensor], path: str, opts: dict, manifest: Optional[Manifest]) -> None:
    """Fill ``buffers`` from checkpoint ``path`` (every item checked against ``manifest`` when given)."""
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*torch.distributed is disabled.*")
            dcp.load(buffers, storage_reader=make_reader(path, opts, manifest), planner=SafeLoadPlanner(),
                     no_dist=True)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
        if is_fatal(e):
            raise
        raise InvalidCheckpointError(f"{path} cannot be read: {describe(e)}") from None


def _write(weights: dict[str, torch.Tensor], out: str, format: str, metadata: dict[str, str],  # noqa: A002
           storage_options: dict) -> None:
    fs, out_path = get_fs(str(out), **storage_options)
    if is_local(fs):
        directory = os.path.dirname(os.path.abspath(out_path)) or "."
        os.makedirs(directory, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix="ckpt_export_tmp_", suffix=".part", dir=directory)
        os.close(fd)
        try:
            if format == "safetensors":
                from safetensors.torch import save_file

                save_file(weights, tmp, metadata=metadata)
            else:
                torch.save(weights, tmp)
            os.chmod(tmp, 0o644)
            os.replace(tmp, out_path)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
        return
    # Object stores: one PUT of the serialised file (a single write is atomic there).
    if format == "safetensors":
        from safetensors.torch import save

        data = save(weights, metadata=metadata)
    else:
        buf = io.BytesIO()
        torch.save(weights, buf)
        data = buf.getvalue()
    parent = out_path.rsplit("/", 1)[0] if "/" in out_path else ""
    if parent:
        fs.makedirs(parent, exist_ok=True)
    fs.pipe_file(out_path, data)
