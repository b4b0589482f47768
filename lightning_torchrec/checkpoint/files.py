"""Writing the files of a sharded checkpoint, one process at a time, and replacing it crash-safely.

Nothing here is collective; :mod:`lightning_torchrec.checkpoint` decides which rank does what and
agrees the verdicts. Checksums are :mod:`~lightning_torchrec.checkpoint.manifest`, reading files
safely :mod:`~lightning_torchrec.checkpoint.folder`, what may be deleted
:mod:`~lightning_torchrec.checkpoint.ownership`.

* **Writes that keep the OS error.** ``torch.save(obj, path)`` turns a full disk into
  ``RuntimeError: basic_ios::clear``; :func:`write_torch_file` serialises into memory and writes
  the bytes itself, so ``ENOSPC`` (or ``EFBIG`` past ``RLIMIT_FSIZE``) reaches the caller.
* **Crash-safe replacement.** :func:`replace_path` swaps a complete new checkpoint with the old one
  in one ``renameat2(RENAME_EXCHANGE)`` system call on Linux, so the name always holds a complete
  checkpoint. Elsewhere (or where the file system refuses the call) it renames twice and
  :func:`recover_replaced` restores the old checkpoint if a crash fell between the renames.
  The replaced checkpoint is deleted only if it is this package's own
  (:func:`~lightning_torchrec.checkpoint.ownership.remove_replaced`).
"""

from __future__ import annotations

import ctypes
import errno
import io
import os
import sys
from pathlib import Path
from typing import Any

import torch

from lightning_torchrec.checkpoint.names import DCP_METADATA, META_FILE
from lightning_torchrec.checkpoint.ownership import owned_files, remove_replaced


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


class _NamedBuffer(io.BytesIO):
    """The in-memory file ``torch.save`` writes into; ``name`` is the file it is for."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def write_torch_file(obj: Any, file: str | Path) -> None:
    """``torch.save`` to a new file, flushed to disk; a refused write raises the OS's error.

    Serialised in memory first (these files are small), then written with ``os.write``: an
    ``OSError`` keeps its errno (``ENOSPC``, ``EFBIG``, ``EDQUOT``), which ``torch.save`` to a
    path or file object would turn into a ``RuntimeError`` without one.

    Args:
        obj: what to save.
        file: the file (must not exist).

    Raises:
        OSError: with the OS's errno when the write is refused.
    """
    buffer = _NamedBuffer(str(file))
    torch.save(obj, buffer)
    view = buffer.getbuffer()
    fd = os.open(file, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o644)
    try:
        done = 0
        while done < len(view):
            done += os.write(fd, view[done:])
        os.fsync(fd)
    finally:
        view.release()
        os.close(fd)


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
    return p.is_dir() and (p / DCP_METADATA).is_file() and (p / META_FILE).is_file()


def recover_replaced(path: str | Path) -> bool:
    """Restores a checkpoint that a crash between the fallback's two renames left aside.

    Only a complete checkpoint of this package's own is moved back (never a user's directory
    that happens to be named ``.{name}.old``).

    Args:
        path: the checkpoint path.

    Returns:
        True when ``path`` was missing and its complete ``.{name}.old`` sibling was moved back.
    """
    path = Path(path)
    old = old_path(path)
    if path.exists() or path.is_symlink() or not looks_complete(old) or old.is_symlink():
        return False
    if owned_files(old) is None:
        return False
    try:
        os.rename(old, path)
    except OSError:
        return path.exists()  # another rank restored it first
    fsync_dir(path.parent)
    return True


def replace_path(src: str | Path, dst: str | Path) -> None:
    """Moves the complete checkpoint ``src`` to ``dst``; ``dst`` never goes missing on Linux.

    With ``dst`` present: one ``renameat2(RENAME_EXCHANGE)`` swaps them atomically, then the old
    checkpoint (now at ``src``) is deleted if it is this package's own (else it stays there,
    with a warning). Without that call: ``dst`` -> ``.{name}.old``, ``src`` -> ``dst``, delete
    the old; a crash between the two renames leaves the old checkpoint at ``.{name}.old``, which
    :func:`recover_replaced` moves back.

    Args:
        src: the new, complete checkpoint (a sibling of ``dst``).
        dst: the checkpoint path.

    Raises:
        FileExistsError: if the fallback is needed and ``.{name}.old`` holds something that is
            not this package's (nothing was moved).
    """
    src, dst = Path(src), Path(dst)
    recover_replaced(dst)
    old = old_path(dst)
    if (old.exists() or old.is_symlink()) and owned_files(old) is not None:
        remove_replaced(old)  # a replaced checkpoint a crash left behind
    if not (dst.exists() or dst.is_symlink()):
        os.rename(src, dst)
    elif exchange(src, dst):
        fsync_dir(dst.parent)
        remove_replaced(src)  # the old checkpoint, now at the temporary name
    else:
        if old.exists() or old.is_symlink():
            raise FileExistsError(
                f"refusing to replace {dst}: {old}, where the old checkpoint is moved while the "
                "new one takes its place, holds something this package did not write. Move it "
                "away."
            )
        os.rename(dst, old)
        os.rename(src, dst)
        fsync_dir(dst.parent)
        remove_replaced(old)
    fsync_dir(dst.parent)
