"""The window of :class:`~lightning_torchrec.training.metrics.RecMetrics`: recent samples.

A :class:`SampleWindow` keeps one rank's most recent samples as rows of a tensor on their device
(a ring, grown by doubling up to the window size, so that a window of "every sample" costs only
what it holds), and on the host the batch size of each step (run-length encoded). Updating it
copies the batch into the ring: no host synchronisation. :func:`gather_window` is the collective
at compute time: the ranks exchange their batch sizes, :func:`window_shares` works out how many
of its newest samples each rank holds in the window, and the rows are gathered.

The window is the last ``size`` samples of the stream ordered by step, then rank, then position
in the batch, over all ranks, whatever their batch sizes (the ranks update at the same steps).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_torchrec.distributed import all_gather, collective_device, run_collective

__all__ = ["SampleWindow", "all_reduce_sum", "batch_rows", "gather_window", "window_shares"]


def batch_rows(
    predictions: torch.Tensor,
    labels: torch.Tensor,
    weights: torch.Tensor | None,
    tasks: Sequence[str],
) -> torch.Tensor:
    """One batch as window rows ``[B, 3, T]`` (prediction, label, weight), float32, detached.

    Args:
        predictions: ``[B]`` (one task) or ``[B, T]`` for the ``T`` tasks.
        labels: as many labels (``[B]``, ``[B, 1]`` or ``[B, T]``).
        weights: ``[B]`` or ``[B, 1]`` (every task), ``[B, T]``, or None for 1.
        tasks: the task names.

    Returns:
        The rows.

    Raises:
        ValueError: naming the tensor whose shape does not fit the tasks or the predictions
            (only shapes are read: no host synchronisation).
    """
    p = predictions.detach().float()
    p = p.unsqueeze(1) if p.dim() == 1 else p
    if p.dim() != 2 or p.shape[1] != len(tasks):
        expected = "[B] or [B, 1]" if len(tasks) == 1 else f"[B, {len(tasks)}]"
        raise ValueError(
            f"predictions of shape {tuple(predictions.shape)} do not fit the {len(tasks)} "
            f"task(s) {list(tasks)}: expected {expected}"
        )
    if labels.numel() != p.numel() or labels.shape[:1] != p.shape[:1]:
        raise ValueError(
            f"labels of shape {tuple(labels.shape)} do not fit predictions of shape "
            f"{tuple(predictions.shape)}"
        )
    y = labels.detach().float().reshape(p.shape)
    if weights is None:
        return torch.stack([p, y, torch.ones_like(p)], 1)
    w = weights.detach().float()
    w = w.unsqueeze(1) if w.dim() == 1 else w
    if w.dim() != 2 or w.shape[0] != p.shape[0] or w.shape[1] not in (1, p.shape[1]):
        raise ValueError(
            f"weights of shape {tuple(weights.shape)} do not fit predictions of shape "
            f"{tuple(predictions.shape)} (expected [B], [B, 1] or the predictions' shape)"
        )
    return torch.stack([p, y, w.expand_as(p)], 1)


class SampleWindow:
    """One rank's last ``size`` samples, as rows of a tensor on their device.

    Args:
        size: samples the window holds over all ranks (a rank never holds more).

    Raises:
        ValueError: if ``size`` is below 1.
    """

    def __init__(self, size: int) -> None:
        if size < 1:
            raise ValueError(f"the window must hold at least 1 sample, got {size}")
        self.size = size
        self.rows: torch.Tensor | None = None
        self.start = 0
        self.count = 0
        #: ``[batch size, steps]`` runs, oldest first, covering at least the last ``size`` rows.
        self.runs: deque[list[int]] = deque()
        self._run_rows = 0

    def append(self, rows: torch.Tensor) -> None:
        """Adds a batch (one step), dropping the oldest rows beyond ``size``.

        Args:
            rows: ``[B, ...]``; every batch has the same trailing shape.
        """
        n = rows.shape[0]
        self._record(n)
        if n == 0:  # an empty batch (e.g. a rank's share of a short last step): no rows
            if self.rows is None:
                self.rows = rows.new_empty((0, *rows.shape[1:]))
            return
        if n >= self.size:
            self._reserve(self.size, like=rows)
            self.rows[:] = rows[n - self.size :]  # type: ignore[index]
            self.start, self.count = 0, self.size
            return
        self._reserve(self.count + n, like=rows)
        assert self.rows is not None
        capacity = self.rows.shape[0]
        at = (self.start + self.count) % capacity
        first = min(n, capacity - at)
        self.rows[at : at + first] = rows[:first]
        if first < n:
            self.rows[: n - first] = rows[first:]
        overflow = self.count + n - capacity
        if overflow > 0:
            self.start = (self.start + overflow) % capacity
        self.count = min(capacity, self.count + n)

    def latest(self, k: int) -> torch.Tensor:
        """The newest ``k`` rows, oldest first.

        Args:
            k: at most the rows held.

        Returns:
            ``[k, ...]`` (a view, or a copy when the rows wrap around the ring).
        """
        assert self.rows is not None and 0 <= k <= self.count
        if k == 0:
            return self.rows[:0]
        capacity = self.rows.shape[0]
        begin = (self.start + self.count - k) % capacity
        if begin + k <= capacity:
            return self.rows[begin : begin + k]
        return torch.cat([self.rows[begin:], self.rows[: begin + k - capacity]])

    def _record(self, n: int) -> None:
        if self.runs and self.runs[-1][0] == n:
            self.runs[-1][1] += 1
        else:
            self.runs.append([n, 1])
        self._run_rows += n
        while (
            len(self.runs) > 1 and self._run_rows - self.runs[0][0] * self.runs[0][1] >= self.size
        ):
            oldest = self.runs.popleft()
            self._run_rows -= oldest[0] * oldest[1]

    def _reserve(self, needed: int, like: torch.Tensor | None = None) -> None:
        """Grows the ring (doubling, at most to ``size``) to hold ``needed`` rows."""
        capacity = 0 if self.rows is None else self.rows.shape[0]
        if needed <= capacity or capacity == self.size:
            return
        source = self.rows if self.rows is not None else like
        assert source is not None
        grown = source.new_empty((min(self.size, max(needed, 2 * capacity)), *source.shape[1:]))
        if self.rows is not None:
            # Below ``size`` the ring has never wrapped: its rows start at 0.
            grown[: self.count] = self.rows[: self.count]
        self.rows, self.start = grown, 0


def window_shares(runs: Sequence[Sequence[Sequence[int]]], size: int) -> list[int]:
    """How many of its newest samples each rank holds in the window of ``size`` samples.

    The steps of every rank are aligned at the newest; the window takes whole steps, newest
    first, and from the step it ends in, the last samples in rank order.

    Args:
        runs: each rank's ``[batch size, steps]`` runs, oldest first.
        size: the window's samples.

    Returns:
        Each rank's share.
    """
    heads = [[list(run) for run in reversed(rank_runs)] for rank_runs in runs]
    shares = [0] * len(heads)
    remaining = size
    while remaining > 0 and any(heads):
        sizes = [h[0][0] if h else 0 for h in heads]
        span = min(h[0][1] for h in heads if h)
        total = sum(sizes)
        whole = span if total == 0 else min(span, remaining // total)
        for r, n in enumerate(sizes):
            shares[r] += n * whole
        remaining -= total * whole
        if whole < span:
            for r in reversed(range(len(heads))):
                take = min(sizes[r], remaining)
                shares[r] += take
                remaining -= take
            break
        for h in heads:
            if h:
                h[0][1] -= span
                if h[0][1] == 0:
                    h.pop(0)
    return shares


def _distributed(world_size: int) -> bool:
    return world_size > 1 and dist.is_available() and dist.is_initialized()


def gather_window(window: SampleWindow, world_size: int, rank: int) -> torch.Tensor:
    """The rows of the window over every rank. Collective when ``world_size`` > 1.

    Args:
        window: this rank's window (with at least one batch).
        world_size: ranks that update.
        rank: this rank.

    Returns:
        ``[n, ...]`` on the window's device, ``n <= window.size`` (rank order, oldest first).
    """
    assert window.rows is not None
    if not _distributed(world_size):
        return window.latest(min(window.count, window.size))
    shares = window_shares(all_gather([list(run) for run in window.runs]), window.size)
    longest = max(shares)
    padded = window.rows.new_zeros((longest, *window.rows.shape[1:]), device=collective_device())
    padded[: shares[rank]] = window.latest(shares[rank])
    parts = [torch.empty_like(padded) for _ in range(world_size)]
    run_collective(dist.all_gather, parts, padded)  # a dead peer: named
    return torch.cat([p[:k] for p, k in zip(parts, shares, strict=True)]).to(window.rows.device)


def all_reduce_sum(value: torch.Tensor, world_size: int) -> torch.Tensor:
    """The sum of ``value`` over every rank. Collective when ``world_size`` > 1.

    Args:
        value: this rank's tensor (not modified).
        world_size: ranks that update.

    Returns:
        The sum, on ``value``'s device.
    """
    if not _distributed(world_size):
        return value
    total = value.to(collective_device(), copy=True)
    run_collective(dist.all_reduce, total)
    return total.to(value.device)
