"""What a save may delete: only what this package made, proven rather than claimed.

A folder is this package's checkpoint (:func:`owned_files`) only when **everything** in it is a
file a save wrote:

- with a manifest naming this package: every entry of the folder is a regular file the manifest
  lists, and the save's random token (``save_token``) is recorded on both sides, in the manifest
  and in ``meta.pt``: a manifest copied into someone's folder, or files added to a checkpoint
  folder later, do not qualify;
- without a token (format 2 written before tokens) or without a manifest (format 1): every file
  has one of the names a save writes (:data:`~lightning_torchrec.checkpoint.names.OUR_FILES`)
  and ``meta.pt`` carries the package's entry.

Deleting such a folder (:func:`remove_owned`) removes exactly those files, then the (then
empty) directory: a file that appears meanwhile makes the directory stay. A folder holding
anything else is never deleted; a save refuses to replace it (``FileExistsError``).

The partial directory of a save is named ``.{name}.partial-{token}`` and recorded by this process
(:func:`make_partial`), so a user's ``.{name}.partial`` is never touched and a failed save removes
only the directory it created.
"""

from __future__ import annotations

import glob
import os
import secrets
import shutil
import warnings
from pathlib import Path

from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, WRITER, read_manifest
from lightning_torchrec.checkpoint.names import META_FILE, OUR_FILES, PACKAGE_KEY
from lightning_torchrec.checkpoint.torch_files import pickled_strings, single_file_checkpoint_kind
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    UnsafeCheckpointError,
)

_PARTIAL = ".partial-"


#: This process's record of the partial directories it created: path -> (device, inode).
_MADE: dict[str, tuple[int, int]] = {}


def owned_files(path: str | Path) -> list[str] | None:
    """The files of a directory, when all of them were written by a save of this package.

    Args:
        path: a directory.

    Returns:
        The file names (empty for an empty directory), or None when the directory holds
        anything this package did not write (or is not a readable directory).
    """
    p = Path(path)
    try:
        entries = list(os.scandir(p))
    except OSError:
        return None
    if any(not e.is_file(follow_symlinks=False) for e in entries):
        return None  # a subdirectory, symlink, FIFO...: never ours
    names = sorted(e.name for e in entries)
    if not names:
        return names
    try:
        manifest = read_manifest(p)
    except (CheckpointCorruptError, UnsafeCheckpointError, CheckpointLimitError):
        return None
    strings = pickled_strings(p / META_FILE) or set()
    if manifest is not None:
        listed = set(manifest["files"]) | {MANIFEST_FILE}
        if manifest.get("writer") != WRITER or not set(names) <= listed:
            return None
        token = manifest.get("save_token")
        if token is not None:
            return names if token in strings else None
    patterned = all(OUR_FILES.fullmatch(n) for n in names if n != MANIFEST_FILE)
    return names if patterned and PACKAGE_KEY in strings else None


def is_replaceable(path: str | Path) -> bool:
    """Whether a save may replace what is at ``path`` (and so delete it).

    Args:
        path: the checkpoint path.

    Returns:
        True when nothing is there, or it is this package's checkpoint or an empty directory
        (:func:`owned_files`), a Lightning single-file checkpoint, or a symlink to one of those
        (only the link is removed).
    """
    p = Path(path)
    if not (p.exists() or p.is_symlink()):
        return True
    if p.is_dir():
        return owned_files(p) is not None
    return p.is_file() and single_file_checkpoint_kind(p) == "lightning"


def foreign_entries(path: str | Path) -> list[str]:
    """The entries of a directory that make it not this package's own, for messages.

    Args:
        path: a directory.

    Returns:
        Up to 5 names (all entries when the manifest or ``meta.pt`` does not prove ownership).
    """
    p = Path(path)
    try:
        manifest = read_manifest(p)
        listed = set(manifest["files"]) | {MANIFEST_FILE} if manifest else set()
    except (CheckpointCorruptError, UnsafeCheckpointError, CheckpointLimitError):
        listed = set()
    try:
        names = sorted(e.name for e in os.scandir(p))
    except OSError:
        return []
    foreign = [n for n in names if n not in listed and not OUR_FILES.fullmatch(n)]
    return (foreign or names)[:5]


def remove_owned(path: str | Path) -> bool:
    """Deletes a checkpoint directory of this package: its own files, then the directory.

    Args:
        path: the directory.

    Returns:
        True when it is gone; False when it was kept because it holds something else (warned).
    """
    p = Path(path)
    names = owned_files(p)
    if names is None:
        foreign = foreign_entries(p)
        warnings.warn(
            f"{p} was not deleted: it holds files this package did not write: {foreign}",
            UserWarning,
            stacklevel=2,
        )
        return False
    for name in names:
        try:
            (p / name).unlink()
        except FileNotFoundError:
            pass
    try:
        p.rmdir()
    except OSError:
        warnings.warn(f"{p} was kept: files appeared in it while it was deleted", UserWarning, 2)
        return False
    return True


def remove_replaced(path: str | Path) -> bool:
    """Deletes what a save replaced, or what a ``ModelCheckpoint`` retires, if it is ours.

    A symlink is removed itself (its target is not touched), a Lightning single-file checkpoint
    is unlinked, a directory goes through :func:`remove_owned`; anything else is kept.

    Args:
        path: the path.

    Returns:
        True when it is gone (or was already missing).
    """
    p = Path(path)
    if p.is_symlink():
        p.unlink()
        return True
    if not p.exists():
        return True
    if p.is_dir():
        return remove_owned(p)
    if p.is_file() and single_file_checkpoint_kind(p) == "lightning":
        p.unlink()
        return True
    warnings.warn(f"{p} was not deleted: it is not a checkpoint", UserWarning, stacklevel=2)
    return False


def make_partial(path: str | Path) -> tuple[Path, str]:
    """Creates the partial directory a save of ``path`` writes into, with a fresh token.

    Complete checkpoints that interrupted saves left at ``.{name}.partial-*`` (proven ours by
    their manifest and token) are deleted first; anything else there is only named in a warning.

    Args:
        path: the checkpoint path.

    Returns:
        ``(directory, token)``: ``.{name}.partial-{token}`` beside ``path``, created by this call.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in sorted(path.parent.glob(glob.escape(f".{path.name}{_PARTIAL}") + "*")):
        if str(stale) in _MADE and remove_partial(stale):
            continue  # this process made it; a save here was interrupted
        if (stale / MANIFEST_FILE).is_file() and owned_files(stale) is not None:
            remove_owned(stale)  # a complete checkpoint an interrupted replacement left
            continue
        warnings.warn(
            f"{stale} was left by an interrupted save (or is not this package's); it is "
            "not deleted. Delete it when no save of this checkpoint is running.",
            UserWarning,
            stacklevel=2,
        )
    token = secrets.token_hex(16)
    tmp = path.parent / f".{path.name}{_PARTIAL}{token}"
    tmp.mkdir()
    info = tmp.stat()
    _MADE[str(tmp)] = (info.st_dev, info.st_ino)
    return tmp, token


def remove_partial(tmp: str | Path) -> bool:
    """Deletes a partial directory this process created (:func:`make_partial`), nothing else.

    Args:
        tmp: the partial directory.

    Returns:
        True when it was deleted (or is gone).
    """
    tmp = Path(tmp)
    made = _MADE.pop(str(tmp), None)
    try:
        info = tmp.stat(follow_symlinks=False)
    except OSError:
        return True
    if made == (info.st_dev, info.st_ino) and tmp.is_dir() and not tmp.is_symlink():
        shutil.rmtree(tmp)
        return True
    return False


def forget_partial(tmp: str | Path) -> None:
    """Drops a partial directory from the record once it became the checkpoint.

    Args:
        tmp: the partial directory (renamed away).
    """
    _MADE.pop(str(tmp), None)
