r"""The main job: DLRM on learnable synthetic click data, sharded over 2 CPU processes.

Run ``python -m lightning_torchrec.demo fit`` (what ``make demo`` does). Every setting can be
changed from the command line, LightningCLI style, e.g.::

    python -m lightning_torchrec.demo fit --trainer.devices 4 --trainer.max_steps 500 \\
        --data.num_embeddings 100000 --model.embedding_dim 32

``--print_config`` shows them all.

``--data criteo --data.path DIR`` trains on Criteo click logs instead (``DIR`` holds Criteo TSV
day files, the Kaggle ``train.txt``, or TorchRec npy days; see ``docs/data.md``), e.g. on files
from ``scripts/make_click_files.py``::

    python scripts/make_click_files.py data/clicks
    python -m lightning_torchrec.demo fit --data criteo --data.path data/clicks/criteo

``--data synthetic`` (the default) is the learnable synthetic data.
"""

from __future__ import annotations

import sys
from typing import Any

import lightning as L
from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.loggers import TensorBoardLogger

import lightning_torchrec  # noqa: F401  (registers strategy="torchrec")
from lightning_torchrec.data import CriteoDataModule, SyntheticClickData
from lightning_torchrec.lightning import EmbeddingNormCallback, WeightNormCallback
from lightning_torchrec.lightning.dlrm import DLRMClickModule
from lightning_torchrec.training.metrics import batch_size_of

#: ``--data NAME`` choices: the data module each trains on.
DATA_MODULES: dict[str, type[L.LightningDataModule]] = {
    "synthetic": SyntheticClickData,
    "criteo": CriteoDataModule,
}
#: Defaults for Criteo data: small tables; one pass over the training days (as TorchRec's DLRM
#: example trains Criteo), validating halfway and at the end.
CRITEO_DEFAULTS: dict[str, Any] = {
    "data.num_embeddings": 1000,
    "data.batch_size": 256,
    "trainer.max_steps": -1,
    "trainer.max_epochs": 1,
    "trainer.val_check_interval": 0.5,
}

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
        if self.datamodule_class is CriteoDataModule:
            parser.set_defaults(CRITEO_DEFAULTS)
            return
        # Tables small enough that the hidden interactions are learnt within the demo's steps;
        # raise --data.num_embeddings to see sharding of larger tables.
        parser.set_defaults(
            {"data.num_embeddings": 200, "data.ids_per_feature": 2, "data.train_batches": 4000}
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parses ``args``: the command line less ``--data NAME`` (see :func:`main`).

        LightningCLI warns when it is given ``args`` and the process also has command-line
        arguments, in case they disagree; here ``args`` is that command line, with only the data
        choice taken out. ``sys.argv`` itself stays whole: the launcher starts the other ranks
        with it.

        Args:
            parser: the CLI's parser.
            args: the arguments.
        """
        self.config = parser.parse_args(args)


def split_data_choice(args: list[str]) -> tuple[type[L.LightningDataModule], list[str]]:
    """Takes ``--data NAME`` (or ``--data=NAME``) out of the arguments.

    Args:
        args: command-line arguments.

    Returns:
        The data module class (synthetic unless named) and the remaining arguments.

    Raises:
        SystemExit: for an unknown name.
    """
    rest, choice, i = [], "synthetic", 0
    while i < len(args):
        arg = args[i]
        if arg == "--data" and i + 1 < len(args) and args[i + 1] in DATA_MODULES:
            choice, i = args[i + 1], i + 2
            continue
        if arg.startswith("--data=") and arg.removeprefix("--data=") in DATA_MODULES:
            choice, i = arg.removeprefix("--data="), i + 1
            continue
        rest.append(arg)
        i += 1
    return DATA_MODULES[choice], rest


def main(args: list[str] | None = None) -> DemoCLI:
    """Runs the demo CLI.

    Args:
        args: command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The CLI, with its trainer and model.
    """
    data_class, args = split_data_choice(sys.argv[1:] if args is None else list(args))
    cli = DemoCLI(
        DLRMClickModule,
        data_class,
        trainer_defaults={
            **TRAINER_DEFAULTS,
            "callbacks": [
                LearningRateMonitor("step"),
                WeightNormCallback(),
                EmbeddingNormCallback(),
                # samples/s of rank 0 (train|device/samples_per_sec) and of all ranks
                # (train|samples_per_sec: ranks get equal batches, so rank 0's times world size)
                ThroughputMonitor(batch_size_fn=batch_size_of, window_size=20),
            ],
        },
        save_config_kwargs={"overwrite": True},
        seed_everything_default=0,
        args=args,
    )
    trainer = cli.trainer
    if trainer.is_global_zero and cli.subcommand == "fit":
        metrics = trainer.callback_metrics
        shown = {
            name: metrics[key]
            for name, key in (
                ("AUROC", "val/auroc"),
                ("NE", "val/ne"),
                ("calibration", "val/calibration"),
                ("AUPRC", "val/auprc"),
            )
            if key in metrics
        }
        if shown:
            print("final validation " + ", ".join(f"{k} {float(v):.4f}" for k, v in shown.items()))
        for logger in trainer.loggers:
            if isinstance(logger, TensorBoardLogger):
                print(f"view the run: tensorboard --logdir {logger.save_dir}")
    return cli


if __name__ == "__main__":
    main()
