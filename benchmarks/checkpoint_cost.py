"""Benchmark 5: save and load cost of sharded checkpoints, public API only, 2 gloo ranks.

Trains the benchmark DLRM a few steps, then alternates ``trainer.save_checkpoint(path)`` (timed
between barriers) and resumes. Load cost = wall time of ``fit(ckpt_path=...)`` on a fresh trainer
and model that stops right after restoring, minus that of the same fresh ``fit`` without a
checkpoint (A B A B ...; both shard the model and set up the optimizers). Size = bytes on disk.
Run: ``python -m benchmarks.checkpoint_cost [--quick]``.
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
from torch.utils.data import DataLoader

from benchmarks.common import RESULTS, ModelSize, stats, write_result
from benchmarks.harness import FUSED, SEED, dataset, dlrm_module, rank_sampler, table_wise


def dir_bytes(path: Path) -> int:
    """Bytes of every file under ``path`` (or of the file itself)."""
    if path.is_file():
        return path.stat().st_size
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def make_trainer(size: ModelSize, root: str, max_steps: int) -> L.Trainer:
    from lightning_torchrec import TorchRecStrategy

    return L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(fused_params=FUSED, constraints=table_wise(size), log_plan=False),
        max_steps=max_steps,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        logger=False,
        default_root_dir=root,
    )


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--steps", type=int, default=5)
    args = p.parse_args(argv)
    size = ModelSize.tiny() if args.quick else ModelSize()
    rounds = 1 if args.quick else args.rounds
    L.seed_everything(SEED, verbose=False)
    torch.set_num_threads(1)
    data = dataset(size, 2 * args.steps)
    loader = DataLoader(data, batch_size=None)
    root = Path(tempfile.mkdtemp(prefix="bench_ckpt_"))
    trainer = make_trainer(size, str(root), args.steps)

    class Prepare(L.Callback):
        def setup(self, trainer: L.Trainer, pl_module: Any, stage: str) -> None:
            data.prepare(list(rank_sampler(data, trainer.global_rank, trainer.world_size)))

    trainer.callbacks.append(Prepare())
    trainer.fit(dlrm_module(size), train_dataloaders=loader)
    strategy = trainer.strategy
    ckpt_root = Path(strategy.broadcast(str(root / "ckpts")))
    save_s, load_s, fresh_s, sizes = [], [], [], []
    for r in range(rounds):
        path = ckpt_root / f"round{r}.ckpt"
        strategy.barrier()
        start = time.perf_counter()
        trainer.save_checkpoint(path)
        strategy.barrier()
        save_s.append(time.perf_counter() - start)
        sizes.append(dir_bytes(path))
        for with_ckpt in (True, False):  # A B: the difference is the restore
            fresh = make_trainer(size, str(root), args.steps if with_ckpt else 0)
            strategy_fresh = fresh.strategy
            module = dlrm_module(size)
            start = time.perf_counter()
            fresh.fit(module, train_dataloaders=loader, ckpt_path=path if with_ckpt else None)
            strategy_fresh.barrier()
            (load_s if with_ckpt else fresh_s).append(time.perf_counter() - start)
            if with_ckpt and fresh.global_step != args.steps:
                raise RuntimeError(f"resume reached step {fresh.global_step}, not {args.steps}")
        strategy.barrier()
        if trainer.is_global_zero and r < rounds - 1:
            shutil.rmtree(path, ignore_errors=True)
    if not trainer.is_global_zero:
        return None
    table_bytes = size.tables * size.rows * size.dim * 4
    load_only = [a - b for a, b in zip(load_s, fresh_s, strict=True)]
    result = {
        "size": size.to_dict(),
        "world_size": 2,
        "rounds": rounds,
        "checkpoint_bytes": stats(sizes)["median"],
        "table_bytes": table_bytes,
        "bytes_over_tables": stats(sizes)["median"] / table_bytes,
        "save_s": stats(save_s),
        "resume_fit_s": stats(load_s),
        "fresh_fit_s": stats(fresh_s),
        "load_s": stats(load_only),
        "save_bytes_per_s": stats(sizes)["median"] / stats(save_s)["median"],
    }
    write_result("checkpoint_cost", result, args.out)
    shutil.rmtree(root, ignore_errors=True)
    return result


if __name__ == "__main__":
    main()
