"""Benchmark 12: children forked right after a gloo collective, and how many never start.

On CPython before 3.12 a child forked while a gloo thread makes itself a Python thread state (to
release a finished collective's tensors) deadlocks before it runs any Python
(:mod:`lightning_torchrec.compat.worker_fork`). Each of 2 gloo ranks runs, in alternating
blocks, ``all_gather_object`` followed at once by the start of a process through
multiprocessing's fork context (as a ``DataLoader`` starts a worker), or through
:class:`~lightning_torchrec.compat.worker_fork.QuietForkContext`, and counts the children not
finished within ``--limit`` seconds (they are then killed) and those that failed. Nothing here
is timed; the rate of hung children is the result.
Run: ``python -m benchmarks.fork_race [--quick] [--forks N]``.
"""

from __future__ import annotations

import argparse
import os
import signal
import tempfile
from multiprocessing.context import ForkContext
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import RESULTS, write_result
from lightning_torchrec.compat.worker_fork import AFFECTED, QUIET_S, QuietForkContext

#: The ways a child is started: multiprocessing's fork context, and the package's.
MODES = {"fork": ForkContext, "quiet_fork": QuietForkContext}


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="a few forks (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--forks", type=int, default=5000, help="forks per mode and rank")
    p.add_argument("--block", type=int, default=250, help="forks per block of one mode")
    p.add_argument("--limit", type=float, default=5.0, help="seconds before a child counts hung")
    return p.parse_args(argv)


def _rank(rank: int, args: argparse.Namespace, init: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    counts = {mode: {"forks": 0, "hung": 0, "failed": 0} for mode in MODES}
    contexts = {mode: cls() for mode, cls in MODES.items()}
    done = 0
    while done < args.forks:
        for mode, context in contexts.items():
            block = min(args.block, args.forks - done)
            for i in range(block):
                gathered: list[Any] = [None, None]
                dist.all_gather_object(gathered, i)
                child = context.Process(target=os._exit, args=(0,))  # exits at once
                child.start()
                child.join(args.limit)
                if child.exitcode is None:  # never got to run its target
                    counts[mode]["hung"] += 1
                    os.kill(child.pid, signal.SIGKILL)
                    child.join()
                elif child.exitcode != 0:
                    counts[mode]["failed"] += 1
                counts[mode]["forks"] += 1
        done += block
    torch.save(counts, Path(out) / f"rank{rank}.pt")
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse(argv)
    if args.quick:
        args.forks, args.block = 20, 10
    with tempfile.TemporaryDirectory(prefix="fork_race_") as tmp:
        init = f"file://{tmp}/store"
        mp.start_processes(_rank, args=(args, init, tmp), nprocs=2, start_method="spawn")
        ranks = [torch.load(Path(tmp) / f"rank{r}.pt", weights_only=True) for r in range(2)]
    modes = {}
    for mode in MODES:
        forks = sum(r[mode]["forks"] for r in ranks)
        hung = sum(r[mode]["hung"] for r in ranks)
        failed = sum(r[mode]["failed"] for r in ranks)
        rate = hung / forks if forks else None
        modes[mode] = {"forks": forks, "hung": hung, "failed": failed, "hung_rate": rate}
    result = {
        "affected_interpreter": AFFECTED,
        "quiet_s": QUIET_S,
        "forks_per_mode_and_rank": args.forks,
        "block": args.block,
        "limit_s": args.limit,
        "modes": modes,
        "goal": {"quiet_fork": "no hung child"},
    }
    write_result("fork_race", result, args.out)
    return result


if __name__ == "__main__":
    main()
