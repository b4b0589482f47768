"""Delta chains on 2 ranks (run as a script; Lightning relaunches it).

1. A fit with ``t_cat_0`` row-wise and ``t_cat_1`` table-wise publishes every 3 steps (and at
   each epoch's end), with the rows' optimizer state; its final full checkpoint goes to
   ``argv[1]/final`` (the test restores both on one process);
2. the 2 ranks (``t_cat_0`` row-wise, ``t_cat_1`` data-parallel as there) restore the
   one-process chain of ``argv[2]`` and compare it with that run's final checkpoint restored on
   them too;
3. a delta whose write fails on rank 1 (disk full) must fail on both ranks with the same named
   error and leave nothing in the chain's folder.

``argv[1]/report.pt`` (rank 0) holds every rank's verdicts.
"""

from __future__ import annotations

import errno
import sys
from pathlib import Path
from typing import Any

import torch
from delta_state import chain_state  # sibling module (script directory)
from factory import cpu_trainer, sharding_constraints, tiny_data, tiny_dlrm

import lightning_torchrec.checkpoint.delta as delta_module
from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.checkpoint import chain_of, checkpoint_id, restore_chain, write_delta
from lightning_torchrec.distributed import all_gather
from lightning_torchrec.lightning import DeltaPublisher

OUT = Path(sys.argv[1])
ONE_RANK = Path(sys.argv[2])
TYPES = {"t_cat_0": "row_wise", "t_cat_1": "table_wise"}
#: The plan restoring the one-process chain (whose ``t_cat_1`` is data-parallel): a table's
#: optimizer state loads only onto the same kind of optimizer (fused or dense).
ONE_RANK_TYPES = {"t_cat_0": "row_wise", "t_cat_1": "data_parallel"}


def trainer_for(callbacks: list[Any], max_epochs: int, types: dict[str, str] = TYPES) -> Any:
    return cpu_trainer(
        TorchRecStrategy(constraints=sharding_constraints(types), log_plan=False),
        devices=2,
        max_epochs=max_epochs,
        limit_val_batches=0,
        callbacks=callbacks,
        default_root_dir=OUT,
    )


def target(types: dict[str, str] = TYPES) -> tuple[Any, Any]:
    module = tiny_dlrm()
    trainer = trainer_for([], 0, types)
    trainer.fit(module, tiny_data(train_batches=8, seed=3))
    return module, trainer.optimizers[0]


def main() -> None:
    publisher = DeltaPublisher(OUT / "chain", every_n_steps=3, with_optimizer=True)
    module = tiny_dlrm()
    trainer = trainer_for([publisher], 2)
    trainer.fit(module, tiny_data(train_batches=8, seed=3))
    trainer.save_checkpoint(OUT / "final", weights_only=False)
    rank = trainer.global_rank

    restored, optimizer = target(ONE_RANK_TYPES)
    restore_chain(restored, ONE_RANK / "chain" / "base", chain_of(ONE_RANK / "chain"), optimizer)
    got = chain_state(restored, optimizer)
    reference, reference_optimizer = target(ONE_RANK_TYPES)
    restore_chain(reference, ONE_RANK / "final", [], reference_optimizer)
    want = chain_state(reference, reference_optimizer)
    equal = set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in got)

    if rank == 1:

        def full_disk(obj: Any, file: Any) -> None:
            raise OSError(errno.ENOSPC, "No space left on device", str(file))

        delta_module.write_torch_file = full_disk  # type: ignore[assignment]
    base_id = checkpoint_id(OUT / "chain" / "base")
    error = None
    try:
        write_delta(
            OUT / "failing",
            module,
            {"t_cat_0": torch.tensor([1, 150])},
            sequence=1,
            parent=base_id,
            base=base_id,
            step=0,
        )
    except Exception as err:  # noqa: BLE001 - reported
        error = type(err).__name__
    left = sorted(p.name for p in (OUT / "failing").iterdir()) if (OUT / "failing").exists() else []
    verdicts = all_gather({"error": error, "left": left, "equal": equal})
    if rank == 0:
        torch.save(
            {
                "errors": [v["error"] for v in verdicts],
                "left": [v["left"] for v in verdicts],
                "one_rank_chain_equal": [v["equal"] for v in verdicts],
            },
            OUT / "report.pt",
        )


if __name__ == "__main__":
    main()
