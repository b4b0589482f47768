"""The fork start method used in notebooks brings the run's results back to the parent."""

from __future__ import annotations

import torch

from tests.helpers import run_script


def test_fork_run_returns_metrics_to_the_parent(tmp_path) -> None:
    run_script("fork_fit.py", str(tmp_path))
    parent = torch.load(tmp_path / "parent.pt", weights_only=True)
    assert parent["state"] == "finished"  # loop counters stay in the workers
    assert 0.0 <= parent["auroc"] <= 1.0
