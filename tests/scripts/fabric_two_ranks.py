"""2-rank Fabric phases in one launch (run as a script; Lightning relaunches it per rank).

Same model, data and seeds throughout (4 table-wise tables, row-wise Adagrad fused, dense Adam,
both learning rates halved every ``HALVE`` steps by one ``StepLR``):
1. ``raw``: TorchRec's own loop (DMP, ``CombinedOptimizer``), no Lightning;
2. ``fabric``: a Fabric loop over ``TorchRecFabricStrategy``; ``fabric.save`` at step ``K``;
3. ``trainer``: the Trainer with ``TorchRecStrategy`` on the same per-rank batches;
4. ``fabric_resume``: a fresh model (another seed) ``fabric.load``s step ``K`` and finishes;
5. ``trainer_resume``: the Trainer resumes the Fabric checkpoint and finishes;
   ``fabric_from_trainer``: Fabric loads the Trainer's final checkpoint;
6. ``faults``: on rank 1 only, a bad batch; a bad batch in the second of two forwards of one
   step (called by keyword); one batch more than rank 0; a NaN loss; a bad batch in an
   evaluation (``model.eval()``); one evaluation batch more than rank 0;
7. ``user_error``, last: rank 1 raises an error of the user's own in its model's forward (before
   the sparse all-to-all that rank 0 then waits in) and does not catch it (Python hands it to
   ``sys.excepthook``; the script's own hook then ends rank 1 with exit code 0, so that Fabric's
   launcher leaves rank 0 alone); rank 0 records what it raised.

Each rank writes ``{phase}_rank{r}.pt`` (losses, local weights, what it raised) into argv[1].
"""

from __future__ import annotations

import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from factory import QUIET, WIDE, table_wise  # sibling module (script directory)
from lightning.pytorch.callbacks import Callback
from rank_state import local_view  # sibling module (script directory)
from torch import nn
from torch.utils.data import DataLoader, Subset
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
from torchrec.distributed.types import ShardingEnv
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec import (
    DLRMClickModule,
    PeerFailureError,
    TorchRecFabricStrategy,
    TorchRecStrategy,
    dense_parameters,
)
from lightning_torchrec.data import Batch, SyntheticClickDataset
from lightning_torchrec.models.dlrm import dlrm_click_model
from lightning_torchrec.sharding.planning import default_sharders

START = time.perf_counter()
OUT = Path(sys.argv[1]) if len(sys.argv) > 1 else Path()
ROWS, TABLES, STEPS, K, SEED = [50] * 4, 4, 12, 6, 7
FUSED = {"learning_rate": 0.2}
LR = 1e-2
HALVE = 4  # StepLR halves both learning rates (dense and fused) every HALVE steps


def halving(optimizer: Any) -> torch.optim.lr_scheduler.StepLR:
    return torch.optim.lr_scheduler.StepLR(optimizer, step_size=HALVE, gamma=0.5)


DATA = SyntheticClickDataset(ROWS, num_batches=2 * STEPS, batch_size=64, ids_per_feature=2, seed=3)


class Click(nn.Module):
    """The model of the Fabric loop, named like ``DLRMClickModule`` so checkpoints are shared."""

    def __init__(self) -> None:
        super().__init__()
        kw = dict(
            dense_arch_layer_sizes=WIDE["dense_sizes"], over_arch_layer_sizes=WIDE["over_sizes"]
        )
        self.model_and_loss = dlrm_click_model(ROWS, embedding_dim=WIDE["embedding_dim"], **kw)

    def forward(self, batch: Any) -> Any:
        return self.model_and_loss(batch)


def batches(rank: int, start: int = 0) -> DataLoader:
    """This rank's batches of the steps ``start ...`` (the same for every front end)."""
    return DataLoader(Subset(DATA, range(2 * start + rank, 2 * STEPS, 2)), batch_size=None)


def save(name: str, obj: Any) -> None:
    torch.save(obj, OUT / f"{name}_rank{dist.get_rank()}.pt")
    print(f"{name} done at {time.perf_counter() - START:.1f}s", flush=True)


def raw() -> dict[str, Any]:
    L.seed_everything(SEED)
    model, world = Click(), dist.get_world_size()
    sharders = default_sharders(FUSED)
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world, compute_device="cpu", local_world_size=world),
        constraints=table_wise(TABLES),
    )
    plan = planner.collective_plan(model, sharders, dist.group.WORLD)
    torch.manual_seed(SEED + 1)  # the tables' initial values
    dmp = DistributedModelParallel(
        model,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
        sharders=sharders,
    )
    dense = {
        n: p
        for n, p in dmp.named_parameters()
        if p.requires_grad and not hasattr(p, "_in_backward_optimizers")
    }
    opt = CombinedOptimizer(
        [
            ("dense", KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=LR))),
            ("embedding", dmp.fused_optimizer),
        ]
    )
    scheduler = halving(opt)
    losses = []
    for batch in batches(dist.get_rank()):
        opt.zero_grad()  # TorchRec's fused optimizer copies the scheduled LR into its kernels here
        loss, _ = dmp(batch)
        loss.backward()
        opt.step()
        scheduler.step()
        losses.append(loss.detach())
    return {"losses": torch.stack(losses), "model": local_view(model.state_dict())}


def fabric_loop(fabric: L.Fabric, start: int = 0, seed: int = SEED) -> dict[str, Any]:
    L.seed_everything(seed)
    # --- the user's loop ---
    unsharded = Click()
    torch.manual_seed(seed + 1)  # the tables' initial values
    model = fabric.setup_module(unsharded)
    optimizer = fabric.setup_optimizers(torch.optim.Adam(dense_parameters(model), lr=LR))
    scheduler = halving(optimizer)  # on the combined optimizer: drives the fused LR too
    # "lr_schedulers" as the Trainer names it, so the Trainer can resume this checkpoint too
    state = {"model": model, "optimizer": optimizer, "step": 0, "lr_schedulers": []}
    if start:
        fabric.load(OUT / f"fabric_step{K}", state)
        assert state["step"] == start, state["step"]
        scheduler.load_state_dict(state["lr_schedulers"][0])
    loader = batches(fabric.global_rank, start)
    losses = []
    for step, batch in enumerate(loader, start=start):
        optimizer.zero_grad()
        loss, _ = model(batch)
        fabric.backward(loss)
        optimizer.step()
        scheduler.step()
        losses.append(loss.detach())
        if step + 1 == K and not start:
            state["step"], state["lr_schedulers"] = K, [scheduler.state_dict()]
            fabric.save(OUT / f"fabric_step{K}", state)
            save("fabric_saved", {"model": local_view(model.module.state_dict())})
    fabric.strategy.finish()
    lrs = [g["lr"] for g in optimizer.param_groups]
    return {
        "losses": torch.stack(losses),
        "model": local_view(model.module.state_dict()),
        "lrs": lrs,
    }


class Reseed(Callback):
    """Seeds the tables' initial values right before the strategy shards the model."""

    def setup(self, trainer: Any, module: Any, stage: str) -> None:
        torch.manual_seed(SEED + 1)


class Losses(Callback):
    def __init__(self) -> None:
        self.losses: list[torch.Tensor] = []

    def on_train_batch_end(self, trainer: Any, module: Any, outputs: Any, *args: Any) -> None:
        self.losses.append(outputs["loss"].detach())


def trainer_run(start: int = 0) -> dict[str, Any]:
    L.seed_everything(SEED if not start else 99)
    module = DLRMClickModule(
        ROWS,
        embedding_dim=WIDE["embedding_dim"],
        dense_arch_layer_sizes=WIDE["dense_sizes"],
        over_arch_layer_sizes=WIDE["over_sizes"],
        optimizer=lambda p: torch.optim.Adam(p, lr=LR),
        lr_scheduler=halving,
        train_metrics_every_n_steps=0,
    )
    losses = Losses()
    strategy = TorchRecStrategy(constraints=table_wise(TABLES), fused_params=FUSED, log_plan=False)
    trainer = L.Trainer(
        strategy=strategy,
        devices=2,
        max_steps=STEPS - start,
        callbacks=[losses, Reseed()],
        use_distributed_sampler=False,
        limit_val_batches=0,
        **QUIET,
    )
    ckpt = OUT / f"fabric_step{K}" if start else None
    trainer.fit(module, train_dataloaders=batches(trainer.global_rank, start), ckpt_path=ckpt)
    if not start:
        trainer.save_checkpoint(OUT / "trainer_end")
    return {
        "losses": torch.stack(losses.losses),
        "model": local_view(module.state_dict()),
        "optim": local_view(trainer.optimizers[0].state_dict()["state"]),
    }


def fabric_from_trainer(fabric: L.Fabric) -> dict[str, Any]:
    L.seed_everything(99)
    model = fabric.setup_module(Click())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(dense_parameters(model), lr=LR))
    rest = fabric.load(OUT / "trainer_end", {"model": model, "optimizer": optimizer})
    return {
        "model": local_view(model.module.state_dict()),
        "optim": local_view(optimizer.state_dict()["state"]),
        "global_step": rest.get("global_step"),
    }


def broken(batch: Batch) -> Batch:
    """The batch with ids far outside the tables."""
    kjt = batch.sparse_features
    bad = KeyedJaggedTensor(kjt.keys(), kjt.values() + 1000, lengths=kjt.lengths())
    return Batch(batch.dense_features, bad, batch.labels)


def faults(fabric: L.Fabric) -> dict[str, Any]:
    L.seed_everything(SEED)
    unsharded = Click()  # fabric.setup with an optimizer built before sharding
    optimizer = torch.optim.Adam(dense_parameters(unsharded), lr=LR)
    model, optimizer = fabric.setup(unsharded, optimizer)
    params = [p for group in optimizer.param_groups for p in group["params"]]
    rank, seen = fabric.global_rank, {"meta_in_optimizer": any(p.is_meta for p in params)}
    for name in ("bad_batch", "second_forward", "uneven", "nan_loss"):
        loader = list(batches(rank))
        if name == "uneven" and rank == 1:
            loader.append(loader[0])  # one batch more than rank 0, no `last` flag given
        try:
            for step, batch in enumerate(loader):
                bad = broken(batch) if rank == 1 and step == 2 else batch
                optimizer.zero_grad()
                if name == "second_forward":  # a summed loss of two forwards; one by keyword
                    loss = model(batch)[0] + model(batch=bad)[0]
                else:
                    loss, _ = model(bad if name == "bad_batch" else batch)
                if name == "nan_loss" and rank == 1 and step == 3:
                    loss = loss * float("nan")
                fabric.backward(loss)
                optimizer.step()
            fabric.strategy.finish()
            seen[name] = None
        except Exception as e:  # every rank must raise the same named error
            seen[name] = (type(e).__name__, str(e), step)
    for name in ("eval_bad_batch", "eval_uneven"):
        evaluation = list(batches(rank))[:4]
        if name == "eval_uneven" and rank == 1:
            evaluation.append(evaluation[0])  # one evaluation batch more than rank 0
        try:
            model.eval()
            with torch.no_grad():
                for step, batch in enumerate(evaluation):
                    bad = name == "eval_bad_batch" and rank == 1 and step == 2
                    model(broken(batch) if bad else batch)  # checked in eval() mode too
            model.train()
            optimizer.zero_grad()  # training goes on: rank 1 is still evaluating
            loss, _ = model(evaluation[0])
            fabric.backward(loss)
            optimizer.step()
            fabric.strategy.finish()
            seen[name] = None
        except Exception as e:
            seen[name] = (type(e).__name__, str(e), step)
        model.train()
    return seen


class Boom(ValueError):
    """A user's own error (a bug in rank 1's model code)."""


class Buggy(Click):
    """Its forward raises ``Boom`` on rank 1 at step 2, before the sparse features' all-to-all."""

    calls = 0

    def forward(self, batch: Any) -> Any:
        step, self.calls = self.calls, self.calls + 1
        if dist.get_rank() == 1 and step == 2:
            raise Boom(f"a bug in rank 1's forward at step {step}")
        return super().forward(batch)


def user_error(fabric: L.Fabric) -> None:
    """Rank 1 raises ``Boom`` in its loop and does not catch it; rank 0 records what it raised."""
    model = fabric.setup_module(Buggy())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(dense_parameters(model), lr=LR))
    rank, seen = fabric.global_rank, {}
    try:
        for batch in batches(rank):
            optimizer.zero_grad()
            loss, _ = model(batch)
            fabric.backward(loss)
            optimizer.step()
    except Exception as e:
        if rank == 1:
            raise  # its own Boom: nobody catches it (see `exit_quietly`)
        seen = {"error": type(e).__name__, "message": str(e), "boom": isinstance(e, Boom)}
        seen["peer_failure"] = isinstance(e, PeerFailureError)
    save("user_error", seen)


def exit_quietly(kind: type, error: BaseException, tb: Any) -> None:
    """The script's ``sys.excepthook`` (the strategy's wraps it): rank 1's ``Boom`` exits 0."""
    if not isinstance(error, Boom):
        sys.__excepthook__(kind, error, tb)
        return
    traceback.print_exception(kind, error, tb)
    rank = dist.get_rank()
    torch.save({"error": kind.__name__}, OUT / f"user_error_rank{rank}.pt")
    sys.stderr.flush()
    sys.stdout.flush()
    os._exit(0)  # Fabric's launcher would kill rank 0 on a non-zero exit code


def main() -> None:
    sys.excepthook = exit_quietly
    strategy = TorchRecFabricStrategy(constraints=table_wise(TABLES), fused_params=FUSED)
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    save(
        "registry",
        {
            "name": type(
                L.Fabric(strategy="torchrec", accelerator="cpu", devices=2).strategy
            ).__name__
        },
    )
    save("raw", raw())
    save("fabric", fabric_loop(fabric))
    save("trainer", trainer_run())
    save("fabric_resume", fabric_loop(fabric, start=K, seed=99))
    save("trainer_resume", trainer_run(start=K))
    save("fabric_from_trainer", fabric_from_trainer(fabric))
    save("faults", faults(fabric))
    user_error(fabric)


if __name__ == "__main__":
    main()
