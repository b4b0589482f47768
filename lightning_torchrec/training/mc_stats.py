"""Managed-collision tables' counts: open slots, ids admitted and evicted, summed over ranks.

A ``ManagedCollisionEmbeddingCollection`` keeps one ``MCHManagedCollisionModule`` per table (on
a sharded model, one per table and rank: the rank's row-wise shard). Its public API says how many
slots are still open (``open_slots()``; one slot per module is TorchRec's default row for ids it
has not admitted, never filled). How many ids came in or went out is not exposed, so
:class:`ManagedCollisionCounts` keeps the raw ids each module held at the last count and compares:
an id held now and not then was admitted, one held then and not now was evicted. An id admitted
and evicted again between two counts is in neither count; filling an empty slot evicts nothing.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torchrec.modules.mc_modules import MCHManagedCollisionModule

from lightning_torchrec.compat.upstream import mch_held_ids
from lightning_torchrec.distributed import all_gather, collective_device, is_distributed

__all__ = ["COUNTS", "ManagedCollisionCounts", "mch_modules"]

#: What is counted per table, in this order.
COUNTS = ("open_slots", "admitted", "evicted")


def mch_modules(module: nn.Module) -> dict[str, MCHManagedCollisionModule]:
    """The MCH managed-collision modules of a (possibly sharded) model, by table.

    Args:
        module: the model, a ``DistributedModelParallel`` or a LightningModule holding one.

    Returns:
        ``{table name: module}``; a table name that two collections share is replaced by the
        modules' qualified names, so no module is dropped.
    """
    found = [(n, m) for n, m in module.named_modules() if isinstance(m, MCHManagedCollisionModule)]
    tables = [n.rsplit(".", 1)[-1] for n, _ in found]
    if len(set(tables)) == len(tables):
        return {t: m for t, (_, m) in zip(tables, found, strict=True)}
    return dict(found)


class ManagedCollisionCounts:
    """Counts a model's managed-collision tables, over every rank.

    Built on every rank at the same point (it gathers the tables' names: a table without a shard
    on some rank counts zero there); then every call is one ``all_reduce`` on every rank, which
    every rank must make at the same steps.

    Args:
        module: the model.

    Attributes:
        tables: the tables counted, in the order of every rank.
    """

    def __init__(self, module: nn.Module) -> None:
        self._modules = mch_modules(module)
        names = sorted(self._modules)
        self.tables: list[str] = sorted({t for rank in all_gather(names) for t in rank})
        self._held = {t: mch_held_ids(m) for t, m in self._modules.items()}

    def __call__(self) -> dict[str, dict[str, int]]:
        """The counts since the last call (or since construction), summed over ranks.

        Returns:
            ``{table: {"open_slots": n, "admitted": n, "evicted": n}}``.
        """
        rows = []
        for table in self.tables:
            module = self._modules.get(table)
            if module is None:
                rows.append([0] * len(COUNTS))
                continue
            held, before = mch_held_ids(module), self._held[table]
            admitted = int((~torch.isin(held, before)).sum())
            evicted = int((~torch.isin(before, held)).sum())
            rows.append([int(module.open_slots().sum()), admitted, evicted])
            self._held[table] = held
        counts = torch.tensor(rows, dtype=torch.int64).reshape(len(self.tables), len(COUNTS))
        if is_distributed():
            counts = counts.to(collective_device())
            dist.all_reduce(counts)
            counts = counts.cpu()
        return {
            t: dict(zip(COUNTS, map(int, row), strict=True))
            for t, row in zip(self.tables, counts.tolist(), strict=True)
        }
