"""Benchmark 6 (on paper): how TorchRec's planner would shard a 100x larger model on many GPUs.

The benchmark DLRM (8 tables x 100k rows x 64) with 100x the rows (8 x 10M x 64, fp32), planned
by ``EmbeddingShardingPlanner`` for ``Topology(world_size=N, compute_device="cuda",
local_world_size=8)`` with the strategy's default sharders (fused row-wise Adagrad). No GPU is
needed: only the planner's own estimates are used. Reports the sharding types chosen and, per
rank, the table bytes and the planner's HBM estimate (tables, optimizer state, I/O buffers).
Run: ``python -m benchmarks.planner_scale``.
"""

from __future__ import annotations

import argparse
import time
from collections import Counter
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import RESULTS, ModelSize, stats, write_result
from benchmarks.norm_throughput import build


def plan_for(size: ModelSize, world_size: int) -> dict[str, Any]:
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology

    from lightning_torchrec.sharding.plan_summary import summarize_plan
    from lightning_torchrec.sharding.planning import default_sharders

    model = build(size, "meta")
    planner = EmbeddingShardingPlanner(
        topology=Topology(world_size=world_size, compute_device="cuda", local_world_size=8)
    )
    start = time.perf_counter()
    plan = planner.plan(model, default_sharders(None))
    seconds = time.perf_counter() - start
    summary = summarize_plan(model, plan, world_size)
    table_bytes = summary.bytes_per_rank
    hbm = [0] * world_size
    for option in getattr(planner, "_best_plan", None) or []:  # the planner's estimates
        for shard in option.shards:
            if shard.rank is not None and shard.storage is not None:
                hbm[shard.rank] += shard.storage.hbm
    holding = [b for b in table_bytes if b > 0]
    return {
        "world_size": world_size,
        "planning_s": seconds,
        "sharding_types": dict(Counter(t.sharding_type for t in summary.tables)),
        "kernels": dict(Counter(t.compute_kernel for t in summary.tables)),
        "ranks_per_table": stats([len(t.ranks) for t in summary.tables]),
        "ranks_holding_tables": len(holding),
        "table_bytes_per_rank": {"max": max(table_bytes), "min": min(table_bytes)},
        "table_bytes_per_holding_rank": stats(holding),
        "planner_hbm_per_rank": {"max": max(hbm), "min": min(hbm)} if any(hbm) else None,
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--scale", type=int, default=100, help="row multiplier of the model")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    base = ModelSize()
    size = ModelSize(tables=base.tables, rows=base.rows * args.scale, dim=base.dim)
    worlds = [8, 16] if args.quick else [8, 64, 512]
    plans = [plan_for(size, n) for n in worlds]
    result = {
        "size": size.to_dict(),
        "total_table_bytes": size.tables * size.rows * size.dim * 4,
        "plans": plans,
    }
    write_result("planner_scale", result, args.out)
    return result


if __name__ == "__main__":
    main()
