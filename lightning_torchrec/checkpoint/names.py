"""The names of a sharded checkpoint's files (see :mod:`lightning_torchrec.checkpoint`)."""

from __future__ import annotations

import re
from pathlib import Path

#: DCP's metadata file.
DCP_METADATA = ".metadata"


#: Lightning's metadata, written last by rank 0.
META_FILE = "meta.pt"


#: The ``meta.pt`` entry that marks a checkpoint written by this package.
PACKAGE_KEY = "lightning_torchrec"


#: Every file name a save of this package (or DCP within it) writes, but the manifest.
OUR_FILES = re.compile(
    r"\.metadata|meta\.pt|__\d+_\d+\.distcp|__\d+\.metadata|param_groups\.rank\d+\.pt"
)


def param_groups_file(path: Path, rank: int) -> Path:
    """The file of ``rank``'s optimizer hyper-parameters inside checkpoint ``path``.

    Args:
        path: the checkpoint directory.
        rank: the rank.

    Returns:
        ``path / "param_groups.rank{rank}.pt"``.
    """
    return path / f"param_groups.rank{rank}.pt"
