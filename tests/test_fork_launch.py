"""The fork start method used in notebooks brings the run's results back to the parent."""

from __future__ import annotations

from pathlib import Path

import torch

from lightning_torchrec.compat.worker_fork import AFFECTED
from tests.helpers import load_ranks, run_script


def test_fork_run_returns_metrics_to_the_parent(tmp_path) -> None:
    run_script("fork_fit.py", str(tmp_path))
    parent = torch.load(tmp_path / "parent.pt", weights_only=True)
    assert parent["state"] == "finished"  # loop counters stay in the workers
    assert 0.0 <= parent["auroc"] <= 1.0


def test_loaders_fork_workers_after_a_pipelined_fit_without_hanging(tmp_path: Path) -> None:
    # 12 rounds of: a pipelined fit, then a fit and a validate whose loaders fork 2 workers each,
    # in one 2-rank process pair. A hang fails at the timeout instead of blocking the suite.
    run_script("fork_after_pipeline.py", str(tmp_path), "12", timeout=420)
    ranks = load_ranks(tmp_path, "fork")
    assert [r["rounds"] for r in ranks] == [12, 12]
    # Every loader forked its workers only after gloo's threads could give the GIL back.
    quiet = ["QuietForkContext"] if AFFECTED else ["NoneType"]
    assert [r["contexts"] for r in ranks] == [quiet, quiet]
