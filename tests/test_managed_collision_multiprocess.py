"""2 ranks: a ``ManagedCollisionEmbeddingCollection`` takes raw 64-bit ids, trains with row-wise
tables, and a sharded checkpoint resumes its remapping state and tables bit for bit; on another
world size it is refused, naming the tables, before anything is loaded.

One launch (tests/scripts/mc_ranks.py) runs its phases; these tests read what each rank
recorded. The one-rank runs (a checkpoint for the launch to refuse, a load of the launch's
checkpoint) run in this process.
"""

from __future__ import annotations

from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

from lightning_torchrec import load_unsharded
from lightning_torchrec.errors import CheckpointMismatchError, ManagedCollisionLayoutError
from lightning_torchrec.training.mc_stats import mch_modules
from tests.helpers import load_ranks, run_script
from tests.scripts.factory import cpu_trainer
from tests.scripts.mc_model import ROWS, STEPS, STOP, data, lookup, module, probe_ids, strategy

RAW_IDS = "_mch_sorted_raw_ids"
EMPTY = torch.iinfo(torch.int64).max  # what an MCH module holds in a slot with no id yet
TABLES = ("t_cat_0", "t_cat_1")


class LookupAtStop(Callback):
    def on_train_batch_end(
        self, trainer: L.Trainer, pl_module: L.LightningModule, *_: object
    ) -> None:
        if trainer.global_step == STOP:
            self.lookup = lookup(pl_module)


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, torch.Tensor]]:
    """A step-``STOP`` checkpoint written by one rank, and its id -> embedding mapping."""
    out = tmp_path_factory.mktemp("mc_one_rank")
    L.seed_everything(3)
    at_stop = LookupAtStop()
    saver = ModelCheckpoint(dirpath=out, every_n_train_steps=STOP, save_top_k=-1)
    trainer = cpu_trainer(
        strategy(),
        max_steps=STOP,
        limit_val_batches=0,
        callbacks=[at_stop, saver],
        enable_checkpointing=True,
        default_root_dir=out,
    )
    trainer.fit(module(), datamodule=data())
    return next(out.glob(f"*step={STOP}.ckpt")), at_stop.lookup


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, one_rank: tuple[Path, object]) -> Path:
    out = tmp_path_factory.mktemp("mc_ranks")
    run_script("mc_ranks.py", str(out), str(one_rank[0]))
    return out


def test_the_managed_collision_tables_are_row_wise(run: Path) -> None:
    for r in load_ranks(run, "full"):
        assert [
            (t.table, t.sharding_type, t.compute_kernel, t.ranks) for t in r["plan"].tables
        ] == [(f"t_cat_{i}", "row_wise", "fused", [0, 1]) for i in range(2)]


def test_raw_ids_are_admitted_into_every_shard(run: Path) -> None:
    for r in load_ranks(run, "full"):
        state = r["steps"][STOP]["state"]
        for table in ("t_cat_0", "t_cat_1"):
            assert r["steps"][STOP]["open_slots"][table] == 0  # every slot holds an id
            raw = next(v for k, v in state.items() if k.endswith(f"{table}.{RAW_IDS}"))
            held = raw[raw != EMPTY]
            assert len(held) > 0 and int(held.max()) >= 2**32  # 64-bit ids, not row numbers
            assert int(held.max()) < 2**40


def test_resume_restores_the_remapping_state_and_tables_bit_for_bit(run: Path) -> None:
    for full, resumed in zip(load_ranks(run, "full"), load_ranks(run, "resumed"), strict=True):
        assert sorted(resumed["steps"]) == list(range(STOP, STEPS + 1))
        restored, saved = resumed["steps"][STOP]["state"], full["steps"][STOP]["state"]
        assert any(RAW_IDS in k for k in restored) and any(".weight" in k for k in restored)
        assert set(restored) == set(saved)
        for name, value in saved.items():
            assert torch.equal(restored[name], value), name
        for step in range(STOP + 1, STEPS + 1):
            a, b = full["steps"][step], resumed["steps"][step]
            assert torch.equal(a["loss"], b["loss"]), step
            for name, value in a["state"].items():
                assert torch.equal(b["state"][name], value), (step, name)


def test_the_remapping_state_changes_while_training(run: Path) -> None:
    # Guards the resume test against comparing state that never moves.
    for r in load_ranks(run, "full"):
        first, last = r["steps"][STOP]["state"], r["steps"][STEPS]["state"]
        changed = {k for k in first if not torch.equal(first[k], last[k])}
        assert any("_mch_counts" in k for k in changed)
        assert any(k.endswith(".weight") and "embeddings" in k for k in changed)


def test_stats_callback_logs_open_slots_admissions_and_evictions_summed_over_ranks(
    run: Path,
) -> None:
    full = load_ranks(run, "full")
    logged = full[0]["logged"]
    assert full[1]["logged"] == {}  # rank 0 writes; every rank counted
    assert full[0]["last"] == full[1]["last"] and full[0]["last"]
    assert set(range(1, STEPS + 1)) <= set(logged)
    for table in ("t_cat_0", "t_cat_1"):
        key = f"managed_collision/{table}/"
        # Every rank's shard counts: the logged value is the sum of the ranks' own open slots.
        for step in range(1, STEPS + 1):
            local = sum(r["steps"][step]["open_slots"][table] for r in full)
            assert logged[step][key + "open_slots"] == local, (table, step)
        # 32 rows in 2 shards: 15 usable slots each (TorchRec keeps one per shard for misses).
        opened = [30.0] + [logged[s][key + "open_slots"] for s in range(1, STEPS + 1)]
        assert opened[STOP] == 0 and opened == sorted(opened, reverse=True)
        for step in range(1, STEPS + 1):
            got = logged[step][key + "admitted"] - logged[step][key + "evicted"]
            assert got == opened[step - 1] - opened[step], (table, step)
        assert sum(logged[s][key + "admitted"] for s in range(1, STEPS + 1)) > 30
        assert sum(logged[s][key + "evicted"] for s in range(1, STEPS + 1)) > 0


def test_resumed_stats_count_from_the_restored_state(run: Path) -> None:
    full, resumed = load_ranks(run, "full")[0], load_ranks(run, "resumed")[0]

    def counts(logged: dict[int, dict[str, float]]) -> dict[int, dict[str, float]]:
        return {
            step: {k: v for k, v in values.items() if k.startswith("managed_collision/")}
            for step, values in logged.items()
        }

    got, want = counts(resumed["logged"]), counts(full["logged"])
    assert {s for s in got if got[s]} == set(range(STOP + 1, STEPS + 1))
    for step in range(STOP + 1, STEPS + 1):
        assert got[step] == want[step], step


def test_resume_keeps_every_ids_embedding(run: Path) -> None:
    for full, resumed in zip(load_ranks(run, "full"), load_ranks(run, "resumed"), strict=True):
        saved, restored = full["steps"][STOP]["lookup"], resumed["steps"][STOP]["lookup"]
        assert set(saved) == {"cat_0", "cat_1"}
        for feature, rows in saved.items():
            assert rows.shape == (len(probe_ids()), 4)
            assert torch.equal(restored[feature], rows), feature


def admitted(full: list[dict], table: str) -> torch.Tensor:
    """Which probe ids some rank's shard of ``table`` held at ``STOP``."""
    held = [
        v
        for r in full
        for k, v in r["steps"][STOP]["state"].items()
        if k.endswith(f"{table}.{RAW_IDS}")
    ]
    return torch.isin(probe_ids(), torch.cat(held))


def test_ids_not_admitted_look_up_the_row_of_their_shard(run: Path) -> None:
    # Why the state is bound to its layout: each shard keeps its own row for ids it did not
    # admit, chosen by the id's bucket (rank 0: the lower half of the range).
    full = load_ranks(run, "full")
    lower = probe_ids() < 2**39
    for i, table in enumerate(TABLES):
        rows = full[0]["steps"][STOP]["lookup"][f"cat_{i}"]
        known = admitted(full, table)
        assert 0 < int(known.sum()) <= 30 and int(known[ROWS:].sum()) == 0
        for half in (lower, ~lower):
            missed = rows[~known & half]
            assert len(missed) > 0 and bool((missed == missed[0]).all()), (table, half[0])
        assert not torch.equal(rows[~known & lower][0], rows[~known & ~lower][0]), table


def test_a_one_rank_checkpoint_is_refused_on_two_ranks_and_nothing_is_loaded(run: Path) -> None:
    for r in load_ranks(run, "from_one_rank"):
        assert r["error"] == "ManagedCollisionLayoutError", r["error"]
        for table in TABLES:
            assert (
                f"table '{table}' (module model_and_loss.model.mc_ec._managed_collision_collection."
                f"_managed_collision_modules.{table}): saved by 1 rank as rows [0, 32), now 2 "
                "ranks with rows [0, 16) [16, 32)"
            ) in r["message"]
        assert "Load it on 1 rank" in r["message"]
        state = r["state"]
        raw = [v for k, v in state.items() if k.endswith(RAW_IDS)]
        tables = [v for k, v in state.items() if k.endswith(".weight") and "embeddings" in k]
        assert len(raw) == 2 and all(bool((v == EMPTY).all()) for v in raw)
        assert len(tables) == 2 and all(not v.any() for v in tables)  # init_fn zeros, no rows


def test_a_two_rank_checkpoint_is_refused_on_one_rank_and_nothing_is_loaded(run: Path) -> None:
    ckpt = next((run / "ckpt").glob(f"*step={STOP}.ckpt"))
    model = module()
    trainer = cpu_trainer(strategy(), max_steps=STOP + 1, limit_val_batches=0)
    with pytest.raises(ManagedCollisionLayoutError) as err:
        trainer.fit(model, datamodule=data(), ckpt_path=ckpt)
    assert isinstance(err.value, CheckpointMismatchError)
    for table in TABLES:
        assert (
            f"table '{table}' (module model_and_loss.model.mc_ec._managed_collision_collection."
            f"_managed_collision_modules.{table}): saved by 2 ranks as rows [0, 16) [16, 32), "
            "now 1 rank with rows [0, 32)"
        ) in str(err.value)
    for table, mch in mch_modules(model).items():
        assert bool((getattr(mch, RAW_IDS) == EMPTY).all()), table


def test_one_process_loads_refuse_a_two_rank_checkpoint_and_keep_a_one_rank_one(
    run: Path, one_rank: tuple[Path, dict[str, torch.Tensor]]
) -> None:
    ckpt = next((run / "ckpt").glob(f"*step={STOP}.ckpt"))
    with pytest.raises(ManagedCollisionLayoutError, match="saved by 2 ranks as rows"):
        load_unsharded(ckpt, module())
    # One rank's layout is the unsharded one: every id keeps its embedding.
    path, saved = one_rank
    restored = lookup(load_unsharded(path, module()))
    assert set(restored) == set(saved)
    for feature, rows in saved.items():
        assert torch.equal(restored[feature], rows), feature
