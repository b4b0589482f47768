"""Managed-collision tables in the served model: raw ids remapped as the trained model did.

A ``ManagedCollisionEmbeddingCollection`` (or ``...BagCollection``) puts one
``MCHManagedCollisionModule`` per table in front of its embedding module. TorchRec shards it
row-wise only, and its state with it (``torchrec/distributed/mc_modules.py``,
``torchrec/modules/mc_modules.py``):

- the input dist sends each raw id to one rank: the range ``[0, input_size)`` is cut into
  ``buckets`` blocks of ``ceil(input_size / buckets)`` ids, ``buckets / W`` consecutive blocks
  per rank (``W`` ranks), so rank ``id // (ceil(input_size / buckets) * buckets / W)`` gets it
  (fbgemm's ``block_bucketize_sparse_features``, checked against it);
- that rank's module looks the id up among the raw ids it admitted, sorted, all but its last
  slot (``searchsorted``); a match gives the id's global row, anything else the shard's last
  row (each shard keeps its last row for the ids of its bucket it has not admitted);
- in eval mode nothing is admitted or evicted.

:class:`RawIdRemap` is that lookup for every table at once, as plain tensors: the admitted ids
of all shards (each shard's only the ids of its own bucket, so together they are sorted), their
rows, and each shard's fallback row; each table's entries are as many as its slots (less one
per shard), the unused ones :data:`EMPTY` as in the MCH module, so a delta that admits or
evicts ids rewrites the tensors in place (``export/fresh.py`` builds them, from the export's
MCH modules here and from a delta's buffers there). It is part of the artifact, behind the
same id check as plain tables (:class:`~lightning_torchrec.export.validate.IdRangeCheck`), here
against the raw-id range ``[0, input_size)``: an id outside it is refused, as the trained
model's buckets do not cover it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torchrec.modules.mc_embedding_modules import BaseManagedCollisionEmbeddingCollection
from torchrec.modules.mc_modules import MCHManagedCollisionModule
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.compat.managed_collision import managed_parts, mch_state
from lightning_torchrec.export.fresh import EMPTY, bucket_width, served_remap
from lightning_torchrec.export.validate import IdRangeCheck

#: The managed-collision embedding modules the export serves.
MANAGED_MODULES = (BaseManagedCollisionEmbeddingCollection,)

__all__ = [
    "EMPTY",
    "MANAGED_MODULES",
    "ManagedEmbeddings",
    "ManagedTable",
    "RawIdRemap",
    "bucket_width",
    "managed_sources",
    "managed_tables",
    "raw_id_bounds",
    "served_managed",
]


@dataclass(frozen=True)
class ManagedTable:
    """One managed table as served.

    Attributes:
        name: the table.
        features: its features.
        input_size: the raw-id range ``[0, input_size)``.
        buckets: the module's buckets.
    """

    name: str
    features: tuple[str, ...]
    input_size: int
    buckets: int


def managed_tables(module: nn.Module) -> list[ManagedTable]:
    """The tables of a managed-collision embedding module, refusing what cannot be served.

    Args:
        module: a ``ManagedCollisionEmbeddingCollection`` / ``...BagCollection``.

    Returns:
        Its tables, in the embedding module's order.

    Raises:
        TypeError: for a table whose managed-collision module is not an
            ``MCHManagedCollisionModule`` (e.g. ``HashZchManagedCollisionModule``) or hashes
            its input with a function (``input_hash_func``), naming the table.
    """
    parts = managed_parts(module)
    tables = []
    for name, mc in parts.modules.items():
        kind = type(mc).__name__
        if not isinstance(mc, MCHManagedCollisionModule):
            raise TypeError(
                f"table {name!r}: its managed-collision module is a {kind}; the export serves "
                "MCHManagedCollisionModule only"
            )
        if mch_state(mc).hash_func is not None:
            raise TypeError(
                f"table {name!r}: its MCHManagedCollisionModule hashes raw ids with an "
                "input_hash_func, which cannot be part of the artifact; hash the ids before "
                "the model instead"
            )
    configs = getattr(parts.embeddings, "embedding_bag_configs", None)
    configs = configs() if callable(configs) else parts.embeddings.embedding_configs()
    for c in configs:
        mc = parts.modules[c.name]
        tables.append(ManagedTable(c.name, tuple(c.feature_names), mc.input_size(), mc.buckets()))
    return tables


def _served_state(
    table: ManagedTable, mc: nn.Module
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
    """``(ids, their rows, fallback row per shard, ids per shard)`` of one table (``fresh``)."""
    state = mch_state(mc)
    return served_remap(
        table.name,
        state.sorted_raw_ids,
        state.rows,
        state.segments,
        table.input_size,
        table.buckets,
    )


def managed_sources(module: nn.Module, prefix: str) -> list[dict[str, Any]]:
    """Where a delta carries each managed table's state, for the served remap's rebuild.

    A delta's ``dense.pt`` holds the MCH modules' buffers under the inference model's names;
    the export records which are the remap's sources, so a server rebuilds the remap from
    them (``fresh.served_remap``) as the export built it.

    Args:
        module: the float managed-collision module (its MCH modules hold the exported state).
        prefix: its path in the inference model (``""`` for the model itself).

    Returns:
        Per table in the remap's order: ``{"table", "input_size", "buckets", "rows",
        "shards", "sorted_raw_ids", "remapped_ids", "segments", "other"}``: the
        names of the three source buffers, and ``other`` the module's other state (eviction
        metadata: carried by deltas, not served).
    """
    parts = managed_parts(module)
    out = []
    for table in managed_tables(module):
        mc = parts.modules[table.name]
        state = mch_state(mc)
        at = f"{prefix}." if prefix else ""
        path = at + next(n for n, m in module.named_modules() if m is mc)
        names = {id(t): f"{path}.{n}" for n, t in mc.state_dict(keep_vars=True).items()}
        sources = {
            "sorted_raw_ids": names[id(state.sorted_raw_ids)],
            "remapped_ids": names[id(state.rows)],
            "segments": names[id(state.output_segments)],
        }
        shards = len(state.segments) - 1
        rows = int(state.sorted_raw_ids.shape[0])
        out.append(
            {
                "table": table.name,
                "input_size": table.input_size,
                "buckets": table.buckets,
                "rows": rows,
                "shards": shards,
                **sources,
                "other": sorted(set(names.values()) - set(sources.values())),
            }
        )
    return out


class RawIdRemap(nn.Module):
    """Remaps raw ids to table rows, for every managed table of one embedding module.

    Per table: the admitted raw ids of every shard (sorted, then :data:`EMPTY` up to
    ``rows - shards + 1`` entries: a size that admissions and evictions do not change), their
    rows, the fallback row of each shard and the ids per shard. An id ``v`` of the table's
    feature gets the row of ``v`` if admitted, else its shard's fallback row
    (shard ``v // width``). Ids are expected in ``[0, input_size)`` (checked before).

    Args:
        features: ``{feature: table index}``.
        states: per table, ``(sorted ids, rows, fallback rows, width)``.
    """

    def __init__(
        self,
        features: dict[str, int],
        states: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]],
    ) -> None:
        super().__init__()
        self.table_of: dict[str, int] = dict(features)
        self.widths: list[int] = [s[3] for s in states]
        self.starts: list[int] = [0]
        self.fallback_starts: list[int] = [0]
        for ids, _, fallback, _ in states:
            self.starts.append(self.starts[-1] + ids.shape[0])
            self.fallback_starts.append(self.fallback_starts[-1] + fallback.shape[0])
        self.register_buffer("sorted_ids", torch.cat([s[0] for s in states]))
        self.register_buffer("rows", torch.cat([s[1] for s in states]))
        self.register_buffer("fallback", torch.cat([s[2] for s in states]))

    def _remap(self, table: int, ids: torch.Tensor) -> torch.Tensor:
        """The rows of one table's raw ids."""
        held = self.sorted_ids[self.starts[table] : self.starts[table + 1]]
        rows = self.rows[self.starts[table] : self.starts[table + 1]]
        start, end = self.fallback_starts[table], self.fallback_starts[table + 1]
        fallback = self.fallback[start:end]
        at = torch.searchsorted(held, ids)  # below the table's last entry (int64 max)
        shard = torch.div(ids, self.widths[table], rounding_mode="floor").clamp(0, end - start - 1)
        return torch.where(held[at] == ids, rows[at], fallback[shard])

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Remaps the raw ids of the managed features (others pass unchanged).

        Args:
            features: raw ids.

        Returns:
            The same keys and lengths, with rows for values.
        """
        keys = features.keys()
        lengths = features.lengths()
        # Each feature's ids are searched in its own table only (ids are feature-major).
        sizes: list[int] = lengths.view(len(keys), -1).sum(1).tolist()
        parts = torch.split(features.values(), sizes)
        out: list[torch.Tensor] = []
        for i in range(len(keys)):
            table = self.table_of.get(keys[i], -1)
            out.append(parts[i] if table < 0 else self._remap(table, parts[i]))
        values = torch.cat(out) if len(out) > 0 else features.values()
        return KeyedJaggedTensor(
            keys=keys, values=values, lengths=lengths, weights=features.weights_or_none()
        )


class ManagedEmbeddings(nn.Module):
    """A managed-collision embedding module as served: check raw ids, remap, look up.

    Returns what TorchRec's module returns: ``(embeddings, remapped features or None)``.

    Args:
        check: the raw-id range check of its features.
        remap: the remap.
        embeddings: the (quantized) ``EmbeddingCollection`` / ``EmbeddingBagCollection``.
        return_remapped: return the remapped features too (as the float module was built).
    """

    def __init__(
        self, check: IdRangeCheck, remap: RawIdRemap, embeddings: nn.Module, return_remapped: bool
    ) -> None:
        super().__init__()
        self.check = check
        self.remap = remap
        self.embeddings = embeddings
        self.return_remapped = return_remapped

    def forward(
        self, features: KeyedJaggedTensor, mutate_miss_lengths: bool = True
    ) -> tuple[Any, KeyedJaggedTensor | None]:
        """Checks, remaps and looks up (``mutate_miss_lengths``: TorchRec's; no effect here).

        Args:
            features: raw ids.
            mutate_miss_lengths: ignored (MCH modules do not change lengths).

        Returns:
            ``(embeddings, remapped features or None)``.
        """
        remapped = self.remap(self.check(features))
        looked_up = self.embeddings(remapped)
        if self.return_remapped:
            return looked_up, remapped
        return looked_up, None


def served_managed(module: nn.Module, quantized: nn.Module) -> ManagedEmbeddings:
    """The served form of a managed-collision embedding module, its MCH state loaded.

    Args:
        module: the float ``ManagedCollisionEmbeddingCollection`` / ``...BagCollection`` whose
            MCH modules hold the checkpoint's state (the unsharded ``state_dict``: every
            shard's slice, by global row).
        quantized: the quantized embedding module that replaces its inner one.

    Returns:
        The served module.

    Raises:
        ValueError: for a state not sharded in non-empty row-wise shards whose number divides
            the buckets.
    """
    parts = managed_parts(module)
    tables = managed_tables(module)
    states = [_served_state(t, parts.modules[t.name]) for t in tables]
    features = {f: i for i, t in enumerate(tables) for f in t.features}
    check = IdRangeCheck(
        {f: (t.name, t.input_size) for t in tables for f in t.features}, raw_ids=True
    )
    return ManagedEmbeddings(check, RawIdRemap(features, states), quantized, parts.return_remapped)


def raw_id_bounds(module: nn.Module) -> dict[str, int]:
    """``{feature: input_size}`` of a managed-collision embedding module's features.

    Args:
        module: the float module.

    Returns:
        The raw-id bound of each feature.
    """
    return {f: t.input_size for t in managed_tables(module) for f in t.features}
