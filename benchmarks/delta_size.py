"""Delta checkpoints: bytes and publish time of a delta against a full checkpoint, one process.

A DLRM with ``--tables`` tables of ``--rows`` rows (dim ``--dim``) is sharded on one gloo rank
(``TorchRecStrategy``, table-wise, fused row-wise Adagrad); its full checkpoint is written with
``trainer.save_checkpoint``. Between two publishes, lookups draw Zipf-distributed ids
(``numpy`` ``zipf(a)`` ranks over a fixed random permutation of each table's rows: hot rows are
scattered) until ``--touch`` of each table's rows are touched; the delta of those rows (with and
without their optimizer state) is written with ``write_delta``. Prints and writes
``results/delta_size.json``: full checkpoint bytes, delta bytes, their ratio, the publish time.
Run: ``python -m benchmarks.delta_size [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch

from benchmarks.checkpoint_cost import dir_bytes
from benchmarks.common import RESULTS, write_result


def zipf_touched(rows: int, fraction: float, a: float, seed: int) -> tuple[torch.Tensor, int]:
    """Distinct rows touched by Zipf(a) lookups until ``fraction`` of ``rows`` are reached.

    Returns:
        The touched ids (sorted) and the number of lookups drawn.
    """
    rng = np.random.default_rng(seed)
    order = rng.permutation(rows)
    seen = np.zeros(rows, dtype=bool)
    want, drawn = int(fraction * rows), 0
    while seen.sum() < want:
        ranks = (rng.zipf(a, size=1 << 16) - 1) % rows
        for start in range(0, len(ranks), 1024):  # stop close to the fraction
            seen[order[ranks[start : start + 1024]]] = True
            drawn += 1024
            if seen.sum() >= want:
                break
    return torch.from_numpy(np.flatnonzero(seen)).long(), drawn


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rows", type=int, default=500_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--tables", type=int, default=2)
    parser.add_argument("--touch", type=float, default=0.05)
    parser.add_argument("--zipf", type=float, default=1.2)
    parser.add_argument("--quick", action="store_true", help="tiny tables (smoke test)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.dim = 20_000, 16

    from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy
    from lightning_torchrec.checkpoint import checkpoint_id, write_delta

    names = [f"t_cat_{i}" for i in range(args.tables)]
    module = DLRMClickModule(
        [args.rows] * args.tables,
        embedding_dim=args.dim,
        dense_arch_layer_sizes=[256, args.dim],
        over_arch_layer_sizes=[256, 1],
    )
    data = SyntheticClickData(
        num_embeddings=args.rows, num_sparse_features=args.tables, batch_size=8, train_batches=1
    )
    from torchrec.distributed.planner.types import ParameterConstraints

    constraints = {n: ParameterConstraints(sharding_types=["table_wise"]) for n in names}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TorchRecStrategy(constraints=constraints, log_plan=False),
        max_epochs=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)  # shards the model and builds its optimizers
    optimizer = trainer.optimizers[0]
    root = Path(tempfile.mkdtemp(prefix="delta_size_"))
    try:
        start = time.perf_counter()
        trainer.save_checkpoint(root / "full", weights_only=False)
        full_seconds = time.perf_counter() - start
        full = dir_bytes(root / "full")
        base = checkpoint_id(root / "full")
        touched, lookups = {}, {}
        for i, name in enumerate(names):
            touched[name], lookups[name] = zipf_touched(args.rows, args.touch, args.zipf, i)
        result: dict[str, Any] = {
            "rows_per_table": args.rows,
            "dim": args.dim,
            "tables": args.tables,
            "zipf_a": args.zipf,
            "touched_fraction": {n: len(t) / args.rows for n, t in touched.items()},
            "lookups_drawn": lookups,
            "full_checkpoint_bytes": full,
            "full_checkpoint_seconds": full_seconds,
        }
        for sequence, with_optimizer in ((1, False), (2, True)):
            start = time.perf_counter()
            path = write_delta(
                root / "chain",
                module,
                touched,
                sequence=sequence,
                parent=base,
                base=base,
                step=0,
                optimizer=optimizer if with_optimizer else None,
            )
            seconds = time.perf_counter() - start
            size = dir_bytes(path)
            tag = "delta_with_optimizer" if with_optimizer else "delta"
            result[f"{tag}_bytes"] = size
            result[f"{tag}_ratio"] = size / full
            result[f"{tag}_publish_seconds"] = seconds
        out = write_result("delta_size", result, args.out)
        for key, value in result.items():
            print(f"{key}: {value}")
        print(f"written to {out}")
        return result
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
