"""Faults and configuration errors in one process: clear errors at setup or at the bad step."""

from __future__ import annotations

import gc
import weakref
from typing import Any

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torchrec.distributed.types import ShardingPlan

from lightning_torchrec import DLRMClickModule, TorchRecStrategy
from lightning_torchrec.distributed import peer_failure
from lightning_torchrec.errors import NonFiniteLossError, UnevenDataError
from lightning_torchrec.lightning.preemption import PreemptionCheckpoint
from lightning_torchrec.training import device_checks
from lightning_torchrec.training.finite import nonfinite_tensors
from lightning_torchrec.training.step_guard import StepGuard, loss_to_judge
from lightning_torchrec.training.steps import StepRunner
from tests.scripts.factory import cpu_trainer, tiny_data, tiny_dlrm
from tests.test_distributed import FakeWorld


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


@pytest.mark.parametrize(
    "loss",
    [
        torch.tensor(float("nan"), requires_grad=True) * 2,  # as training_step returns it
        torch.tensor([float("-inf")], dtype=torch.bfloat16),
        torch.tensor([0.5, float("nan"), 0.25]),  # a loss left unreduced
    ],
    ids=["graph", "bfloat16", "unreduced"],
)
def test_every_kind_of_host_loss_is_judged(loss: torch.Tensor) -> None:
    guard = StepGuard("raise")
    guard.record_loss({"loss": loss}, 5)
    with pytest.raises(NonFiniteLossError, match=r"global step 5 .*this rank: (nan|-inf)\)"):
        guard.check(None, batch_checked=False)
    guard.record_loss({"loss": loss.detach().nan_to_num()}, 6)
    guard.check(None, batch_checked=False)


def test_nonfinite_tensors_names_them() -> None:
    state = {"a": torch.ones(2), "b": {"c": torch.tensor([1.0, float("nan")])}, "n": 3}
    assert nonfinite_tensors(state) == ["b.c"]


def test_peer_failure_explains_dead_peers_only() -> None:
    gloo = "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer"
    err = peer_failure(RuntimeError(gloo), 20)
    assert err is not None and "another rank probably died" in str(err)
    assert peer_failure(dist.DistNetworkError("Broken pipe")) is not None
    assert peer_failure(RuntimeError("Application timeout caused pair closure")) is not None
    assert peer_failure(RuntimeError("shape mismatch")) is None
    # This rank's own error, though it says "timed out": it was blamed on another rank, and
    # so neither rank named it.
    assert peer_failure(RuntimeError("DataLoader timed out after 2 seconds")) is None
    with pytest.raises(ValueError):
        PreemptionCheckpoint("x", check_every_n_steps=0)


def test_plan_for_tables_the_model_does_not_have_is_refused_at_setup() -> None:
    from torchrec.distributed.types import EmbeddingModuleShardingPlan, ParameterSharding

    ps = ParameterSharding(sharding_type="table_wise", compute_kernel="fused", ranks=[0])
    path = "model_and_loss.model.sparse_arch.embedding_bag_collection"
    plan = ShardingPlan({path: EmbeddingModuleShardingPlan({"t_user": ps})})
    t = cpu_trainer(TorchRecStrategy(plan=plan), max_steps=1)
    with pytest.raises(ValueError, match="does not have"):
        t.fit(tiny_dlrm(10))
    assert t.global_step == 0


def test_tables_too_large_are_explained_in_bytes_at_setup() -> None:
    t = cpu_trainer(TorchRecStrategy(log_plan=False), max_steps=1)
    with pytest.raises(ValueError, match="The tables need 596.0 GiB"):
        t.fit(tiny_dlrm([10, 40_000_000_000]))


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

    model = tiny_dlrm(10, cls=Module)
    data = tiny_data(10, batch_size=8, train_batches=400)
    trainer = cpu_trainer("torchrec", max_steps=1, limit_val_batches=0)
    with pytest.raises(PeerFailureError, match="another rank probably died.*Connection closed"):
        trainer.fit(model, datamodule=data)


def test_votes_ahead_of_cpu_ranks_run_on_the_default_group_the_others_on_the_host_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch)  # a gloo default group
    host = object()  # the strategy's gloo group with the short `peer_timeout`
    runner = StepRunner(
        nn.Linear(1, 1), torch.device("cpu"), specs={}, dense_width=None, group=host
    )
    guard = runner.guard
    guard.carries_stop = True
    world.peer_votes = [False, False, False, False, False]
    guard.before_training_step(None, 0, 0, last=False)  # the first step votes before its forward
    guard.vote_ahead(None, batch_idx=0, last=False)  # decided after the step: no peer holds it
    guard.decide_ahead()
    world.peer_votes = [False, False]
    guard.before_eval_step(None, "validation", 0, last=False)
    assert world.groups == [host, None, host]
    # Where the default group is NCCL (GPUs), every vote stays on the host group.
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    guard = StepRunner(
        nn.Linear(1, 1), torch.device("cpu"), specs={}, dense_width=None, group=host
    ).guard
    world.peer_votes, world.groups = [False, False, False, False, False], []
    guard.vote_ahead(None, batch_idx=0, last=False)
    guard.decide_ahead()
    assert world.groups == [host]


def test_the_votes_of_a_cuda_rank_under_nccl_live_on_the_host_with_the_host_group(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A GPU rank's configuration, run on the CPU: the default group is NCCL, the strategy's
    # host group gloo, the rank's device CUDA. Every vote's tensor is made on the host (one made
    # on CUDA would fail here); only a vote on the NCCL group itself would live on the GPU.
    world = FakeWorld(monkeypatch)
    host = object()
    monkeypatch.setattr(dist, "get_backend", lambda group=None: "gloo" if group is host else "nccl")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    places: list[torch.device] = []
    reduce = dist.all_reduce

    def placed(votes: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        places.append(votes.device)
        return reduce(votes, *args, **kwargs)

    monkeypatch.setattr(dist, "all_reduce", placed)
    runner = StepRunner(
        nn.Linear(1, 1), torch.device("cuda", 0), specs={}, dense_width=None, group=host
    )
    guard = runner.guard
    guard.carries_stop = True
    world.peer_votes = [False, False, False, False, False]
    guard.before_training_step(None, 0, 0, last=False)
    guard.record_loss(torch.tensor(0.5), 0)
    guard.vote_ahead(None, batch_idx=0, last=False)
    guard.decide_ahead()
    guard.settle()
    assert world.groups == [host, host] and places == [torch.device("cpu")] * 2


def test_the_vote_ahead_runs_during_the_step_and_is_decided_before_any_other_vote(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    world = FakeWorld(monkeypatch)
    guard = StepGuard("raise")
    guard.carries_stop = True
    # slots: the next batch, this step's loss; flags: no batch after this one, stop, evaluating
    world.peer_votes = [False, False, False, True, False]
    guard.record_loss(torch.tensor(0.5), 3)
    guard.vote_ahead(None, batch_idx=3, last=False)
    assert (world.started, world.waited) == (1, 0)
    assert guard.decide_ahead() == [1]  # the peer asked to stop
    assert guard.decide_ahead() is None  # decided once
    # A NaN loss of this step stops every rank when the vote is decided.
    world.peer_votes = [False, False, False, False, False]
    guard.record_loss(torch.tensor(float("nan")), 4)
    guard.vote_ahead(None, batch_idx=4, last=False)
    with pytest.raises(NonFiniteLossError, match="global step 4"):
        guard.decide_ahead()
    # Only this rank has no batch after this one: the same named error, naming the batch.
    guard.vote_ahead(None, batch_idx=5, last=True)
    with pytest.raises(UnevenDataError, match=r"rank\(s\) \[0\] have 6"):
        guard.decide_ahead()
    # A checkpoint's vote leaves it running; an evaluation step decides it first.
    world.peer_votes = [False, False, False, True, False]
    guard.vote_ahead(None, batch_idx=6, last=False)
    world.peer_votes = [False]
    guard.settle()
    assert world.waited == 3
    world.peer_votes = [False, False]
    guard.before_eval_step(None, "validation", 0, last=False)
    assert world.waited == 4 and guard.decide_ahead() is None


def test_a_loops_evaluation_vote_meets_a_training_vote_and_both_name_the_uneven_data(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A Fabric rank with an evaluation batch more than its peer: its vote must have the layout
    # of the peer's next training vote (else the two all_reduces mismatch and hang).
    world = FakeWorld(monkeypatch)
    guard = StepGuard("raise")
    # slots: the batch, the last loss; flags: no batch after this one, stop, evaluating
    world.peer_votes = [False, False, False, False, True]  # the peer evaluates, this rank trains
    with pytest.raises(UnevenDataError, match=r"rank\(s\) \[1\] ran an evaluation forward"):
        guard.check(None, batch_checked=True)
    world.peer_votes = [False, False, False, False, False]  # this rank evaluates, the peer trains
    with pytest.raises(UnevenDataError, match=r"while rank\(s\) \[1\] had ended"):
        guard.before_loop_eval(None, "evaluation forward 4 after step 6", 4)
    world.peer_votes = [False, False, False, False, True]  # both evaluate: fine
    guard.record_loss(torch.tensor(float("nan")), 6)  # judged before the evaluation's metrics
    with pytest.raises(NonFiniteLossError, match="global step 6"):
        guard.before_loop_eval(None, "evaluation forward 0 after step 7", 0)
    guard.before_loop_eval(None, "evaluation forward 1 after step 7", 1)
    world.peer_votes = [False, False, False, False, True]  # the peer has more batches
    with pytest.raises(UnevenDataError, match=r"evaluation batches .*rank\(s\) \[0\] have 3"):
        guard.before_loop_eval(None, "evaluation forward 2 after step 7", 2, last=True)


def test_every_vote_keeps_its_tensors_until_the_next_vote(monkeypatch: pytest.MonkeyPatch) -> None:
    # gloo's thread must never free a vote's tensors (cpython#112275): a DataLoader may fork then.
    world = FakeWorld(monkeypatch)
    seen: list[weakref.ref] = []
    reduce = world.all_reduce
    monkeypatch.setattr(
        dist, "all_reduce", lambda v, *a, **k: seen.append(weakref.ref(v)) or reduce(v, *a, **k)
    )
    guard = StepGuard("raise")
    guard.carries_stop = True
    world.peer_votes = [False, False, False, False, False]
    guard.before_training_step(None, 0, 0, last=False)  # decided at once
    gc.collect()
    assert seen[0]() is not None  # still held after it was decided
    guard.vote_ahead(None, batch_idx=0, last=False)
    guard.decide_ahead()
    gc.collect()
    assert seen[0]() is None and seen[1]() is not None  # the next vote lets the last one go
    world.peer_votes = [False, False]
    guard.before_eval_step(None, "validation", 0, last=False)
    gc.collect()
    assert seen[1]() is None and seen[2]() is not None


def test_a_loss_of_several_numbers_is_judged_by_its_first_non_finite_one_on_its_device() -> None:
    """On CUDA the pinned copy held the first element only: a NaN elsewhere passed."""
    for loss, judged in [
        (torch.tensor([1.0, float("nan"), float("inf")]), "nan"),
        (torch.tensor([[2.0, 3.0], [float("-inf"), 1.0]]), "-inf"),
        (torch.tensor([2.0, 3.0]), "2.0"),
        (torch.tensor(4.0, dtype=torch.bfloat16), "4.0"),
        (torch.empty(0), "0.0"),
    ]:
        picked = loss_to_judge(loss)
        assert picked.shape == (1,) and picked.dtype == torch.float32
        assert str(float(picked)) == judged, (loss, picked)
    on_meta = loss_to_judge(torch.empty(3, device="meta"))  # no host read (item() would raise)
    assert on_meta.shape == (1,) and on_meta.device.type == "meta"


def test_the_loss_is_recorded_through_the_copy_the_gpu_uses_on_the_cpu_too(monkeypatch) -> None:
    # The same code on both devices: the one judged number is copied to a host buffer, a mark
    # recorded after the copy, and waited on at the next vote; only the pinned buffer and the
    # CUDA event are the GPU's own. A loss changed in place after its step (as a reused buffer
    # would be) is judged as it was at its step, on the CPU as on CUDA.
    marks: list[str] = []

    class Mark(device_checks._Finished):
        def record(self) -> None:
            marks.append("record")

        def synchronize(self) -> None:
            marks.append("synchronize")

    monkeypatch.setattr(device_checks, "_FINISHED", Mark())
    guard = StepGuard("raise")
    loss = torch.tensor([float("nan"), 1.0])
    guard.record_loss(loss, 4)
    loss.fill_(0.5)
    assert marks == ["record"]
    with pytest.raises(NonFiniteLossError, match=r"global step 4 .*this rank: nan\)"):
        guard.check(None, batch_checked=False)
    assert marks == ["record", "synchronize"]
