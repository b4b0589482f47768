"""Shared helpers: robust statistics, result files, the benchmark model and cached batches."""

from __future__ import annotations

import json
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import Dataset

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parent.parent


def stats(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles, IQR, mean, min and count of ``values``."""
    vals = sorted(float(v) for v in values)
    if not vals:
        return {"n": 0}
    q = statistics.quantiles(vals, n=4, method="inclusive") if len(vals) > 1 else [vals[0]] * 3
    return {
        "n": len(vals),
        "median": q[1],
        "q1": q[0],
        "q3": q[2],
        "iqr": q[2] - q[0],
        "mean": statistics.fmean(vals),
        "min": vals[0],
    }


def paired_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """:func:`stats` of ``num[i] / den[i]`` (pairs by position, up to the shorter list's end).

    Each pair ran back to back (a round, a block), so a machine that slows down for a while
    slows both: the paired ratio is steadier than the ratio of the overall medians.
    """
    return stats([a / b for a, b in zip(num, den, strict=False) if b > 0])


def ratio_stats(num: Sequence[float], den: Sequence[float]) -> dict[str, float]:
    """Ratio of medians plus the spread of paired (block-wise) ratios."""
    sn, sd = stats(num), stats(den)
    out = {
        "ratio_of_medians": sn["median"] / sd["median"],
        "ratio_of_q1": sn["q1"] / sd["q1"],  # less sensitive to other load on the machine
    }
    s = paired_stats(num, den)
    if s["n"]:
        out.update({"paired_median": s["median"], "paired_q1": s["q1"], "paired_q3": s["q3"]})
    return out


def block_bootstrap_ratio(
    blocks: Sequence[tuple[Sequence[float], Sequence[float]]],
    rounds: int = 2000,
    seed: int = 0,
) -> dict[str, float]:
    """95% interval of the ratio of medians, resampling whole paired blocks with replacement.

    Steps of one block share a spell of the machine, so blocks (not steps) are the independent
    units: each round draws as many ``(numerator steps, denominator steps)`` blocks as there are,
    pools their steps, and takes the ratio of the two medians. The 2.5th and 97.5th percentiles
    of the rounds bound the ratio the run measured; a goal inside them is not resolved by the run.

    Args:
        blocks: per block, its numerator (e.g. Lightning) and denominator (raw) step times.
        rounds: resamples.
        seed: of the resampling, so a result file can be recomputed.

    Returns:
        ``{"lo": ..., "hi": ..., "rounds": ...}``; empty without at least two blocks.
    """
    pairs = [(list(a), list(b)) for a, b in blocks if a and b]
    if len(pairs) < 2:
        return {}
    rng = random.Random(seed)
    ratios = []
    for _ in range(rounds):
        drawn = [pairs[rng.randrange(len(pairs))] for _ in pairs]
        num = statistics.median(t for a, _ in drawn for t in a)
        den = statistics.median(t for _, b in drawn for t in b)
        ratios.append(num / den)
    q = statistics.quantiles(ratios, n=40, method="inclusive")  # 2.5% steps
    return {"lo": q[0], "hi": q[-1], "rounds": rounds}


def machine() -> dict[str, Any]:
    """What the numbers were measured on."""
    return {
        "python": sys.version.split()[0],
        "torch": torch.__version__,
        "platform": platform.platform(),
        "cpus": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


def write_result(name: str, result: dict[str, Any], out_dir: Path | None = None) -> Path:
    """Writes ``{out_dir}/{name}.json`` (with machine info) and returns its path."""
    out_dir = out_dir or RESULTS
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps({"benchmark": name, "machine": machine(), **result}, indent=2))
    return path


def run_module(module: str, *args: str, timeout: float = 900) -> None:
    """Runs ``python -m module args`` in a clean environment (Lightning relaunches it per rank)."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PL_", "MASTER_", "LOCAL_", "TORCHELASTIC"))
        and k not in ("RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    }
    env.setdefault("OMP_NUM_THREADS", "1")
    env["PYTHONUNBUFFERED"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", module, *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{module} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )


@dataclass
class ModelSize:
    """The benchmark DLRM and its data (defaults: the issue's model)."""

    tables: int = 8
    rows: int = 100_000
    dim: int = 64
    dense: int = 13
    ids_per_feature: int = 20
    batch_size: int = 1024

    def to_dict(self) -> dict[str, int]:
        """Plain dict for the JSON result."""
        return asdict(self)

    @classmethod
    def demo(cls) -> ModelSize:
        """The model and data of ``make demo``."""
        return cls(tables=8, rows=200, dim=16, ids_per_feature=2, batch_size=512)

    @classmethod
    def host_bound(cls) -> ModelSize:
        """Small tables, small batches (8 x 2,000 x 64, batch 64): the host's work leads a step."""
        return cls(tables=8, rows=2_000, dim=64, batch_size=64)

    @classmethod
    def tiny(cls) -> ModelSize:
        """Sizes for smoke tests."""
        return cls(tables=4, rows=200, dim=8, ids_per_feature=2, batch_size=32)


#: The raw loops that train synchronously, as the Trainer does at its defaults (semi-sync reads
#: the tables one update late).
SYNC_RAW = ("raw_base", "raw_sparse_dist")


class CachedBatches(Dataset):
    """Batches generated once (``prepare(indices)``), so step timings exclude making data.

    Args:
        source: a map-style dataset of whole batches.
    """

    def __init__(self, source: Dataset) -> None:
        self.source = source
        self.length = len(source)  # type: ignore[arg-type]
        self.items: dict[int, Any] = {}

    def prepare(self, keep: Sequence[int]) -> None:
        """Materialises the batches ``keep`` (e.g. the ones this rank's sampler reads)."""
        self.items = {i: self.source[i] for i in keep}

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, index: int) -> Any:
        if index not in self.items:
            raise IndexError(f"batch {index} was not cached on this rank")
        return self.items[index]


def fmt_ratio(value: float, goal: str, interval: dict[str, float] | None = None) -> str:
    """``1.013 (goal <= 1.02: met)`` style text.

    With a 95% ``interval`` (:func:`block_bootstrap_ratio`) it is shown, and a goal inside it
    is said to be within the run's noise.
    """
    op, bound = goal.split()
    ok = value <= float(bound) if op == "<=" else value >= float(bound)
    text = f"{value:.3f} (goal {goal}: {'met' if ok else 'NOT met'}"
    if interval:
        lo, hi = interval["lo"], interval["hi"]
        inside = lo <= float(bound) <= hi
        text += f"; 95% interval [{lo:.3f}, {hi:.3f}]" + (", goal inside it" if inside else "")
    return text + ")"
