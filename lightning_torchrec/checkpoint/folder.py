"""A checkpoint directory opened for reading: every file it hands out is checked first.

:class:`CheckpointFolder` is the only way the loaders open a checkpoint's files. A file is
handed out only when:

- its name is a plain name inside the folder and it is a regular file
  (:mod:`lightning_torchrec.checkpoint.paths`);
- it is listed in the manifest (``checksums.json``), and a file parsed in memory (``.metadata``,
  ``meta.pt``, ``param_groups``) is checked against its checksum *before* it is parsed, from the
  very bytes that are then parsed; large files (DCP's chunks) are checked by
  :meth:`CheckpointFolder.verify` before any tensor is read;
- with a key (:mod:`~lightning_torchrec.checkpoint.signing`), the manifest is signed with it
  and files are compared by SHA-256.

A checkpoint of format version 2 (or later) without a manifest is refused: the manifest was
removed, and its files could not be verified. Only format 1 (written before manifests existed)
loads without one, with a warning (:data:`UNVERIFIED`), and with every other rule.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, BinaryIO

from torch.distributed.checkpoint.metadata import Metadata

from lightning_torchrec.checkpoint.dcp_metadata import parse_dcp_metadata, storage_files
from lightning_torchrec.checkpoint.limits import DEFAULT_LIMITS, CheckpointLimits
from lightning_torchrec.checkpoint.manifest import (
    MANIFEST_FILE,
    check_bytes,
    read_manifest,
    verify_files,
)
from lightning_torchrec.checkpoint.names import DCP_METADATA, META_FILE, PACKAGE_KEY
from lightning_torchrec.checkpoint.paths import (
    check_plain_name,
    open_stream,
    read_capped,
    regular_size,
)
from lightning_torchrec.checkpoint.signing import check_signature, resolve_key
from lightning_torchrec.checkpoint.torch_files import load_torch_bytes
from lightning_torchrec.errors import CheckpointCorruptError

UNVERIFIED = (
    "{path} has no checksum manifest (written before lightning_torchrec checkpoint format 2): "
    "its files cannot be verified, so damage would go unnoticed. Save it again to add one."
)


def _damaged(problem: str) -> CheckpointCorruptError:
    return CheckpointCorruptError(
        f"checkpoint files do not match the checksums written with them: {problem}. Use another "
        "checkpoint (or a backup copy of this one)."
    )


class CheckpointFolder:
    """A checkpoint directory opened for reading (one process; nothing collective).

    Args:
        path: the checkpoint directory.
        key: the HMAC key checkpoints must be signed with (default: see
            :func:`~lightning_torchrec.checkpoint.signing.resolve_key`).
        limits: the reading limits (default :data:`DEFAULT_LIMITS`).

    Raises:
        CheckpointCorruptError: if the manifest is damaged.
        CheckpointSignatureError: with a key, if the checkpoint is not signed with it.
        UnsafeCheckpointError: if the manifest is not a regular file inside the folder.
        CheckpointLimitError: if the manifest is larger than the limit.
    """

    def __init__(
        self,
        path: str | Path,
        *,
        key: bytes | str | None = None,
        limits: CheckpointLimits | None = None,
    ) -> None:
        self.path = Path(path)
        self.limits = DEFAULT_LIMITS if limits is None else limits
        self.key = resolve_key(key)
        self.manifest = read_manifest(self.path, self.limits)
        if self.key is not None:
            check_signature(self.manifest, self.key, self.path)
        self._meta: dict[bool, dict[str, Any]] = {}

    @property
    def strong(self) -> bool:
        """Whether files are compared by SHA-256 (a signed checkpoint read with its key)."""
        return self.key is not None

    def names(self) -> list[str]:
        """The files the manifest lists, sorted (none without a manifest).

        Returns:
            The names.
        """
        return sorted(self.manifest["files"]) if self.manifest is not None else []

    def entry(self, name: str, where: str | None = None) -> dict[str, Any] | None:
        """The manifest entry of a file the load is about to open.

        Args:
            name: the file name (must be plain).
            where: what named it, for messages.

        Returns:
            The entry, or None without a manifest.

        Raises:
            UnsafeCheckpointError: for a name that is not a plain name inside the folder.
            CheckpointCorruptError: for a file the manifest does not list.
        """
        check_plain_name(name, where or str(self.path))
        if self.manifest is None:
            return None
        if name not in self.manifest["files"]:
            raise CheckpointCorruptError(
                f"{self.path / name} is not listed in {self.path / MANIFEST_FILE} (named by "
                f"{where or 'the loader'}): no file is read unless it was verified. The "
                "checkpoint was changed after it was written; use another checkpoint."
            )
        return self.manifest["files"][name]

    def read(self, name: str, cap: int, where: str | None = None) -> bytes:
        """A whole file, verified against its manifest entry before anything parses it.

        Args:
            name: the file name.
            cap: its size cap (:class:`CheckpointLimits`).
            where: what named it, for messages.

        Returns:
            Its bytes.
        """
        entry = self.entry(name, where)
        data = read_capped(self.path, name, cap, where)
        if entry is not None:
            problem = check_bytes(self.path / name, data, entry, self.strong)
            if problem is not None:
                raise _damaged(problem)
        return data

    def open(self, name: str, where: str | None = None) -> BinaryIO:
        """A listed regular file, open for reading (verify it first with :meth:`verify`).

        Args:
            name: the file name.
            where: what named it, for messages.

        Returns:
            The open file.
        """
        entry = self.entry(name, where)
        stream = open_stream(self.path, name, where)
        size = stream.seek(0, 2)
        stream.seek(0)
        if entry is not None and size != entry["size"]:
            stream.close()
            raise _damaged(f"{self.path / name} has {size} bytes, {entry['size']} were written")
        return stream

    def size(self, name: str, where: str | None = None) -> int:
        """The size of a file the load will read (from the manifest, else from the file).

        Args:
            name: the file name.
            where: what named it, for messages.

        Returns:
            Bytes.
        """
        entry = self.entry(name, where)
        return entry["size"] if entry is not None else regular_size(self.path, name, where)

    def verify(self, names: list[str] | None = None) -> None:
        """Checks files against the manifest by streaming them (nothing without a manifest).

        Args:
            names: the files (default: every file the manifest lists).
        """
        if self.manifest is not None:
            todo = self.names() if names is None else names
            verify_files(self.path, self.manifest, todo, strong=self.strong)

    def metadata(self, rank: int | None = None) -> Metadata:
        """DCP's metadata (``.metadata`` or ``__{rank}.metadata``): verified, parsed, checked.

        Every file its chunks name is checked to be listed (or, without a manifest, a regular
        file) and long enough for its slices.

        Args:
            rank: read DCP's rank-local metadata file instead.

        Returns:
            The metadata.
        """
        name = DCP_METADATA if rank is None else f"__{rank}{DCP_METADATA}"
        data = self.read(name, self.limits.max_metadata_bytes)
        metadata = parse_dcp_metadata(data, self.path / name, self.limits)
        where = str(self.path / name)
        for file, end in storage_files(metadata).items():
            size = self.size(file, where)
            if end > size:
                raise CheckpointCorruptError(
                    f"{self.path / file} is truncated or damaged: it has {size} bytes, but {where} "
                    f"places a chunk up to byte {end}. Use another checkpoint."
                )
        return metadata

    def torch_file(self, name: str, weights_only: bool = True) -> Any:
        """A ``torch.save`` file of the folder: verified, then loaded within the limits.

        Args:
            name: the file name.
            weights_only: refuse objects that are not tensors or plain data.

        Returns:
            What it holds.
        """
        data = self.read(name, self.limits.max_torch_file_bytes)
        return load_torch_bytes(data, self.path / name, weights_only, self.limits)

    def meta(self, weights_only: bool = True) -> dict[str, Any]:
        """Lightning's metadata (``meta.pt``), after the format check (see the module docstring).

        Args:
            weights_only: refuse objects that are not tensors or plain data.

        Returns:
            The dict.

        Raises:
            CheckpointCorruptError: if it is not a dict, or it says format 2 or later but the
                checkpoint has no manifest.
        """
        if weights_only not in self._meta:
            meta = self.torch_file(META_FILE, weights_only)
            if not isinstance(meta, dict):
                raise CheckpointCorruptError(f"{self.path / META_FILE} does not hold a dict")
            info = meta.get(PACKAGE_KEY)
            version = info.get("format_version", 1) if isinstance(info, dict) else 1
            if self.manifest is None and (not isinstance(version, int) or version >= 2):
                raise CheckpointCorruptError(
                    f"{self.path} says it is checkpoint format {version!r}, which always has a "
                    f"checksum manifest, but {MANIFEST_FILE} is missing (removed or lost): its "
                    "files cannot be verified, so it is refused. Use another checkpoint."
                )
            self._meta[weights_only] = meta
        return self._meta[weights_only]

    def unverified(self) -> bool:
        """Whether the checkpoint loads without a manifest (format 1; checked via ``meta.pt``).

        Returns:
            True for a format-1 checkpoint (warn with :data:`UNVERIFIED`).
        """
        if self.manifest is not None:
            return False
        self.meta()
        return True


def read_dcp_metadata(
    path: str | Path,
    rank: int | None = None,
    *,
    key: bytes | str | None = None,
    limits: CheckpointLimits | None = None,
) -> Metadata:
    """Reads a checkpoint's DCP metadata without running code from it (verified when listed).

    Args:
        path: the checkpoint directory.
        rank: read DCP's rank-local ``__{rank}.metadata`` instead of ``.metadata``.
        key: the key the checkpoint must be signed with (see :class:`CheckpointFolder`).
        limits: the reading limits.

    Returns:
        DCP's ``Metadata``.

    Raises:
        UnsafeCheckpointError: if the file references anything but DCP metadata types, naming
            the file and the global (nothing of it is called), or names files outside the folder.
        CheckpointCorruptError: if the file is missing, damaged or not valid DCP metadata.
        CheckpointLimitError: if it is larger, or expands further, than the limits.
    """
    return CheckpointFolder(path, key=key, limits=limits).metadata(rank)
