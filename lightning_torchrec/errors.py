"""Every exception type of the package, in one place (the bottom layer: imports nothing).

Each error names its culprit (the table, key, id, file or rank). Errors found on one rank are
agreed across ranks by :func:`lightning_torchrec.distributed.agree`: every rank raises the same
type, and the message says which rank found what.
"""

from __future__ import annotations

import pickle


class BatchValidationError(ValueError):
    """A batch the model cannot train on; the message names the feature, table, value, sample."""


class CheckpointMismatchError(ValueError):
    """A checkpoint's tensors do not fit the model or optimizer it is loaded into."""


class ManagedCollisionLayoutError(CheckpointMismatchError):
    """A checkpoint's managed-collision state was sharded over other rows per rank than now.

    Names the tables, the saved and current row-wise shards and the number of ranks of each.
    A managed-collision module's state is per shard (the raw ids of the shard's bucket, and one
    row for the ids of that bucket it has not admitted), so it does not carry over exactly to
    another world size; such a load is refused before anything is read.
    """


class NonFiniteLossError(FloatingPointError):
    """The training loss was NaN or infinite on some rank."""


class NonFiniteCheckpointError(ValueError):
    """A checkpoint would have stored a NaN or infinite weight or optimizer state."""


class PeerFailureError(RuntimeError):
    """A collective failed because another rank died or stopped answering."""


class MidStepCheckpointError(RuntimeError):
    """A checkpoint was asked for between a training backward and its optimizer step.

    The fused tables already hold the step's update (they update inside the backward) while
    the dense weights do not, so it could not resume exactly; nothing is written.
    """


class Preempted(SystemExit):
    """Raised on every rank after the preemption checkpoint was written."""


class StopRequested(Exception):
    """Some rank asked every rank to stop before a training step (e.g. it received SIGTERM).

    Raised on every rank at the same step by the step's vote; ``ranks`` are the ranks that asked.
    """

    def __init__(self, ranks: list[int]) -> None:
        super().__init__(f"rank(s) {ranks} asked to stop")
        self.ranks = ranks


class RankFailureError(RuntimeError):
    """Another rank failed with an error that could not be re-created here; names the rank."""


class UnevenDataError(RuntimeError):
    """Ranks have different numbers of batches; every rank raises it, with the counts."""


class CheckpointCorruptError(ValueError):
    """A checkpoint file is damaged (checksum mismatch, truncated, unreadable); names the file."""


class UnsafeCheckpointError(pickle.UnpicklingError, ValueError):
    """A checkpoint file holds objects that could run code when loaded; names the file.

    Also a ``pickle.UnpicklingError``: what refused ``meta.pt`` files raised before.
    """


class UnsupportedDtypeError(ValueError):
    """A tensor's dtype the output format has no name for (safetensors: ``complex64``...)."""


class CheckpointWriteError(OSError):
    """Writing a checkpoint failed on some rank (e.g. disk full); names the file and the rank."""


class ShardingConflictError(ValueError):
    """A model sharded before is asked to shard differently (another plan, constraints, ...)."""


class CheckpointSignatureError(UnsafeCheckpointError):
    """A checkpoint is unsigned or its manifest's signature does not match the key; names it."""


class CheckpointLimitError(ValueError):
    """A checkpoint file is larger, or expands to more, than the reading limits allow; names it.

    The limits (``lightning_torchrec.checkpoint.limits.CheckpointLimits``) bound what a
    stranger's file can cost; raise them for a checkpoint you trust that is legitimately larger.
    """


class ServedInputError(ValueError):
    """A request an exported model refuses (lengths that do not match the ids); names features."""


class IdOutOfRangeError(ServedInputError, IndexError):
    """An id outside its table, refused by an exported model; names feature, table, id, rows.

    The message also names the sample the id is in.

    Also an ``IndexError``: what a float model's lookup of such an id raised before.
    """


class PartitionError(ValueError):
    """A stream partition that cannot be trained on; names the partition and what is wrong.

    Missing, unreadable, or with other columns than the stream's first partition.
    """


class DeltaRefusedError(ValueError):
    """A delta that cannot be applied; names the delta and the reason.

    Out of order, a gap in its chain, another model, an id outside its table, a damaged or
    unsigned file. Nothing of it was applied: the model keeps its last good state.
    """
