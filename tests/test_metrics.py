"""RecMetrics against direct computation on the window's samples, on one and on two ranks."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torchmetrics.functional.classification import binary_auroc
from torchrec.metrics.calibration import CalibrationMetric
from torchrec.metrics.ne import NEMetric
from torchrec.metrics.rec_metric import RecComputeMode, RecTaskInfo

from lightning_torchrec.training.metrics import (
    RecMetrics,
    auprc,
    auroc,
    calibration,
    normalized_entropy,
)
from lightning_torchrec.training.window_metrics import SampleWindow, window_shares

BATCH, STEPS, TASKS = 64, 6, ("click", "like")
#: The plain functions the window values are checked against.
PLAIN = {"ne": normalized_entropy, "calibration": calibration, "auroc": auroc, "auprc": auprc}


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
        errors.update(_check_uneven(rank, world))
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
        assert len(errors) == 2 * 6 + 4 * len(UNEVEN_WINDOWS)
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


UNEVEN_SIZES = ((5, 64, 3, 17, 0, 8), (64, 0, 9, 2, 30, 1))
UNEVEN_WINDOWS = (20, 50, 100, 10_000)


def uneven_batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7919 * rank + step)
    n = UNEVEN_SIZES[rank][step]
    p = torch.rand(n, generator=g)
    return p, torch.bernoulli(p, generator=g), torch.rand(n, generator=g) + 0.2


def _check_uneven(rank: int, world: int) -> dict[str, float]:
    """Different batch sizes on the ranks (some empty); the window ends inside a step."""
    stream = [uneven_batch(r, s) for s in range(len(UNEVEN_SIZES[0])) for r in range(world)]
    p, y, w = (torch.cat([part[i] for part in stream]) for i in range(3))
    errors = {}
    for size in UNEVEN_WINDOWS:
        metrics = RecMetrics(window_size=size)
        for step in range(len(UNEVEN_SIZES[0])):
            metrics.update(*uneven_batch(rank, step))
        got = metrics.compute()
        last = slice(max(0, len(p) - size), None)
        for name, fn in PLAIN.items():
            direct = float(fn(p[last], y[last], w[last]))
            errors[f"uneven{size}/{name}"] = abs(float(got[f"{name}/click/window"]) - direct)
    return errors


def test_uneven_batches_window_one_rank() -> None:
    errors = _check_uneven(0, 1)
    assert max(errors.values()) < 1e-5, errors


@pytest.mark.parametrize(("window", "batch"), [(4000, 2), (3999, 3)])
def test_window_of_more_than_1000_batches_holds_the_last_samples(window: int, batch: int) -> None:
    """TorchRec's window buffer kept at most 1000 batches: 2000 samples, not 4000."""
    steps = 3000
    g = torch.Generator().manual_seed(3)
    p = torch.rand(steps * batch, generator=g)
    y = torch.bernoulli(p, generator=g)
    w = torch.rand(steps * batch, generator=g) + 0.5
    # Older than the last 1000 batches, the predictions are miscalibrated: which count shows.
    p[: len(p) - 1000 * batch] = 0.9
    metrics = RecMetrics(window_size=window)
    for s in range(steps):
        part = slice(s * batch, (s + 1) * batch)
        metrics.update(p[part], y[part], w[part])
    got = metrics.named("train")
    last = slice(len(p) - window, None)
    for name, fn in PLAIN.items():
        direct = float(fn(p[last], y[last], w[last]))
        assert float(got[f"train/{name}_window"]) == pytest.approx(direct, abs=1e-5), name
    last_1000_batches = slice(len(p) - 1000 * batch, None)
    stale = float(calibration(p[last_1000_batches], y[last_1000_batches], w[last_1000_batches]))
    assert abs(float(got["train/calibration_window"]) - stale) > 0.05
    assert float(got["train/ne_lifetime"]) == pytest.approx(
        float(normalized_entropy(p, y, w)), abs=1e-5
    )


@pytest.mark.parametrize(
    "labels",
    [[1, 0, 1, 0, 1, 0, 1, 0], [0, 1, 0, 1, 0, 1, 0, 1], [1, 1, 1, 1, 0, 0, 0, 0]],
)
@pytest.mark.parametrize("batch", [8, 3])
def test_constant_predictor_has_auroc_one_half(labels: list[int], batch: int) -> None:
    """TorchRec's AUC did not merge tied scores: 0.625, 0.375 or 1.0 by label order."""
    y = torch.tensor(labels, dtype=torch.float32)
    p = torch.full_like(y, 0.5)
    metrics = RecMetrics(window_size=100)
    for start in range(0, len(y), batch):
        metrics.update(p[start : start + batch], y[start : start + batch])
    got = metrics.named("train")
    assert float(got["train/auroc_window"]) == pytest.approx(0.5, abs=1e-7)
    assert float(got["train/auprc_window"]) == pytest.approx(0.5, abs=1e-7)


def _mann_whitney(p: torch.Tensor, y: torch.Tensor, w: torch.Tensor) -> float:
    """Weighted probability that a positive outranks a negative, ties counting half."""
    pos, neg = y == 1, y == 0
    above = (p[pos][:, None] > p[neg][None, :]).double()
    tied = (p[pos][:, None] == p[neg][None, :]).double()
    pairs = w[pos].double()[:, None] * w[neg].double()[None, :]
    return float((pairs * (above + 0.5 * tied)).sum() / pairs.sum())


def test_tied_predictions_weighted_auroc_is_order_independent() -> None:
    g = torch.Generator().manual_seed(5)
    p = torch.rand(600, generator=g)
    y = torch.bernoulli(p, generator=g)
    w = torch.rand(600, generator=g) + 0.1
    p = (p * 10).round() / 10
    expected = _mann_whitney(p, y, w)
    assert float(auroc(p, y, w)) == pytest.approx(expected, abs=1e-9)
    assert float(auroc(p, y)) == pytest.approx(float(binary_auroc(p, y.long())), abs=1e-6)
    for seed in range(3):
        order = torch.randperm(600, generator=torch.Generator().manual_seed(seed))
        metrics = RecMetrics(window_size=10_000)
        for part in order.split(64):
            metrics.update(p[part], y[part], w[part])
        got = metrics.compute()
        assert float(got["auroc/click/window"]) == pytest.approx(expected, abs=1e-5)
        assert float(got["auprc/click/window"]) == pytest.approx(float(auprc(p, y, w)), abs=1e-5)


def test_no_signal_window_values() -> None:
    """As TorchRec: AUROC 0.5 without positives or negatives, AUPRC 0 without positives."""
    metrics = RecMetrics(window_size=10)
    metrics.update(torch.tensor([0.2, 0.7]), torch.zeros(2))
    got = metrics.compute()
    assert float(got["auroc/click/window"]) == 0.5
    assert float(got["auprc/click/window"]) == 0.0
    assert float(got["calibration/click/window"]) == 0.0


def test_zero_weight_samples_ranked_first() -> None:
    p = torch.tensor([0.9, 0.8, 0.3, 0.2])
    y = torch.tensor([0.0, 1.0, 1.0, 0.0])
    w = torch.tensor([0.0, 1.0, 1.0, 1.0])
    assert float(auprc(p, y, w)) == pytest.approx(1.0)
    assert float(auroc(p, y, w)) == pytest.approx(1.0)


def test_lifetime_values_are_torchrec_ones() -> None:
    """The lifetime NE and calibration are those of torchrec.metrics, as before."""
    infos = [RecTaskInfo(name=t, label_name=t, prediction_name=t, weight_name=t) for t in TASKS]
    reference = [
        cls(
            world_size=1,
            my_rank=0,
            batch_size=BATCH,
            tasks=infos,
            compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION,
            window_size=BATCH,
        )
        for cls in (NEMetric, CalibrationMetric)
    ]
    ours = RecMetrics(TASKS, window_size=BATCH)
    for step in range(STEPS):
        p, y, w = fake_batch(0, step)
        ours.update(p, y, w)
        for metric in reference:
            metric.update(
                predictions={t: p[:, i] for i, t in enumerate(TASKS)},
                labels={t: y[:, i] for i, t in enumerate(TASKS)},
                weights={t: w for t in TASKS},
            )
    got = ours.compute()
    expected = {k: v for metric in reference for k, v in metric.compute().items()}
    for name in ("ne", "calibration"):
        for task in TASKS:
            want = float(expected[f"{name}-{task}|lifetime_{name}"])
            assert float(got[f"{name}/{task}/lifetime"]) == pytest.approx(want, rel=1e-6)


@pytest.mark.parametrize("size", [7, 50, 2**40])
def test_sample_window_keeps_the_last_rows(size: int) -> None:
    g = torch.Generator().manual_seed(size % 1000)
    window = SampleWindow(size)
    stream = torch.empty(0, 3)
    for _ in range(40):
        n = int(torch.randint(0, 12, (1,), generator=g))
        rows = torch.rand(n, 3, generator=g)
        window.append(rows)
        stream = torch.cat([stream, rows])
        held = min(len(stream), size)
        assert window.count == held
        assert torch.equal(window.latest(held), stream[len(stream) - held :])
        assert sum(n * steps for n, steps in window.runs) >= held
    assert window.rows is not None and window.rows.shape[0] <= max(size, 2 * len(stream))


def test_sample_window_batch_larger_than_window() -> None:
    window = SampleWindow(4)
    window.append(torch.arange(3.0)[:, None])
    window.append(torch.arange(10.0)[:, None])
    assert window.latest(4).flatten().tolist() == [6.0, 7.0, 8.0, 9.0]
    with pytest.raises(ValueError, match="at least 1 sample"):
        RecMetrics(window_size=0)


def test_window_shares() -> None:
    # 2 ranks x 4 samples a step: the newest step, then the last 2 samples (rank 1's) before it
    assert window_shares([[[4, 10]], [[4, 10]]], 10) == [4, 6]
    # more window than samples: everything
    assert window_shares([[[3, 1]], [[5, 2]]], 100) == [3, 10]
    # aligned at the newest step: rank 0 had 2, 2, 2, 1; rank 1 had 5 each step
    assert window_shares([[[2, 3], [1, 1]], [[5, 4]]], 9) == [1, 8]
    # empty batches count as steps; a window ending inside a step takes its last ranks first
    assert window_shares([[[0, 2], [3, 1]], [[1, 3]]], 6) == [3, 3]
    assert window_shares([[[0, 2], [3, 1]], [[1, 3]]], 3) == [2, 1]
