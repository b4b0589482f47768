"""TorchRec's train pipelines under Lightning's loop, with ``training_step`` unchanged.

``TrainPipelineSparseDist`` overlaps the next batch's host-to-device copy and sparse input
all-to-all with the current batch's forward and backward; ``TrainPipelineSemiSync`` also looks
the next batch's embeddings up before this batch's table update, so their output all-to-all
overlaps the backward. A TorchRec pipeline normally owns the loop (``progress(dataloader_iter)``
runs forward, backward and optimizer step). Here Lightning keeps the loop, the backward and the
optimizer step:

* :class:`PipelineFeed` wraps the training dataloader: Lightning and the pipeline read the same
  batches through ``itertools.tee`` (the pipeline reads up to three batches ahead); each epoch's
  iterator resets the pipeline.
* :class:`SparseDistPipeline` runs ``progress()`` once per Lightning training step with a model
  forward that is the strategy's ``training_step`` on the pipeline's (device) copy of the batch;
  the pipeline's own backward and optimizer step are disabled
  (:class:`~lightning_torchrec.compat.pipelines.ForwardOnlySparseDist`), so the order of
  collectives and updates is TorchRec's: input dist of batch ``i + 1`` before the forward of
  batch ``i``, its completion before the backward of batch ``i``.
* :class:`SemiSyncPipeline` runs TorchRec's semi-sync ``progress()`` cut in two
  (:class:`~lightning_torchrec.compat.pipelines.StagedSemiSync`): up to the backward inside the
  training step, the tables' backward (their fused update) right after Lightning's backward.
* A model TorchRec cannot trace, or whose forward calls a sharded module twice
  (:meth:`SparseDistPipeline.first_step`), trains unpipelined.
* Validation, test and predict run through a forward-only sparse-dist pipeline with the model in
  eval mode (``progress()`` then runs the forward only: the shape of TorchRec's
  ``EvalPipelineSparseDist``, whose fixed ``model(batch)`` forward cannot call
  ``validation_step``). The training pipeline detaches (restores the sharded modules' forwards)
  before evaluation and re-attaches at the next training step; the evaluation one detaches at
  the end of each evaluation.

The pipeline traces ``LightningModule.forward(batch)`` (TorchRec's FX tracer) to find the inputs
of the sharded modules: ``training_step`` must reach them through ``forward`` with the same batch.
Where TorchRec cannot pipeline a sharded module, :meth:`SparseDistPipeline.unpipelined` names it
and the strategy trains without the pipeline.

The batches a pipeline reads ahead of the loop are checked before they travel: a TorchRec
pipeline starts their sparse input all-to-all (and, semi-sync, their embedding lookup) steps
early, and a malformed batch on one rank can break a collective the others are already in, so
its verdict is agreed by every rank *before* that happens, not at its own step.
:class:`Lookahead` lets the step read those batches first: at each step it returns the batches
the coming ``progress()`` will send, so the step's one vote covers them. :class:`Peek` reads one
batch ahead for the unpipelined step, whose vote on the next batch runs during the current step.
"""

from __future__ import annotations

import inspect
import logging
from collections import deque
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchrec.distributed.types import ShardedModule

from lightning_torchrec.compat.pipelines import (
    ForwardOnlySparseDist,
    StagedSemiSync,
    called_twice,
    pipelined_modules,
)

log = logging.getLogger(__name__)


class Split:
    """One iterator read from two sides, each side getting every item once, in order.

    Unlike ``itertools.tee``, which frees its items in blocks of 57, an item is held only until
    both sides have taken it: a side reading ahead holds one batch or two, not a block of them.
    A side that is dropped (a pipeline given up, a reader no longer needed) stops holding items
    for itself: the other side goes on alone.

    Args:
        source: the iterator to share.
    """

    def __init__(self, source: Iterator[Any]) -> None:
        self._source = source
        self._waiting: tuple[deque[Any], deque[Any]] = (deque(), deque())
        self._dropped = [False, False]
        self._ended = False

    def sides(self) -> tuple[Iterator[Any], Iterator[Any]]:
        """The two sides.

        Returns:
            Two iterators over the source's items.
        """
        return _Side(self, 0), _Side(self, 1)

    def take(self, side: int) -> Any:
        """The next item of ``side``.

        Args:
            side: 0 or 1.

        Returns:
            The item.

        Raises:
            StopIteration: after the source's last item.
        """
        mine = self._waiting[side]
        if mine:
            return mine.popleft()
        if self._ended:
            raise StopIteration
        try:
            item = next(self._source)
        except StopIteration:
            self._ended = True
            raise
        if not self._dropped[1 - side]:
            self._waiting[1 - side].append(item)
        return item

    def drop(self, side: int) -> None:
        """Forgets ``side``: what it has not taken is released, and nothing more is kept for it.

        Args:
            side: 0 or 1.
        """
        self._dropped[side] = True
        self._waiting[side].clear()

    def close(self) -> None:
        """Ends the source now, for both sides (at the end of a stage).

        A multi-worker loader's iterator left to the garbage collector (this object sits in
        reference cycles with the strategy) is finalized after its queues: its workers never
        get the word to exit, and its shutdown waits 5 s for each before killing it. Ended
        here, its workers exit at once. A generator source (a loader whose ``__iter__``
        yields) is closed, which ends the iterator it holds.
        """
        source, self._source = self._source, iter(())
        self._ended = True
        for waiting in self._waiting:
            waiting.clear()
        if inspect.isgenerator(source):
            source.close()


class _Side:
    def __init__(self, split: Split, side: int) -> None:
        self._split, self._side = split, side

    def __iter__(self) -> _Side:
        return self

    def __next__(self) -> Any:
        return self._split.take(self._side)

    def __del__(self) -> None:
        self._split.drop(self._side)

    def close(self) -> None:
        self._split.close()


class _Reader:
    """What reads one side of an epoch's batches ahead of Lightning."""

    _batches: Iterator[Any]

    def close(self) -> None:
        """Ends the epoch's iterator, for both sides (see :meth:`Split.close`)."""
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()


class Lookahead(_Reader):
    """An iterator over an epoch's batches that can be read ahead of its consumer (the pipeline).

    Args:
        batches: the pipeline's side of the epoch's batches.
    """

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._buffer: deque[Any] = deque()
        self._read = 0
        self._steps = 0
        self._unchecked: list[tuple[int, Any]] = []
        self._first_index: int | None = None
        #: Whether :meth:`ahead` found the epoch's end (fewer batches than it reads ahead).
        self.exhausted = False

    def __iter__(self) -> Lookahead:
        return self

    def __next__(self) -> Any:
        if self._buffer:
            return self._buffer.popleft()
        batch = next(self._batches)
        self._unchecked.append((self._read, batch))
        self._read += 1
        return batch

    def ahead(self, depth: int, batch_idx: int) -> list[tuple[int, Any]]:
        """Reads the batches the next step's ``progress()`` sends, and returns the new ones.

        Call once per step, before that step's ``progress()`` (or, voting ahead, after the
        previous step's forward).

        Args:
            depth: how many batches past the current one that ``progress()`` sends early (1 for
                sparse-dist, 2 for semi-sync).
            batch_idx: Lightning's index of the current batch in the epoch.

        Returns:
            ``(index in the epoch, batch)`` of every batch read since the last call (normally
            the one ``depth`` places ahead; at the first step, the first ``depth + 1``).
        """
        if self._first_index is None:
            self._first_index = batch_idx
        self._steps += 1
        while self._read < self._steps + depth:
            try:
                batch = next(self._batches)
            except StopIteration:
                self.exhausted = True
                break
            self._buffer.append(batch)
            self._unchecked.append((self._read, batch))
            self._read += 1
        found, self._unchecked = self._unchecked, []
        return [(self._first_index + position, batch) for position, batch in found]


class Peek(_Reader):
    """An epoch's batches read one step ahead of their consumer, and kept by it alone.

    Args:
        batches: the reader's side of the epoch's batches (the consumer has the other side).
    """

    def __init__(self, batches: Iterator[Any]) -> None:
        self._batches = batches
        self._first: int | None = None
        self._read = 0
        self._last: Any = None
        self._ended = False

    def after(self, batch_idx: int) -> tuple[bool, Any]:
        """Reads up to the batch after ``batch_idx`` (the current one).

        Call at each step: batches passed over are dropped here, so none is held twice.

        Args:
            batch_idx: Lightning's index of the current batch in the epoch.

        Returns:
            ``(True, batch)`` with the next batch, or ``(False, None)`` at the epoch's end.
        """
        if self._first is None:
            self._first = batch_idx
        wanted = batch_idx - self._first + 1
        while not self._ended and self._read <= wanted:
            try:
                self._last = next(self._batches)
            except StopIteration:
                self._ended, self._last = True, None
            self._read += 1
        return (False, None) if self._ended else (True, self._last)


class PipelineFeed:
    """A dataloader whose batches a pipeline reads ahead of Lightning.

    Everything but iteration is the wrapped loader's (``len``, ``sampler``, ``dataset``, ...).
    Once the pipeline is dropped (``active()`` False), iteration is the loader's own: no batch
    is buffered for a reader that will never come.

    Args:
        loader: the dataloader.
        on_epoch: called with the reader's side (``reader(batches)``) whenever a new epoch's
            iterator is made.
        active: whether the reader still reads.
        reader: what reads ahead: :class:`Lookahead` (a pipeline) or :class:`Peek`.
    """

    def __init__(
        self,
        loader: Any,
        on_epoch: Callable[[Any], None],
        active: Callable[[], bool] = lambda: True,
        reader: Callable[[Iterator[Any]], Any] = Lookahead,
    ) -> None:
        self.loader = loader
        self.on_epoch = on_epoch
        self.active = active
        self.reader = reader

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)

    def __iter__(self) -> Iterator[Any]:
        if not self.active():
            return iter(self.loader)
        lightning_side, reader_side = Split(iter(self.loader)).sides()
        self.on_epoch(self.reader(reader_side))
        return lightning_side


def epoch_ending(pipeline: Any, batch_idx: int, last: bool, steps: int = 0) -> tuple[int, bool]:
    """What the vote for the step ``steps`` after ``batch_idx``'s says of the epoch's end.

    The flag must be the same on every rank, else ``UnevenDataError`` names the flagged ranks
    as having ``index + 1`` batches. Unpipelined: Lightning's "no batch after this one". A
    pipeline's ``progress()`` sends the batch ``depth`` places ahead (sparse-dist 1, semi-sync
    2): a rank whose epoch ends before it (its read-ahead found the end) is flagged, as having
    that many, before any rank sends it (a batch only some ranks send mismatches collectives).

    Args:
        pipeline: the stage's pipeline (its ``depth`` and ``exhausted``), or None.
        batch_idx: the current batch's index in the epoch.
        last: whether this rank has no batch after the current one.
        steps: how many steps after the current one the vote is for.

    Returns:
        ``(index, flag)``: the batch index the message counts to, and this rank's flag.
    """
    if pipeline is None:
        return batch_idx, last
    return batch_idx + steps + pipeline.depth - 1, last or pipeline.exhausted


#: Why TorchRec could not pipeline a model: its forward calls a module twice; or it cannot trace.
TWICE = "a sharded embedding module is called twice per forward; TorchRec pipelines one call"
UNTRACED = "TorchRec's tracer of LightningModule.forward(batch) must find the sharded modules'"
UNTRACED += " inputs as attributes of the batch"

#: The pipelines a strategy takes; ``"auto"`` picks one per device
#: (:func:`~lightning_torchrec.training.steps.choose_mode`).
PIPELINES = (None, "auto", "sparse_dist", "semi_sync")

#: ``pipeline_options`` each pipeline takes (TorchRec's constructor arguments of the same name).
PIPELINE_OPTIONS: dict[str, set[str]] = {"sparse_dist": set(), "semi_sync": {"start_batch"}}

#: TorchRec's default for ``TrainPipelineSemiSync(start_batch=...)``.
SEMI_SYNC_START_BATCH = 900


@dataclass(frozen=True)
class PipelineConfig:
    """The train pipeline a strategy asked for, checked and defaulted once (:meth:`parse`).

    Attributes:
        kind: ``None``, ``"auto"``, ``"sparse_dist"`` or ``"semi_sync"``.
        start_batch: ``"semi_sync"``: the first global step whose next batch is looked up
            before the update (TorchRec's default 900 keeps the first steps synchronous).
    """

    kind: str | None = None
    start_batch: int = SEMI_SYNC_START_BATCH

    @classmethod
    def parse(cls, pipeline: str | None, options: dict[str, Any] | None) -> PipelineConfig:
        """Checks ``TorchRecStrategy(pipeline=..., pipeline_options=...)``.

        Args:
            pipeline: the pipeline's name (one of :data:`PIPELINES`).
            options: its options: ``{"start_batch": N}`` for ``"semi_sync"``.

        Returns:
            The config.

        Raises:
            ValueError: for an unknown pipeline, an option the pipeline does not take (naming
                it), or a ``start_batch`` that is not a non-negative int.
        """
        if pipeline not in PIPELINES:
            raise ValueError(f"pipeline must be one of {PIPELINES}, got {pipeline!r}")
        options = dict(options or {})
        allowed = PIPELINE_OPTIONS.get(pipeline or "", set())
        for key in options:
            if key not in allowed:
                why = (
                    " (semi_sync's dense part is always synchronous here: Lightning's optimizer "
                    "step cannot be skipped at the switch)"
                    if key == "stash_gradients"
                    else ""
                )
                raise ValueError(
                    f"pipeline_options[{key!r}] is not an option of pipeline={pipeline!r}; it "
                    f"takes {sorted(allowed) or 'none'}{why}"
                )
        start = options.get("start_batch", SEMI_SYNC_START_BATCH)
        if not isinstance(start, int) or isinstance(start, bool) or start < 0:
            raise ValueError(f"pipeline_options['start_batch'] must be an int >= 0, got {start!r}")
        return cls(pipeline, start)


class _NoOptimizer:
    """The pipeline's optimizer: Lightning zeroes gradients and steps the real one."""

    param_groups: list[dict[str, Any]] = []  # noqa: RUF012 (read-only, always empty)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Does nothing (``set_to_none`` is ignored)."""

    def step(self, closure: Any = None) -> None:
        """Does nothing (``closure`` is ignored)."""


class SparseDistPipeline:
    """One TorchRec sparse-dist pipeline driven by Lightning's training steps.

    Args:
        model: the ``DistributedModelParallel``.
        device: the rank's device.
        asked: whether the user asked for this pipeline by name (a model it cannot pipeline
            then gets a warning; under ``pipeline="auto"``, an INFO line).
    """

    #: Batches past the current one whose input all-to-all ``progress()`` starts.
    depth = 1

    def __init__(self, model: nn.Module, device: torch.device, asked: bool = True) -> None:
        self.asked = asked
        self._step: Callable[[Any], Any] | None = None
        self._pipeline = self._make(model, device)
        self._model = model
        self._iterator: Lookahead | None = None
        self.checked = False
        self.dropped = False

    #: The TorchRec pipeline class, and its arguments beyond the common ones.
    _kind: type[ForwardOnlySparseDist | StagedSemiSync] = ForwardOnlySparseDist

    def _options(self) -> dict[str, Any]:
        return {}

    def _make(
        self, model: nn.Module, device: torch.device
    ) -> ForwardOnlySparseDist | StagedSemiSync:
        return self._kind(
            model=model,
            optimizer=_NoOptimizer(),  # type: ignore[arg-type]
            device=device,
            execute_all_batches=True,
            custom_model_fwd=self._forward,
            **self._options(),
        )

    def _progress(self, iterator: Iterator[Any]) -> Any:
        return self._pipeline.progress(iterator)

    def after_backward(self) -> None:
        """Called after Lightning's backward of a training step (nothing to do here)."""

    def _forward(self, batch: Any) -> tuple[None, Any]:
        assert self._step is not None
        return None, self._step(batch)

    def new_epoch(self, iterator: Lookahead) -> None:
        """Starts over with a new epoch's batches (drops batches still in flight).

        Args:
            iterator: the pipeline's side of the epoch's iterator.
        """
        self._pipeline.reset()
        self._iterator = iterator

    def ahead(self, batch_idx: int) -> list[tuple[int, Any]]:
        """The batches this step's ``progress()`` sends that were not checked yet.

        Args:
            batch_idx: Lightning's index of the current batch.

        Returns:
            ``(index in the epoch, host batch)`` pairs (see :meth:`Lookahead.ahead`).
        """
        return [] if self._iterator is None else self._iterator.ahead(self.depth, batch_idx)

    @property
    def exhausted(self) -> bool:
        """Whether the epoch ended within the batches :meth:`ahead` read."""
        return self._iterator is not None and self._iterator.exhausted

    def feed(self, loader: Any) -> PipelineFeed:
        """Wraps a training dataloader so the pipeline reads its batches ahead.

        Args:
            loader: the training dataloader.

        Returns:
            The wrapped loader (give it to Lightning).
        """
        return PipelineFeed(loader, self.new_epoch, lambda: not self.dropped)

    def train_step(self, step: Callable[[Any], Any]) -> Any:
        """Runs one pipelined step: ``step(device_batch)`` is the forward of the current batch.

        Args:
            step: runs the training step on the pipeline's copy of the current batch and
                returns its output (the loss); Lightning does the backward and the update.

        Returns:
            What ``step`` returned.
        """
        assert self._iterator is not None, "the training dataloader was not fed to the pipeline"
        self._step = step
        try:
            return self._progress(self._iterator)
        finally:
            self._step = None

    def first_step(self, step: Callable[[Any], Any]) -> tuple[Any, Exception | None]:
        """:meth:`train_step` for the first step, when TorchRec traces and rewrites the model.

        Args:
            step: as for :meth:`train_step`.

        Returns:
            ``(output, None)``; or ``(None, error)`` when TorchRec failed before the forward (its
            tracer) or at a sharded module's second call in it (on every rank; no weight has
            changed): the model is detached and the caller runs the step unpipelined.
        """
        ran = []

        def tracked(batch: Any) -> Any:
            ran.append(True)
            return step(batch)

        try:
            return self.train_step(tracked), None
        except Exception as e:
            if ran and not called_twice(e):
                raise
            self.detach()
            return None, e

    def run(self, step: Callable[[Any], Any], unpipelined: Callable[[], Any]) -> tuple[Any, bool]:
        """One step through the pipeline; on the first, check what TorchRec could pipeline.

        Args:
            step: runs the step on the pipeline's copy of the current batch.
            unpipelined: runs the step without the pipeline (when TorchRec cannot trace).

        Returns:
            ``(output, usable)``: ``usable`` False means TorchRec cannot pipeline the model (a
            warning names why) and ``output`` came from ``unpipelined``; drop the pipeline.
        """
        if self.checked:
            return self.train_step(step), True
        self.checked = True
        output, error = self.first_step(step)
        missed = self.unpipelined() if error is None else [repr(error)[:300]]
        if missed:
            why = TWICE if error is not None and called_twice(error) else UNTRACED
            done = "It runs without the pipeline." if error else "They run unpipelined."
            message = f"TorchRec's train pipeline cannot pipeline this model ({missed}): {why}."
            message += f" {done}"
            if self.asked:
                rank_zero_warn(message)
            else:
                log.info(message)
        if error is not None:
            self.dropped, self._iterator = True, None
            return unpipelined(), False
        return output, True

    def detach(self) -> None:
        """Restores the sharded modules' own forwards (before evaluation)."""
        self._pipeline.detach()

    def release(self) -> None:
        """At the end of a fit or evaluation: detaches and drops the batches and the iterator.

        The pipeline's side of the loader keeps its iterator (and a multi-worker loader's
        worker processes and feeder threads) alive while held; a later loader of the same
        process would fork its workers next to those threads.
        """
        self.detach()
        self._pipeline.reset()
        if self._iterator is not None:  # its workers exit now (see ``Split.close``)
            self._iterator.close()
        self._iterator = None

    def unpipelined(self) -> list[str]:
        """Sharded modules TorchRec's tracer could not pipeline (after the first step).

        Returns:
            Their names in the model; empty when every sharded module is pipelined.
        """
        inner = self._model.module if hasattr(self._model, "module") else self._model
        sharded = {id(m): n for n, m in inner.named_modules() if isinstance(m, ShardedModule)}
        done = {id(m) for m in pipelined_modules(self._pipeline)}
        return sorted(name for key, name in sharded.items() if key not in done)


class SemiSyncPipeline(SparseDistPipeline):
    """TorchRec's semi-synchronous pipeline driven by Lightning's training steps.

    From global step ``start_batch`` on, the embeddings of batch ``i + 1`` are looked up before
    batch ``i``'s table update (one batch of staleness for the tables; the dense part stays
    synchronous), so their output all-to-all overlaps the backward of batch ``i``. Before it,
    steps are synchronous (the same results as ``pipeline=None``). The table update runs after
    Lightning's backward (:meth:`after_backward`), before its optimizer step, as in TorchRec's
    ``TrainPipelineSemiSync.progress``.

    Args:
        model: the ``DistributedModelParallel``.
        device: the rank's device.
        start_batch: the first global step that looks the next batch up early.
        global_step: returns Lightning's global step (the number of finished steps).
        asked: see :class:`SparseDistPipeline`.
    """

    depth = 2

    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        start_batch: int,
        global_step: Callable[[], int],
        asked: bool = True,
    ) -> None:
        self.start_batch = start_batch
        self._global_step = global_step
        super().__init__(model, device, asked)

    _kind = StagedSemiSync

    def _options(self) -> dict[str, Any]:
        return {"start_batch": self.start_batch}

    def _progress(self, iterator: Iterator[Any]) -> Any:
        semi_sync = self._global_step() >= self.start_batch
        return self._pipeline.forward_stage(iterator, semi_sync)  # type: ignore[attr-defined]

    def after_backward(self) -> None:
        """The tables' backward and fused update of the batch whose backward Lightning ran."""
        self._pipeline.embedding_backward_stage()  # type: ignore[attr-defined]
