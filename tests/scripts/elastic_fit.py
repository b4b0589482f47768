"""2 ranks under torchrun: a rank hangs, then one is SIGKILLed; torchrun restarts, the run resumes.

argv[1]: the output directory; argv[2]: ``reference`` (an uninterrupted fit) or ``faults``:

* attempt 0: rank 1 hangs before step ``HANG_AT``; rank 0 must raise ``PeerFailureError``
  within the strategy's ``peer_timeout`` (``PEER_TIMEOUT``), not the 30-minute collective
  timeout; it records the error and the seconds it waited in ``faults_hang.pt``;
* attempt 1: resumes with ``fit(ckpt_path="last")``; rank 1 SIGKILLs itself before step
  ``KILL_AT`` (mid second epoch);
* attempt 2: resumes again and finishes.

Checkpoints every ``EVERY`` steps, so the last one before each fault is mid-epoch. The finishing
attempt writes ``{mode}_rank{r}.pt``: its restart count, the checkpoint it resumed from, the
losses of the steps it trained, the rank's table shards, dense weights and optimizer state.
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
from factory import adam, cpu_trainer, table_wise, tiny_dlrm  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from rank_state import local_view

from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.data import SyntheticClickDataset
from lightning_torchrec.data.resumable import (
    ResumableDataModule,
    ResumableIterableDataset,
    worker_slot,
)

OUT, MODE = Path(sys.argv[1]), sys.argv[2]
ROWS, BATCHES, EVERY, EPOCHS = 40, 16, 3, 2  # 8 steps per epoch and rank
HANG_AT, KILL_AT, PEER_TIMEOUT = 5, 11, timedelta(seconds=3)  # the test reads 3 s
ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])


class RankBatches(ResumableIterableDataset):
    """One rank's share of a synthetic split, in a fixed order; skips ``start_batch`` batches."""

    def __init__(self, rank: int, world: int) -> None:
        self.source = SyntheticClickDataset([ROWS, ROWS], num_batches=BATCHES, batch_size=16)
        self.indices = list(range(rank, BATCHES, world))

    def __len__(self) -> int:
        return len(self.indices)

    def __iter__(self) -> Any:
        _, _, skip = worker_slot(self.start_batch)
        for i in self.indices[skip:]:
            yield self.source[i]


class Data(ResumableDataModule):
    def dataset(self, stage: str, num_workers: int = 0) -> RankBatches:
        return RankBatches(*self.rank_and_world())


class Record(Callback):
    """Losses per global step; the faults of the first two ``faults`` attempts (on rank 1)."""

    def __init__(self) -> None:
        self.losses: dict[int, torch.Tensor] = {}
        self.hang_started = 0.0

    def on_train_batch_start(self, trainer: L.Trainer, *args: Any) -> None:
        step = trainer.global_step
        if MODE != "faults" or (ATTEMPT, step) not in ((0, HANG_AT), (1, KILL_AT)):
            return
        self.hang_started = time.monotonic()
        if trainer.global_rank == 1 and ATTEMPT == 0:
            signal.signal(signal.SIGTERM, signal.SIG_DFL)  # torchrun's stop ends the hang
            time.sleep(3600)
        elif trainer.global_rank == 1:
            os.kill(os.getpid(), signal.SIGKILL)

    def on_train_batch_end(self, trainer: L.Trainer, module: Any, outputs: Any, *args: Any) -> None:
        self.losses[trainer.global_step] = outputs["loss"].detach().clone()


def main() -> None:
    L.seed_everything(0)
    record = Record()
    ckpts = ModelCheckpoint(
        dirpath=OUT / MODE, every_n_train_steps=EVERY, save_top_k=-1, save_last=True
    )
    trainer = cpu_trainer(
        # The vote before each forward: a peer hung between steps is then found at the vote,
        # within peer_timeout (with the vote ahead, the others wait in the next forward).
        TorchRecStrategy(constraints=table_wise(2), peer_timeout=PEER_TIMEOUT, vote_ahead=False),
        devices=2,
        max_epochs=EPOCHS,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ckpts, record],
    )
    model = tiny_dlrm(ROWS, **adam())
    try:
        trainer.fit(model, datamodule=Data(), ckpt_path="last" if ATTEMPT else None)
    except Exception as e:
        if trainer.global_rank == 0 and ATTEMPT == 0:
            waited = time.monotonic() - record.hang_started
            torch.save({"error": type(e).__name__, "waited": waited}, OUT / "faults_hang.pt")
        raise
    optimizer = trainer.strategy.optimizers[0]
    torch.save(
        {
            "attempt": ATTEMPT,
            "resumed_from": trainer.ckpt_path and Path(trainer.ckpt_path).name,
            "losses": record.losses,
            "model": local_view(trainer.strategy.dmp.state_dict()),
            "optimizer": local_view(optimizer.state_dict()),
            "global_step": trainer.global_step,
        },
        OUT / f"{MODE}_rank{trainer.global_rank}.pt",
    )


if __name__ == "__main__":
    main()
