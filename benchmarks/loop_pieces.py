"""Benchmark: Lightning's per-step pieces alone, Lightning's own against the strategy's.

The pieces of Lightning's training loop the strategy and ``TorchRecModule`` replace for a fit
(see ``docs/benchmarks.md``, "What only Lightning can change"), each timed alone on one core in
this process, on the code paths a fit runs:

* ``training_step kwargs``: ``_TrainingEpochLoop._build_kwargs`` reads ``training_step``'s
  signature at every batch; the strategy's ``StepKwargs`` reads it once per function;
* ``closure result + backward``: ``ClosureResult.from_training_step_output`` divides the loss by
  ``accumulate_grad_batches`` (1), then the backward runs through that division; the strategy's
  ``UndividedClosureResult`` takes the loss as it is (timed with the backward of a small graph);
* ``profiler context``: each hook call runs in ``PassThroughProfiler.profile``; the strategy gives
  the default profiler ``contextlib.nullcontext``;
* ``hook name set``: Lightning sets ``_current_fx_name`` on the module through
  ``nn.Module.__setattr__`` twice per hook call; ``TorchRecModule`` takes a short path.

Interleaved: every round times each variant of each piece once (``--number`` calls, best-case
free of the host's other work only by the median over ``--rounds``). "per step": how often a
training step at Lightning's defaults runs the piece. Run: ``python -m benchmarks.loop_pieces``.
"""

from __future__ import annotations

import argparse
import contextlib
import time
import types
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loops.optimization.automatic import ClosureResult
from lightning.pytorch.loops.training_epoch_loop import _TrainingEpochLoop
from lightning.pytorch.profilers import PassThroughProfiler

from benchmarks.common import RESULTS, stats, write_result
from benchmarks.harness import versions

#: Calls per training step at Lightning's defaults (hook calls of one step; see the docs).
PER_STEP = {
    "training_step kwargs": 1,
    "closure result + backward": 1,
    "profiler context": 41,
    "hook name set": 44,
}


class _Plain(L.LightningModule):
    def training_step(self, batch: Any, batch_idx: int) -> Any:
        return batch


def _pieces() -> dict[str, dict[str, Callable[[], Any]]]:
    from lightning_torchrec import DLRMClickModule
    from lightning_torchrec.compat.lightning_step import StepKwargs, UndividedClosureResult

    module = DLRMClickModule([200, 200], embedding_dim=4, dense_arch_layer_sizes=[4])
    loop = types.SimpleNamespace(trainer=types.SimpleNamespace(lightning_module=module))
    ours = StepKwargs(loop)
    weight = torch.randn(64, requires_grad=True)

    def closure(kind: Any) -> Callable[[], Any]:
        def run() -> None:
            result = kind.from_training_step_output((weight * 2).sum(), 1)
            result.closure_loss.backward()

        return run

    profiler = PassThroughProfiler()
    plain = _Plain()

    def context(make: Callable[[str], Any]) -> Callable[[], Any]:
        def run() -> None:
            with make("[LightningModule]TorchRecModule.training_step"):
                pass

        return run

    return {
        "training_step kwargs": {
            "lightning": lambda: _TrainingEpochLoop._build_kwargs(loop, OrderedDict(), 1, 2),  # type: ignore[arg-type]
            "strategy": lambda: ours(OrderedDict(), 1, 2),
        },
        "closure result + backward": {
            "lightning": closure(ClosureResult),
            "strategy": closure(UndividedClosureResult),
        },
        "profiler context": {
            "lightning": context(profiler.profile),
            "strategy": context(contextlib.nullcontext),
        },
        "hook name set": {
            "lightning": lambda: setattr(plain, "_current_fx_name", "training_step"),
            "strategy": lambda: setattr(module, "_current_fx_name", "training_step"),
        },
    }


def main(argv: list[str] | None = None) -> dict[str, Any]:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rounds", type=int, default=15)
    p.add_argument("--number", type=int, default=2000, help="calls per timing")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--quick", action="store_true", help="3 rounds of 200 calls (smoke test)")
    args = p.parse_args(argv)
    if args.quick:
        args.rounds, args.number = 3, 200
    torch.set_num_threads(1)
    pieces = _pieces()
    times: dict[str, dict[str, list[float]]] = {n: {v: [] for v in fs} for n, fs in pieces.items()}
    for fs in pieces.values():  # warm up
        for f in fs.values():
            for _ in range(50):
                f()
    for _ in range(args.rounds):
        for name, fs in pieces.items():
            for variant, f in fs.items():
                start = time.perf_counter()
                for _ in range(args.number):
                    f()
                times[name][variant].append((time.perf_counter() - start) / args.number)
    result: dict[str, Any] = {"versions": versions(), "rounds": args.rounds, "pieces": {}}
    for name, by_variant in times.items():
        entry = {v: stats(t) for v, t in by_variant.items()}
        saved = entry["lightning"]["median"] - entry["strategy"]["median"]
        result["pieces"][name] = {
            **entry,
            "per_step": PER_STEP[name],
            "saved_per_step_s": saved * PER_STEP[name],
        }
        print(
            f"loop_pieces: {name}: {1e6 * entry['lightning']['median']:.2f} us -> "
            f"{1e6 * entry['strategy']['median']:.2f} us, x{PER_STEP[name]} a step"
        )
    write_result("loop_pieces", result, args.out)
    return result


if __name__ == "__main__":
    main()
