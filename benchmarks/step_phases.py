"""Where a step's host time goes, phase by phase: the Trainer against TorchRec's sparse-dist loop.

2 gloo ranks on CPU (or one GPU with ``--accelerator cuda``), the benchmark DLRM. Timestamps
are taken at the boundaries both loops share (TorchRec's ``progress()`` and its input
all-to-all, the sharded model's forward, ``Tensor.backward``, the dense optimizer's ``step``)
and at the Trainer's hooks; the host time between two consecutive marks is one phase. Each
phase's median over the timed steps, per variant, median over rounds (the variants alternate,
each round starting at another one). What the Trainer adds shows as phases the raw loop does
not have, or as longer shared ones. On CUDA the host runs ahead of the GPU: a phase there is
host work (or a wait for the GPU), which is what decides a short GPU step.

Run: ``python -m benchmarks.step_phases [--rounds 3] [--steps 60] [--size benchmark]``.
"""

from __future__ import annotations

import contextlib
import itertools
import statistics
import time
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from benchmarks.common import stats, write_result
from benchmarks.harness import SEED, dataset, versions
from benchmarks.pipeline_throughput import (
    SIZES,
    Setup,
    parse_rounds,
    raw_run,
    rounds_parser,
    trainer_run,
)

#: A Trainer first: its fit opens the process group the raw loop then uses.
VARIANTS = ["trainer_parity", "trainer_defaults", "raw_sparse_dist"]
#: Marks at the start (``<``) and end (``>``) of these calls, whoever makes them.
CALLS = [
    (TrainPipelineSparseDist, "progress", "progress"),
    (TrainPipelineSparseDist, "start_sparse_data_dist", "input dist start"),
    (TrainPipelineSparseDist, "enqueue_batch", "next batch copy"),
    (TrainPipelineSparseDist, "wait_sparse_data_dist", "input dist wait"),
    (DistributedModelParallel, "forward", "forward"),
    (torch.Tensor, "backward", "backward"),
    (torch.optim.Adam, "step", "dense optimizer"),
]
#: The Trainer's hooks marked (Lightning calls them once per training step).
HOOKS = [
    "on_train_batch_start",
    "on_before_zero_grad",
    "on_before_backward",
    "on_after_backward",
    "on_before_optimizer_step",
    "on_train_batch_end",
]


class Marks(Callback):
    """Timestamps, taken while enabled (the timed steps of a run); a Lightning callback too."""

    def __init__(self) -> None:
        self.on = False
        self.marks: list[tuple[str, float]] = []
        for hook in HOOKS:
            setattr(self, hook, self._hook(hook))

    def _hook(self, name: str) -> Any:
        def mark(*args: Any, **kwargs: Any) -> None:
            self.add(name)

        return mark

    def add(self, name: str) -> None:
        """Marks ``name`` now (when enabled)."""
        if self.on:
            self.marks.append((name, time.perf_counter()))

    def enable(self) -> None:
        """Starts marking (``raw_run``/``trainer_run`` call it at the first timed step)."""
        self.on = True

    def disable(self) -> None:
        """Stops marking."""
        self.on = False

    def phases(self) -> dict[str, float]:
        """Each phase's (``"from -> to"``) median host time in seconds over the marked steps.

        Phases seen in fewer than half of the steps (the first and last of a run) are dropped.
        """
        found: dict[str, list[float]] = {}
        for (a, ta), (b, tb) in itertools.pairwise(self.marks):
            found.setdefault(f"{a} -> {b}", []).append(tb - ta)
        steps = max((len(v) for v in found.values()), default=0)
        return {k: statistics.median(v) for k, v in found.items() if 2 * len(v) >= steps}


@contextlib.contextmanager
def marking(marks: Marks) -> Iterator[None]:
    """Marks the start and end of every call in :data:`CALLS` within (this benchmark only)."""
    saved = [(owner, name, owner.__dict__[name]) for owner, name, _ in CALLS]

    def wrapped(fn: Any, tag: str) -> Any:
        def call(*args: Any, **kwargs: Any) -> Any:
            marks.add(f"{tag} <")
            try:
                return fn(*args, **kwargs)
            finally:
                marks.add(f"{tag} >")

        return call

    for owner, name, tag in CALLS:
        setattr(owner, name, wrapped(owner.__dict__[name], tag))
    try:
        yield
    finally:
        for owner, name, fn in saved:
            setattr(owner, name, fn)


def run_variant(variant: str, size: Any, data: Any, steps: int, warmup: int, setup: Setup) -> Any:
    """One run of ``variant``; its phases (s) and its median step (s)."""
    marks = Marks()
    L.seed_everything(SEED, verbose=False)
    with marking(marks):
        if variant == "raw_sparse_dist":
            run = raw_run(size, data, steps, "sparse_dist", setup, warmup, profile=marks)
        else:
            defaults = variant == "trainer_defaults"
            run = trainer_run(
                size,
                data,
                steps,
                "default",
                setup,
                warmup,
                marks,
                lightning_defaults=defaults,
                callbacks=[marks],
            )
    return marks.phases(), statistics.median(run.times[warmup:] or run.times)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = rounds_parser(__doc__ or "", steps=60, rounds=3)
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    args = parse_rounds(p, argv)
    torch.set_num_threads(1)
    cuda = args.accelerator == "cuda"
    setup = Setup(accelerator=args.accelerator, world=1 if cuda else 2)
    size = SIZES[args.size]()
    data = dataset(size, setup.world * (args.steps + 4))
    phases: dict[str, dict[str, list[float]]] = {v: {} for v in VARIANTS}
    step: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            found, median = run_variant(variant, size, data, args.steps, args.warmup, setup)
            step[variant].append(median)
            for name, seconds in found.items():
                phases[variant].setdefault(name, []).append(seconds)
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    result: dict[str, Any] = {
        "size": size.to_dict(),
        "accelerator": args.accelerator,
        "world_size": setup.world,
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "warmup": args.warmup,
        "versions": versions(),
        "variants": {
            v: {
                "step_s": stats(step[v]),
                "phases_s": {k: statistics.median(x) for k, x in phases[v].items()},
            }
            for v in VARIANTS
        },
    }
    path = write_result(f"step_phases_{args.accelerator}", result, args.out)
    print(f"step_phases: wrote {path}")
    return result


if __name__ == "__main__":
    main()
