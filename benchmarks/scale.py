"""Scale benchmark: what grows with the rank count, and checkpoints on an object store that throttles.

    python -m benchmarks.scale                    # plans at 8..4096 ranks, 10,000-object retention, 64 MiB restore
    python -m benchmarks.scale --quick            # a smoke run (about a minute)
    python -m benchmarks.scale --parts plans --ranks 8 64 512 --params 200

Three parts, each in this one process (no training processes are needed):

1. *plans*: the per-rank ``SavePlan``s that DCP builds for a model of
   ``--params`` parameters sharded along dim 0 over N ranks, FSDP-style (the
   parameter and its two AdamW states are split in N chunks, the AdamW
   ``step`` is a replicated scalar, each rank adds its own small state), and a
   replicated (DDP-style) case where every rank holds every tensor whole. The
   real global planning (dedup, metadata, validation) runs on them with
   ``ckpt_core``'s planner (``ckpt_core.planner.LinearMergePlanner``, whose merge of
   the ranks' planner data is linear) and with DCP's ``DefaultSavePlanner``
   (``stock plan``), first cold, then as a later save with unchanged plans
   (plan caching, as ``ckpt_core`` saves). The ``.metadata``
   is the ``Metadata`` that DCP's file-system writer pickles (with one
   ``storage_data`` entry per item); it is read back with the allowlist
   unpickler (``safe_pickle.load_dcp_metadata``) and with ``pickle.loads``.
   The commit's own work is measured on realistic files: one sidecar per rank
   (one CRC32C per item, the rank's share of the fingerprint) and the manifest
   (a sidecar and a shard file per rank); ``commit`` is what the coordinator
   does with them (parse every sidecar, combine the fingerprint, build and
   serialise the manifest), ``rank read`` what every rank does before
   loading (parse the manifest, unpickle ``.metadata``). Each figure comes with
   its growth exponent between successive rank counts (log ratio; 1.0 is
   linear); above ``--superlinear`` it is flagged.
2. *retention*: moto's S3 server runs in this process (``ThreadedMotoServer``)
   behind a WSGI layer that answers a fraction ``--throttle`` of the requests
   with ``503 SlowDown`` (the body S3 sends) and, in DeleteObjects, fails a
   fraction ``--throttle-keys`` of the keys with a per-key ``SlowDown`` inside
   a ``200`` (S3 reports a failed key so). Checkpoints of 1,000 objects each (a
   manifest, ``.metadata``, shard files) are written, then retention deletes
   all but the newest through the code path of a run (``Retainer.retain`` with
   ``list_records`` and the manager's ``_delete``). A second client lists the
   root all along and checks that no checkpoint listed as committed misses an
   object. Reported: time, requests by kind, throttled responses, objects left.
3. *restore*: a checkpoint of ``--restore-mib`` of fp32 tensors is saved to the
   bucket (``CheckpointManager(async_mode="off")``), then restored into fresh
   tensors with throttling off and on; the restored tensors must equal the
   saved ones.

JSON in ``benchmarks/results/scale_<timestamp>.json``.
"""

from __future__ import annotations

import argparse
import gc
import io
import math
import pickle
import random
import re
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional

if __package__ in (None, ""):
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    __package__ = "benchmarks"

from benchmarks import _common as C  # noqa: E402

BUCKET = "ckpts"
OBSERVER_AGENT = "ckpt-scale-observer"
KINDS = ("head", "get", "list", "put", "delete", "delete_objects", "post")


# ------------------------------------------------------------------- plans
def _write_item(fqn: str, kind: Any, offsets: Any, sizes: Any, size: Any, props: Any) -> Any:
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem

    return WriteItem(index=MetadataIndex(fqn, offsets), type=kind,
                     tensor_data=TensorWriteData(chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                                                 properties=props, size=size))


def local_plan(rank: int, world: int, params: int, case: str, rows: int = 8192, cols: int = 1024) -> Any:
    """The ``SavePlan`` DCP's ``create_local_plan`` makes on ``rank`` (flattened state, planner_data mappings).

    ``sharded``: every parameter and its ``exp_avg``/``exp_avg_sq`` is a DTensor
    split along dim 0 (one chunk per rank); ``replicated``: every rank holds them
    whole. Both: the AdamW ``step`` scalar on every rank, and ``ranks.<r>``, the
    rank's own state (RNG, data position) as a small uint8 tensor.
    """
    import torch
    from torch.distributed.checkpoint.metadata import TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan, WriteItemType

    fp32, u8 = TensorProperties(dtype=torch.float32), TensorProperties(dtype=torch.uint8)
    full = torch.Size([rows, cols])
    if case == "sharded":
        per = rows // world
        kind, offsets, sizes = WriteItemType.SHARD, torch.Size([rank * per, 0]), torch.Size([per, cols])
    else:
        kind, offsets, sizes = WriteItemType.TENSOR, torch.Size([0, 0]), full
    scalar = torch.Size([])
    items, mappings = [], {}
    for i in range(params):
        p = f"layers.{i}.weight"
        for fqn in (f"model.{p}", f"optim.state.{p}.exp_avg", f"optim.state.{p}.exp_avg_sq"):
            items.append(_write_item(fqn, kind, offsets, sizes, full, fp32))
            mappings[fqn] = tuple(fqn.split("."))
        fqn = f"optim.state.{p}.step"
        items.append(_write_item(fqn, WriteItemType.TENSOR, scalar, scalar, scalar, fp32))
        mappings[fqn] = tuple(fqn.split("."))
    blob = torch.Size([512])
    items.append(_write_item(f"ranks.{rank}", WriteItemType.TENSOR, torch.Size([0]), blob, blob, u8))
    mappings[f"ranks.{rank}"] = ("ranks", str(rank))
    return SavePlan(items, planner_data=mappings)


def _cached_planning_s(plans: list, world: int) -> float:
    """A later save's global planning with unchanged local plans: ``ckpt_core``'s saver caches plans."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner

    key = f"ckpt-scale-{world}"
    first = DefaultSavePlanner(enable_plan_caching=True)
    first._cached_plans_key = key
    first.create_global_plan(plans)
    later = DefaultSavePlanner(enable_plan_caching=True)
    later._cached_plans_key = key
    t0 = time.perf_counter()
    later.create_global_plan([SavePlan([], usable=False)] * world)
    dt = time.perf_counter() - t0
    for cache in ("_cached_save_plan", "_cached_all_plans", "_cached_global_plan", "_cached_metadata",
                  "_cached_final_save_plan"):
        getattr(SavePlanner, cache, {}).pop(key, None)
    return dt


def dcp_metadata(global_plan: list, metadata: Any) -> tuple[Any, dict]:
    """``metadata`` completed as DCP's writer's ``finish`` completes it; and each rank's items (name, offset, length).

    Every item of rank ``r`` lands in ``__<r>_0.distcp`` at consecutive offsets (one writer thread).
    """
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import StorageMeta

    storage, per_rank = {}, {}
    for r, plan in enumerate(global_plan):
        name, offset, mine = f"__{r}_0.distcp", 0, []
        for item in plan.items:
            length = 4 * math.prod(item.tensor_data.chunk.sizes) + 1000  # torch.save framing of a tensor, about
            storage[item.index] = _StorageInfo(name, offset, length)
            mine.append((item.index.fqn, offset, length))
            offset += length
        per_rank[r] = mine
    metadata.storage_data = storage
    metadata.version = "1.0.0"
    metadata.storage_meta = StorageMeta(checkpoint_id="s3://bucket/run/step_000001000", save_id="0" * 32)
    return metadata, per_rank


def _timed(fn: Callable[[], Any]) -> tuple[Any, float]:
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def sidecars_for(per_rank: dict, checkpoint_id: str, step: int) -> list[bytes]:
    """Each rank's sidecar as its writer leaves it: its shard file, one CRC32C per item, its fingerprint share."""
    from ckpt_core.fingerprint import is_fingerprinted
    from ckpt_core.sidecar import Sidecar

    out = []
    for r, mine in per_rank.items():
        name = f"__{r}_0.distcp"
        size = mine[-1][1] + mine[-1][2] if mine else 0
        out.append(Sidecar(
            prefix=f"__{r}_", files={name: (size, (r * 2654435761) & 0xFFFFFFFF)},
            fingerprint={fqn: (0.5 * length, 0.75 * length, length // 4) for fqn, _, length in mine
                         if is_fingerprinted(fqn)},
            items={(name, offset, length): (offset * 40503 + r) & 0xFFFFFFFF for _, offset, length in mine},
            checkpoint_id=checkpoint_id, step=step).to_json())
    return out


def commit(raws: list[bytes], metadata_bytes: bytes, checkpoint_id: str, step: int) -> bytes:
    """The coordinator's commit after every rank wrote (``dcp_io._CommitMixin.finish``), storage left out.

    Parse and check every sidecar, list its files in the manifest, combine the fingerprint, build the manifest
    and serialise it.
    """
    import crc32c

    from ckpt_core import fingerprint as fp
    from ckpt_core.manifest import FileEntry, build_manifest
    from ckpt_core.sidecar import parse_sidecar, sidecar_name
    from ckpt_core.signing import sha256_hex

    files, digests, parts = {}, {}, []
    for r, raw in enumerate(raws):
        name = sidecar_name(f"__{r}_")
        side = parse_sidecar(raw, name)
        if side.checkpoint_id != checkpoint_id:
            raise AssertionError(f"{name} belongs to another checkpoint")
        files[name] = FileEntry(len(raw), crc32c.crc32c(raw))
        digests[name] = sha256_hex(raw)
        files.update({f: FileEntry(size, crc) for f, (size, crc) in side.files.items()})
        parts.append(side.fingerprint)
    files[".metadata"] = FileEntry(len(metadata_bytes), crc32c.crc32c(metadata_bytes))
    manifest = build_manifest(files=files, fingerprint=fp.combine(parts), world_size=len(raws), step=step,
                              checkpoint_id=checkpoint_id)
    return manifest.to_json().encode()


def restore_rank(manifest_json: bytes, metadata_bytes: bytes) -> Any:
    """What every rank reads before loading: the manifest, then ``.metadata`` through the allowlist unpickler."""
    from ckpt_core.manifest import parse_manifest
    from ckpt_core.safe_pickle import load_dcp_metadata

    parse_manifest(manifest_json)
    return load_dcp_metadata(metadata_bytes, "step_000001000/.metadata")


def measure_plans(world: int, params: int, case: str) -> dict:
    """Every figure of one (rank count, case): planning, ``.metadata``, sidecars, manifest, commit, restore."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from ckpt_core.planner import LinearMergePlanner

    sent = [pickle.dumps(local_plan(r, world, params, case)) for r in range(world)]  # what each rank sends
    plans, gather_s = _timed(lambda: [pickle.loads(b) for b in sent])
    plan_bytes = sum(map(len, sent))
    del sent
    _, stock_plan_s = _timed(lambda: DefaultSavePlanner().create_global_plan(plans))
    (global_plan, metadata), plan_s = _timed(lambda: LinearMergePlanner().create_global_plan(plans))
    cached_s = _cached_planning_s(plans, world)
    del plans
    _, scatter_s = _timed(lambda: [pickle.dumps(p) for p in global_plan])
    metadata, per_rank = dcp_metadata(global_plan, metadata)
    del global_plan
    chunks = sum(len(getattr(v, "chunks", ())) for v in metadata.state_dict_metadata.values())
    data, pickle_s = _timed(lambda: pickle.dumps(metadata))
    del metadata
    gc.collect()
    cid, step = "0123456789abcdef0123456789abcdef-1000", 1000
    raws = sidecars_for(per_rank, cid, step)
    del per_rank
    manifest_json, commit_s = _timed(lambda: commit(raws, data, cid, step))
    _, restore_s = _timed(lambda: restore_rank(manifest_json, data))
    gc.collect()
    _, c_load_s = _timed(lambda: pickle.loads(data))
    gc.collect()
    return {
        "ranks": world, "case": case, "params": params, "metadata_chunks": chunks,
        "gathered_plan_bytes": plan_bytes, "plan_exchange_s": gather_s + scatter_s,
        "plan_s": plan_s, "plan_stock_s": stock_plan_s, "plan_cached_s": cached_s,
        "metadata_bytes": len(data), "metadata_pickle_s": pickle_s,
        "restore_rank_s": restore_s, "metadata_c_unpickle_s": c_load_s,
        "sidecar_max_bytes": max(map(len, raws)), "sidecars_total_bytes": sum(map(len, raws)),
        "manifest_bytes": len(manifest_json), "commit_s": commit_s,
    }


# -------------------------------------------------------------- S3 throttling
_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?>\n<Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
OBJECT_RE = re.compile(rb"<Object>\s*<Key>(.*?)</Key>.*?</Object>", re.S)


def request_kind(environ: dict) -> str:
    """The S3 operation of a path-style request: head, get, list, put, delete, delete_objects, post."""
    method, query = environ["REQUEST_METHOD"], environ.get("QUERY_STRING", "")
    has_key = "/" in environ.get("PATH_INFO", "").strip("/")
    if method == "POST":
        return "delete_objects" if re.search(r"(^|&)delete(=|&|$)", query) else "post"
    if method == "GET":
        return "get" if has_key else "list"
    return method.lower()


class Throttle:
    """WSGI layer in front of moto: answers a fraction of requests ``503 SlowDown`` and fails DeleteObjects keys.

    ``rate``: the fraction of requests answered ``503 SlowDown`` (the request
    never reaches the store); ``key_rate``: the fraction of the keys of a
    DeleteObjects that come back as per-key ``SlowDown`` errors in a ``200``
    (those keys stay). Requests whose User-Agent holds ``OBSERVER_AGENT`` pass
    untouched and are counted apart. Seeded: a run is reproducible.
    """

    def __init__(self, app: Callable, seed: int = 0) -> None:
        self.app, self.rate, self.key_rate = app, 0.0, 0.0
        self._rng = random.Random(seed)
        self._lock = threading.Lock()
        self.counts: dict[str, int] = {}

    def reset(self, rate: float = 0.0, key_rate: float = 0.0) -> None:
        with self._lock:
            self.rate, self.key_rate, self.counts = rate, key_rate, {}

    def _count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self.counts[name] = self.counts.get(name, 0) + n

    def _draw(self, p: float) -> bool:
        with self._lock:
            return p > 0 and self._rng.random() < p

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        kind = request_kind(environ)
        if OBSERVER_AGENT in environ.get("HTTP_USER_AGENT", ""):
            self._count("observer")
            return self.app(environ, start_response)
        self._count(kind)
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        if self._draw(self.rate):
            self._count("throttled")
            self._count(f"throttled_{kind}")
            payload = b"" if kind == "head" else _SLOWDOWN
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(payload)))])
            return [payload]
        if kind == "delete_objects" and self.key_rate > 0:
            return self._delete_some(environ, body, start_response)
        return self.app(environ, start_response)

    def _delete_some(self, environ: dict, body: bytes, start_response: Callable) -> Any:
        """Pass the DeleteObjects on without the failed keys; add a per-key ``SlowDown`` for each to the answer."""
        failed = [m for m in OBJECT_RE.finditer(body) if self._draw(self.key_rate)]
        self._count("keys_failed", len(failed))
        return delete_objects_failing(self.app, environ, body, failed, start_response)


def delete_objects_failing(app: Callable, environ: dict, body: bytes, failed: list, start_response: Callable) -> Any:
    """Answer the DeleteObjects ``body`` through ``app`` without the ``failed`` ``<Object>`` matches (of
    ``OBJECT_RE``), reporting a per-key ``SlowDown`` for each inside the ``200``, as S3 does (s3fs raises nothing)."""
    if not failed:
        return app(environ, start_response)
    errors = b"".join(b"<Error><Key>" + m.group(1) + b"</Key><Code>SlowDown</Code>"
                      b"<Message>Please reduce your request rate.</Message></Error>" for m in failed)
    spans = {m.span() for m in failed}
    kept = OBJECT_RE.sub(lambda m: b"" if m.span() in spans else m.group(0), body)
    if not OBJECT_RE.search(kept):
        out = b'<?xml version="1.0" encoding="UTF-8"?>\n<DeleteResult>' + errors + b"</DeleteResult>"
        start_response("200 OK", [("Content-Type", "application/xml"), ("Content-Length", str(len(out)))])
        return [out]
    for h in [h for h in environ if h.startswith(("HTTP_X_AMZ_CHECKSUM", "HTTP_CONTENT_MD5"))]:
        del environ[h]
    environ.update({"wsgi.input": io.BytesIO(kept), "CONTENT_LENGTH": str(len(kept))})
    status: list = []
    out = b"".join(app(environ, lambda s, h, *a: status.append((s, h))))
    out = out.replace(b"</DeleteResult>", errors + b"</DeleteResult>")
    headers = [(k, v) for k, v in status[0][1] if k.lower() != "content-length"]
    start_response(status[0][0], [*headers, ("Content-Length", str(len(out)))])
    return [out]


class ThrottledS3:
    """moto's S3 server (``ThreadedMotoServer``) on a loopback port in this process, behind ``Throttle``."""

    def __init__(self, seed: int = 0) -> None:
        import boto3
        from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
        from moto.server import ThreadedMotoServer
        from werkzeug.serving import make_server

        outer = self

        class Server(ThreadedMotoServer):
            def _server_entry(self) -> None:  # moto's own, with the app wrapped
                outer.throttle = Throttle(DomainDispatcherApplication(create_backend_app), seed)
                self._server = make_server(self._ip_address, self._port, outer.throttle, True,
                                           request_handler=MotoRequestHandler)
                self._server_ready_event.set()
                self._server.serve_forever()

        self.throttle: Throttle
        self._server = Server(ip_address="127.0.0.1", port=0, verbose=False)
        self._server.start()
        self.port = self._server.get_host_and_port()[1]
        self.options = {"key": "testing", "secret": "testing",
                        "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{self.port}", "region_name": "us-east-1"}}
        boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                     **self.options["client_kwargs"]).create_bucket(Bucket=BUCKET)

    def observer_options(self) -> dict:
        """Storage options of a client that the throttle lets through (and counts apart)."""
        return {**self.options, "skip_instance_cache": True, "config_kwargs": {"user_agent_extra": OBSERVER_AGENT}}

    def close(self) -> None:
        self._server.stop()


# --------------------------------------------------------------- retention
def populate(fs: Any, root_path: str, checkpoints: int, per_checkpoint: int) -> list[int]:
    """``checkpoints`` committed checkpoints of ``per_checkpoint`` objects each (shards, ``.metadata``, manifest).

    Written without throttling; the manifest last, as a save commits. The steps.
    """
    import crc32c

    from ckpt_core.manifest import FileEntry, build_manifest
    from ckpt_core.storage import MANIFEST_NAME, join, step_dirname, write_bytes_durable

    payload = bytes(range(64))
    steps = [100 * (k + 1) for k in range(checkpoints)]
    for step in steps:
        d = join(root_path, step_dirname(step))
        names = [".metadata", *(f"__{r}_0.distcp" for r in range(per_checkpoint - 2))]
        fs.pipe({join(d, n): payload for n in names})
        manifest = build_manifest(step=step, world_size=per_checkpoint - 2, fingerprint={},
                                  files={n: FileEntry(len(payload), crc32c.crc32c(payload)) for n in names},
                                  checkpoint_id=f"{0:032x}-{step}")
        write_bytes_durable(fs, join(d, MANIFEST_NAME), manifest.to_json().encode())
    return steps


def objects_by_dir(fs: Any, root_path: str) -> dict[str, int]:
    """How many objects each step directory under ``root_path`` holds (one recursive listing)."""
    from ckpt_core.storage import basename

    fs.invalidate_cache()
    counts: dict[str, int] = {}
    for path in fs.find(root_path):
        d = basename(path.rsplit("/", 1)[0])
        counts[d] = counts.get(d, 0) + 1
    return counts


class Observer(threading.Thread):
    """Lists the root over and over while retention runs; records every committed checkpoint missing an object.

    Objects are listed first, then the records: a checkpoint still committed
    (its manifest present) after its listing showed an object gone was
    committed while half deleted (manifests are only ever removed here).
    """

    def __init__(self, root: str, options: dict, per_checkpoint: int) -> None:
        super().__init__(name="ckpt-scale-observer", daemon=True)
        from ckpt_core.storage import get_fs

        self.root, self.options, self.per_checkpoint = root, options, per_checkpoint
        self.fs, self.root_path = get_fs(root, **options)
        self.stop = threading.Event()
        self.rounds = 0
        self.violations: list[str] = []

    def run(self) -> None:
        from ckpt_core.discovery import list_records
        from ckpt_core.storage import basename

        while not self.stop.is_set():
            counts = objects_by_dir(self.fs, self.root_path)
            for rec in list_records(self.root, self.options):
                have = counts.get(basename(rec.path), 0)
                if rec.committed and have < self.per_checkpoint:
                    self.violations.append(f"step {rec.step} listed committed with {have}/{self.per_checkpoint}")
            self.rounds += 1


def _warnings_of(logger_name: str) -> tuple[Any, list]:
    import logging

    seen: list = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: seen.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger(logger_name).addHandler(handler)
    return handler, seen


def measure_retention(s3: ThrottledS3, objects: int, per_checkpoint: int, rate: float, key_rate: float,
                      label: str) -> dict:
    """Write ``objects`` to delete (+ the newest checkpoint, kept), then retention with ``keep_last=1``; check it."""
    import logging
    from functools import partial

    from ckpt_core.discovery import list_records
    from ckpt_core.manager import _delete
    from ckpt_core.retainer import Retainer
    from ckpt_core.retention import build_policy
    from ckpt_core.storage import get_fs, step_dirname

    root = f"s3://{BUCKET}/retention-{label}"
    fs, root_path = get_fs(root, **s3.options)
    s3.throttle.reset()
    steps, populate_s = _timed(lambda: populate(fs, root_path, objects // per_checkpoint + 1, per_checkpoint))
    observer = Observer(root, s3.observer_options(), per_checkpoint)
    handler, warned = _warnings_of("ckpt_core")
    retainer = Retainer(build_policy(keep_last=1), partial(list_records, root, s3.options),
                        partial(_delete, fs, s3.options), active=False)
    s3.throttle.reset(rate, key_rate)
    observer.start()
    try:
        deleted, retain_s = _timed(lambda: retainer.retain(set(), set))
    finally:
        s3.throttle.rate = s3.throttle.key_rate = 0.0
        observer.stop.set()
        observer.join()
        logging.getLogger("ckpt_core").removeHandler(handler)
    counts = dict(s3.throttle.counts)
    left = objects_by_dir(observer.fs, root_path)
    committed = [r.step for r in list_records(root, s3.options) if r.committed]
    newest = step_dirname(steps[-1])
    return {
        "label": label, "throttle": rate, "throttle_keys": key_rate, "objects_deleted_target": objects,
        "per_checkpoint": per_checkpoint, "populate_s": populate_s, "retention_s": retain_s,
        "deleted_steps": deleted, "all_deleted": deleted == steps[:-1],
        "objects_left_in_deleted": sum(n for d, n in left.items() if d != newest),
        "newest_intact": left.get(newest) == per_checkpoint, "committed_after": committed,
        "requests": counts, "observer_rounds": observer.rounds, "violations": observer.violations,
        "retention_warnings": warned,
    }


# ----------------------------------------------------------------- restore
def _manager(root: str, options: dict) -> Any:
    from ckpt_core import CheckpointManager

    return CheckpointManager(root, async_mode="off", storage_options=options, handle_preemption=False,
                             env={}, argv=[])


def measure_restore(s3: ThrottledS3, size_bytes: int, tensor_bytes: int, rate: float, repeats: int) -> dict:
    """Save ``size_bytes`` of fp32 tensors to the bucket, then restore them with throttling off and at ``rate``."""
    import torch

    from ckpt_core import TrainState

    root = f"s3://{BUCKET}/restore"
    saved, _, nbytes = C.build_model(size_bytes, tensor_bytes, 0, 1, seed=0)
    s3.throttle.reset()
    with _manager(root, s3.options) as m:
        _, save_s = _timed(lambda: m.save(1, TrainState(model=saved, rng=False)))
    rounds = []
    for i in range(repeats):
        for r in (0.0, rate):
            fresh, _, _ = C.build_model(size_bytes, tensor_bytes, 0, 1, seed=1 + i)
            with _manager(root, s3.options) as m:
                s3.throttle.reset(r)
                try:
                    rec, dt = _timed(lambda: m.restore(TrainState(model=fresh, rng=False)))
                finally:
                    s3.throttle.rate = 0.0
                counts = dict(s3.throttle.counts)
            same = all(torch.equal(a, b) for a, b in zip(saved.state_dict().values(), fresh.state_dict().values()))
            rounds.append({"throttle": r, "restore_s": dt, "step": None if rec is None else rec.step,
                           "equal": same, "requests": counts})
    return {"state_bytes": nbytes, "save_s": save_s, "rounds": rounds}


# ----------------------------------------------------------------- harness
PLAN_COLUMNS = (  # (key, header, format)
    ("metadata_chunks", "chunks", "d"), ("plan_s", "plan s", ".3f"), ("plan_stock_s", "stock plan s", ".3f"), ("plan_cached_s", "cached s", ".4f"),
    ("plan_exchange_s", "exchange s", ".3f"), ("metadata_bytes", ".metadata", "B"),
    ("metadata_pickle_s", "pickle s", ".3f"), ("restore_rank_s", "rank read s", ".3f"),
    ("metadata_c_unpickle_s", "C unpickle s", ".3f"), ("sidecar_max_bytes", "sidecar", "B"),
    ("sidecars_total_bytes", "all sidecars", "B"), ("manifest_bytes", "manifest", "B"),
    ("commit_s", "commit s", ".3f"), ("restore_reads_bytes", "job reads", "B"),
)


def human_bytes(n: float) -> str:
    """``n`` bytes in KiB/MiB/GiB."""
    for unit, size in (("GiB", C.GiB), ("MiB", C.MiB), ("KiB", 1024)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"


def exponents(rows: list[dict], keys: list[str]) -> list[dict]:
    """Growth exponent of each figure between successive rank counts: log(ratio of figures) / log(ratio of ranks)."""
    out = []
    for a, b in zip(rows, rows[1:]):
        e = {"from": a["ranks"], "to": b["ranks"]}
        for k in keys:
            x, y = a.get(k), b.get(k)
            e[k] = math.log(y / x) / math.log(b["ranks"] / a["ranks"]) if x and y and x > 0 and y > 0 else None
        out.append(e)
    return out


def run_plans(args: argparse.Namespace) -> list[dict]:
    """Every case at every rank count, with the growth exponents between counts."""
    suites = []
    for case in args.cases:
        rows = []
        for world in args.ranks:
            row = measure_plans(world, args.params, case)
            row["restore_reads_bytes"] = world * (row["metadata_bytes"] + row["manifest_bytes"])
            rows.append(row)
            print(f"  plans {case:<10} {world:>5} ranks: planning {row['plan_s']:.2f}s, .metadata "
                  f"{human_bytes(row['metadata_bytes'])}, a rank reads it in {row['restore_rank_s']:.2f}s", flush=True)
        suites.append({"case": case, "rows": rows,
                       "exponents": exponents(rows, [k for k, _, _ in PLAN_COLUMNS if k != "metadata_chunks"])})
    return suites


def _cell(value: Any, spec: str) -> str:
    if value is None:
        return "-"
    return human_bytes(value) if spec == "B" else format(value, spec)


def print_plans(suites: list[dict], args: argparse.Namespace) -> None:
    for s in suites:
        print(f"\n-- DCP plans, {s['case']}: {args.params} parameters x (weight, exp_avg, exp_avg_sq) "
              f"{'split over the ranks' if s['case'] == 'sharded' else 'whole on every rank'}, a replicated "
              f"step per parameter, one state per rank --")
        print("  ".join(f"{h:>12}" for h in ("ranks", *(h for _, h, _ in PLAN_COLUMNS))))
        for r in s["rows"]:
            print("  ".join(f"{c:>12}" for c in (str(r["ranks"]), *(_cell(r[k], f) for k, _, f in PLAN_COLUMNS))))
        for e in s["exponents"]:
            flags = [_cell(e[k], ".2f") + ("!" if (e[k] or 0) > args.superlinear else "")
                     for k, _, _ in PLAN_COLUMNS[1:]]
            print("  ".join(f"{c:>12}" for c in (f"{e['from']}->{e['to']}", "", *flags)))
    print(f"(second block per case: growth exponents between rank counts, 1.00 = linear; '!' = above "
          f"{args.superlinear}. 'job reads': what all ranks read before a restore, every rank the whole .metadata and "
          "manifest)")


def run_retention(s3: ThrottledS3, args: argparse.Namespace) -> list[dict]:
    """Retention without throttling, then with it, each on checkpoints of its own."""
    out = []
    for label, rate, key_rate in (("no-throttle", 0.0, 0.0), ("throttled", args.throttle, args.throttle_keys)):
        r = measure_retention(s3, args.objects, args.per_checkpoint, rate, key_rate, label)
        out.append(r)
        print(f"  retention {label}: {r['retention_s']:.2f}s, deleted steps {r['deleted_steps']}, objects left "
              f"{r['objects_left_in_deleted']}, violations {len(r['violations'])}", flush=True)
    return out


def print_retention(runs: list[dict]) -> None:
    print("\n-- retention on moto S3: delete all but the newest checkpoint (keep_last=1) --")
    print(f"{'run':<12} {'objects':>8} {'503 rate':>8} {'key rate':>8} {'time s':>7} {'requests':>9} {'throttled':>9} "
          f"{'keys failed':>11} {'all deleted':>11} {'left':>6} {'half listed':>11} {'warnings':>8}")
    for r in runs:
        req = r["requests"]
        total = sum(v for k, v in req.items() if k in KINDS)
        print(f"{r['label']:<12} {r['objects_deleted_target']:>8} {r['throttle']:>8.2f} {r['throttle_keys']:>8.2f} "
              f"{r['retention_s']:>7.2f} {total:>9} {req.get('throttled', 0):>9} {req.get('keys_failed', 0):>11} "
              f"{str(r['all_deleted']):>11} {r['objects_left_in_deleted']:>6} {len(r['violations']):>11} "
              f"{len(r['retention_warnings']):>8}")
        print(f"{'':<12} requests by kind: {', '.join(f'{k} {v}' for k, v in sorted(req.items()))}; "
              f"observer rounds {r['observer_rounds']}")
    print("('left': objects of deleted checkpoints still stored; 'half listed': times a checkpoint missing objects "
          "was listed committed; 'warnings': retention failures logged)")


def print_restore(res: dict) -> None:
    print(f"\n-- restore from moto S3: {human_bytes(res['state_bytes'])} of fp32 tensors "
          f"(saved in {res['save_s']:.2f}s) --")
    for rate in sorted({r["throttle"] for r in res["rounds"]}):
        rounds = [r for r in res["rounds"] if r["throttle"] == rate]
        total = C.median([sum(v for k, v in r["requests"].items() if k in KINDS) for r in rounds])
        throttled = C.median([r["requests"].get("throttled", 0) for r in rounds])
        times = ", ".join(f"{r['restore_s']:.2f}" for r in rounds)
        print(f"  503 rate {rate:.2f}: restore {C.median([r['restore_s'] for r in rounds]):.2f}s (median of "
              f"{len(rounds)}: {times}), {total:.0f} requests, {throttled:.0f} throttled; restored steps "
              f"{[r['step'] for r in rounds]}, tensors equal {all(r['equal'] for r in rounds)}")


def parse_args(argv: Optional[list] = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks.scale", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--parts", nargs="+", default=["plans", "retention", "restore"],
                   choices=("plans", "retention", "restore"))
    p.add_argument("--ranks", type=int, nargs="+", default=None, help="rank counts (default 8 64 512 4096; "
                   "--quick: 8 64 512)")
    p.add_argument("--params", type=int, default=None, help="parameters of the model (default 50; --quick: 10); "
                   "each has 3 sharded tensors and a replicated step")
    p.add_argument("--cases", nargs="+", default=["sharded", "replicated"], choices=("sharded", "replicated"))
    p.add_argument("--superlinear", type=float, default=1.2, help="flag growth exponents above this")
    p.add_argument("--objects", type=int, default=None, help="objects retention deletes (default 10000; --quick: 1000)")
    p.add_argument("--per-checkpoint", type=int, default=None,
                   help="objects per checkpoint (default 1000; --quick: 200)")
    p.add_argument("--throttle", type=float, default=0.2, help="fraction of requests answered 503 SlowDown")
    p.add_argument("--throttle-keys", type=float, default=0.05,
                   help="fraction of DeleteObjects keys failed with a per-key SlowDown")
    p.add_argument("--restore-mib", type=float, default=None, help="state restored from S3 (default 64; --quick: 16)")
    p.add_argument("--tensor-mib", type=float, default=8)
    p.add_argument("--repeats", type=int, default=None, help="restores per throttle rate (default 3; --quick: 1)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=None)
    p.add_argument("--quick", action="store_true")
    a = p.parse_args(argv)
    q = a.quick
    a.ranks = a.ranks or ([8, 64, 512] if q else [8, 64, 512, 4096])
    a.params = a.params or (10 if q else 50)
    a.objects = a.objects or (1000 if q else 10000)
    a.per_checkpoint = a.per_checkpoint or (200 if q else 1000)
    a.restore_mib = a.restore_mib or (16 if q else 64)
    a.repeats = a.repeats or (1 if q else 3)
    return a


def main(argv: Optional[list] = None) -> int:
    """Run the parts asked for, print their tables, write the JSON; 1 if a deletion or a restore went wrong."""
    import logging

    args = parse_args(argv)
    C.exit_on_sigterm()
    logging.getLogger().setLevel(logging.ERROR)
    logging.getLogger("ckpt_core").setLevel(logging.WARNING)
    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's server logs every request
    t0, stamp = time.time(), C.timestamp()
    payload: dict = {"benchmark": "scale", "timestamp": stamp, "machine": C.machine_info(),
                     "config": {k: v for k, v in vars(args).items()}}
    if "plans" in args.parts:
        payload["plans"] = run_plans(args)
    if {"retention", "restore"} & set(args.parts):
        s3 = ThrottledS3(seed=args.seed)
        try:
            if "retention" in args.parts:
                payload["retention"] = run_retention(s3, args)
            if "restore" in args.parts:
                payload["restore"] = measure_restore(s3, int(args.restore_mib * C.MiB), int(args.tensor_mib * C.MiB),
                                                     args.throttle, args.repeats)
        finally:
            s3.close()
    if "plans" in payload:
        print_plans(payload["plans"], args)
    if "retention" in payload:
        print_retention(payload["retention"])
    if "restore" in payload:
        print_restore(payload["restore"])
    payload["wall_s"] = time.time() - t0
    paths = C.save_json(f"scale_{stamp}.json", payload, args.out)
    print(f"\nwrote {', '.join(map(str, paths))} in {payload['wall_s']:.0f}s")
    return 0 if _all_ok(payload) else 1


def _all_ok(payload: dict) -> bool:
    """Every deletion done and never a half-deleted checkpoint listed committed; every restore equal."""
    ok = all(r["all_deleted"] and not r["objects_left_in_deleted"] and not r["violations"] and r["newest_intact"]
             for r in payload.get("retention", []))
    return ok and all(r["equal"] and r["step"] == 1 for r in payload.get("restore", {}).get("rounds", []))


if __name__ == "__main__":
    sys.exit(main())
