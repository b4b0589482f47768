"""Delta checkpoints: content, chain restore (also on another world size), refusals, resume."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import DataLoader

from benchmarks.delta_size import main as delta_size
from lightning_torchrec import TorchRecFabricStrategy, TorchRecStrategy, dense_parameters
from lightning_torchrec.checkpoint import (
    DeltaWriter,
    chain_of,
    checkpoint_id,
    read_delta,
    restore_chain,
    write_delta,
)
from lightning_torchrec.checkpoint.delta import DELTA_FILE, DENSE_FILE, delta_name, model_tables
from lightning_torchrec.checkpoint.manifest import MANIFEST_FILE, file_checksum
from lightning_torchrec.data import SyntheticClickDataset
from lightning_torchrec.errors import (
    CheckpointWriteError,
    DeltaRefusedError,
    NonFiniteCheckpointError,
    ShardingConflictError,
)
from lightning_torchrec.lightning import DeltaPublisher
from lightning_torchrec.models.dlrm import dlrm_click_model
from lightning_torchrec.sharding.layout import shard_info
from tests.helpers import assert_same, run_script
from tests.scripts import mc_model
from tests.scripts.delta_state import chain_state
from tests.scripts.factory import (
    cpu_trainer,
    sharding_constraints,
    table_wise,
    tiny_data,
    tiny_dlrm,
)

KEY = b"k" * 32
STEPS_PER_EPOCH = 8


def _trainer(callbacks: list[Any], types: dict[str, str] | None = None, **kwargs: Any) -> Any:
    constraints = sharding_constraints(types) if types else table_wise(2)
    strategy = TorchRecStrategy(constraints=constraints, log_plan=False)
    return cpu_trainer(strategy, limit_val_batches=0, callbacks=callbacks, **kwargs)


def _data() -> Any:
    return tiny_data(train_batches=STEPS_PER_EPOCH, seed=3)


class Snapshots(Callback):
    """The whole state at the fit's start and after every step (placed before the publisher)."""

    def __init__(self) -> None:
        self.at: dict[int, dict[str, torch.Tensor]] = {}

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        self.at[trainer.global_step] = chain_state(pl_module, trainer.optimizers[0])

    def on_train_batch_end(self, trainer: Any, pl_module: Any, *args: Any) -> None:
        self.at[trainer.global_step] = chain_state(pl_module, trainer.optimizers[0])


def _target(types: dict[str, str] | None = None) -> tuple[Any, Any]:
    """A freshly sharded model and its optimizer to restore into."""
    module = tiny_dlrm()
    trainer = _trainer([], types, max_epochs=0)
    trainer.fit(module, _data())
    return module, trainer.optimizers[0]


@pytest.fixture(scope="module")
def chain(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One fit of 2 epochs publishing every 3 steps (and at each epoch's end), with optimizer.

    ``t_cat_1`` is data-parallel: the dense optimizer (Adam) moves rows no batch touched, so
    every delta holds the whole table."""
    out = tmp_path_factory.mktemp("chain")
    snaps = Snapshots()
    publisher = DeltaPublisher(out / "chain", every_n_steps=3, with_optimizer=True)
    module = tiny_dlrm()
    types = {"t_cat_0": "table_wise", "t_cat_1": "data_parallel"}
    trainer = _trainer([snaps, publisher], types, max_epochs=2)
    trainer.fit(module, _data())
    trainer.save_checkpoint(out / "final", weights_only=False)
    target, optimizer = _target(types)
    return {
        "out": out,
        "root": out / "chain",
        "snaps": snaps.at,
        "published": publisher.published,
        "final": chain_state(module, trainer.optimizers[0]),
        "target": target,
        "optimizer": optimizer,
    }


def test_each_delta_holds_every_changed_row(chain: dict[str, Any]) -> None:
    published = chain["published"]
    steps = [read_delta(p).info["step"] for p in published]
    assert steps == [3, 6, 8, 9, 12, 15, 16]  # every 3 steps and at each epoch's end
    assert [p.name for p in published] == [delta_name(i + 1) for i in range(len(steps))]
    previous = chain["snaps"][0]
    untouched_seen = 0
    for path, step in zip(published, steps, strict=True):
        delta = read_delta(path)
        now = chain["snaps"][step]
        rows = delta.tensors("rank-00000.pt")
        for table in ("t_cat_0", "t_cat_1"):
            ids = rows[f"{table}/ids"]
            changed = (now[f"{table}/rows"] != previous[f"{table}/rows"]).any(dim=1)
            changed_ids = set(changed.nonzero().flatten().tolist())
            assert changed_ids <= set(ids.tolist()), f"{path.name}: a changed row is missing"
            untouched = torch.ones(len(changed), dtype=torch.bool)
            untouched[ids] = False
            untouched_seen += int(untouched.sum())
            assert not changed[untouched].any()  # rows of untouched ids did not change
            assert torch.equal(rows[f"{table}/rows"], now[f"{table}/rows"][ids])
        state = rows["t_cat_0/state/momentum1"]  # the fused optimizer's row state
        assert torch.equal(state, now["t_cat_0/state/t_cat_0.momentum1"][rows["t_cat_0/ids"]])
        assert len(rows["t_cat_1/ids"]) == 200  # data-parallel: the whole table
        assert rows["t_cat_1/state/exp_avg"].shape == (200, 4)
        dense = delta.tensors(DENSE_FILE)
        assert "dense_arch.model._mlp.0._linear.weight" in dense  # the inference model's names
        for name, value in dense.items():
            assert torch.equal(value, now[f"dense/{name}"]), name
        previous = now
    assert untouched_seen > 0  # the deltas are not whole tables


def test_chain_restores_the_trained_state_bit_exactly(chain: dict[str, Any]) -> None:
    root = chain["root"]
    last = restore_chain(
        chain["target"], root / "base", chain_of(root), optimizer=chain["optimizer"]
    )
    assert last is not None and last.sequence == len(chain["published"])
    assert_same(chain_state(chain["target"], chain["optimizer"]), chain["final"])
    # the base alone is the state before training: the deltas carried the difference
    restore_chain(chain["target"], root / "base", [], optimizer=chain["optimizer"])
    assert not torch.equal(
        chain_state(chain["target"])["t_cat_0/rows"], chain["final"]["t_cat_0/rows"]
    )


def _copy_chain(chain: dict[str, Any], tmp_path: Path) -> Path:
    root = tmp_path / "chain"
    shutil.copytree(chain["root"], root)
    return root


@pytest.mark.parametrize(
    "case", ["out_of_order", "gap", "foreign_base", "damaged", "unsigned_with_key", "truncated"]
)
def test_a_bad_chain_is_refused_before_anything_is_written(
    chain: dict[str, Any], tmp_path: Path, case: str
) -> None:
    root = _copy_chain(chain, tmp_path)
    deltas = chain_of(root)
    base, key, named = root / "base", None, deltas[1].name
    if case == "out_of_order":
        deltas = [deltas[0], deltas[1], deltas[0]]
        named, reason = deltas[0].name, "out of order"
    elif case == "gap":
        deltas = [deltas[0], deltas[2]]
        named, reason = deltas[1].name, f"{delta_name(2)} is missing"
    elif case == "foreign_base":
        base, named, reason = chain["out"] / "final", deltas[0].name, "another chain"
    elif case == "damaged":
        file = deltas[1] / "rank-00000.pt"
        data = bytearray(file.read_bytes())
        data[len(data) // 2] ^= 0xFF
        file.write_bytes(bytes(data))
        reason = "damaged"
    elif case == "truncated":
        (deltas[1] / DENSE_FILE).write_bytes((deltas[1] / DENSE_FILE).read_bytes()[:-7])
        reason = "truncated"
    else:
        key, named, reason = KEY, deltas[0].name, "not signed"
    before = chain_state(chain["target"], chain["optimizer"])
    with pytest.raises(DeltaRefusedError, match=reason) as caught:
        restore_chain(chain["target"], base, deltas, optimizer=chain["optimizer"], key=key)
    assert named in str(caught.value)
    assert_same(chain_state(chain["target"], chain["optimizer"]), before)  # untouched


def test_a_delta_of_another_model_is_refused(chain: dict[str, Any], tmp_path: Path) -> None:
    root = _copy_chain(chain, tmp_path)
    first = chain_of(root)[0]
    info = json.loads((first / DELTA_FILE).read_text())
    assert info["tables"]["t_cat_0"]["rows"] == 200
    # Rewrite delta.json as another model's (and its manifest entry, so only the model differs).
    info["tables"]["t_cat_0"]["rows"] = 300
    (first / DELTA_FILE).write_text(json.dumps(info))
    manifest = json.loads((first / MANIFEST_FILE).read_text())
    manifest["files"][DELTA_FILE] = file_checksum(first / DELTA_FILE)
    (first / MANIFEST_FILE).write_text(json.dumps(manifest))
    with pytest.raises(DeltaRefusedError, match="another model") as caught:
        restore_chain(chain["target"], root / "base", [first])
    assert first.name in str(caught.value)


def test_signed_deltas_and_bad_ids(chain: dict[str, Any], tmp_path: Path) -> None:
    module = chain["target"]
    base_id = checkpoint_id(chain["root"] / "base")
    ids = {"t_cat_0": torch.tensor([5, 1, 5]), "t_cat_1": torch.tensor([7])}
    path = write_delta(
        tmp_path, module, ids, sequence=1, parent=base_id, base=base_id, step=0, key=KEY
    )
    delta = read_delta(path, key=KEY)
    assert delta.info["tables"]["t_cat_0"]["ids"] == 2
    assert delta.tensors("rank-00000.pt")["t_cat_0/ids"].tolist() == [1, 5]
    with pytest.raises(DeltaRefusedError, match="does not match the key"):
        read_delta(path, key=b"x" * 32)
    with pytest.raises(ValueError, match="has 200 rows"):
        write_delta(tmp_path, module, {"t_cat_0": torch.tensor([200])}, **_next(base_id))
    with pytest.raises(ValueError, match="not in the model"):
        write_delta(tmp_path, module, {"nope": torch.tensor([1])}, **_next(base_id))
    assert sorted(p.name for p in tmp_path.iterdir()) == [path.name]  # nothing else written


def test_a_rank_without_the_key_stops_the_publish_of_a_signed_delta(
    chain: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A rank whose environment lacks the key writes its file with a CRC only; a signed manifest
    # over it would be refused by every reader, and the chain would stall behind it.
    import lightning_torchrec.checkpoint.delta as delta_module

    checksum = delta_module.file_checksum

    def keyless_rank_file(path: Path, strong: bool = False) -> dict[str, Any]:
        return checksum(path, strong=strong and not path.name.startswith("rank-"))

    monkeypatch.setattr(delta_module, "file_checksum", keyless_rank_file)
    module, base_id = chain["target"], checkpoint_id(chain["root"] / "base")
    with pytest.raises(CheckpointWriteError, match="ranks without the checkpoint key wrote"):
        write_delta(tmp_path, module, {"t_cat_0": torch.tensor([1])}, **_next(base_id), key=KEY)
    assert list(tmp_path.iterdir()) == []


def test_non_finite_rows_are_neither_published_nor_restored(
    chain: dict[str, Any], tmp_path: Path
) -> None:
    module, base_id = chain["target"], checkpoint_id(chain["root"] / "base")
    local = shard_info(model_tables(module)["t_cat_0"].tensor).shards[0].tensor
    kept = local[1].clone()
    local[1, 0] = float("nan")
    try:
        with pytest.raises(NonFiniteCheckpointError, match="refusing to publish delta-000002"):
            write_delta(tmp_path / "w", module, {"t_cat_0": torch.tensor([1, 2])}, **_next(base_id))
    finally:
        local[1] = kept
    assert not (tmp_path / "w" / delta_name(2)).exists()
    root = _copy_chain(chain, tmp_path)
    first = chain_of(root)[0]
    rows = torch.load(first / "rank-00000.pt", weights_only=True)
    rows["t_cat_0/rows"][0, 0] = float("inf")
    torch.save(rows, first / "rank-00000.pt")
    manifest = json.loads((first / MANIFEST_FILE).read_text())
    manifest["files"]["rank-00000.pt"] = file_checksum(first / "rank-00000.pt")
    (first / MANIFEST_FILE).write_text(json.dumps(manifest))
    before = chain_state(module, chain["optimizer"])
    with pytest.raises(DeltaRefusedError, match="t_cat_0/rows holds NaN or inf") as caught:
        restore_chain(module, root / "base", [first], optimizer=chain["optimizer"])
    assert first.name in str(caught.value)
    assert_same(chain_state(module, chain["optimizer"]), before)


def test_column_wise_tables_are_refused_clearly(chain: dict[str, Any], tmp_path: Path) -> None:
    module = tiny_dlrm(embedding_dim=8)
    types = {"t_cat_0": "column_wise", "t_cat_1": "table_wise"}
    cw = TorchRecStrategy(constraints=sharding_constraints(types, min_partition=4), log_plan=False)
    cpu_trainer(cw, max_epochs=0).fit(module, _data())
    with pytest.raises(ShardingConflictError, match="'t_cat_0' is sharded by columns"):
        write_delta(tmp_path, module, {"t_cat_0": torch.tensor([3])}, **_next("0" * 64))
    assert list(tmp_path.iterdir()) == []
    # A publisher refuses the plan at the fit's start, before it writes the chain's base.
    cw = TorchRecStrategy(constraints=sharding_constraints(types, min_partition=4), log_plan=False)
    publisher = DeltaPublisher(tmp_path / "chain")
    with pytest.raises(ShardingConflictError, match="'t_cat_0' is sharded by columns"):
        cpu_trainer(cw, max_steps=2, callbacks=[publisher]).fit(tiny_dlrm(embedding_dim=8), _data())
    assert not (tmp_path / "chain" / "base").exists()
    # Restoring onto such a plan is refused too, before the base is loaded.
    before = {k: v.clone() for k, v in chain_state(module, None).items()}
    with pytest.raises(ShardingConflictError, match="'t_cat_0' is sharded by columns"):
        restore_chain(module, chain["root"] / "base", chain_of(chain["root"]))
    assert_same(chain_state(module, None), before)


def _next(base_id: str) -> dict[str, Any]:
    return {"sequence": 2, "parent": base_id, "base": base_id, "step": 1}


def test_a_resumed_fit_continues_the_chain(tmp_path: Path) -> None:
    """A fit killed after step 7 resumes from its step-5 checkpoint: the ids touched at steps 4
    and 5 (after delta 1, before the checkpoint) come from the checkpoint, the delta published
    at step 6 is dropped and published again by the resumed fit."""
    root = tmp_path / "chain"
    saves = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    first = DeltaPublisher(root, every_n_steps=3, at_partition_end=False)
    _trainer([first, saves], max_steps=7, enable_checkpointing=True).fit(tiny_dlrm(), _data())
    assert [p.name for p in chain_of(root)] == [delta_name(1), delta_name(2)]
    killed_id = read_delta(chain_of(root)[1]).id
    # Killed while writing a third delta: its hidden folder stays, and the resumed fit drops it.
    unfinished = root / f".{delta_name(3)}.partial-0123456789ab"
    unfinished.mkdir()
    (unfinished / "rank-00000.pt").write_bytes(b"half")
    (resume_from,) = (tmp_path / "ckpt").iterdir()
    module = tiny_dlrm()
    second = DeltaPublisher(root, every_n_steps=3, at_partition_end=False)
    again = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=5, save_top_k=-1)
    trainer = _trainer([second, again], max_steps=12, enable_checkpointing=True)
    with pytest.warns(UserWarning, match="published after the checkpoint"):
        trainer.fit(module, _data(), ckpt_path=str(resume_from))
    deltas = chain_of(root)
    assert not unfinished.exists()
    assert [read_delta(p).info["step"] for p in deltas] == [3, 6, 9, 12]
    assert read_delta(deltas[1]).id != killed_id
    final = chain_state(module)
    target, _ = _target()
    restore_chain(target, root / "base", deltas)
    assert_same(chain_state(target), final)


def test_time_trigger_and_a_folder_of_another_run(tmp_path: Path) -> None:
    root = tmp_path / "chain"
    timed = DeltaPublisher(
        root, every_minutes=1e-9, at_partition_end=False, time_check_every_n_steps=2
    )
    trainer, model = _trainer([timed], max_steps=5), tiny_dlrm()
    trainer.fit(model, _data())
    assert [read_delta(p).info["step"] for p in timed.published] == [2, 4]
    # The fit's end undoes what the publisher set on the model the strategy keeps.
    dmp = trainer.strategy.run.dmp
    assert not timed.writer.touched.attached and dmp.get_delta_tracker() is None
    sharded = [m for m in dmp.modules() if hasattr(m, "post_lookup_tracker_fn")]
    assert sharded and all(m.post_lookup_tracker_fn is None for m in sharded)
    fresh = DeltaPublisher(root)
    with pytest.raises(FileExistsError, match="another run"):
        _trainer([fresh], max_steps=1).fit(tiny_dlrm(), _data())


def test_two_rank_chain_restores_on_one_process_and_back(
    chain: dict[str, Any], tmp_path: Path
) -> None:
    """2 ranks (a row-wise and a table-wise table) publish; one process restores their chain
    and equals their final checkpoint loaded on one process. The 2 ranks restore this file's
    one-process chain and equal its final state. A write failing on rank 1 is agreed."""
    run_script("delta_ranks.py", str(tmp_path), str(chain["out"]))
    report = torch.load(tmp_path / "report.pt", weights_only=False)
    assert report["errors"] == ["CheckpointWriteError", "CheckpointWriteError"]
    assert report["left"] == [[], []]  # no final folder, no partial one
    assert report["one_rank_chain_equal"] == [True, True]
    root = tmp_path / "chain"
    assert len(chain_of(root)) >= 3
    target, optimizer = _target()
    restore_chain(target, root / "base", chain_of(root), optimizer=optimizer)
    restored = chain_state(target, optimizer)
    reference, reference_optimizer = _target()
    restore_chain(reference, tmp_path / "final", [], optimizer=reference_optimizer)
    assert_same(restored, chain_state(reference, reference_optimizer))


def test_a_fabric_loop_publishes_with_a_delta_writer(tmp_path: Path) -> None:
    strategy = TorchRecFabricStrategy(
        log_plan=False, fused_params={"learning_rate": 0.1}, constraints=table_wise(2)
    )
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()

    def setup() -> tuple[Any, Any]:
        torch.manual_seed(0)
        unsharded = dlrm_click_model([50, 50], embedding_dim=4, dense_arch_layer_sizes=[4])
        model = fabric.setup_module(unsharded)
        return model, fabric.setup_optimizers(torch.optim.SGD(dense_parameters(model), lr=0.1))

    model, optimizer = setup()
    writer = DeltaWriter(tmp_path / "chain")
    state = {"model": model, "optimizer": optimizer, "deltas": writer}
    writer.start(fabric.strategy.run.dmp, model.module, lambda path: fabric.save(path, state))
    batches = DataLoader(SyntheticClickDataset([50, 50], 6, 4), batch_size=None)
    for step, batch in enumerate(batches, 1):
        optimizer.zero_grad()
        fabric.backward(model(batch)[0])
        optimizer.step()
        if step % 2 == 0:
            writer.publish(model.module, step, optimizer=optimizer)
    fabric.save(tmp_path / "final", state)  # the writer's state rides along
    assert [p.name for p in chain_of(tmp_path / "chain")] == [delta_name(i) for i in (1, 2, 3)]
    final = chain_state(model.module)
    target, target_optimizer = setup()
    restore_chain(target.module, tmp_path / "chain" / "base", chain_of(tmp_path / "chain"))
    assert_same(chain_state(target.module), final)
    again = DeltaWriter(tmp_path / "chain")
    loaded = {"model": target, "optimizer": target_optimizer, "deltas": again}
    fabric.load(tmp_path / "final", loaded)
    assert (again.sequence, again.last_id, again.base_id) == (3, writer.last_id, writer.base_id)


def test_the_size_benchmark_meets_its_target(tmp_path: Path) -> None:
    result = delta_size(["--quick", "--out", str(tmp_path)])
    assert all(0.05 <= f < 0.06 for f in result["touched_fraction"].values())
    assert result["delta_ratio"] <= 0.10 and result["delta_with_optimizer_ratio"] <= 0.10
    assert (tmp_path / "delta_size.json").is_file()


def test_a_managed_collision_model_restores_its_remapping(tmp_path: Path) -> None:
    """Evicting MCH modules remap raw ids every 2 steps: the deltas carry the remapping (whole,
    in dense.pt) and the rows the remapped ids reach, so every raw id finds the same row."""
    publisher = DeltaPublisher(tmp_path / "chain", every_n_steps=5, with_optimizer=True)
    module = mc_model.module()
    trainer = cpu_trainer(
        mc_model.strategy(), max_steps=12, limit_val_batches=0, callbacks=[publisher]
    )
    trainer.fit(module, mc_model.data())
    dense = read_delta(publisher.published[-1]).tensors(DENSE_FILE)
    assert any("_mch_" in name for name in dense)  # the remapping, named as in the model
    want = (chain_state(module), mc_model.lookup(module))
    target = mc_model.module()
    cpu_trainer(mc_model.strategy(), max_epochs=0).fit(target, mc_model.data())
    restore_chain(target, tmp_path / "chain" / "base", chain_of(tmp_path / "chain"))
    assert_same((chain_state(target), mc_model.lookup(target)), want)


def test_settings_the_publisher_cannot_follow_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="every_n_steps=0"):
        DeltaPublisher(tmp_path, every_n_steps=0)
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False, pipeline="semi_sync")
    trainer = cpu_trainer(strategy, max_steps=1, callbacks=[DeltaPublisher(tmp_path / "chain")])
    with pytest.raises(ValueError, match="cannot follow pipeline=.semi_sync."):
        trainer.fit(tiny_dlrm(), _data())
    assert not (tmp_path / "chain").exists()


def test_a_state_saved_without_touched_ids_publishes_whole_tables(
    chain: dict[str, Any], tmp_path: Path
) -> None:
    """A save while handling an exception gathers nothing (the ranks may be at different
    points): a run resumed from it cannot know the rows touched, so its next delta is whole."""
    base_id = checkpoint_id(chain["root"] / "base")
    writer = DeltaWriter(tmp_path)
    state = {"sequence": 0, "last_id": base_id, "base_id": base_id, "touched": None}
    writer.load_state_dict(state)
    assert writer.state_dict()["touched"] is None  # still unknown until a delta is published
    first = read_delta(writer.publish(chain["target"], 5))
    whole = {"rows": 200, "dim": 4, "ids": 200}
    assert first.info["tables"] == {"t_cat_0": whole, "t_cat_1": whole}
    assert writer.state_dict()["touched"] == {}  # known again: nothing touched since
