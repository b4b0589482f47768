"""DCP's reader and load planner, made to read a checkpoint without running code or reaching out.

``torch.distributed.checkpoint``'s ``FileSystemReader`` unpickles ``.metadata`` with plain
``pickle.load`` (a crafted file runs code), opens whatever path a chunk names (``../`` and
absolute paths included, FIFOs that block forever) and inflates compressed chunk data.
:class:`SafeFileSystemReader` replaces both halves:

- ``read_metadata`` returns metadata read by
  :meth:`~lightning_torchrec.checkpoint.folder.CheckpointFolder.metadata` (verified, unpickled
  safely, every tensor covered exactly once, every chunk file a plain name inside the folder);
- ``read_data`` opens chunk files through the folder (listed in the manifest, regular files),
  reads each slice within the file, refuses stream transforms, and loads each chunk with
  :func:`~lightning_torchrec.checkpoint.torch_files.load_torch_bytes` (no compressed entries, no
  globals but a tensor's, no tensor larger than its bytes).

:class:`SafeLoadPlanner` checks non-tensor entries the same way before DCP unpickles them.
"""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from lightning_torchrec.checkpoint.folder import CheckpointFolder, read_dcp_metadata
from lightning_torchrec.checkpoint.torch_files import (
    FileSlice,
    load_torch_bytes,
    pickled_strings,
    single_file_checkpoint_kind,
)
from lightning_torchrec.compat.upstream import narrow_tensor
from lightning_torchrec.errors import (
    CheckpointCorruptError,
    CheckpointLimitError,
    UnsafeCheckpointError,
)

__all__ = [
    "SafeFileSystemReader",
    "SafeLoadPlanner",
    "pickled_strings",
    "read_dcp_metadata",
    "single_file_checkpoint_kind",
]


class SafeFileSystemReader(FileSystemReader):
    """DCP's ``FileSystemReader`` that reads only what :class:`CheckpointFolder` hands out.

    Args:
        path: the checkpoint directory.
        metadata: metadata read (safely) already, returned instead of reading it again.
        folder: the opened checkpoint folder (default: opened here).
    """

    def __init__(
        self,
        path: str | Path,
        metadata: Metadata | None = None,
        folder: CheckpointFolder | None = None,
    ) -> None:
        super().__init__(str(path))
        self.checkpoint_dir = Path(path)
        self.folder = CheckpointFolder(path) if folder is None else folder
        self.metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """DCP metadata, read safely (see :meth:`CheckpointFolder.metadata`).

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
            metadata = self.folder.metadata(rank)
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """Reads the plan's chunks file by file through the folder; a failure names the file.

        Args:
            plan: DCP's load plan for this rank.
            planner: DCP's load planner.

        Returns:
            A completed future.

        Raises:
            CheckpointCorruptError: if a file cannot be read (truncated, damaged), naming it.
            UnsafeCheckpointError: if a file is not a listed regular file inside the folder.
        """
        per_file: dict[str, list[ReadItem]] = {}
        for item in plan.items:
            name = self.storage_data[item.storage_index].relative_path
            per_file.setdefault(name, []).append(item)
        for name, items in per_file.items():
            try:
                self._read_file(name, items, planner)
            except (UnsafeCheckpointError, CheckpointCorruptError, CheckpointLimitError):
                raise
            except Exception as err:  # noqa: BLE001 - any read failure: a damaged file
                raise CheckpointCorruptError(
                    f"{self.checkpoint_dir / name} cannot be read (truncated or damaged): "
                    f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
                ) from err
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def _read_file(self, name: str, items: list[ReadItem], planner: LoadPlanner) -> None:
        file = self.checkpoint_dir / name
        with self.folder.open(name, str(self.checkpoint_dir / ".metadata")) as stream:
            for req in items:
                info = self.storage_data[req.storage_index]
                if req.type == LoadItemType.BYTE_IO:
                    stream.seek(info.offset)
                    blob = stream.read(info.length)
                    if len(blob) != info.length:
                        raise CheckpointCorruptError(f"{file} ends inside a chunk (truncated)")
                    planner.load_bytes(req, io.BytesIO(blob))
                    continue
                chunk = FileSlice(stream, info.offset, info.length)  # within the file: checked
                tensor = load_torch_bytes(chunk, file, True, self.folder.limits)
                if type(tensor) is not torch.Tensor:
                    raise CheckpointCorruptError(f"{file} holds a {type(tensor).__name__} chunk")
                tensor = narrow_tensor(tensor, req.storage_offsets, req.lengths)
                target = planner.resolve_tensor(req).detach()
                if target.size() != tensor.size():
                    raise CheckpointCorruptError(
                        f"{file}: the chunk of {req.storage_index.fqn!r} has shape "
                        f"{list(tensor.shape)}, its metadata says {list(target.shape)}"
                    )
                target.copy_(tensor)
                planner.commit_tensor(req, target)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default load planner, refusing code in non-tensor (pickled) entries.

    DCP unpickles non-tensor entries with ``torch.load(weights_only=False)``; each is checked
    with :func:`~lightning_torchrec.checkpoint.torch_files.load_torch_bytes` first. (This
    package's checkpoints hold tensors only.)
    """

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """Loads one non-tensor entry once it was read as tensors and plain data only.

        Args:
            read_item: DCP's read item.
            value: the entry's bytes.

        Raises:
            UnsafeCheckpointError: if the entry holds anything but tensors and plain data.
        """
        where = f"the checkpoint entry {read_item.dest_index.fqn!r}"
        load_torch_bytes(value.getvalue(), where, True)
        value.seek(0)
        super().load_bytes(read_item, value)
