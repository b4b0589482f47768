"""Benchmark: train pipelines, raw TorchRec loops against the Trainer, side by side in one run.

On 2 gloo ranks, the same DLRM, batches and optimizers, per variant: samples per second (both
ranks together) and the step time, at the demo size and at the benchmark size (8 tables of
100k x 64):

* ``raw_base``: a hand-written TorchRec loop (``benchmarks.harness.RawLoop``);
* ``raw_sparse_dist``: the same model and optimizer driven by TorchRec's
  ``TrainPipelineSparseDist.progress``;
* ``trainer_none`` / ``trainer_sparse_dist``: ``Trainer`` + ``TorchRecStrategy(pipeline=...)``
  at Lightning's parity settings (no progress bar, no logger, no checkpointing).

Variants run one after the other, twice (A B C D A B C D), in the same processes; the first
``--warmup`` steps of each run are dropped. Run: ``python -m benchmarks.pipeline_throughput``.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from benchmarks.common import RESULTS, CachedBatches, ModelSize, stats, write_result
from benchmarks.harness import FUSED, SEED, RawLoop, dataset, dlrm_module, rank_sampler, table_wise

VARIANTS = ["trainer_none", "trainer_sparse_dist", "raw_base", "raw_sparse_dist"]


class StepTimes(Callback):
    """Time between consecutive ``on_train_batch_start`` calls: one full Lightning step."""

    def __init__(self, data: CachedBatches) -> None:
        self.data = data
        self.last: float | None = None
        self.times: list[float] = []

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.data.items:
            self.data.prepare(list(rank_sampler(self.data, trainer.global_rank, 2)))

    def on_train_batch_start(self, *args: Any) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now


def trainer_run(
    size: ModelSize, data: CachedBatches, steps: int, pipeline: str | None
) -> list[float]:
    """One Trainer fit of ``steps`` steps; the step times."""
    from lightning_torchrec import TorchRecStrategy

    timer = StepTimes(data)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(
            fused_params=FUSED, constraints=table_wise(size), pipeline=pipeline, log_plan=False
        ),
        max_steps=steps,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=tempfile.mkdtemp(prefix="bench_pipeline_"),
        callbacks=[timer],
    )
    trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    return timer.times


def raw_run(size: ModelSize, data: CachedBatches, steps: int, pipelined: bool) -> list[float]:
    """``steps`` steps of a raw TorchRec loop, plain or through ``TrainPipelineSparseDist``."""
    if not data.items:
        data.prepare(list(rank_sampler(data, dist.get_rank(), dist.get_world_size())))
    raw = RawLoop(size, data)
    times: list[float] = []
    if not pipelined:
        for _ in range(steps):
            start = time.perf_counter()
            raw.step()
            times.append(time.perf_counter() - start)
        return times
    pipeline = TrainPipelineSparseDist(raw.model, raw.optimizer, torch.device("cpu"))
    for _ in range(steps):
        start = time.perf_counter()
        pipeline.progress(raw.batches)
        times.append(time.perf_counter() - start)
    return times


def measure(size: ModelSize, steps: int, warmup: int, rounds: int) -> dict[str, Any]:
    """Every variant, ``rounds`` times in turn, on one size."""
    data = dataset(size, 2 * (steps + 4))
    runs: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for _ in range(rounds):
        for variant in VARIANTS:
            L.seed_everything(SEED, verbose=False)
            if variant.startswith("trainer"):
                pipeline = None if variant == "trainer_none" else "sparse_dist"
                times = trainer_run(size, data, steps, pipeline)
            else:
                times = raw_run(size, data, steps, variant == "raw_sparse_dist")
            runs[variant] += times[warmup:]
    samples = 2 * size.batch_size
    out: dict[str, Any] = {"size": size.to_dict(), "steps_per_run": steps, "rounds": rounds}
    base = stats(runs["raw_base"])["median"]
    for variant, times in runs.items():
        s = stats(times)
        out[variant] = {
            "step_s": s,
            "samples_per_s": samples / s["median"],
            "ratio_to_raw_base": s["median"] / base,
        }
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    sizes = (
        {"tiny": ModelSize.tiny()}
        if args.quick
        else {
            "demo": ModelSize.demo(),
            "benchmark": ModelSize(),
        }
    )
    steps, warmup = (8, 2) if args.quick else (args.steps, args.warmup)
    rounds = 1 if args.quick else args.rounds
    result: dict[str, Any] = {"world_size": 2, "plan": "table_wise", "sizes": {}}
    for name, size in sizes.items():
        result["sizes"][name] = measure(size, steps, warmup, rounds)
    if dist.get_rank() != 0:
        return None
    write_result("pipeline_throughput", result, args.out)
    return result


if __name__ == "__main__":
    main()
