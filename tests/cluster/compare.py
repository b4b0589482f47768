"""Checks a preempted-and-requeued SLURM run against an uninterrupted one (bit-equal).

``python -m tests.cluster.compare FULL_DIR PREEMPTED_DIR`` (directories written by
:mod:`tests.cluster.slurm_fit`). Exit status 0 and one summary line when the requeued run resumed
from Lightning's ``hpc_ckpt_*.ckpt`` and every loss after the resume, every weight shard and every
optimizer state equals the uninterrupted run's; otherwise the first differences, status 1.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import torch


def _load(run: Path, attempt: int, rank: int) -> dict[str, Any]:
    return torch.load(run / f"attempt{attempt}_rank{rank}.pt", weights_only=False)


def _diff(a: Any, b: Any, where: str) -> list[str]:
    if isinstance(a, dict) and isinstance(b, dict):
        if a.keys() != b.keys():
            return [f"{where}: keys {sorted(a.keys() ^ b.keys())[:5]} differ"]
        return [d for k in a for d in _diff(a[k], b[k], f"{where}.{k}")]
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        if len(a) != len(b):
            return [f"{where}: {len(a)} != {len(b)} entries"]
        pairs = enumerate(zip(a, b, strict=True))
        return [d for i, (x, y) in pairs for d in _diff(x, y, f"{where}[{i}]")]
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return [] if torch.equal(a, b) else [f"{where}: tensors differ"]
    return [] if a == b else [f"{where}: {a!r} != {b!r}"]


def compare(full: Path, preempted: Path, world: int = 2) -> list[str]:
    """The differences between the runs (empty: the requeued run resumed exactly).

    Args:
        full: the uninterrupted run's directory.
        preempted: the preempted run's directory (attempts 0 and 1).
        world: the ranks of each run.

    Returns:
        One line per difference or missing piece.
    """
    problems: list[str] = []
    for rank in range(world):
        ref, first, second = (
            _load(full, 0, rank),
            _load(preempted, 0, rank),
            _load(preempted, 1, rank),
        )
        where = f"rank {rank}"
        if {first["environment"], second["environment"]} != {"SLURMEnvironment"}:
            problems.append(f"{where}: not trained under SLURMEnvironment")
        if first["job_id"] != second["job_id"]:
            problems.append(f"{where}: attempts ran as jobs {first['job_id']}, {second['job_id']}")
        if not str(second["resumed_from"]).startswith("hpc_ckpt_"):
            problems.append(f"{where}: requeued attempt resumed from {second['resumed_from']!r}")
        resumed_at = min(second["steps"]) - 1
        if not 0 < resumed_at < max(ref["steps"]):
            problems.append(f"{where}: resumed at step {resumed_at}, not mid-run")
        if first["steps"].keys() - ref["steps"].keys() or resumed_at not in first["steps"]:
            problems.append(f"{where}: first attempt never reached step {resumed_at}")
        problems += _diff(
            second["steps"],
            {s: ref["steps"][s] for s in ref["steps"] if s > resumed_at},
            f"{where} steps",
        )
        problems += _diff(
            {s: first["steps"][s] for s in first["steps"] if s <= resumed_at},
            {s: ref["steps"][s] for s in ref["steps"] if s <= resumed_at},
            f"{where} steps before the signal",
        )
        for key in ("weights", "optimizer"):
            if key not in second:
                problems.append(f"{where}: requeued attempt did not finish")
                break
            problems += _diff(second[key], ref[key], f"{where} {key}")
    return problems


def main() -> None:
    full, preempted = Path(sys.argv[1]), Path(sys.argv[2])
    problems = compare(full, preempted)
    if problems:
        print("NOT EXACT:", *problems[:20], sep="\n  ")
        sys.exit(1)
    first, second = _load(preempted, 0, 0), _load(preempted, 1, 0)
    resumed_at = min(second["steps"]) - 1
    print(
        f"exact: job {second['job_id']} trained steps 1-{max(first['steps'])}, got the requeue "
        f"signal, was requeued and resumed from {second['resumed_from']} at step {resumed_at}; "
        f"losses of steps {resumed_at + 1}-{max(second['steps'])}, weights and optimizer state "
        "equal the uninterrupted run's on both ranks"
    )


if __name__ == "__main__":
    main()
