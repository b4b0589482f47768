"""Tiny models, data, trainers and constraints for the tests and the multi-process scripts.

One module for both: the scripts in this directory import it as a sibling (``from factory import
...``; ``python tests/scripts/x.py`` puts this directory first on ``sys.path``), test files as
``tests.scripts.factory``. Defaults are those of the single-process tests (two tables of
``ROWS`` rows, embedding dim 4); every caller passes its own numbers where they differ.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.loggers import Logger
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, PoolingType
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.sharding_plan import construct_module_sharding_plan
from torchrec.distributed.sharding_plan import table_wise as on_rank
from torchrec.distributed.types import ShardingPlan
from torchrec.models.dlrm import DLRM
from torchrec.optim import apply_optimizer_in_backward

from lightning_torchrec import (
    DLRMClickModule,
    ModelAndLoss,
    SyntheticClickData,
    TorchRecModule,
    TorchRecStrategy,
)

#: Rows of every table of the default tiny model and data.
ROWS = 200

#: The two-rank scripts' wider model (the one-rank load of their checkpoint builds it too).
WIDE: dict[str, Any] = dict(embedding_dim=8, dense_sizes=[16, 8], over_sizes=[16, 1])

#: Trainer settings that keep a test run quiet and small: CPU, no logger, no checkpoints,
#: no progress bar or model summary, no sanity validation.
QUIET: dict[str, Any] = dict(
    accelerator="cpu",
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
    num_sanity_val_steps=0,
)


def table_names(tables: int | Iterable[str]) -> list[str]:
    """``t_cat_0 ... t_cat_{n-1}`` (the DLRM's and the data's table names), or the names given."""
    return [f"t_cat_{i}" for i in range(tables)] if isinstance(tables, int) else list(tables)


def sharding_constraints(
    types: Mapping[str, str], **kwargs: Any
) -> dict[str, ParameterConstraints]:
    """One sharding type per table: ``{"t_cat_0": "column_wise"}``; ``kwargs`` go to each."""
    return {t: ParameterConstraints(sharding_types=[s], **kwargs) for t, s in types.items()}


def table_wise(tables: int | Iterable[str] = 2, **kwargs: Any) -> dict[str, ParameterConstraints]:
    """Table-wise constraints for ``tables`` (a count of ``t_cat_i`` tables, or names)."""
    return sharding_constraints(dict.fromkeys(table_names(tables), "table_wise"), **kwargs)


def tiny_data(
    rows: int = ROWS,
    num_tables: int = 2,
    *,
    batch_size: int = 32,
    train_batches: int = 8,
    val_batches: int = 2,
    test_batches: int = 2,
    **kwargs: Any,
) -> SyntheticClickData:
    """Synthetic clicks with ``num_tables`` features of ``rows`` ids each.

    ``kwargs`` (``ids_per_feature``, ``seed``, ...) go to ``SyntheticClickData``.
    """
    return SyntheticClickData(
        num_embeddings=rows,
        num_sparse_features=num_tables,
        batch_size=batch_size,
        train_batches=train_batches,
        val_batches=val_batches,
        test_batches=test_batches,
        **kwargs,
    )


def tiny_dlrm(
    rows: int | Sequence[int] = ROWS,
    num_tables: int = 2,
    *,
    embedding_dim: int = 4,
    dense_sizes: Sequence[int] | None = None,
    over_sizes: Sequence[int] = (4, 1),
    cls: type[DLRMClickModule] = DLRMClickModule,
    **module_kwargs: Any,
) -> DLRMClickModule:
    """A small DLRM (or subclass ``cls``): tables of ``rows`` rows (one size per table, or one
    for all ``num_tables``), dense arch ``dense_sizes`` (default ``[embedding_dim]``).

    ``module_kwargs`` (``optimizer``, ``lr_scheduler``, ``num_dense_features``, a subclass's own
    arguments) go to the module.
    """
    per_table = [rows] * num_tables if isinstance(rows, int) else list(rows)
    return cls(
        per_table,
        embedding_dim=embedding_dim,
        dense_arch_layer_sizes=list(dense_sizes or [embedding_dim]),
        over_arch_layer_sizes=list(over_sizes),
        **module_kwargs,
    )


def adam(lr: float = 1e-2, halve_every: int | None = None) -> dict[str, Any]:
    """Module kwargs: a dense Adam at ``lr``, halved every ``halve_every`` steps by ``StepLR``."""
    kwargs: dict[str, Any] = {"optimizer": lambda p: torch.optim.Adam(p, lr=lr)}
    if halve_every is not None:
        kwargs["lr_scheduler"] = lambda o: torch.optim.lr_scheduler.StepLR(
            o, step_size=halve_every, gamma=0.5
        )
    return kwargs


def cpu_trainer(strategy: Any = None, devices: int = 1, **overrides: Any) -> L.Trainer:
    """A quiet CPU ``Trainer`` (:data:`QUIET`, then ``overrides``).

    ``strategy`` None: ``TorchRecStrategy`` with table-wise ``t_cat_0`` and ``t_cat_1``.
    """
    strategy = strategy if strategy is not None else TorchRecStrategy(constraints=table_wise(2))
    return L.Trainer(strategy=strategy, devices=devices, **(QUIET | overrides))


class Capture(Logger):
    """Keeps every logged metric: ``{step: {name: value}}``."""

    def __init__(self) -> None:
        super().__init__()
        self.metrics: dict[int, dict[str, float]] = {}

    @property
    def name(self) -> str:
        return "capture"

    @property
    def version(self) -> int:
        return 0

    def log_hyperparams(self, params: Any, *args: Any, **kwargs: Any) -> None:
        pass

    def log_metrics(self, metrics: dict[str, float], step: int | None = None) -> None:
        self.metrics.setdefault(int(step or 0), {}).update(metrics)


POOLED_EBC = "model_and_loss.model.sparse_arch.embedding_bag_collection"


def pooled_module(own_lrs: Sequence[float] = ()) -> TorchRecModule:
    """Two tables TorchRec puts in separate fused kernels on one rank (SUM and MEAN pooling).

    ``own_lrs``: table ``t_cat_i`` gets an SGD of its own at ``own_lrs[i]``, as the TorchRec
    tutorial gives them (``apply_optimizer_in_backward``).
    """
    torch.manual_seed(3)
    tables = [
        EmbeddingBagConfig(
            name=f"t_cat_{i}",
            embedding_dim=8,
            num_embeddings=40,
            feature_names=[f"cat_{i}"],
            pooling=PoolingType.SUM if i == 0 else PoolingType.MEAN,
        )
        for i in range(2)
    ]
    ebc = EmbeddingBagCollection(tables=tables, device=torch.device("meta"))
    for i, lr in enumerate(own_lrs):
        with warnings.catch_warnings():  # TorchRec points to torch's private equivalent
            warnings.simplefilter("ignore", DeprecationWarning)
            weight = ebc.embedding_bags[f"t_cat_{i}"].weight
            apply_optimizer_in_backward(torch.optim.SGD, [weight], {"lr": lr})
    dlrm = DLRM(
        embedding_bag_collection=ebc,
        dense_in_features=13,
        dense_arch_layer_sizes=[16, 8],
        over_arch_layer_sizes=[16, 1],
    )
    return TorchRecModule(
        ModelAndLoss(dlrm),
        optimizer=lambda p: torch.optim.Adam(p, lr=1e-2),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1 / (1 + s)),
    )


def pooled_plan(module: TorchRecModule, ranks: list[int], world: int) -> Any:
    """Table ``t_cat_i`` table-wise on rank ``ranks[i]``."""
    ebc = module.get_submodule(POOLED_EBC)
    per = {f"t_cat_{i}": on_rank(rank=r, compute_kernel="fused") for i, r in enumerate(ranks)}
    return ShardingPlan(
        {POOLED_EBC: construct_module_sharding_plan(ebc, per, world_size=world, device_type="cpu")}
    )
