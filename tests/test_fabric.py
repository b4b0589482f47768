"""``TorchRecFabricStrategy`` in real processes: 2 gloo ranks, then one rank resharding.

One launch (tests/scripts/fabric_two_ranks.py) runs a raw TorchRec loop, a Fabric loop and a
Trainer run of the same model, data and seeds, resumes the Fabric checkpoint under Fabric and
under the Trainer, and injects a bad batch and a NaN loss on rank 1;
tests/scripts/fabric_one_rank.py loads the 2-rank checkpoint on one rank.
"""

from __future__ import annotations

import gc
import sys
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
import torch.distributed as dist
from lightning.fabric.accelerators import CPUAccelerator
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.fabric.strategies import DDPStrategy
from torch.utils.data import DataLoader

from lightning_torchrec import (
    BatchValidationError,
    PeerFailureError,
    TorchRecFabricStrategy,
    dense_parameters,
)
from lightning_torchrec.compat.lightning_fabric import ReportingLauncher
from lightning_torchrec.data import SyntheticClickDataset
from lightning_torchrec.errors import CheckpointMismatchError
from lightning_torchrec.fabric.strategy import TorchRecFabricStrategy as Direct
from lightning_torchrec.models.dlrm import dlrm_click_model
from lightning_torchrec.training import run as sharded_run
from tests.helpers import assert_same, load_ranks, one_rank_group, run_script  # noqa: F401
from tests.scripts.factory import table_wise

K = 6


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fabric")
    run_script("fabric_two_ranks.py", str(out))
    run_script("fabric_one_rank.py", str(out))
    return out


def test_fabric_strategy_is_registered_and_exported() -> None:
    assert TorchRecFabricStrategy is Direct
    fabric = L.Fabric(strategy="torchrec", accelerator="cpu", devices=1)
    assert isinstance(fabric.strategy, TorchRecFabricStrategy)
    with pytest.raises(ValueError, match="batch_checks"):
        TorchRecFabricStrategy(batch_checks="never")  # type: ignore[arg-type]


def test_registry_name_under_launch(run: Path) -> None:
    assert [r["name"] for r in load_ranks(run, "registry")] == ["TorchRecFabricStrategy"] * 2


@pytest.mark.parametrize("other", ["raw", "trainer"])
def test_fabric_loop_is_bit_equal(run: Path, other: str) -> None:
    fabric, theirs = load_ranks(run, "fabric"), load_ranks(run, other)
    for rank in range(2):
        assert_same(fabric[rank]["losses"], theirs[rank]["losses"], f"rank {rank} losses")
        assert_same(fabric[rank]["model"], theirs[rank]["model"], f"rank {rank} weights")


def test_the_scheduler_drives_dense_and_fused_learning_rates(run: Path) -> None:
    for snap in load_ranks(run, "fabric"):  # 12 steps, halved every 4: 1/8 of the start
        assert snap["lrs"][0] == pytest.approx(1e-2 / 8)
        assert snap["lrs"][1:] and all(lr == pytest.approx(0.2 / 8) for lr in snap["lrs"][1:])


@pytest.mark.parametrize("resume", ["fabric_resume", "trainer_resume"])
def test_resume_from_fabric_checkpoint_is_bit_equal(run: Path, resume: str) -> None:
    full, resumed = load_ranks(run, "fabric"), load_ranks(run, resume)
    for rank in range(2):
        assert_same(full[rank]["losses"][K:], resumed[rank]["losses"], f"rank {rank} losses")
        assert_same(full[rank]["model"], resumed[rank]["model"], f"rank {rank} weights")


def test_fabric_loads_a_trainer_checkpoint(run: Path) -> None:
    trainer, fabric = load_ranks(run, "trainer"), load_ranks(run, "fabric_from_trainer")
    for rank in range(2):
        assert fabric[rank]["global_step"] == 12  # the Trainer's entries come back as the rest
        assert_same(trainer[rank]["model"], fabric[rank]["model"], f"rank {rank} weights")
        assert_same(trainer[rank]["optim"], fabric[rank]["optim"], f"rank {rank} optimizer")


def _whole(snapshots: list[dict], key: str) -> torch.Tensor:
    shards = [s for snap in snapshots for s in snap["model"][key]]
    rows = max(off[0] for off, t in shards) + 1 if shards else 0
    out = torch.zeros(sum(t.shape[0] for _, t in shards), shards[0][1].shape[1])
    for (r, c), t in shards:
        out[r : r + t.shape[0], c : c + t.shape[1]] = t
    assert rows <= out.shape[0]
    return out


def test_reshard_two_ranks_to_one(run: Path) -> None:
    saved, one = load_ranks(run, "fabric_saved"), torch.load(run / "reshard_rank0.pt")
    assert one["step"] == K
    for key, value in one["model"].items():
        if isinstance(value, list):  # a table: one rank now holds all of it
            assert torch.equal(_whole([one], key), _whole(saved, key)), key
        else:
            assert_same(value, saved[0]["model"][key], key)


@pytest.mark.parametrize(
    ("fault", "error", "step"),
    [
        ("bad_batch", "BatchValidationError", 2),
        ("nan_loss", "NonFiniteLossError", 4),
        ("second_forward", "BatchValidationError", 2),  # every forward is checked
        # An evaluation forward read the bad id as row 0 and raised nothing (wrong metrics).
        ("eval_bad_batch", "BatchValidationError", 2),
    ],
)
def test_one_rank_fault_raises_the_same_named_error_everywhere(
    run: Path, fault: str, error: str, step: int
) -> None:
    ranks = load_ranks(run, "faults")
    assert [r["meta_in_optimizer"] for r in ranks] == [False, False]  # fabric.setup(model, opt)
    seen = [r[fault] for r in ranks]
    assert [s[0] for s in seen] == [error, error]
    assert [s[2] for s in seen] == [step, step]
    assert "rank 1" in seen[0][1] and "rank 1" in seen[1][1] or "[1]" in seen[1][1]


def test_a_rank_still_training_when_another_finishes_raises_uneven_data_everywhere(
    run: Path,
) -> None:
    # Rank 1's vote before its extra forward meets rank 0's finish(): no hang, one named error.
    seen = [r["uneven"] for r in load_ranks(run, "faults")]
    assert [s[0] for s in seen] == ["UnevenDataError", "UnevenDataError"]
    last = seen[0][2]
    assert seen[1][2] == last + 1  # rank 0 raised in finish() after its last step, rank 1 before
    assert all("rank(s) [0] have" in s[1] and "rank(s) [1] have more" in s[1] for s in seen)


def test_a_rank_still_evaluating_when_another_trains_on_raises_uneven_data_everywhere(
    run: Path,
) -> None:
    # Rank 1's fifth evaluation forward met rank 0's next training step: no hang, one error.
    seen = [r["eval_uneven"] for r in load_ranks(run, "faults")]
    assert [s[0] for s in seen] == ["UnevenDataError", "UnevenDataError"]
    assert [s[2] for s in seen] == [3, 4]  # rank 0 after its last evaluation batch, rank 1 in it
    told = "rank(s) [1] ran an evaluation forward while rank(s) [0] had ended their evaluation"
    assert all(told in s[1] for s in seen)


def test_a_users_uncaught_error_on_one_rank_is_raised_by_type_on_the_other(run: Path) -> None:
    # Rank 0 raised a PeerFailureError that could only say "another rank probably died"; waiting
    # in the forward's all-to-all, it raised gloo's bare RuntimeError.
    failed = torch.load(run / "user_error_rank1.pt", weights_only=False)
    assert failed == {"error": "Boom"}  # rank 1 ended through sys.excepthook
    peer = torch.load(run / "user_error_rank0.pt", weights_only=False)
    assert peer["error"] == "Boom" and peer["boom"] and peer["peer_failure"], peer
    assert (
        "stopped because another rank failed: rank 1 raised Boom at Fabric step 2: a bug in "
        "rank 1's forward at step 2 (seen here as: "
    ) in peer["message"]


ROWS = [20, 20]


def one_rank_fabric(**kwargs: Any) -> tuple[L.Fabric, Any]:
    """A Fabric of this process's one-rank group and a tiny DLRM with two fused tables."""
    strategy = TorchRecFabricStrategy(
        log_plan=False, fused_params={"learning_rate": 0.1}, constraints=table_wise(2), **kwargs
    )
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    torch.manual_seed(0)
    sizes = dict(dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1])
    return fabric, dlrm_click_model(ROWS, embedding_dim=4, **sizes)


def train(fabric: L.Fabric, model: Any, optimizers: list[Any], schedulers: list[Any]) -> None:
    for batch in DataLoader(SyntheticClickDataset(ROWS, 2, 4), batch_size=None):
        for optimizer in optimizers:
            optimizer.zero_grad()
        fabric.backward(model(batch)[0])
        for stepper in (*optimizers, *schedulers):
            stepper.step()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize(
    ("options", "raised"),
    [({}, True), ({"validate_batches": 1}, False), ({"validate_batches": False}, False)],
)
def test_an_evaluation_forward_is_checked_as_validate_batches_says(
    options: dict[str, Any], raised: bool
) -> None:
    # In eval() mode the id 20 of a 20-row table was read as row 0: no error, wrong outputs.
    fabric, unsharded = one_rank_fabric(**options)
    model = fabric.setup_module(unsharded)
    first, second = DataLoader(SyntheticClickDataset(ROWS, 2, 4), batch_size=None)
    values = second.sparse_features.values()
    values[0] = 20
    model.eval()
    with torch.no_grad():
        model(first)
        if raised:
            with pytest.raises(BatchValidationError, match="evaluation forward 1 after step 0"):
                model(second)
        else:
            model(second)  # the first forward only (validate_batches=1), or none
    model.train()


@pytest.mark.usefixtures("one_rank_group")
@pytest.mark.parametrize("setup", ["setup_optimizers", "setup"])
def test_only_the_first_of_several_optimizers_drives_the_fused_tables(setup: str) -> None:
    fabric, unsharded = one_rank_fabric()
    dense = unsharded.model.dense_arch.parameters(), unsharded.model.over_arch.parameters()
    plain = [torch.optim.SGD(params, lr=0.1) for params in dense]
    if setup == "setup":
        model, a, b = fabric.setup(unsharded, *plain)
    else:
        model = fabric.setup_module(unsharded)
        a, b = fabric.setup_optimizers(*plain)
    halve, tenth = (torch.optim.lr_scheduler.StepLR(o, 1, gamma=g) for o, g in ((a, 0.5), (b, 0.1)))
    train(fabric, model, [a, b], [halve, tenth])
    # The fused learning rate follows a's schedule alone (it was scaled by both: 0.00025).
    assert [g["lr"] for g in a.param_groups[1:]] == [pytest.approx(0.1 / 4)]  # the kernel's
    assert [g["lr"] for g in b.param_groups] == [pytest.approx(0.1 / 100)]  # dense only


@pytest.mark.usefixtures("one_rank_group")
def test_an_lr_scheduler_in_the_state_is_saved_and_loaded_by_its_state(tmp_path: Path) -> None:
    # Fabric saves objects with state_dict()/load_state_dict() by their state and loads them in
    # place; the scheduler itself (which holds the optimizer) used to be pickled into meta.pt.
    def run(schedule: bool) -> tuple[L.Fabric, Any, Any, Any]:
        fabric, unsharded = one_rank_fabric()
        model = fabric.setup_module(unsharded)
        optimizer = fabric.setup_optimizers(torch.optim.SGD(dense_parameters(model), lr=0.1))
        scheduler = torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5)
        train(fabric, model, [optimizer], [scheduler] if schedule else [])
        return fabric, model, optimizer, scheduler

    fabric, model, optimizer, scheduler = run(schedule=True)  # two steps: lr / 4
    saved = {"model": model, "optimizer": optimizer, "scheduler": scheduler, "counts": {"a": 1}}
    fabric.save(tmp_path / "ckpt", saved)
    fabric, model, optimizer, fresh = run(schedule=False)
    state = {"model": model, "optimizer": optimizer, "scheduler": fresh, "counts": {}}
    fabric.load(tmp_path / "ckpt", state)
    assert state["scheduler"] is fresh and state["counts"] == {"a": 1}
    assert fresh.state_dict() == scheduler.state_dict()
    assert [g["lr"] for g in optimizer.param_groups] == [pytest.approx(0.1 / 4)] * 2


@pytest.mark.usefixtures("one_rank_group")
def test_strict_false_loads_into_a_model_with_a_layer_added(tmp_path: Path) -> None:
    # As Fabric's own strategies (`module.load_state_dict(strict=strict)`).
    fabric, unsharded = one_rank_fabric()
    model = fabric.setup_module(unsharded)
    fabric.save(tmp_path / "ckpt", {"model": model})
    fabric, wider = one_rank_fabric()
    wider.extra = torch.nn.Linear(2, 2)
    model = fabric.setup_module(wider)
    with pytest.raises(CheckpointMismatchError, match="extra.weight"):
        fabric.load(tmp_path / "ckpt", {"model": model})
    with pytest.warns(UserWarning, match=r"not in the checkpoint: \['extra.weight', 'extra.b"):
        fabric.load(tmp_path / "ckpt", {"model": model}, strict=False)


@pytest.mark.parametrize(
    ("name", "args"),
    [("barrier", ()), ("broadcast", ("ckpt",)), ("all_reduce", (torch.ones(1),))]
    + [("all_gather", (torch.ones(1),))],
)
def test_the_loops_collectives_name_a_dead_peer(
    monkeypatch: pytest.MonkeyPatch, name: str, args: tuple
) -> None:
    # fabric.barrier() & co. raised gloo's bare "Connection closed by peer" RuntimeError.
    def dead_peer(*_: Any, **__: Any) -> None:
        raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [::1]:1")

    monkeypatch.setattr(DDPStrategy, name, dead_peer)
    with pytest.raises(PeerFailureError, match="another rank probably died"):
        getattr(TorchRecFabricStrategy(), name)(*args)


def test_the_strategy_reports_an_uncaught_error_while_set_up_and_only_then(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    printed: list[BaseException] = []
    posted: list[tuple[BaseException, str, int]] = []
    monkeypatch.setattr(sys, "excepthook", lambda kind, error, tb: printed.append(error))
    monkeypatch.setattr(
        sharded_run, "post", lambda error, where, rank: posted.append((error, where, rank))
    )
    monkeypatch.setattr(Direct, "global_rank", property(lambda self: 1))
    monkeypatch.setattr(Direct, "world_size", property(lambda self: 2))
    # The set-up of a strategy over two ranks, without their process group.
    monkeypatch.setattr(DDPStrategy, "setup_environment", lambda self: None)
    monkeypatch.setattr(dist, "get_backend", lambda *args: "gloo")
    before = sys.excepthook
    devices = [torch.device("cpu")] * 2
    strategy = TorchRecFabricStrategy(
        accelerator=CPUAccelerator(),
        parallel_devices=devices,
        cluster_environment=LightningEnvironment(),
    )
    strategy.setup_environment()
    strategy.step = 3
    bug = KeyError("user_id")
    sys.excepthook(KeyError, bug, None)  # what Python does with an error nobody caught
    assert posted == [(bug, "Fabric step 3", 1)] and printed == [bug]  # reported, then printed
    strategy.teardown()
    assert sys.excepthook is before  # restored
    # A strategy never torn down takes its hook out when it is collected.
    strategy = TorchRecFabricStrategy()
    strategy.setup_environment()
    assert sys.excepthook is not before
    del strategy
    gc.collect()
    assert sys.excepthook is before


def test_a_function_launched_with_fork_or_spawn_reports_its_error(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's process wrapper catches it before sys.excepthook could see it.
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("LOCAL_RANK", "0")
    fabric = L.Fabric(strategy="torchrec_fork", accelerator="cpu", devices=2)  # not launched
    strategy = fabric.strategy
    assert isinstance(strategy.launcher, ReportingLauncher)
    reported: list[BaseException] = []
    monkeypatch.setattr(strategy, "report_failure", reported.append)
    bug = ValueError("a bug in the loop")

    def loop() -> None:
        raise bug

    with pytest.raises(ValueError, match="a bug in the loop"):
        strategy.launcher._wrapping_function(0, loop, (), {}, None)
    assert reported == [bug]
