"""Benchmark 3: bytes of parameters read per second by ``weights_to_log`` vs a plain reduction.

One process. Models: the demo-size DLRM (8 tables x 200 rows x 16) and the benchmark DLRM
(8 x 100k x 64), each as a plain module and as a 1-rank ``DistributedModelParallel`` (the sharded
code path). Baselines over the same tensors: ``torch._foreach_norm`` and ``sum(t.sum())``.
Variants alternate (A B C A B C ...) after a warm-up. Run: ``python -m benchmarks.norm_throughput``.
"""

from __future__ import annotations

import argparse
import socket
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from benchmarks.common import RESULTS, ModelSize, stats, write_result

DEMO = ModelSize(tables=8, rows=200, dim=16, batch_size=512, ids_per_feature=2)


def build(size: ModelSize, device: str) -> nn.Module:
    """A DLRM with tables on ``device`` (``"cpu"`` or ``"meta"`` for sharding)."""
    from torchrec.models.dlrm import DLRM
    from torchrec.modules.embedding_modules import EmbeddingBagCollection

    from lightning_torchrec.models.dlrm import dlrm_tables

    ebc = EmbeddingBagCollection(
        tables=dlrm_tables([size.rows] * size.tables, size.dim, "mean", 0.1),
        device=torch.device(device),
    )
    return DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=size.dense,
        dense_arch_layer_sizes=[64, size.dim],
        over_arch_layer_sizes=[64, 1],
    )


def init_single_process_group() -> None:
    """A 1-rank gloo group, so the model can be wrapped in ``DistributedModelParallel``."""
    if dist.is_initialized():
        return
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)


def local_tensors(model: nn.Module) -> list[torch.Tensor]:
    """Every parameter tensor the process holds (the TBE weights of sharded tables included)."""
    return [p.detach() for p in model.parameters()]


def interleave(
    variants: dict[str, Callable[[], Any]], rounds: int, warmup: int, min_sample_s: float
) -> dict[str, list[float]]:
    """Seconds per call of each variant; rounds alternate the variants."""
    repeat = {}
    for name, fn in variants.items():  # calls per sample so a sample lasts >= min_sample_s
        start = time.perf_counter()
        fn()
        repeat[name] = max(1, int(min_sample_s / max(time.perf_counter() - start, 1e-7)))
    times: dict[str, list[float]] = {name: [] for name in variants}
    for r in range(warmup + rounds):
        for name, fn in variants.items():
            start = time.perf_counter()
            for _ in range(repeat[name]):
                fn()
            if r >= warmup:
                times[name].append((time.perf_counter() - start) / repeat[name])
    return times


def measure(
    model: nn.Module, tensors: list[torch.Tensor], rounds: int, warmup: int, min_sample_s: float
) -> dict[str, Any]:
    from lightning_torchrec.training.norms import weights_to_log

    nbytes = sum(t.numel() * t.element_size() for t in tensors)
    variants = {
        "weights_to_log": lambda: weights_to_log(model),
        "foreach_norm": lambda: torch._foreach_norm(tensors),
        "sum": lambda: sum(t.sum() for t in tensors),
    }
    times = interleave(variants, rounds, warmup, min_sample_s)
    out: dict[str, Any] = {"bytes": nbytes, "tensors": len(tensors), "keys": len(variants)}
    for name, ts in times.items():
        s = stats(ts)
        out[name] = {"seconds": s, "bytes_per_s": nbytes / s["median"]}
    w = out["weights_to_log"]["bytes_per_s"]
    out["ratio_vs_foreach_norm"] = w / out["foreach_norm"]["bytes_per_s"]
    out["ratio_vs_sum"] = w / out["sum"]["bytes_per_s"]
    out["ratio_vs_best_baseline"] = w / max(
        out["foreach_norm"]["bytes_per_s"], out["sum"]["bytes_per_s"]
    )
    out["num_keys_logged"] = len(weights_to_log(model))
    return out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    torch.manual_seed(0)
    rounds, warmup, min_s = (3, 1, 0.002) if args.quick else (15, 3, 0.05)
    sizes = {"demo": DEMO} if args.quick else {"demo": DEMO, "benchmark": ModelSize()}
    init_single_process_group()
    from lightning_torchrec.sharding.planning import maybe_shard_model

    results: dict[str, Any] = {}
    for label, size in sizes.items():
        plain = build(size, "cpu")
        results[f"{label}/plain"] = measure(plain, local_tensors(plain), rounds, warmup, min_s)
        sharded = maybe_shard_model(build(size, "meta"), torch.device("cpu"))
        results[f"{label}/dmp_1rank"] = measure(
            sharded, local_tensors(sharded), rounds, warmup, min_s
        )
        results[f"{label}/size"] = size.to_dict()
    result = {"results": results, "goal": {"ratio_vs_foreach_norm": ">= 0.5"}}
    write_result("norm_throughput", result, args.out)
    return result


if __name__ == "__main__":
    main()
