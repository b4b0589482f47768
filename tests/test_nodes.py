"""Plans for several nodes: the planner, TorchRec's node groups and the readable plan agree."""

from __future__ import annotations

import os

import pytest
import torch
from torch import nn
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
from torchrec.distributed.planner.types import ParameterConstraints

from lightning_torchrec.sharding.nodes import local_world_size_env, resolve_local_world_size
from lightning_torchrec.sharding.plan_summary import summarize_plan
from lightning_torchrec.sharding.planning import make_planner, make_topology
from lightning_torchrec.sharding.sharders import default_sharders


class Model(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        tables = [
            EmbeddingBagConfig(name=n, embedding_dim=8, num_embeddings=1000, feature_names=[n])
            for n in ("a", "b")
        ]
        self.ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))


@pytest.mark.parametrize(("nodes", "local"), [(2, 2), (2, 4), (4, 2)])
def test_table_row_wise_shards_stay_within_one_node(nodes: int, local: int) -> None:
    """TorchRec runs table_row_wise on CUDA only; planning for CUDA needs no GPU."""
    model = Model()
    twrw = {t: ParameterConstraints(sharding_types=["table_row_wise"]) for t in ("a", "b")}
    planner = make_planner(model, make_topology(nodes * local, local, "cuda"), twrw)
    plan = planner.plan(model, default_sharders(None))
    summary = summarize_plan(model, plan, nodes * local, local)
    assert summary.num_nodes == nodes
    for table in summary.tables:
        assert table.sharding_type == "table_row_wise"
        on = {summary.node_of(r) for r in table.ranks}
        assert len(on) == 1 and len(table.ranks) == local, (table.table, table.ranks)
    markdown = summary.to_markdown().splitlines()
    assert markdown[0] == "| table | module | sharding | kernel | ranks | nodes | rows x dim |"
    assert "| rank | node | table bytes |" in markdown
    assert f"| {nodes * local - 1} | {nodes - 1} | " in summary.to_markdown()


def test_one_node_plans_keep_their_columns() -> None:
    model = Model()
    plan = make_planner(model, make_topology(2, 2, "cpu")).plan(model, default_sharders(None))
    text = summarize_plan(model, plan, 2, 2).to_markdown()
    assert "nodes" not in text and "| rank | table bytes |" in text


def test_local_world_size_comes_from_the_launcher_then_the_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert resolve_local_world_size(None, 4) == 4
    assert resolve_local_world_size(2, 4) == 2
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert resolve_local_world_size(None, 8) == 2
    with pytest.raises(ValueError, match="3 ranks per node do not divide the world of 4"):
        resolve_local_world_size(3, 4)


def test_torchrec_reads_the_plans_ranks_per_node_while_sharding(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    with local_world_size_env(2):
        assert os.environ["LOCAL_WORLD_SIZE"] == "2"
    assert "LOCAL_WORLD_SIZE" not in os.environ  # nothing left behind
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    with local_world_size_env(2):
        pass
    assert os.environ["LOCAL_WORLD_SIZE"] == "2"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "4")
    with pytest.raises(ValueError, match="LOCAL_WORLD_SIZE is 4, but the plan was made for 2"):
        with local_world_size_env(2):
            pass
