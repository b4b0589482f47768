"""Warnings and log records that only a dependency can fix, each silenced at its source.

Every entry says why it fires and why the package cannot avoid it; :func:`filter_upstream_warnings`
applies them when ``lightning_torchrec`` is imported, and ``tests/conftest.py`` turns the same
list into pytest filters (the rest of the package's and its dependencies' deprecations fail the
tests). Warnings the package itself could avoid are avoided instead.
"""

from __future__ import annotations

import logging
import warnings
from typing import Any

#: Warnings that only a dependency can fix: (message regex, category, module regex, why). No
#: colons in the regexes: pytest reads them as ini filters too (tests/conftest.py).
UPSTREAM_WARNINGS: list[tuple[str, type[Warning], str, str]] = [
    (
        "guard_size_oblivious will be removed",
        FutureWarning,
        r"torchrec\.pt2\.checks",
        "TorchRec 1.6's pt2_guard_size_oblivious calls torch's deprecated guard_size_oblivious "
        "when the export traces a quantized EmbeddingCollection (its KJT permute).",
    ),
    (
        "_check_is_size will be removed",
        FutureWarning,
        r"torchrec\.pt2\.checks",
        "TorchRec 1.6's pt2_checks_all_is_size calls torch's deprecated _check_is_size in the "
        "same trace.",
    ),
    (
        "`broadcast_buffers` is deprecated",
        FutureWarning,
        r"torchrec\.distributed\..*",
        "TorchRec's DistributedModelParallel (torchrec <= 1.9) builds its DDP wrappers with "
        "broadcast_buffers=False, which torch 2.13 deprecates.",
    ),
    (
        "Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        r"torch\.distributed\.checkpoint\..*",
        "TorchRec's sharded tables are ShardedTensors in their state dicts; "
        "torch.distributed.checkpoint warns each time it plans one.",
    ),
    (
        "Please use DTensor instead and we are deprecating ShardedTensor",
        FutureWarning,
        r"torch\.distributed\._shard\.sharded_tensor\.api",
        "Lightning's Strategy.setup moves every optimizer's state to the device; the fused "
        "optimizer's state is TorchRec's ShardedTensors, whose .to() (already on the device: it "
        "returns the tensor itself) warns that torch deprecates ShardedTensor.",
    ),
    (
        r"fbgemm..dense_embedding_codegen_lookup_function. an autograd kernel was not registered",
        UserWarning,
        r"torch\.autograd\..*",
        "fbgemm-gpu-cpu registers no CPU autograd kernel for data-parallel tables; the update is "
        "still exact (tests/test_strategy.py::test_data_parallel_tables_train_exactly_like_torch).",
    ),
    (
        r"`isinstance\(treespec, LeafSpec\)` is deprecated",
        FutureWarning,
        r"lightning\.pytorch\.utilities\._pytree",
        "Lightning 2.6's _pytree helper tests isinstance(treespec, LeafSpec), which torch 2.13 "
        "deprecates (it still works).",
    ),
    (
        "Your `IterableDataset` has `__len__` defined",
        UserWarning,
        r"lightning\.pytorch\.utilities\.data",
        "Lightning 2.6 warns for every DataLoader of an IterableDataset with a length, in case "
        "its workers duplicate data. The Criteo and Parquet datasets deal their batches to the "
        "(rank, worker) readers themselves and give every reader the same count, so the length "
        "is exact; it is what fractional val_check_interval, progress totals and the resume "
        "position need. (Also silences it for other iterable datasets in the process.)",
    ),
    (
        "You're resuming from a checkpoint that ended before the epoch ended and your "
        "dataloader is not resumable",
        UserWarning,
        r"lightning\.pytorch\.loops\.training_epoch_loop",
        "Lightning 2.6 calls a training loader resumable mid-epoch only when it has "
        "state_dict()/load_state_dict(). TorchRecStrategy resumes any map-style DataLoader at "
        "its sampler (lightning_torchrec.lightning.mid_epoch) and warns itself, naming the "
        "loader, for one it cannot resume. (Also silences it for other strategies' Trainers in "
        "the process.)",
    ),
    (
        "The given NumPy array is not writable",
        UserWarning,
        r"torchrec\.datasets\.criteo",
        "TorchRec's InMemoryBinaryCriteoIterDataPipe (mmap_mode) wraps slices of its read-only "
        "memory-mapped npy files with torch.from_numpy; the Criteo reader clones the dense rows "
        "and converts the labels, and never writes to them.",
    ),
    (
        r"torch\.ao\.quantization is deprecated",
        DeprecationWarning,
        r"(torchrec\.inference\.modules|torch\.ao\.quantization\..*)",
        "TorchRec 1.8's quantize_embeddings (its own inference quantization, which the tests "
        "compare the export with bit for bit) calls torch.ao.quantization.quantize_dynamic, "
        "which torch 2.13 deprecates, as its own internal calls; the export does not use it.",
    ),
    # Raised while the dependencies are imported (hidden by Python's default filters, shown by
    # pytest and -W): listed for the tests, which make every other deprecation an error.
    (
        r"\x1b\[93m\s+Failed to import",
        DeprecationWarning,
        r"fbgemm_gpu\.split_embedding_codegen_lookup_invokers",
        "fbgemm-gpu-cpu 1.8 imports its SSD optimizer lookups, which the CPU wheel does not ship, "
        "and reports each missing one as a DeprecationWarning.",
    ),
    (
        r"\x1b\[93m\s+The Python module fbgemm_gpu\.split_table_batched_embeddings_ops is now",
        DeprecationWarning,
        r"fbgemm_gpu\.split_table_batched_embeddings_ops",
        "TorchRec 1.8 (distributed.model_tracker) imports fbgemm's deprecated "
        "split_table_batched_embeddings_ops module.",
    ),
    (
        "distutils Version classes are deprecated",
        DeprecationWarning,
        r"torchmetrics\.utilities\.imports",
        "torchmetrics 1.0 (the oldest supported) compares versions with distutils' LooseVersion "
        "when imported.",
    ),
    (
        "`torch.jit.script_method` is deprecated",
        DeprecationWarning,
        r"torch\.jit\._script",
        "torch 2.13's own torch.utils.mkldnn, imported by the first torch.compile, defines its "
        "modules with torch.jit.script_method, which torch 2.13 deprecates.",
    ),
]


#: Log records of dependencies silenced the same way: (logger, message start, why).
UPSTREAM_LOG_RECORDS: list[tuple[str, str, str]] = [
    (
        "torch.fx._symbolic_trace",
        "is_fx_tracing will return true for both",
        "TorchRec's sharded modules call torch.fx's is_fx_tracing() in every forward; torch 2.13 "
        "logs once per process that its meaning widened (TorchRec does not trace there).",
    ),
    (
        "root",
        "Sharding spec not found for",
        "TorchRec's planner (1.8) checks every table of its plan for a sharding spec and logs on "
        "the root logger for each data_parallel table, which has none by design (it is "
        "replicated, not sharded).",
    ),
]


class _DropRecords:
    """A logging filter dropping records whose message starts with one of ``starts``."""

    def __init__(self, starts: list[str]) -> None:
        self.starts = tuple(starts)

    def filter(self, record: Any) -> bool:
        return not str(record.msg).startswith(self.starts)


def filter_upstream_warnings() -> None:
    """Silences :data:`UPSTREAM_WARNINGS` and :data:`UPSTREAM_LOG_RECORDS`, each only at its source.

    Called once when ``lightning_torchrec`` is imported. Warnings the package itself could avoid
    are avoided instead (e.g. the planner's storage reservation gets a dense estimate, shapes of
    ShardedTensors are read from their metadata).
    """
    for message, category, module, _why in UPSTREAM_WARNINGS:
        warnings.filterwarnings("ignore", message=message, category=category, module=module)
    for name in {logger for logger, _, _ in UPSTREAM_LOG_RECORDS}:
        log = logging.getLogger(name)
        if not any(isinstance(f, _DropRecords) for f in log.filters):
            log.addFilter(_DropRecords([m for n, m, _ in UPSTREAM_LOG_RECORDS if n == name]))
