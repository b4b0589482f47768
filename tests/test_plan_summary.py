"""Unit tests of lightning_torchrec.sharding.plan_summary: where each table went, bytes per rank."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.sharding_plan import (
    column_wise,
    construct_module_sharding_plan,
    data_parallel,
    table_wise,
)
from torchrec.distributed.types import (
    EmbeddingModuleShardingPlan,
    ParameterSharding,
    ShardingPlan,
)
from torchrec.modules.embedding_configs import DataType

from lightning_torchrec.lightning.trainer_setup import write_plan
from lightning_torchrec.sharding.plan_summary import PlanSummary, summarize_plan


def bag(name: str, rows: int, dim: int, **kw: Any) -> EmbeddingBagConfig:
    return EmbeddingBagConfig(
        name=name, embedding_dim=dim, num_embeddings=rows, feature_names=[name], **kw
    )


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            bag("a", 10, 4),
            bag("b", 20, 8, data_type=DataType.FP16),
            bag("c", 20, 8),
            bag("d", 5, 4),
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
        self.dense = nn.Linear(3, 4)


def plan_for(model: Model, **per_table: Any) -> ShardingPlan:
    module_plan = construct_module_sharding_plan(
        model.ebc, per_table, world_size=2, local_size=2, device_type="cpu"
    )
    return ShardingPlan({"ebc": module_plan})


@pytest.fixture(scope="module")
def summary() -> PlanSummary:
    model = Model()
    plan = plan_for(
        model,
        a=table_wise(rank=1),
        b=table_wise(rank=0),
        c=column_wise(ranks=[0, 1]),
        d=data_parallel(),
    )
    return summarize_plan(model, plan, world_size=2)


def test_table_wise_tables_count_on_their_rank_only(summary: PlanSummary) -> None:
    a, b = summary.tables[0], summary.tables[1]
    assert (a.module, a.table, a.sharding_type, a.ranks, a.shape) == (
        "ebc",
        "a",
        "table_wise",
        [1],
        (10, 4),
    )
    assert a.bytes_per_rank == {1: 10 * 4 * 4}
    assert (b.ranks, b.shape) == ([0], (20, 8))
    assert b.bytes_per_rank == {0: 20 * 8 * 2}  # fp16


def test_column_wise_and_data_parallel_bytes(summary: PlanSummary) -> None:
    c, d = summary.tables[2], summary.tables[3]
    assert (c.sharding_type, c.ranks) == ("column_wise", [0, 1])
    assert c.bytes_per_rank == {0: 20 * 4 * 4, 1: 20 * 4 * 4}  # half the columns each
    assert (d.sharding_type, d.ranks) == ("data_parallel", [0, 1])
    assert d.bytes_per_rank == {0: 5 * 4 * 4, 1: 5 * 4 * 4}  # every rank holds all of it


def test_bytes_per_rank_add_up_every_table(summary: PlanSummary) -> None:
    assert summary.world_size == 2
    assert summary.bytes_per_rank == [320 + 320 + 80, 160 + 320 + 80]


def test_to_markdown_lists_tables_then_bytes_per_rank(summary: PlanSummary) -> None:
    lines = summary.to_markdown().splitlines()
    assert lines[:2] == [
        "| table | module | sharding | kernel | ranks | rows x dim |",
        "|---|---|---|---|---|---|",
    ]
    kernel = summary.tables[0].compute_kernel
    assert lines[2] == f"| a | ebc | table_wise | {kernel} | 1 | 10 x 4 |"
    assert lines[4].startswith("| c | ebc | column_wise |") and "| 0,1 | 20 x 8 |" in lines[4]
    assert lines[6:] == [
        "",
        "| rank | table bytes |",
        "|---|---|",
        "| 0 | 720 B |",
        "| 1 | 560 B |",
    ]


def test_a_table_the_model_does_not_have_counts_no_bytes() -> None:
    ps = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0])
    plan = ShardingPlan({"ebc": EmbeddingModuleShardingPlan({"ghost": ps})})
    (ghost,) = summarize_plan(Model(), plan, world_size=1).tables
    assert (ghost.table, ghost.shape, ghost.ranks, ghost.bytes_per_rank) == (
        "ghost",
        (0, 0),
        [0],
        {0: 0},
    )


def test_write_plan_writes_text_and_a_markdown_file(summary: PlanSummary, tmp_path: Path) -> None:
    texts: list[tuple[str, str, int]] = []
    experiment = SimpleNamespace(
        add_text=lambda tag, text, global_step: texts.append((tag, text, global_step))
    )
    tensorboard = SimpleNamespace(experiment=experiment, log_dir=str(tmp_path / "tb"))
    csv = SimpleNamespace(experiment=object(), log_dir=None)
    write_plan(summary, [tensorboard, csv])
    assert texts == [("torchrec/sharding_plan", summary.to_markdown(), 0)]
    assert (tmp_path / "tb" / "sharding_plan.md").read_text() == summary.to_markdown() + "\n"
