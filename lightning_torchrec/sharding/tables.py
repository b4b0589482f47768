"""Model introspection: where the embedding tables are, what they hold, what reads them.

The one walk over a model's TorchRec embedding modules (:func:`embedding_modules`), and what is
derived from it: table configs, bytes, the features each table reads, the state-dict key of each
table, the tensors of a (sharded) model without building its ``state_dict()``, and tables that
were built whole instead of on the meta device. Works on unsharded models (tables possibly on the
meta device) and on models inside ``DistributedModelParallel``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

import torch
from torch import nn
from torch.distributed.tensor import DTensor
from torchrec.distributed.model_parallel import DistributedModelParallel
from torchrec.distributed.types import ShardedModule
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, data_type_to_dtype
from torchrec.modules.embedding_modules import (
    EmbeddingBagCollectionInterface,
    EmbeddingCollectionInterface,
)

from lightning_torchrec.compat.upstream import ShardedTensor, sharded_table_views, unwrap_compiled
from lightning_torchrec.sharding.layout import global_dtype, global_shape

#: The unsharded TorchRec embedding module types.
EMBEDDING_MODULES = (EmbeddingBagCollectionInterface, EmbeddingCollectionInterface)
_TABLE_KEY = re.compile(r"(?:^|\.)(?:embedding_bags|embeddings)\.([^.]+)\.weight$")


def unwrap(module: nn.Module) -> nn.Module:
    """The module inside ``DistributedModelParallel``, DDP and ``torch.compile`` wrappers.

    Args:
        module: any module.

    Returns:
        The innermost wrapped module (``module`` itself when it is not a wrapper).
    """
    while True:
        if isinstance(module, DistributedModelParallel):
            inner = module.module
        elif isinstance(module, nn.parallel.DistributedDataParallel):
            inner = module.module
        else:
            inner = unwrap_compiled(module)
        if inner is module:
            return module
        module = inner


def configs_of(module: nn.Module) -> list[BaseEmbeddingConfig] | None:
    """The table configs of one unsharded EBC/EC (or any module exposing them).

    Args:
        module: a module.

    Returns:
        Its ``embedding_bag_configs()``/``embedding_configs()``, or None for other modules.
    """
    getter = getattr(module, "embedding_bag_configs", None) or getattr(
        module, "embedding_configs", None
    )
    return list(getter()) if callable(getter) else None


def embedding_modules(model: nn.Module) -> dict[str, list[BaseEmbeddingConfig]]:
    """Every unsharded embedding module of ``model`` with its table configs, in model order.

    Args:
        model: an unsharded model (tables may be on the meta device).

    Returns:
        ``{module path: table configs}`` (``""`` when ``model`` itself is one).
    """
    found: dict[str, list[BaseEmbeddingConfig]] = {}
    for path, module in unwrap(model).named_modules():
        configs = configs_of(module)
        if configs is not None:
            found[path] = configs
    return found


def table_configs(model: nn.Module) -> dict[str, BaseEmbeddingConfig]:
    """Every table config of ``model``, by table name.

    Args:
        model: an unsharded model.

    Returns:
        ``{table name: config}`` in model order.
    """
    return {c.name: c for configs in embedding_modules(model).values() for c in configs}


def module_table_configs(model: nn.Module, module_path: str) -> dict[str, BaseEmbeddingConfig]:
    """The table configs of the embedding module at ``module_path`` (``""``: ``model``).

    Args:
        model: the unsharded model.
        module_path: a submodule path, as in a sharding plan.

    Returns:
        ``{table name: config}``: those of the embedding modules inside it when it has none
        itself (a ``ManagedCollisionEmbeddingCollection``); empty for a missing module.
    """
    try:
        module = model.get_submodule(module_path) if module_path else model
    except AttributeError:
        return {}
    configs = configs_of(module)
    if configs is None:  # e.g. a managed-collision collection: the tables of the one inside
        configs = [c for found in embedding_modules(module).values() for c in found]
    return {c.name: c for c in configs}


def table_bytes(config: BaseEmbeddingConfig) -> int:
    """Weight bytes of one table (optimizer state not included).

    Args:
        config: the table config.

    Returns:
        ``num_embeddings * embedding_dim * element size``.
    """
    element = torch.empty((), dtype=data_type_to_dtype(config.data_type)).element_size()
    return config.num_embeddings * config.embedding_dim * element


def dense_bytes(model: nn.Module) -> int:
    """Bytes of every parameter and buffer outside the embedding modules.

    Args:
        model: an unsharded model (tables may be on the meta device).

    Returns:
        The byte count (meta tensors count by shape and dtype).
    """
    inner = unwrap(model)
    skip = {id(t) for path in embedding_modules(inner) for t in _tensors(inner.get_submodule(path))}
    return sum(t.numel() * t.element_size() for t in _tensors(inner) if id(t) not in skip)


def _tensors(module: nn.Module) -> list[torch.Tensor]:
    return [*module.parameters(), *module.buffers()]


def human_bytes(n: float) -> str:
    """``n`` bytes for people, e.g. ``2.4 MiB``.

    Args:
        n: a byte count.

    Returns:
        The text.
    """
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return str(n)


def table_of_key(key: str) -> str:
    """The table a state-dict key belongs to (``...embedding_bags.t_cat_0.weight`` -> ``t_cat_0``).

    Optimizer-state keys (``...embedding_bags.t_cat_0.weight.t_cat_0.momentum1``) map too.

    Args:
        key: a state-dict or optimizer-state key.

    Returns:
        The table name, or ``key`` itself when it names no table.
    """
    parts = key.split(".")
    for marker in ("embedding_bags", "embeddings"):
        if marker in parts and parts.index(marker) + 1 < len(parts):
            return parts[parts.index(marker) + 1]
    return key


def dense_width(module: nn.Module) -> int | None:
    """The dense input width a module declares (``num_dense_features`` attribute/hparam).

    Args:
        module: usually the LightningModule.

    Returns:
        The width, or None when the module does not expose it.
    """
    width = getattr(module, "num_dense_features", None)
    if width is None:
        hparams = getattr(module, "hparams", None)
        if isinstance(hparams, Mapping):
            width = hparams.get("num_dense_features")
    return int(width) if isinstance(width, int) else None


def _sharded_views(module: nn.Module) -> dict[str, torch.Tensor] | None:
    views = sharded_table_views(module)
    if views is None and isinstance(module, ShardedModule):
        state = module.state_dict(keep_vars=True)  # the costly fallback, see compat
        # Tables only: 2-D floating tensors (a managed-collision module's remapping state is
        # sharded too, as 1-D integer tensors).
        views = {
            k: v
            for k, v in state.items()
            if isinstance(v, ShardedTensor | DTensor)
            and len(global_shape(v)) == 2
            and global_dtype(v).is_floating_point
        }
    return views


def model_tensors(model: nn.Module) -> dict[str, tuple[torch.Tensor, bool]]:
    """Every parameter of a (sharded) model once, tables as whole-table views.

    Sharded tables come as the ShardedTensor/DTensor their module keeps (no ``state_dict()``
    call, no copy); dense parameters and data-parallel tables as plain tensors.

    Args:
        model: a plain model or one inside ``DistributedModelParallel``.

    Returns:
        ``{unwrapped name: (tensor, is an embedding table)}`` in model order.
    """
    out: dict[str, tuple[torch.Tensor, bool]] = {}
    seen: set[int] = set()

    def add(name: str, tensor: torch.Tensor, is_table: bool) -> None:
        if id(tensor) not in seen and name not in out:
            seen.add(id(tensor))
            out[name] = (tensor, is_table)

    def walk(module: nn.Module, prefix: str) -> None:
        inner = unwrap(module)
        if inner is not module:
            walk(inner, prefix)
            return
        views = _sharded_views(module)
        if views is not None or isinstance(module, EMBEDDING_MODULES):
            views = views or {}
            for name, view in views.items():
                add(prefix + name, view, True)
            for name, param in module.named_parameters():
                if name not in views:  # skips the local TBE slices of sharded tables
                    add(prefix + name, param, bool(_TABLE_KEY.search(name)))
            return
        for name, param in module.named_parameters(recurse=False):
            add(prefix + name, param, False)
        for name, child in module.named_children():
            walk(child, f"{prefix}{name}.")

    walk(model, "")
    return out


def embedding_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every EBC/EC table of ``model`` by its state-dict key, without calling ``state_dict()``.

    Args:
        model: a plain model or a ``DistributedModelParallel`` (possibly inside another module).

    Returns:
        ``{state-dict key: ShardedTensor/DTensor (model-parallel) or plain tensor}``, usable as
        ``model_state_dict`` of ``log_ebc_norms``; wrapper prefixes are stripped.
    """
    return {name: t for name, (t, is_table) in model_tensors(model).items() if is_table}


def materialized_tables(model: nn.Module) -> dict[str, torch.Tensor]:
    """Tables of an unsharded model built whole (not on the meta device), detached.

    Args:
        model: the unsharded model.

    Returns:
        ``{state-dict key: table}`` of the tables that hold values.
    """
    return {k: t.detach() for k, t in embedding_tables(model).items() if t.device.type != "meta"}
