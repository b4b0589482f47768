"""Callbacks that log weight norms and sampled embedding-table norms to every attached logger."""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities.exceptions import MisconfigurationException
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from typing_extensions import override

from lightning_torchrec.compat.lightning_step import is_last_batch
from lightning_torchrec.distributed import is_distributed
from lightning_torchrec.sharding.tables import embedding_tables, table_of_key
from lightning_torchrec.training.ebc_norms import as_sample_size, log_ebc_norms
from lightning_torchrec.training.norms import (
    bad_return_error,
    is_whole_table_norm,
    l2_norm,
    reduce_weights,
)

HowToLog = Callable[[torch.Tensor], Any] | Mapping[str, Callable[[torch.Tensor], Any]] | None


def log_due(trainer: L.Trainer, every_n_steps: int | None, last_logged_step: int) -> bool:
    """Whether a step-cadence callback logs at this batch end (the same on every rank).

    Every ``every_n_steps`` optimizer steps (None: the Trainer's ``log_every_n_steps``; 0 there
    turns the cadence off) and when training stops; once per step: with gradient accumulation
    several batches end on the same optimizer step (the first ones before any step at all).

    Args:
        trainer: the Trainer.
        every_n_steps: the callback's cadence, or None.
        last_logged_step: the global step the callback last logged at.

    Returns:
        True when it logs now.
    """
    step = trainer.global_step
    if step == 0 or step == last_logged_step:
        return False
    max_epochs = trainer.max_epochs
    ending = (0 < trainer.max_steps <= step) or (  # Lightning sets no should_stop for these
        max_epochs is not None
        and 0 < max_epochs <= trainer.current_epoch + 1
        and is_last_batch(trainer)
    )
    every = every_n_steps or trainer.log_every_n_steps
    return (every > 0 and step % every == 0) or trainer.should_stop or ending


def table_labels(keys: Sequence[str]) -> dict[str, str]:
    """The name each table's norms are logged under: its table name, unless collections share it.

    Args:
        keys: the tables' state-dict keys.

    Returns:
        ``{key: label}``: the table name (``"t_cat_0"``), or for a name that several
        collections give a table, the key without ``.weight`` (no table is dropped).
    """
    names = [table_of_key(k) for k in keys]
    return {
        k: n if names.count(n) == 1 else k.removesuffix(".weight")
        for k, n in zip(keys, names, strict=True)
    }


def _table_list(tables: Sequence[str] | None) -> list[str] | None:
    """``EmbeddingNormCallback``'s ``tables`` as a list, refused when it selects nothing clear."""
    if tables is None:
        return None
    if isinstance(tables, str | bytes):
        raise TypeError(
            f"EmbeddingNormCallback(tables={tables!r}) is one string, not a list of tables: "
            f"write tables=[{tables!r}]"
        )
    names = list(tables)
    if not names:
        raise ValueError(
            "EmbeddingNormCallback(tables=[]) selects no table; tables=None means every table"
        )
    twice = sorted({t for t in names if names.count(t) > 1})
    if twice:
        raise ValueError(f"EmbeddingNormCallback(tables=...) names these tables twice: {twice}")
    return names


class _NormCallback(Callback):
    """Cadence and logging shared by the norm callbacks; subclasses compute the values.

    Values are computed only on logging steps, on every rank (the maths is collective), and
    written by rank 0 with ``logger.log_metrics(values, step=global_step)`` to every logger.
    """

    def __init__(self, every_n_steps: int | None) -> None:
        if every_n_steps is not None and every_n_steps < 1:
            raise ValueError(f"every_n_steps must be >= 1 or None, got {every_n_steps}")
        self.every_n_steps = every_n_steps
        self._last_logged_step = -1

    def _compute(self, pl_module: L.LightningModule) -> dict[str, float]:
        raise NotImplementedError

    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Resolves names and validates arguments; raises before any step on bad input."""

    def _check_loggers(self, trainer: L.Trainer) -> None:
        if not trainer.loggers:
            raise MisconfigurationException(
                f"Cannot use {type(self).__name__} with Trainer(logger=False): attach a logger "
                "(e.g. TensorBoardLogger) to see the norms."
            )

    def _log(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        step = trainer.global_step
        values = self._compute(pl_module)
        self._last_logged_step = step
        if not trainer.is_global_zero:
            return
        bad = sorted(k for k, v in values.items() if not math.isfinite(v))
        if bad:
            rank_zero_warn(f"Non-finite norms at step {step}: {bad}")
        for logger in trainer.loggers:
            logger.log_metrics(values, step=step)

    @override
    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._check_loggers(trainer)
        self._prepare(trainer, pl_module)

    @override
    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        if log_due(trainer, self.every_n_steps, self._last_logged_step):
            self._log(trainer, pl_module)

    @override
    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.state.fn != TrainerFn.FITTING:
            self._check_loggers(trainer)
            self._prepare(trainer, pl_module)

    @override
    def on_validation_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # Validation-only runs (trainer.validate) log the norms of the weights they evaluated.
        if trainer.state.fn != TrainerFn.FITTING and not trainer.sanity_checking:
            self._log(trainer, pl_module)

    @property
    @override
    def state_key(self) -> str:
        # Two callbacks of one type with different arguments keep separate state.
        return f"{type(self).__qualname__}{self._state_key_args()!r}"

    def _state_key_args(self) -> dict[str, Any]:
        return {"every_n_steps": self.every_n_steps}

    @override
    def state_dict(self) -> dict[str, Any]:
        return {"last_logged_step": self._last_logged_step}

    @override
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self._last_logged_step = int(state_dict.get("last_logged_step", -1))


class WeightNormCallback(_NormCallback):
    """Logs per-parameter norms (``weights_to_log`` semantics) of a possibly sharded model.

    For sharded tables the built-in norms are the norm of the whole table across ranks (one
    collective per logging step for all parameters); replicated parameters count once. Tags are
    ``model/{fn name}/{parameter name}`` (e.g. ``model/l2_norm/...``), one TensorBoard section.

    Args:
        how_to_log: one callable for every parameter, ``{parameter name: callable}`` for some, or
            None for the L2 norm of every parameter (see ``lightning_torchrec.training.norms``).
        every_n_steps: logging cadence in optimizer steps; None follows the Trainer's
            ``log_every_n_steps``.

    Raises:
        ValueError: for a non-positive ``every_n_steps``; at a logging step, on every rank, when
            a callable of ``how_to_log`` returns None, several numbers or none (naming the
            callable and the parameters).
        TypeError: if ``how_to_log`` is neither callable, mapping nor None; at a logging step,
            on every rank, when its callables return only values that are not numbers (e.g. a
            ``str``), naming the callable and the parameters.
    """

    def __init__(self, how_to_log: HowToLog = None, every_n_steps: int | None = None) -> None:
        super().__init__(every_n_steps)
        if (
            how_to_log is not None
            and not callable(how_to_log)
            and not isinstance(how_to_log, Mapping)
        ):
            raise TypeError(f"how_to_log must be a callable or a mapping, got {type(how_to_log)}")
        self.how_to_log = how_to_log

    @override
    def _state_key_args(self) -> dict[str, Any]:
        how = self.how_to_log
        names = sorted(how) if isinstance(how, Mapping) else getattr(how, "__name__", repr(how))
        return {"every_n_steps": self.every_n_steps, "how_to_log": names}

    @override
    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if isinstance(self.how_to_log, Mapping):
            names = {n for n, _ in pl_module.named_parameters()}
            unknown = sorted(set(self.how_to_log) - names)
            if unknown:
                hints = {u: difflib.get_close_matches(u, names, n=3) for u in unknown}
                raise KeyError(
                    f"WeightNormCallback(how_to_log=...) names unknown parameters {unknown}; "
                    f"closest: {hints}"
                )

    @override
    def _compute(self, pl_module: L.LightningModule) -> dict[str, float]:
        raw, bad = reduce_weights(pl_module, self.how_to_log)
        values = {k: float(v) for k, v in raw.items()}
        # A callable that returns None, several numbers or no number: named, on every rank (no
        # rank left waiting in the gather below while another raised).
        how = self.how_to_log
        fns = list(how.values()) if isinstance(how, Mapping) else [how or l2_norm]
        if is_distributed() and not all(is_whole_table_norm(fn) for fn in fns):
            # Other callables give per-rank values (``/rank{r}`` keys): rank 0 logs them all.
            gathered: list[Any] = [None] * torch.distributed.get_world_size()
            torch.distributed.all_gather_object(gathered, (values, bad))
            for rank_values, rank_bad in gathered:
                values.update(rank_values)
                bad.update(rank_bad)
        if bad:
            raise bad_return_error(bad, "WeightNormCallback(how_to_log=...)")
        return values


class EmbeddingNormCallback(_NormCallback):
    """Logs sampled mean row norms of embedding tables (``log_ebc_norms`` semantics).

    Per table and rank: the mean L2 norm of at most ``sample_size`` of that rank's rows (a fixed
    sample under ``seed``, so the curve follows the same rows); -1 for a rank without rows of the
    table; plus the mean norm of whole rows over a sample of the table. Tags:
    ``embedding_norms/{table}-norm-{rank}`` and ``embedding_norms/{table}-norm-mean``. For a
    column-wise table each rank's value is over the columns it holds; the mean is always over
    whole rows (the parts on several ranks are combined).

    Args:
        tables: a list of table names (e.g. ``["t_cat_0"]``) or state-dict keys; None for every
            table.
        sample_size: most rows read per table and rank (a whole number; ``4e6`` is one).
        every_n_steps: cadence in optimizer steps; None follows ``log_every_n_steps``.
        seed: seed of the row sample.

    Raises:
        ValueError: for a non-positive ``sample_size`` or ``every_n_steps``; for an empty
            ``tables`` (it selects no table; None means every table); for a table named twice
            in ``tables`` (naming it), also as a name and its key (at the start of the run).
        TypeError: for a ``sample_size`` with a fraction, or not a number; for ``tables`` given
            as one string (write ``tables=["t_cat_0"]``).
        KeyError: at the start of the run, for a table the model does not have.
    """

    def __init__(
        self,
        tables: Sequence[str] | None = None,
        sample_size: float = 4_000_000,
        every_n_steps: int | None = None,
        seed: int = 0,
    ) -> None:
        super().__init__(every_n_steps)
        self.tables = _table_list(tables)
        self.sample_size = as_sample_size(sample_size)
        self.seed = seed
        self._keys: dict[str, str] = {}

    @override
    def _state_key_args(self) -> dict[str, Any]:
        return {
            "every_n_steps": self.every_n_steps,
            "tables": self.tables,
            "sample_size": self.sample_size,
        }

    @override
    def _prepare(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        available = list(embedding_tables(pl_module))
        if not available:
            raise MisconfigurationException(
                "EmbeddingNormCallback found no EmbeddingBagCollection/EmbeddingCollection "
                "table in the LightningModule."
            )
        labels = table_labels(available)
        if self.tables is None:
            self._keys = {labels[k]: k for k in available}
            return
        by_name = {labels[k]: k for k in available}
        shared = {t: [k for k in available if table_of_key(k) == t] for t in self.tables}
        ambiguous = {t: keys for t, keys in shared.items() if len(keys) > 1}
        if ambiguous:
            raise KeyError(
                f"EmbeddingNormCallback(tables=...) names tables that several collections have: "
                f"{ambiguous}; name them by one of these keys"
            )
        unknown = [t for t in self.tables if t not in by_name and t not in available]
        unknown = [t for t in unknown if not shared[t]]
        if unknown:
            hints = {u: difflib.get_close_matches(u, list(by_name), n=3) for u in unknown}
            raise KeyError(
                f"EmbeddingNormCallback(tables=...) names unknown tables {unknown}; "
                f"closest: {hints}; the model has {sorted(by_name)}"
            )
        chosen = [t if t in available else by_name.get(t) or shared[t][0] for t in self.tables]
        same = {k: [t for t, c in zip(self.tables, chosen, strict=True) if c == k] for k in chosen}
        same = {labels[k]: names for k, names in same.items() if len(names) > 1}
        if same:
            raise ValueError(
                f"EmbeddingNormCallback(tables=...) names these tables more than once: {same}"
            )
        self._keys = {labels[k]: k for k in chosen}

    @override
    def _compute(self, pl_module: L.LightningModule) -> dict[str, float]:
        tables = embedding_tables(pl_module)
        values = log_ebc_norms(
            tables, list(self._keys.values()), sample_size=self.sample_size, seed=self.seed
        )
        out = {}
        for name, key in self._keys.items():
            for k, v in values.items():
                if k.startswith(f"{key}-norm-"):
                    out[f"embedding_norms/{name}{k[len(key) :]}"] = float(v)
        return out
