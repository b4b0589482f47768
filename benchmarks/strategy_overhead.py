"""Benchmark 1: ``Trainer`` + ``TorchRecStrategy`` against hand-written TorchRec loops, in blocks.

Same DLRM, same batches, same starting weights (the plain raw loop's are copied into the
sparse-dist raw loop and the Lightning model), table-wise plan, 2 gloo ranks on CPU. Inside one
run, every block of Lightning steps follows a block of each raw loop (the plain loop and
TorchRec's sparse-dist pipeline, in alternating order), so all three see the same spell of a
shared machine: each Lightning block is paired with the raw blocks just before it. The Lightning
blocks alternate the strategy's defaults and its per-step checks off. Two fits: Lightning's
defaults (progress bar, logger, model summary; checkpointing off) and parity (all off); both at
the strategy's defaults (``pipeline="auto"``). The first step of every block is dropped.
Run: ``python -m benchmarks.strategy_overhead [--quick] [--profile] [--fits defaults,parity]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import (
    RESULTS,
    ModelSize,
    block_bootstrap_ratio,
    ratio_stats,
    stats,
    write_result,
)
from benchmarks.harness import (
    FUSED,
    SEED,
    Interleaver,
    RawLoop,
    dataset,
    dlrm_module,
    per_block,
    table_wise,
)

#: Per-step safety checks of the strategy, switched off in the ``no_checks`` variant (each is one
#: collective per step): batch validation and the non-finite loss check.
NO_CHECKS = {"validate_batches": False, "on_nonfinite_loss": "ignore"}
VARIANTS = ["lightning", "lightning_no_checks"]


def configure(trainer: L.Trainer, variant: str) -> None:
    """Sets the strategy's per-step checks for ``variant`` (defaults, or all off)."""
    strategy = trainer.strategy
    defaults = strategy.__dict__.setdefault("_bench_defaults", {})
    for name, off in NO_CHECKS.items():
        if hasattr(strategy, name):
            defaults.setdefault(name, getattr(strategy, name))
            setattr(strategy, name, off if variant.endswith("no_checks") else defaults[name])


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--blocks", type=int, default=100)
    p.add_argument("--block", type=int, default=5, help="steps per block")
    p.add_argument("--warmup-blocks", type=int, default=2)
    p.add_argument("--batch-size", type=int, default=None)
    p.add_argument("--rows", type=int, default=None)
    p.add_argument("--profile", action="store_true", help="cProfile the Lightning steps")
    p.add_argument("--fits", default="defaults,parity", help="comma list of defaults,parity")
    return p.parse_args(argv)


#: The raw loops each Lightning block is paired with (both synchronous: bit-equal training).
RAWS = ("raw_base", "raw_sparse_dist")
#: Lightning's extras, off in the ``parity`` fit.
PARITY = {
    "logger": False,
    "enable_progress_bar": False,
    "enable_model_summary": False,
    "enable_checkpointing": False,
}


def fit(args: argparse.Namespace, size: ModelSize, lightning: str) -> dict[str, Any] | None:
    """One interleaved fit (``lightning``: ``"defaults"`` or ``"parity"``); rank 0's result."""
    blocks = 4 if args.quick else args.blocks
    warmup = 1 if args.quick else args.warmup_blocks
    steps = blocks * args.block
    L.seed_everything(SEED, verbose=False)
    data = dataset(size, 2 * steps)
    profile = cProfile.Profile() if args.profile else None
    timer = Interleaver(
        VARIANTS,
        args.block,
        data,
        raw=lambda: [RawLoop(size, data), RawLoop(size, data, pipelined=True)],
        profile=profile,
        configure=configure,
    )
    from lightning_torchrec import TorchRecStrategy

    extras = PARITY if lightning == "parity" else {"enable_checkpointing": False}
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(fused_params=FUSED, constraints=table_wise(size)),
        max_steps=steps,
        default_root_dir=tempfile.mkdtemp(prefix="bench_overhead_"),
        callbacks=[timer],
        **extras,
    )
    from torch.utils.data import DataLoader

    trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    if not trainer.is_global_zero:
        return None
    loops = dict(zip(RAWS, timer.raws, strict=True))
    raws = {name: per_block(loop.times, warmup) for name, loop in loops.items()}
    best = min(RAWS, key=lambda k: stats([t for ts in raws[k].values() for t in ts])["median"])
    variants: dict[str, Any] = {}
    for variant in VARIANTS:
        light = per_block(timer.times[variant], warmup)
        against: dict[str, Any] = {}
        for name, raw in raws.items():
            common = sorted(set(light) & set(raw))
            light_all = [t for b in common for t in light[b]]
            raw_all = [t for b in common for t in raw[b]]
            against[name] = {
                "lightning_step_s": stats(light_all),
                "raw_step_s": stats(raw_all),
                "step_time_ratio": ratio_stats(light_all, raw_all),
                "step_time_ratio_95": block_bootstrap_ratio([(light[b], raw[b]) for b in common]),
                "block_median_ratio": ratio_stats(
                    [stats(light[b])["median"] for b in common],
                    [stats(raw[b])["median"] for b in common],
                ),
            }
        variants[variant] = {**against[best], "against": against}
    losses = {"lightning": timer.losses, **{n: loop.losses for n, loop in loops.items()}}
    n = min(len(v) for v in losses.values())
    diffs = [
        abs(a - b) for name in RAWS for a, b in zip(timer.losses[:n], losses[name][:n], strict=True)
    ]
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(150)
        (args.out / f"strategy_overhead_profile_{lightning}.txt").parent.mkdir(
            parents=True, exist_ok=True
        )
        (args.out / f"strategy_overhead_profile_{lightning}.txt").write_text(text.getvalue())
    return {
        "steps_per_variant": steps,
        "warmup_blocks": warmup,
        "weights_copied": timer.copied,
        "best_raw": best,
        "variants": variants,
        "loss_steps_compared": n,
        "loss_max_abs_diff": max(diffs) if diffs else None,
        "losses_identical": bool(diffs) and max(diffs) == 0.0,
        "first_losses": {k: v[:3] for k, v in losses.items()},
    }


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    size = ModelSize.tiny() if args.quick else ModelSize()
    if args.batch_size:
        size.batch_size = args.batch_size
    if args.rows:
        size.rows = args.rows
    torch.set_num_threads(1)
    fits = {name: fit(args, size, name) for name in args.fits.split(",")}
    if any(v is None for v in fits.values()):
        return None
    result: dict[str, Any] = {
        "size": size.to_dict(),
        "world_size": 2,
        "plan": "table_wise",
        "block": args.block,
        "no_checks": NO_CHECKS,
        "fits": fits,
        "goal": {
            "defaults": "<= 1.03 x the best raw loop",
            "parity": "<= 1.02 x the best raw loop",
            "loss_max_abs_diff": "== 0",
        },
    }
    write_result("strategy_overhead", result, args.out)
    return result


if __name__ == "__main__":
    main()
