"""Hostile checkpoint files for the integrity tests: malicious pickles, forged checksums, damaged manifests.

A *forger* has write access to the bucket: after replacing a file it
recomputes every checksum the manifest and sidecars hold, so only the
allowlist unpickler and ``weights_only`` stand between the file and the
restore. Each payload that could run code would create ``marker``.
"""

from __future__ import annotations

import io
import json
import os
import pickle
import struct
from pathlib import Path
from typing import Callable

import crc32c

from ckpt_core.sidecar import parse_sidecar, sidecar_for


def _str(s: str) -> bytes:
    b = s.encode()
    return pickle.SHORT_BINUNICODE + bytes([len(b)]) + b if len(b) < 256 else pickle.BINUNICODE + struct.pack(
        "<I", len(b)) + b


def _stack_global(module: str, name: str) -> bytes:
    return _str(module) + _str(name) + pickle.STACK_GLOBAL


def _global(module: str, name: str) -> bytes:
    return pickle.GLOBAL + f"{module}\n{name}\n".encode()


def _call(fn: bytes, *args: str) -> bytes:
    """``fn(*args)`` left on the stack (REDUCE)."""
    return fn + pickle.MARK + b"".join(_str(a) for a in args) + pickle.TUPLE + pickle.REDUCE


def _touch(marker: Path) -> str:
    return f"touch {marker}"


def metadata_payloads(marker: Path) -> dict[str, Callable[[bytes], bytes]]:
    """Ways to run code from a ``.metadata``; each takes the real metadata and returns the hostile file.

    The ``+real`` variants run the payload and then unpickle the real metadata,
    so a loader that runs the payload would still get a working checkpoint.
    """
    cmd = _touch(marker)

    def then_real(ops: bytes, proto: int = 4) -> Callable[[bytes], bytes]:
        return lambda real: pickle.PROTO + bytes([proto]) + ops + pickle.POP + real[2:]

    class Reduce:
        def __reduce__(self):
            return (os.system, (cmd,))

    class Popen:
        def __reduce__(self):
            import subprocess

            return (subprocess.Popen, (["touch", str(marker)],))

    out: dict[str, Callable[[bytes], bytes]] = {
        f"reduce-os.system-protocol{p}": (lambda real, p=p: pickle.dumps(Reduce(), protocol=p)) for p in range(0, 6)
    }
    out.update({
        "reduce-subprocess.Popen": lambda real: pickle.dumps(Popen(), protocol=4),
        "dotted-name-via-dcp-filesystem+real": then_real(
            _call(_stack_global("torch.distributed.checkpoint.filesystem", "os.system"), cmd)),
        "dotted-name-via-dcp-metadata+real": then_real(
            _call(_stack_global("torch.distributed.checkpoint.metadata", "torch.os.system"), cmd), proto=5),
        "dotted-name-via-allowed-class+real": then_real(
            _call(_stack_global("torch.distributed.checkpoint.metadata", "Metadata.__init__.__globals__"))),
        "prefix-of-allowed-module+real": then_real(
            _call(_stack_global("torch.distributed.checkpoint.filesystem_x", "system"), cmd)),
        "allowed-module-other-function+real": then_real(
            _call(_stack_global("torch.distributed.checkpoint.filesystem", "_generate_uuid"))),
        "global-opcode-posix.system-protocol2+real": then_real(_call(_global("posix", "system"), cmd), proto=2),
        "builtins.eval+real": then_real(_call(_stack_global("builtins", "eval"),
                                              f"__import__('os').system({cmd!r})")),
        "builtins.exec+real": then_real(_call(_stack_global("builtins", "exec"),
                                              f"__import__('os').system({cmd!r})")),
        "builtins.getattr+real": then_real(_call(_stack_global("builtins", "getattr"), "x", "y")),
        "torch.load-nested+real": then_real(_call(_stack_global("torch", "load"), "/dev/null")),
        "rebuild-tensor+real": then_real(_call(_stack_global("torch._utils", "_rebuild_tensor_v2"))),
        "inst-opcode-protocol0": lambda real: b"(S'" + cmd.encode() + b"'\nios\nsystem\n.",
        "obj-opcode-protocol1": lambda real: b"(cos\nsystem\nS'" + cmd.encode() + b"'\no.",
        "newobj-ex-protocol4": lambda real: (pickle.PROTO + b"\x04" + _stack_global("subprocess", "Popen")
                                             + _str("x") + pickle.TUPLE1 + pickle.EMPTY_DICT + pickle.NEWOBJ_EX
                                             + pickle.STOP),
        "build-on-allowed-class+real": then_real(
            _stack_global("torch.distributed.checkpoint.metadata", "Metadata") + pickle.NONE
            + pickle.EMPTY_DICT + _str("__hostile__") + _str("set") + pickle.SETITEM + pickle.TUPLE2
            + pickle.BUILD),
        "persistent-id": lambda real: pickle.PROTO + b"\x02" + _str("x") + pickle.BINPERSID + pickle.STOP,
        "extension-code": lambda real: pickle.PROTO + b"\x02" + pickle.EXT1 + b"\x07" + pickle.STOP,
        "not-metadata-a-list": lambda real: pickle.dumps([1, 2, 3]),
        "truncated": lambda real: real[: len(real) // 2],
        "random-bytes": lambda real: os.urandom(len(real)),
        "empty": lambda real: b"",
        "deeply-nested-lists": lambda real: (pickle.PROTO + b"\x04" + (pickle.EMPTY_LIST + pickle.MARK) * 100_000
                                             + (pickle.APPENDS) * 100_000 + pickle.STOP),
    })
    return out


def torch_save_payload(marker: Path) -> bytes:
    """A ``torch.save`` file whose pickle runs ``touch marker`` on a full (non ``weights_only``) load."""
    import torch

    class Reduce:
        def __reduce__(self):
            return (os.system, (_touch(marker),))

    buf = io.BytesIO()
    torch.save(Reduce(), buf)
    return buf.getvalue()


# ------------------------------------------------------------------ forging
def _manifest(ckpt: Path) -> dict:
    return json.loads((ckpt / "manifest.json").read_text())


def _write_manifest(ckpt: Path, body: dict) -> None:
    (ckpt / "manifest.json").write_text(json.dumps(body))


def forge_file(ckpt: Path, name: str, data: bytes) -> None:
    """Replace small file ``name`` (``.metadata``, a sidecar) and fix its entry in the manifest."""
    (ckpt / name).write_bytes(data)
    body = _manifest(ckpt)
    body["files"][name] = {"size": len(data), "crc32c": crc32c.crc32c(data)}
    _write_manifest(ckpt, body)


def forge_item(ckpt: Path, name: str, offset: int, length: int, data: bytes) -> None:
    """Overwrite one DCP item of shard ``name`` in place (``data`` padded to its length) and re-sign every checksum."""
    assert len(data) <= length, (len(data), length)
    data = data + b"\0" * (length - len(data))
    shard = bytearray((ckpt / name).read_bytes())
    shard[offset:offset + length] = data
    (ckpt / name).write_bytes(bytes(shard))
    side_name = sidecar_for(name)
    side = json.loads((ckpt / side_name).read_text())
    side["files"][name] = [len(shard), crc32c.crc32c(bytes(shard))]
    side["items"][name] = [[o, n, crc32c.crc32c(bytes(shard[o:o + n])) if o == offset else c]
                           for o, n, c in side["items"][name]]
    raw = json.dumps(side).encode()
    parse_sidecar(raw)  # still well-formed
    (ckpt / side_name).write_bytes(raw)
    body = _manifest(ckpt)
    body["files"][name] = {"size": len(shard), "crc32c": crc32c.crc32c(bytes(shard))}
    body["files"][side_name] = {"size": len(raw), "crc32c": crc32c.crc32c(raw)}
    _write_manifest(ckpt, body)


def item_of(ckpt: Path, fqn: str) -> tuple[str, int, int]:
    """(file, offset, length) of the DCP item holding ``fqn`` (the first chunk)."""
    from ckpt_core.dcp_io import read_metadata

    md = read_metadata(str(ckpt))
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            return os.path.basename(str(info.relative_path)), info.offset, info.length
    raise KeyError(fqn)


def set_manifest_fields(ckpt: Path, raw_fields: dict[str, str]) -> None:
    """Set manifest fields to raw JSON text (``1e999``, ``NaN``...) that ``json.dumps`` would not write."""
    body = _manifest(ckpt)
    for k in raw_fields:
        body[k] = f"@@{k}@@"
    text = json.dumps(body)
    for k, raw in raw_fields.items():
        text = text.replace(f'"@@{k}@@"', raw)
    (ckpt / "manifest.json").write_text(text)
