"""Non-strict loading (``strict=False``, ``LightningModule.strict_loading = False``).

As ``nn.Module.load_state_dict(strict=False)`` does: a tensor of the model that the checkpoint
lacks keeps its current value (a layer added since the save) and one the checkpoint holds that
the model lacks is ignored (a layer removed since). A tensor in both with another global shape
is never skipped: the load still refuses it, naming it. Parameters the checkpoint lacks start
with fresh optimizer state. Both lists are reported with Lightning's
``load_from_checkpoint(strict=False)`` warnings, on rank 0.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from lightning.fabric.utilities.rank_zero import rank_zero_warn
from torch.distributed.checkpoint.metadata import Metadata

from lightning_torchrec.checkpoint.common import MODEL_KEY
from lightning_torchrec.training.optim import DENSE_KEY, FUSED_KEY


def model_differences(
    metadata: Metadata, model_state: Mapping[str, Any]
) -> tuple[list[str], list[str]]:
    """The model's keys the checkpoint lacks, and the checkpoint's model keys the model lacks.

    Args:
        metadata: the checkpoint's DCP metadata.
        model_state: the model's state dict (the load target).

    Returns:
        ``(missing, unexpected)``: state-dict keys (without the checkpoint's ``state_dict.``).
    """
    prefix = f"{MODEL_KEY}."
    saved = [k[len(prefix) :] for k in metadata.state_dict_metadata if k.startswith(prefix)]
    # A value the model holds as a mapping (an extra state) is saved under dotted sub-keys.
    owners = {s: _owner(s, model_state) for s in saved}
    found = set(owners.values())
    missing = [k for k in model_state if k not in found]
    return missing, sorted(s for s, owner in owners.items() if owner is None)


def _owner(saved: str, model_state: Mapping[str, Any]) -> str | None:
    parts = saved.split(".")
    for n in range(len(parts), 0, -1):
        if ".".join(parts[:n]) in model_state:
            return ".".join(parts[:n])
    return None


def without_keys(state: Mapping[str, Any], missing: list[str]) -> dict[str, Any]:
    """``state`` without the ``missing`` model keys (a model state dict).

    Args:
        state: the model's state dict.
        missing: the keys to leave out.

    Returns:
        A new dict.
    """
    drop = set(missing)
    return {k: v for k, v in state.items() if k not in drop}


def state_of(target: Mapping[str, Any], missing: list[str]) -> dict[str, Any]:
    """The entries of an optimizer's state target that belong to the parameters in ``missing``.

    The combined optimizer keys its state ``dense.<parameter>`` and ``embedding.<parameter>``,
    other keyed optimizers by the parameter's name. The load leaves these entries as they are.

    Args:
        target: the keyed optimizer's ``state_dict()["state"]``.
        missing: model keys the checkpoint lacks.

    Returns:
        A new dict.
    """
    keys = {f"{part}{k}" for k in missing for part in ("", f"{DENSE_KEY}.", f"{FUSED_KEY}.")}
    return {k: v for k, v in target.items() if k in keys}


def report(path: Any, missing: list[str], unexpected: list[str], rank: int) -> None:
    """Warns (on rank 0) about the keys a non-strict load left alone, as Lightning does.

    Args:
        path: the checkpoint, for the message.
        missing: model keys the checkpoint lacks (they keep their values).
        unexpected: checkpoint keys the model lacks (ignored).
        rank: this process's rank.
    """
    if rank != 0:
        return
    if missing:
        rank_zero_warn(
            f"{path}: Found keys that are in the model state dict but not in the checkpoint: "
            f"{missing}"
        )
    if unexpected:
        rank_zero_warn(
            f"{path}: Found keys that are not in the model state dict but in the checkpoint: "
            f"{unexpected}"
        )
