"""A Fabric loop over ``TorchRecFabricStrategy`` against a hand-written TorchRec loop.

Same DLRM shape, same cached batches, table-wise plan, 2 gloo ranks on CPU, one launch. Blocks
alternate raw, Fabric, raw, Fabric... (``--rounds`` rounds of ``--block`` steps each); every step
is timed on its own (next batch, zero_grad, forward, backward, step, ``loss.item()``). The
Fabric loop runs with the strategy's defaults (batch checks and the loss check: one small
collective per step) unless ``--no_checks``. Run: ``python -m benchmarks.fabric_overhead``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader

from benchmarks.common import RESULTS, ModelSize
from benchmarks.harness import FUSED, SEED, RawLoop, dataset, rank_sampler, table_wise, versions
from lightning_torchrec import TorchRecFabricStrategy, dense_parameters
from lightning_torchrec.models.dlrm import dlrm_click_model

SIZE = ModelSize(tables=8, rows=20_000, dim=32, ids_per_feature=20, batch_size=1024)


class FabricLoop:
    """The user's loop: ``fabric.setup_module``/``setup_optimizers``, ``fabric.backward``."""

    def __init__(self, fabric: L.Fabric, size: ModelSize, data: Any) -> None:
        model = dlrm_click_model(
            [size.rows] * size.tables,
            num_dense_features=size.dense,
            embedding_dim=size.dim,
            dense_arch_layer_sizes=[64, size.dim],
            over_arch_layer_sizes=[64, 1],
            pooling="mean",
            embedding_init_scale=0.1,
        )
        self.fabric = fabric
        self.model = fabric.setup_module(model)
        optimizer = torch.optim.Adam(dense_parameters(self.model), lr=1e-3)
        self.optimizer = fabric.setup_optimizers(optimizer)
        sampler = rank_sampler(data, fabric.global_rank, fabric.world_size)
        self.batches = iter(DataLoader(data, batch_size=None, sampler=sampler))
        self.times: list[tuple[int, float]] = []

    def run_block(self, block_index: int, steps: int) -> None:
        """Runs and times ``steps`` steps."""
        for _ in range(steps):
            start = time.perf_counter()
            batch = next(self.batches)
            self.optimizer.zero_grad()
            loss, _ = self.model(batch)
            self.fabric.backward(loss)
            self.optimizer.step()
            loss.item()
            self.times.append((block_index, time.perf_counter() - start))


def block_medians(times: list[tuple[int, float]], warmup: int) -> dict[int, float]:
    """The median step time of every counted block, its first ``warmup`` steps left out."""
    blocks: dict[int, list[float]] = {}
    for block, seconds in times:
        blocks.setdefault(block, []).append(seconds)
    return {b: statistics.median(t[warmup:] or t) for b, t in blocks.items() if b >= 0}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--block", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=3, help="steps of each block not counted")
    parser.add_argument("--no_checks", action="store_true")
    opts = parser.parse_args()
    checks: dict[str, Any] = (
        {"validate_batches": False, "on_nonfinite_loss": "ignore"} if opts.no_checks else {}
    )
    strategy = TorchRecFabricStrategy(
        constraints=table_wise(SIZE), fused_params=FUSED, log_plan=False, **checks
    )
    fabric = L.Fabric(accelerator="cpu", devices=2, strategy=strategy)
    fabric.launch()
    L.seed_everything(SEED, verbose=False)
    steps = opts.rounds * opts.block + 1
    data = dataset(SIZE, 2 * steps)
    data.prepare(list(rank_sampler(data, fabric.global_rank, fabric.world_size)))
    raw = RawLoop(SIZE, data)
    loop = FabricLoop(fabric, SIZE, data)
    raw.run_block(-1, 1)  # first steps allocate; not counted
    loop.run_block(-1, 1)
    for r in range(opts.rounds):
        dist.barrier()
        raw.run_block(r, opts.block)
        dist.barrier()
        loop.run_block(r, opts.block)
    raw_med = block_medians(raw.times, opts.warmup)
    fab_med = block_medians(loop.times, opts.warmup)
    ratios = [fab_med[r] / raw_med[r] for r in range(opts.rounds)]
    result = {
        "benchmark": "fabric_overhead",
        "checks": not opts.no_checks,
        "size": SIZE.to_dict(),
        "rounds": opts.rounds,
        "block": opts.block,
        "raw_step_ms": [1e3 * raw_med[r] for r in range(opts.rounds)],
        "fabric_step_ms": [1e3 * fab_med[r] for r in range(opts.rounds)],
        "ratio_per_round": ratios,
        "ratio_median": statistics.median(ratios),
        "ratio_of_medians": statistics.median(fab_med[r] for r in range(opts.rounds))
        / statistics.median(raw_med[r] for r in range(opts.rounds)),
        "versions": versions(),
    }
    if fabric.global_rank == 0:
        name = "fabric_overhead" + ("_no_checks" if opts.no_checks else "")
        (RESULTS / f"{name}.json").write_text(json.dumps(result, indent=2) + "\n")
        print(json.dumps({k: v for k, v in result.items() if k != "versions"}, indent=1))


if __name__ == "__main__":
    main()
