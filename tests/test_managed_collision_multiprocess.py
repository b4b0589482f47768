"""2 ranks: a ``ManagedCollisionEmbeddingCollection`` takes raw 64-bit ids, trains with row-wise
tables, and a sharded checkpoint resumes its remapping state and tables bit for bit.

One launch (tests/scripts/mc_ranks.py) runs both phases; these tests read what each rank
recorded.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.helpers import load_ranks, run_script

STEPS, STOP = 8, 4
RAW_IDS = "_mch_sorted_raw_ids"
EMPTY = torch.iinfo(torch.int64).max  # what an MCH module holds in a slot with no id yet


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("mc_ranks")
    run_script("mc_ranks.py", str(out))
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
