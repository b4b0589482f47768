"""Where a step's host time goes: raw TorchRec loops and the Trainer, under cProfile.

One process (one rank; CUDA with nccl when there is a GPU, else gloo on CPU), the benchmark DLRM
at ``--batch-size``. Each variant runs ``--steps`` steps; the window after ``--warmup`` steps is
timed (synchronised at both ends) and profiled. Variants: ``raw_base``, ``raw_sparse_dist``,
``trainer_defaults`` (Lightning's and the strategy's defaults), ``trainer_parity`` (the
strategy's defaults, Lightning's extras off), ``trainer_none`` and ``trainer_sparse_dist``
(the last two also with the strategy's per-step checks off: ``validate_batches=False``,
``on_nonfinite_loss="ignore"``: ``..._nochecks``).
Writes ``step_profile.json`` (ms per step) and ``step_profile.txt`` (the top functions).

Run: ``python -m benchmarks.step_profile --out DIR [--accelerator cuda]``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
from pathlib import Path
from typing import Any

import lightning as L
import torch

from benchmarks.common import RESULTS, ModelSize, write_result
from benchmarks.harness import SEED, dataset, versions
from benchmarks.pipeline_throughput import Setup, raw_run, trainer_run

NOCHECKS = {"validate_batches": False, "on_nonfinite_loss": "ignore"}
VARIANTS: dict[str, tuple[str, Any, dict[str, Any]]] = {
    "trainer_defaults": ("trainer", "default", {"lightning_defaults": True}),
    "trainer_parity": ("trainer", "default", {}),
    "trainer_none": ("trainer", None, {}),
    "trainer_none_nochecks": ("trainer", None, NOCHECKS),
    "raw_base": ("raw", False, {}),
    "trainer_sparse_dist": ("trainer", "sparse_dist", {}),
    "trainer_sparse_dist_nochecks": ("trainer", "sparse_dist", NOCHECKS),
    "raw_sparse_dist": ("raw", "sparse_dist", {}),
}


def top(profile: cProfile.Profile, sort: str, n: int | str) -> str:
    """The ``n`` top entries of a profile by ``sort`` (or those whose path matches ``n``)."""
    out = io.StringIO()
    pstats.Stats(profile, stream=out).sort_stats(sort).print_stats(n)
    return out.getvalue()


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default="step_profile", help="result file name (without .json)")
    p.add_argument("--accelerator", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--batch-size", type=int, default=16384)
    p.add_argument("--steps", type=int, default=80)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--only", action="append", choices=sorted(VARIANTS))
    args = p.parse_args(argv)
    size = ModelSize(batch_size=args.batch_size)
    setup = Setup(accelerator=args.accelerator, world=1, timing="window")
    data = dataset(size, args.steps + 4)
    result: dict[str, Any] = {"size": size.to_dict(), "versions": versions(), "variants": {}}
    text: list[str] = []
    # In the table's order whatever ``--only`` says: a raw loop runs in the process group the
    # first Trainer fit starts.
    for name in [n for n in VARIANTS if not args.only or n in args.only]:
        kind, pipeline, extra = VARIANTS[name]
        L.seed_everything(SEED, verbose=False)
        profile = cProfile.Profile()
        if kind == "trainer":
            run = trainer_run(
                size, data, args.steps, pipeline, setup, args.warmup, profile, **extra
            )
        else:
            run = raw_run(size, data, args.steps, pipeline, setup, args.warmup, profile)
        ms = 1e3 * run.window_s / max(run.window_steps, 1)
        result["variants"][name] = {"ms_per_step": ms, "steps": run.window_steps}
        print(f"{name:30s} {ms:8.2f} ms/step", flush=True)
        text += [f"===== {name}: {ms:.2f} ms/step (profiled window, cProfile on)", ""]
        text += [top(profile, "tottime", args.top), top(profile, "cumulative", args.top)]
        if kind == "trainer":  # the strategy's and the module's own share
            text.append(top(profile, "cumulative", "lightning_torchrec"))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / f"{args.name}.txt").write_text("\n".join(text))
    write_result(args.name, result, args.out)
    return result


if __name__ == "__main__":
    main()
