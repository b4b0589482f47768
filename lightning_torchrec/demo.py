r"""The main job: DLRM on learnable synthetic click data, sharded over 2 CPU processes.

Run ``python -m lightning_torchrec.demo fit`` (what ``make demo`` does). Every setting can be
changed from the command line, LightningCLI style, e.g.::

    python -m lightning_torchrec.demo fit --trainer.devices 4 --trainer.max_steps 500 \\
        --data.num_embeddings 100000 --model.embedding_dim 32

``--print_config`` shows them all.
"""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import LearningRateMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_torchrec  # noqa: F401  (registers strategy="torchrec")
from lightning_torchrec.callbacks import EmbeddingNormCallback, WeightNormCallback
from lightning_torchrec.data import SyntheticClickData
from lightning_torchrec.dlrm import DLRMClickModule

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "strategy": {
        "class_path": "lightning_torchrec.TorchRecStrategy",
        "init_args": {"fused_params": {"learning_rate": 0.1}},
    },
    "max_steps": 1000,
    "val_check_interval": 250,
    "limit_val_batches": 20,
    "log_every_n_steps": 10,
    "default_root_dir": "runs/demo",
    "enable_checkpointing": False,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs/demo", "name": "dlrm"},
    },
}


class DemoCLI(LightningCLI):
    """LightningCLI that keeps the model's tables in step with the data."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Links table sizes and dense width from the data module to the model.

        Args:
            parser: the CLI's parser.
        """
        parser.link_arguments(
            "data.num_embeddings_per_feature",
            "model.num_embeddings_per_feature",
            apply_on="instantiate",
        )
        parser.link_arguments(
            "data.num_dense_features", "model.num_dense_features", apply_on="instantiate"
        )
        # Tables small enough that the hidden interactions are learnt within the demo's steps;
        # raise --data.num_embeddings to see sharding of larger tables.
        parser.set_defaults(
            {"data.num_embeddings": 200, "data.ids_per_feature": 2, "data.train_batches": 4000}
        )


def main(args: list[str] | None = None) -> DemoCLI:
    """Runs the demo CLI.

    Args:
        args: command-line arguments (defaults to ``sys.argv``).

    Returns:
        The CLI, with its trainer and model.
    """
    cli = DemoCLI(
        DLRMClickModule,
        SyntheticClickData,
        trainer_defaults={
            **TRAINER_DEFAULTS,
            "callbacks": [
                LearningRateMonitor("step"),
                WeightNormCallback(),
                EmbeddingNormCallback(),
            ],
        },
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )
    trainer = cli.trainer
    if trainer.is_global_zero and cli.subcommand == "fit":
        auroc = trainer.callback_metrics.get("val/auroc")
        if auroc is not None:
            print(f"final validation AUROC: {float(auroc):.4f}")
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                print(f"view the run: tensorboard --logdir {logger.save_dir}")
    return cli


if __name__ == "__main__":
    main()
