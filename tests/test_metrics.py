"""RecMetrics (torchrec.metrics) against direct computation, on one and on two ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics.functional.classification import binary_auroc

from lightning_torchrec.training.metrics import (
    RecMetrics,
    auprc,
    auroc,
    calibration,
    normalized_entropy,
)

BATCH, STEPS, TASKS = 64, 6, ("click", "like")


def fake_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + step)
    logits = torch.randn(BATCH, len(TASKS), generator=g)
    labels = torch.bernoulli(torch.sigmoid(1.5 * logits), generator=g)
    weights = torch.rand(BATCH, generator=g) + 0.5
    return torch.sigmoid(logits + 0.3), labels, weights


def test_direct_definitions() -> None:
    p = torch.tensor([0.9, 0.8, 0.3, 0.3, 0.1])
    y = torch.tensor([1.0, 0.0, 1.0, 0.0, 0.0])
    assert float(calibration(p, y)) == pytest.approx(2.4 / 2)
    base = 0.4
    ce = -(torch.log(p) * y + torch.log(1 - p) * (1 - y)).double().mean()
    h = -(base * torch.log(torch.tensor(base)) + 0.6 * torch.log(torch.tensor(0.6)))
    assert float(normalized_entropy(p, y)) == pytest.approx(float(ce / h), rel=1e-6)
    assert float(auroc(p, y)) == pytest.approx(float(binary_auroc(p, y.long())), rel=1e-6)
    # ranked: 1 (P=1 R=.5), 0 (P=.5), tie {1, 0} (P=.5 R=1): AP = .5 * 1 + .5 * .5
    assert float(auprc(p, y)) == pytest.approx(0.75)
    w = torch.tensor([1.0, 2.0, 1.0, 1.0, 1.0])
    assert float(calibration(p, y, w)) == pytest.approx(3.2 / 2)


def _check(rank: int, world: int, window_batches: int) -> dict[str, float]:
    metrics = RecMetrics(TASKS, window_size=window_batches * BATCH * world)
    for step in range(STEPS):
        metrics.update(*fake_batch(rank, step))
    got = metrics.compute()
    errors = {}
    for scope, steps in (
        ("lifetime", range(STEPS)),
        ("window", range(STEPS - window_batches, STEPS)),
    ):
        parts = [fake_batch(r, s) for r in range(world) for s in steps]
        p, y, w = (torch.cat([part[i] for part in parts]) for i in range(3))
        for t, task in enumerate(TASKS):
            direct = {
                "ne": normalized_entropy(p[:, t], y[:, t], w),
                "calibration": calibration(p[:, t], y[:, t], w),
                "auroc": auroc(p[:, t], y[:, t], w),
                "auprc": auprc(p[:, t], y[:, t], w),
            }
            for name, value in direct.items():
                key = f"{name}/{task}/{scope}"
                if key in got:
                    errors[key] = abs(float(got[key]) - float(value))
    return errors


def _worker(rank: int, world: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        errors = _check(rank, world, window_batches=2)
        torch.save(errors, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_one_rank_against_direct() -> None:
    errors = _check(0, 1, window_batches=3)
    assert len(errors) == 2 * 6  # AUROC, AUPRC: window values only
    assert max(errors.values()) < 1e-5, errors


def test_two_ranks_synchronised_against_direct_on_gathered(tmp_path: Path) -> None:
    mp.start_processes(
        _worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    for rank in range(2):
        errors = torch.load(tmp_path / f"rank{rank}.pt")
        assert len(errors) == 2 * 6
        assert max(errors.values()) < 1e-5, errors


def test_named_keys() -> None:
    one = RecMetrics()
    one.update(*[x[:, 0] if x.dim() == 2 else x for x in fake_batch(0, 0)])
    assert sorted(one.named("val", scope="lifetime")) == [
        "val/auprc",
        "val/auroc",
        "val/calibration",
        "val/ne",
    ]
    assert "train/auroc_window" in one.named("train")
    two = RecMetrics(TASKS)
    two.update(*fake_batch(0, 0))
    assert "val/ne/like" in two.named("val", scope="lifetime")
    with pytest.raises(ValueError, match="unknown metrics"):
        RecMetrics(metrics=["ne", "gauc"])
