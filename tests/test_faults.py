"""Faults and configuration errors in one process: clear errors at setup or at the bad step."""

from __future__ import annotations

from typing import Any

import lightning as L
import pytest
import torch
from torchrec.distributed.types import ShardingPlan

from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy
from lightning_torchrec.callbacks.preemption import PreemptionCheckpoint
from lightning_torchrec.errors import NonFiniteLossError
from lightning_torchrec.faults import StepGuard, nonfinite_tensors, peer_failure
from lightning_torchrec.planning import default_sharders, make_topology
from lightning_torchrec.setup_checks import (
    check_fused_optimizer_for_device,
    check_plan_matches_model,
    explain_planner_error,
)


def dlrm(rows: list[int] | None = None) -> DLRMClickModule:
    return DLRMClickModule(
        rows or [10, 10], embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1]
    )


def test_nonfinite_loss_is_judged_at_the_next_check_naming_the_step() -> None:
    guard = StepGuard("raise")
    guard.record_loss(torch.tensor(0.5), 3)
    guard.check(None, batch_checked=True)  # a finite loss passes
    guard.record_loss({"loss": torch.tensor(float("inf"))}, 7)
    with pytest.raises(
        NonFiniteLossError, match=r"global step 7 on rank\(s\) \[0\].*this rank: inf"
    ):
        guard.check(None, batch_checked=False)
    guard.check(None, batch_checked=False)  # judged once
    guard.record_loss(torch.tensor(float("nan")), 8)
    with pytest.raises(NonFiniteLossError, match="global step 8"):
        guard.flush()
    ignoring = StepGuard("ignore")
    ignoring.record_loss(torch.tensor(float("nan")), 9)
    ignoring.flush()
    with pytest.raises(ValueError, match="on_nonfinite_loss"):
        TorchRecStrategy(on_nonfinite_loss="skip")  # type: ignore[arg-type]


def test_nonfinite_tensors_names_them() -> None:
    state = {"a": torch.ones(2), "b": {"c": torch.tensor([1.0, float("nan")])}, "n": 3}
    assert nonfinite_tensors(state) == ["b.c"]


def test_peer_failure_explains_dead_peers_only() -> None:
    err = peer_failure(RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]"), 20)
    assert err is not None and "another rank probably died" in str(err)
    assert peer_failure(RuntimeError("shape mismatch")) is None
    with pytest.raises(ValueError):
        PreemptionCheckpoint("x", check_every_n_steps=0)


def test_plan_for_tables_the_model_does_not_have() -> None:
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding

    ps = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0])
    path = "model_and_loss.model.sparse_arch.embedding_bag_collection"
    plan = ShardingPlan({path: EmbeddingModuleShardingPlan({"t_user": ps})})
    with pytest.raises(ValueError, match=r"tables \['t_user'\].*t_cat_0"):
        check_plan_matches_model(plan, dlrm())
    t = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        strategy=TorchRecStrategy(plan=plan),
    )
    with pytest.raises(ValueError, match="does not have"):
        t.fit(dlrm())
    assert t.global_step == 0


def test_fused_adam_on_cpu_is_refused_at_setup() -> None:
    with pytest.raises(ValueError, match="'adam'.*not supported on CPU"):
        check_fused_optimizer_for_device(default_sharders({"optimizer": "adam"}), "cpu")
    check_fused_optimizer_for_device(default_sharders({"optimizer": "adam"}), "cuda")


def test_tables_too_large_explained_in_bytes() -> None:
    from torchrec.distributed.planner import EmbeddingShardingPlanner

    model = dlrm([10, 40_000_000_000])
    topology = make_topology(2, 2, "cpu")
    with pytest.raises(Exception) as planner_error:
        EmbeddingShardingPlanner(topology=topology).plan(model, default_sharders(None))
    msg = explain_planner_error(planner_error.value, model, topology)
    assert "640000000160 bytes" in msg  # 4e10 x 4 x fp32 + 10 x 4 x fp32
    assert "t_cat_1: 596.0 GiB" in msg and "Each of the 2 ranks offers" in msg
    assert "Planner said: Unable to find a plan" in msg
    t = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        strategy=TorchRecStrategy(log_plan=False),
    )
    with pytest.raises(ValueError, match="The tables need 596.0 GiB"):
        t.fit(dlrm([10, 40_000_000_000]))


def test_a_collective_failing_in_the_backward_is_explained() -> None:
    from lightning_torchrec import PeerFailureError

    class DiesInBackward(torch.autograd.Function):
        @staticmethod
        def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
            return x.clone()

        @staticmethod
        def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
            raise RuntimeError("[gloo] Connection closed by peer [127.0.0.1]:29500")

    class Module(DLRMClickModule):
        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            return DiesInBackward.apply(super().training_step(batch, batch_idx))

    model = Module(
        [10, 10], embedding_dim=4, dense_arch_layer_sizes=[4], over_arch_layer_sizes=[4, 1]
    )
    data = SyntheticClickData(num_embeddings=10, num_sparse_features=2, batch_size=8)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy="torchrec",
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        limit_val_batches=0,
    )
    with pytest.raises(PeerFailureError, match="another rank probably died.*Connection closed"):
        trainer.fit(model, datamodule=data)
