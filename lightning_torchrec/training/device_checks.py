"""Batch checks on the device, read a step later: no host read of the ids on the critical path.

On a GPU the host must run ahead of the device: reading a batch's ids on the host (or any
``.item()`` on a device tensor) makes it wait for the GPU's queue. :class:`DeferredVerdict`
checks a batch *on its device* with a few reductions (no host read of the data; the shapes,
keys and dtypes it also checks are host metadata), copies the small result to pinned host
memory without blocking (:class:`HostCopy`), and reads it at the **next** step's vote, long after
the copy finished. The same code runs on the CPU (``batch_checks="next_step"``), where only the
pinned buffer and the CUDA event are left out.
When the flags say the batch was bad, the full host check
(:func:`~lightning_torchrec.training.batch_checks.validate_batch`) runs on that batch, only
then, to name the rank, step, feature, table and value.

What the tables hold in the window: the bad batch's own step has run. fbgemm's fused embedding
kernels run with ``bounds_check_mode=WARNING`` (TorchRec's default): an id outside its table is
replaced by row 0 before any memory access, so nothing is read or written out of bounds, but row 0
of that table got that step's update. fbgemm's dense kernel (``data_parallel`` tables) checks
nothing, so ``batch_checks="auto"`` reads the ids before the forward where a table has it
(:func:`judged_next_step`). The run then stops at the next step's vote with the same named
:class:`~lightning_torchrec.errors.BatchValidationError` on every rank, and a checkpoint is never
written in the window: saving settles the pending verdict first (a collective), so the last
checkpoint is the last good state. ``batch_checks="before_forward"`` keeps the strict order
(checked before the forward, at the cost of reading the ids on the host) where that matters.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from fbgemm_gpu.split_table_batched_embeddings_ops_common import BoundsCheckMode
from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
    DenseTableBatchedEmbeddingBagsCodegen,
)
from torch import nn

from lightning_torchrec.compat.upstream import fused_kernels
from lightning_torchrec.errors import BatchValidationError
from lightning_torchrec.sharding.features import FeatureSpec, specs_for
from lightning_torchrec.sharding.sharders import FUSED_KERNELS
from lightning_torchrec.training.batch_checks import (
    check_batch,
    field_of,
    kjts_of,
    out_of_range_message,
)

#: The flags one batch reduces to: ids out of range, lengths not matching the ids, negative
#: lengths, non-finite dense features, labels or weights, samples over a feature's ``max_ids``
#: and under its ``min_ids``.
FLAGS = (
    "ids",
    "lengths",
    "negative_lengths",
    "dense",
    "labels",
    "weights",
    "too_long",
    "too_short",
)

#: fbgemm's bounds-check modes that replace an id out of range by row 0 on the device.
CLAMPING_MODES = frozenset(
    m.value for m in BoundsCheckMode if m.name in ("WARNING", "IGNORE", "V2_WARNING", "V2_IGNORE")
)


def clamps_bad_ids(model: nn.Module) -> bool:
    """Whether every fbgemm embedding kernel of ``model`` clamps ids out of range on the device.

    fbgemm's split kernels (TorchRec's fused ones) replace such an id by row 0 before any memory
    access under :data:`CLAMPING_MODES` (TorchRec's default is ``WARNING``); ``FATAL`` stops the
    kernel with a device-side assert and ``NONE`` checks nothing. fbgemm's dense kernel (every
    ``data_parallel`` table's) checks nothing: on CUDA its forward reads, and its backward
    writes, at the id as given: another table's rows, memory past them, or a fault.

    Args:
        model: the sharded model (its plan names each table's kernel; the fused optimizer holds
            the fused kernels, which a sharded module does not list among its submodules).

    Returns:
        True when a bad id reaches no memory out of its table before the next step's verdict.
    """
    plan = getattr(model, "plan", None)
    shardings = [ps for m in plan.plan.values() for ps in m.values()] if plan is not None else []
    if any(ps.compute_kernel not in FUSED_KERNELS for ps in shardings):
        return False
    kernels = [*fused_kernels(getattr(model, "fused_optimizer", None)), *model.modules()]
    if any(isinstance(k, DenseTableBatchedEmbeddingBagsCodegen) for k in kernels):
        return False
    modes = [getattr(k, "bounds_check_mode_int", None) for k in kernels]
    return all(mode is None or mode in CLAMPING_MODES for mode in modes)


def judged_next_step(
    batch_checks: str, device: torch.device, specs: Mapping[str, FeatureSpec], model: nn.Module
) -> bool:
    """Whether a training batch's checks are judged at the next step (``batch_checks``).

    ``"auto"`` judges them there on CUDA where a bad batch cannot break its own step first:
    where no feature has a per-sample limit (a position-weighted or sequence model indexes by
    position: past the limit its forward fails with a device-side assert) and every embedding
    kernel clamps bad ids (:func:`clamps_bad_ids`). Elsewhere its ids are read before the forward.

    Args:
        batch_checks: ``"auto"``, ``"before_forward"`` or ``"next_step"``.
        device: the rank's device.
        specs: what each sparse feature may hold.
        model: the sharded model.

    Returns:
        True for ``"next_step"``, and for ``"auto"`` where it defers.
    """
    if batch_checks != "auto":
        return batch_checks == "next_step"
    limited = any(spec.max_ids is not None for spec in specs.values())
    return device.type == "cuda" and not limited and clamps_bad_ids(model)


def _structure(batch: Any, specs: Mapping[str, FeatureSpec]) -> str | None:
    """Checks that need no data (keys, dtypes): the host's metadata, no device sync."""
    kjts = kjts_of(batch)
    if specs and not kjts:
        return f"the batch ({type(batch).__name__}) holds no KeyedJaggedTensor"
    keys = [k for kjt in kjts for k in kjt.keys()]
    if [k for k in keys if k not in specs] or sorted(set(specs) - set(keys)):
        return "unknown or missing sparse features"
    for kjt in kjts:
        values, kjt_specs = kjt.values(), specs_for(specs, kjt.keys())
        if values.is_floating_point() or values.is_complex() or values.dtype == torch.bool:
            return "non-integer ids"
        weighted = [k for k in kjt.keys() if kjt_specs[k].weighted]
        if weighted and kjt.weights_or_none() is None:
            return "a weighted table's feature without weights"
        if values.dtype != torch.int64 and any(kjt_specs[k].managed for k in kjt.keys()):
            return "a managed-collision table's feature without int64 ids"
    return None


def device_flags(batch: Any, specs: Mapping[str, FeatureSpec]) -> torch.Tensor:
    """The batch's problems as :data:`FLAGS` counts, computed on the batch's device.

    No host read of the batch's data and no blocking copy to the device (either would make the
    host wait for the GPU's queue): each id's table size is found by its position among the
    bags' ends (``searchsorted`` on the device), the per-feature limits are copied from the
    host without blocking, and the first bad id is gathered on the device. Three more
    entries locate the first id out of range (the KJT's index, the id's position, its value):
    the embedding kernels clamp such ids to 0 in place, so they must be recorded before the
    forward.

    Args:
        batch: the batch, on its device.
        specs: what each sparse feature may hold.

    Returns:
        An ``int64`` tensor of ``len(FLAGS) + 3`` entries (the flags all zero: a good batch),
        on the device.
    """
    kjts = kjts_of(batch)
    device = kjts[0].values().device if kjts else torch.device("cpu")
    flags = torch.zeros(len(FLAGS) + 3, dtype=torch.int64, device=device)
    flags[len(FLAGS)] = -1
    for index, kjt in enumerate(kjts):
        values, lengths = kjt.values(), kjt.lengths()
        keys = list(kjt.keys())
        if not keys or lengths.numel() == 0:
            continue
        stride = lengths.numel() // len(keys)
        own = specs_for(specs, keys)  # a feature several collections read: this KJT's one
        per_bag = _to_device([own[k].num_embeddings for k in keys], device, stride)
        flags[1] += (lengths.sum() != values.numel()).long()
        flags[2] += (lengths < 0).sum()
        limits = [own[k].max_ids for k in keys]
        if any(m is not None for m in limits):
            most = _to_device([-1 if m is None else m for m in limits], device, stride)
            flags[FLAGS.index("too_long")] += ((lengths > most) & (most >= 0)).sum()
        if any(own[k].min_ids for k in keys):
            least = _to_device([own[k].min_ids for k in keys], device, stride)
            flags[FLAGS.index("too_short")] += (lengths < least).sum()
        if values.numel():
            # Each id's bag by its position against the bags' ends: no host read, and robust
            # to lengths that do not match the ids (flagged above).
            ends = torch.cumsum(lengths.clamp(min=0), 0)
            positions = torch.arange(values.numel(), device=device)
            bag = torch.searchsorted(ends, positions, right=True).clamp(max=per_bag.numel() - 1)
            limit = per_bag[bag]
            bad = (values < 0) | (values >= limit)
            count = bad.sum()
            first = torch.argmax(bad.to(torch.int8))
            unset = (flags[0] == 0) & (count > 0)
            # ``values[first]`` would read ``first`` on the host (a 0-dim index is an item()).
            value = values.index_select(0, first.reshape(1)).long()[0]
            where = torch.stack([flags.new_full((), index), first, value])
            flags[len(FLAGS) :] = torch.where(unset, where, flags[len(FLAGS) :])
            flags[0] += count
    for index, name in ((3, "dense_features"), (4, "labels"), (5, "weights")):
        t = field_of(batch, name)
        if isinstance(t, torch.Tensor) and t.is_floating_point():
            flags[index] += (~torch.isfinite(t)).sum().to(device)
    return flags


def _to_device(per_key: list[int], device: torch.device, stride: int) -> torch.Tensor:
    """One value per key, repeated for each of its ``stride`` bags, on ``device``.

    Copied from the host without blocking: ``torch.tensor(..., device=cuda)`` copies
    synchronously, and so waits for everything queued on the GPU before it.
    """
    values = torch.tensor(per_key, dtype=torch.int64)
    return values.to(device, non_blocking=True).repeat_interleave(stride)


class _Finished:
    """The CPU's stand-in for a CUDA event: work on the host is finished when its op returns."""

    def record(self) -> None:
        """Marks the point reached (nothing to wait for on the host)."""

    def synchronize(self) -> None:
        """Waits for the work before the mark (finished already on the host)."""


#: The one mark every CPU copy records.
_FINISHED = _Finished()


class HostCopy:
    """A small device tensor copied to one reused host buffer without the host waiting for it.

    The copy is started at one step and read at the next, long after it finished: no stall. The
    same code runs on every device; only two calls are the device's own (:meth:`start`): on CUDA
    the buffer is pinned (a copy from the GPU that does not block needs it) and a CUDA event marks
    the copy's end; on the CPU the buffer is an ordinary one and the event a stand-in that is
    finished when recorded.

    Args:
        size: the number of elements copied.
        dtype: their type.
    """

    def __init__(self, size: int, dtype: torch.dtype) -> None:
        self.size, self.dtype = size, dtype
        self._buffer: torch.Tensor | None = None
        self._pinned = False
        self._done: Any = None

    def start(self, tensor: torch.Tensor) -> torch.Tensor:
        """Starts copying ``tensor`` (``size`` elements, on its device) to the host buffer.

        Args:
            tensor: what to copy.

        Returns:
            The host buffer, to be read only after :meth:`wait`.
        """
        cuda = tensor.is_cuda
        if self._buffer is None or self._pinned != cuda:
            self._buffer = torch.empty(self.size, dtype=self.dtype, pin_memory=cuda)
            self._pinned = cuda
        self._buffer.copy_(tensor, non_blocking=True)
        self._done = torch.cuda.Event() if cuda else _FINISHED
        self._done.record()
        return self._buffer

    def wait(self) -> None:
        """Waits until the last copy started has reached the host buffer (normally long done)."""
        done, self._done = self._done, None
        if done is not None:
            done.synchronize()


class DeferredVerdict:
    """One batch's device check, read at the next step (see the module docstring).

    Args:
        specs: what each sparse feature may hold.
        dense_width: the expected dense width, or None.
    """

    def __init__(self, specs: Mapping[str, FeatureSpec], dense_width: int | None) -> None:
        self.specs = specs
        self.dense_width = dense_width
        self._pending: tuple[Any, str, torch.Tensor, str | None] | None = None
        self._known = False
        self._copy = HostCopy(len(FLAGS) + 3, torch.int64)

    def submit(self, batch: Any, where: str) -> None:
        """Starts checking ``batch`` (on its device) without waiting for the device.

        Args:
            batch: the step's batch, on its device.
            where: names the rank and step for the message.
        """
        problem = _structure(batch, self.specs)
        flags = self._copy.start(device_flags(batch, self.specs))
        self._pending = (batch, where, flags, problem)
        self._known = False

    def submit_known(self) -> None:
        """Marks this step as judged already (e.g. by a DataLoader worker): nothing to read."""
        self._pending = None
        self._known = True

    @property
    def pending(self) -> bool:
        """Whether a submitted step waits to be judged (also one judged already)."""
        return self._pending is not None or self._known

    def verdict(self) -> BatchValidationError | None:
        """The submitted batch's verdict (its copy finished long ago: no stall), then forgets it.

        Returns:
            The error naming where and what (from the full check of the batch), or None.
        """
        self._known = False
        if self._pending is None:
            return None
        batch, where, flags, problem = self._pending
        self._pending = None
        self._copy.wait()
        counts = flags[: len(FLAGS)].tolist()
        if problem is None and not any(counts):
            return None
        if counts[0] and problem is None:  # ids were clamped in place: use the record
            kjt_index, position, value = flags[len(FLAGS) :].tolist()
            kjt = kjts_of(batch)[kjt_index]
            text = out_of_range_message(kjt, self.specs, position, value, counts[0])
            return BatchValidationError(f"{where}: {text}")
        found = check_batch(batch, self.specs, self.dense_width, where)
        if found is None:  # the flags and the full check disagree: report the flags
            named = dict(zip(FLAGS, counts, strict=True))
            found = BatchValidationError(f"{where}: {problem or named}")
        return found
