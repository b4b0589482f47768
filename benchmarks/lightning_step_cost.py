"""What the Trainer adds to a step, piece by piece: each removed in turn, against the raw loop.

2 gloo ranks on CPU, the same DLRM, batches and optimizers. Variants, run in interleaved rounds
in the same processes, each round starting one variant later (A B C, B C A, C A B, ...):

* ``raw_base``: the hand-written TorchRec loop (``benchmarks.harness.RawLoop``);
* ``trainer_defaults``: Lightning's defaults (progress bar, logger, checkpointing) and the
  strategy's (batch checks, loss guard, ``pipeline="auto"``: ``"sparse_dist"`` on 2 CPU ranks);
* ``trainer_parity``: the strategy's defaults, Lightning's extras off;
* ``trainer_parity, vote before forward``: the same with ``vote_ahead=False`` (the step's vote
  waited for before each forward, instead of running during the step before); the ablations
  below name the pipeline the defaults resolve to, since ``"auto"`` depends on the vote;
* ``- checks``: ``validate_batches=False``, ``on_nonfinite_loss="ignore"`` (the strategy's
  per-step vote is then skipped);
* ``- vote``: also without the per-step vote, which the strategy keeps when its checks are off
  to carry Lightning's SIGTERM flag (it takes over Lightning's ``_broadcast_sigterm_tensor``:
  one ``broadcast`` and one ``.item()`` per step); patched out here only, to measure it
  (``vote_ahead=False`` and no flag to carry: no vote at all);
* ``- log``: also without the module's ``self.log("train/loss")`` (Lightning's result
  collection per logged value).

What remains after the last is Lightning's loop itself (hooks, closures, the optimizer wrapper)
and the pipeline's own work. ``raw_sparse_dist`` is TorchRec's sparse-dist loop written by hand,
the fastest synchronous raw loop on 2 CPU ranks. Ratios: step time / ``raw_base``'s.

Run: ``python -m benchmarks.lightning_step_cost [--size tiny|demo|benchmark|host_bound]
[--rounds 5]`` (``host_bound``: 8 tables x 2,000 rows x 64, batch 64, where the host's work
is most of a step); writes ``lightning_step_cost_SIZE.json``.
"""

from __future__ import annotations

import contextlib
import statistics
from collections.abc import Iterator
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.common import SYNC_RAW, paired_stats, stats, write_result
from benchmarks.harness import SEED, dataset, versions
from benchmarks.pipeline_throughput import (
    SIZES,
    Setup,
    parse_rounds,
    raw_run,
    rounds_parser,
    trainer_run,
)

NO_CHECKS = {"validate_batches": False, "on_nonfinite_loss": "ignore"}
VARIANTS = [
    "trainer_defaults",
    "trainer_parity",
    "trainer_parity, vote before forward",
    "trainer_parity - checks",
    "trainer_parity - checks - vote",
    "trainer_parity - checks - vote - log",
    "raw_base",
    "raw_sparse_dist",
]
#: The pipeline ``"auto"`` resolves to on 2 CPU ranks whose steps vote ahead.
RESOLVED = "sparse_dist"


@contextlib.contextmanager
def patched(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Sets ``obj.name`` to ``value`` within (for this benchmark's what-if variants only)."""
    missing = object()
    old = obj.__dict__.get(name, missing)
    setattr(obj, name, value)
    try:
        yield
    finally:
        if old is missing:
            delattr(obj, name)
        else:
            setattr(obj, name, old)


def run_variant(variant: str, size: Any, data: Any, steps: int, warmup: int) -> list[float]:
    """One run of ``variant``: its per-step host times."""
    from lightning_torchrec.lightning.module import TorchRecModule
    from lightning_torchrec.training.step_guard import StepGuard

    setup = Setup()
    if variant.startswith("raw_"):
        kind = "sparse_dist" if variant == "raw_sparse_dist" else False
        return raw_run(size, data, steps, kind, setup, warmup).times[warmup:]
    extra: dict[str, Any] = NO_CHECKS if "- checks" in variant else {}
    if "vote before forward" in variant or "- vote" in variant:
        extra = extra | {"vote_ahead": False}
    pipeline = "default" if variant in ("trainer_defaults", "trainer_parity") else RESOLVED
    with contextlib.ExitStack() as stack:
        if "- vote" in variant:  # never True, and assignments ignored: no flag, no vote
            never = property(lambda self: False, lambda self, value: None)
            stack.enter_context(patched(StepGuard, "carries_stop", never))
        if "- log" in variant:
            stack.enter_context(
                patched(TorchRecModule, "_log_train_loss", lambda self, *args: None)
            )
        run = trainer_run(
            size,
            data,
            steps,
            pipeline,
            setup,
            warmup,
            lightning_defaults=variant == "trainer_defaults",
            **extra,
        )
    return run.times[warmup:]


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    args = parse_rounds(rounds_parser(__doc__ or "", steps=60, rounds=5), argv)
    torch.set_num_threads(1)
    size = SIZES[args.size]()
    data = dataset(size, 2 * (args.steps + 4))
    rounds: dict[str, list[float]] = {v: [] for v in VARIANTS}
    steps: dict[str, list[float]] = {v: [] for v in VARIANTS}
    for r in range(args.rounds):
        # Each round starts at another variant: none always runs after the same one.
        for variant in VARIANTS[r % len(VARIANTS) :] + VARIANTS[: r % len(VARIANTS)]:
            L.seed_everything(SEED, verbose=False)
            times = run_variant(variant, size, data, args.steps, args.warmup)
            rounds[variant].append(statistics.median(times))
            steps[variant].extend(times)
    if dist.get_rank() != 0:
        return None
    base = statistics.median(rounds["raw_base"])
    result: dict[str, Any] = {
        "size": size.to_dict(),
        "world_size": 2,
        "rounds": args.rounds,
        "steps_per_run": args.steps,
        "warmup": args.warmup,
        "versions": versions(),
        "variants": {},
    }
    best_sync = min(SYNC_RAW, key=lambda k: statistics.median(rounds[k]))
    for variant in VARIANTS:
        per_round = stats(rounds[variant])
        result["variants"][variant] = {
            "round_median_step_s": per_round,
            "step_s": stats(steps[variant]),
            "ratio_to_raw_base": per_round["median"] / base,
            "extra_ms_per_step": 1e3 * (per_round["median"] - base),
            # Each round's step over the best synchronous raw loop's in the same round.
            "paired_ratio_to_best_synchronous_raw": paired_stats(
                rounds[variant], rounds[best_sync]
            ),
        }
        print(
            f"{variant:42s} {1e3 * per_round['median']:8.2f} ms (IQR {1e3 * per_round['iqr']:.2f})"
            f"  x{per_round['median'] / base:.3f}",
            flush=True,
        )
    path = write_result(f"lightning_step_cost_{args.size}", result, args.out)
    print(f"lightning_step_cost: wrote {path}")
    return result


if __name__ == "__main__":
    main()
