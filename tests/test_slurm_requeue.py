"""SLURM's requeue signal in one process: the HPC checkpoint between steps, requeue, resume.

A fake ``scontrol`` on the PATH records the requeue; ``make test-cluster`` runs the same path
under real SLURM daemons with 2 ranks.
"""

from __future__ import annotations

import os
import signal
import stat
from pathlib import Path
from typing import Any

import lightning as L
import pytest
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.plugins.environments import LightningEnvironment, SLURMEnvironment

from lightning_torchrec import Preempted, SLURMRequeue, TorchRecStrategy
from lightning_torchrec.lightning.preemption import add_slurm_requeue, slurm_job_id
from tests.scripts.factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm

SLURM_VARS = dict(
    SLURM_NTASKS="1",
    SLURM_NTASKS_PER_NODE="1",
    SLURM_NNODES="1",
    SLURM_NODEID="0",
    SLURM_PROCID="0",
    SLURM_LOCALID="0",
    SLURM_JOB_ID="4242",
    SLURM_JOB_NAME="recsys",
    SLURM_NODELIST="127.0.0.1",
)


class SignalAt(Callback):
    """Sends ``sig`` to this process at the start of training batch ``step`` (0-based)."""

    def __init__(self, step: int, sig: int = signal.SIGUSR1) -> None:
        self.step, self.sig = step, sig

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.step:
            os.kill(os.getpid(), self.sig)


@pytest.fixture
def slurm(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """SLURM's task variables and a fake ``scontrol`` that logs its arguments (exit status in
    ``SCONTROL_STATUS``)."""
    for key, value in SLURM_VARS.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "0")
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    fake = bin_dir / "scontrol"
    fake.write_text(f'#!/bin/sh\necho "$@" >> {tmp_path}/scontrol.log\nexit $SCONTROL_STATUS\n')
    fake.chmod(fake.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("SCONTROL_STATUS", "0")
    return tmp_path


def _fit(root: Path, *callbacks: Callback, steps: int = 6) -> L.Trainer:
    L.seed_everything(3)
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        plugins=[SLURMEnvironment(auto_requeue=True)],
        max_steps=steps,
        limit_val_batches=0,
        default_root_dir=root,
        callbacks=list(callbacks),
    )
    trainer.fit(tiny_dlrm(), datamodule=tiny_data(train_batches=20))
    return trainer


def test_requeue_signal_saves_between_steps_requeues_and_the_next_fit_resumes(
    slurm: Path,
) -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGUSR1, signal.SIGTERM)}
    root = slurm / "run"
    with pytest.raises(Preempted) as info:
        _fit(root, SignalAt(step=3))
    assert info.value.code == 0
    assert (slurm / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert (root / "hpc_ckpt_1.ckpt" / "meta.pt").is_file()  # a sharded checkpoint directory
    # Lightning's handlers and ours are gone: the process is as it was.
    assert {s: signal.getsignal(s) for s in before} == before

    # The requeued job: a plain fit finds the HPC checkpoint and continues after step 4.
    steps: list[int] = []

    class Steps(Callback):
        def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
            steps.append(trainer.global_step)

    trainer = _fit(root, Steps())
    assert Path(str(trainer.ckpt_path)).name == "hpc_ckpt_1.ckpt"
    assert steps == [5, 6]  # the signal came before step 4's batch; saved after it
    assert [type(c) for c in trainer.callbacks].count(SLURMRequeue) == 1


def test_failed_requeue_exits_nonzero_and_says_so(
    slurm: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("SCONTROL_STATUS", "3")
    with pytest.raises(Preempted) as info:
        _fit(slurm / "run", SignalAt(step=1))
    assert info.value.code == 1
    out = capsys.readouterr()
    assert "NOT requeued" in out.out
    assert "scontrol requeue 4242 exited with 3" in out.err
    assert (slurm / "run" / "hpc_ckpt_1.ckpt").is_dir()


def test_added_only_under_slurm_auto_requeue(slurm: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    trainer = L.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False)
    n = len(trainer.callbacks)
    assert add_slurm_requeue(trainer, LightningEnvironment()) is None
    assert add_slurm_requeue(trainer, SLURMEnvironment(auto_requeue=False)) is None
    added = add_slurm_requeue(trainer, SLURMEnvironment(requeue_signal=signal.SIGUSR2))
    assert added is not None and added.signals == (signal.SIGUSR2,)
    assert add_slurm_requeue(trainer, SLURMEnvironment()) is added
    assert len(trainer.callbacks) == n + 1
    assert slurm_job_id() == "4242"
    monkeypatch.setenv("SLURM_ARRAY_JOB_ID", "77")
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", "3")
    assert slurm_job_id() == "77_3"
    with pytest.raises(ValueError, match="check_every_n_steps"):
        SLURMRequeue(check_every_n_steps=0)


class SignalInSanityCheck(Callback):
    """Sends SIGUSR1 to this process at the first batch of the sanity-check validation."""

    def on_validation_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.sanity_checking:
            os.kill(os.getpid(), signal.SIGUSR1)


def test_a_requeue_signal_during_the_sanity_check_saves_at_the_first_step(slurm: Path) -> None:
    # Lightning installs its own handler (a save inside the handler, on the signalled rank
    # alone) before the sanity check; ours replaces it from the check's start.
    root = slurm / "run"
    L.seed_everything(3)
    trainer = cpu_trainer(
        TorchRecStrategy(constraints=table_wise(2), log_plan=False),
        plugins=[SLURMEnvironment(auto_requeue=True)],
        max_steps=6,
        num_sanity_val_steps=1,
        limit_val_batches=1,
        default_root_dir=root,
        callbacks=[SignalInSanityCheck()],
    )
    with pytest.raises(Preempted) as info:
        trainer.fit(tiny_dlrm(), datamodule=tiny_data(train_batches=20))
    assert info.value.code == 0 and trainer.global_step == 1
    assert (slurm / "scontrol.log").read_text().split() == ["requeue", "4242"]
    assert [p.name for p in root.iterdir() if p.name.startswith("hpc_")] == ["hpc_ckpt_1.ckpt"]
