"""Signed checkpoints: an HMAC-SHA256 of the manifest, with a key that is never stored in the root.

With a key (``signing_key`` / ``CKPT_SIGNING_KEY``, or ``signing_key_file``)
a save writes ``digests`` into the manifest (the SHA-256 of every sidecar and
of ``.metadata``: the sidecars hold the CRC32C of every DCP item) and a
``signature``: ``hmac.new(key, canonical_json(manifest without signature),
sha256)``. Restore, ``ckpt verify`` and ``ckpt export`` refuse a checkpoint
that is unsigned or signed with another key (``authenticate``); the
``CheckpointVerifier`` of an authenticated manifest checks each small file
against its SHA-256 as well as its CRC32C. Without a key nothing changes.

Only the standard library's ``hmac``/``hashlib`` are used; signatures are
compared with ``hmac.compare_digest``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
from typing import Any, Mapping, Optional

SIGNATURE_FIELD = "signature"
KEY_ENV = "CKPT_SIGNING_KEY"
KEY_FILE_ENV = "CKPT_SIGNING_KEY_FILE"


class SignatureError(ValueError):
    """A checkpoint that a signing key is set for is unsigned, or its signature does not match the key."""


def canonical(body: Mapping[str, Any]) -> bytes:
    """The bytes that are signed: ``body`` (a decoded manifest) without its signature, as canonical JSON."""
    rest = {k: v for k, v in body.items() if k != SIGNATURE_FIELD}
    return json.dumps(rest, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True).encode()


def sign(content: bytes, key: bytes) -> str:
    """HMAC-SHA256 of ``content`` under ``key``, as hex."""
    return hmac.new(key, content, hashlib.sha256).hexdigest()


def sha256_hex(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def same_digest(a: str, b: str) -> bool:
    """Constant-time comparison of two hex digests."""
    return hmac.compare_digest(a.encode("ascii", "replace"), b.encode("ascii", "replace"))


def signed_json(text: str, key: bytes) -> str:
    """Manifest JSON ``text`` with its ``signature`` field added (computed over the rest of it)."""
    body = json.loads(text)
    body[SIGNATURE_FIELD] = sign(canonical(body), key)
    return json.dumps(body, indent=1, sort_keys=True, allow_nan=True)


def authenticate(manifest: Any, key: bytes, where: str = "the checkpoint") -> Any:
    """``manifest`` marked authenticated (its verifier then checks the SHA-256 digests too).

    ``SignatureError`` when it carries no signature or one that ``key`` did not make.
    """
    if manifest.signature is None:
        raise SignatureError(f"{where} is unsigned, and a signing key is set: only checkpoints signed with "
                             "that key are accepted")
    if not same_digest(sign(manifest.signed_content, key), manifest.signature):
        raise SignatureError(f"the signature of {where} does not match the signing key (its manifest was "
                             "changed after signing, or it was signed with another key)")
    return dataclasses.replace(manifest, authenticated=True)


def status(manifest: Any, key: Optional[bytes]) -> str:
    """One line on a manifest's signature, for ``ckpt inspect``."""
    if manifest.signature is None:
        return "no" + (" (REFUSED: a signing key is set)" if key is not None else "")
    if key is None:
        return "yes (not checked: no key)"
    try:
        authenticate(manifest, key)
    except SignatureError:
        return "yes, but the signature DOES NOT MATCH the key (REFUSED)"
    return "yes (signature valid)"


def load_key(key: Optional[str | bytes], key_file: Optional[str], key_name: str = "signing_key",
             file_name: str = "signing_key_file") -> Optional[bytes]:
    """The signing key from its value or its file (trailing newlines dropped); None when neither is given.

    ``SettingError`` when both are given, the file cannot be read, or the key is empty. The key itself never
    appears in a message.
    """
    from .config.errors import SettingError

    if key is not None and key_file is not None:
        raise SettingError(key_name, "***", f"unset when {file_name} is set too (give the key one way)")
    if key_file is not None:
        try:
            with open(os.path.expanduser(key_file), "rb") as f:
                raw = f.read()
        except OSError as e:
            raise SettingError(file_name, key_file, f"a readable file holding the key ({e.strerror})") from None
        key = raw.rstrip(b"\r\n")
        if not key:
            raise SettingError(file_name, key_file, "a file holding a non-empty key")
    if key is None:
        return None
    out = key.encode() if isinstance(key, str) else bytes(key)
    if not out:
        raise SettingError(key_name, "***", "a non-empty key")
    return out


def settings_key(settings: Any) -> Optional[bytes]:
    """The signing key ``CheckpointSettings`` name (``signing_key`` or ``signing_key_file``), or None."""
    return load_key(getattr(settings, "signing_key", None), getattr(settings, "signing_key_file", None))


def env_key(key_file: Optional[str] = None, env: Optional[Mapping[str, str]] = None) -> Optional[bytes]:
    """The key of a ``ckpt`` command: ``--signing-key-file``, ``CKPT_SIGNING_KEY`` or ``CKPT_SIGNING_KEY_FILE``."""
    env = os.environ if env is None else env
    file_name = "--signing-key-file" if key_file is not None else KEY_FILE_ENV
    key_file = key_file if key_file is not None else (env.get(KEY_FILE_ENV) or None)
    return load_key(env.get(KEY_ENV) or None, key_file, KEY_ENV, file_name)
