"""Reading checkpoint files without running code from them (one process at a time).

``torch.distributed.checkpoint``'s ``FileSystemReader.read_metadata`` unpickles ``.metadata``
with plain ``pickle.load``: a crafted file runs code. Here it is read by
:func:`read_dcp_metadata`, an unpickler that admits only the types DCP stores there (its metadata
dataclasses and enums, ``torch.Size``, dtypes, layouts, memory formats, paths and plain
builtins); anything else raises :class:`~lightning_torchrec.errors.UnsafeCheckpointError` naming
the file and the global, before it is called. :class:`SafeFileSystemReader` plugs it into
``dcp.load``; :class:`SafeLoadPlanner` refuses code in non-tensor entries too;
:func:`load_torch_file` reads ``torch.save`` files with ``weights_only`` and names the file when
it is damaged.
"""

from __future__ import annotations

import builtins
import collections
import dataclasses
import enum
import io
import pathlib
import pickle
import pickletools
import zipfile
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

from lightning_torchrec.checkpoint.files import DCP_METADATA
from lightning_torchrec.compat.upstream import TORCH_LAYOUT_DECODER
from lightning_torchrec.errors import CheckpointCorruptError, UnsafeCheckpointError

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
    # TensorProperties pickles its layout as a call of torch's private layout decoder with the
    # layout's name; a lookup among torch's layouts replaces that call.
    if (module, name) == TORCH_LAYOUT_DECODER:
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
