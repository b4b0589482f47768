"""2 ranks: fits with a train pipeline, each followed by a fit and a validate whose loaders fork
two workers, ``ROUNDS`` times in one process pair (run as a script; Lightning relaunches it).

Before the fix, a loader forking its workers after a pipelined fit hung about one run in three:
the dropped pipeline's process-group handles were finalized by a garbage collection in the forked
worker, where ProcessGroupGloo's destructor waits for threads the fork did not copy. Writes
``fork_rank{r}.pt`` (the rounds completed, and the multiprocessing contexts the forking loaders
ended with) into argv[1].
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from factory import cpu_trainer, table_wise, tiny_data, tiny_dlrm

from lightning_torchrec import TorchRecStrategy

OUT = Path(sys.argv[1])
ROUNDS = int(sys.argv[2]) if len(sys.argv) > 2 else 20


def data(workers: int):  # noqa: ANN201
    return tiny_data(train_batches=6, val_batches=2, num_workers=workers)


def fit(pipeline: str | None, workers: int):  # noqa: ANN201
    strategy = TorchRecStrategy(constraints=table_wise(2), pipeline=pipeline, log_plan=False)
    trainer = cpu_trainer(strategy, devices=2, max_steps=4)
    model = tiny_dlrm()
    trainer.fit(model, datamodule=data(workers))
    return trainer, model


if __name__ == "__main__":
    done, contexts = 0, set()
    for _ in range(ROUNDS):
        fit("sparse_dist", workers=0)
        trainer, model = fit(None, workers=2)
        contexts.add(type(trainer.train_dataloader.multiprocessing_context).__name__)
        trainer.validate(model, datamodule=data(2), verbose=False)
        contexts.add(type(trainer.val_dataloaders.multiprocessing_context).__name__)
        done += 1
    saved = {"rounds": done, "contexts": sorted(contexts)}
    torch.save(saved, OUT / f"fork_rank{trainer.global_rank}.pt")
