"""The job's own key-value store, which torch.distributed keeps behind a private accessor.

Every rank of a process group reaches the store it rendezvoused in (the TCPStore served by rank 0
or by torchrun's agent). torch has no public getter for the default group's store; this one
reads it through ``distributed_c10d._get_default_store`` (present since torch 1.x).
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
