"""Benchmark 4: ``log_ebc_norms`` time and memory against table size, at a fixed sample size.

One process, one plain table per size (dim 64). Memory is measured two ways: torch allocations made
while the call runs (a ``TorchDispatchMode`` tracking the storages that op outputs allocate: the
total and the peak of those alive at once), and the growth of the process's peak RSS (``VmHWM``,
reset before each call through ``/proc/self/clear_refs``). Sizes alternate (A B C A B C ...).
Run: ``python -m benchmarks.sampling_scale``.
"""

from __future__ import annotations

import argparse
import time
import weakref
from pathlib import Path
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.common import RESULTS, stats, write_result

KEY = "ebc.embedding_bags.t.weight"


class AllocationCounter(TorchDispatchMode):
    """Counts bytes of new storages returned by torch ops (views and in-place results excluded)."""

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.live = 0
        self.peak = 0
        self._refs: dict[int, list[int]] = {}  # storage pointer -> [bytes, tensors alive]

    def _release(self, ptr: int) -> None:
        entry = self._refs.get(ptr)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.live -= entry[0]
            del self._refs[ptr]

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        out = func(*args, **(kwargs or {}))
        aliased = any(r.alias_info is not None for r in func._schema.returns)
        if aliased:
            return out
        for t in tree_leaves(out):
            if not isinstance(t, torch.Tensor) or t.device.type == "meta":
                continue
            storage = t.untyped_storage()
            ptr, nbytes = storage.data_ptr(), storage.nbytes()
            if ptr in self._refs:
                self._refs[ptr][1] += 1
            else:
                self._refs[ptr] = [nbytes, 1]
                self.total += nbytes
                self.live += nbytes
                self.peak = max(self.peak, self.live)
            weakref.finalize(t, self._release, ptr)
        return out


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def rss_peak_growth(fn: Any) -> int | None:
    """Bytes the peak RSS grew while ``fn()`` ran, or None where the peak cannot be reset."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        return None
    before = _status_kib("VmRSS")
    fn()
    return max(0, _status_kib("VmHWM") - before) * 1024


def main(argv: list[str] | None = None) -> dict[str, Any]:
    from lightning_torchrec.training.ebc_norms import log_ebc_norms

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--sample-size", type=int, default=65_536)
    p.add_argument("--dim", type=int, default=64)
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    rows_list = [1_000, 10_000, 100_000] if args.quick else [100_000, 1_000_000, 10_000_000]
    sample = 256 if args.quick else args.sample_size
    rounds, warmup = (2, 1) if args.quick else (7, 2)
    tables = {}
    for rows in rows_list:
        tables[rows] = torch.empty(rows, args.dim).uniform_(-0.1, 0.1)

    def call(rows: int) -> dict[str, torch.Tensor]:
        return log_ebc_norms({KEY: tables[rows]}, [KEY], sample_size=sample)

    times: dict[int, list[float]] = {rows: [] for rows in rows_list}
    for r in range(warmup + rounds):
        for rows in rows_list:
            start = time.perf_counter()
            call(rows)
            if r >= warmup:
                times[rows].append(time.perf_counter() - start)
    per_size: dict[str, Any] = {}
    for rows in rows_list:
        counter = AllocationCounter()
        with counter:
            value = call(rows)
        per_size[str(rows)] = {
            "table_bytes": tables[rows].numel() * tables[rows].element_size(),
            "seconds": stats(times[rows]),
            "torch_alloc_total_bytes": counter.total,
            "torch_alloc_peak_bytes": counter.peak,
            "rss_peak_growth_bytes": rss_peak_growth(lambda r=rows: call(r)),
            "mean_norm": float(value[f"{KEY}-norm-mean"]),
        }
    small, large = str(rows_list[0]), str(rows_list[-1])
    result = {
        "dim": args.dim,
        "sample_size": sample,
        "sizes": per_size,
        "time_growth": per_size[large]["seconds"]["median"] / per_size[small]["seconds"]["median"],
        "alloc_peak_growth": per_size[large]["torch_alloc_peak_bytes"]
        / max(1, per_size[small]["torch_alloc_peak_bytes"]),
        "table_growth": rows_list[-1] / rows_list[0],
        "sample_bytes": sample * args.dim * 4,
        "goal": "time and memory bounded by the sample size, not the table",
    }
    write_result("sampling_scale", result, args.out)
    return result


if __name__ == "__main__":
    main()
