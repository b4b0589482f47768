"""A readable account of a sharding plan: where each table went and the bytes per rank.

:func:`log_plan` prints it and writes it to Lightning loggers (TensorBoard text and a
``sharding_plan.md`` file in the log directory).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from torch import nn
from torchrec.distributed.types import ShardingPlan

from lightning_torchrec.sharding.tables import human_bytes, module_table_configs, table_bytes


@dataclass
class TablePlacement:
    """Where one table went.

    Attributes:
        module: path of the embedding module.
        table: table name.
        sharding_type: e.g. ``table_wise``.
        compute_kernel: e.g. ``fused``.
        ranks: ranks holding a part of it.
        shape: ``(rows, dim)``.
        bytes_per_rank: weight bytes each rank holds.
    """

    module: str
    table: str
    sharding_type: str
    compute_kernel: str
    ranks: list[int]
    shape: tuple[int, int]
    bytes_per_rank: dict[int, int] = field(default_factory=dict)


@dataclass
class PlanSummary:
    """A readable account of a sharding plan.

    Attributes:
        world_size: number of ranks.
        tables: one placement per table.
        local_world_size: ranks per node (None: every rank on one node). Rank ``r`` is on node
            ``r // local_world_size``, as torchrun, SLURM and Lightning number them.
    """

    world_size: int
    tables: list[TablePlacement]
    local_world_size: int | None = None

    @property
    def num_nodes(self) -> int:
        """The number of nodes the ranks span."""
        local = self.local_world_size or self.world_size
        return max(self.world_size // max(local, 1), 1)

    def node_of(self, rank: int) -> int:
        """The node a rank runs on.

        Args:
            rank: a global rank.

        Returns:
            Its node rank (0 on one node).
        """
        return rank // (self.local_world_size or self.world_size)

    @property
    def bytes_per_rank(self) -> list[int]:
        """Table weight bytes per rank (optimizer state not included)."""
        totals = [0] * self.world_size
        for t in self.tables:
            for rank, n in t.bytes_per_rank.items():
                totals[rank] += n
        return totals

    def to_markdown(self) -> str:
        """The plan as a Markdown table, then the bytes per rank.

        Returns:
            Markdown text.
        """
        nodes = self.num_nodes > 1  # columns shown only for a job of several nodes
        lines = [
            "| table | module | sharding | kernel | ranks | "
            + ("nodes | " if nodes else "")
            + "rows x dim |",
            "|---|---|---|---|---|---|" + ("---|" if nodes else ""),
        ]
        for t in self.tables:
            ranks = ",".join(map(str, t.ranks))
            on = ",".join(str(n) for n in sorted({self.node_of(r) for r in t.ranks}))
            lines.append(
                f"| {t.table} | {t.module} | {t.sharding_type} | {t.compute_kernel} | "
                f"{ranks} | " + (f"{on} | " if nodes else "") + f"{t.shape[0]} x {t.shape[1]} |"
            )
        if nodes:
            lines += ["", "| rank | node | table bytes |", "|---|---|---|"]
            lines += [
                f"| {r} | {self.node_of(r)} | {human_bytes(b)} |"
                for r, b in enumerate(self.bytes_per_rank)
            ]
        else:
            lines += ["", "| rank | table bytes |", "|---|---|"]
            lines += [f"| {r} | {human_bytes(b)} |" for r, b in enumerate(self.bytes_per_rank)]
        return "\n".join(lines)


def summarize_plan(
    model: nn.Module, plan: ShardingPlan, world_size: int, local_world_size: int | None = None
) -> PlanSummary:
    """Describes ``plan`` for ``model`` (call before sharding; the model may be on meta).

    Args:
        model: the unsharded model the plan was made for.
        plan: its sharding plan.
        world_size: number of ranks.
        local_world_size: ranks per node (None: all on one node).

    Returns:
        The summary.
    """
    tables = []
    for module_path, module_plan in plan.plan.items():
        configs = module_table_configs(model, module_path)
        for name, ps in module_plan.items():  # type: ignore[attr-defined]
            cfg = configs.get(name)
            rows, dim = (cfg.num_embeddings, cfg.embedding_dim) if cfg else (0, 0)
            elem = table_bytes(cfg) // max(rows * dim, 1) if cfg else 4
            per_rank: dict[int, int] = {}
            spec = ps.sharding_spec
            if spec is not None and hasattr(spec, "shards"):
                for shard in spec.shards:
                    rank = shard.placement.rank()
                    per_rank[rank] = per_rank.get(rank, 0) + math.prod(shard.shard_sizes) * elem
            else:
                for rank in ps.ranks or range(world_size):
                    per_rank[rank] = rows * dim * elem
            tables.append(
                TablePlacement(
                    module=module_path,
                    table=name,
                    sharding_type=ps.sharding_type,
                    compute_kernel=ps.compute_kernel,
                    ranks=sorted(per_rank) if per_rank else list(ps.ranks or []),
                    shape=(rows, dim),
                    bytes_per_rank=per_rank,
                )
            )
    return PlanSummary(world_size=world_size, tables=tables, local_world_size=local_world_size)
