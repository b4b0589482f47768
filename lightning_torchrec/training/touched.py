"""Touched ids: the rows each table's training lookups reached since the last delta was published.

TorchRec's ``ModelDeltaTracker`` (``DistributedModelParallel.init_torchrec_delta_tracker``,
``TrackingMode.ID_ONLY``) records the ids of every lookup of a sharded ``EmbeddingBagCollection``
or ``EmbeddingCollection`` after its input distribution: each rank sees only the rows it owns,
as *local* row ids of its shard (a row-wise shard starting at row 500 reports row 503 as 3).
:class:`TouchedIds` owns one tracker per sharded model, records only lookups in training mode
(a validation forward reads rows, it does not change them), turns local ids into the tables'
global row ids and keeps what was drained in a state that a checkpoint can hold, so a run killed
and resumed loses none of them. The per-step cost is TorchRec's: the values tensor of each
lookup appended to a list; ids are made unique only at :meth:`TouchedIds.drain`.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torchrec.distributed.mc_embedding_modules import (
    BaseShardedManagedCollisionEmbeddingCollection,
)
from torchrec.distributed.model_tracker.types import DeltaTrackerConfig, TrackingMode
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.compat.upstream import embedding_lookups
from lightning_torchrec.distributed import all_gather
from lightning_torchrec.sharding.layout import shard_info
from lightning_torchrec.sharding.tables import embedding_tables, table_of_key


def _inside_managed_collision(module: nn.Module, fqn: str) -> bool:
    """Whether the tracked module at ``fqn`` is the collection inside a managed-collision one."""
    parent = fqn.rsplit(".", 1)[0] if "." in fqn else ""
    try:
        holder = module.get_submodule(parent)
    except AttributeError:
        return False
    return isinstance(holder, BaseShardedManagedCollisionEmbeddingCollection)


class TouchedIds:
    """The global row ids of each table that training touched since the last :meth:`clear`.

    Call :meth:`attach` once the model is sharded; :meth:`drain` moves what the tracker
    recorded into the pending sets; :meth:`gathered` unites every rank's (collective);
    :meth:`state_dict` / :meth:`load_state_dict` carry the pending sets through a checkpoint.
    """

    def __init__(self) -> None:
        self._pending: dict[str, list[torch.Tensor]] = {}
        self._tracker: Any = None
        self._handles: list[Any] = []
        self._recorded = False
        #: tracker fqn -> (table name, row offset of this rank's shard)
        self._where: dict[str, tuple[str, int]] = {}

    @property
    def attached(self) -> bool:
        """Whether a tracker records lookups."""
        return self._tracker is not None

    def attach(self, dmp: Any, module: nn.Module) -> None:
        """Starts recording the training lookups of a sharded model (drops what it held).

        Args:
            dmp: the ``DistributedModelParallel``.
            module: the module holding the tables (the LightningModule), for the shards' rows.

        Raises:
            ValueError: if a rank holds several row ranges of one table (its local ids could
                not be told apart).
        """
        tracker = dmp.init_torchrec_delta_tracker(
            DeltaTrackerConfig(tracking_mode=TrackingMode.ID_ONLY, delete_on_read=True)
        )
        tracker.clear()
        for handle in self._handles:
            handle.remove()
        self._handles = []
        self._recorded = False
        record = tracker.record_lookup

        def record_training(kjt: Any, states: Any, emb_module: Any = None, *rest: Any) -> None:
            if emb_module is None or emb_module.training:
                record(kjt, states, emb_module, *rest)
                self._recorded = True

        for fqn, tracked in tracker.get_tracked_modules().items():
            # Replaces the tracker's own function (registering again would log a warning).
            tracked.post_lookup_tracker_fn = record_training
            if _inside_managed_collision(module, fqn):
                self._watch_lookups(tracked, record_training)
        offsets: dict[str, int] = {}
        for key, tensor in embedding_tables(module).items():
            starts = {s.row_offset for s in shard_info(tensor).shards}
            if len(starts) > 1:
                raise ValueError(
                    f"{key}: this rank holds rows of it from offsets {sorted(starts)}; touched "
                    "ids cannot be tracked for a plan that gives a rank several row ranges of "
                    "one table"
                )
            offsets[table_of_key(key)] = next(iter(starts), 0)
        self._where = {
            fqn: (table, offsets.get(table, 0)) for table, fqn in tracker.table_to_fqn.items()
        }
        self._tracker = tracker

    def _watch_lookups(self, tracked: nn.Module, record: Any) -> None:
        """Records the ids reaching ``tracked``'s lookups (its post-lookup hook never runs)."""

        def before_lookup(lookup: nn.Module, args: tuple[Any, ...]) -> None:
            if args and isinstance(args[0], KeyedJaggedTensor):
                record(args[0], None, tracked)

        self._handles = [
            lookup.register_forward_pre_hook(before_lookup) for lookup in embedding_lookups(tracked)
        ]

    def drain(self) -> None:
        """Moves what the tracker recorded since the last drain into the pending sets."""
        if self._tracker is None or not self._recorded:
            # TorchRec 1.8's store keeps a table's emptied list after a read, and reading it
            # again before a lookup fails (torch.cat of no tensors): read only after lookups.
            return
        self._recorded = False
        found = self._tracker.get_unique_ids()
        self._tracker.step()  # later lookups go to the next batch index: read by the next drain
        for fqn, ids in found.items():
            table, offset = self._where.get(fqn, (table_of_key(f"{fqn}.weight"), 0))
            if ids.numel():
                self._pending.setdefault(table, []).append(ids.to("cpu", torch.int64) + offset)

    def add(self, table: str, ids: torch.Tensor) -> None:
        """Marks global row ids of ``table`` touched (a loop that tracks ids itself).

        Args:
            table: the table's name.
            ids: global row ids.
        """
        self._pending.setdefault(table, []).append(torch.as_tensor(ids, dtype=torch.int64).cpu())

    def local(self) -> dict[str, torch.Tensor]:
        """This rank's pending ids per table (sorted, unique), after a :meth:`drain`.

        Returns:
            ``{table: ids}``.
        """
        self.drain()
        out = {}
        for table, parts in self._pending.items():
            ids = torch.cat(parts).unique() if parts else torch.empty(0, dtype=torch.int64)
            self._pending[table] = [ids]
            out[table] = ids
        return out

    def gathered(self) -> dict[str, torch.Tensor]:
        """Every rank's pending ids united; every rank keeps the union. Collective.

        Returns:
            ``{table: sorted unique global ids}``, the same on every rank.
        """
        united: dict[str, list[torch.Tensor]] = {}
        for share in all_gather(self.local()):
            for table, ids in share.items():
                united.setdefault(table, []).append(ids)
        out = {t: torch.cat(parts).unique() for t, parts in sorted(united.items())}
        self._pending = {t: [ids] for t, ids in out.items()}
        return out

    def clear(self) -> None:
        """Forgets the pending ids (after a publish); what the tracker recorded since stays."""
        self._pending = {}

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The pending ids of every rank, united (collective: every rank calls it).

        Returns:
            ``{table: ids}``.
        """
        return self.gathered()

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restores pending ids (a checkpoint's union: every rank holds all of them).

        Args:
            state: what :meth:`state_dict` returned.

        Raises:
            ValueError: if an entry is not a 1-D integer tensor.
        """
        pending = {}
        for table, ids in state.items():
            if not isinstance(ids, torch.Tensor) or ids.dim() != 1 or ids.is_floating_point():
                raise ValueError(f"touched ids of {table!r}: not a 1-D integer tensor")
            pending[str(table)] = [ids.to(torch.int64)]
        self._pending = pending
