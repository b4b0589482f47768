"""Tests of the sharding-aware norms with torch.distributed initialised (gloo, CPU).

First, in-process tests on a one-rank process group (ShardedTensor with several local shards,
DTensor). Then real 2-process tests on fused TorchRec tables: one spawn builds one model holding a
table of every CPU sharding type (plan made by the planner from per-table
``ParameterConstraints``); each rank saves what it computed (see norms_worker.py) and the tests
check it against the known full tables.
"""

from __future__ import annotations

import socket
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp
from torch import nn
from torch.distributed._shard.sharded_tensor import Shard, ShardMetadata, init_from_local_shards
from torch.distributed.tensor import Replicate, distribute_tensor, init_device_mesh
from torch.distributed.tensor import Shard as DShard
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig

from lightning_torchrec.sharding.layout import log_sharded_tensor_content, shard_info
from lightning_torchrec.sharding.planning import maybe_shard_model
from lightning_torchrec.sharding.tables import embedding_tables
from lightning_torchrec.training.ebc_norms import log_ebc_norms
from lightning_torchrec.training.norms import (
    l1_norm,
    l2_norm,
    max_norm,
    weights_to_log,
)
from tests.helpers import one_rank_group  # noqa: F401 - a fixture
from tests.scripts.factory import table_wise

sys.path.insert(0, str(Path(__file__).resolve().parent))  # spawned ranks import the worker
import norms_worker  # noqa: E402
from norms_worker import SAMPLE, TABLES, full_table, table_key  # noqa: E402

WORLD_SIZE = 2
KEYS = {t: table_key(t) for t in TABLES}


# ---------------------------------------------------------------- one-rank process group


class FakeShardedEBC(nn.Module):
    """Quacks like TorchRec's ShardedEmbeddingBagCollection: global views of its tables."""

    def __init__(self, tables: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.embedding_bags = nn.ModuleDict({t: nn.Module() for t in tables})
        for t in tables:
            self.embedding_bags[t].register_parameter("weight", nn.Parameter(torch.empty(0)))
        self._model_parallel_name_to_sharded_tensor = dict(tables)
        self._model_parallel_name_to_dtensor: dict[str, torch.Tensor] = {}


def _two_column_shards(full: torch.Tensor) -> torch.Tensor:
    rows, cols = full.shape
    half = cols // 2
    shards = [
        Shard(full[:, :half].clone(), ShardMetadata([0, 0], [rows, half], "rank:0/cpu")),
        Shard(full[:, half:].clone(), ShardMetadata([0, half], [rows, cols - half], "rank:0/cpu")),
    ]
    return init_from_local_shards(shards, rows, cols)


@pytest.mark.usefixtures("one_rank_group")
def test_sharded_tensor_with_two_local_shards() -> None:
    full = torch.randn(6, 8)
    sharded = _two_column_shards(full)
    info = shard_info(sharded)
    assert not info.replicated and info.counted and info.global_shape == (6, 8)
    assert [(s.row_offset, s.col_offset) for s in info.shards] == [(0, 0), (0, 4)]
    gathered = log_sharded_tensor_content("w", "t", sharded)
    assert gathered is not None and torch.equal(gathered, full)

    model = nn.ModuleDict({"ebc": FakeShardedEBC({"t": sharded})})
    assert list(embedding_tables(model)) == ["ebc.embedding_bags.t.weight"]
    expected = {l2_norm: full.norm(), l1_norm: full.abs().sum(), max_norm: full.abs().max()}
    for fn, value in expected.items():
        logged = weights_to_log(model, fn)
        assert list(logged) == [key := f"model/{fn.__name__}/ebc.embedding_bags.t.weight"]
        torch.testing.assert_close(logged[key], value)

    def numel(t: torch.Tensor) -> torch.Tensor:
        return torch.tensor(t.numel())

    per_rank = weights_to_log(model, numel)  # custom: per local shard of this rank
    assert {k: int(v) for k, v in per_rank.items()} == {
        "model/numel/ebc.embedding_bags.t.weight/rank0/shard0": 24,
        "model/numel/ebc.embedding_bags.t.weight/rank0/shard1": 24,
    }
    logged = log_ebc_norms(embedding_tables(model), list(embedding_tables(model)))
    torch.testing.assert_close(
        logged["ebc.embedding_bags.t.weight-norm-0"], full.norm(dim=1).mean()
    )


@pytest.mark.usefixtures("one_rank_group")
def test_dtensor_shard_and_replicate() -> None:
    mesh = init_device_mesh("cpu", (1,))
    full = torch.randn(4, 3)
    sharded = distribute_tensor(full, mesh, [DShard(1)])
    info = shard_info(sharded)
    assert not info.replicated and info.global_shape == (4, 3)
    assert [(s.row_offset, s.col_offset) for s in info.shards] == [(0, 0)]
    assert shard_info(distribute_tensor(full, mesh, [Replicate()])).replicated
    gathered = log_sharded_tensor_content("w", "t", sharded)
    assert gathered is not None and torch.equal(gathered, full)


@pytest.mark.usefixtures("one_rank_group")
def test_norms_of_a_sharded_model_do_not_build_its_state_dict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    ebc = EmbeddingBagCollection(
        tables=[
            EmbeddingBagConfig(name="t", embedding_dim=4, num_embeddings=8, feature_names=["f"])
        ],
        device=torch.device("meta"),
    )
    dmp = maybe_shard_model(ebc, torch.device("cpu"), constraints=table_wise(["t"]))
    expected = dmp.state_dict()["embedding_bags.t.weight"].local_shards()[0].tensor.norm()

    def no_state_dict(*args: object, **kwargs: object) -> None:
        raise AssertionError("weights_to_log must not call state_dict()")

    monkeypatch.setattr(nn.Module, "state_dict", no_state_dict)
    logged = weights_to_log(dmp)
    assert list(logged) == ["model/l2_norm/embedding_bags.t.weight"]
    torch.testing.assert_close(logged["model/l2_norm/embedding_bags.t.weight"], expected)


# ---------------------------------------------------------------- two ranks, spawned


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    out_dir = tmp_path_factory.mktemp("norms_ranks")
    mp.start_processes(
        norms_worker.run,
        args=(WORLD_SIZE, _free_port(), str(out_dir)),
        nprocs=WORLD_SIZE,
        start_method="spawn",
    )
    return [torch.load(out_dir / f"rank{r}.pt", weights_only=False) for r in range(WORLD_SIZE)]


def _owners(ranks: list[dict], table: str) -> list[int]:
    return [r for r, res in enumerate(ranks) if res["naive_local_mean"][table] != -1.0]


def test_plan_has_every_sharding_type_and_fill_reached_tbe(ranks: list[dict]) -> None:
    for res in ranks:
        assert res["plan_types"] == {t: kind for t, (_, _, kind) in TABLES.items()}
    # the values written through the ShardedTensor shards are the fused weights' values
    for r, res in enumerate(ranks):
        for t in ("tw_a", "tw_b", "dp"):
            if r in _owners(ranks, t):
                torch.testing.assert_close(res["tbe_slices"][t], full_table(t))
    assert _owners(ranks, "tw_a") != _owners(ranks, "tw_b")  # balanced: one table each
    for t in ("tw_a", "tw_b"):
        assert len(_owners(ranks, t)) == 1


def test_names_equal_unwrapped_model_and_no_duplicates(ranks: list[dict]) -> None:
    for res in ranks:
        expected = [f"model/l2_norm/{n}" for n in res["unwrapped_names"]]
        assert sorted(res["l2"]) == sorted(expected)
        assert len(res["l2"]) == len(expected)
        assert sorted(res["table_keys"]) == sorted(res["state_table_keys"])
        assert sorted(res["table_keys"]) == sorted(KEYS.values())


@pytest.mark.parametrize("kind", ["l2", "l1", "max"])
def test_table_norms_are_whole_table_norms_on_every_rank(ranks: list[dict], kind: str) -> None:
    ord_ = {"l2": 2, "l1": 1, "max": float("inf")}[kind]
    fn = {"l2": "l2_norm", "l1": "l1_norm", "max": "max_norm"}[kind]
    for res in ranks:
        for t, key in KEYS.items():
            expected = torch.linalg.vector_norm(full_table(t), ord=ord_)
            torch.testing.assert_close(res[kind][f"model/{fn}/{key}"], expected)


def test_torch_norm_and_linalg_norm_count_as_whole_table_l2(ranks: list[dict]) -> None:
    for res in ranks:
        assert set(res["torch_norms"]) == {
            "model/norm/dense.weight",
            f"model/linalg_norm/{KEYS['cw']}",
        }
        torch.testing.assert_close(
            res["torch_norms"][f"model/linalg_norm/{KEYS['cw']}"], full_table("cw").norm()
        )


def test_gathered_tables_equal_full_tables_on_rank0_only(ranks: list[dict]) -> None:
    for t in TABLES:
        torch.testing.assert_close(ranks[0]["gathered"][t], full_table(t), rtol=0, atol=0)
        assert ranks[1]["gathered"][t] is None
        # and the logged norm is the norm of what was gathered
        torch.testing.assert_close(
            ranks[1]["l2"][f"model/l2_norm/{KEYS[t]}"], ranks[0]["gathered"][t].norm()
        )


def test_replicated_dense_params_are_not_double_counted(ranks: list[dict]) -> None:
    for res in ranks:
        torch.testing.assert_close(
            res["l2"]["model/l2_norm/dense.weight"], res["dense_weight"].norm()
        )
        torch.testing.assert_close(
            res["l1"]["model/l1_norm/dense.bias"], res["dense_bias"].abs().sum()
        )
    torch.testing.assert_close(ranks[0]["dense_weight"], ranks[1]["dense_weight"])


def test_ebc_norms_equal_exact_local_mean_when_sample_covers_rows(ranks: list[dict]) -> None:
    for res in ranks:
        for name in ("ebc_state_dict", "ebc_tables", "dtensor_ebc"):
            logged = res[name]
            assert len(logged) == len(TABLES) * (WORLD_SIZE + 1)
            for t, key in KEYS.items():
                for r in range(WORLD_SIZE):
                    expected = torch.tensor(ranks[r]["naive_local_mean"][t])
                    torch.testing.assert_close(logged[f"{key}-norm-{r}"], expected)


def test_table_wise_non_owner_reports_minus_one(ranks: list[dict]) -> None:
    for t in ("tw_a", "tw_b"):
        (owner,) = _owners(ranks, t)
        other = 1 - owner
        exact = full_table(t).norm(dim=1).mean()
        for res in ranks:
            assert res["ebc_tables"][f"{KEYS[t]}-norm-{other}"].item() == -1.0
            torch.testing.assert_close(res["ebc_tables"][f"{KEYS[t]}-norm-{owner}"], exact)
            torch.testing.assert_close(res["ebc_tables"][f"{KEYS[t]}-norm-mean"], exact)


def test_global_mean_is_over_whole_rows_and_counts_replicated_once(ranks: list[dict]) -> None:
    logged = ranks[0]["ebc_tables"]
    # data-parallel: both ranks hold all rows; the mean is the table's, not a doubled count
    dp_exact = full_table("dp").norm(dim=1).mean()
    torch.testing.assert_close(logged[f"{KEYS['dp']}-norm-mean"], dp_exact)
    # column-wise: each rank holds every row's local columns; the mean is over WHOLE rows,
    # combining the column parts held by different ranks
    for t in ("cw", "twcw"):
        per_rank = torch.tensor([ranks[r]["naive_local_mean"][t] for r in range(WORLD_SIZE)])
        whole_rows = full_table(t).norm(dim=1).mean()
        torch.testing.assert_close(logged[f"{KEYS[t]}-norm-mean"], whole_rows)
        # per-rank values are over local columns only: below whole-row norms
        assert (per_rank < whole_rows).all()


def test_sampled_ebc_norms_are_deterministic_and_seeded(ranks: list[dict]) -> None:
    for res in ranks:
        first, again, other_seed = res["sampled"]
        assert first.keys() == again.keys() == res["ebc_tables"].keys()
        for key in first:
            torch.testing.assert_close(first[key], again[key], rtol=0, atol=0)
        assert any(not torch.equal(first[k], other_seed[k]) for k in first)
        # ranks agree on every value (all-gathered)
        for key in first:
            torch.testing.assert_close(first[key], ranks[0]["sampled"][0][key], rtol=0, atol=0)
    # a sample of SAMPLE rows is a sample: not the exact mean of a table-wise table
    (owner,) = _owners(ranks, "tw_a")
    key = f"{KEYS['tw_a']}-norm-{owner}"
    assert ranks[0]["sampled"][0][key] != ranks[0]["ebc_tables"][key]
    assert SAMPLE < TABLES["tw_a"][0]


def test_custom_fn_is_per_rank_on_local_shards(ranks: list[dict]) -> None:
    for r, res in enumerate(ranks):
        custom = res["custom"]
        # replicated params: plain key, whole tensor
        assert custom[f"model/numel/{KEYS['dp']}"].item() == full_table("dp").numel()
        assert custom["model/numel/dense.weight"].item() == 12
        for t in ("tw_a", "tw_b"):
            key = f"model/numel/{KEYS[t]}/rank{r}"
            if r in _owners(ranks, t):
                assert custom[key].item() == full_table(t).numel()
            else:
                assert not any(k.startswith(f"model/numel/{KEYS[t]}") for k in custom)
        assert custom[f"model/numel/{KEYS['cw']}/rank{r}"].item() == 30 * 8
        # table-column-wise: 3 column shards of 24 x 8 over 2 ranks; one key per local shard
        twcw = {k: v.item() for k, v in custom.items() if KEYS["twcw"] in k}
        assert set(twcw.values()) == {24 * 8}
        prefix = f"model/numel/{KEYS['twcw']}/rank{r}"
        if len(twcw) == 1:
            assert list(twcw) == [prefix]
        else:
            assert sorted(twcw) == [f"{prefix}/shard{i}" for i in range(len(twcw))]
    counts = [sum(KEYS["twcw"] in k for k in res["custom"]) for res in ranks]
    assert sorted(counts) == [1, 2]


def test_dtensor_state_gives_the_same_whole_table_norms(ranks: list[dict]) -> None:
    for res in ranks:
        sharded = {
            k
            for k, (_, _, kind) in zip(KEYS.values(), TABLES.values(), strict=True)
            if kind != "data_parallel"
        }
        assert {k for k, v in res["dtensor_types"].items() if v == "DTensor"} == sharded
        for t, key in KEYS.items():
            torch.testing.assert_close(
                res["dtensor_l2"][f"model/l2_norm/{key}"], full_table(t).norm()
            )


def test_a_bad_return_on_one_rank_is_raised_on_every_rank(ranks: list[dict]) -> None:
    """Rank 1 raised alone (an unnamed RuntimeError) and left rank 0 in all_gather_object."""
    for rank, res in enumerate(ranks):
        kind, message = res["bad_return"]
        assert kind == "ValueError", (rank, kind, message)
        assert "norms_worker.none_on_rank_one returned None (a missing return?)" in message
        assert "'model/none_on_rank_one/dense.weight'" in message  # rank 1's keys, on both ranks
