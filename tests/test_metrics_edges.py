"""RecMetrics off the beaten path: empty batches, bad shapes, NaN scores, odd task names, ranks."""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lightning_torchrec.training.metrics import (
    RecMetrics,
    auprc,
    auroc,
    calibration,
    normalized_entropy,
)
from lightning_torchrec.training.window_metrics import SampleWindow
from tests.test_metrics import _free_port

PLAIN = {"ne": normalized_entropy, "calibration": calibration, "auroc": auroc, "auprc": auprc}


def batch(seed: int, n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    p = torch.rand(n, generator=g)
    return p, torch.bernoulli(p, generator=g), torch.rand(n, generator=g) + 0.5


def test_an_empty_first_batch_is_a_batch_without_samples() -> None:
    window = SampleWindow(5)
    window.append(torch.zeros(0, 3, 1))
    assert window.count == 0 and window.latest(0).shape == (0, 3, 1)
    window.append(torch.ones(2, 3, 1))
    assert window.latest(2).shape == (2, 3, 1)
    metrics = RecMetrics(window_size=100)
    metrics.update(torch.zeros(0), torch.zeros(0))
    assert float(metrics.compute()["auroc/click/window"]) == 0.5  # no signal yet
    p, y, w = batch(0, 40)
    metrics.update(p, y, w)
    metrics.update(torch.zeros(0), torch.zeros(0), torch.zeros(0))
    got = metrics.compute()
    for name, fn in PLAIN.items():
        assert float(got[f"{name}/click/window"]) == pytest.approx(float(fn(p, y, w)), abs=1e-5)


@pytest.mark.parametrize(
    ("tasks", "p", "y", "w", "culprit"),
    [
        (("a", "b"), (4, 3), (4, 3), None, r"predictions of shape \(4, 3\).*\[B, 2\]"),
        (("a",), (4, 2), (4, 2), None, r"predictions of shape \(4, 2\).*\[B\] or \[B, 1\]"),
        (("a",), (), (), None, r"predictions of shape \(\)"),
        (("a",), (4,), (5,), None, r"labels of shape \(5,\)"),
        (("a", "b"), (4, 2), (2, 4), None, r"labels of shape \(2, 4\)"),
        (("a",), (4,), (4,), (5,), r"weights of shape \(5,\)"),
        (("a", "b"), (4, 2), (4, 2), (4, 3), r"weights of shape \(4, 3\)"),
    ],
)
def test_shapes_that_do_not_fit_the_tasks_are_refused_naming_the_tensor(
    tasks: tuple[str, ...],
    p: tuple[int, ...],
    y: tuple[int, ...],
    w: tuple[int, ...] | None,
    culprit: str,
) -> None:
    metrics = RecMetrics(tasks)
    weights = None if w is None else torch.ones(w)
    with pytest.raises(ValueError, match=culprit):
        metrics.update(torch.rand(p), torch.ones(y), weights)
    assert metrics.window is None  # nothing half-added


def test_accepted_shapes_give_the_values_of_each_task() -> None:
    p, y, w = batch(1, 30)
    one = RecMetrics(("a",))
    one.update(p[:, None], y[:, None], w[:, None])
    assert float(one.compute()["ne/a/window"]) == pytest.approx(float(normalized_entropy(p, y, w)))
    two = RecMetrics(("a", "b"))
    two.update(torch.stack([p, 1 - p], 1), torch.stack([y, 1 - y], 1), w)
    got = two.compute()
    assert float(got["auroc/b/window"]) == pytest.approx(float(auroc(1 - p, 1 - y, w)), abs=1e-6)


def test_task_names_with_a_slash_and_tasks_named_twice() -> None:
    metrics = RecMetrics(("ads/click", "ads/like"))
    metrics.update(torch.rand(8, 2), torch.ones(8, 2))
    assert set(metrics.named("val", scope="lifetime")) == {
        f"val/{m}/ads/{t}" for m in PLAIN for t in ("click", "like")
    }
    assert "train/ne/ads/click_window" in metrics.named("train")
    with pytest.raises(ValueError, match=r"\['a'\] are named twice"):
        RecMetrics(("a", "b", "a"))
    with pytest.raises(ValueError, match="string 'click'"):
        RecMetrics("click")
    with pytest.raises(ValueError, match="scope must be"):
        metrics.named("val", scope="lifetim")


def test_nan_scores_make_the_ranking_metrics_nan_not_a_number() -> None:
    p, y, w = batch(2, 20)
    p[3] = math.nan
    metrics = RecMetrics()
    metrics.update(p, y, w)
    got = metrics.compute()
    for name in PLAIN:
        assert math.isnan(float(got[f"{name}/click/window"])), name
        assert math.isnan(float(PLAIN[name](p, y, w))), name
    labels = RecMetrics()
    labels.update(*batch(3, 20))
    labels.update(torch.tensor([0.5]), torch.tensor([math.nan]))
    assert math.isnan(float(labels.compute()["auroc/click/window"]))
    for fn in (auroc, auprc):  # no sample: undefined, not an IndexError
        assert math.isnan(float(fn(torch.zeros(0), torch.zeros(0))))


def _worker(rank: int, world: int, port: int, out: str) -> None:
    # Built before the process group, as in a LightningModule's __init__.
    early = RecMetrics(window_size=50)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        sizes = {0: (16, 7, 30), 1: (0, 12, 9)}  # rank 1 starts with an empty batch
        for step, n in enumerate(sizes[rank]):
            early.update(*batch(10 * rank + step, n))
        got = {k: float(v) for k, v in early.compute().items()}
        torch.save((early.world_size, got), Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_metrics_built_before_the_process_group_sync_over_ranks(tmp_path: Path) -> None:
    mp.start_processes(
        _worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, start_method="spawn"
    )
    sizes = {0: (16, 7, 30), 1: (0, 12, 9)}
    steps = [[batch(10 * r + s, sizes[r][s]) for r in range(2)] for s in range(3)]
    every = [part for step in steps for part in step]
    p, y, w = (torch.cat([part[i] for part in every]) for i in range(3))
    for rank in range(2):
        world, got = torch.load(tmp_path / f"rank{rank}.pt")
        assert world == 2
        for name, fn in PLAIN.items():
            want = float(fn(p[-50:], y[-50:], w[-50:]))  # the last 50 samples, step then rank
            assert got[f"{name}/click/window"] == pytest.approx(want, abs=1e-5), (rank, name)
        lifetime = float(normalized_entropy(p, y, w))
        assert got["ne/click/lifetime"] == pytest.approx(lifetime, rel=1e-5), rank
