"""What a fit builds is freed with the objects that own it (run as a script; 2 ranks).

Phases, in one launch:
1. ``ROUNDS`` times: build a model and a trainer, fit, validate, drop every reference,
   ``gc.collect()``; record whether weakrefs to the model, its ``DistributedModelParallel`` and
   the trainer are dead, and the process's RSS after each round;
2. one model fitted by a first strategy, then a second trainer whose strategy asks for another
   sharding (constraints, plan, fused optimizer): each must raise ``ShardingConflictError``;
   one asking for nothing new (or a new fused learning rate) reuses the sharding; the last
   trainer then predicts.

Each rank writes ``lifetime_rank{r}.pt`` into the directory given as argv[1], and, last of all
at its exit (after the package's own exit hook), ``exit_rank{r}.pt``: the names of the threads
still running then (no process group's or store's may be left to the finalising interpreter).
"""

from __future__ import annotations

import atexit
import gc
import os
import sys
import weakref
from pathlib import Path

import torch
from factory import cpu_trainer, sharding_constraints, table_wise, tiny_data, tiny_dlrm

from lightning_torchrec import ShardingConflictError, TorchRecStrategy
from lightning_torchrec.sharding.reuse import recorded

OUT = Path(sys.argv[1])
ROUNDS = 5


def threads_left() -> None:
    """Registered first, so run last at exit: what the interpreter's finalisation would meet."""
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            continue
    rank = int(os.environ.get("LOCAL_RANK", "0"))
    torch.save({"rank": rank, "threads": sorted(names)}, OUT / f"exit_rank{rank}.pt")


atexit.register(threads_left)


def rss_mib() -> float:
    with open("/proc/self/status") as f:
        line = next(x for x in f if x.startswith("VmRSS:"))
    return int(line.split()[1]) / 1024


#: Big enough that a leaked model shows in RSS: 2 tables x 300k rows x 16 floats (19 MiB/rank).
ROWS = 300_000


def one_round() -> tuple[weakref.ref, weakref.ref, weakref.ref, int]:
    model = tiny_dlrm(rows=ROWS, embedding_dim=16)
    trainer = cpu_trainer(devices=2, max_steps=4)
    trainer.fit(model, datamodule=tiny_data(rows=ROWS))
    trainer.validate(model, datamodule=tiny_data(rows=ROWS), verbose=False)
    dmp = trainer.strategy.dmp
    assert dmp is not None and recorded(model) is not None
    refs = weakref.ref(model), weakref.ref(dmp), weakref.ref(trainer)
    return (*refs, trainer.global_rank)


def lifetimes() -> dict:
    alive, rss = [], []
    for _ in range(ROUNDS):
        model_ref, dmp_ref, trainer_ref, rank = one_round()
        gc.collect()
        alive.append([r() is not None for r in (model_ref, dmp_ref, trainer_ref)])
        rss.append(rss_mib())
    return {"alive": alive, "rss": rss, "rank": rank}


def conflicts() -> dict:
    model = tiny_dlrm(rows=2000, embedding_dim=8)
    cpu_trainer(devices=2, max_steps=2).fit(model, datamodule=tiny_data(rows=2000))
    asks = {
        "constraints": dict(constraints=sharding_constraints({"t_cat_0": "column_wise"})),
        "fused_params": dict(fused_params={"optimizer": "SGD", "learning_rate": 0.1}),
    }
    found = {}
    for name, kwargs in asks.items():
        trainer = cpu_trainer(TorchRecStrategy(**kwargs), devices=2, max_steps=4)
        try:
            trainer.fit(model, datamodule=tiny_data(rows=2000))
            found[name] = "no error"
        except ShardingConflictError as e:
            found[name] = str(e)
    # The same request, or none, or a new learning rate only: reused.
    for name, strategy in {
        "same": TorchRecStrategy(constraints=table_wise(2)),
        "lr only": TorchRecStrategy(fused_params={"learning_rate": 0.05}),
    }.items():
        trainer = cpu_trainer(strategy, devices=2, max_steps=4)
        trainer.fit(model, datamodule=tiny_data(rows=2000))
        found[name] = trainer.global_step
    lr = [g["lr"] for g in trainer.strategy.dmp.fused_optimizer.param_groups]
    # A predict after the fit (its own strategy set-up and host group), as a script ends.
    predictions = trainer.predict(model, datamodule=tiny_data(rows=2000))
    return {"conflicts": found, "fused_lr": lr, "predicted": len(predictions or [])}


if __name__ == "__main__":
    result = lifetimes()
    result.update(conflicts())
    torch.save(result, OUT / f"lifetime_rank{result['rank']}.pt")
