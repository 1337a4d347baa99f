"""Checkpoints on an S3 server that throttles: moto's S3 server (in this process) behind a WSGI fault layer.

The layer answers chosen requests ``503 SlowDown`` (what S3 sends when a
prefix takes more requests than it serves) and fails chosen keys of a
DeleteObjects with a per-key ``SlowDown`` inside a ``200`` (which s3fs does
not raise). Retention must still delete every object, the manifest first; a
restore must still load the saved tensors.
"""

from __future__ import annotations

import io
import threading
from typing import Any, Callable

import pytest
import torch
from torch import nn

from benchmarks.scale import OBJECT_RE, delete_objects_failing
from ckpt_core import CheckpointManager, TrainState
from ckpt_core.discovery import list_records
from ckpt_core.storage import get_fs, remove_tree

pytest.importorskip("s3fs", reason="the s3 extra is part of the test install")
pytest.importorskip("moto", reason="the s3 extra is part of the test install")

_SLOWDOWN = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"


class Faults:
    """WSGI layer in front of moto's app; records the requests that reach the store, in order."""

    def __init__(self, app: Callable) -> None:
        self.app = app
        self.lock = threading.Lock()
        self.reset()

    def reset(self) -> None:
        self.slow_down: Callable[[str, str], bool] = lambda method, path: False
        """(method, path) -> answer this request ``503 SlowDown`` instead of passing it on."""
        self.fail_key: Callable[[str], bool] = lambda key: False
        """key of a DeleteObjects -> fail it with a per-key ``SlowDown`` (the object stays)."""
        self.passed: list[tuple[str, str]] = []
        self.throttled: list[tuple[str, str]] = []
        self.keys_failed: list[str] = []

    def __call__(self, environ: dict, start_response: Callable) -> Any:
        method, path = environ["REQUEST_METHOD"], environ.get("PATH_INFO", "")
        if environ.get("QUERY_STRING", "").startswith("delete"):
            method = "DeleteObjects"
        body = environ["wsgi.input"].read(int(environ.get("CONTENT_LENGTH") or 0))
        environ["wsgi.input"] = io.BytesIO(body)
        with self.lock:
            throttle = self.slow_down(method, path)
            (self.throttled if throttle else self.passed).append((method, path))
        if throttle:
            payload = b"" if method == "HEAD" else _SLOWDOWN
            start_response("503 Slow Down", [("Content-Type", "application/xml"),
                                             ("Content-Length", str(len(payload)))])
            return [payload]
        if method == "DeleteObjects":
            return self._delete_objects(environ, body, start_response)
        return self.app(environ, start_response)

    def _delete_objects(self, environ: dict, body: bytes, start_response: Callable) -> Any:
        with self.lock:
            failed = [m for m in OBJECT_RE.finditer(body) if self.fail_key(m.group(1).decode())]
            self.keys_failed += [m.group(1).decode() for m in failed]
        return delete_objects_failing(self.app, environ, body, failed, start_response)


@pytest.fixture(scope="module")
def throttled_s3():
    """(storage options, fault layer): moto's ``ThreadedMotoServer`` on loopback with its app behind ``Faults``."""
    import boto3
    from moto.moto_server.werkzeug_app import DomainDispatcherApplication, MotoRequestHandler, create_backend_app
    from moto.server import ThreadedMotoServer
    from werkzeug.serving import make_server

    layer: list[Faults] = []

    class Server(ThreadedMotoServer):
        def _server_entry(self) -> None:
            layer.append(Faults(DomainDispatcherApplication(create_backend_app)))
            self._server = make_server(self._ip_address, self._port, layer[0], True, request_handler=MotoRequestHandler)
            self._server_ready_event.set()
            self._server.serve_forever()

    server = Server(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    opts = {"key": "testing", "secret": "testing", "skip_instance_cache": True,
            "client_kwargs": {"endpoint_url": f"http://127.0.0.1:{server.get_host_and_port()[1]}",
                              "region_name": "us-east-1"}}
    boto3.client("s3", aws_access_key_id="testing", aws_secret_access_key="testing",
                 **opts["client_kwargs"]).create_bucket(Bucket="ckpts")
    yield opts, layer[0]
    server.stop()


@pytest.fixture
def faults(throttled_s3):
    throttled_s3[1].reset()
    yield throttled_s3[1]
    throttled_s3[1].reset()


def _manager(root: str, opts: dict, **kw: Any) -> CheckpointManager:
    return CheckpointManager(root, async_mode="off", storage_options=opts, handle_preemption=False, lease=False,
                             env={}, argv=[], **kw)


def _save(root: str, opts: dict, steps: list[int], **kw: Any) -> dict[int, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    saved = {}
    with _manager(root, opts, **kw) as m:
        for step in steps:
            with torch.no_grad():
                model.weight.add_(1.0)
            m.save(step, TrainState(model=model, rng=False))
            m.wait()
            saved[step] = [p.detach().clone() for p in model.parameters()]
    return saved


def _first_of(match: Callable[[str, str], bool], per_path: bool = True) -> Callable[[str, str], bool]:
    """A ``slow_down`` rule: the first request that ``match``es (of each path, with ``per_path``), once."""
    seen: set[str] = set()

    def rule(method: str, path: str) -> bool:
        key = path if per_path else ""
        hit = match(method, path) and key not in seen
        if hit:
            seen.add(key)
        return hit

    return rule


def _keys(opts: dict, path: str) -> list[str]:
    fs, p = get_fs(path, **opts)
    fs.invalidate_cache()
    return fs.find(p)


def test_retention_deletes_the_keys_a_throttled_bulk_delete_left(throttled_s3, faults):
    """DeleteObjects answers 200 with a per-key SlowDown for the shard and ``.metadata`` of each checkpoint it
    deletes (once each): retention still deletes every object, and only the kept checkpoint is listed."""
    opts, _ = throttled_s3
    root = "s3://ckpts/bulk"
    _save(root, opts, [10, 20], keep_last=None)
    once: set[str] = set()

    def fail_once(key: str) -> bool:
        hit = key.endswith(("/__0_0.distcp", "/.metadata")) and key not in once
        once.add(key)
        return hit

    faults.fail_key = fail_once
    _save(root, opts, [30], keep_last=1)  # its commit runs retention: steps 10 and 20 go
    assert sorted(faults.keys_failed) == sorted(f"bulk/step_0000000{s}/{n}" for s in (10, 20)
                                                for n in (".metadata", "__0_0.distcp"))
    assert [(r.step, r.committed) for r in list_records(root, opts)] == [(30, True)]
    assert _keys(opts, root + "/step_000000010") == [] and _keys(opts, root + "/step_000000020") == []


def test_the_manifest_goes_first_and_a_refused_manifest_delete_keeps_the_checkpoint(throttled_s3, faults):
    """The manifest delete always reaches the store before any other delete of the directory. When it is
    throttled past every retry, nothing else is deleted: the checkpoint stays committed and whole."""
    opts, _ = throttled_s3
    root = "s3://ckpts/order"
    _save(root, opts, [10], keep_last=None)
    step_dir = "ckpts/order/step_000000010"
    before = _keys(opts, root)
    fs = get_fs(root, **{**opts, "config_kwargs": {"retries": {"max_attempts": 1}}})[0]
    fs.retries = 1  # no retry by botocore nor by s3fs: as when throttling outlasts them, without the wait
    faults.passed.clear()
    faults.slow_down = lambda method, path: method == "DELETE" and path.endswith("/manifest.json")
    with pytest.raises(OSError):
        remove_tree(fs, step_dir)
    assert [m for m, p in faults.passed if m in ("DELETE", "DeleteObjects")] == []
    assert _keys(opts, root) == before
    assert [(r.step, r.committed) for r in list_records(root, opts)] == [(10, True)]

    faults.reset()
    faults.slow_down = _first_of(lambda method, path: method == "DELETE", per_path=False)
    remove_tree(get_fs(root, **opts)[0], step_dir)  # throttled once, retried
    deletes = [(m, p) for m, p in faults.passed if m in ("DELETE", "DeleteObjects")]
    assert deletes[0] == ("DELETE", "/" + step_dir + "/manifest.json") and len(faults.throttled) == 1
    assert _keys(opts, root) == [] and list_records(root, opts) == []


def test_restore_from_s3_retries_throttled_reads(throttled_s3, faults):
    """The first GET of the manifest, of ``.metadata`` and of a shard file is answered 503 SlowDown: the restore
    retries them and loads exactly the saved tensors."""
    opts, _ = throttled_s3
    root = "s3://ckpts/restore"
    saved = _save(root, opts, [10])
    faults.slow_down = _first_of(lambda method, path: method == "GET" and path.endswith(
        (".metadata", "__0_0.distcp", "manifest.json")))
    fresh = nn.Linear(8, 8)
    with _manager(root, opts) as m:
        assert m.restore(TrainState(model=fresh, rng=False)).step == 10
    step_dir = "/ckpts/restore/step_000000010/"
    assert sorted(p for _, p in faults.throttled) == [step_dir + n for n in (".metadata", "__0_0.distcp",
                                                                            "manifest.json")]
    assert all(torch.equal(a, b) for a, b in zip(fresh.parameters(), saved[10]))
