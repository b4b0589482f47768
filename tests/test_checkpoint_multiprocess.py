"""Sharded checkpoints on two real gloo ranks: exact resume, resharding, plain weights.

One launch (tests/scripts/checkpoint_two_ranks.py) runs every phase; these tests read what each
rank recorded. The one-rank load of the two-rank checkpoint runs in this process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.checkpoint.consolidate import read_plain
from lightning_torchrec.training.optim import optimizer_steps
from tests.helpers import assert_same, load_ranks, run_script
from tests.scripts.factory import (
    WIDE,
    cpu_trainer,
    pooled_module,
    pooled_plan,
    table_wise,
    tiny_data,
    tiny_dlrm,
)
from tests.scripts.rank_state import kernel_lrs

TABLES = [f"t_cat_{i}" for i in range(4)]
EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection"
CKPT = Path("part") / "epoch=1-step=20.ckpt"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("checkpoint_two_ranks")
    run_script("checkpoint_two_ranks.py", str(out))
    return out


def table_key(table: str) -> str:
    return f"{EBC}.embedding_bags.{table}.weight"


def assemble(snaps: list[dict[str, Any]], key: str, shape: tuple[int, ...]) -> torch.Tensor:
    """The whole table from every rank's ``(offsets, local shard)`` pieces; NaN where none."""
    full = torch.full(shape, float("nan"))
    for snap in snaps:
        for offsets, shard in snap["model"][key]:
            index = tuple(slice(o, o + n) for o, n in zip(offsets, shard.shape, strict=True))
            full[index] = shard
    return full


def test_resumed_run_matches_uninterrupted_run_bit_for_bit(run: Path) -> None:
    for rank in range(2):
        full, part = load_ranks(run, "full_steps")[rank], load_ranks(run, "part_steps")[rank]
        resumed = load_ranks(run, "resume_steps")[rank]
        assert sorted(part) == list(range(1, 21)) and sorted(resumed) == list(range(21, 31))
        assert all(torch.equal(full[s]["loss"], part[s]["loss"]) for s in part)
        for step, rec in resumed.items():
            assert torch.equal(rec["loss"], full[step]["loss"]), f"rank {rank} step {step}"
            assert rec["dense_lr"] == full[step]["dense_lr"], step
            assert rec["kernel_lrs"] == full[step]["kernel_lrs"], step
        # StepLR halved both LRs after step 20: the first resumed step already uses them.
        assert full[20]["kernel_lrs"] == [pytest.approx(0.1)]
        assert resumed[21]["kernel_lrs"] == [pytest.approx(0.05)]
        assert resumed[21]["dense_lr"] == pytest.approx(5e-3)
    batches = load_ranks(run, "full_batches"), load_ranks(run, "resume_batches")
    for rank in range(2):  # the same batches in the same order after the resume
        assert all(batches[1][rank][s] == batches[0][rank][s] for s in range(21, 31))


def test_resume_restores_everything_and_ends_in_the_same_state(run: Path) -> None:
    part_end, restored = load_ranks(run, "part_end"), load_ranks(run, "resume_start")
    full_end, resume_end = load_ranks(run, "full_end"), load_ranks(run, "resume_end")
    for rank in range(2):
        assert_same(part_end[rank], restored[rank], f"rank{rank}/restored")
        assert_same(full_end[rank], resume_end[rank], f"rank{rank}/end")
        optim = full_end[rank]["optim"]
        assert any(k.startswith("dense.") for k in optim)
        assert any(k.startswith("embedding.") for k in optim)
        # The fused kernels' step counter lives outside every state dict; it is restored too.
        assert restored[rank]["optimizer_steps"] == [20]
        assert resume_end[rank]["optimizer_steps"] == full_end[rank]["optimizer_steps"] == [30]


def test_column_wise_plan_restores_every_table_value(run: Path) -> None:
    info = load_ranks(run, "cw_info")
    assert {t.sharding_type for t in info[0]["plan"].tables} == {"column_wise"}
    plain = read_plain(run / "plain.safetensors")
    part_end = load_ranks(run, "part_end")
    for table in TABLES:
        key = table_key(table)
        for rank in range(2):  # each rank holds half of the columns
            (piece,) = info[rank]["restored"]["model"][key]
            assert piece[0] == (0, 4 * rank) and piece[1].shape == (40, 4)
        restored = assemble([i["restored"] for i in info], key, (40, 8))
        saved = assemble(part_end, key, (40, 8))  # table-wise: the owner holds all of it
        assert torch.equal(restored, saved), table
        assert torch.equal(plain[key], saved), table
    for key, value in plain.items():  # dense weights too
        if isinstance(info[0]["restored"]["model"][key], torch.Tensor):
            assert torch.equal(info[0]["restored"]["model"][key], value), key


def test_optimizer_state_across_plan_change_is_refused_naming_tables(run: Path) -> None:
    for info in load_ranks(run, "cw_info"):
        msg = info["optimizer_load"]
        assert "shapes differ (tables ['t_cat_0', 't_cat_1', 't_cat_2', 't_cat_3'])" in msg
        assert "t_cat_0.momentum1: checkpoint [40], target [80]" in msg
        assert "load_optimizer_states=False" in msg


def test_plain_weights_fill_each_ranks_shards(run: Path) -> None:
    for info in load_ranks(run, "cw_info"):
        assert {table_key(t) for t in TABLES} <= set(info["plain_keys"])
        assert_same(info["restored"]["model"], info["after_plain"]["model"])


def test_two_rank_checkpoint_loads_on_one_rank(run: Path) -> None:
    data = tiny_data(40, 4, ids_per_feature=2, batch_size=64, train_batches=20, seed=5)
    model = tiny_dlrm(data.num_embeddings_per_feature, **WIDE)
    strategy = TorchRecStrategy(
        fused_params={"learning_rate": 0.1}, constraints=table_wise(TABLES), log_plan=False
    )
    trainer = cpu_trainer(
        strategy,
        max_epochs=2,  # reached: restores only
        num_sanity_val_steps=0,  # eval forwards advance the fused step counter too
        default_root_dir=run,
    )
    trainer.fit(model, datamodule=data, ckpt_path=run / CKPT)
    assert trainer.global_step == 20
    plain = read_plain(run / "plain.safetensors")
    state = model.state_dict()
    for key, value in plain.items():
        local = state[key]
        if hasattr(local, "local_shards"):
            (shard,) = local.local_shards()
            local = shard.tensor
        assert torch.equal(local, value), key
    # Same plan type, other world size: the fused optimizer state reshards too.
    part_end = load_ranks(run, "part_end")
    optim = trainer.optimizers[0].state_dict()["state"]
    for table in TABLES:
        key = f"embedding.{table_key(table)}"
        (shard,) = optim[key][f"{table}.momentum1"].local_shards()
        owner = next(s for s in part_end if key in s["optim"])
        ((_, saved),) = owner["optim"][key][f"{table}.momentum1"]
        assert torch.equal(shard.tensor, saved), table
    assert optimizer_steps(trainer.optimizers[0]) == [20]


def kernel_schedule(steps: dict[int, dict[str, Any]], step: int) -> tuple[float, float]:
    """What step ``step`` trained with: the dense LR and the one LR of every fused kernel."""
    lrs = set(steps[step]["kernel_lrs"])
    assert len(lrs) == 1, lrs
    return steps[step]["dense_lr"], lrs.pop()


def test_kernels_another_rank_held_resume_their_schedule_and_step_counter(run: Path) -> None:
    # Saved with both tables on rank 1: rank 0 saved no fused group, no step counter, and (for
    # every rank) a scheduler state of one group. LambdaLR: step s trains at base / s.
    saved = load_ranks(run, "kernels_save_end")
    assert saved[0]["optimizer_steps"] == [] and saved[1]["optimizer_steps"] == [4, 4]
    resumed = load_ranks(run, "kernels_resume_steps"), load_ranks(run, "kernels_resume_end")
    for rank, (steps, end) in enumerate(zip(*resumed, strict=True)):
        assert sorted(steps) == [5, 6]
        for step in steps:
            dense, fused = kernel_schedule(steps, step)
            assert dense == pytest.approx(1e-2 / step) and fused == pytest.approx(0.1 / step)
        assert end["optimizer_steps"] == [6], rank
        assert end["lrs"] == pytest.approx([1e-2 / 7, 0.1 / 7]), rank


def test_kernels_resume_on_one_rank_driving_more_kernels_than_rank_zero_saved(run: Path) -> None:
    class Lrs(Callback):
        def __init__(self) -> None:
            self.steps: dict[int, dict[str, Any]] = {}

        def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
            opt = trainer.optimizers[0]
            lrs = {"dense_lr": opt.param_groups[0]["lr"], "kernel_lrs": kernel_lrs(opt.fused)}
            self.steps[trainer.global_step + 1] = lrs

    module = pooled_module()
    strategy = TorchRecStrategy(
        plan=pooled_plan(module, [0, 0], 1), fused_params={"learning_rate": 0.1}, log_plan=False
    )
    seen = Lrs()
    trainer = cpu_trainer(
        strategy, max_steps=6, limit_val_batches=0, callbacks=[seen], default_root_dir=run
    )
    data = tiny_data(40, 2, batch_size=16, train_batches=8, seed=2)
    trainer.fit(module, datamodule=data, ckpt_path=run / "kernels.ckpt")
    opt = trainer.optimizers[0]
    assert optimizer_steps(opt) == [6, 6]  # two kernels on this rank (SUM and MEAN pooling)
    for step in (5, 6):
        dense, fused = kernel_schedule(seen.steps, step)
        assert dense == pytest.approx(1e-2 / step) and fused == pytest.approx(0.1 / step)
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 / 7, 0.1 / 7, 0.1 / 7])


#: ``checkpoint_two_ranks.OWN_LRS``: each table's own optimizer's learning rate.
OWN_LRS = (0.1, 0.02)


def test_tables_with_their_own_learning_rate_resume_it_on_every_rank(run: Path) -> None:
    # t_cat_r on rank r, each with its own SGD rate; Lightning restores every rank's scheduler
    # from rank 0's state, whose fused base rate is t_cat_0's (rank 1 trained t_cat_1 at 5x).
    resumed = load_ranks(run, "own_resume_steps"), load_ranks(run, "own_resume_end")
    for rank, (steps, end) in enumerate(zip(*resumed, strict=True)):
        assert sorted(steps) == [5, 6]
        for step in steps:
            dense, fused = kernel_schedule(steps, step)
            assert dense == pytest.approx(1e-2 / step)
            assert fused == pytest.approx(OWN_LRS[rank] / step), (rank, step)
        assert end["lrs"] == pytest.approx([1e-2 / 7, OWN_LRS[rank] / 7]), rank


def test_tables_with_their_own_learning_rate_resume_it_on_one_rank(run: Path) -> None:
    # Both tables on one rank: each kernel takes the values saved for its own table, not one
    # saved fused group's for both.
    module = pooled_module(OWN_LRS)
    strategy = TorchRecStrategy(plan=pooled_plan(module, [0, 0], 1), log_plan=False)
    trainer = cpu_trainer(strategy, max_steps=6, limit_val_batches=0, default_root_dir=run)
    data = tiny_data(40, 2, batch_size=16, train_batches=8, seed=2)
    trainer.fit(module, datamodule=data, ckpt_path=run / "own.ckpt")
    opt = trainer.optimizers[0]
    assert kernel_lrs(opt.fused) == pytest.approx([lr / 6 for lr in OWN_LRS])  # step 6's
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([1e-2 / 7, 0.1 / 7, 0.02 / 7])
    # Labels of this plan's kernels, not those saved by the two ranks' kernels.
    assert [g.get("name") for g in opt.param_groups] == [None, "tables:t_cat_0", "tables:t_cat_1"]
    (scheduler,) = (c.scheduler for c in trainer.lr_scheduler_configs)
    assert scheduler.base_lrs == pytest.approx([1e-2, *OWN_LRS])
