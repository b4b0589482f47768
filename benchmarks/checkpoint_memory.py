"""Rank-0 peak memory while saving (and loading) a sharded checkpoint, 2 gloo ranks.

Two tables, table-wise: ``small`` (rank 0, fixed size) and ``big`` (rank 1, grows). If a save or
load ever gathered a whole table on rank 0, rank 0's peak would grow with ``big``; with DCP each
rank only reads and writes its own shards, so it stays flat. Peak = ``VmHWM`` after resetting it
(``/proc/self/clear_refs``), minus ``VmRSS`` just before the call. Also records save/load time and
checkpoint size. Writes ``benchmarks/results/checkpoint_memory.json``.
Run: ``python -m benchmarks.checkpoint_memory [--rows 250000 2000000]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
DIM = 64
SMALL_ROWS = 10_000


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _measure(fn: Any) -> tuple[float, int]:
    """Seconds and peak RSS increase of ``fn()`` (between barriers)."""
    dist.barrier()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS
    base = _status("VmRSS")
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0, _status("VmHWM") - base


def _worker(rank: int, rows: int, path: str, port: int, out: dict) -> None:
    from torchrec.distributed.model_parallel import DistributedModelParallel
    from torchrec.distributed.sharding_plan import construct_module_sharding_plan, table_wise
    from torchrec.distributed.types import ShardingEnv, ShardingPlan
    from torchrec.modules.embedding_configs import EmbeddingBagConfig
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from lightning_torchrec.checkpoint import load_sharded, save_sharded

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    tables = [
        EmbeddingBagConfig(name=n, embedding_dim=DIM, num_embeddings=r, feature_names=[f"f_{n}"])
        for n, r in (("small", SMALL_ROWS), ("big", rows))
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    plan = ShardingPlan(
        {
            "": construct_module_sharding_plan(
                ebc,
                {"small": table_wise(rank=0), "big": table_wise(rank=1)},
                world_size=2,
                device_type="cpu",
            )
        }
    )
    dmp = DistributedModelParallel(
        ebc,
        env=ShardingEnv.from_process_group(dist.group.WORLD),
        device=torch.device("cpu"),
        plan=plan,
    )
    optim = [dmp.fused_optimizer]
    save_s, save_peak = _measure(lambda: save_sharded(path, dmp, optim, {"step": 0}))
    load_s, load_peak = _measure(lambda: load_sharded(path, dmp, optim))
    size = sum(f.stat().st_size for f in Path(path).iterdir())
    out[rank] = {
        "save_s": save_s,
        "save_peak_rss_increase_bytes": save_peak,
        "load_s": load_s,
        "load_peak_rss_increase_bytes": load_peak,
        "checkpoint_bytes": size,
    }
    dist.destroy_process_group()


def run(rows: int, port: int) -> dict[str, Any]:
    tmp = tempfile.mkdtemp()
    try:
        with mp.Manager() as manager:
            out = manager.dict()
            mp.spawn(_worker, args=(rows, f"{tmp}/ckpt", port, out), nprocs=2, join=True)
            ranks = dict(out)
    finally:
        shutil.rmtree(tmp)
    return {
        "big_rows": rows,
        "big_table_bytes": rows * DIM * 4,
        "small_table_bytes": SMALL_ROWS * DIM * 4,
        "rank0": ranks[0],
        "rank1": ranks[1],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[250_000, 2_000_000])
    args = parser.parse_args()
    results = [run(rows, 29_600 + i) for i, rows in enumerate(args.rows)]
    for r in results:
        mib = 2**20
        print(
            f"big table {r['big_table_bytes'] / mib:7.1f} MiB | rank 0 save peak "
            f"+{r['rank0']['save_peak_rss_increase_bytes'] / mib:6.1f} MiB, load peak "
            f"+{r['rank0']['load_peak_rss_increase_bytes'] / mib:6.1f} MiB | rank 1 save peak "
            f"+{r['rank1']['save_peak_rss_increase_bytes'] / mib:6.1f} MiB | save "
            f"{r['rank0']['save_s']:.2f} s, load {r['rank0']['load_s']:.2f} s"
        )
    RESULTS.mkdir(parents=True, exist_ok=True)
    dest = RESULTS / "checkpoint_memory.json"
    dest.write_text(json.dumps({"benchmark": "checkpoint_memory", "runs": results}, indent=2))
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
