"""Recommendation metrics: NE, calibration, AUROC and AUPRC, windowed and lifetime, per task.

:class:`RecMetrics` computes them with ``torchrec.metrics`` (the implementations TorchRec users
already read and compare against), synchronised across ranks when a process group exists. The
functions :func:`normalized_entropy`, :func:`calibration`, :func:`auroc` and :func:`auprc` are the
textbook definitions on plain tensors, used to check the synchronised values and handy offline.

* **NE** (normalized entropy): the mean weighted cross-entropy of the predictions divided by
  the entropy of the weighted base rate ``p``, ``-(p log p + (1 - p) log(1 - p))``. 1.0 is no
  better than always predicting the base rate; lower is better.
* **calibration**: ``sum(w * prediction) / sum(w * label)``; 1.0 means the predicted click rate
  matches the observed one.
* **AUROC**, **AUPRC**: ranking quality; AUPRC suits rare positives.

*Lifetime* values cover every sample since the last reset; *window* values the most recent
``window_size`` samples over all ranks. AUROC and AUPRC have window values only: TorchRec's AUC
has no lifetime value (it would need every prediction of the run), and its "lifetime" AUPRC is a
weighted mean of the window values at each ``compute()`` (averaged over tasks), not the AUPRC of
the samples; it is left out. For an evaluation, make the window hold every sample (the module
does), and the window values are the values of the whole evaluation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torchrec.metrics.auc import AUCMetric
from torchrec.metrics.auprc import AUPRCMetric
from torchrec.metrics.calibration import CalibrationMetric
from torchrec.metrics.ne import NEMetric
from torchrec.metrics.rec_metric import RecComputeMode, RecMetric, RecTaskInfo

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

_METRICS: dict[str, type[RecMetric]] = {
    "ne": NEMetric,
    "calibration": CalibrationMetric,
    "auroc": AUCMetric,
    "auprc": AUPRCMetric,
}
#: torchrec's own names for the metrics, in the keys ``compute()`` returns.
_LIFETIME = {"ne", "calibration"}
_TORCHREC_NAMES = {"ne": "ne", "calibration": "calibration", "auroc": "auc", "auprc": "auprc"}


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
    order = torch.argsort(predictions.double(), descending=True)
    p = predictions.double()[order]
    y = labels.double()[order]
    w = _weights(labels.double(), weights)[order]
    last_of_tie = torch.cat([p[1:] != p[:-1], torch.tensor([True])])
    return torch.cumsum(w * y, 0)[last_of_tie], torch.cumsum(w * (1 - y), 0)[last_of_tie]


def auroc(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Area under the ROC curve (trapezoids; tied predictions count half).

    Args:
        predictions: scores ``[N]``.
        labels: 0/1 labels ``[N]``.
        weights: sample weights ``[N]``, or None for 1.

    Returns:
        A float64 scalar.
    """
    tp, fp = _curve(predictions, labels, weights)
    tpr = torch.cat([tp.new_zeros(1), tp / tp[-1]])
    fpr = torch.cat([fp.new_zeros(1), fp / fp[-1]])
    return torch.trapezoid(tpr, fpr)


def auprc(
    predictions: torch.Tensor, labels: torch.Tensor, weights: torch.Tensor | None = None
) -> torch.Tensor:
    """Area under the precision-recall curve (TorchRec's definition: a right Riemann sum).

    Args:
        predictions: scores ``[N]``.
        labels: 0/1 labels ``[N]``.
        weights: sample weights ``[N]``, or None for 1.

    Returns:
        A float64 scalar.
    """
    tp, fp = _curve(predictions, labels, weights)
    precision = tp / (tp + fp)
    recall = tp / tp[-1]
    previous = torch.cat([recall.new_zeros(1), recall[:-1]])
    return ((recall - previous) * precision).sum()


def batch_size_of(batch: object) -> int:
    """Samples in a batch with ``labels`` (for Lightning's ``ThroughputMonitor``).

    Args:
        batch: the batch.

    Returns:
        ``len(batch.labels)``.
    """
    return len(batch.labels)  # type: ignore[attr-defined]


class RecMetrics:
    """NE, calibration, AUROC and AUPRC of one or more tasks, with ``torchrec.metrics``.

    Built on the first :meth:`update` (TorchRec needs the batch size). :meth:`compute` gathers
    the states of every rank (a collective: every rank calls it at the same point).

    Args:
        tasks: task names; predictions and labels are ``[B]`` for one task, ``[B, T]`` for
            ``T`` tasks (column ``t`` is task ``tasks[t]``).
        metrics: which of ``ne``, ``calibration``, ``auroc``, ``auprc``.
        window_size: samples (over all ranks) of the window values.
        world_size: ranks that update (None: the process group's, or 1).
        rank: this rank (None: the process group's, or 0).

    Raises:
        ValueError: for an unknown metric or no task.
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
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        self.world_size = world_size or (torch.distributed.get_world_size() if distributed else 1)
        self.rank = (
            rank if rank is not None else (torch.distributed.get_rank() if distributed else 0)
        )
        self.tasks = list(tasks)
        self.metric_names = list(metrics)
        self.window_size = window_size
        self.metrics: dict[str, RecMetric] = {}

    def _build(self, batch_size: int, device: torch.device) -> None:
        infos = [
            RecTaskInfo(name=t, label_name=t, prediction_name=t, weight_name=t) for t in self.tasks
        ]
        window = max(self.window_size, batch_size * self.world_size)
        self.metrics = {
            name: _METRICS[name](
                world_size=self.world_size,
                my_rank=self.rank,
                batch_size=batch_size,
                tasks=infos,
                compute_mode=RecComputeMode.UNFUSED_TASKS_COMPUTATION,
                window_size=window,
                compute_on_all_ranks=True,
            ).to(device)
            for name in self.metric_names
        }

    def update(
        self,
        predictions: torch.Tensor,
        labels: torch.Tensor,
        weights: torch.Tensor | None = None,
    ) -> None:
        """Adds a batch.

        Args:
            predictions: probabilities, ``[B]`` or ``[B, T]``.
            labels: 0/1 labels of the same shape.
            weights: sample weights of the same shape (or ``[B]`` for all tasks), None for 1.
        """
        predictions = predictions.detach().float()
        if predictions.dim() == 1:
            predictions = predictions.unsqueeze(1)
        labels = labels.detach().float().reshape(predictions.shape)
        if weights is None:
            weights = torch.ones_like(predictions)
        else:
            weights = weights.detach().float()
            weights = (weights.unsqueeze(1) if weights.dim() == 1 else weights).expand_as(
                predictions
            )
        if not self.metrics:
            self._build(predictions.shape[0], predictions.device)
        p = {t: predictions[:, i] for i, t in enumerate(self.tasks)}
        y = {t: labels[:, i] for i, t in enumerate(self.tasks)}
        w = {t: weights[:, i] for i, t in enumerate(self.tasks)}
        for metric in self.metrics.values():
            metric.update(predictions=p, labels=y, weights=w)

    def compute(self) -> dict[str, torch.Tensor]:
        """The metrics over every rank.

        Returns:
            ``{"{metric}/{task}/{lifetime|window}": value}`` (float scalars); empty before
            the first update.
        """
        out: dict[str, torch.Tensor] = {}
        for name, metric in self.metrics.items():
            trname = _TORCHREC_NAMES[name]
            values = metric.compute()
            for task in self.tasks:
                for scope in ("lifetime", "window") if name in _LIFETIME else ("window",):
                    key = f"{trname}-{task}|{scope}_{trname}"
                    if key in values:
                        out[f"{name}/{task}/{scope}"] = values[key].reshape(()).float()
        return out

    def reset(self) -> None:
        """Forgets every sample (the next update rebuilds the metrics)."""
        self.metrics = {}

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
        """
        named = {}
        for key, value in self.compute().items():
            metric, task, kind = key.split("/")
            if scope == "window" and kind != scope:
                continue
            if scope == "lifetime" and kind != scope and metric in _LIFETIME:
                continue
            base = f"{prefix}/{metric}" + (f"/{task}" if len(self.tasks) > 1 else "")
            named[base if scope is not None else f"{base}_{kind}"] = value
        return named


def task_columns(values: torch.Tensor, num_tasks: int) -> torch.Tensor:
    """Reshapes model outputs or labels to ``[B]`` (one task) or ``[B, T]``.

    Args:
        values: a tensor with ``B * num_tasks`` elements.
        num_tasks: ``T``.

    Returns:
        The reshaped tensor.
    """
    return values.reshape(-1) if num_tasks == 1 else values.reshape(-1, num_tasks)
