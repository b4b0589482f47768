r"""The demo job in a loop of your own: DLRM on synthetic clicks, sharded over 2 CPU processes.

Run ``python -m lightning_torchrec.demo_fabric`` (``make demo-fabric``). The loop is what a
TorchRec user writes anyway; Lightning Fabric adds the processes, the sharding, the combined
optimizer, the agreed batch and loss checks and the sharded checkpoints. Options::

    python -m lightning_torchrec.demo_fabric --devices 2 --steps 200 --checkpoint ckpt/fabric

``--resume`` continues from ``--checkpoint``; ``--help`` lists every option.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import lightning.fabric as lf
import torch
from lightning.fabric.loggers import CSVLogger

from lightning_torchrec.data import SyntheticClickDataset
from lightning_torchrec.fabric import TorchRecFabricStrategy
from lightning_torchrec.models.dlrm import dlrm_click_model
from lightning_torchrec.training.norms import weights_to_log
from lightning_torchrec.training.optim import dense_parameters


def parse(args: list[str] | None = None) -> argparse.Namespace:
    """The command line.

    Args:
        args: the arguments (None: ``sys.argv[1:]``).

    Returns:
        The parsed options.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--accelerator", default="cpu")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--num_nodes", type=int, default=1)
    parser.add_argument("--steps", type=int, default=200, help="training steps (all ranks)")
    parser.add_argument("--batch_size", type=int, default=512, help="samples per rank and step")
    parser.add_argument("--num_embeddings", type=int, default=10_000, help="rows per table")
    parser.add_argument("--tables", type=int, default=8)
    parser.add_argument("--embedding_dim", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-3, help="dense Adam learning rate")
    parser.add_argument("--fused_lr", type=float, default=0.1, help="embedding learning rate")
    parser.add_argument("--log_every", type=int, default=50)
    parser.add_argument("--checkpoint", type=Path, default=Path("checkpoints/fabric"))
    parser.add_argument("--resume", action="store_true", help="continue from --checkpoint")
    parser.add_argument("--log_dir", type=Path, default=Path("lightning_logs/fabric"))
    return parser.parse_args(args)


def train(opts: argparse.Namespace) -> list[float]:
    """Runs the loop on every rank (call after ``fabric.launch()``'s processes start).

    Args:
        opts: the options of :func:`parse`.

    Returns:
        This rank's training losses.
    """
    strategy = TorchRecFabricStrategy(fused_params={"learning_rate": opts.fused_lr})
    fabric = lf.Fabric(
        accelerator=opts.accelerator,
        devices=opts.devices,
        num_nodes=opts.num_nodes,
        strategy=strategy,
        loggers=CSVLogger(opts.log_dir),
    )
    fabric.launch()
    fabric.seed_everything(1234)
    rows = [opts.num_embeddings] * opts.tables
    data = SyntheticClickDataset(rows, opts.steps * fabric.world_size, opts.batch_size, seed=1)
    model = dlrm_click_model(rows, embedding_dim=opts.embedding_dim)

    model = fabric.setup_module(model)  # plans, shards (tables on meta -> shards)
    optimizer = torch.optim.Adam(dense_parameters(model), lr=opts.lr)
    optimizer = fabric.setup_optimizers(optimizer)  # + the fused embedding optimizer
    loader = fabric.setup_dataloaders(torch.utils.data.DataLoader(data, batch_size=None))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    if opts.resume:
        fabric.load(opts.checkpoint, state)
    losses = []
    for step, batch in enumerate(loader):
        if step < state["step"]:
            continue  # the batches the checkpoint has seen
        optimizer.zero_grad()
        loss, _ = model(batch)  # the batch and the last loss are checked on every rank first
        fabric.backward(loss)  # fused tables update here
        optimizer.step()  # dense parameters
        losses.append(loss.item())
        if (step + 1) % opts.log_every == 0:
            fabric.log_dict({"train/loss": loss.detach(), **weights_to_log(model.module)}, step)
            fabric.print(f"step {step + 1}: loss {loss.item():.4f}")
    state["step"] = opts.steps
    strategy.finish()  # judges the last loss
    fabric.save(opts.checkpoint, state)
    fabric.print(f"saved {opts.checkpoint}")
    for logger in fabric.loggers:
        logger.finalize("success")
    return losses


def main(args: list[str] | None = None) -> list[float]:
    """``python -m lightning_torchrec.demo_fabric``.

    Args:
        args: the command line (None: ``sys.argv[1:]``).

    Returns:
        This rank's training losses.
    """
    return train(parse(args))


if __name__ == "__main__":
    main()
