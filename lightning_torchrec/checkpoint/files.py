"""The files of a sharded checkpoint, one process at a time: checksums and crash-safe replacement.

Nothing here is collective; :mod:`lightning_torchrec.checkpoint` decides which rank does what and
agrees the verdicts. Reading files safely is :mod:`lightning_torchrec.checkpoint.safe_load`.

* **Checksums.** :func:`file_checksum` (CRC-32 and size) of every file is kept in the manifest
  (:data:`MANIFEST_FILE`); :func:`verify_files` finds damaged, truncated or missing files. CRC-32
  detects accidental damage (disk, copy, truncation), not tampering: safety against a malicious
  checkpoint comes from the safe unpickling, not from the checksums.
* **Crash-safe replacement.** :func:`replace_path` swaps a complete new checkpoint with the old one
  in one ``renameat2(RENAME_EXCHANGE)`` system call on Linux, so the name always holds a complete
  checkpoint. Elsewhere (or where the file system refuses the call) it renames twice and
  :func:`recover_replaced` restores the old checkpoint if a crash fell between the renames.
"""

from __future__ import annotations

import ctypes
import errno
import json
import os
import shutil
import sys
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from lightning_torchrec.errors import CheckpointCorruptError

DCP_METADATA = ".metadata"


MANIFEST_FILE = "checksums.json"


#: Written into the manifest; a directory whose manifest names it was written by this package.
WRITER = "lightning_torchrec"


CHECKSUM = "crc32"


_CHUNK = 1 << 22


def fsync_file(file: str | Path) -> None:
    """Flushes a written file to disk.

    Args:
        file: the file.
    """
    fd = os.open(file, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_dir(directory: str | Path) -> None:
    """Flushes a directory's entries (renames, new files) to disk where the OS allows it.

    Args:
        directory: the directory.
    """
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass  # some file systems refuse fsync on directories
    finally:
        os.close(fd)


def file_checksum(file: str | Path) -> dict[str, Any]:
    """CRC-32 and size of a file (read in 4 MiB chunks; about 2.3 GB/s here).

    Args:
        file: the file.

    Returns:
        ``{"crc32": "8 hex digits", "size": bytes}``.
    """
    crc, size = 0, 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(file, "rb") as f:
        while n := f.readinto(buf):
            crc = zlib.crc32(view[:n], crc)
            size += n
    return {CHECKSUM: f"{crc:08x}", "size": size}


def write_manifest(
    directory: str | Path,
    files: dict[str, dict[str, Any]],
    format_version: int,
    world_size: int,
) -> Path:
    """Writes the checksum manifest of a checkpoint directory (flushed to disk).

    Args:
        directory: the checkpoint directory.
        files: ``{file name: file_checksum(...)}``.
        format_version: the checkpoint format version.
        world_size: the world size that wrote it.

    Returns:
        The manifest's path.
    """
    out = Path(directory) / MANIFEST_FILE
    manifest = {
        "writer": WRITER,
        "format_version": format_version,
        "world_size": world_size,
        "checksum": CHECKSUM,
        "files": dict(sorted(files.items())),
    }
    with open(out, "w") as f:
        json.dump(manifest, f, indent=1)
        f.flush()
        os.fsync(f.fileno())
    return out


def read_manifest(directory: str | Path) -> dict[str, Any] | None:
    """Reads a checkpoint's checksum manifest.

    Args:
        directory: the checkpoint directory.

    Returns:
        The manifest, or None when the checkpoint has none (written before format version 2).

    Raises:
        CheckpointCorruptError: if the manifest is damaged.
    """
    file = Path(directory) / MANIFEST_FILE
    if not file.is_file():
        return None
    try:
        manifest = json.loads(file.read_text())
        if not isinstance(manifest.get("files"), dict):
            raise ValueError("no 'files' entry")
        return manifest
    except Exception as err:  # noqa: BLE001 - unreadable JSON: a damaged file
        raise CheckpointCorruptError(f"{file} cannot be read (damaged): {err}") from err


def verify_files(directory: str | Path, manifest: dict[str, Any], names: Iterable[str]) -> None:
    """Checks files of a checkpoint against its manifest.

    Args:
        directory: the checkpoint directory.
        manifest: its manifest (:func:`read_manifest`).
        names: the files to check (names listed in the manifest).

    Raises:
        CheckpointCorruptError: naming every missing, truncated or damaged file.
    """
    directory = Path(directory)
    bad = []
    for name in names:
        expected = manifest["files"][name]
        file = directory / name
        if not file.is_file():
            bad.append(f"{file} is missing")
            continue
        size = file.stat().st_size
        if size != expected.get("size", size):
            bad.append(f"{file} has {size} bytes, {expected['size']} were written (truncated?)")
            continue
        got = file_checksum(file)[CHECKSUM]
        if got != expected.get(CHECKSUM, got):
            bad.append(f"{file} is damaged ({CHECKSUM} {got}, written {expected[CHECKSUM]})")
    if bad:
        raise CheckpointCorruptError(
            "checkpoint files do not match the checksums written with them: "
            + "; ".join(bad)
            + ". Use another checkpoint (or a backup copy of this one)."
        )


#: Set False to always use the two-rename fallback (tests; file systems that misbehave).
USE_RENAME_EXCHANGE = sys.platform.startswith("linux")


RENAME_EXCHANGE = 2  # from <linux/fs.h>


AT_FDCWD = -100  # from <fcntl.h>: paths relative to the working directory


def _renameat2() -> Any:
    # renameat2(2) has been in glibc since 2.28 and in Linux since 3.15; CPython has no wrapper,
    # so it is called through ctypes. None where the C library lacks it (then: fallback).
    try:
        fn = ctypes.CDLL(None, use_errno=True).renameat2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    fn.restype = ctypes.c_int
    return fn


def exchange(a: str | Path, b: str | Path) -> bool:
    """Atomically swaps two existing paths (Linux ``renameat2(..., RENAME_EXCHANGE)``).

    Args:
        a: a path.
        b: another path on the same file system.

    Returns:
        True when swapped; False when the system call is unavailable here (another OS, an old
        kernel or C library, a file system that does not support it).

    Raises:
        OSError: for any other failure of the call.
    """
    fn = _renameat2() if USE_RENAME_EXCHANGE else None
    if fn is None:
        return False
    if fn(AT_FDCWD, os.fsencode(a), AT_FDCWD, os.fsencode(b), RENAME_EXCHANGE) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP):
        return False
    raise OSError(code, os.strerror(code), str(a), None, str(b))


def old_path(path: str | Path) -> Path:
    """Where the two-rename fallback parks the old checkpoint: ``.{name}.old`` beside it.

    Args:
        path: the checkpoint path.

    Returns:
        The sibling path.
    """
    p = Path(path)
    return p.parent / f".{p.name}.old"


def looks_complete(path: str | Path) -> bool:
    """Whether ``path`` is a directory holding DCP metadata and ``meta.pt`` (written last).

    Args:
        path: a path.

    Returns:
        True for a complete checkpoint directory.
    """
    p = Path(path)
    return p.is_dir() and (p / DCP_METADATA).is_file() and (p / "meta.pt").is_file()


def recover_replaced(path: str | Path) -> bool:
    """Restores a checkpoint that a crash between the fallback's two renames left aside.

    Args:
        path: the checkpoint path.

    Returns:
        True when ``path`` was missing and its complete ``.{name}.old`` sibling was moved back.
    """
    path = Path(path)
    old = old_path(path)
    if path.exists() or path.is_symlink() or not looks_complete(old):
        return False
    try:
        os.rename(old, path)
    except OSError:
        return path.exists()  # another rank restored it first
    fsync_dir(path.parent)
    return True


def remove_path(path: str | Path) -> None:
    """Deletes a file or a directory tree, if it exists.

    Args:
        path: the path.
    """
    p = Path(path)
    if p.is_dir() and not p.is_symlink():
        shutil.rmtree(p)
    elif p.exists() or p.is_symlink():
        p.unlink()


def replace_path(src: str | Path, dst: str | Path) -> None:
    """Moves the complete checkpoint ``src`` to ``dst``; ``dst`` never goes missing on Linux.

    With ``dst`` present: one ``renameat2(RENAME_EXCHANGE)`` swaps them atomically, then the old
    checkpoint (now at ``src``) is deleted. Without that call: ``dst`` -> ``.{name}.old``,
    ``src`` -> ``dst``, delete the old; a crash between the two renames leaves the old checkpoint
    at ``.{name}.old``, which :func:`recover_replaced` moves back.

    Args:
        src: the new, complete checkpoint (a sibling of ``dst``).
        dst: the checkpoint path.
    """
    src, dst = Path(src), Path(dst)
    recover_replaced(dst)
    old = old_path(dst)
    if old.exists() or old.is_symlink():
        remove_path(old)
    if not (dst.exists() or dst.is_symlink()):
        os.rename(src, dst)
    elif exchange(src, dst):
        fsync_dir(dst.parent)
        remove_path(src)  # the old checkpoint, now at the temporary name
    else:
        os.rename(dst, old)
        os.rename(src, dst)
        fsync_dir(dst.parent)
        remove_path(old)
    fsync_dir(dst.parent)
