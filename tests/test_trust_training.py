"""The training promises on two real gloo ranks (tests/scripts/trust_training_ranks.py).

A sharded model computes the same function as under any other plan and world size; bad input,
uneven data and a second fit are handled on every rank with a named error or just work.
"""

from __future__ import annotations

import csv
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from tests.helpers import load_ranks, run_script
from tests.scripts.factory import QUIET
from tests.scripts.positional import ROWS, Positional, data

PHASE_TIMEOUT_S = 60  # a rank that hangs in a collective would wait 30 minutes


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("trust_training")
    run_script("trust_training_ranks.py", str(out), timeout=300)
    return out


def test_sharded_outputs_keep_the_unsharded_key_order(run: Path) -> None:
    for r in load_ranks(run, "order"):
        # The plan mixes sharding types, which TorchRec groups its outputs by.
        assert set(r["plan"].values()) == {"data_parallel", "table_wise", "column_wise"}
        assert r["keys"] == [f"cat_{i}" for i in range(4)]


def test_the_model_is_the_same_function_on_another_plan_and_world_size(run: Path) -> None:
    import lightning as L
    from torchrec.distributed.planner.types import ParameterConstraints

    from lightning_torchrec import TorchRecStrategy

    ranks = load_ranks(run, "order")
    two_rank = {0: ranks[0]["preds"][0], 1: ranks[1]["preds"][0], 2: ranks[0]["preds"][1]}
    two_rank[3] = ranks[1]["preds"][1]  # DistributedSampler: rank r predicts batches r, r + 2
    table_wise = {
        f"t_cat_{i}": ParameterConstraints(sharding_types=["table_wise"]) for i in range(4)
    }
    trainer = L.Trainer(strategy=TorchRecStrategy(constraints=table_wise), devices=1, **QUIET)
    loader = DataLoader(data().dataset("predict"), batch_size=None)
    one_rank = trainer.predict(Positional(), dataloaders=loader, ckpt_path=run / "order.ckpt")
    assert len(one_rank) == 4
    for i, preds in enumerate(one_rank):
        torch.testing.assert_close(preds, two_rank[i], rtol=0, atol=1e-6)
    assert not torch.allclose(one_rank[0], one_rank[1])  # the predictions are not trivial


def test_unweighted_batch_for_a_weighted_ebc_is_refused_on_every_rank(run: Path) -> None:
    r0, r1 = load_ranks(run, "weighted")
    assert r0["error"] == r1["error"] == "BatchValidationError"
    for r in (r0, r1):
        # Pipelined (the default on 2 CPU ranks): checked before the pipeline sends it ahead.
        assert "rank 1, batch 1 of the epoch (checked at step 0" in r["message"]
        assert "weighted table(s) ['t_cat_0', 't_cat_1', 't_cat_2', 't_cat_3']" in r["message"]


def test_custom_norm_values_of_every_rank_reach_the_logger(run: Path) -> None:
    r0, _ = load_ranks(run, "custom_norm")
    with open(Path(r0["log_dir"]) / "metrics.csv") as f:
        columns = next(csv.reader(f))
    table = "model_and_loss.model.sparse_arch.embedding_bag_collection.embedding_bags"
    for t in ("t_cat_0", "t_cat_1"):  # table-wise: each table lives on one rank
        assert any(c.startswith(f"model/mean_abs/{table}.{t}.weight/rank") for c in columns), t
    ranks = {c.rsplit("/rank", 1)[1] for c in columns if "/rank" in c}
    assert ranks == {"0", "1"}


@pytest.mark.parametrize(
    ("phase", "stage", "counts"),
    [
        ("uneven_sized", "training", "rank 0: 5, rank 1: 3"),
        ("uneven_val", "validation", "rank 0: 2, rank 1: 3"),
        ("predict_uneven", "predict", "rank 0: 2, rank 1: 1"),
    ],
)
def test_uneven_sized_data_is_refused_before_the_first_step(
    run: Path, phase: str, stage: str, counts: str
) -> None:
    r0, r1 = load_ranks(run, phase)
    assert r0["error"] == r1["error"] == "UnevenDataError"
    for r in (r0, r1):
        assert f"different numbers of {stage} batches ({counts})" in r["message"]
        assert r["seconds"] < PHASE_TIMEOUT_S
    if stage == "predict":
        assert "multiple of the number of ranks" in r0["message"]


def test_uneven_iterable_data_stops_every_rank_at_the_short_ranks_last_batch(run: Path) -> None:
    r0, r1 = load_ranks(run, "uneven_iterable")
    assert r0["error"] == r1["error"] == "UnevenDataError"
    for r in (r0, r1):
        assert "rank(s) [1] have 2, rank(s) [0] have more" in r["message"]
        assert r["seconds"] < PHASE_TIMEOUT_S


def test_uneven_iterable_validation_is_refused_with_the_batch_checks_off(run: Path) -> None:
    r0, r1 = load_ranks(run, "uneven_val_unchecked")
    assert r0["error"] == r1["error"] == "UnevenDataError"
    for r in (r0, r1):
        assert "validation batches in this epoch: rank(s) [1] have 2" in r["message"]
        assert r["seconds"] < PHASE_TIMEOUT_S


def test_a_second_fit_on_the_same_module_trains(run: Path) -> None:
    for r in load_ranks(run, "refit"):
        assert r["error"] is None, r.get("trace")
        assert r["steps"] == 2
        assert any("over_arch" in k for k in r["changed"])


def test_embedding_collection_plans_only_what_the_cpu_runs(run: Path) -> None:
    for r in load_ranks(run, "ec"):
        assert r["error"] is None, r.get("trace")
        assert r["steps"] == 3
        assert not {"row_wise", "table_row_wise", "data_parallel"} & set(r["plan"].values())


def test_no_fused_lr_warning_without_fused_tables(run: Path) -> None:
    for r in load_ranks(run, "no_fused"):
        assert r["steps"] == 2
        assert not [w for w in r["warnings"] if "fused embedding learning rate" in w]


def test_rows_constant_matches_the_script() -> None:
    assert ROWS == 20
