"""What torch.distributed keeps behind private accessors: the job's store, collective counts.

* Every rank of a process group reaches the store it rendezvoused in (the TCPStore served by
  rank 0 or by torchrun's agent). torch has no public getter for the default group's store; this
  one reads it through ``distributed_c10d._get_default_store`` (present since torch 1.x).
* A process group counts the collectives started on it (its sequence number,
  ``ProcessGroup._get_sequence_number_for_group``, torch 1.10+, gloo and nccl): ranks that
  started different numbers cannot run one more collective together.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist
from torch.distributed import distributed_c10d


def default_store() -> Any:
    """The default process group's store, or None without one (or when it cannot be reached).

    Returns:
        A ``torch.distributed.Store``, or None.
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return distributed_c10d._get_default_store()
    except (RuntimeError, ValueError):
        return None


def collective_count(group: Any = None) -> int | None:
    """How many collectives this rank has started on ``group`` (default: the default group).

    Args:
        group: a process group, or None for the default one.

    Returns:
        The count, or None where the group does not keep one (or there is no group).
    """
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        chosen = group if group is not None else distributed_c10d._get_default_group()
        return int(chosen._get_sequence_number_for_group())
    except (AttributeError, RuntimeError, ValueError):
        return None
