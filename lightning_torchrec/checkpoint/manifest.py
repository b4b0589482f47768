"""The checksum manifest of a checkpoint (``checksums.json``): written, read, checked.

:func:`file_checksum` (CRC-32 and size, plus SHA-256 when the checkpoint is signed) of every file
is kept in the manifest (:data:`MANIFEST_FILE`); :func:`verify_files` finds damaged, truncated or
missing files, and :func:`check_bytes` checks a file already read into memory, so that what is
parsed is exactly what was verified. CRC-32 detects accidental damage (disk, copy, truncation),
not tampering: anyone can write a manifest that matches files they changed. Authenticity needs a
signed manifest (:mod:`lightning_torchrec.checkpoint.signing`).

A manifest read from disk is checked before it is used: a JSON object, its file names plain
names inside the folder, its sizes non-negative integers and its checksums hex digests.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_torchrec.checkpoint.limits import DEFAULT_LIMITS, CheckpointLimits
from lightning_torchrec.checkpoint.paths import is_plain_name, open_stream, read_capped
from lightning_torchrec.checkpoint.signing import sign
from lightning_torchrec.errors import CheckpointCorruptError

MANIFEST_FILE = "checksums.json"


#: Written into the manifest; a directory whose manifest names it was written by this package.
WRITER = "lightning_torchrec"


CHECKSUM = "crc32"


STRONG = "sha256"


_CHUNK = 1 << 22


_HEX = {CHECKSUM: re.compile(r"[0-9a-f]{8}"), STRONG: re.compile(r"[0-9a-f]{64}")}


class _Sums:
    def __init__(self, strong: bool) -> None:
        self.crc, self.size = 0, 0
        self.sha = hashlib.sha256() if strong else None

    def update(self, data: Any) -> None:
        self.crc = zlib.crc32(data, self.crc)
        self.size += len(data)
        if self.sha is not None:
            self.sha.update(data)

    def result(self) -> dict[str, Any]:
        out: dict[str, Any] = {CHECKSUM: f"{self.crc:08x}", "size": self.size}
        if self.sha is not None:
            out[STRONG] = self.sha.hexdigest()
        return out


def _stream_sums(f: Any, strong: bool) -> dict[str, Any]:
    sums = _Sums(strong)
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    while n := f.readinto(buf):
        sums.update(view[:n])
    return sums.result()


def file_checksum(file: str | Path, strong: bool = False) -> dict[str, Any]:
    """CRC-32 and size of a file (read in 4 MiB chunks; about 2.3 GB/s here).

    Args:
        file: the file.
        strong: add its SHA-256 (for signed manifests; about 1.3 GB/s).

    Returns:
        ``{"crc32": "8 hex digits", "size": bytes}`` (and ``"sha256"``).
    """
    with open(file, "rb") as f:
        return _stream_sums(f, strong)


def bytes_checksum(data: bytes, strong: bool = False) -> dict[str, Any]:
    """:func:`file_checksum` of bytes in memory.

    Args:
        data: the bytes.
        strong: add their SHA-256.

    Returns:
        The checksum entry.
    """
    sums = _Sums(strong)
    sums.update(data)
    return sums.result()


def write_manifest(
    directory: str | Path,
    files: dict[str, dict[str, Any]],
    format_version: int,
    world_size: int,
    *,
    token: str | None = None,
    key: bytes | None = None,
) -> Path:
    """Writes the checksum manifest of a checkpoint directory (flushed to disk).

    Args:
        directory: the checkpoint directory.
        files: ``{file name: file_checksum(...)}``.
        format_version: the checkpoint format version.
        world_size: the world size that wrote it.
        token: the save's random token (also in ``meta.pt``): marks the folder as this
            package's own (see :mod:`lightning_torchrec.checkpoint.ownership`).
        key: sign the manifest with this HMAC key (entries must carry ``sha256``).

    Returns:
        The manifest's path.
    """
    out = Path(directory) / MANIFEST_FILE
    manifest: dict[str, Any] = {
        "writer": WRITER,
        "format_version": format_version,
        "world_size": world_size,
        "checksum": CHECKSUM,
        "files": dict(sorted(files.items())),
    }
    if token is not None:
        manifest["save_token"] = token
    if key is not None:
        manifest = sign(manifest, key)
    with open(out, "x") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return out


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _problem(manifest: Any) -> str | None:
    """What makes a parsed manifest unusable, or None."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "no 'files' entry"
    for key in ("writer", "save_token", "checksum"):
        if key in manifest and not isinstance(manifest[key], str):
            return f"'{key}' is not a string"
    for key in ("format_version", "world_size"):
        if key in manifest and not _is_count(manifest[key]):
            return f"'{key}' is not a non-negative integer"
    for name, entry in manifest["files"].items():
        if not is_plain_name(name) or name == MANIFEST_FILE:
            return f"it lists {name!r}, which is not a plain file name inside the folder"
        if not isinstance(entry, dict) or not _is_count(entry.get("size")):
            return f"the entry of {name!r} has no valid size"
        for kind, pattern in _HEX.items():
            value = entry.get(kind)
            if (kind == CHECKSUM or value is not None) and not (
                isinstance(value, str) and pattern.fullmatch(value)
            ):
                return f"the entry of {name!r} has no valid {kind}"
    return None


def read_manifest(
    directory: str | Path, limits: CheckpointLimits = DEFAULT_LIMITS
) -> dict[str, Any] | None:
    """Reads and checks a checkpoint's checksum manifest.

    Args:
        directory: the checkpoint directory.
        limits: the size cap of the manifest.

    Returns:
        The manifest, or None when the checkpoint has none (written before format version 2).

    Raises:
        CheckpointCorruptError: if the manifest is damaged or malformed, naming it.
        UnsafeCheckpointError: if it is not a regular file inside the folder.
        CheckpointLimitError: if it is larger than the limit.
    """
    directory = Path(directory)
    file = directory / MANIFEST_FILE
    if not (file.exists() or file.is_symlink()):
        return None
    data = read_capped(directory, MANIFEST_FILE, limits.max_manifest_bytes)
    try:
        manifest = json.loads(data)
    except Exception as err:  # noqa: BLE001 - unreadable JSON (or too deep): a damaged file
        raise CheckpointCorruptError(f"{file} cannot be read (damaged): {err}") from err
    problem = _problem(manifest)
    if problem is not None:
        raise CheckpointCorruptError(f"{file} cannot be used (damaged or not ours): {problem}")
    return manifest


def check_bytes(file: Path, data: bytes, entry: dict[str, Any], strong: bool) -> str | None:
    """How bytes read from ``file`` differ from its manifest entry, or None when they match.

    Args:
        file: the file, for the message.
        data: its bytes.
        entry: its manifest entry.
        strong: compare the SHA-256 too (signed manifests).

    Returns:
        The problem, or None.
    """
    if len(data) != entry["size"]:
        return f"{file} has {len(data)} bytes, {entry['size']} were written (truncated?)"
    got = bytes_checksum(data, strong)
    return _mismatch(file, got, entry, strong)


def _mismatch(file: Path, got: dict[str, Any], entry: dict[str, Any], strong: bool) -> str | None:
    for kind in (CHECKSUM, STRONG) if strong else (CHECKSUM,):
        if got[kind] != entry.get(kind):
            return f"{file} is damaged ({kind} {got[kind][:16]}, written {entry.get(kind)})"
    return None


def verify_files(
    directory: str | Path,
    manifest: dict[str, Any],
    names: Iterable[str],
    *,
    strong: bool = False,
) -> None:
    """Checks files of a checkpoint against its manifest (each opened as a regular file).

    Args:
        directory: the checkpoint directory.
        manifest: its manifest (:func:`read_manifest`).
        names: the files to check (names listed in the manifest).
        strong: compare SHA-256 too (signed manifests).

    Raises:
        CheckpointCorruptError: naming every missing, truncated or damaged file.
        UnsafeCheckpointError: for a file that is not a regular file inside the folder.
    """
    directory = Path(directory)
    bad = []
    for name in names:
        expected = manifest["files"][name]
        file = directory / name
        try:
            f = open_stream(directory, name, str(directory / MANIFEST_FILE))
        except CheckpointCorruptError:
            bad.append(f"{file} is missing")
            continue
        with f:
            size = os.fstat(f.fileno()).st_size
            if size != expected["size"]:
                bad.append(f"{file} has {size} bytes, {expected['size']} were written (truncated?)")
                continue
            problem = _mismatch(file, _stream_sums(f, strong), expected, strong)
        if problem is not None:
            bad.append(problem)
    if bad:
        raise CheckpointCorruptError(
            "checkpoint files do not match the checksums written with them: "
            + "; ".join(bad)
            + ". Use another checkpoint (or a backup copy of this one)."
        )
