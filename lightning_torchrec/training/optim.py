"""One optimizer Lightning can step: the dense optimizer plus TorchRec's fused embedding optimizer.

Fused (TBE) tables update inside the backward pass; their "optimizer" only carries the
hyper-parameters (the learning rate above all) and the state (e.g. row-wise Adagrad sums).
Combining it with the dense optimizer gives LR schedulers, ``LearningRateMonitor`` and checkpoints
one object that sees both, while the training closure still runs once (the fused part ignores it).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch import nn
from torchrec.optim.fused import FusedOptimizerModule
from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizer, KeyedOptimizerWrapper
from torchrec.optim.optimizers import in_backward_optimizer_filter

from lightning_torchrec.compat.fused import fused_param_groups, kernel_tables, kernel_values
from lightning_torchrec.compat.upstream import fused_kernels, kernel_step, set_kernel_step

DENSE_KEY = "dense"
FUSED_KEY = "embedding"
#: What LR schedulers and ``LearningRateMonitor`` read from every param group besides ``lr``
#: (``OneCycleLR``/``CyclicLR`` cycle ``momentum`` or ``betas``): a fused group carries its
#: kernel's values of those the dense optimizer has.
KERNEL_VALUES = ("momentum", "betas", "weight_decay", "eps")
#: A param group's label (``LearningRateMonitor`` names groups by it), for a fused group
#: ``"tables:"`` and its kernel's first :data:`NAMED_TABLES` tables; never restored on resume.
GROUP_NAME, NAMED_TABLES = "name", 4


def is_fused_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` is updated by a fused (in-backward) embedding optimizer.

    Args:
        param: a parameter of a (possibly sharded) model.

    Returns:
        True for fused embedding-table parameters, which no dense optimizer may update.
    """
    return any(True for _ in in_backward_optimizer_filter(iter([("", param)]), include=True))


def dense_named_parameters(module: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """The named parameters a dense optimizer should train.

    Everything except fused embedding tables: dense layers and data-parallel (replicated)
    tables, which TorchRec trains with the dense optimizer.

    Args:
        module: a (possibly sharded) module.

    Yields:
        ``(name, parameter)`` pairs.
    """
    for name, param in module.named_parameters():
        if param.requires_grad and not is_fused_parameter(param):
            yield name, param


def dense_parameters(module: nn.Module) -> list[nn.Parameter]:
    """The parameters to give the dense optimizer in ``configure_optimizers``.

    Example::

        def configure_optimizers(self):
            return combine_optimizers(torch.optim.Adam(dense_parameters(self)), self)

    Args:
        module: a (possibly sharded) module.

    Returns:
        Every trainable parameter that is not a fused embedding table.
    """
    return [p for _, p in dense_named_parameters(module)]


def fused_optimizers(module: nn.Module, prefix: str = "") -> list[tuple[str, KeyedOptimizer]]:
    """Collects the fused optimizers of TorchRec's sharded modules inside ``module``.

    Args:
        module: a module whose embedding modules have been sharded.
        prefix: path of ``module`` (used in the keys).

    Returns:
        ``(module path, fused optimizer)`` pairs, outermost fused module first; empty when the
        module holds no fused tables.
    """
    if isinstance(module, FusedOptimizerModule):
        return [(prefix, module.fused_optimizer)]
    found: list[tuple[str, KeyedOptimizer]] = []
    for name, child in module.named_children():
        found.extend(fused_optimizers(child, f"{prefix}.{name}" if prefix else name))
    return found


class DenseAndFusedOptimizer(CombinedOptimizer):
    """A ``CombinedOptimizer`` of one dense optimizer and the fused embedding optimizers.

    ``param_groups`` lists the dense groups first, then one group per fused table group, so an
    LR scheduler built on this optimizer drives both.

    Args:
        dense: the keyed dense optimizer.
        fused: ``(path, fused optimizer)`` pairs.
        dense_optimizer: the torch optimizer inside ``dense``.
    """

    def __init__(
        self,
        dense: KeyedOptimizer,
        fused: list[tuple[str, KeyedOptimizer]],
        dense_optimizer: torch.optim.Optimizer | None = None,
    ) -> None:
        optims: list[tuple[str, KeyedOptimizer]] = [(DENSE_KEY, dense)]
        if fused:
            optims.append((FUSED_KEY, CombinedOptimizer(fused)))
        super().__init__(optims)
        self._dense_optimizer = dense_optimizer or dense
        # Schedulers read the defaults (e.g. OneCycleLR asks for momentum or betas there).
        self.defaults = {**self._dense_optimizer.defaults, **self.defaults}
        for group, kernel in self.fused_groups():
            values = kernel_values(kernel)
            for key in KERNEL_VALUES:
                if key in self.defaults and key in values:
                    group.setdefault(key, values[key])
        _name_fused_groups(self.fused_groups(), len(self.dense.param_groups))

    @property
    def dense(self) -> KeyedOptimizer:
        """The keyed dense optimizer."""
        return self.optimizers[0][1]

    @property
    def fused(self) -> KeyedOptimizer | None:
        """The combined fused embedding optimizer, or None without fused tables."""
        return self.optimizers[1][1] if len(self.optimizers) > 1 else None

    @property
    def dense_optimizer(self) -> torch.optim.Optimizer:
        """The torch optimizer the user built for the dense parameters."""
        return self._dense_optimizer

    def fused_groups(self) -> list[tuple[dict[str, Any], Any]]:
        """Each fused param group with the embedding kernel it drives.

        Returns:
            ``(param group, fbgemm TBE)`` pairs, in ``param_groups`` order.
        """
        return fused_param_groups(self.fused) if self.fused is not None else []

    def off_kernel_values(self) -> list[str]:
        """The values of fused groups (besides ``lr``) that differ from their kernel's.

        A scheduler may set them (``OneCycleLR`` cycles ``betas``), but TorchRec passes only
        the learning rate on to the kernels.

        Returns:
            The keys, sorted.
        """
        found = set()
        for group, kernel in self.fused_groups():
            values = kernel_values(kernel)
            found.update(k for k in KERNEL_VALUES if k in group and group[k] != values.get(k))
        return sorted(found)

    def push_fused_lr(self) -> None:
        """Writes each fused group's current ``lr`` into its embedding kernel.

        TorchRec's fused optimizers copy ``param_groups[0]["lr"]`` into the kernel only in
        ``zero_grad()``/``step()``; the kernel reads it during the backward pass. Calling this
        before each forward makes a scheduler's change apply to the very next update.
        """
        if self.fused is not None:
            self.fused.zero_grad()


def _name_fused_groups(groups: list[tuple[dict[str, Any], Any]], dense: int) -> None:
    """Labels each fused group by its kernel's tables (``"tables:t_user,t_item"``), unique."""
    taken: set[str] = set()
    for position, (group, kernel) in enumerate(groups):
        tables = list(dict.fromkeys(kernel_tables(kernel)))
        if not tables or GROUP_NAME in group:
            continue
        label = "tables:" + ",".join(tables[:NAMED_TABLES])
        if len(tables) > NAMED_TABLES:
            label += f",+{len(tables) - NAMED_TABLES} more"
        if label in taken:  # never two alike: LearningRateMonitor refuses duplicate names
            label += f" (pg{dense + position + 1})"
        taken.add(label)
        group[GROUP_NAME] = label


def combine_optimizers(
    dense_optimizer: torch.optim.Optimizer, module: nn.Module, with_fused: bool = True
) -> KeyedOptimizer:
    """Combines a dense torch optimizer with the fused embedding optimizers of ``module``.

    Build LR schedulers on the returned optimizer to schedule the embedding learning rate too.

    Args:
        dense_optimizer: an optimizer over (a subset of) ``dense_parameters(module)``.
        module: the (sharded) module; its parameters name the optimizer state in checkpoints.
        with_fused: combine the module's fused optimizers (False: key the dense one only, for
            an optimizer other than the one that drives the tables).

    Returns:
        A ``DenseAndFusedOptimizer`` (the dense optimizer alone is wrapped too, so checkpoints
        key its state by parameter name).

    Raises:
        ValueError: if the dense optimizer holds fused embedding-table parameters, naming them.
    """
    if isinstance(dense_optimizer, DenseAndFusedOptimizer):
        return dense_optimizer
    names = {id(p): n for n, p in module.named_parameters()}
    fused_names, params = [], {}
    for group in dense_optimizer.param_groups:
        for i, p in enumerate(group["params"]):
            name = names.get(id(p), f"unnamed_parameter_{len(params)}_{i}")
            if is_fused_parameter(p):
                fused_names.append(name)
            params[name] = p
    if fused_names:
        raise ValueError(
            "The dense optimizer from `configure_optimizers` holds fused embedding-table "
            f"parameters: {sorted(fused_names)}. They are updated inside the backward pass by "
            "TorchRec's fused optimizer (set its type and learning rate with "
            "`TorchRecStrategy(fused_params=...)`). Build the dense optimizer on "
            "`lightning_torchrec.dense_parameters(self)` instead of `self.parameters()`."
        )
    keyed = KeyedOptimizerWrapper(params, lambda _: dense_optimizer)
    fused = fused_optimizers(module) if with_fused else []
    return DenseAndFusedOptimizer(keyed, fused, dense_optimizer)


def keyed_further(optimizers: list[Any], module: nn.Module) -> list[Any]:
    """The optimizers after the first of ``configure_optimizers``, keyed by parameter name.

    The first one drives the fused tables too (:func:`combine_with_schedulers`); the others
    (manual optimization) are keyed so that checkpoints hold them, and keep their own
    schedulers. Keyed optimizers are kept as they are.

    Args:
        optimizers: the optimizers after the first.
        module: the (sharded) LightningModule.

    Returns:
        Keyed optimizers, in the same order.

    Raises:
        ValueError: if one holds fused embedding-table parameters, naming them.
    """
    return [
        o if isinstance(o, KeyedOptimizer) else combine_optimizers(o, module, with_fused=False)
        for o in optimizers
    ]


def combine_with_schedulers(
    optimizer: torch.optim.Optimizer, module: nn.Module, schedulers: list[object]
) -> KeyedOptimizer:
    """:func:`combine_optimizers` for the optimizer Lightning got from ``configure_optimizers``.

    Warns when a scheduler was built on the dense optimizer alone: it cannot drive the fused
    learning rate.

    Args:
        optimizer: the first optimizer from ``configure_optimizers``.
        module: the (sharded) LightningModule.
        schedulers: the LR schedulers from ``configure_optimizers``.

    Returns:
        The combined optimizer (``optimizer`` itself when it already is one).
    """
    combined = combine_optimizers(optimizer, module)
    fused = combined.fused if isinstance(combined, DenseAndFusedOptimizer) else None
    has_fused = fused is not None and bool(fused.params)
    if (
        has_fused
        and combined is not optimizer
        and any(getattr(s, "optimizer", None) is optimizer for s in schedulers)
    ):
        rank_zero_warn(
            "The LR scheduler from `configure_optimizers` drives the dense optimizer only; the "
            "fused embedding learning rate stays constant. Build the scheduler on "
            "`lightning_torchrec.combine_optimizers(dense_optimizer, self)` to schedule both."
        )
    off = combined.off_kernel_values() if isinstance(combined, DenseAndFusedOptimizer) else []
    if off:
        rank_zero_warn(
            f"The LR scheduler from `configure_optimizers` sets {off} of the fused embedding "
            "param groups, but TorchRec passes only the learning rate on to the embedding "
            "kernels: the tables keep the values they were built with (set them with "
            "`TorchRecStrategy(fused_params=...)`). The dense optimizer follows the schedule."
        )
    return combined


def optimizer_steps(optimizer: KeyedOptimizer) -> list[int]:
    """The step counters of the fused kernels (used by Adam-family fused optimizers).

    Args:
        optimizer: a keyed optimizer, typically ``DenseAndFusedOptimizer``.

    Returns:
        One counter per fused kernel; they live outside every state dict.
    """
    return [kernel_step(k) for k in fused_kernels(optimizer)]


def set_optimizer_steps(optimizer: KeyedOptimizer, step: int) -> None:
    """Sets every fused kernel's step counter (the device counter and its host copy).

    Args:
        optimizer: a keyed optimizer, typically ``DenseAndFusedOptimizer``.
        step: the counter value; every kernel of one run advances in lock step.
    """
    for kernel in fused_kernels(optimizer):
        set_kernel_step(kernel, step)


def init_optimizer_state(optimizer: KeyedOptimizer) -> None:
    """Materialises lazily created optimizer state so a checkpoint can be loaded into it.

    Torch optimizers create state at their first step; a load target without state would
    restore nothing, silently. Runs the dense optimizer once on zero gradients (the loaded
    weights and state overwrite whatever that step did) and clears the gradients again.

    Args:
        optimizer: a keyed optimizer, typically ``DenseAndFusedOptimizer``.
    """
    dense = optimizer.dense if isinstance(optimizer, DenseAndFusedOptimizer) else optimizer
    params = [p for p in dense.params.values() if p.requires_grad]
    if params and len(dense.state) < len(params):
        dense.init_state()
        for p in params:
            p.grad = None


def forget_dense_state(optimizer: KeyedOptimizer, keys: list[str]) -> None:
    """Drops the dense optimizer's state of the parameters named ``keys`` (as after no step).

    Args:
        optimizer: a ``DenseAndFusedOptimizer`` (anything else is left alone).
        keys: the parameters' keys in ``optimizer.params`` (``"dense.<name>"``).
    """
    if not isinstance(optimizer, DenseAndFusedOptimizer):
        return
    for key in keys:
        optimizer.dense_optimizer.state.pop(optimizer.params[key], None)


def keyed_optimizer(optimizer: Any) -> KeyedOptimizer:
    """The keyed optimizer behind a (Lightning-wrapped) optimizer.

    Args:
        optimizer: an optimizer, possibly wrapped by Lightning (``LightningOptimizer``, Fabric's
            optimizer), which keeps the wrapped one in ``.optimizer``.

    Returns:
        The ``KeyedOptimizer`` (state keyed by parameter name, as checkpoints need).

    Raises:
        TypeError: for a plain torch optimizer, saying how to fix ``configure_optimizers``.
    """
    opt = optimizer
    # Unwrapped before the type test: LightningOptimizer even subclasses the wrapped class.
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer
    if not isinstance(opt, KeyedOptimizer):
        raise TypeError(
            f"TorchRecStrategy checkpoints keyed optimizers; got {type(opt).__name__}. Return "
            "the optimizer from `combine_optimizers(...)` in configure_optimizers."
        )
    return opt


def push_fused_lr(optimizers: Iterable[Any]) -> None:
    """Pushes each combined optimizer's learning rate into its fused kernels.

    The fused kernels read the learning rate during the backward, but TorchRec's fused optimizer
    pushes a changed ``param_group["lr"]`` only in its own ``step()``: a scheduler's change made
    after the last step reaches the kernels before this forward (and the first step after a
    resume uses the restored rate, not the constructor's).

    Args:
        optimizers: the front end's optimizers (those that are not combined are skipped).
    """
    for optimizer in optimizers:
        if isinstance(optimizer, DenseAndFusedOptimizer):
            optimizer.push_fused_lr()
