"""How many ranks share a node, as TorchRec's sharding reads it.

The planner takes the local world size as an argument (``Topology(local_world_size=...)``), but
TorchRec's ``table_row_wise`` and ``grid_shard`` sharding build their intra-node and cross-node
process groups from the ``LOCAL_WORLD_SIZE`` environment variable
(``torchrec.distributed.comm.get_local_size``). torchrun sets it; Lightning's own launcher and
SLURM do not, and TorchRec then assumes 8 ranks per node (or one node of all ranks), which
disagrees with the plan on a job of several nodes. :func:`local_world_size_env` sets it while a
model is sharded.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator

#: The environment variable TorchRec reads.
LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"


def resolve_local_world_size(local_world_size: int | None, world_size: int) -> int:
    """The ranks per node: the one given, else ``LOCAL_WORLD_SIZE``, else every rank on one node.

    Args:
        local_world_size: the launcher's processes per node, when known.
        world_size: the number of ranks.

    Returns:
        The ranks per node.

    Raises:
        ValueError: when it does not divide ``world_size`` (nodes of different sizes).
    """
    local = local_world_size or int(os.environ.get(LOCAL_WORLD_SIZE, world_size))
    if local < 1 or world_size % local:
        raise ValueError(
            f"{local} ranks per node do not divide the world of {world_size} ranks: every node "
            "must run the same number of processes (Trainer(devices=...) per node, torchrun's "
            "--nproc-per-node)."
        )
    return local


@contextlib.contextmanager
def local_world_size_env(local_world_size: int) -> Iterator[None]:
    """Sets ``LOCAL_WORLD_SIZE`` for TorchRec's sharding inside the block; restores it after.

    Args:
        local_world_size: the ranks per node the plan was made for.

    Yields:
        Nothing.

    Raises:
        ValueError: when ``LOCAL_WORLD_SIZE`` is set to another number (the launcher and the
            plan disagree on the ranks per node).
    """
    before = os.environ.get(LOCAL_WORLD_SIZE)
    if before is not None and int(before) != local_world_size:
        raise ValueError(
            f"LOCAL_WORLD_SIZE is {before}, but the plan was made for {local_world_size} ranks "
            "per node: give the strategy the devices per node the launcher started."
        )
    os.environ[LOCAL_WORLD_SIZE] = str(local_world_size)
    try:
        yield
    finally:
        if before is None:
            del os.environ[LOCAL_WORLD_SIZE]
