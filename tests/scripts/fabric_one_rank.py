"""One Fabric rank loads the 2-rank Fabric checkpoint (resharding 2 -> 1) and records its tables.

``python fabric_one_rank.py OUT``: reads ``OUT/fabric_step6`` (written by fabric_two_ranks.py),
writes ``OUT/reshard_rank0.pt``.
"""

from __future__ import annotations

import sys
from pathlib import Path

import lightning as L
import torch
from fabric_two_ranks import FUSED, LR, TABLES, Click, K
from factory import table_wise  # sibling module (script directory)
from rank_state import local_view  # sibling module (script directory)

from lightning_torchrec import TorchRecFabricStrategy, dense_parameters

OUT = Path(sys.argv[1])


def main() -> None:
    strategy = TorchRecFabricStrategy(constraints=table_wise(TABLES), fused_params=FUSED)
    fabric = L.Fabric(accelerator="cpu", devices=1, strategy=strategy)
    fabric.launch()
    L.seed_everything(99)
    model = fabric.setup_module(Click())
    optimizer = fabric.setup_optimizers(torch.optim.Adam(dense_parameters(model), lr=LR))
    state = {"model": model, "optimizer": optimizer, "step": 0}
    fabric.load(OUT / f"fabric_step{K}", state)
    snapshot = {"step": state["step"], "model": local_view(model.module.state_dict())}
    torch.save(snapshot, OUT / "reshard_rank0.pt")


if __name__ == "__main__":
    main()
