"""The zip archives of ``torch.save`` and ``torch.export.save`` as torch itself reads them.

``torch.load`` and ``torch.export.load`` read a zip file with ``torch._C.PyTorchFileReader``
(miniz), not with Python's ``zipfile``, and the two do not always read the same archive out of
one file. ``zipfile`` takes bytes before the archive as a prefix and shifts every offset past
them, while miniz reads the central directory at the offset the end record states: one file can
hold two archives, one for each reader. And ``torch.load`` reads a file that does not start with
a zip entry (:data:`ZIP_MAGIC`) as a legacy pickle, which ``zipfile`` finds the archive appended
to. A check of a stranger's file must therefore read what torch will read: :class:`TorchZip` is
that reading. ``PyTorchFileReader`` is what ``torch.serialization`` and
``torch.export.pt2_archive`` open (torch 1.x through 2.14); it has no public equivalent.

Its ``get_record_size`` (an entry's size in the central directory miniz reads) came after torch
2.11. Without it the sizes are read with ``zipfile``, and only from an archive both readers
place at the same offset: with no bytes before it, ``zipfile`` reads the central directory where
the end record says, as miniz does; a file with bytes before its archive is refused as
unreadable.
"""

from __future__ import annotations

import zipfile
from typing import IO

import torch

#: How ``torch.load`` tells a zip archive from a legacy pickle (``torch.serialization.
#: _is_zipfile``): the file starts with a zip local file header.
ZIP_MAGIC = b"PK\x03\x04"


class TorchZip:
    """A zip archive opened with torch's own reader (raises ``RuntimeError`` when unreadable).

    Args:
        source: the open file (read from its start; left at any position).
    """

    def __init__(self, source: IO[bytes]) -> None:
        source.seek(0)
        self._source = source
        self._reader = torch._C.PyTorchFileReader(source)
        self._sizes: dict[str, int] | None = None

    def names(self) -> list[str]:
        """Every entry's name below the archive's one root folder, in the central directory.

        Returns:
            The names (a name stored twice is listed twice).
        """
        return list(self._reader.get_all_records())

    def size(self, name: str) -> int:
        """The uncompressed size of an entry (what reading it allocates).

        Args:
            name: the entry (below the root).

        Returns:
            Bytes.
        """
        if hasattr(self._reader, "get_record_size"):
            return int(self._reader.get_record_size(name))
        if self._sizes is None:
            self._sizes = _central_sizes(self._source)
        if name not in self._sizes:
            raise RuntimeError(f"zip entry {name!r} is not in the central directory")
        return self._sizes[name]

    def read(self, name: str) -> bytes:
        """An entry's bytes, as torch reads them.

        Args:
            name: the entry (below the root).

        Returns:
            The bytes.
        """
        return bytes(self._reader.get_record(name))


def _central_sizes(source: IO[bytes]) -> dict[str, int]:
    """Each entry's size below the root, from the central directory the end record places.

    ``zipfile`` shifts every offset past bytes before the archive; miniz does not. Such a file
    is refused, so the sizes read here are those of the archive torch reads. A name stored
    twice gets its larger size (torch's reader may read either).
    """
    source.seek(0)
    end = zipfile._EndRecData(source)  # type: ignore[attr-defined]
    if end is None:
        raise RuntimeError("no zip end record")
    with zipfile.ZipFile(source) as archive:
        if archive.start_dir != end[zipfile._ECD_OFFSET]:  # type: ignore[attr-defined]
            raise RuntimeError(
                "bytes before the zip archive: torch's reader and zipfile read it differently"
            )
        sizes: dict[str, int] = {}
        for info in archive.infolist():
            name = info.filename.split("/", 1)[-1]
            sizes[name] = max(sizes.get(name, 0), info.file_size)
    return sizes
