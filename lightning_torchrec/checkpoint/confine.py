"""Paths a resumed run restores into a ``ModelCheckpoint`` stay inside its directory.

A ``ModelCheckpoint`` keeps ``best_model_path``, ``last_model_path``, ``kth_best_model_path`` and
the ``best_k_models`` paths in the checkpoint (plain strings in ``meta.pt``), restores them on
resume and later deletes the ones it retires. A checkpoint from a stranger can name any path
there, and Lightning's own containment check is lexical (``dirpath/../../elsewhere`` passes).
:func:`confine_checkpoint_paths` keeps a restored path only when it resolves (symlinks followed)
strictly inside the callback's ``dirpath``; the strategy applies it before Lightning restores
the callbacks, and warns about what it dropped. Deleting goes through
:func:`~lightning_torchrec.checkpoint.ownership.remove_replaced` as well, which deletes only this
package's checkpoints.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from lightning_torchrec.checkpoint.paths import is_inside

#: The single paths of a ``ModelCheckpoint`` state.
PATH_KEYS = ("best_model_path", "last_model_path", "kth_best_model_path")


def _inside(path: Any, dirpath: str | Path | None) -> bool:
    return isinstance(path, str) and dirpath is not None and is_inside(path, dirpath)


def confine_checkpoint_paths(state: dict[str, Any], dirpath: str | Path | None) -> list[str]:
    """Drops, in place, the paths of a saved ``ModelCheckpoint`` state outside ``dirpath``.

    Args:
        state: the callback's saved state (``ModelCheckpoint.state_dict()``), as loaded.
        dirpath: the live callback's directory (None: drop every path).

    Returns:
        The dropped paths (single paths become ``""``, ``best_k_models`` loses the entries).
    """
    dropped: list[str] = []
    for key in PATH_KEYS:
        value = state.get(key)
        if value in (None, "") or _inside(value, dirpath):
            continue
        dropped.append(str(value)[:200])
        state[key] = ""
    best = state.get("best_k_models")
    if best is not None:
        if not isinstance(best, dict):
            dropped.append(f"best_k_models ({type(best).__name__})")
            state["best_k_models"] = {}
        else:
            kept = {k: v for k, v in best.items() if _inside(k, dirpath)}
            dropped += [str(k)[:200] for k in best if k not in kept]
            state["best_k_models"] = kept
    return dropped
