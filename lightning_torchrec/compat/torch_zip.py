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
"""

from __future__ import annotations

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
        self._reader = torch._C.PyTorchFileReader(source)

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
        return int(self._reader.get_record_size(name))

    def read(self, name: str) -> bytes:
        """An entry's bytes, as torch reads them.

        Args:
            name: the entry (below the root).

        Returns:
            The bytes.
        """
        return bytes(self._reader.get_record(name))
