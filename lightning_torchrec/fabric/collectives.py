"""Fabric's collectives for ``TorchRecFabricStrategy``: a dead or failed peer is named.

A Fabric loop enters collectives of its own through the strategy (``fabric.barrier()``,
``fabric.broadcast``, ``fabric.all_reduce``, ``fabric.all_gather``, and ``fabric.save``'s path
broadcast). When another rank has died, gloo's error says only "Connection closed by peer" (or
times out); as the Trainer's ``TorchRecStrategy`` does for Lightning's collectives, these raise
:class:`~lightning_torchrec.errors.PeerFailureError` instead (with the failing rank's own error
when it reported one).
"""

from __future__ import annotations

from typing import Any

from typing_extensions import override

from lightning_torchrec.distributed import run_collective


class FabricCollectives:
    """Mixin for ``TorchRecFabricStrategy`` (before Fabric's ``DDPStrategy`` in its bases)."""

    collective_timeout: Any

    def _collective(self, fn: Any, *args: Any, **kwargs: Any) -> Any:
        return run_collective(fn, *args, timeout=self.collective_timeout, **kwargs)

    @override
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        self._collective(super().barrier, *args, **kwargs)  # type: ignore[misc]

    @override
    def broadcast(self, obj: Any, src: int = 0) -> Any:
        return self._collective(super().broadcast, obj, src)  # type: ignore[misc]

    @override
    def all_reduce(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._collective(super().all_reduce, tensor, *args, **kwargs)  # type: ignore[misc]

    @override
    def all_gather(self, tensor: Any, *args: Any, **kwargs: Any) -> Any:
        return self._collective(super().all_gather, tensor, *args, **kwargs)  # type: ignore[misc]
