"""2 ranks: the sequence model trains under table-, row- and column-wise item tables, its ranking
metrics are global, and a mid-epoch checkpoint resumes exactly under another plan.

One launch (tests/scripts/sequence_ranks.py) runs every phase; these tests read what each rank
recorded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from lightning_torchrec.training.ranking import ranking_values
from tests.helpers import load_ranks, run_script

STEPS, STOP = 10, 7
TABLE = "model_and_loss.model.item_embeddings"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sequence_ranks")
    run_script("sequence_ranks.py", str(out))
    return out


def test_each_run_shards_the_item_table_as_asked(run: Path) -> None:
    for tag, kind in (("full", "table_wise"), ("rw", "row_wise"), ("cw", "column_wise")):
        for r in load_ranks(run, tag):
            assert [(t.table, t.sharding_type) for t in r["plan"].tables] == [("t_item", kind)]


def test_ranking_metrics_cover_every_user_of_every_rank(run: Path) -> None:
    ranks = load_ranks(run, "full")
    assert ranks[0]["val"] == ranks[1]["val"]
    combined = ranking_values(
        torch.cat([r["val_ranks"] for r in ranks]),
        [10],
        torch.cat([r["val_weights"] for r in ranks]),
    )
    assert float(torch.cat([r["val_weights"] for r in ranks]).sum()) == 160  # every user once
    for name in ("recall@10", "ndcg@10"):
        assert ranks[0]["val"][f"val/{name}"] == pytest.approx(float(combined[name]), abs=1e-6)


def test_val_loss_is_the_mean_over_every_position_of_every_rank(run: Path) -> None:
    ranks = load_ranks(run, "full")
    weights = torch.cat([r["val_loss_weights"] for r in ranks])
    losses = torch.cat([r["val_losses"] for r in ranks])
    # Rank 0 holds 100 users, rank 1 60 and a padding sample (its last batch).
    assert [float(r["val_weights"].sum()) for r in ranks] == [100, 60]
    assert float(weights[-1]) == 0
    want = float((losses * weights).sum() / weights.sum())
    for r in ranks:
        assert r["val"]["val/loss"] == pytest.approx(want, rel=1e-5)


def test_a_history_over_max_length_on_rank_1_stops_both_ranks_by_name(run: Path) -> None:
    r0, r1 = load_ranks(run, "long")
    assert r0["error"] == r1["error"] == "BatchValidationError"
    for msg in (r0["message"], r1["message"]):
        assert "rank 1, " in msg and "feature 'item_seq' (table 't_item') has 12 ids" in msg
        assert "in sample 0, more than the 8" in msg
    assert "another rank failed" in r0["message"]
    assert r0["global_step"] == r1["global_step"] <= 1  # the long batch never trained


def dense(step: dict) -> dict:
    return {k: v for k, v in step["dense"].items() if not k.startswith(TABLE)}


def test_row_wise_resume_continues_bit_for_bit(run: Path) -> None:
    for full, rw in zip(load_ranks(run, "full"), load_ranks(run, "rw"), strict=True):
        assert torch.equal(rw["steps"][STOP]["table"], full["steps"][STOP]["table"])
        assert sorted(rw["steps"]) == list(range(STOP, STEPS + 1))
        for step in range(STOP + 1, STEPS + 1):
            a, b = full["steps"][step], rw["steps"][step]
            assert torch.equal(a["batch"], b["batch"]), step  # the data resumed mid-epoch
            assert torch.equal(a["loss"], b["loss"]), step
            assert torch.equal(a["table"], b["table"]), step
            for name, value in dense(a).items():
                assert torch.equal(value, dense(b)[name]), (step, name)


def test_column_wise_resume_restores_the_table_exactly(run: Path) -> None:
    for full, cw in zip(load_ranks(run, "full"), load_ranks(run, "cw"), strict=True):
        assert torch.equal(cw["steps"][STOP]["table"], full["steps"][STOP]["table"])
        # The first resumed step computes its loss from the restored weights: equal.
        assert torch.equal(cw["steps"][STOP + 1]["loss"], full["steps"][STOP + 1]["loss"])
        # Then the fused optimizer state starts afresh (row-wise Adagrad keeps one value per
        # row, which column shards cannot share), so the runs part.
        assert not torch.equal(cw["steps"][STEPS]["table"], full["steps"][STEPS]["table"])
