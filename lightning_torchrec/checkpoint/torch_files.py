"""Reading a checkpoint's ``torch.save`` files (``meta.pt``, ``param_groups``, chunks) safely.

``torch.load(weights_only=True)`` refuses code, but within what it allows a crafted file can
still cost a lot: a DEFLATE-compressed zip entry inflates ~1000x, ``bytearray(n)`` and the
legacy tensor constructors allocate what the file asks, and a tensor view with zero strides
claims more elements than its storage holds. :func:`load_torch_bytes` closes those before and
after ``torch.load`` runs, on bytes already in memory (so what is parsed is what was verified):

- the zip must be one ``torch.save`` writes: every entry stored uncompressed, sizes consistent,
  checked on the archive as torch itself reads it (:mod:`lightning_torchrec.compat.torch_zip`:
  Python's ``zipfile`` can be shown another archive in the same file);
- the pickle may name only the globals a plain ``torch.save`` of tensors and containers uses
  (:data:`TORCH_FILE_GLOBALS`): tensors and their storages, ``OrderedDict``, ``set``, bytes,
  ``torch.Size``, ``torch.device`` and dtypes; anything else is refused before it is resolved;
- what it unpickles into is walked with a budget (:class:`CheckpointLimits`) and every tensor
  must hold no more elements than its storage.
"""

from __future__ import annotations

import io
import os
import pickle
import pickletools
import zipfile
from pathlib import Path
from typing import Any

import torch

from lightning_torchrec.checkpoint.limits import DEFAULT_LIMITS, CheckpointLimits
from lightning_torchrec.compat.torch_zip import ZIP_MAGIC, TorchZip
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    UnsafeCheckpointError,
)

#: The globals a ``torch.save`` of tensors, containers and plain values pickles (protocol 2).
TORCH_FILE_GLOBALS = {
    "collections OrderedDict",
    "torch._utils _rebuild_tensor_v2",
    "torch._utils _rebuild_parameter",
    "torch Size",
    "torch device",
    "_codecs encode",
    "__builtin__ set",
    "builtins set",
    "__builtin__ complex",
    "builtins complex",
}


def _allowed_global(arg: str) -> bool:
    if arg in TORCH_FILE_GLOBALS:
        return True
    module, _, name = arg.partition(" ")
    if module != "torch":
        return False
    value = getattr(torch, name, None)
    storage = name.endswith("Storage") and isinstance(value, type)
    return storage or isinstance(value, torch.dtype)


class FileSlice(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes of an open file from ``offset``.

    What a chunk of a DCP file is read through: ``torch.load`` reads its tensor straight from
    the file (no copy of the chunk's bytes in memory first), and nothing past the slice.

    Args:
        stream: an open binary file.
        offset: where the slice starts.
        length: its length.
    """

    def __init__(self, stream: Any, offset: int, length: int) -> None:
        super().__init__()
        self.stream, self.offset, self.length, self.pos = stream, offset, length, 0

    def readable(self) -> bool:  # noqa: D102 - io protocol
        return True

    def seekable(self) -> bool:  # noqa: D102 - io protocol
        return True

    def tell(self) -> int:  # noqa: D102 - io protocol
        return self.pos

    def seek(self, pos: int, whence: int = 0) -> int:  # noqa: D102 - io protocol
        base = {0: 0, 1: self.pos, 2: self.length}[whence]
        self.pos = max(0, min(self.length, base + pos))
        return self.pos

    def readinto(self, buffer: Any) -> int:  # noqa: D102 - io protocol
        n = min(len(buffer), self.length - self.pos)
        if n <= 0:
            return 0
        self.stream.seek(self.offset + self.pos)
        got = self.stream.readinto(memoryview(buffer)[:n])
        self.pos += got
        return got


def _data_pickle(data: bytes | Path | FileSlice, file: Path, cap: int | None = None) -> bytes:
    """The pickle ``torch.load`` reads from a ``torch.save`` zip (bytes, a file or a slice).

    Checked on both readings of the archive (see :mod:`lightning_torchrec.compat.torch_zip`):
    ``zipfile``'s, for a compressed entry, and torch's, which is the one loaded: its entries
    may not claim more bytes than the file holds (so nothing inflates), and its pickle is
    returned. A file that does not start with a zip entry is refused (``torch.load`` would read
    it as a legacy pickle, past any check of the archive appended to it).
    """
    try:
        if isinstance(data, Path):
            with open(data, "rb") as stream:
                return _checked_pickle(stream, os.fstat(stream.fileno()).st_size, file, cap)
        if isinstance(data, bytes):
            return _checked_pickle(io.BytesIO(data), len(data), file, cap)
        return _checked_pickle(data, data.length, file, cap)
    except CheckpointCorruptError:
        raise
    except Exception as err:  # noqa: BLE001 - a zip that cannot be read: a damaged file
        raise CheckpointCorruptError(
            f"{file} cannot be read (truncated or damaged; not a torch.save zip file): "
            f"{type(err).__name__}: {err}"
        ) from err


def _checked_pickle(source: Any, size: int, file: Path, cap: int | None) -> bytes:
    source.seek(0)
    if source.read(len(ZIP_MAGIC)) != ZIP_MAGIC:
        raise CheckpointCorruptError(
            f"{file} is not a torch.save zip file (it does not start with a zip entry; torch.load "
            "would read it as a legacy pickle, which this package never writes)"
        )
    source.seek(0)
    with zipfile.ZipFile(source) as z:
        for info in z.infolist():
            if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
                raise CheckpointCorruptError(
                    f"{file} holds a compressed entry ({info.filename!r}); torch.save never "
                    "compresses, and it is refused unread (it could inflate without bound)"
                )
    archive = TorchZip(source)
    names = archive.names()
    if sum(archive.size(name) for name in names) > size:
        raise CheckpointCorruptError(f"{file}: its zip entries claim more than the file")
    if names.count("data.pkl") != 1:
        raise CheckpointCorruptError(f"{file} is not a torch.save file (no data.pkl)")
    if cap is not None and archive.size("data.pkl") > cap:
        raise CheckpointCorruptError(f"{file}: its pickle is larger than {cap} bytes")
    return archive.read("data.pkl")


def _check_globals(pkl: bytes, file: Path) -> None:
    try:
        for op, arg, _ in pickletools.genops(pkl):
            if op.name == "GLOBAL" and not _allowed_global(str(arg)):
                raise UnsafeCheckpointError(
                    f"Refusing to load {file}: it references the global "
                    f"'{str(arg).replace(' ', '.')}', which a torch.save of tensors and plain "
                    "data never holds (loading it could run code or allocate without bound). "
                    "Nothing was executed. Only load checkpoints from sources you trust; if you "
                    "wrote it yourself, load it with `weights_only=False`."
                )
            if op.name in ("STACK_GLOBAL", "INST", "OBJ", "EXT1", "EXT2", "EXT4", "NEWOBJ_EX"):
                raise UnsafeCheckpointError(
                    f"Refusing to load {file}: its pickle uses {op.name}, which torch.save never "
                    "writes. Nothing was executed."
                )
    except (UnsafeCheckpointError, CheckpointCorruptError):
        raise
    except Exception as err:  # noqa: BLE001 - a pickle that cannot be parsed: damaged
        raise CheckpointCorruptError(f"{file} cannot be read (damaged pickle): {err}") from err


def check_expansion(
    obj: Any, budget: int, file: Path, max_depth: int = DEFAULT_LIMITS.max_depth
) -> None:
    """Walks what a file unpickled into, refusing more than ``budget`` objects or bloated tensors.

    Shared references are counted each time they are reached, so the walk (and anything that
    later walks the object) stays within the budget. Containers may nest ``max_depth`` deep: a
    few bytes a level build a list nested thousands deep, which anything that walks it by
    recursion (``copy.deepcopy`` in Lightning's ``save_hyperparameters``, ``repr``) fails on
    with a bare ``RecursionError``.

    Args:
        obj: the unpickled object.
        budget: the objects allowed (:meth:`CheckpointLimits.object_budget`).
        file: the file, for the message.
        max_depth: the deepest nesting of containers allowed (:class:`CheckpointLimits`).

    Raises:
        CheckpointLimitError: when the object graph exceeds the budget or the depth.
        CheckpointCorruptError: for a tensor claiming more elements than its storage holds.
    """
    stack, seen = [(obj, 0)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if seen > budget:
            raise CheckpointLimitError(
                f"{file} expands to more than {budget} objects (shared references reached "
                "repeatedly, or a cycle); refused. If you trust it, raise "
                "CheckpointLimits.objects_per_byte."
            )
        if isinstance(item, torch.Tensor):
            if item.layout != torch.strided or item.is_meta:
                raise CheckpointCorruptError(f"{file} holds a {item.layout} tensor")
            nbytes = item.numel() * item.element_size()
            if nbytes > item.untyped_storage().nbytes():
                raise CheckpointCorruptError(
                    f"{file} holds a tensor of {item.numel()} elements on a storage of "
                    f"{item.untyped_storage().nbytes()} bytes (a view that repeats its data)"
                )
            continue
        if isinstance(item, dict):
            items = [*item.keys(), *item.values()]
        elif isinstance(item, list | tuple | set | frozenset):
            items = list(item)
        else:
            continue
        if items and depth >= max_depth:
            raise CheckpointLimitError(
                f"{file} nests containers more than {max_depth} deep; refused. If you trust "
                "it, raise CheckpointLimits.max_depth."
            )
        stack.extend((child, depth + 1) for child in items)


def load_torch_bytes(
    data: bytes | FileSlice,
    file: str | Path,
    weights_only: bool = True,
    limits: CheckpointLimits = DEFAULT_LIMITS,
) -> Any:
    """``torch.load`` of a checkpoint file's bytes, bounded, with errors that name the file.

    Args:
        data: the file's bytes (verified against the manifest already, where there is one), or
            a :class:`FileSlice` of a verified file.
        file: the file, for messages.
        weights_only: refuse objects that are not tensors or plain data (and bound the work);
            False trusts the file (code in it runs).
        limits: the expansion budget.

    Returns:
        What the file holds.

    Raises:
        UnsafeCheckpointError: if ``weights_only`` and the file holds other objects (also a
            ``pickle.UnpicklingError``).
        CheckpointCorruptError: if the file is truncated, damaged or compressed.
        CheckpointLimitError: if it expands beyond the budget.
    """
    file = Path(file)
    pkl = _data_pickle(data, file)
    if weights_only:
        _check_globals(pkl, file)
    try:
        source = io.BytesIO(data) if isinstance(data, bytes) else data
        source.seek(0)
        obj = torch.load(source, map_location="cpu", weights_only=weights_only)
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
    if weights_only:
        size = len(data) if isinstance(data, bytes) else data.length
        check_expansion(obj, limits.object_budget(size), file, limits.max_depth)
    return obj


def pickled_strings(
    file: str | Path, cap: int = DEFAULT_LIMITS.max_torch_file_bytes
) -> set[str] | None:
    """The strings in a ``torch.save`` file's pickle, read without unpickling it.

    Args:
        file: a file (only a regular file is read: not a symlink, FIFO or device).
        cap: a pickle larger than this is not read (None is returned).

    Returns:
        The string constants of its ``data.pkl`` (keys, names), or None when it is not a readable
        ``torch.save`` zip file.
    """
    path = Path(file)
    try:
        if path.is_symlink() or not path.is_file():
            return None
        pkl = _data_pickle(path, path, cap)
        return {arg for _, arg, _ in pickletools.genops(pkl) if isinstance(arg, str)}
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
