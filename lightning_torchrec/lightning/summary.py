"""Lightning's model summary with each sharded table counted whole.

Lightning's ``ModelSummary`` counts ``numel()`` of the parameters the process holds. After
sharding these are the rank's own pieces of each table (an empty placeholder for a table held
elsewhere): on two ranks the summary of a model whose tables hold 6,400 parameters said rank
0's 3,200. :class:`WholeTableSummary` counts every parameter by its global shape, read from the
model's state dict (``ShardedTensor``/``DTensor`` metadata: no collective), so every rank prints
the numbers of the unsharded model. ``TorchRecStrategy`` makes the Trainer's
``ModelSummary``/``RichModelSummary`` callbacks use it.
"""

from __future__ import annotations

import math

from lightning.pytorch.utilities.model_summary import ModelSummary
from torch import nn

from lightning_torchrec.sharding.layout import global_shape


def whole_sizes(model: nn.Module) -> dict[int, int]:
    """Each parameter's global element count, by ``id``, where it differs from its ``numel``.

    Args:
        model: a (sharded) module.

    Returns:
        ``{id(parameter): elements of the whole tensor}`` for sharded parameters.
    """
    state = model.state_dict(keep_vars=True)
    sizes = {}
    for name, param in model.named_parameters():
        whole = state.get(name)
        if whole is not None and whole is not param:
            count = math.prod(global_shape(whole))
            if count != param.numel():
                sizes[id(param)] = count
    return sizes


class WholeTableSummary(ModelSummary):
    """Lightning's ``ModelSummary`` counting sharded parameters by their global shape.

    Args:
        model: the LightningModule.
        max_depth: as Lightning's (``-1``: every layer).
    """

    def __init__(self, model: nn.Module, max_depth: int = 1) -> None:
        self._whole_model = model
        self._whole_sizes = whole_sizes(model)
        super().__init__(model, max_depth)  # type: ignore[arg-type]

    def _count(self, module: nn.Module, trainable_only: bool = False) -> int:
        return sum(
            self._whole_sizes.get(id(p), p.numel())
            for p in module.parameters()
            if not isinstance(p, nn.parameter.UninitializedParameter)
            and (p.requires_grad or not trainable_only)
        )

    @property
    def param_nums(self) -> list[int]:
        """Each listed layer's parameters, sharded ones counted whole."""
        return [self._count(self._whole_model.get_submodule(name)) for name in self.layer_names]

    @property
    def total_parameters(self) -> int:
        """The model's parameters, sharded ones counted whole."""
        return self._count(self._whole_model)

    @property
    def trainable_parameters(self) -> int:
        """The model's parameters that require gradients, sharded ones counted whole."""
        return self._count(self._whole_model, trainable_only=True)
