"""Benchmark: train pipelines, raw TorchRec loops against the Trainer, side by side in one run.

By default on 2 gloo ranks (CPU); ``--accelerator cuda --devices 1`` runs one nccl rank on one GPU.
The same DLRM, batches and optimizers, per variant: samples per second (all ranks together) and
the step time, at the demo size and at the benchmark size (8 tables of 100k x 64):

* ``raw_base``: a hand-written TorchRec loop (``benchmarks.harness.RawLoop``);
* ``raw_sparse_dist``: the same model and optimizer driven by TorchRec's
  ``TrainPipelineSparseDist.progress``;
* ``trainer_none`` / ``trainer_sparse_dist``: ``Trainer`` + ``TorchRecStrategy(pipeline=...)``
  at Lightning's parity settings (no progress bar, no logger, no checkpointing);
* when ``"semi_sync"`` is one of ``training.pipelines.PIPELINES``: ``raw_semi_sync``
  (TorchRec's ``TrainPipelineSemiSync``, ``start_batch=0``) and ``trainer_semi_sync``
  (``pipeline="semi_sync"``, ``start_batch`` 0); an error in either (TorchRec's semi-sync
  pipeline needs CUDA) is recorded in the result instead of stopping the benchmark.

Variants run one after the other, ``--rounds`` times (A B C D A B C D), in the same processes.
Timing (``--timing``): ``steps`` (the CPU default) times every step on the host and drops the
first ``--warmup`` steps of each run; ``window`` (the CUDA default: the host runs ahead of the
GPU, so per-step host times mean nothing) times steps ``warmup .. steps-1`` of each run by wall
clock with ``torch.cuda.synchronize()`` only at both ends, and reports samples/s =
samples x steps / elapsed. Ratios are step time / ``raw_base``'s. The result file is rewritten
after every run (``"complete": false`` until the end), so an interrupted run keeps what it measured.

Run: ``python -m benchmarks.pipeline_throughput``; on a GPU e.g. ``python -m
benchmarks.pipeline_throughput --accelerator cuda --devices 1 --batch-size 8192 --out DIR``.
"""

from __future__ import annotations

import argparse
import gc
import inspect
import statistics
import tempfile
import time
import traceback
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from benchmarks.common import (
    RESULTS,
    SYNC_RAW,
    CachedBatches,
    ModelSize,
    paired_stats,
    stats,
    write_result,
)
from benchmarks.harness import (
    FUSED,
    SEED,
    RawLoop,
    dataset,
    dlrm_module,
    pin_cached,
    rank_sampler,
    synchronize,
    table_wise,
    versions,
)

VARIANTS = [
    "trainer_defaults",
    "trainer_parity",
    "trainer_none",
    "trainer_sparse_dist",
    "raw_base",
    "raw_sparse_dist",
]
#: Trainer variants at the strategy's defaults (``pipeline="auto"``, checks on): with Lightning's
#: defaults (progress bar, logger, checkpointing, model summary), and at parity (all off).
DEFAULT_VARIANTS = {"trainer_defaults": True, "trainer_parity": False}
SEMI_SYNC_VARIANTS = ["trainer_semi_sync", "raw_semi_sync"]
NOCHECKS = "_nochecks"
#: ``host_bound``: small tables and batches (8 x 2,000 x 64, batch 64), where the host's Python
#: work is most of a step, so what the Trainer adds to it shows most.
SIZES = {
    "demo": ModelSize.demo,
    "benchmark": ModelSize,
    "host_bound": ModelSize.host_bound,
    "tiny": ModelSize.tiny,
}


def rounds_parser(
    doc: str, steps: int, rounds: int, quick: str = "tiny model, one short round"
) -> argparse.ArgumentParser:
    """The options of a benchmark of alternating rounds of whole runs (see :func:`parse_rounds`).

    ``--size``, ``--steps``, ``--warmup``, ``--rounds``, ``--out`` and ``--quick``; add more
    before parsing.
    """
    p = argparse.ArgumentParser(description=doc.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="benchmark")
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=rounds)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help=quick)
    return p


def parse_rounds(
    p: argparse.ArgumentParser, argv: list[str] | None, quick_rounds: int = 1
) -> argparse.Namespace:
    """Parses :func:`rounds_parser`'s options; ``--quick``: tiny model, 12 steps, 2 of warmup."""
    args = p.parse_args(argv)
    if args.quick:
        args.size, args.rounds, args.steps, args.warmup = "tiny", quick_rounds, 12, 2
    return args


@dataclass
class Setup:
    """Where and how the benchmark runs."""

    accelerator: str = "cpu"
    world: int = 2
    timing: str = "steps"  # "steps" or "window"

    def device(self) -> torch.device:
        """This rank's device (after the first Trainer fit has selected it)."""
        if self.accelerator == "cuda":
            return torch.device("cuda", torch.cuda.current_device())
        return torch.device("cpu")


@dataclass
class Run:
    """One run of one variant: host time of every step, and the timed window."""

    times: list[float] = field(default_factory=list)
    window_s: float = 0.0
    window_steps: int = 0


class StepTimes(Callback):
    """Host time between consecutive ``on_train_batch_start`` calls (one full Lightning step),
    and the window from the start of step ``warmup`` to ``on_train_end`` (synchronised on CUDA).
    """

    def __init__(self, data: CachedBatches, warmup: int = 0, profile: Any = None) -> None:
        self.data = data
        self.warmup = warmup
        self.profile = profile
        self.last: float | None = None
        self.times: list[float] = []
        self.window_start: float | None = None
        self.window_s = 0.0
        self.window_steps = 0
        self.device = torch.device("cpu")

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if not self.data.items:
            sampler = rank_sampler(self.data, trainer.global_rank, trainer.world_size)
            self.data.prepare(list(sampler))
        self.device = trainer.strategy.root_device
        if self.device.type == "cuda":
            pin_cached(self.data)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self.last is not None:
            self.times.append(now - self.last)
        self.last = now
        if batch_idx == self.warmup:
            synchronize(self.device)
            self.window_start = time.perf_counter()
            if self.profile is not None:
                self.profile.enable()

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.window_start is not None:
            synchronize(self.device)
            if self.profile is not None:
                self.profile.disable()
            self.window_s = time.perf_counter() - self.window_start
            self.window_steps = trainer.global_step - self.warmup


def strategy_kwargs(pipeline: str | None) -> dict[str, Any]:
    """``pipeline_options`` that start semi-sync at once (when the strategy takes them)."""
    from lightning_torchrec import TorchRecStrategy

    takes = "pipeline_options" in inspect.signature(TorchRecStrategy.__init__).parameters
    if pipeline == "semi_sync" and takes:
        return {"pipeline_options": {"start_batch": 0}}
    return {}


def trainer_run(
    size: ModelSize,
    data: CachedBatches,
    steps: int,
    pipeline: str | None,
    setup: Setup | None = None,
    warmup: int = 0,
    profile: Any = None,
    lightning_defaults: bool = False,
    callbacks: Sequence[Callback] = (),
    **strategy_extra: Any,
) -> Run:
    """One Trainer fit of ``steps`` steps; its step times and timed window.

    ``pipeline``: the strategy's, or ``"default"`` for its default (``"auto"``);
    ``lightning_defaults``: Lightning's own defaults (progress bar, logger, checkpointing, model
    summary) instead of parity settings (all off); ``profile``: a ``cProfile.Profile`` enabled
    over the timed window; ``callbacks``: more Trainer callbacks; ``strategy_extra`` goes to
    ``TorchRecStrategy``.
    """
    from lightning_torchrec import TorchRecStrategy

    setup = setup or Setup()
    timer = StepTimes(data, warmup, profile)
    chosen = {} if pipeline == "default" else {"pipeline": pipeline}
    parity = {
        "logger": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
        "enable_checkpointing": False,
    }
    trainer = L.Trainer(
        accelerator=setup.accelerator,
        devices=setup.world,
        strategy=TorchRecStrategy(
            fused_params=FUSED,
            constraints=table_wise(size),
            log_plan=False,
            **(chosen | strategy_kwargs(pipeline) | strategy_extra),
        ),
        max_steps=steps,
        num_sanity_val_steps=0,
        default_root_dir=tempfile.mkdtemp(prefix="bench_pipeline_"),
        callbacks=[timer, *callbacks],
        **({} if lightning_defaults else parity),
    )
    trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    return Run(timer.times, timer.window_s, timer.window_steps)


def raw_run(
    size: ModelSize,
    data: CachedBatches,
    steps: int,
    pipelined: bool | str,
    setup: Setup | None = None,
    warmup: int = 0,
    profile: Any = None,
) -> Run:
    """``steps`` steps of a raw TorchRec loop: plain, ``TrainPipelineSparseDist`` or semi-sync.

    ``pipelined``: False (plain), True or ``"sparse_dist"``, or ``"semi_sync"``.
    """
    setup = setup or Setup()
    if not data.items:
        data.prepare(list(rank_sampler(data, dist.get_rank(), dist.get_world_size())))
    device = setup.device()
    raw = RawLoop(size, data, device)
    kind = "sparse_dist" if pipelined is True else (pipelined or "base")
    pipeline: Any = None
    if kind == "sparse_dist":
        pipeline = TrainPipelineSparseDist(raw.model, raw.optimizer, device)
    elif kind == "semi_sync":
        # Not exported by the package torchrec.distributed.train_pipeline (1.6.1 through 1.9).
        from torchrec.distributed.train_pipeline.train_pipelines import TrainPipelineSemiSync

        from lightning_torchrec.compat.pipelines import StagedSemiSync

        # On CPU, TorchRec's own progress() fails on CUDA-stream calls: its subclass with the
        # CPU fixes runs the same progress() there.
        semi = StagedSemiSync if device.type == "cpu" else TrainPipelineSemiSync
        pipeline = semi(raw.model, raw.optimizer, device, start_batch=0)
    elif kind != "base":
        raise ValueError(f"unknown raw loop {pipelined!r}")

    def step() -> Any:
        return raw.step() if pipeline is None else pipeline.progress(raw.batches)

    run = Run()
    window_start = time.perf_counter()
    for i in range(steps):
        if i == warmup:
            synchronize(device)
            window_start = time.perf_counter()
            if profile is not None:
                profile.enable()
        start = time.perf_counter()
        step()
        run.times.append(time.perf_counter() - start)
    synchronize(device)
    if profile is not None:
        profile.disable()
    run.window_s = time.perf_counter() - window_start
    run.window_steps = steps - warmup
    return run


def variants_to_run(semi_sync: str) -> list[str]:
    """The variants; semi-sync ones when asked (``yes``) or the strategy has it (``auto``)."""
    from lightning_torchrec.training.pipelines import PIPELINES

    wanted = semi_sync == "yes" or (semi_sync == "auto" and "semi_sync" in PIPELINES)
    return VARIANTS + (SEMI_SYNC_VARIANTS if wanted else [])


def run_variant(
    variant: str, size: ModelSize, data: CachedBatches, steps: int, warmup: int, setup: Setup
) -> Run:
    """One run of ``variant`` (a Trainer one ending in ``_nochecks``: the strategy's per-step
    checks off, ``validate_batches=False`` and ``on_nonfinite_loss="ignore"``)."""
    extra: dict[str, Any] = {}
    if variant.endswith(NOCHECKS):
        variant = variant.removesuffix(NOCHECKS)
        extra = {"validate_batches": False, "on_nonfinite_loss": "ignore"}
    if variant in DEFAULT_VARIANTS:
        return trainer_run(
            size,
            data,
            steps,
            "default",
            setup,
            warmup,
            lightning_defaults=DEFAULT_VARIANTS[variant],
            **extra,
        )
    pipeline = variant.split("_", 1)[1]
    if variant.startswith("trainer"):
        return trainer_run(
            size, data, steps, None if pipeline == "none" else pipeline, setup, warmup, **extra
        )
    return raw_run(size, data, steps, False if pipeline == "base" else pipeline, setup, warmup)


def paired_ratios(runs: list[Run], against: list[Run], warmup: int) -> dict[str, float]:
    """Each round's median step over ``against``'s in the same round: median, quartiles."""
    return paired_stats(
        [statistics.median(r.times[warmup:]) for r in runs],
        [statistics.median(r.times[warmup:]) for r in against],
    )


def summarize(
    runs: dict[str, list[Run]],
    errors: dict[str, str],
    size: ModelSize,
    steps: int,
    warmup: int,
    rounds: int,
    setup: Setup,
    limit: dict[str, Any],
) -> dict[str, Any]:
    """The result of one size from the runs so far (``limit``: :func:`physical_limit`)."""
    samples = setup.world * size.batch_size
    out: dict[str, Any] = {
        "size": size.to_dict(),
        "steps_per_run": steps,
        "rounds": rounds,
        "physical_limit": limit,
    }
    if setup.timing == "window":
        out["timed_steps_per_run"] = steps - warmup
    per_variant: dict[str, dict[str, Any]] = {}
    for variant, done in runs.items():
        if not done:
            continue
        if setup.timing == "steps":
            s = stats([t for r in done for t in r.times[warmup:]])
            per_round = stats([statistics.median(r.times[warmup:]) for r in done])
            per_variant[variant] = {
                "step_s": s,
                "round_median_step_s": per_round,
                "samples_per_s": samples / per_round["median"],
            }
        else:
            rates = [samples * r.window_steps / r.window_s for r in done]
            per_variant[variant] = {
                "step_s": stats([r.window_s / r.window_steps for r in done]),
                "samples_per_s": statistics.median(rates),
                "samples_per_s_runs": rates,
                "window_s": [r.window_s for r in done],
                "host_step_s": stats([t for r in done for t in r.times[warmup:]]),
            }
    base = per_variant.get("raw_base")
    raws = [v for k, v in per_variant.items() if k.startswith("raw_")]
    key = "round_median_step_s" if setup.timing == "steps" else "step_s"
    best = min((v[key]["median"] for v in raws), default=None)
    # The loops the Trainer's defaults are bit-equal to (semi-sync reads tables one update late).
    synchronous = [k for k in SYNC_RAW if k in per_variant]
    sync_name = min(synchronous, key=lambda k: per_variant[k][key]["median"], default=None)
    best_sync = None if sync_name is None else per_variant[sync_name][key]["median"]
    if best is not None:
        out["best_raw_step_s"] = best
    if best_sync is not None:
        out["best_synchronous_raw_step_s"] = best_sync
    for variant, v in per_variant.items():
        if best_sync is not None:
            v["ratio_to_best_synchronous_raw"] = v[key]["median"] / best_sync
        if sync_name is not None and setup.timing == "steps":
            v["paired_ratio_to_best_synchronous_raw"] = paired_ratios(
                runs[variant], runs[sync_name], warmup
            )
        if best is not None:
            v["ratio_to_best_raw"] = v[key]["median"] / best
            v["memory_bandwidth_fraction"] = limit["bytes_per_step"] / (
                v[key]["median"] * limit["bytes_per_s"]
            )
        if base is not None:
            if setup.timing == "steps":
                v["ratio_to_raw_base"] = (
                    v["round_median_step_s"]["median"] / base["round_median_step_s"]["median"]
                )
            else:
                v["ratio_to_raw_base"] = base["samples_per_s"] / v["samples_per_s"]
                v["samples_per_s_ratio_to_raw_base"] = v["samples_per_s"] / base["samples_per_s"]
        out[variant] = v
    for variant, error in errors.items():
        out[variant] = {"error": error}
    return out


#: Bytes of one embedding row's traffic per id and step, in units of the row's size: read in the
#: forward, read again and written back by the fused row-wise Adagrad update in the backward.
ROW_PASSES = 3


def memory_bandwidth(device: torch.device, mib: int = 256) -> float:
    """Measured copy bandwidth of ``device`` in bytes/s (read + write of a ``mib`` MiB buffer).

    On the CPU this runs on the benchmark's one intra-op thread per rank, as the training does.
    """
    src = torch.ones(mib * 2**20 // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(5):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() * 4 / best


def physical_limit(size: ModelSize, setup: Setup) -> dict[str, Any]:
    """Bytes of embedding rows one rank moves per step, and the device's memory bandwidth.

    Each id of the batch reads and writes its row (``ROW_PASSES`` x ``dim`` x 4 bytes, fp32,
    plus the row-wise Adagrad state of one float); a rank handles its share of the world's ids.
    The step time this traffic alone needs is ``bytes_per_step / bytes_per_s``: the floor no loop
    beats; ``memory_bandwidth_fraction`` of a variant is that floor over its step time.
    """
    ids = size.batch_size * size.tables * size.ids_per_feature  # the world's ids / world
    row = size.dim * 4
    per_step = ids * (ROW_PASSES * row + 2 * 4)
    bandwidth = memory_bandwidth(setup.device())
    return {
        "ids_per_rank_step": ids,
        "bytes_per_step": per_step,
        "bytes_per_s": bandwidth,
        "floor_step_s": per_step / bandwidth,
    }


def measure(
    size: ModelSize,
    steps: int,
    warmup: int,
    rounds: int,
    setup: Setup | None = None,
    variants: list[str] | None = None,
    report: Any = None,
) -> dict[str, Any]:
    """Every variant, ``rounds`` times in turn, on one size.

    ``report(partial)`` is called with the size's result after every run. Errors of the
    semi-sync variants are recorded (the variant is then skipped); others propagate.
    """
    setup = setup or Setup()
    variants = variants or VARIANTS
    data = dataset(size, setup.world * (steps + 4))
    runs: dict[str, list[Run]] = {v: [] for v in variants}
    errors: dict[str, str] = {}
    limit: dict[str, Any] = {}
    for _ in range(rounds):
        for variant in variants:
            if variant in errors:
                continue
            L.seed_everything(SEED, verbose=False)
            try:
                runs[variant].append(run_variant(variant, size, data, steps, warmup, setup))
                limit = limit or physical_limit(size, setup)  # after the first run's setup
            except Exception as e:
                if variant not in SEMI_SYNC_VARIANTS:
                    raise
                errors[variant] = f"{type(e).__name__}: {e}"[:2000]
                print(f"{variant} failed: {errors[variant]}\n{traceback.format_exc()}")
            if setup.accelerator == "cuda":
                gc.collect()
                torch.cuda.empty_cache()
            if report is not None:
                report(summarize(runs, errors, size, steps, warmup, rounds, setup, limit))
    return summarize(runs, errors, size, steps, warmup, rounds, setup, limit)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--name", default=None, help="result file name (default: by accelerator)")
    p.add_argument("--devices", type=int, default=2, help="ranks (one per device on CUDA)")
    p.add_argument(
        "--sizes",
        default=None,
        help="comma list of demo,benchmark,host_bound,tiny (default: demo,benchmark)",
    )
    p.add_argument(
        "--batch-size",
        default=None,
        help="batch size per rank: one value for every size, or a comma list (one per size)",
    )
    p.add_argument(
        "--timing",
        choices=["auto", "steps", "window"],
        default="auto",
        help="auto: window on CUDA, steps on CPU",
    )
    p.add_argument(
        "--semi-sync",
        choices=["auto", "yes", "no"],
        default="auto",
        help="semi-sync variants: auto = when training.pipelines.PIPELINES has it",
    )
    p.add_argument(
        "--variants",
        default=None,
        help="comma list of variants to run instead of all (a trainer_* one may end in "
        f"{NOCHECKS}: the strategy's per-step checks off)",
    )
    return p.parse_args(argv)


def sizes_of(args: argparse.Namespace) -> dict[str, ModelSize]:
    """The sizes to measure (``--sizes``, ``--quick``), with ``--batch-size`` applied."""
    names = (
        args.sizes.split(",") if args.sizes else (["tiny"] if args.quick else ["demo", "benchmark"])
    )
    unknown = [n for n in names if n not in SIZES]
    if unknown:
        raise SystemExit(f"unknown sizes {unknown}; choose from {sorted(SIZES)}")
    sizes = {n: SIZES[n]() for n in names}
    if args.batch_size:
        batches = [int(b) for b in str(args.batch_size).split(",")]
        if len(batches) not in (1, len(sizes)):
            raise SystemExit(f"--batch-size: give 1 or {len(sizes)} values, got {batches}")
        for size, batch in zip(sizes.values(), batches * len(sizes), strict=False):
            size.batch_size = batch
    return sizes


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    if args.accelerator == "cuda" and not torch.cuda.is_available():
        raise SystemExit("--accelerator cuda: no CUDA device is visible")
    timing = (
        args.timing
        if args.timing != "auto"
        else ("window" if args.accelerator == "cuda" else "steps")
    )
    setup = Setup(args.accelerator, args.devices, timing)
    if args.accelerator == "cpu":
        torch.set_num_threads(1)
    sizes = sizes_of(args)
    steps, warmup = (8, 2) if args.quick else (args.steps, args.warmup)
    rounds = 1 if args.quick else args.rounds
    if not 0 <= warmup < steps:
        raise SystemExit(f"--warmup must be in [0, --steps), got {warmup} and {steps}")
    variants = variants_to_run(args.semi_sync)
    if args.variants:
        chosen = args.variants.split(",")
        known = set(variants) | {v + NOCHECKS for v in variants if v.startswith("trainer")}
        if not set(chosen) <= known or not chosen[0].startswith("trainer"):
            raise SystemExit(
                f"--variants: choose from {sorted(known)}, a trainer_* one first (it opens the "
                f"process group); got {chosen}"
            )
        variants = chosen
    if args.name:
        name = args.name
    elif args.accelerator == "cuda":
        name = "pipeline_throughput_cuda"
    elif setup.world == 2:
        name = "pipeline_throughput"
    else:
        name = f"pipeline_throughput_cpu{setup.world}"
    result: dict[str, Any] = {
        "world_size": setup.world,
        "accelerator": setup.accelerator,
        "plan": "table_wise",
        "timing": timing,
        "variants": variants,
        "versions": versions(),
        "complete": False,
        "sizes": {},
    }

    def write(size_name: str, partial: dict[str, Any]) -> None:
        result["sizes"][size_name] = partial
        if dist.is_available() and dist.is_initialized() and dist.get_rank() == 0:
            write_result(name, result, args.out)

    for size_name, size in sizes.items():
        print(f"pipeline_throughput: size {size_name} {size.to_dict()}", flush=True)
        result["sizes"][size_name] = measure(
            size,
            steps,
            warmup,
            rounds,
            setup,
            variants,
            report=lambda partial, n=size_name: write(n, partial),
        )
    if dist.get_rank() != 0:
        return None
    result["complete"] = True
    path = write_result(name, result, args.out)
    print(f"pipeline_throughput: wrote {path}")
    for size_name, sized in result["sizes"].items():
        for variant in variants:
            v = sized.get(variant, {})
            shown = (
                f"{v['samples_per_s']:.0f} samples/s, ratio {v.get('ratio_to_raw_base', 0):.3f}"
                if "samples_per_s" in v
                else v.get("error", "not run")[:200]
            )
            print(f"  {size_name:9s} {variant:20s} {shown}")
    return result


if __name__ == "__main__":
    main()
