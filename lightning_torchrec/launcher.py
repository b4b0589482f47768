"""Fork/spawn launching (notebooks) for sharded models."""

from __future__ import annotations

import os
import shutil
from typing import Any

from lightning.pytorch.strategies.launchers.multiprocessing import (
    _MultiProcessingLauncher,
    _WorkerOutput,
)
from typing_extensions import override


class ShardedResultsLauncher(_MultiProcessingLauncher):
    """Lightning's fork/spawn launcher, minus shipping rank 0's weights back to the parent.

    Lightning's launcher saves rank 0's ``state_dict`` and loads it into the parent's module. A
    sharded model's state holds only rank 0's shards, and the parent's module is the unsharded
    one (tables on the meta device), so that load fails. The trainer state, ``callback_metrics``
    and the return value still come back; weights are read from checkpoints or loggers.
    """

    @override
    def _collect_rank_zero_results(self, trainer: Any, results: Any) -> _WorkerOutput | None:
        out = super()._collect_rank_zero_results(trainer, results)
        if out is not None and out.weights_path is not None:
            shutil.rmtree(os.path.dirname(out.weights_path), ignore_errors=True)
            out = out._replace(weights_path=None)
        return out
