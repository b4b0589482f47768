"""2-rank fault scenarios (run as a script; Lightning relaunches it per rank).

``python faults_two_ranks.py OUT MODE`` with MODE:

* ``phases``: one launch, several trainers: (1) only rank 1's loader yields a batch with an
  out-of-range id at step 2; (2) only rank 1's loss is NaN at step 3; (3) only rank 1's table
  turns NaN just before the second checkpoint; (4) only rank 1's Trainer has
  ``received_sigterm`` set (as by Lightning's SIGTERM handler) before step 3. Each rank records
  what it raised in ``{phase}_rank{r}.pt``.
* ``kill``: rank 1 SIGKILLs itself at step 3; rank 0 must exit non-zero within the timeout.
* ``raise_one``: rank 1's ``training_step`` raises at step 3; rank 0 must raise an error of the
  same type naming it. ``raise_setup``: the same from a callback's ``setup`` on rank 1.
  ``raise_zero``: rank 0, which serves the store, raises at step 3; rank 1 must name it.
* ``stop_one``: ``trainer.should_stop`` set on rank 1 alone: rank 0 must name it.
* ``interrupt_apart``: Ctrl-C reaches the ranks at different points of step 3 (rank 0 right
  after its forward, rank 1 after it also started the next step's vote), with an
  ``OnExceptionCheckpoint``: both must refuse the save, promptly, instead of hanging in it.
* ``preempt``: rank 1 receives SIGTERM at step 5: every rank saves ``OUT/preempted.ckpt`` and
  exits; ``resume`` (or ``phases``, first, when that checkpoint exists) continues from it to
  step 8.
"""

from __future__ import annotations

import os
import signal
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import lightning as L
import torch

# sibling module (script directory)
from factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm
from lightning.pytorch.callbacks import (
    Callback,
    Checkpoint,
    ModelCheckpoint,
    OnExceptionCheckpoint,
)
from lightning.pytorch.utilities.exceptions import SIGTERMException

from lightning_torchrec import DLRMClickModule, PeerFailureError, TorchRecStrategy
from lightning_torchrec.lightning.preemption import PreemptionCheckpoint

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
#: The modes whose ranks record what they raised (then raise it).
RECORDED = ("kill", "onexc_one", "stop_one", "interrupt_apart")
ROWS = 20
#: CUDA's ``batch_checks="auto"`` (unpipelined): checked on the device, judged a step later.
NEXT_STEP = {"batch_checks": "next_step"}


class Faulty(DLRMClickModule):
    """Breaks things on one rank at one step."""

    def __init__(self, *args: Any, fault: str = "", at: int = -1, **kw: Any) -> None:
        super().__init__(*args, **kw)
        self.fault, self.at = fault, at

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        loss = super().training_step(batch, batch_idx)
        if self.global_rank == 1 and self.global_step == self.at and self.fault == "nan_loss":
            loss = loss * float("nan")
        if self.global_rank == 1 and self.global_step == self.at and self.fault == "raise":
            raise Boom(f"a bug in rank 1's training_step at step {self.at}")
        if self.global_rank == 0 and self.global_step == self.at and self.fault == "interrupt":
            raise KeyboardInterrupt  # after the forward, before the strategy starts its vote
        return loss


class Boom(RuntimeError):
    """A user's error in a hook."""


class RaiseAt(Callback):
    """Raises :class:`Boom` at step ``at`` on the ``ranks``, in hook ``hook``."""

    def __init__(self, hook: str, at: int, ranks: tuple[int, ...], interrupt: bool = False) -> None:
        self.at, self.ranks, self.interrupt = at, ranks, interrupt
        setattr(self, hook, self._maybe_raise)

    def _maybe_raise(self, *args: Any, **kwargs: Any) -> None:
        trainer = kwargs.get("trainer") or args[0]  # Lightning calls `setup` by keyword
        if trainer.global_rank in self.ranks and trainer.global_step == self.at:
            if self.interrupt:  # as Ctrl-C raises it
                raise KeyboardInterrupt
            raise Boom(f"rank {trainer.global_rank} fails at step {self.at}")


class StopAlone(Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 3:
            trainer.should_stop = True


class RankOneFault(Callback):
    def __init__(self, fault: str, at: int) -> None:
        self.fault, self.at = fault, at

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: Any, i: int) -> None:
        if trainer.global_rank != 1 or trainer.global_step != self.at:
            return
        if self.fault == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.fault == "sigterm":
            os.kill(os.getpid(), signal.SIGTERM)
        elif self.fault == "sigterm_flag":  # what Lightning's SIGTERM handler sets
            trainer._signal_connector.received_sigterm = True


class RecordError(Callback):
    """Saves what a rank raised before the Trainer's teardown (a dead peer's launcher may kill
    this process during the teardown)."""

    def __init__(self, phase: str) -> None:
        self.phase = phase

    def on_exception(self, trainer: L.Trainer, pl_module: Any, exception: BaseException) -> None:
        if MODE in RECORDED or MODE.startswith("raise_"):
            result = {"error": type(exception).__name__, "message": str(exception)}
            result["peer_failure"] = isinstance(exception, PeerFailureError)
            result["boom"] = isinstance(exception, Boom)
            torch.save(result, OUT / f"{self.phase}_rank{trainer.global_rank}.pt")


class BadIdOnRankOne:
    """The training batches, with an out-of-range id in rank 1's batch ``at`` (as drawn: the
    strategy checks batches when they leave the loader)."""

    def __init__(self, loader: Any, at: int) -> None:
        self.loader, self.at = loader, at

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Any:
        rank = torch.distributed.get_rank()
        for i, batch in enumerate(self.loader):
            if rank == 1 and i == self.at:
                batch.sparse_features.values()[3] = ROWS + 7
            yield batch


class NanTableBeforeSave(Callback):
    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, *args: Any) -> None:
        if trainer.global_rank == 1 and trainer.global_step == 4:
            for v in pl_module.state_dict().values():
                for s in getattr(v, "local_shards", list)():
                    s.tensor.data[0, 0] = float("nan")


class Steps(Callback):
    def __init__(self) -> None:
        self.steps: list[int] = []

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        self.steps.append(trainer.global_step)


def run(
    phase: str,
    fault: str,
    at: int,
    max_steps: int = 6,
    ckpt_path: Any = None,
    extra: list[Callback] | None = None,
    **strategy_kw: Any,
) -> dict[str, Any]:
    data = tiny_data(ROWS, batch_size=16, train_batches=40, seed=1)
    model = tiny_dlrm(ROWS, cls=Faulty, fault=fault, at=at)
    steps = Steps()
    trainer = cpu_trainer(
        TorchRecStrategy(
            log_plan=False,
            timeout=timedelta(seconds=20),
            constraints=table_wise(2),
            **strategy_kw,
        ),
        devices=2,
        max_steps=max_steps,
        limit_val_batches=0,
        default_root_dir=OUT,
        enable_checkpointing=any(isinstance(c, Checkpoint) for c in extra or []),
        callbacks=[RankOneFault(fault, at), steps, RecordError(phase), *(extra or [])],
    )
    result: dict[str, Any] = {"error": None, "message": ""}
    broadcasts = [0]
    broadcast = torch.distributed.broadcast

    def counted(*args: Any, **kwargs: Any) -> Any:  # Lightning's loop calls it by this name
        broadcasts[0] += 1
        return broadcast(*args, **kwargs)

    votes = {"ahead": 0, "now": 0}  # the strategy's votes: int32 all_reduces
    all_reduce = torch.distributed.all_reduce

    def counted_vote(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        if tensor.dtype == torch.int32:
            votes["ahead" if kwargs.get("async_op") else "now"] += 1
        return all_reduce(tensor, *args, **kwargs)

    torch.distributed.broadcast = counted
    torch.distributed.all_reduce = counted_vote
    try:
        if fault == "bad_id":
            data.setup("fit")
            loader = BadIdOnRankOne(data.train_dataloader(), at)
            trainer.fit(model, train_dataloaders=loader, ckpt_path=ckpt_path)
        else:
            trainer.fit(model, datamodule=data, ckpt_path=ckpt_path)
    except (Exception, SIGTERMException) as e:  # recorded for the parent's assertions
        result = {"error": type(e).__name__, "message": str(e)}
        if MODE in RECORDED or MODE.startswith("raise_"):
            name = phase if MODE == "kill" else f"{phase}_final"  # onexc_one: after on_exception
            torch.save(result, OUT / f"{name}_rank{trainer.global_rank}.pt")
            if MODE == "interrupt_apart" and trainer.global_rank == 1:
                # Both ranks refuse on their own; Lightning's launcher SIGKILLs rank 0 once rank 1
                # exited non-zero (it polls every 5 s), which on a busy host came before rank 0
                # had written what it raised.
                _wait_for(OUT / f"{name}_rank0.pt")
            raise
    finally:
        torch.distributed.broadcast = broadcast
        torch.distributed.all_reduce = all_reduce
    result.update(steps=steps.steps, global_step=trainer.global_step, broadcasts=broadcasts[0])
    result.update(votes_ahead=votes["ahead"], votes_now=votes["now"])
    torch.save(result, OUT / f"{phase}_rank{trainer.global_rank}.pt")
    return result


def _wait_for(path: Path, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)


def main() -> None:
    L.seed_everything(0)
    if MODE == "phases":
        if (OUT / "preempted.ckpt").exists():  # left by a ``preempt`` launch into OUT
            run("resume", "", at=-1, max_steps=8, ckpt_path=OUT / "preempted.ckpt")
        every_step = ModelCheckpoint(dirpath=OUT / "bad_id_ckpts", every_n_train_steps=1)
        run("bad_id", "bad_id", at=2, extra=[every_step])  # the default: pipelined
        every_step = ModelCheckpoint(dirpath=OUT / "bad_id_plain_ckpts", every_n_train_steps=1)
        run("bad_id_plain", "bad_id", at=2, extra=[every_step], pipeline=None)
        # Checked on the device and judged at the next step: CUDA's "auto", through the same code.
        every_step = ModelCheckpoint(dirpath=OUT / "bad_id_next_ckpts", every_n_train_steps=1)
        run("bad_id_next", "bad_id", at=2, extra=[every_step], pipeline=None, **NEXT_STEP)
        run("nan_raise", "nan_loss", at=3)
        run("sigterm_flag", "sigterm_flag", at=3)
        ckpt = ModelCheckpoint(dirpath=OUT / "ckpts", every_n_train_steps=2, save_top_k=-1)
        run("nan_ckpt", "", at=-1, extra=[NanTableBeforeSave(), ckpt])
        # Both ranks fail after step 3's backward: the tables hold its update, the dense
        # weights not.
        saver = OnExceptionCheckpoint(OUT / "onexc_mid")
        raise_ = RaiseAt("on_after_backward", 3, (0, 1))
        run("onexc_mid", "", at=-1, extra=[raise_, saver])
    elif MODE == "kill":
        run("kill", "kill", at=3)
    elif MODE == "raise_one":  # a user's bug on rank 1 alone; rank 0 waits for it in step 3
        run("raise_one", "raise", at=3)
    elif MODE == "stop_one":  # trainer.should_stop set on rank 1 alone after step 3
        run("stop_one", "", at=-1, extra=[StopAlone()])
    elif MODE == "raise_zero":  # a user's bug on rank 0 alone (it serves the store)
        run("raise_zero", "", at=-1, extra=[RaiseAt("on_train_batch_start", 3, (0,))])
    elif MODE == "raise_setup":  # rank 0 waits in Lightning's barrier after the setup hooks
        run("raise_setup", "", at=-1, extra=[RaiseAt("setup", 0, (1,))])
    elif MODE == "onexc_one":  # only rank 1 fails; the others wait for it inside step 3
        saver = OnExceptionCheckpoint(OUT / "onexc_one")
        raise_ = RaiseAt("on_train_batch_start", 3, (1,))
        run("onexc_one", "", at=-1, extra=[raise_, saver], peer_timeout=timedelta(seconds=5))
    elif MODE == "interrupt_apart":
        saver = OnExceptionCheckpoint(OUT / "interrupt_apart")
        later = RaiseAt("on_before_zero_grad", 3, (1,), interrupt=True)  # vote started
        run("interrupt_apart", "interrupt", at=3, extra=[later, saver])
    elif MODE == "preempt":
        run(
            "preempt",
            "sigterm",
            at=5,
            max_steps=20,
            extra=[PreemptionCheckpoint(OUT / "preempted.ckpt")],
        )
    elif MODE == "resume":
        run("resume", "", at=-1, max_steps=8, ckpt_path=OUT / "preempted.ckpt")


if __name__ == "__main__":
    main()
    # Shut the process group down before the interpreter exits: with torch 2.11, gloo's
    # threads left from the failed phases occasionally aborted the exit ("terminate called
    # without an active exception", SIGABRT) after every phase had passed.
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
