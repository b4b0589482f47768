"""Opening a file of a checkpoint folder: a plain name inside it, a regular file, nothing else.

A checkpoint directory from a stranger names files in three places: DCP's ``.metadata`` (the
file of every chunk), the manifest, and this package's fixed names. Every file a load opens goes
through :func:`open_regular`:

- the name is a plain file name (no ``/``, not ``.``/``..``, not empty, no NUL): nothing outside
  the folder can be named, absolute paths and ``../`` included;
- a symbolic link is followed only when it resolves to a file inside the folder;
- the file is regular: a FIFO would block the reader forever, a device could be anything. The
  file is opened without blocking and without following a last-moment symlink, and the opened
  descriptor is checked to be the file that was examined.
"""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path
from typing import Any, BinaryIO

from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    UnsafeCheckpointError,
)

_OPEN_FLAGS = (
    os.O_RDONLY
    | getattr(os, "O_NONBLOCK", 0)
    | getattr(os, "O_NOFOLLOW", 0)
    | getattr(os, "O_CLOEXEC", 0)
)


#: A URL's scheme as fsspec (and so Lightning's ``ModelCheckpoint``) reads a path: ``s3://...``.
_URL = re.compile(r"([A-Za-z][A-Za-z0-9+.-]*)://")
#: fsspec's schemes for the local file system, whose paths follow the ``://``.
_LOCAL_SCHEMES = ("file", "local")
#: What those schemes become as a directory when their URL is read as a path: ``file:``.
_LOCAL_DIRS = frozenset(f"{scheme}:" for scheme in _LOCAL_SCHEMES)


def local_path(path: str | os.PathLike[str]) -> Path:
    """A checkpoint path on this machine's file system (a local disk or a mount).

    Lightning accepts fsspec URLs where it takes a checkpoint path (``ModelCheckpoint(dirpath=
    "s3://bucket/run")``, ``trainer.save_checkpoint("file:///ckpts/a.ckpt")``); read as a plain
    path, ``s3://bucket/run`` is the relative directory ``s3:/bucket/run`` of the current
    directory, where the checkpoint would go unnoticed. A ``file://`` (or ``local://``) URL is
    the local path after the ``://``, as fsspec reads it.

    Args:
        path: a path or a URL.

    Returns:
        The local path.

    Raises:
        ValueError: for a URL of another file system, naming it: sharded checkpoints are written
            by every rank through the local file system; and for a path holding a directory
            ``file:`` (``local:``), a ``file://`` URL read as a path (see
            :func:`refuse_url_read_as_path`).
    """
    text = os.fspath(path)
    match = _URL.match(text)
    if match is None:
        refuse_url_read_as_path(text)
        return Path(text)
    if match.group(1).lower() in _LOCAL_SCHEMES:
        return Path(text[match.end() :])
    raise ValueError(
        f"{text} is a {match.group(1)}:// URL; sharded checkpoints are read and written by every "
        "rank through the local file system (torch.distributed.checkpoint's FileSystemWriter). "
        "Use a local path, or a path where that storage is mounted on every node (and copy the "
        "directory there after the run if it cannot be mounted)."
    )


def refuse_url_read_as_path(path: str) -> None:
    """Refuses a path that is a ``file://`` URL read as a plain path.

    Lightning's ``ModelCheckpoint`` passes a ``file://`` ``dirpath`` through
    ``os.path.realpath``: ``file:///ckpts`` becomes the directory ``file:/ckpts`` below the
    current one, where every checkpoint would then go. The scheme's ``//`` collapses, so
    ``file:///ckpts`` and ``file://ckpts`` give the same path and the one meant cannot be told.

    Args:
        path: a path (not a URL).

    Raises:
        ValueError: if a directory of ``path`` is named ``file:`` or ``local:``, naming it.
    """
    scheme = next((p for p in Path(path).parts if p.lower() in _LOCAL_DIRS), None)
    if scheme is not None:
        raise ValueError(
            f"{path} holds a directory named {scheme!r}: a {scheme}// URL read as a plain path "
            "(Lightning's ModelCheckpoint makes dirpath='file:///ckpts' the directory "
            "'./file:/ckpts'). Pass the local path itself, e.g. dirpath='/ckpts'."
        )


def is_plain_name(name: Any) -> bool:
    """Whether ``name`` names a file directly inside a folder.

    Args:
        name: a candidate file name.

    Returns:
        True for a non-empty string without path separators or NUL that is not ``.``/``..``
        and that the file system can name (a lone surrogate, which a JSON manifest
        can carry, cannot be encoded: opening it would raise ``UnicodeEncodeError``).
    """
    if not isinstance(name, str) or name in ("", ".", ".."):
        return False
    separators = {"/", "\0", os.sep} | ({os.altsep} if os.altsep else set())
    if any(s in name for s in separators):
        return False
    try:
        os.fsencode(name)
    except UnicodeError:
        return False
    return True


def check_plain_name(name: Any, where: str) -> str:
    """Refuses a name that could reach outside the checkpoint folder.

    Args:
        name: the name found.
        where: what named it, for the message (e.g. ``"ckpt/.metadata"``).

    Returns:
        The name.

    Raises:
        UnsafeCheckpointError: naming ``where`` and the name.
    """
    if not is_plain_name(name):
        raise UnsafeCheckpointError(
            f"Refusing to load: {where} names the file {name!r}, which is not a plain file name "
            "inside the checkpoint folder (an absolute path or '..' would read a file elsewhere "
            "on this machine). Nothing was read from it."
        )
    return name


def is_inside(path: str | Path, folder: str | Path) -> bool:
    """Whether ``path`` resolves (symlinks followed) to something strictly inside ``folder``.

    Args:
        path: a path.
        folder: a directory.

    Returns:
        True when the resolved path is below the resolved folder (not the folder itself); False
        for a path no file system can hold (a NUL byte or a lone surrogate, which a string
        restored from a checkpoint can carry).
    """
    try:
        real, top = os.path.realpath(path), os.path.realpath(folder)
    except ValueError:  # embedded NUL; UnicodeEncodeError
        return False
    return real != top and os.path.commonpath([real, top]) == top


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISFIFO, "FIFO"),
        (stat.S_ISCHR, "character device"),
        (stat.S_ISBLK, "block device"),
        (stat.S_ISSOCK, "socket"),
        (stat.S_ISDIR, "directory"),
    ):
        if test(mode):
            return name
    return "special file"


def open_regular(folder: str | Path, name: str, where: str | None = None) -> int:
    """Opens a regular file directly inside ``folder`` for reading, refusing anything else.

    Args:
        folder: the checkpoint directory.
        name: the file's name (checked with :func:`check_plain_name`).
        where: what named the file, for messages (default: the file itself).

    Returns:
        A file descriptor (the caller closes it).

    Raises:
        UnsafeCheckpointError: for a name that is not plain, a symlink that leaves the folder,
            or a file that is not regular (FIFO, device, socket, directory).
        CheckpointCorruptError: if the file is missing.
    """
    folder = Path(folder)
    file = folder / check_plain_name(name, where or str(folder))
    try:
        target: str | Path = file
        if os.path.islink(file):
            if not is_inside(file, folder):
                raise UnsafeCheckpointError(
                    f"Refusing to load {file}: it is a symbolic link to "
                    f"{os.path.realpath(file)}, outside the checkpoint folder. Nothing was read."
                )
            target = os.path.realpath(file)
        info = os.stat(target, follow_symlinks=False)
        if not stat.S_ISREG(info.st_mode):
            raise UnsafeCheckpointError(
                f"Refusing to load {file}: it is a {_kind(info.st_mode)}, not a regular file "
                "(reading it could block forever or reach a device). Nothing was read."
            )
        fd = os.open(target, _OPEN_FLAGS)
    except FileNotFoundError as err:
        raise CheckpointCorruptError(f"{file} is missing: the checkpoint is incomplete") from err
    except OSError as err:
        raise CheckpointCorruptError(f"{file} cannot be opened: {err}") from err
    opened = os.fstat(fd)
    if not stat.S_ISREG(opened.st_mode) or (opened.st_dev, opened.st_ino) != (
        info.st_dev,
        info.st_ino,
    ):
        os.close(fd)
        raise UnsafeCheckpointError(f"Refusing to load {file}: it changed while it was opened")
    return fd


def open_stream(folder: str | Path, name: str, where: str | None = None) -> BinaryIO:
    """:func:`open_regular` as a buffered binary file object.

    Args:
        folder: the checkpoint directory.
        name: the file's name.
        where: what named the file, for messages.

    Returns:
        The open file (blocking reads; it is a regular file).
    """
    fd = open_regular(folder, name, where)
    os.set_blocking(fd, True)
    return os.fdopen(fd, "rb")


def read_capped(folder: str | Path, name: str, cap: int, where: str | None = None) -> bytes:
    """Reads a whole regular file of the folder, refusing one larger than ``cap`` bytes.

    Args:
        folder: the checkpoint directory.
        name: the file's name.
        cap: the largest size accepted.
        where: what named the file, for messages.

    Returns:
        The file's bytes.

    Raises:
        CheckpointLimitError: if the file is larger than ``cap``, naming it and the limit.
        UnsafeCheckpointError: see :func:`open_regular`.
        CheckpointCorruptError: see :func:`open_regular`.
    """
    with open_stream(folder, name, where) as f:
        size = os.fstat(f.fileno()).st_size
        if size > cap:
            raise CheckpointLimitError(
                f"{Path(folder) / name} has {size} bytes, more than the {cap} this load accepts "
                "for it (CheckpointLimits). If you trust this checkpoint, load it with larger "
                "limits."
            )
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CheckpointLimitError(f"{Path(folder) / name} grew past {cap} bytes while read")
    return data


def regular_size(folder: str | Path, name: str, where: str | None = None) -> int:
    """The size of a regular file of the folder (checked like :func:`open_regular`).

    Args:
        folder: the checkpoint directory.
        name: the file's name.
        where: what named the file, for messages.

    Returns:
        Its size in bytes.
    """
    fd = open_regular(folder, name, where)
    try:
        return os.fstat(fd).st_size
    finally:
        os.close(fd)
