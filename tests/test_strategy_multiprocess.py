"""Two real gloo ranks under Lightning's own launcher: train, shard, checkpoint, resume, validate.

One launch (tests/scripts/train_two_ranks.py) runs every phase; these tests read what each rank
recorded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import assert_same, load_ranks, run_script

TABLES = [f"t_cat_{i}" for i in range(4)]


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("two_ranks")
    run_script("train_two_ranks.py", str(out))
    return out


def _table_key(key: str) -> str | None:
    for t in TABLES:
        if key.endswith(f"embedding_bags.{t}.weight"):
            return t
    return None


def test_auroc_rises_above_chance(run: Path) -> None:
    info = load_ranks(run, "fit_info")
    assert abs(info[0]["auroc_before"] - 0.5) < 0.1
    aurocs = info[0]["aurocs"]  # the validate before fit, then steps 60 and 120
    assert len(aurocs) == 3 and aurocs[0] == pytest.approx(info[0]["auroc_before"])
    assert aurocs[-1] > info[0]["auroc_before"] + 0.05
    assert aurocs[-1] > 0.6
    # torchmetrics syncs AUROC over ranks: both report the same value.
    assert info[0]["aurocs"] == info[1]["aurocs"]


def test_each_rank_holds_only_its_shards(run: Path) -> None:
    plan = load_ranks(run, "fit_info")[0]["plan"]
    owner = {t.table: t.ranks for t in plan.tables}
    assert all(t.sharding_type == "table_wise" and t.compute_kernel == "fused" for t in plan.tables)
    for rank, snap in enumerate(load_ranks(run, "fit_end")):
        for key, value in snap["model"].items():
            table = _table_key(key)
            if table is None:
                continue
            rows = sum(shard.shape[0] for _, shard in value)
            assert rows == (50 if owner[table] == [rank] else 0), (rank, table)
    # Bytes per rank add up to all tables, split evenly.
    assert plan.bytes_per_rank == [2 * 50 * 8 * 4] * 2


def test_tables_and_dense_weights_change_and_dense_stays_replicated(run: Path) -> None:
    start, end = load_ranks(run, "fit_trainstart"), load_ranks(run, "fit_end")
    for rank in range(2):
        changed_tables = changed_dense = 0
        for key, before in start[rank]["model"].items():
            after = end[rank]["model"][key]
            if _table_key(key):
                if before:
                    changed_tables += not torch.equal(before[0][1], after[0][1])
            elif isinstance(before, torch.Tensor) and before.is_floating_point():
                changed_dense += not torch.equal(before, after)
        assert changed_tables == 2, f"rank {rank}: both owned tables must train"
        assert changed_dense > 4
    for key, value in end[0]["model"].items():
        if not _table_key(key) and isinstance(value, torch.Tensor):
            assert torch.equal(value, end[1]["model"][key]), f"dense {key} differs across ranks"


def test_resume_restores_weights_and_both_optimizer_states(run: Path) -> None:
    saved, restored = load_ranks(run, "fit_saved60"), load_ranks(run, "resume_trainstart")
    for rank in range(2):
        assert saved[rank]["step"] == restored[rank]["step"] == 60
        assert_same(saved[rank]["model"], restored[rank]["model"], f"rank{rank}/model")
        assert_same(saved[rank]["optim"], restored[rank]["optim"], f"rank{rank}/optim")
        assert saved[rank]["lrs"] == restored[rank]["lrs"]
        optim_keys = list(saved[rank]["optim"])
        assert any(k.startswith("dense.") for k in optim_keys)
        assert any(k.startswith("embedding.") for k in optim_keys)
        # The state is real: Adam moments and row-wise Adagrad sums are non-zero.
        fused = [v for k, v in saved[rank]["optim"].items() if k.startswith("embedding.")]
        assert any(float(s.abs().sum()) > 0 for st in fused for v in st.values() for _, s in v)
    # The schedule halved both the dense and the fused LR at step 40 (StepLR on the combined
    # optimizer): 1e-2 -> 5e-3 and 0.2 -> 0.1 (one fused group per rank here).
    assert saved[0]["lrs"] == pytest.approx([5e-3, 0.1])


def test_resumed_run_continues_training(run: Path) -> None:
    restored, end = load_ranks(run, "resume_trainstart"), load_ranks(run, "resume_end")
    assert end[0]["step"] == 65
    assert any(
        not torch.equal(restored[0]["model"][k], v)
        for k, v in end[0]["model"].items()
        if isinstance(v, torch.Tensor) and v.is_floating_point()
    )


def test_standalone_validate_from_checkpoint_matches_fit(run: Path) -> None:
    fit_auroc = load_ranks(run, "fit_info")[0]["aurocs"][-1]
    for info in load_ranks(run, "validate_info"):
        assert info["auroc"] == pytest.approx(fit_auroc, abs=1e-6)


def test_checkpoints_are_sharded_directories(run: Path) -> None:
    from lightning_torchrec import is_sharded_checkpoint

    ckpts = load_ranks(run, "fit_info")[0]["ckpts"]
    assert len(ckpts) == 2
    for c in ckpts:
        assert is_sharded_checkpoint(c)
        distcp = list(Path(c).glob("*.distcp"))
        assert len(distcp) == 2, "every rank writes its own shard file"


def test_manual_optimization_trains_like_automatic_and_keeps_dense_replicated(run: Path) -> None:
    # manual_backward runs inside the DMP's forward, before its dense DDP is ready for a backward:
    # without Lightning's DDP handling applied to that DDP, no dense gradient was all-reduced.
    ranks = load_ranks(run, "manual")
    for rank in ranks:
        assert rank["Manual"]["losses"] == rank["DLRMClickModule"]["losses"]
        assert_same(rank["Manual"]["dense"], rank["DLRMClickModule"]["dense"])
    assert ranks[0]["Manual"]["dense"]
    assert_same(ranks[0]["Manual"]["dense"], ranks[1]["Manual"]["dense"])
