"""Benchmark 2: step-time cost of ``WeightNormCallback`` and ``EmbeddingNormCallback``.

One 2-rank Lightning run of the benchmark DLRM (defaults: progress bar, TensorBoard logger,
``log_every_n_steps=50``). Variants take turns block by block (none, weight every step, embedding
every step, weight at the default cadence, embedding at the default cadence, ...): each callback
sits behind a switch that forwards its batch hooks only during its blocks. Blocks of 7 steps make
the default-cadence logging steps (every 50th) fall in every variant's blocks in turn.

Reported: every-step ratio = median step with the callback / median step without; default
cadence = ``1 + extra / (50 * median step without)``: the amortised cost of one logging event
every 50 steps, with ``extra`` = median every-step step - median step without (many samples),
and, directly, median logging step - median quiet step of the default-cadence variant (few
samples); plus the plain ratio of means.
Run: ``python -m benchmarks.callback_cost [--quick]``.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from benchmarks.common import RESULTS, ModelSize, stats, write_result
from benchmarks.harness import FUSED, SEED, Interleaver, dataset, dlrm_module, table_wise

VARIANTS = ["none", "weight_every", "embedding_every", "weight_default", "embedding_default"]
BATCH_HOOKS = ("on_train_batch_start", "on_train_batch_end")


class Switched(Callback):
    """Forwards every hook to ``inner``; batch hooks only while ``timer.current == variant``."""

    def __init__(self, inner: Callback, variant: str, timer: Interleaver) -> None:
        self.inner, self.variant, self.timer = inner, variant, timer

    @property
    def state_key(self) -> str:
        return f"Switched[{self.variant}]"

    def __getattribute__(self, name: str) -> Any:
        if name.startswith(("on_", "setup", "teardown")) and name != "on_load_checkpoint":
            inner = object.__getattribute__(self, "inner")
            if name in BATCH_HOOKS:
                timer = object.__getattribute__(self, "timer")
                if timer.current != object.__getattribute__(self, "variant"):
                    return lambda *args, **kwargs: None
            return getattr(inner, name)
        return object.__getattribute__(self, name)


def callbacks_for(timer: Interleaver) -> list[Callback]:
    from lightning_torchrec.lightning import EmbeddingNormCallback, WeightNormCallback

    inner = {
        "weight_every": WeightNormCallback(every_n_steps=1),
        "embedding_every": EmbeddingNormCallback(every_n_steps=1),
        "weight_default": WeightNormCallback(),
        "embedding_default": EmbeddingNormCallback(),
    }
    return [Switched(cb, name, timer) for name, cb in inner.items()]


def summarize(timer: Interleaver, warmup_steps: int, log_every: int) -> dict[str, Any]:
    steps: dict[str, list[tuple[int, float]]] = {v: [] for v in VARIANTS}
    for variant, batch_idx, seconds in timer.records:
        if batch_idx >= warmup_steps:
            steps[variant].append((batch_idx, seconds))
    base = stats([t for _, t in steps["none"]])
    out: dict[str, Any] = {"none_step_s": base}
    for variant in VARIANTS[1:]:
        times = [t for _, t in steps[variant]]
        s = stats(times)
        entry: dict[str, Any] = {
            "step_s": s,
            "ratio_of_medians": s["median"] / base["median"],
            "ratio_of_means": s["mean"] / base["mean"],
            "ratio_of_q1": s["q1"] / base["q1"],
        }
        if variant.endswith("_default"):
            every = stats([t for _, t in steps[variant.replace("_default", "_every")]])
            # Every step of the every-step variant logs: its extra median time is one event.
            entry["derived_extra_per_logging_step_s"] = every["median"] - base["median"]
            entry["derived_amortised_ratio"] = 1 + entry["derived_extra_per_logging_step_s"] / (
                log_every * base["median"]
            )
            logging = [t for i, t in steps[variant] if (i + 1) % log_every == 0]
            quiet = [t for i, t in steps[variant] if (i + 1) % log_every != 0]
            entry["logging_steps"] = len(logging)
            if logging and quiet:
                extra = stats(logging)["median"] - stats(quiet)["median"]
                entry["extra_per_logging_step_s"] = extra
                entry["amortised_ratio"] = 1 + extra / (log_every * base["median"])
        out[variant] = entry
    return out


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--demo", action="store_true", help="the demo's model (8 x 200 x 16)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--cycles", type=int, default=28, help="rounds of all variants")
    p.add_argument("--block", type=int, default=7)
    args = p.parse_args(argv)
    size = ModelSize.tiny() if args.quick else ModelSize.demo() if args.demo else ModelSize()
    cycles = 1 if args.quick else args.cycles
    warmup_steps = args.block * len(VARIANTS)  # one full cycle
    steps = warmup_steps + cycles * args.block * len(VARIANTS)
    L.seed_everything(SEED, verbose=False)
    torch.set_num_threads(1)
    data = dataset(size, 2 * steps)
    timer = Interleaver(VARIANTS, args.block, data)
    from lightning_torchrec import TorchRecStrategy

    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy=TorchRecStrategy(fused_params=FUSED, constraints=table_wise(size)),
        max_steps=steps,
        enable_checkpointing=False,
        default_root_dir=tempfile.mkdtemp(prefix="bench_callbacks_"),
        callbacks=[timer, *callbacks_for(timer)],
    )
    trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    if not trainer.is_global_zero:
        return None
    result = {
        "size": size.to_dict(),
        "world_size": 2,
        "steps": steps,
        "block": args.block,
        "warmup_steps": warmup_steps,
        "log_every_n_steps": trainer.log_every_n_steps,
        "variants": summarize(timer, warmup_steps, trainer.log_every_n_steps),
        "goal": {"every_step": "<= 1.05", "default_cadence": "<= 1.01"},
    }
    write_result("callback_cost_demo" if args.demo else "callback_cost", result, args.out)
    return result


if __name__ == "__main__":
    main()
