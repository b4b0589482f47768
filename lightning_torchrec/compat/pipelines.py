"""TorchRec's train pipelines, cut where Lightning's loop takes over.

A TorchRec train pipeline owns the whole step in ``progress()``: forward, backward, optimizer
step. Under Lightning the loop owns the backward and the optimizer step (its closure), so these
subclasses stop ``progress()`` before the backward. They override TorchRec methods (and read
pipeline attributes) whose names, signatures and order are the same from torchrec 1.6.1 through
1.9; ``make test-compat`` runs the pipeline tests against both ends.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torchrec.distributed.train_pipeline.runtime_forwards import EmbeddingPipelinedForward

# The package ``torchrec.distributed.train_pipeline`` does not export TrainPipelineSemiSync
# (torchrec 1.6.1 through 1.9): both pipelines come from their module.
from torchrec.distributed.train_pipeline.train_pipelines import (
    TrainPipelineSemiSync,
    TrainPipelineSparseDist,
)
from typing_extensions import override

__all__ = ["ForwardOnlySparseDist", "StagedSemiSync", "called_twice", "pipelined_modules"]


def called_twice(error: BaseException) -> bool:
    """Whether ``error`` is TorchRec's refusal of a pipelined module called twice in a forward.

    A pipelined embedding module consumes its batch's input all-to-all at its first call; a
    second call in the same forward (one collection applied to two KJTs) fails with an
    ``AssertionError`` raised inside TorchRec's pipelined forward ("Invalid PipelinedForward
    usage", torchrec 1.8+; a bare assertion there before).

    Args:
        error: what the first pipelined forward raised.

    Returns:
        True for that refusal.
    """
    if not isinstance(error, AssertionError):
        return False
    if "Invalid PipelinedForward usage" in str(error):
        return True
    frames = error.__traceback__
    while frames is not None and frames.tb_next is not None:
        frames = frames.tb_next
    where = frames.tb_frame.f_code.co_filename if frames is not None else ""
    return "train_pipeline" in where and "torchrec" in where


class _FirstForwards:
    """``detach()`` that gives a module called twice per forward its own forward back.

    TorchRec's rewrite lists such a module once per call site (``_pipelined_modules``), and
    records as its "original" forward at the second site the pipelined one it installed at the
    first; ``detach()`` restores them in order and leaves the pipelined forward in place (so do
    its input dists' forwards). Restoring the first recorded forward of each undoes that.
    """

    def detach(self) -> nn.Module:
        modules = list(getattr(self, "_pipelined_modules", []))
        firsts = list(zip(modules, getattr(self, "_original_forwards", []), strict=False))
        dists = [
            found._dist
            for module in modules
            for _, child in module.named_modules()
            for found in getattr(child, "_input_dists", [])
            if hasattr(found, "_dist")
        ]
        firsts += zip(dists, getattr(self, "_original_kjt_dist_forwards", []), strict=False)
        model = super().detach()  # type: ignore[misc]
        restored: set[int] = set()
        for owner, forward in firsts:
            if id(owner) not in restored:
                restored.add(id(owner))
                owner.forward = forward
        return model


class ForwardOnlySparseDist(_FirstForwards, TrainPipelineSparseDist):
    """TorchRec's sparse-dist pipeline whose ``progress()`` leaves the backward to the caller.

    ``TrainPipelineSparseDist._backward`` is the one step of ``progress()`` that Lightning must
    own (its closure runs the backward after the training step); the optimizer step is disabled
    by giving the pipeline a no-op optimizer.
    """

    @override
    def _backward(self, losses: torch.Tensor) -> None:
        pass


def pipelined_modules(pipeline: Any) -> list[nn.Module]:
    """The sharded modules a TorchRec train pipeline rewrote (``_pipelined_modules``).

    Args:
        pipeline: a ``TrainPipelineSparseDist`` (or a subclass).

    Returns:
        The modules whose input dist the pipeline runs ahead.
    """
    return list(getattr(pipeline, "_pipelined_modules", []))


class _CpuEmbeddingPipelinedForward(EmbeddingPipelinedForward):
    """The semi-sync pipeline's forward of a sharded module, also on CPU.

    TorchRec's forwards take their device from the data-dist stream, and assume CUDA without
    one (there is none on CPU); ``EmbeddingPipelinedForward`` then asks CUDA for its current
    stream, and ``detach_embeddings`` records the pooled output on it unconditionally, which CPU
    tensors refuse. Without a stream the device is the CPU and that one call is skipped (one
    stream, nothing to order); with a stream TorchRec's code runs unchanged.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self._stream is None:
            self._device = torch.device("cpu")

    @override
    def detach_embeddings(self, embeddings: Any, cur_stream: Any) -> None:
        values = embeddings.values() if callable(getattr(embeddings, "values", None)) else None
        if not isinstance(values, torch.Tensor) or values.device.type != "cpu":
            super().detach_embeddings(embeddings, cur_stream)
            return
        embeddings.record_stream = lambda stream: None  # this object only, for this call
        try:
            super().detach_embeddings(embeddings, cur_stream)
        finally:
            del embeddings.record_stream


class StagedSemiSync(_FirstForwards, TrainPipelineSemiSync):
    """TorchRec's semi-synchronous pipeline, its ``progress()`` cut around Lightning's backward.

    ``TrainPipelineSemiSync.progress`` runs, for batch ``i``: the dense forward of ``i`` on
    embeddings looked up earlier; in the semi-synchronous phase, the embedding lookup of
    ``i + 1`` (it reads the tables *before* batch ``i``'s update: one batch of staleness, and its
    output all-to-all overlaps ``i``'s backward); the backward; the embedding backward (where
    the fused optimizer updates the tables); the dense optimizer step; and, in the synchronous
    phase, the lookup of ``i + 1`` after the update.

    Here :meth:`forward_stage` runs up to the backward, :meth:`embedding_backward_stage` runs
    after Lightning's backward (before its optimizer step), and the synchronous phase's lookup
    of the next batch runs at the start of the next :meth:`forward_stage` (nothing touches the
    tables in between). Whether a step is semi-synchronous is the caller's decision (Lightning's
    global step against ``start_batch``), not the pipeline's batch index, which restarts with
    every epoch's :meth:`reset`.

    On CPU the lookup and the pipelined forward skip ``record_stream``: TorchRec records tensors
    on the CPU "stream", which CPU tensors refuse; with one stream there is nothing to order.
    """

    _pipelined_forward_type = _CpuEmbeddingPipelinedForward

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._pending: Any = None
        self._lookup_due = False

    @override
    def reset(self) -> None:
        super().reset()
        self._pending = None
        self._lookup_due = False

    def forward_stage(self, dataloader_iter: Iterator[Any], semi_sync: bool) -> Any:
        """``progress()`` up to the backward: the forward of the current batch.

        Args:
            dataloader_iter: the pipeline's side of the epoch's batches.
            semi_sync: look the next batch up now, before this batch's update (else after it,
                at the next call).

        Returns:
            What the pipeline's model forward returned.

        Raises:
            StopIteration: when no batch is left.
        """
        if not self._model_attached:
            self.attach(self._model)
        if self._lookup_due and self.batches:
            torch.get_device_module(self._device).synchronize()  # TorchRec's: avoids a race
            self.start_embedding_lookup(self.batches[0], self.contexts[0])
        self._lookup_due = False
        self.fill_pipeline(dataloader_iter)
        if not self.batches:
            raise StopIteration
        if getattr(self, "_clear_data_dist_inputs", False):  # torchrec 1.8+
            self.clear_sparse_data_dist_inputs(self.contexts[0])
        if len(self.batches) >= 3:
            self.start_sparse_data_dist(self.batches[2], self.contexts[2])
        batch, context = self.batches[0], self.contexts[0]
        _, output = self._mlp_forward(batch, context)
        self.dequeue_batch()
        del batch
        del context.postproc_fwd_results
        self.enqueue_batch(dataloader_iter)
        if self.batches and semi_sync:
            self.start_embedding_lookup(self.batches[0], self.contexts[0])
        if len(self.batches) >= 2:
            self.wait_sparse_data_dist(self.contexts[1])
        self._pending = context
        self._lookup_due = not semi_sync
        return output

    def embedding_backward_stage(self) -> None:
        """After Lightning's backward: the tables' backward (the fused update) of that batch."""
        context, self._pending = self._pending, None
        if context is None:
            return
        self.embedding_backward(context)
        self.sync_embeddings(self._model, self._dmp_collection_sync_interval_batches, context)

    @override
    def _mlp_forward(self, batch: Any, context: Any) -> Any:
        if self._device.type != "cpu":
            return super()._mlp_forward(batch, context)
        context.events.clear()  # CPU events are complete when recorded
        return self._model_fwd(batch)

    @override
    def start_embedding_lookup(self, batch: Any, context: Any) -> None:
        if self._device.type != "cpu":
            super().start_embedding_lookup(batch, context)
            return
        if batch is None:
            return
        for module in self._pipelined_modules:
            name = module.forward.name
            kjt = context.input_dist_tensors_requests[name].wait()
            context.embedding_a2a_requests[name] = module.compute_and_output_dist(
                context.module_contexts[name], kjt
            )
