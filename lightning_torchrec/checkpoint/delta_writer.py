"""The delta chain of one run: its base, sequence, last id and touched ids, for any loop.

:class:`DeltaWriter` is what the Trainer's ``DeltaPublisher`` callback and a Fabric loop of
one's own share: it saves (through the front end's own save) a full checkpoint ``base`` the
first time, tracks the rows training touches (:class:`~lightning_torchrec.training.touched.
TouchedIds`), publishes ``delta-000001``, ``delta-000002``, ... (:func:`~lightning_torchrec.
checkpoint.delta.write_delta`) and keeps its state in every full checkpoint
(:meth:`DeltaWriter.state_dict`), so a resumed run continues the chain exactly.
"""

from __future__ import annotations

import json
import logging
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from lightning_torchrec.checkpoint.common import agree_checkpoint_error
from lightning_torchrec.checkpoint.delta import (
    DELTA_FILE,
    check_whole_rows,
    checkpoint_id,
    delta_name,
    model_tables,
    write_delta,
)
from lightning_torchrec.checkpoint.paths import local_path
from lightning_torchrec.distributed import broadcast_from_rank0, rank_and_world_size
from lightning_torchrec.training.touched import TouchedIds

log = logging.getLogger(__name__)

#: The full checkpoint a chain starts from, in the chain's folder.
BASE_NAME = "base"


class DeltaWriter:
    """Publishes the deltas of one run into ``dirpath`` (``base``, ``delta-000001``, ...).

    Every method but :meth:`load_state_dict` is collective: every rank calls it at the same
    point.

    Args:
        dirpath: the chain's folder.
        with_optimizer: write the touched rows' optimizer state too.
        key: sign deltas with this HMAC key (default: see ``signing.resolve_key``).
    """

    def __init__(
        self, dirpath: str | Path, *, with_optimizer: bool = False, key: bytes | str | None = None
    ) -> None:
        self.dirpath = local_path(dirpath)
        self.with_optimizer = with_optimizer
        self.key = key
        #: The sequence number of the last delta published (0: none yet).
        self.sequence = 0
        #: The id of the state the next delta follows (the last delta's, or the base's).
        self.last_id: str | None = None
        #: The base checkpoint's id (None before :meth:`start`).
        self.base_id: str | None = None
        self.touched = TouchedIds()
        #: The touched ids are unknown (a state saved without them): the next delta holds
        #: every row of every table.
        self.everything = False

    @property
    def base_path(self) -> Path:
        """The base checkpoint's folder."""
        return self.dirpath / BASE_NAME

    def start(self, dmp: Any, module: nn.Module, save_base: Callable[[Path], None]) -> None:
        """Starts tracking; saves the base the first time, or checks it on a resumed chain.

        Args:
            dmp: the ``DistributedModelParallel``.
            module: the module holding the tables.
            save_base: saves a full checkpoint at the given path (collective), e.g.
                ``trainer.save_checkpoint``.

        Raises:
            FileExistsError: on every rank, if a fresh chain finds a base in ``dirpath`` (a
                chain of another run: give a new ``dirpath``, or resume that run).
            ValueError: on every rank, if a resumed chain's base is missing or is another.
            ShardingConflictError: on every rank, before the base is written, if a table is
                sharded by columns (a delta needs each row whole on one rank).
        """
        fresh = self.base_id is None
        error: BaseException | None = None
        try:  # a plan deltas cannot follow: refused now, not at the first publish
            check_whole_rows(model_tables(module))
        except Exception as err:  # noqa: BLE001 - agreed below
            error = err
        agree_checkpoint_error(error)

        def check() -> None:
            if fresh and (self.base_path.exists() or self.base_path.is_symlink()):
                raise FileExistsError(
                    f"{self.base_path} exists: {self.dirpath} holds the delta chain of another "
                    "run. Publish into a new folder, or resume that run from a checkpoint "
                    "written with its chain."
                )
            if not fresh:
                found = checkpoint_id(self.base_path) if self.base_path.exists() else None
                if found != self.base_id:
                    raise ValueError(
                        f"the resumed run's delta chain follows base {self.base_id}, but "
                        f"{self.base_path} is {'missing' if found is None else found}: the chain "
                        "cannot continue there"
                    )
                self._drop_later_deltas()
            self._drop_partial_deltas()

        broadcast_from_rank0(check)
        if fresh:
            self.dirpath.mkdir(parents=True, exist_ok=True)
            save_base(self.base_path)
            self.base_id = broadcast_from_rank0(lambda: checkpoint_id(self.base_path))
            self.last_id = self.base_id
            self.sequence = 0
        try:
            self.touched.attach(dmp, module)
        except Exception as err:  # noqa: BLE001 - agreed below
            error = err
        agree_checkpoint_error(error)

    def stop(self) -> None:
        """Stops tracking the model's lookups; the chain's state stays for a later start."""
        self.touched.detach()

    def _drop_partial_deltas(self) -> None:
        """Removes the hidden folders of deltas a killed run was writing (rank 0).

        A delta is written under ``.delta-NNNNNN.partial-*`` and renamed when complete; a run
        killed before the rename leaves that folder, which no chain and no server reads.
        """
        if not self.dirpath.is_dir():
            return
        for path in sorted(self.dirpath.glob(".delta-*.partial-*")):
            if path.is_dir() and not path.is_symlink():
                shutil.rmtree(path)
                log.info(
                    "%s: removed %s, a delta a killed run did not finish", self.dirpath, path.name
                )

    def _drop_later_deltas(self) -> None:
        """Removes deltas past the resumed sequence (rank 0).

        A killed run published them after the checkpoint this run resumes from; the chain
        continues from that checkpoint, so they belong to no chain any more.
        """
        later = []
        for path in sorted(self.dirpath.glob("delta-*")):
            tail = path.name[len("delta-") :]
            if path.is_dir() and tail.isdigit() and int(tail) > self.sequence:
                later.append(path)
        for path in later:
            shutil.rmtree(path)
        if later:
            warnings.warn(
                f"{self.dirpath}: removed {[p.name for p in later]}, published after the "
                f"checkpoint this run resumed from; the chain continues from "
                f"{delta_name(self.sequence) if self.sequence else BASE_NAME}",
                UserWarning,
                stacklevel=3,
            )

    def publish(
        self,
        module: nn.Module,
        step: int,
        *,
        partition: str | None = None,
        optimizer: Any = None,
    ) -> Path:
        """Writes the next delta: the rows touched since the last one, and the dense state.

        Args:
            module: the (sharded) module.
            step: the global step trained.
            partition: the partition's name, if any.
            optimizer: the (keyed) optimizer; its rows' state is written with
                ``with_optimizer``.

        Returns:
            The delta's folder.

        Raises:
            RuntimeError: before :meth:`start`.
        """
        if self.base_id is None or self.last_id is None:
            raise RuntimeError("DeltaWriter.start() first: the chain has no base yet")
        touched = self.touched.local()  # write_delta unites the ranks' ids
        if self.everything:
            touched = {t.name: torch.arange(t.rows) for t in model_tables(module).values()}
        path = write_delta(
            self.dirpath,
            module,
            touched,
            sequence=self.sequence + 1,
            parent=self.last_id,
            base=self.base_id,
            step=step,
            partition=partition,
            optimizer=optimizer if self.with_optimizer else None,
            key=self.key,
        )
        self.last_id = broadcast_from_rank0(
            lambda: json.loads((path / DELTA_FILE).read_text())["id"]
        )
        self.sequence += 1
        self.touched.clear()
        self.everything = False
        return path

    def state_dict(self, collective: bool = True) -> dict[str, Any]:
        """The chain's state, with every rank's touched ids united. Collective.

        Args:
            collective: False when the ranks may not all be here (a save while handling an
                exception on several ranks): nothing is gathered, and the state says that the
                touched ids are unknown, so a run resumed from it publishes whole tables next.

        Returns:
            ``{"sequence", "last_id", "base_id", "touched"}`` (``touched`` None: unknown).
        """
        world = rank_and_world_size()[1]
        known = collective or world == 1
        return {
            "sequence": self.sequence,
            "last_id": self.last_id,
            "base_id": self.base_id,
            "touched": self.touched.state_dict() if known and not self.everything else None,
            "world_size": world,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Continues the chain of a checkpoint's state (see :meth:`state_dict`).

        Args:
            state: the saved state.

        Raises:
            ValueError: for a state of another shape.
        """
        sequence, last, base = state.get("sequence"), state.get("last_id"), state.get("base_id")
        if not (type(sequence) is int and sequence >= 0):
            raise ValueError(f"a delta chain's state with sequence {sequence!r}")
        if not (isinstance(last, str | None) and isinstance(base, str | None)):
            raise ValueError("a delta chain's state whose ids are not strings")
        self.sequence, self.last_id, self.base_id = sequence, last, base
        touched = state.get("touched")
        self.everything = touched is None and last is not None
        self.touched.load_state_dict(touched or {})
