"""The step's vote ahead (the default) against the vote before each forward, in ABBA rounds.

2 gloo ranks on CPU, the benchmark DLRM, the Trainer at parity settings (the strategy's defaults,
Lightning's extras off), both through the pipeline ``"auto"`` resolves to with the vote ahead
(``sparse_dist`` on 2 CPU ranks). Variant A: ``vote_ahead=True`` (the vote on step ``t + 1``
starts after step ``t``'s forward and is decided after its update); B: ``vote_ahead=False``
(the vote waited for before each forward). Rounds alternate the order (A B, B A, ...), so
neither variant always runs after the other; the figure is the median over rounds of A's minus
B's median step, with the number of rounds in which A was faster.

Run: ``python -m benchmarks.vote_ahead [--rounds 10] [--size benchmark]``.
"""

from __future__ import annotations

import statistics
from typing import Any

import lightning as L
import torch
import torch.distributed as dist

from benchmarks.common import stats, write_result
from benchmarks.harness import SEED, dataset, versions
from benchmarks.lightning_step_cost import RESOLVED, run_variant
from benchmarks.pipeline_throughput import SIZES, parse_rounds, rounds_parser

AHEAD, BEFORE = "trainer_parity", "trainer_parity, vote before forward"


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Runs the rounds; rank 0 writes ``vote_ahead.json`` and returns it."""
    p = rounds_parser(__doc__ or "", 50, 10, quick="tiny model, one round of each order")
    args = parse_rounds(p, argv, quick_rounds=2)
    torch.set_num_threads(1)
    size = SIZES[args.size]()
    data = dataset(size, 2 * (args.steps + 4))
    rounds: dict[str, list[float]] = {AHEAD: [], BEFORE: []}
    for r in range(args.rounds):
        for variant in (AHEAD, BEFORE) if r % 2 == 0 else (BEFORE, AHEAD):
            L.seed_everything(SEED, verbose=False)
            times = run_variant(variant, size, data, args.steps, args.warmup)
            rounds[variant].append(statistics.median(times))
    if dist.get_rank() != 0:
        return None
    diffs = [a - b for a, b in zip(rounds[AHEAD], rounds[BEFORE], strict=True)]
    result: dict[str, Any] = {
        "size": size.to_dict(),
        "world_size": 2,
        "rounds": args.rounds,
        "pipeline": RESOLVED,
        "steps_per_run": args.steps,
        "warmup": args.warmup,
        "versions": versions(),
        "vote_ahead": stats(rounds[AHEAD]),
        "vote_before_forward": stats(rounds[BEFORE]),
        "round_medians_s": {"vote_ahead": rounds[AHEAD], "vote_before_forward": rounds[BEFORE]},
        "ahead_minus_before_s": stats(diffs),
        "rounds_ahead_faster": sum(d < 0 for d in diffs),
    }
    name = "vote_ahead" if args.size == "benchmark" else f"vote_ahead_{args.size}"
    path = write_result(name, result, args.out)
    print(
        f"vote ahead {1e3 * result['vote_ahead']['median']:.2f} ms, before the forward "
        f"{1e3 * result['vote_before_forward']['median']:.2f} ms per step; ahead minus before "
        f"{1e3 * result['ahead_minus_before_s']['median']:+.2f} ms (median of {args.rounds} "
        f"rounds), ahead faster in {result['rounds_ahead_faster']}; wrote {path}"
    )
    return result


if __name__ == "__main__":
    main()
