"""Benchmark: instructions per training step, the Trainer against raw TorchRec loops (cachegrind).

Step times on a shared 2-core machine move by several percent from one hour to the next (see
``docs/benchmarks.md``), more than the goals leave. The instructions a step executes do not: each
variant runs twice on 2 gloo ranks under ``valgrind --tool=cachegrind --cache-sim=no``, once for
``--short`` steps and once for ``--long`` steps, on the same cached batches, and the difference in
executed instructions divided by the difference in steps is that variant's instructions per step
(the set-up, planning, data and teardown cancel out). What this leaves out is time that is not
instructions: cache misses (the embedding rows' reads are the same in every variant) and waits
(the cores' share of a shared host, gloo's sockets). Valgrind also shows the program a CPU
without AVX-512, so vectorised kernels run their AVX2 paths and SIMD-heavy work weighs more in
the counts than on the host: the batch check, 0.70M instructions a step under valgrind, takes
64 us natively (19 us of it the pass over the ids).

Variants (the ``benchmarks.pipeline_throughput`` ones, same DLRM, data, plan and optimizers):

* ``raw_base``, ``raw_sparse_dist``: the hand-written TorchRec loops;
* ``trainer_parity``: ``Trainer`` + ``TorchRecStrategy`` at the strategy's defaults
  (``pipeline="auto"``: ``"sparse_dist"`` on 2 CPU ranks), Lightning's extras off;
* ``trainer_parity_nochecks``: the same without the strategy's per-step checks.

Lightning's own defaults (progress bar, logger) are left out: the bar refreshes by wall time, which
runs 20-50 times slower under valgrind, so its instruction count would not be the one of a real
run. Run: ``python -m benchmarks.step_instructions [--size tiny|demo|benchmark]``.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, ModelSize, write_result

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = ("raw_base", "raw_sparse_dist", "trainer_parity", "trainer_parity_nochecks")
SIZES = {"tiny": ModelSize.tiny, "demo": ModelSize.demo, "benchmark": ModelSize}
_REFS = re.compile(r"==(\d+)== I\s+refs:\s+([\d,]+)")


def worker(variant: str, steps: int, batches: int, size_name: str) -> None:
    """One rank's run of ``variant`` for ``steps`` steps (under valgrind; see ``measure``)."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from benchmarks.harness import SEED, dataset
    from benchmarks.pipeline_throughput import Setup, raw_run, trainer_run

    torch.set_num_threads(1)
    L.seed_everything(SEED, verbose=False)  # Lightning's sampler: the raw loops' order
    size = SIZES[size_name]()
    data = dataset(size, batches)
    if variant.startswith("raw_"):
        dist.init_process_group("gloo")
        kind = "sparse_dist" if variant == "raw_sparse_dist" else False
        raw_run(size, data, steps, kind, Setup())
        dist.destroy_process_group()
        return
    extra: dict[str, Any] = {}
    if variant.endswith("_nochecks"):
        extra = {"validate_batches": False, "on_nonfinite_loss": "ignore"}
    trainer_run(size, data, steps, "default", Setup(), **extra)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def measure(variant: str, steps: int, batches: int, size_name: str, world: int = 2) -> list[int]:
    """Instructions each rank executed in a run of ``variant`` of ``steps`` steps."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PL_", "TORCHELASTIC"))
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
        }
        # The ranks are started here, as torchrun starts them (Lightning sees LOCAL_RANK and
        # launches nothing): each runs under its own valgrind.
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONHASHSEED="0",
            PYTHONPATH=str(ROOT),
        )
        command = [
            "valgrind",
            "--tool=cachegrind",
            "--cache-sim=no",
            "--cachegrind-out-file=/dev/null",
            sys.executable,
            "-m",
            "benchmarks.step_instructions",
            "--worker",
            variant,
            "--steps",
            str(steps),
            "--batches",
            str(batches),
            "--size",
            size_name,
        ]
        procs.append(
            subprocess.Popen(
                command,
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    counts = []
    for rank, proc in enumerate(procs):
        _, err = proc.communicate(timeout=7200)
        found = _REFS.findall(err)
        if proc.returncode != 0 or not found:
            raise RuntimeError(f"{variant} rank {rank} exited {proc.returncode}:\n{err[-4000:]}")
        counts.append(int(found[-1][1].replace(",", "")))
    return counts


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--size", choices=sorted(SIZES), default="benchmark")
    p.add_argument("--short", type=int, default=10, help="steps of the short run")
    p.add_argument("--long", type=int, default=30, help="steps of the long run")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    p.add_argument("--steps", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--batches", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        worker(args.worker, args.steps, args.batches, args.size)
        return None
    if shutil.which("valgrind") is None:
        raise SystemExit("valgrind is not installed (Debian: apt-get install valgrind)")
    if not 0 < args.short < args.long:
        raise SystemExit("--short must be positive and below --long")
    batches = 2 * args.long + 4  # the same cached data in both runs: its making cancels out
    result: dict[str, Any] = {
        "size": SIZES[args.size]().to_dict(),
        "size_name": args.size,
        "world_size": 2,
        "steps": [args.short, args.long],
        "variants": {},
    }
    for variant in args.variants.split(","):
        started = time.perf_counter()
        short = measure(variant, args.short, batches, args.size)
        long = measure(variant, args.long, batches, args.size)
        per_step = [(b - a) / (args.long - args.short) for a, b in zip(short, long, strict=True)]
        result["variants"][variant] = {
            "instructions_short": short,
            "instructions_long": long,
            "per_step_by_rank": per_step,
            "per_step": sum(per_step) / len(per_step),
            "seconds": time.perf_counter() - started,
        }
        print(f"step_instructions: {variant}: {sum(per_step) / len(per_step) / 1e6:.2f}M per step")
        write_result(f"step_instructions_{args.size}", result, args.out)
    variants = result["variants"]
    raws = [v for v in variants if v.startswith("raw_")]
    if not raws:  # trainer variants alone: no ratio to give
        return result
    best = min(raws, key=lambda v: variants[v]["per_step"])
    for v in variants.values():
        v["ratio_to_best_raw"] = v["per_step"] / variants[best]["per_step"]
    result["best_raw"] = best
    write_result(f"step_instructions_{args.size}", result, args.out)
    return result


if __name__ == "__main__":
    main()
