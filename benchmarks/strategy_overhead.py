"""Benchmark 1: ``Trainer`` + ``TorchRecStrategy`` against a hand-written TorchRec loop.

Same DLRM, same batches, same starting weights (the raw model's are copied into the Lightning
model), table-wise plan, 2 gloo ranks on CPU. Blocks alternate raw, Lightning, raw, Lightning...
inside one run. Lightning runs with its defaults (progress bar, logger, ``self.log`` every step),
checkpointing off. Run: ``python -m benchmarks.strategy_overhead [--quick] [--profile]``.
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

from benchmarks.common import RESULTS, ModelSize, ratio_stats, stats, write_result
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
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse(argv)
    size = ModelSize.tiny() if args.quick else ModelSize()
    if args.batch_size:
        size.batch_size = args.batch_size
    if args.rows:
        size.rows = args.rows
    blocks = 4 if args.quick else args.blocks
    warmup = 1 if args.quick else args.warmup_blocks
    steps = blocks * args.block
    L.seed_everything(SEED, verbose=False)
    torch.set_num_threads(1)
    data = dataset(size, 2 * steps)
    profile = cProfile.Profile() if args.profile else None
    timer = Interleaver(
        VARIANTS,
        args.block,
        data,
        raw=lambda: RawLoop(size, data),
        profile=profile,
        configure=configure,
    )
    from lightning_torchrec import TorchRecStrategy

    root = tempfile.mkdtemp(prefix="bench_overhead_")
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(fused_params=FUSED, constraints=table_wise(size)),
        max_steps=steps,
        enable_checkpointing=False,
        default_root_dir=root,
        callbacks=[timer],
    )
    from torch.utils.data import DataLoader

    trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    if not trainer.is_global_zero:
        return None
    assert timer.raw is not None
    raw = per_block(timer.raw.times, warmup)
    variants: dict[str, Any] = {}
    for variant in VARIANTS:
        light = per_block(timer.times[variant], warmup)
        common = sorted(set(light) & set(raw))
        light_all = [t for b in common for t in light[b]]
        raw_all = [t for b in common for t in raw[b]]
        variants[variant] = {
            "lightning_step_s": stats(light_all),
            "raw_step_s": stats(raw_all),
            "step_time_ratio": ratio_stats(light_all, raw_all),
            "block_median_ratio": ratio_stats(
                [stats(light[b])["median"] for b in common],
                [stats(raw[b])["median"] for b in common],
            ),
        }
    n = min(len(timer.losses), len(timer.raw.losses))
    diffs = [abs(a - b) for a, b in zip(timer.losses[:n], timer.raw.losses[:n], strict=True)]
    result: dict[str, Any] = {
        "size": size.to_dict(),
        "world_size": 2,
        "plan": "table_wise",
        "steps_per_variant": steps,
        "block": args.block,
        "warmup_blocks": warmup,
        "weights_copied": timer.copied,
        "no_checks": NO_CHECKS,
        **variants["lightning"],
        "variants": variants,
        "loss_steps_compared": n,
        "loss_max_abs_diff": max(diffs) if diffs else None,
        "losses_identical": bool(diffs) and max(diffs) == 0.0,
        "first_losses": {"lightning": timer.losses[:3], "raw": timer.raw.losses[:3]},
        "goal": {"step_time_ratio": "<= 1.02", "loss_max_abs_diff": "== 0"},
    }
    if profile is not None:
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(150)
        (args.out / "strategy_overhead_profile.txt").parent.mkdir(parents=True, exist_ok=True)
        (args.out / "strategy_overhead_profile.txt").write_text(text.getvalue())
    write_result("strategy_overhead", result, args.out)
    return result


if __name__ == "__main__":
    main()
