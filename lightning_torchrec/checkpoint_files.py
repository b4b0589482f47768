"""The files of a sharded checkpoint, one process at a time: safe reading, checksums, replacement.

Nothing here is collective; :mod:`lightning_torchrec.checkpoint` decides which rank does what and
agrees the verdicts.

* **Safe DCP metadata.** ``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata``
  unpickles ``.metadata`` with plain ``pickle.load``: a crafted file runs code. Here it is read by
  :func:`read_dcp_metadata`, an unpickler that admits only the types DCP stores there (its
  metadata dataclasses and enums, ``torch.Size``, dtypes, layouts, memory formats, paths and
  plain builtins); anything else raises :class:`~lightning_torchrec.errors.UnsafeCheckpointError`
  naming the file and the global, before it is called. :class:`SafeFileSystemReader` plugs it
  into ``dcp.load``; :class:`SafeLoadPlanner` refuses code in non-tensor entries too.
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

import builtins
import collections
import ctypes
import dataclasses
import enum
import errno
import io
import json
import os
import pathlib
import pickle
import pickletools
import shutil
import sys
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
import torch.distributed.checkpoint.metadata as dcp_metadata
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_torchrec.errors import CheckpointCorruptError, UnsafeCheckpointError

DCP_METADATA = ".metadata"
MANIFEST_FILE = "checksums.json"
#: Written into the manifest; a directory whose manifest names it was written by this package.
WRITER = "lightning_torchrec"
CHECKSUM = "crc32"
_CHUNK = 1 << 22

# ------------------------------------------------------------------ safe DCP metadata

_BUILTINS = {"set", "frozenset", "slice", "complex", "bytearray", "range", "tuple", "list", "dict"}
_BUILTINS |= {"int", "float", "bool", "str", "bytes"}
_PATHS = {"Path", "PurePath", "PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"}
#: DCP's own modules: their dataclasses and enums are plain data (DCP's metadata is made of them).
_DCP_MODULES = {m.__name__: m for m in (dcp_metadata, dcp_filesystem)}
_LAYOUTS = {str(v): v for v in vars(torch).values() if isinstance(v, torch.layout)}


def _layout_by_name(name: str) -> torch.layout:
    """Stands in for torch's layout decoder in DCP metadata: a name to one of torch's layouts."""
    if name not in _LAYOUTS:
        raise pickle.UnpicklingError(f"unknown tensor layout {name!r}")
    return _LAYOUTS[name]


def _admitted(module: str, name: str) -> Any:
    """The object a pickle global may resolve to, or None when it is not DCP metadata data."""
    if module == "builtins" and name in _BUILTINS:
        return getattr(builtins, name)
    if module == "collections" and name == "OrderedDict":
        return collections.OrderedDict
    if module == "pathlib" and name in _PATHS:
        return getattr(pathlib, name)
    if module == "torch":
        obj = getattr(torch, name, None)
        if obj is torch.Size or isinstance(obj, torch.dtype | torch.layout | torch.memory_format):
            return obj
    # TensorProperties pickles its layout as a call of torch.serialization's (private) layout
    # decoder with the layout's name; a lookup among torch's layouts replaces that call.
    if module == "torch.serialization" and name.lstrip("_") == "get_layout":
        return _layout_by_name
    if module in _DCP_MODULES:
        obj = getattr(_DCP_MODULES[module], name, None)
        if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
            return obj
    return None


class _MetadataUnpickler(pickle.Unpickler):
    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str) -> Any:
        obj = _admitted(module, name)
        if obj is None:
            raise UnsafeCheckpointError(
                f"Refusing to load {self.path}: it references the global '{module}.{name}', "
                "which is not part of torch.distributed.checkpoint metadata (loading it could "
                "run code). Nothing was executed. Only load checkpoints from sources you trust."
            )
        return obj

    def persistent_load(self, pid: Any) -> Any:
        raise UnsafeCheckpointError(
            f"Refusing to load {self.path}: it holds a persistent reference ({pid!r}), which "
            "DCP metadata never does."
        )


def read_dcp_metadata(path: str | Path, rank: int | None = None) -> Metadata:
    """Reads a checkpoint's DCP metadata without running code from it.

    Args:
        path: the checkpoint directory.
        rank: read DCP's rank-local ``__{rank}.metadata`` instead of ``.metadata``.

    Returns:
        DCP's ``Metadata``.

    Raises:
        UnsafeCheckpointError: if the file references anything but DCP metadata types, naming
            the file and the global (nothing of it is called).
        CheckpointCorruptError: if the file is missing, truncated or not DCP metadata.
    """
    name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
    file = Path(path) / name
    try:
        with open(file, "rb") as f:
            obj = _MetadataUnpickler(f, file).load()
    except UnsafeCheckpointError:
        raise
    except FileNotFoundError as err:
        raise CheckpointCorruptError(f"{file} is missing: not a complete checkpoint") from err
    except Exception as err:  # noqa: BLE001 - any unpickling failure means a damaged file
        raise CheckpointCorruptError(
            f"{file} cannot be read (truncated or damaged; not DCP metadata): "
            f"{type(err).__name__}: {err}"
        ) from err
    if not isinstance(obj, Metadata):
        raise CheckpointCorruptError(f"{file} holds a {type(obj).__name__}, not DCP metadata")
    if getattr(obj, "storage_meta", None) is None:
        obj.storage_meta = StorageMeta()
    return obj


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads ``.metadata`` with :func:`read_dcp_metadata`.

    Args:
        path: the checkpoint directory.
        metadata: metadata read (safely) already, returned instead of reading it again.
    """

    def __init__(self, path: str | Path, metadata: Metadata | None = None) -> None:
        super().__init__(str(path))
        self.checkpoint_dir = Path(path)
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata, unpickled safely (see :func:`read_dcp_metadata`).

        Args:
            *args: unused (DCP's signature).
            **kwargs: ``rank``: read DCP's rank-local metadata file.

        Returns:
            The metadata.
        """
        rank = kwargs.get("rank")
        if rank is None and self.metadata is not None:
            metadata = self.metadata
        else:
            metadata = read_dcp_metadata(self.checkpoint_dir, rank)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's tensors file by file; a failure names the file.

        Args:
            plan: DCP's load plan for this rank.
            planner: DCP's load planner.

        Returns:
            A completed future.

        Raises:
            CheckpointCorruptError: if a file cannot be read (truncated, damaged), naming it.
        """
        per_file: dict[str, list[Any]] = {}
        for item in plan.items:
            name = str(self.storage_data[item.storage_index].relative_path)
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                super().read_data(dataclasses.replace(plan, items=items), planner).wait()
            except (UnsafeCheckpointError, CheckpointCorruptError):
                raise
            except Exception as err:  # noqa: BLE001 - any read failure: a damaged file
                raise CheckpointCorruptError(
                    f"{self.checkpoint_dir / name} cannot be read (truncated or damaged): "
                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                ) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing code in non-tensor (pickled) entries.

    DCP unpickles non-tensor entries with ``torch.load(weights_only=False)``; each is checked
    with ``weights_only=True`` first. (This package's checkpoints hold tensors only.)
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Loads one non-tensor entry once ``torch.load(weights_only=True)`` accepted it.

        Args:
            read_item: DCP's read item.
            value: the entry's bytes.

        Raises:
            UnsafeCheckpointError: if the entry holds anything but tensors and plain data.
        """
        try:
            torch.load(value, map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as err:
            raise UnsafeCheckpointError(
                f"Refusing to load the checkpoint entry {read_item.dest_index.fqn!r}: it holds "
                f"objects that are not tensors or plain data. torch.load said: {err}"
            ) from err
        value.seek(0)
        super().load_bytes(read_item, value)


# ------------------------------------------------------------------ other files


def pickled_strings(file: str | Path) -> set[str] | None:
    """The strings in a ``torch.save`` file's pickle, read without unpickling it.

    Args:
        file: a file.

    Returns:
        The string constants of its ``data.pkl`` (keys, names), or None when it is not a readable
        ``torch.save`` zip file.
    """
    try:
        with zipfile.ZipFile(file) as z:
            pkl = [n for n in z.namelist() if n == "data.pkl" or n.endswith("/data.pkl")]
            if not pkl:
                return None
            data = z.read(pkl[0])
        return {arg for _, arg, _ in pickletools.genops(data) if isinstance(arg, str)}
    except Exception:  # noqa: BLE001 - any failure: not a readable torch file
        return None


def single_file_checkpoint_kind(file: str | Path) -> str | None:
    """What a regular file is: a Lightning (single-file) checkpoint, another torch file, or not.

    Args:
        file: a file.

    Returns:
        ``"lightning"`` for a checkpoint Lightning wrote with ``torch.save`` (e.g. under the
        default DDP strategy), ``"torch"`` for another ``torch.save`` file, else None.
    """
    strings = pickled_strings(file)
    if strings is None:
        return None
    return "lightning" if "pytorch-lightning_version" in strings else "torch"


def load_torch_file(file: str | Path, weights_only: bool = True) -> Any:
    """``torch.load`` of a checkpoint file, with errors that name the file and say why.

    Args:
        file: the file (``meta.pt``, ``param_groups.rank{r}.pt``).
        weights_only: refuse objects that are not tensors or plain data.

    Returns:
        What the file holds.

    Raises:
        UnsafeCheckpointError: if ``weights_only`` and the file holds other objects (also a
            ``pickle.UnpicklingError``).
        CheckpointCorruptError: if the file is missing, truncated or damaged.
    """
    file = Path(file)
    try:
        return torch.load(file, map_location="cpu", weights_only=weights_only)
    except FileNotFoundError as err:
        raise CheckpointCorruptError(f"{file} is missing: the checkpoint is incomplete") from err
    except pickle.UnpicklingError as err:
        if weights_only and "unsupported global" in str(err).lower():
            raise UnsafeCheckpointError(
                f"Refusing to load {file}: it holds objects that are not tensors or plain data "
                "(loading them could run code). If you wrote this checkpoint yourself and trust "
                "it, load it with `weights_only=False` (e.g. `trainer.fit(..., "
                f"weights_only=False)`).\ntorch.load said: {err}"
            ) from err
        raise CheckpointCorruptError(
            f"{file} cannot be read (truncated or damaged): {str(err).splitlines()[0]}"
        ) from err
    except Exception as err:  # noqa: BLE001 - zip/EOF/format errors: a damaged file
        raise CheckpointCorruptError(
            f"{file} cannot be read (truncated or damaged): {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}"
        ) from err


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


# ------------------------------------------------------------------ checksums


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


# ------------------------------------------------------------------ crash-safe replacement

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
