"""Signed manifests: an HMAC-SHA256 key so a team can refuse checkpoints it did not write.

CRC-32 (the manifest's checksum) finds accidental damage; anyone can write a manifest that
matches files they changed. With a key, a save adds the SHA-256 of every file to the manifest
and signs the manifest with HMAC-SHA256; a load with the key refuses a checkpoint that is
unsigned, signed with another key, or whose files do not match their SHA-256 (checked before any
of them is parsed). The key is a shared secret: whoever holds it can sign.

The key comes from, first match wins: the ``key`` argument (``TorchRecStrategy(checkpoint_key=
...)``, ``load_sharded(..., key=...)``, the command lines' ``--key-file``), else the file named by
the environment variable :data:`KEY_FILE_ENV`. Without either, checkpoints are neither signed nor
required to be.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
from pathlib import Path
from typing import Any

from lightning_torchrec.errors import CheckpointSignatureError

#: Names a file holding the key; used when no key is passed.
KEY_FILE_ENV = "LIGHTNING_TORCHREC_CHECKPOINT_KEY_FILE"


#: The manifest entry holding the signature.
SIGNATURE = "signature"


ALGORITHM = "hmac-sha256"


#: The shortest key accepted (bytes): shorter keys can be guessed.
MIN_KEY_BYTES = 16


def _check_key(key: bytes, where: str) -> bytes:
    if len(key) < MIN_KEY_BYTES:
        raise ValueError(
            f"the checkpoint key from {where} has {len(key)} bytes; use at least "
            f"{MIN_KEY_BYTES} random bytes (e.g. `python -c 'import secrets; "
            "print(secrets.token_hex(32))' > key`)"
        )
    return key


def read_key_file(path: str | Path) -> bytes:
    """Reads a checkpoint key from a file (its bytes, surrounding whitespace stripped).

    Args:
        path: the key file.

    Returns:
        The key.

    Raises:
        FileNotFoundError: if the file is missing.
        ValueError: if the key is shorter than :data:`MIN_KEY_BYTES`.
    """
    return _check_key(Path(path).read_bytes().strip(), str(path))


def resolve_key(key: bytes | str | None) -> bytes | None:
    """The key in force: ``key`` if given, else the file named by :data:`KEY_FILE_ENV`.

    Args:
        key: an explicit key (a ``str`` is encoded as UTF-8), or None.

    Returns:
        The key, or None when checkpoints are not signed.

    Raises:
        ValueError: for a key shorter than :data:`MIN_KEY_BYTES`.
    """
    if key is not None:
        return _check_key(key.encode() if isinstance(key, str) else bytes(key), "the argument")
    env = os.environ.get(KEY_FILE_ENV)
    return read_key_file(env) if env else None


def _payload(manifest: dict[str, Any]) -> bytes:
    unsigned = {k: v for k, v in manifest.items() if k != SIGNATURE}
    return json.dumps(unsigned, sort_keys=True, separators=(",", ":")).encode()


def sign(manifest: dict[str, Any], key: bytes) -> dict[str, Any]:
    """The manifest with its HMAC-SHA256 signature (over everything else in it).

    Args:
        manifest: the manifest (its entries must carry ``sha256``).
        key: the key.

    Returns:
        A copy with ``"signature": {"alg": "hmac-sha256", "mac": hex}``.
    """
    mac = hmac.new(key, _payload(manifest), hashlib.sha256).hexdigest()
    return {**manifest, SIGNATURE: {"alg": ALGORITHM, "mac": mac}}


def check_signature(manifest: dict[str, Any] | None, key: bytes, where: Path) -> None:
    """Refuses a manifest that is missing, unsigned or signed with another key.

    Args:
        manifest: the checkpoint's manifest (None: it has none).
        key: the key in force.
        where: the checkpoint, for the message.

    Raises:
        CheckpointSignatureError: naming the checkpoint and what is wrong.
    """
    fix = (
        "A checkpoint key is set (TorchRecStrategy(checkpoint_key=...), --key-file or "
        f"{KEY_FILE_ENV}), so only checkpoints signed with it are loaded."
    )
    if manifest is None:
        raise CheckpointSignatureError(f"Refusing to load {where}: it has no manifest. {fix}")
    sig = manifest.get(SIGNATURE)
    if not isinstance(sig, dict) or sig.get("alg") != ALGORITHM:
        raise CheckpointSignatureError(f"Refusing to load {where}: it is not signed. {fix}")
    expected = hmac.new(key, _payload(manifest), hashlib.sha256).hexdigest()
    mac = sig.get("mac")
    # compare_digest raises TypeError for a str with non-ASCII characters: compare bytes.
    if not isinstance(mac, str) or not hmac.compare_digest(
        mac.encode("utf-8", "surrogatepass"), expected.encode()
    ):
        raise CheckpointSignatureError(
            f"Refusing to load {where}: its manifest's signature does not match the key (signed "
            f"with another key, or changed after signing). {fix}"
        )
    unsigned = [n for n, e in manifest["files"].items() if "sha256" not in e]
    if unsigned:
        raise CheckpointSignatureError(
            f"Refusing to load {where}: files without a SHA-256 in its signed manifest: "
            f"{sorted(unsigned)[:5]}"
        )
