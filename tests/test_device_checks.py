"""Batch checks judged a step later (``batch_checks="next_step"``, CUDA's default), on the CPU.

The code path is the device one (reductions on the batch's device, the flags copied to the host
without blocking and read at the next vote); on the CPU only the buffer is not pinned and the
CUDA event is a stand-in. One process (two ranks: tests/test_faults_multiprocess.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import pytest
import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import (
    BoundsCheckMode,
    EmbeddingLocation,
)
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    ComputeDevice,
    DenseTableBatchedEmbeddingBagsCodegen,
    SplitTableBatchedEmbeddingBagsCodegen,
)
from lightning.pytorch.callbacks import ModelCheckpoint
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils.data import DataLoader

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.sharding.features import FeatureSpec
from lightning_torchrec.training import device_checks
from lightning_torchrec.training.device_checks import (
    FLAGS,
    DeferredVerdict,
    HostCopy,
    clamps_bad_ids,
    device_flags,
    judged_next_step,
)
from lightning_torchrec.training.steps import StepRunner
from tests.scripts.factory import cpu_trainer, sharding_constraints, table_wise
from tests.test_validation import SPECS, _Batches, batch, model


def _named(found: torch.Tensor) -> dict[str, int]:
    return dict(zip(FLAGS, found[: len(FLAGS)].tolist(), strict=True))


def test_device_flags_count_each_kind_of_problem() -> None:
    assert set(_named(device_flags(batch(), SPECS)).values()) == {0}
    found = device_flags(batch(values=torch.tensor([1, -2, 10, 20])), SPECS)
    assert _named(found)["ids"] == 2  # cat_0: -2; cat_1 (20 rows): 20
    assert found[len(FLAGS) :].tolist() == [0, 1, -2]  # the first bad id: KJT 0, position 1
    nan = batch(dense_features=torch.tensor([[0.0, float("nan"), 0.0], [0.0, 0.0, 0.0]]))
    assert _named(device_flags(nan, SPECS))["dense"] == 1
    short = batch(lengths=torch.tensor([1, 1, 1, 0]))
    assert _named(device_flags(short, SPECS))["lengths"] == 1


class _HostWaits(TorchDispatchMode):
    """Records the ops that make the host wait for a GPU: host reads, blocking copies to it."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.__name__
        source = args[0] if args and isinstance(args[0], torch.Tensor) else None
        on_device = isinstance(out, torch.Tensor) and out.device.type != "cpu"
        if name.startswith("_local_scalar_dense"):  # item(), bool(), a 0-dim tensor index
            self.seen.append(name)
        elif name.startswith("lift_fresh") and on_device:  # torch.tensor(data, device=...)
            self.seen.append(name)
        elif name.startswith("_to_copy") and on_device and not kwargs.get("non_blocking"):
            if source is not None and source.device.type == "cpu":
                self.seen.append(name)
        return out


def test_device_flags_never_make_the_host_wait_for_the_device(monkeypatch) -> None:
    # On the meta device (no data) as on CUDA: every flag computed, nothing read on the host,
    # nothing copied to the device synchronously (torch.tensor(data, device=...) does).
    made_there: list[Any] = []
    tensor = torch.tensor

    def spy(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if torch.device(kwargs.get("device") or "cpu").type != "cpu":
            made_there.append(data)
        return tensor(data, *args, **kwargs)

    limited = {k: dataclasses.replace(s, max_ids=1, min_ids=1) for k, s in SPECS.items()}
    bad = batch(values=torch.tensor([1, -2, 10, 20])).to(torch.device("meta"))
    monkeypatch.setattr(torch, "tensor", spy)
    for specs in (SPECS, limited):
        with _HostWaits() as waits:
            found = device_flags(bad, specs)
        assert found.device.type == "meta" and found.shape == (len(FLAGS) + 3,)
        assert waits.seen == [] and made_there == []
    monkeypatch.undo()
    # The same code on the host still finds the first bad id without reading it early.
    found = device_flags(batch(values=torch.tensor([1, -2, 10, 20])), limited)
    assert found[len(FLAGS) :].tolist() == [0, 1, -2]


def test_the_verdict_names_the_step_it_was_submitted_at() -> None:
    deferred = DeferredVerdict(SPECS, 3)
    deferred.submit(batch(values=torch.tensor([1, 2, 3, 20])), "rank 0, step 7")
    assert deferred.pending
    error = deferred.verdict()
    assert "rank 0, step 7: feature 'cat_1'" in str(error) and "id 20" in str(error)
    assert not deferred.pending and deferred.verdict() is None
    deferred.submit(batch(), "rank 0, step 8")
    assert deferred.verdict() is None


def _fit(tmp_path: Path, bad_at: int, every_step_checkpoint: bool = False):
    strategy = TorchRecStrategy(constraints=table_wise(2), log_plan=False, batch_checks="next_step")
    callbacks = []
    if every_step_checkpoint:
        callbacks = [ModelCheckpoint(dirpath=tmp_path / "ck", every_n_train_steps=1, save_top_k=-1)]
    trainer = cpu_trainer(
        strategy,
        max_steps=6,
        use_distributed_sampler=False,
        callbacks=callbacks,
        enable_checkpointing=every_step_checkpoint,
    )
    module = model()
    with pytest.raises(BatchValidationError) as err:
        trainer.fit(module, DataLoader(_Batches(bad_at), batch_size=None))
    return trainer, module, str(err.value)


def test_a_bad_batch_stops_training_at_the_next_step_naming_its_own_step(tmp_path) -> None:
    trainer, module, message = _fit(tmp_path, bad_at=2)
    assert "rank 0, step 2: feature 'cat_1'" in message and "id 1000" in message
    assert trainer.global_step == 3  # step 2 ran; step 3 was refused before its forward
    tables = [p for n, p in module.state_dict().items() if "embedding_bags" in n]
    assert tables and all(
        torch.isfinite(t.local_tensor() if hasattr(t, "local_tensor") else t).all() for t in tables
    )


def test_no_checkpoint_holds_the_bad_batch_update(tmp_path) -> None:
    trainer, _, message = _fit(tmp_path, bad_at=2, every_step_checkpoint=True)
    assert "step 2" in message
    saved = sorted(p.name for p in (tmp_path / "ck").iterdir())
    # Saved after steps 0 and 1 (global steps 1, 2); the save after the bad step 2 settled the
    # verdict first and stopped.
    assert saved == ["epoch=0-step=1.ckpt", "epoch=0-step=2.ckpt"], saved
    assert trainer.global_step == 3


def test_the_strategy_refuses_an_unknown_timing() -> None:
    with pytest.raises(ValueError, match="batch_checks must be one of"):
        TorchRecStrategy(batch_checks="sometimes")


def test_auto_judges_at_the_next_step_only_where_every_kernel_clamps_bad_ids() -> None:
    # fbgemm's dense kernel (every data_parallel table's) reads and writes at a bad id as given:
    # on CUDA out of the table's rows, or a fault, before any verdict a step later.
    spec = {"cat_0": FeatureSpec("cat_0", "t", 10)}
    cuda = torch.device("cuda")

    def split(**kwargs: Any) -> nn.Module:
        return SplitTableBatchedEmbeddingBagsCodegen(
            [(10, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], **kwargs
        )

    def deferred(*kernels: nn.Module, checks: str = "auto") -> bool:
        return judged_next_step(checks, cuda, spec, nn.ModuleList(kernels))

    dense = DenseTableBatchedEmbeddingBagsCodegen([(10, 4)], use_cpu=True)
    assert deferred(split()) and deferred(split(bounds_check_mode=BoundsCheckMode.IGNORE))
    assert not deferred(split(), dense)
    assert not deferred(split(bounds_check_mode=BoundsCheckMode.NONE))
    assert not deferred(split(bounds_check_mode=BoundsCheckMode.FATAL))
    assert deferred(dense, checks="next_step")  # asked for: as asked
    assert not judged_next_step("auto", torch.device("cpu"), spec, nn.ModuleList([split()]))


def test_a_sharded_data_parallel_table_is_checked_before_its_forward_on_cuda() -> None:
    module = model()
    constraints = sharding_constraints({"t_cat_0": "table_wise", "t_cat_1": "data_parallel"})
    for types, clamped in ((table_wise(2), True), (constraints, False)):
        trainer = cpu_trainer(TorchRecStrategy(constraints=types, log_plan=False), max_steps=1)
        trainer.fit(module, DataLoader(_Batches(bad_at=99), batch_size=None))
        dmp = trainer.strategy.dmp
        assert clamps_bad_ids(dmp) is clamped
        runner = StepRunner(dmp, torch.device("cuda"), specs=SPECS, dense_width=3)
        assert (runner.guard.deferred is not None) is clamped
        module = model()


def test_the_verdict_is_read_through_the_copy_the_gpu_uses(monkeypatch) -> None:
    # On the CPU as on CUDA: the flags are copied to a host buffer without blocking, a mark is
    # recorded after the copy and waited on at the verdict (CUDA: a pinned buffer and an event;
    # the CPU's stand-in is finished when recorded), and the flags read are the buffer's.
    marks: list[str] = []

    class Mark(device_checks._Finished):
        def record(self) -> None:
            marks.append("record")

        def synchronize(self) -> None:
            marks.append("synchronize")

    monkeypatch.setattr(device_checks, "_FINISHED", Mark())
    deferred = DeferredVerdict(SPECS, 3)
    deferred.submit(batch(values=torch.tensor([1, 2, 3, 20])), "rank 0, step 7")
    assert marks == ["record"]
    copied = HostCopy(len(FLAGS) + 3, torch.int64)
    flags = device_flags(batch(values=torch.tensor([1, 2, 3, 20])), SPECS)
    held = copied.start(flags)
    assert held is not flags and torch.equal(held, flags) and not held.is_pinned()
    assert "id 20" in str(deferred.verdict())
    assert marks == ["record", "record", "synchronize"]
