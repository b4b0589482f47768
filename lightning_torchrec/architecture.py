"""The package's architecture as data: its layers, what each holds, and what each may import.

This is the one source of truth for the layout. ``tests/test_layering.py`` checks the source
against it (in CI), and the documentation's architecture table is generated from it
(``docs/conf.py`` puts :func:`markdown_table` into ``concepts.md``).

A *layer* is a subpackage (``sharding``, ``training``, ...) or a top-level module (``errors``,
``distributed``); the *application* layer is the package's face (``__init__``) and its commands
(``demo``, ``consolidate``). The rules:

1. A module imports package modules of its own layer or of the layers in its ``may_import``.
2. Within a layer, module imports form no cycle.
3. Only the Trainer glue (``lightning``) and the application import ``lightning.pytorch``; the
   Fabric glue (``fabric``) stands beside the Trainer glue and imports ``lightning.fabric`` only;
   ``data``'s data modules may subclass ``lightning.pytorch.LightningDataModule`` (their loaders
   serve a Fabric loop as well). The core may use ``lightning.fabric``.
4. Private names of torch, TorchRec, fbgemm and Lightning appear only in ``compat``; Lightning's
   only in ``compat.lightning`` and its siblings (``compat.lightning_callbacks``,
   ``compat.lightning_loops``, ``compat.lightning_batches``, ``compat.lightning_fabric``,
   ``compat.lightning_ddp``), which only the glue (Trainer and Fabric) imports.
5. No module imports another module's private (``_``) name; every import is at module level.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Layer:
    """One layer of the package.

    Attributes:
        name: the subpackage or top-level module.
        holds: what it holds, in a sentence (shown in the docs).
        may_import: the layers below it that it may import.
        trainer: whether it may import ``lightning.pytorch`` (see rule 3).
    """

    name: str
    holds: str
    may_import: tuple[str, ...] = ()
    trainer: bool = False


_BASE = ("errors", "compat", "failure_reports", "distributed")

#: Lowest first. The core is everything below ``lightning``.
LAYERS: tuple[Layer, ...] = (
    Layer("errors", "every exception type of the package"),
    Layer(
        "compat",
        "every private or version-sensitive name of torch, TorchRec, fbgemm (``upstream``) and "
        "Lightning (``lightning``; Fabric's launcher: ``lightning_fabric``); TorchRec's train "
        "pipelines cut where a loop takes over (``pipelines``); the upstream-only warnings, each "
        "with its cause (``upstream_warnings``); loader workers forked around CPython's fork "
        "deadlock before 3.12 (``worker_fork``); the job's store and collective counts "
        "(``c10d``); the optimizers "
        "``apply_optimizer_in_backward`` leaves on parameters and the tables of fused kernels "
        "(``fused``); the collections feature processors wrap (``feature_processors``)",
        ("errors",),
    ),
    Layer(
        "failure_reports",
        "a rank that fails alone writes its error to the job's store before it exits; the ranks "
        "that see it as a dead peer read it and raise an error of its type that names it",
        ("errors", "compat"),
    ),
    Layer(
        "distributed",
        "ranks, the collective device, and ``agree()``: how every rank learns that some rank "
        "failed and raises the same named error; collectives that failed because a peer died; "
        "the default group of a torchrun attempt, in keys of its own, destroyed at exit",
        ("errors", "compat", "failure_reports"),
    ),
    Layer(
        "data",
        "batches, datasets and data modules (synthetic, Criteo, Parquet) that resume mid-epoch; "
        "a stream of time partitions, one an epoch",
        ("errors", "distributed"),
        trainer=True,
    ),
    Layer(
        "models",
        "``ModelAndLoss`` (``forward(batch) -> (loss, outputs)``) and DLRM, tables on the meta "
        "device",
        ("errors",),
    ),
    Layer(
        "sharding",
        "tables and their shards, sharders, configuration checks, tables with optimizers of "
        "their own, the planner and "
        "``shard_model()`` (the one place that builds ``DistributedModelParallel``), the readable "
        "plan, outputs in the unsharded key order",
        _BASE,
    ),
    Layer(
        "training",
        "the run both front ends share (``run``: groups, sharding, collectives, failures), the "
        "step (``steps``: its owner and one object per mode), its vote (``step_guard``: bad "
        "batches, non-finite losses, uneven data), batch checks, TorchRec's train pipelines, the "
        "combined dense and fused optimizer, norms, managed-collision counts, metrics, "
        "the ids training touched (``touched``)",
        (*_BASE, "sharding"),
    ),
    Layer(
        "checkpoint",
        "sharded checkpoints with torch.distributed.checkpoint: files and checksums, loading "
        "without running code, save, load, one-process loads, consolidation to plain weights, "
        "delta checkpoints (the rows training touched) and their chains",
        (*_BASE, "sharding", "training"),
    ),
    Layer(
        "export",
        "quantized inference export from a sharded checkpoint, served without Lightning; a "
        "served model kept fresh by deltas (``fresh``: standalone, torch and torchrec only)",
        (*_BASE, "sharding", "checkpoint", "models"),
    ),
    Layer(
        "lightning",
        "the Trainer glue: ``TorchRecStrategy`` (one class) with its setup checks, checkpoint "
        "save and load, the step vote's callback; "
        "``TorchRecModule``, ``DLRMClickModule``; the norm, managed-collision, preemption and "
        "progressive-evaluation callbacks; the delta publisher",
        (*_BASE, "data", "models", "sharding", "training", "checkpoint"),
        trainer=True,
    ),
    Layer(
        "fabric",
        "the Fabric glue: ``TorchRecFabricStrategy`` for a loop of the user's own: the same "
        "sharding, combined optimizer, agreed step checks and sharded checkpoints as the Trainer "
        "glue, over the same core",
        (*_BASE, "sharding", "training", "checkpoint"),
    ),
    Layer(
        "app",
        "the package's face (``__init__``), the demo job and the command lines",
        (
            *_BASE,
            "data",
            "models",
            "sharding",
            "training",
            "checkpoint",
            "export",
            "lightning",
            "fabric",
        ),
        trainer=True,
    ),
)

#: Top-level modules of the application layer (the other layers are named by their module).
APP_MODULES = (
    "__init__",
    "architecture",
    "consolidate",
    "criteo",
    "demo",
    "demo_fabric",
    "demo_online",
    "demo_seq",
)

#: The only layers that may import ``compat.lightning*`` (Lightning's private names).
LIGHTNING_PRIVATE_USERS = ("lightning", "fabric", "app")


def layer_of(module: str) -> str:
    """The layer of a package module.

    Args:
        module: a dotted name relative to the package (``"sharding.planning"``, ``"__init__"``).

    Returns:
        The layer's name.

    Raises:
        KeyError: for a module of no layer.
    """
    if module in APP_MODULES:
        return "app"
    head = module.split(".")[0]
    if any(layer.name == head for layer in LAYERS):
        return head
    raise KeyError(f"{module} belongs to no layer of lightning_torchrec.architecture.LAYERS")


def markdown_table() -> str:
    """The layers as a Markdown table, lowest first (the docs include it).

    Returns:
        The table.
    """
    rows = ["| layer | holds | may import |", "|---|---|---|"]
    for layer in LAYERS:
        allowed = ", ".join(f"`{name}`" for name in layer.may_import) or "nothing"
        name = "application" if layer.name == "app" else f"`{layer.name}`"
        rows.append(f"| {name} | {layer.holds} | {allowed} |")
    return "\n".join(rows)
