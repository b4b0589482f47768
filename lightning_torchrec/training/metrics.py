"""Recommendation metrics: NE, calibration, AUROC and AUPRC, windowed and lifetime, per task.

:class:`RecMetrics` keeps its state on the device and synchronises it across ranks at
:meth:`~RecMetrics.compute` only. The functions :func:`normalized_entropy`, :func:`calibration`,
:func:`auroc` and :func:`auprc` are the textbook definitions on plain tensors: the window values
are these functions of the window's samples, and they are handy offline.

* **NE** (normalized entropy): the mean weighted cross-entropy of the predictions divided by
  the entropy of the weighted base rate ``p``, ``-(p log p + (1 - p) log(1 - p))``. 1.0 is no
  better than always predicting the base rate; lower is better.
* **calibration**: ``sum(w * prediction) / sum(w * label)``; 1.0 means the predicted click rate
  matches the observed one.
* **AUROC**, **AUPRC**: ranking quality (tied predictions count half); AUPRC suits rare
  positives.

*Lifetime* values cover every sample since the last reset (running sums); *window* values the
last ``window_size`` samples over all ranks, whatever the batch size (a ring of the samples on
the device, :mod:`~lightning_torchrec.training.window_metrics`). AUROC and AUPRC have window
values only: a lifetime value would need every prediction of the run. For an evaluation, make
the window hold every sample (the module does), and the window values are the values of the
whole evaluation. NE and calibration follow ``torchrec.metrics`` (``NEMetric``,
``CalibrationMetric``: the same clamping, a calibration of 0 without positive labels), and so
does the no-signal AUROC of a window without positives or negatives, 0.5 (and its AUPRC is 0
without positives).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from lightning_torchrec.training.window_metrics import (
    SampleWindow,
    all_reduce_sum,
    batch_rows,
    gather_window,
)

__all__ = [
    "RecMetrics",
    "auprc",
    "auroc",
    "batch_size_of",
    "calibration",
    "normalized_entropy",
]

#: Predictions are clamped to [ETA, 1 - ETA] in the cross-entropy, as in torchrec.metrics.
ETA = 1e-12

_METRICS = ("ne", "calibration", "auroc", "auprc")
#: The metrics with a lifetime value.
_LIFETIME = {"ne", "calibration"}


def _weights(labels: torch.Tensor, weights: torch.Tensor | None) -> torch.Tensor:
    return torch.ones_like(labels) if weights is None else weights.double()


def normalized_entropy(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Normalized entropy of click probabilities (lower is better; 1.0 is the base rate).

    Args:
        predictions: probabilities ``[N]``.
        labels: 0/1 labels ``[N]``.
        weights: sample weights ``[N]``, or None for 1.

    Returns:
        A float64 scalar.
    """
    p = predictions.double().clamp(ETA, 1 - ETA)
    y = labels.double()
    w = _weights(y, weights)
    ce = -(w * (y * torch.log(p) + (1 - y) * torch.log(1 - p))).sum() / w.sum()
    base = ((w * y).sum() / w.sum()).clamp(ETA, 1 - ETA)
    return ce / -(base * torch.log(base) + (1 - base) * torch.log(1 - base))


def calibration(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Sum of predictions over sum of labels (weighted); 1.0 is calibrated.

    Args:
        predictions: probabilities ``[N]``.
        labels: 0/1 labels ``[N]``.
        weights: sample weights ``[N]``, or None for 1.

    Returns:
        A float64 scalar.
    """
    w = _weights(labels.double(), weights)
    return (w * predictions.double()).sum() / (w * labels.double()).sum()


def _curve(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Cumulative weighted true and false positives at each distinct threshold, descending."""
    p, order = torch.sort(predictions.double(), descending=True)
    y = labels.double()[order]
    w = _weights(labels.double(), weights)[order]
    last_of_tie = torch.cat([p[1:] != p[:-1], p.new_ones(1, dtype=torch.bool)])
    return torch.cumsum(w * y, 0)[last_of_tie], torch.cumsum(w * (1 - y), 0)[last_of_tie]


def _nan_if_nan(values: torch.Tensor, area: torch.Tensor) -> torch.Tensor:
    """NaN where ``values`` hold a NaN, else ``area`` (no host synchronisation).

    Sorting ranks NaN scores above every other: the area would be a number that hides them.
    """
    return torch.where(values.isnan().any(), math.nan, area)


def _auroc_of_curve(tp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    tpr = torch.cat([tp.new_zeros(1), tp / tp[-1]])
    fpr = torch.cat([fp.new_zeros(1), fp / fp[-1]])
    return torch.trapezoid(tpr, fpr)


def _auprc_of_curve(tp: torch.Tensor, fp: torch.Tensor) -> torch.Tensor:
    # No weight above a threshold yet (zero-weight samples ranked first): no recall either.
    precision = torch.where(tp + fp > 0, tp / (tp + fp), 1.0)
    recall = tp / tp[-1]
    previous = torch.cat([recall.new_zeros(1), recall[:-1]])
    return ((recall - previous) * precision).sum()


def auroc(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Area under the ROC curve (trapezoids; tied predictions count half).

    Args:
        predictions: scores ``[N]``.
        labels: 0/1 labels ``[N]``.
        weights: sample weights ``[N]``, or None for 1.

    Returns:
        A float64 scalar; NaN without samples or with a NaN score.
    """
    if predictions.numel() == 0:
        return predictions.new_tensor(math.nan, dtype=torch.float64)
    return _nan_if_nan(predictions, _auroc_of_curve(*_curve(predictions, labels, weights)))


def auprc(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Area under the precision-recall curve (TorchRec's definition: a right Riemann sum).

    Args:
        predictions: scores ``[N]``.
        labels: 0/1 labels ``[N]``.
        weights: sample weights ``[N]``, or None for 1.

    Returns:
        A float64 scalar; NaN without samples or with a NaN score.
    """
    if predictions.numel() == 0:
        return predictions.new_tensor(math.nan, dtype=torch.float64)
    return _nan_if_nan(predictions, _auprc_of_curve(*_curve(predictions, labels, weights)))


def batch_size_of(batch: object) -> int:
    """Samples in a batch with ``labels`` (for Lightning's ``ThroughputMonitor``).

    Args:
        batch: the batch.

    Returns:
        ``len(batch.labels)``.
    """
    return len(batch.labels)  # type: ignore[attr-defined]


def _sums(rows: torch.Tensor) -> torch.Tensor:
    """Sums over ``[N, 3, T]`` (prediction, label, weight) rows, ``[4, T]`` float64.

    They are the weighted cross-entropy (in bits, predictions clamped), the weights, the
    weighted labels and the weighted predictions: the states of TorchRec's NE and calibration.
    """
    rows = rows.double()
    p, y, w = rows[:, 0], rows[:, 1], rows[:, 2]
    clamped = p.clamp(ETA, 1 - ETA)
    ce = -w * (y * torch.log2(clamped) + (1 - y) * torch.log2(1 - clamped))
    return torch.stack([ce, w, w * y, w * p]).sum(1)


def _ne_and_calibration(sums: torch.Tensor) -> dict[str, torch.Tensor]:
    """NE and calibration ``[T]`` from :func:`_sums` (TorchRec's ``compute_ne``, ...)."""
    ce, w, pos, wp = sums
    base = (pos / w.clamp(min=ETA)).clamp(ETA, 1 - ETA)
    entropy = -pos * torch.log2(base) - (w - pos) * torch.log2(1 - base)
    return {"ne": ce / entropy, "calibration": torch.where(pos <= 0, 0.0, wp / pos)}


def _ranking(rows: torch.Tensor, names: Sequence[str]) -> dict[str, torch.Tensor]:
    """AUROC and AUPRC of ``[N, 3]`` rows (one sort); 0.5 and 0 where they have no signal.

    NaN where a prediction, label or weight is NaN (no area is meaningful then).
    """
    no_signal = {"auroc": 0.5, "auprc": 0.0}
    wanted = [name for name in names if name in no_signal]
    if rows.shape[0] == 0 or not wanted:
        return {name: rows.new_tensor(no_signal[name], dtype=torch.float64) for name in wanted}
    tp, fp = _curve(rows[:, 0], rows[:, 1], rows[:, 2])
    area = {"auroc": _auroc_of_curve, "auprc": _auprc_of_curve}
    # The last point of the curve holds the weighted positives and negatives.
    signal = {"auroc": tp[-1] * fp[-1] > 0, "auprc": tp[-1] > 0}
    return {
        name: _nan_if_nan(rows, torch.where(signal[name], area[name](tp, fp), no_signal[name]))
        for name in wanted
    }


class RecMetrics:
    """NE, calibration, AUROC and AUPRC of one or more tasks, windowed and lifetime.

    :meth:`update` keeps everything on the device, without host synchronisation: the last
    ``window_size`` samples in a :class:`~lightning_torchrec.training.window_metrics.SampleWindow`,
    running sums for the lifetime NE and calibration. :meth:`compute` gathers the window and
    sums the lifetime states of every rank (a collective: every rank calls it at the same point,
    after as many updates).

    Args:
        tasks: task names; predictions and labels are ``[B]`` for one task, ``[B, T]`` for
            ``T`` tasks (column ``t`` is task ``tasks[t]``).
        metrics: which of ``ne``, ``calibration``, ``auroc``, ``auprc``.
        window_size: samples (over all ranks) of the window values.
        world_size: ranks that update (None: the process group's when the metrics are
            computed, or 1: a ``RecMetrics`` built before the process group works under it).
        rank: this rank (None: the process group's, or 0).

    Raises:
        ValueError: for an unknown metric, no task, a task named twice, tasks given as one
            string, or a window of less than 1 sample.
    """

    def __init__(
        self,
        tasks: Sequence[str] = ("click",),
        metrics: Sequence[str] = ("ne", "calibration", "auroc", "auprc"),
        window_size: int = 1_000_000,
        world_size: int | None = None,
        rank: int | None = None,
    ) -> None:
        unknown = sorted(set(metrics) - set(_METRICS))
        if unknown or not tasks:
            raise ValueError(f"unknown metrics {unknown} (known: {sorted(_METRICS)}) or no task")
        if isinstance(tasks, str):
            raise ValueError(f"tasks must be a sequence of task names, got the string {tasks!r}")
        twice = sorted({task for task in tasks if list(tasks).count(task) > 1})
        if twice:
            raise ValueError(f"tasks {twice} are named twice: their values would share keys")
        if window_size < 1:
            raise ValueError(f"window_size must be at least 1 sample, got {window_size}")
        self._world_size, self._rank = world_size, rank
        self.tasks = list(tasks)
        self.metric_names = list(metrics)
        self.window_size = window_size
        self.window: SampleWindow | None = None
        self.lifetime: torch.Tensor | None = None

    @property
    def world_size(self) -> int:
        """Ranks that update: as given, else the process group's now (1 without one)."""
        if self._world_size:
            return self._world_size
        return torch.distributed.get_world_size() if _process_group() else 1

    @property
    def rank(self) -> int:
        """This rank: as given, else the process group's now (0 without one)."""
        if self._rank is not None:
            return self._rank
        return torch.distributed.get_rank() if _process_group() else 0

    def update(
        self,
        predictions: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Adds a batch (on the device; no host synchronisation).

        Args:
            predictions: probabilities, ``[B]`` or ``[B, T]``.
            labels: 0/1 labels of the same shape.
            weights: sample weights of the same shape (or ``[B]`` for all tasks), None for 1.

        Raises:
            ValueError: when the shapes do not fit the tasks or each other (checked on the
                host, from the shapes only).
        """
        rows = batch_rows(predictions, labels, weights, self.tasks)
        if self.window is None:
            self.window = SampleWindow(self.window_size)
        self.window.append(rows)
        if _LIFETIME.intersection(self.metric_names):
            sums = _sums(rows)
            self.lifetime = sums if self.lifetime is None else self.lifetime + sums

    def compute(self) -> dict[str, torch.Tensor]:
        """The metrics over every rank.

        Returns:
            ``{"{metric}/{task}/{lifetime|window}": value}`` (float scalars); empty before
            the first update.
        """
        if self.window is None:
            return {}
        rows = gather_window(self.window, self.world_size, self.rank)
        values: dict[str, dict[str, torch.Tensor]] = {"window": _ne_and_calibration(_sums(rows))}
        if self.lifetime is not None:
            values["lifetime"] = _ne_and_calibration(all_reduce_sum(self.lifetime, self.world_size))
        ranking = [_ranking(rows[:, :, t], self.metric_names) for t in range(len(self.tasks))]
        out: dict[str, torch.Tensor] = {}
        for name in self.metric_names:
            for t, task in enumerate(self.tasks):
                if name in _LIFETIME:
                    for scope in ("lifetime", "window"):
                        out[f"{name}/{task}/{scope}"] = values[scope][name][t].reshape(()).float()
                else:
                    out[f"{name}/{task}/window"] = ranking[t][name].reshape(()).float()
        return out

    def reset(self) -> None:
        """Forgets every sample."""
        self.window = None
        self.lifetime = None

    def named(self, prefix: str, scope: str | None = None) -> dict[str, torch.Tensor]:
        """:meth:`compute` with logger-friendly keys.

        One task: ``{prefix}/{metric}`` (``scope`` given) or ``{prefix}/{metric}_{scope}``;
        several: ``{prefix}/{metric}/{task}`` likewise.

        Args:
            prefix: e.g. ``"val"``.
            scope: ``"lifetime"`` keeps the lifetime NE and calibration and the window AUROC
                and AUPRC, unsuffixed (for an evaluation whose window holds all its samples);
                ``"window"`` keeps the window values, unsuffixed; None keeps all, suffixed.

        Returns:
            The values.

        Raises:
            ValueError: for a ``scope`` other than None, ``"lifetime"`` and ``"window"``.
        """
        if scope not in (None, "lifetime", "window"):
            raise ValueError(f"scope must be None, 'lifetime' or 'window', got {scope!r}")
        named = {}
        for key, value in self.compute().items():
            # Task names may hold "/" (tags nested in TensorBoard); metrics and scopes do not.
            metric, rest = key.split("/", 1)
            task, kind = rest.rsplit("/", 1)
            if scope == "window" and kind != scope:
                continue
            if scope == "lifetime" and kind != scope and metric in _LIFETIME:
                continue
            base = f"{prefix}/{metric}" + (f"/{task}" if len(self.tasks) > 1 else "")
            named[base if scope is not None else f"{base}_{kind}"] = value
        return named


def _process_group() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def task_columns(values: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """Reshapes model outputs or labels to ``[B]`` (one task) or ``[B, T]``.

    Args:
        values: a tensor with ``B * num_tasks`` elements.
        num_tasks: ``T``.

    Returns:
        The reshaped tensor.
    """
    return values.reshape(-1) if num_tasks == 1 else values.reshape(-1, num_tasks)
