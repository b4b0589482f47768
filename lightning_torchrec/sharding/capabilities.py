"""What the process group can run: the sharding types a device offers, decided once at set-up.

Row-wise ``EmbeddingBagCollection`` tables (``row_wise``, ``table_row_wise``, ``grid_shard``)
send their pooled outputs back with a reduce-scatter: TorchRec calls ``reduce_scatter_tensor``
for even splits and the list form ``reduce_scatter`` for uneven ones (``table_row_wise``,
variable batches). NCCL has both; gloo has ``reduce_scatter_tensor`` since torch 2.2 and
``reduce_scatter`` since torch 2.8 (see ``docs/concepts.md``). Rather than a fixed list by
device, :func:`probe_reduce_scatter` asks the group once, with tensors of a few numbers, and the
set-up checks and sharders offer or refuse those types by its answer.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist

#: Sharding types whose pooled output dist is a reduce-scatter.
REDUCE_SCATTER_SHARDING_TYPES = frozenset({"row_wise", "table_row_wise", "grid_shard"})


def probe_reduce_scatter(group: Any = None) -> bool:
    """Whether ``group`` runs both reduce-scatter forms and returns the right sums.

    Collective: call on every rank of ``group``. A backend without the collective raises at
    once on every rank (before any message); every rank then agrees on the answer with one
    all-reduce, so no rank offers a type another cannot run.

    Args:
        group: the process group (default: the default group).

    Returns:
        True when every rank got ``sum(rank + 1)`` in its slot from ``reduce_scatter_tensor``
        and from ``reduce_scatter``.
    """
    world = dist.get_world_size(group)
    rank = dist.get_rank(group)
    want = world * (world + 1) / 2
    tensor_out, list_out = torch.zeros(1), torch.zeros(1)
    try:
        with warnings.catch_warnings():
            # torch 2.13 deprecates the name that TorchRec's own output dist still calls.
            warnings.filterwarnings("ignore", ".*reduce_scatter_tensor", FutureWarning)
            dist.reduce_scatter_tensor(tensor_out, torch.full((world,), rank + 1.0), group=group)
        dist.reduce_scatter(list_out, [torch.full((1,), rank + 1.0)] * world, group=group)
        ok = tensor_out.item() == want and list_out.item() == want
    except (RuntimeError, NotImplementedError, ValueError):
        ok = False
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
    return bool(flag.item())


def reduce_scatter_types(compute_device: str, reduce_scatter: bool) -> frozenset[str]:
    """The sharding types of ``EmbeddingBagCollection`` tables this stack cannot run.

    Args:
        compute_device: ``"cpu"`` or ``"cuda"``.
        reduce_scatter: whether the process group has a reduce-scatter
            (:func:`probe_reduce_scatter`).

    Returns:
        ``row_wise``, ``table_row_wise`` and ``grid_shard`` on a CPU group without a
        reduce-scatter; nothing otherwise.
    """
    if compute_device == "cuda" or reduce_scatter:
        return frozenset()
    return REDUCE_SCATTER_SHARDING_TYPES


def missing_collective_note() -> str:
    """The reason given when a reduce-scatter type is refused on CPU, with the torch version.

    Returns:
        A sentence naming the installed torch and what to do.
    """
    return (
        f"needs CUDA or a gloo with reduce-scatter, which this stack's gloo (torch "
        f"{torch.__version__}) lacks"
    )
