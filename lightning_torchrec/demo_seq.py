r"""The sequence demo: SASRec on MovieLens-layout ratings, its item table sharded over 2 CPU ranks.

Run ``python -m lightning_torchrec.demo_seq`` (what ``make demo-seq`` does). Without
``--data.path`` it writes a ``ratings.dat`` of known structure (see
:func:`~lightning_torchrec.data.movielens.write_cycle_ratings`) under ``runs/demo_seq`` first.
It trains, tests, and prints the test recall@10 and NDCG@10 beside the best any model can reach
on that data and a popularity baseline. ``--sharding`` picks how the item table is sharded::

    python -m lightning_torchrec.demo_seq --sharding row_wise --trainer.max_steps 200
    python -m lightning_torchrec.demo_seq --data.path ~/data/ml-1m/ratings.dat

Every other setting is LightningCLI's (``--print_config`` shows them all).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any

import numpy as np
import torch
from lightning.pytorch.cli import LightningCLI
from torchrec.distributed.planner.types import ParameterConstraints

import lightning_torchrec  # noqa: F401  (registers strategy="torchrec")
from lightning_torchrec.data.movielens import best_achievable, cycle_structure, write_cycle_ratings
from lightning_torchrec.data.sequences import MovieLensSequenceData, leave_last_out
from lightning_torchrec.lightning.sequence import SASRecModule
from lightning_torchrec.lightning.strategy import TorchRecStrategy
from lightning_torchrec.training.ranking import popularity_ranks, ranking_values

#: How the generated demo data is made (its best achievable metrics follow from these).
GENERATED: dict[str, Any] = {
    "num_users": 2000,
    "num_items": 500,
    "noise": 0.3,
    "popularity_skew": 1.0,
    "seed": 0,
}
DEFAULT_DATA = Path("runs/demo_seq/ratings.dat")
SHARDING_TYPES = ("table_wise", "row_wise", "column_wise")

TRAINER_DEFAULTS: dict[str, Any] = {
    "accelerator": "cpu",
    "devices": 2,
    "max_steps": 300,
    "val_check_interval": 100,
    "check_val_every_n_epoch": None,
    "log_every_n_steps": 5,
    "default_root_dir": "runs/demo_seq",
    "enable_checkpointing": False,
    "logger": {
        "class_path": "lightning.pytorch.loggers.TensorBoardLogger",
        "init_args": {"save_dir": "runs/demo_seq", "name": "sasrec"},
    },
}


class SequenceCLI(LightningCLI):
    """LightningCLI that sizes the model's item table and history from the data.

    Args:
        *args: LightningCLI's.
        sharding: how the item table is sharded (``--sharding``).
        **kwargs: LightningCLI's.
    """

    def __init__(self, *args: Any, sharding: str = "table_wise", **kwargs: Any) -> None:
        self.sharding = sharding
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser: Any) -> None:
        """Links ``num_items`` and ``max_length`` from the data module to the model.

        Args:
            parser: the CLI's parser.
        """
        parser.add_argument(  # taken out of the arguments first (split_sharding); for --help
            "--sharding",
            choices=SHARDING_TYPES,
            default="table_wise",
            help="How the item table is sharded over the ranks.",
        )
        parser.link_arguments("data.num_items", "model.num_items", apply_on="instantiate")
        parser.link_arguments("data.max_length", "model.max_length")
        parser.set_defaults(
            {
                "data.path": str(DEFAULT_DATA),
                "model.optimizer": {"class_path": "torch.optim.Adam", "init_args": {"lr": 0.003}},
            }
        )

    def parse_arguments(self, parser: Any, args: Any) -> None:
        """Parses ``args``: the command line less ``--sharding`` (no warning that both are given).

        Args:
            parser: the CLI's parser.
            args: the arguments.
        """
        self.config = parser.parse_args(args)

    def instantiate_trainer(self, **kwargs: Any) -> Any:
        """The Trainer, with the demo's strategy unless ``--trainer.strategy`` names another.

        The strategy's planner constraints are objects a config file cannot hold, so they are
        given here rather than as a default.

        Args:
            **kwargs: LightningCLI's.

        Returns:
            The Trainer.
        """
        if self.config["trainer"]["strategy"] == "torchrec":
            constraint = ParameterConstraints(sharding_types=[self.sharding], min_partition=16)
            kwargs["strategy"] = TorchRecStrategy(
                constraints={"t_item": constraint}, fused_params={"learning_rate": 0.05}
            )
        return super().instantiate_trainer(**kwargs)


def split_sharding(args: list[str]) -> tuple[str, list[str]]:
    """Takes ``--sharding KIND`` (or ``--sharding=KIND``) out of the arguments.

    Args:
        args: command-line arguments.

    Returns:
        The sharding type of the item table (``table_wise`` unless named) and the rest.

    Raises:
        SystemExit: naming the choices, for an unknown type.
    """
    rest, kind, i = [], "table_wise", 0
    while i < len(args):
        if args[i] == "--sharding" and i + 1 < len(args):
            kind, i = args[i + 1], i + 2
        elif args[i].startswith("--sharding="):
            kind, i = args[i].removeprefix("--sharding="), i + 1
        else:
            rest.append(args[i])
            i += 1
    if kind not in SHARDING_TYPES:
        raise SystemExit(f"--sharding must be one of {', '.join(SHARDING_TYPES)}, got {kind!r}")
    return kind, rest


def baselines(data: MovieLensSequenceData, generated: bool, k: int = 10) -> dict[str, float]:
    """The test split's popularity baseline and, for generated data, the best achievable.

    Args:
        data: the data module.
        generated: whether the file was written with :data:`GENERATED`.
        k: the cut-off.

    Returns:
        ``popularity recall@k``, ``popularity ndcg@k`` and, for generated data,
        ``best recall@k`` and ``best ndcg@k``.
    """
    seqs = data.sequences
    _, targets = leave_last_out(seqs, "test")
    seen = np.ones(len(seqs.items), dtype=bool)
    seen[targets] = False
    ranks = popularity_ranks(seqs.items[seen], seqs.items[targets], seqs.num_items)
    values = ranking_values(torch.from_numpy(ranks), [k])
    out = {f"popularity {name}": float(v) for name, v in values.items()}
    if generated:
        structure = cycle_structure(
            GENERATED["num_items"],
            GENERATED["noise"],
            GENERATED["popularity_skew"],
            GENERATED["seed"],
        )
        # The generator's item i is raw id i + 1.
        last = seqs.item_ids[seqs.items[targets - 1]] - 1
        best = best_achievable(structure, last, k)
        out |= {f"best recall@{k}": best["recall"], f"best ndcg@{k}": best["ndcg"]}
    return out


def main(args: list[str] | None = None) -> SequenceCLI:
    """Trains and tests the sequence model.

    Args:
        args: command-line arguments (defaults to ``sys.argv[1:]``).

    Returns:
        The CLI, with its trainer, model and data.
    """
    kind, args = split_sharding(sys.argv[1:] if args is None else list(args))
    generated = not any(a.startswith("--data.path") for a in args)
    if generated and not DEFAULT_DATA.exists() and os.environ.get("LOCAL_RANK", "0") == "0":
        write_cycle_ratings(DEFAULT_DATA, **GENERATED)
    cli = SequenceCLI(
        SASRecModule,
        MovieLensSequenceData,
        sharding=kind,
        trainer_defaults={**TRAINER_DEFAULTS, "strategy": "torchrec"},  # see instantiate_trainer
        seed_everything_default=0,
        # The strategy's constraints are objects, not a config file's values.
        save_config_callback=None,
        args=args,
        run=False,
    )
    trainer = cli.trainer
    trainer.fit(cli.model, datamodule=cli.datamodule)
    trainer.test(cli.model, datamodule=cli.datamodule, verbose=False)
    if trainer.is_global_zero:
        metrics = trainer.callback_metrics
        shown = {f"test {m}": float(metrics[f"test/{m}"]) for m in ("recall@10", "ndcg@10")}
        shown |= baselines(cli.datamodule, generated)
        print(", ".join(f"{name} {value:.4f}" for name, value in shown.items()))
    return cli


if __name__ == "__main__":
    main()
