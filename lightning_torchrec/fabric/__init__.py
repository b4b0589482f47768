"""The Fabric glue: ``TorchRecFabricStrategy`` for users who keep their own training loop.

It stands beside the Trainer glue (:mod:`lightning_torchrec.lightning`) over the same core:
sharding (:func:`~lightning_torchrec.sharding.planning.shard_model`), the combined optimizer, the
step's agreed checks (:class:`~lightning_torchrec.training.steps.StepRunner`) and sharded
checkpoints (:mod:`lightning_torchrec.checkpoint`). It imports ``lightning.fabric`` only.
"""

from lightning_torchrec.fabric.strategy import TorchRecFabricStrategy

__all__ = ["TorchRecFabricStrategy"]
