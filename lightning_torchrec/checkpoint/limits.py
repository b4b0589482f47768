"""How much reading one checkpoint file may cost: size caps and expansion bounds.

A checkpoint from a stranger must not be able to exhaust memory or CPU while it is being checked.
Every file a load parses is read whole into memory after its size is checked against a cap, and
what it unpickles into is bounded by its size (:attr:`CheckpointLimits.objects_per_byte`): a tiny
file cannot expand into a huge object graph through shared references. Compressed entries are
refused (``torch.save`` stores its zip entries uncompressed), so nothing inflates either.

The defaults are far above what this package writes (a ``.metadata`` of a model with thousands of
tables and hundreds of ranks is a few MiB; ``meta.pt`` a few KiB). A checkpoint you trust that is
legitimately larger loads with larger limits: ``load_sharded(..., limits=CheckpointLimits(...))``,
``consolidate(..., limits=...)``, or ``strategy.checkpoint_limits = CheckpointLimits(...)``.
"""

from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20


@dataclass(frozen=True)
class CheckpointLimits:
    """Caps on what reading a checkpoint may cost. Exceeding one raises ``CheckpointLimitError``.

    Attributes:
        max_metadata_bytes: largest DCP ``.metadata`` file read (default 256 MiB).
        max_torch_file_bytes: largest ``meta.pt`` or ``param_groups.rank{r}.pt`` (64 MiB).
        max_manifest_bytes: largest ``checksums.json`` (64 MiB).
        objects_per_byte: the objects (containers, their items, tensors, strings) a file may
            unpickle into, per byte of the file, counting shared references each time they are
            reached. Pickle needs at least one byte per reference, so a file that expands beyond
            a few objects per byte is built on shared references (a "billion laughs"). Default 4.
        min_objects: the object budget of small files (default 100,000: milliseconds of work).
        max_depth: how deep containers in ``meta.pt`` and ``param_groups`` may nest (default
            100; Lightning's checkpoint dict nests about 10 deep). A few bytes a level build a
            list nested thousands deep, which ``copy.deepcopy`` (``save_hyperparameters``) and
            ``repr`` fail on with a bare ``RecursionError``.
    """

    max_metadata_bytes: int = 256 * MiB
    max_torch_file_bytes: int = 64 * MiB
    max_manifest_bytes: int = 64 * MiB
    objects_per_byte: int = 4
    min_objects: int = 100_000
    max_depth: int = 100

    def object_budget(self, size: int) -> int:
        """The objects a file of ``size`` bytes may unpickle into.

        Args:
            size: the file's size in bytes.

        Returns:
            ``max(min_objects, objects_per_byte * size)``.
        """
        return max(self.min_objects, self.objects_per_byte * size)


#: The limits used when none are given.
DEFAULT_LIMITS = CheckpointLimits()
