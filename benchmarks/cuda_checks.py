"""Checks of the strategy on one GPU (world size 1, nccl); runnable on CPU for testing.

``python -m benchmarks.cuda_checks --out DIR [--accelerator cuda] [--only NAME ...]`` writes
``DIR/cuda_checks.json`` (one entry per check: ``name``, ``ok`` (None when skipped),
``summary``, ``details`` or ``error``/``traceback``, ``seconds``) and prints one line per check as
it finishes. Checks:

* ``equality``: the same model, data and starting weights trained 30 steps by the Trainer with
  ``pipeline=None``, again with ``None`` (a determinism control), with ``"sparse_dist"``, and
  by TorchRec's own ``TrainPipelineSparseDist`` loop; per-step losses bit-equal or not (and the
  largest difference), then validation losses and final weights.
* ``sync_audit``: ``torch.cuda.set_sync_debug_mode("warn")`` over steps 10..15 of Trainer fits
  (``pipeline=None``, ``"sparse_dist"``, and ``"semi_sync"`` when the strategy has it); every
  GPU-to-host sync with the call-site frames in ``lightning_torchrec``, Lightning and TorchRec.
  Skipped without CUDA (``--audit-on-cpu`` runs it with ``Tensor.item``/``tolist``/``bool``/
  ``float``/``int`` standing in for syncs, to test the machinery).
* ``sharding``: a few steps under row-wise, table-row-wise, column-wise and data-parallel plans,
  fused row-wise Adagrad and Adam, and ``precision="bf16-mixed"``: finite losses, tables that
  change, and a checkpoint that loads into a fresh Trainer with identical weights and optimizer
  state. On CPU the CUDA-only cases must be refused with an error naming CUDA.
* ``bad_step``: a batch with an id out of its table at step 2, then a NaN loss at step 2, in
  unpipelined fits at ``batch_checks="auto"`` (on CPU: ``"next_step"``, which ``"auto"`` is on
  CUDA): each stops the fit at the next step with the named error, its copies to the host made
  through pinned buffers on CUDA (``HostCopy``). What else only a GPU runs: docs/benchmarks.md.
* ``demo``: the project's demo job (``lightning_torchrec.demo``) for a short run on the device;
  without ``jsonargparse`` (its CLI needs it) the same job is built in code instead.

Each check runs in a worker process that the parent watches: a check that hangs past its time
limit, or crashes the worker, is recorded as failed and the remaining checks go on in a fresh
worker. ``--in-process`` runs them all in this process instead.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
import traceback
import warnings
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader

from benchmarks.common import ROOT, CachedBatches, ModelSize
from benchmarks.harness import (
    FUSED,
    SEED,
    RawLoop,
    dataset,
    dlrm_module,
    pin_cached,
    rank_sampler,
    table_wise,
    versions,
)
from benchmarks.pipeline_throughput import strategy_kwargs

#: Time limit of each check in seconds (on a GPU each takes well under a minute).
TIMEOUTS = {"equality": 180, "sync_audit": 150, "bad_step": 120, "sharding": 240, "demo": 180}
#: Time limit for a worker to start its first check (imports, CUDA start-up).
STARTUP_TIMEOUT = 180
CHECKS = list(TIMEOUTS)
MARK = "@@"


@dataclass
class Context:
    """What every check gets."""

    accelerator: str
    out: Path
    audit_on_cpu: bool = False
    demo_mode: str = "auto"  # auto | cli | code

    @property
    def cuda(self) -> bool:
        """Whether the checks run on CUDA."""
        return self.accelerator == "cuda"

    def device(self) -> torch.device:
        """This process's device (after a Trainer has selected it)."""
        return (
            torch.device("cuda", torch.cuda.current_device()) if self.cuda else torch.device("cpu")
        )


class Skip(Exception):
    """Raised by a check that does not apply here (the entry gets ``ok: None``)."""


# ----------------------------------------------------------------------------- helpers


def quiet_trainer(ctx: Context, strategy: Any, root: Path, **kwargs: Any) -> L.Trainer:
    """A one-device Trainer without logger, progress bar, summary, checkpoints or sanity check."""
    defaults: dict[str, Any] = dict(
        accelerator=ctx.accelerator,
        devices=1,
        strategy=strategy,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        default_root_dir=root,
    )
    return L.Trainer(**(defaults | kwargs))


def local_view(value: Any) -> Any:
    """A rank-local copy of a state value: sharded tensors as ``[(offsets, shard), ...]``."""
    if hasattr(value, "local_shards"):
        return [
            (tuple(s.metadata.shard_offsets), s.tensor.detach().clone())
            for s in value.local_shards()
        ]
    if hasattr(value, "to_local") and isinstance(value, torch.Tensor):  # DTensor
        return value.to_local().detach().clone()
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, dict):
        return {k: local_view(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(local_view(v) for v in value)
    return value


def flat(value: Any, prefix: str = "") -> dict[str, Any]:
    """``{path: leaf}`` of nested dicts, lists and ``(offsets, shard)`` pairs."""
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for k, v in value.items():
            out |= flat(v, f"{prefix}{k}.")
        return out
    if isinstance(value, list | tuple):
        out = {}
        for i, v in enumerate(value):
            out |= flat(v, f"{prefix}{i}.")
        return out
    return {prefix.rstrip("."): value}


def compare(a: Any, b: Any) -> dict[str, Any]:
    """Bit-equality and the largest absolute difference of two (nested) states."""
    fa, fb = flat(a), flat(b)
    differ, max_diff = [], 0.0
    for key in sorted(set(fa) | set(fb)):
        x, y = fa.get(key), fb.get(key)
        if isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor):
            if x.shape != y.shape or x.dtype != y.dtype:
                differ.append(f"{key} (shape/dtype)")
                max_diff = math.inf
            elif not torch.equal(x, y):
                differ.append(key)
                if x.is_floating_point():
                    max_diff = max(max_diff, (x.double() - y.double()).abs().max().item())
                else:
                    max_diff = math.inf
        elif x != y:
            differ.append(key)
    return {
        "bit_equal": not differ,
        "max_abs_diff": max_diff,
        "keys": len(fa),
        "differ": differ[:20],
    }


def compare_losses(a: list[torch.Tensor], b: list[torch.Tensor]) -> dict[str, Any]:
    """Step-by-step comparison of two loss sequences."""
    n = min(len(a), len(b))
    if n == 0:
        return {"steps": 0, "bit_equal": False, "max_abs_diff": None}
    x = torch.stack([t.float().cpu() for t in a[:n]]).double()
    y = torch.stack([t.float().cpu() for t in b[:n]]).double()
    unequal = (x != y).nonzero().flatten().tolist()
    return {
        "steps": n,
        "lengths": [len(a), len(b)],
        "bit_equal": not unequal and len(a) == len(b),
        "max_abs_diff": (x - y).abs().max().item(),
        "first_unequal_step": unequal[0] if unequal else None,
    }


def jsonable(value: Any) -> Any:
    """``value`` with tensors, paths and non-finite floats made JSON-safe."""
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple | set):
        return [jsonable(v) for v in value]
    if isinstance(value, torch.Tensor):
        return jsonable(value.item() if value.numel() == 1 else value.tolist())
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    return str(value)


class LossRecorder(Callback):
    """Records every training loss (detached, on the device) and every validation loss.

    Args:
        make_raw: builds a ``RawLoop`` once the process group exists (first fit only); its
            starting weights are copied into the module at ``on_train_start``.
        holder: where the raw loop is kept between fits (``holder["raw"]``).
    """

    def __init__(
        self, make_raw: Callable[[], RawLoop] | None = None, holder: dict[str, Any] | None = None
    ) -> None:
        self.make_raw = make_raw
        self.holder = holder if holder is not None else {}
        self.train: list[torch.Tensor] = []
        self.val: list[torch.Tensor] = []
        self.copied = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        if self.make_raw is not None and "raw" not in self.holder:
            self.holder["raw"] = self.make_raw()

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if "raw" in self.holder:
            self.copied = self.holder["raw"].copy_weights_to(pl_module)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self.train.append(loss.detach().clone())

    def on_validation_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if isinstance(outputs, torch.Tensor):
            self.val.append(outputs.detach().clone())


# ----------------------------------------------------------------------------- a. equality


def check_equality(ctx: Context, steps: int = 30) -> dict[str, Any]:
    """Trainer (None, None again, sparse_dist) against TorchRec's pipelined loop: bit-equal?"""
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from lightning_torchrec import TorchRecStrategy
    from lightning_torchrec.data import SyntheticClickDataset

    size = ModelSize.demo()
    data = dataset(size, steps + 4)
    data.prepare(list(rank_sampler(data, 0, 1)))
    val = CachedBatches(
        SyntheticClickDataset(
            [size.rows] * size.tables,
            num_batches=4,
            batch_size=size.batch_size,
            num_dense_features=size.dense,
            ids_per_feature=size.ids_per_feature,
            seed=SEED,
            split="val",
        )
    )
    val.prepare(range(4))
    if ctx.cuda:
        pin_cached(data)
        pin_cached(val)
    holder: dict[str, Any] = {}
    root = Path(tempfile.mkdtemp(prefix="cuda_checks_eq_"))

    def fit(pipeline: str | None) -> tuple[LossRecorder, Any]:
        L.seed_everything(SEED, verbose=False)
        rec = LossRecorder(lambda: RawLoop(size, data, ctx.device()), holder)
        strategy = TorchRecStrategy(
            fused_params=FUSED, constraints=table_wise(size), pipeline=pipeline, log_plan=False
        )
        trainer = quiet_trainer(ctx, strategy, root, max_steps=steps, callbacks=[rec])
        module = dlrm_module(size)
        sampler = rank_sampler(data, 0, 1)
        trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None, sampler=sampler))
        trainer.validate(module, dataloaders=DataLoader(val, batch_size=None), verbose=False)
        assert rec.copied > 0, "no weights copied from the raw loop"
        return rec, local_view(module.state_dict())

    none, none_state = fit(None)
    again, again_state = fit(None)
    sparse, sparse_state = fit("sparse_dist")
    raw: RawLoop = holder["raw"]
    device = ctx.device()
    pipeline = TrainPipelineSparseDist(raw.model, raw.optimizer, device)
    raw_losses = [pipeline.progress(raw.batches)["loss"].detach().clone() for _ in range(steps)]
    pipeline.detach()
    raw.model.eval()
    with torch.no_grad():
        raw_val = [raw.model(val.items[i].to(device))[0].detach().clone() for i in range(4)]
    prefix = "model_and_loss."
    raw_state = {prefix + k: v for k, v in local_view(raw.model.state_dict()).items()}
    sparse_tensors = {k: v for k, v in sparse_state.items() if k in raw_state}
    comparisons = {
        "train_sparse_dist_vs_none": compare_losses(sparse.train, none.train),
        "train_raw_pipeline_vs_sparse_dist": compare_losses(raw_losses, sparse.train),
        "train_raw_pipeline_vs_none": compare_losses(raw_losses, none.train),
        "train_control_none_vs_none": compare_losses(again.train, none.train),
        "val_sparse_dist_vs_none": compare_losses(sparse.val, none.val),
        "val_raw_vs_sparse_dist": compare_losses(raw_val, sparse.val),
        "val_control_none_vs_none": compare_losses(again.val, none.val),
        "state_sparse_dist_vs_none": compare(sparse_state, none_state),
        "state_raw_vs_sparse_dist": compare(raw_state, sparse_tensors),
        "state_control_none_vs_none": compare(again_state, none_state),
    }
    required = [k for k in comparisons if "control" not in k]
    ok = all(comparisons[k]["bit_equal"] for k in required)
    differ = [k for k in required if not comparisons[k]["bit_equal"]]
    control = comparisons["train_control_none_vs_none"]["bit_equal"]
    return {
        "ok": ok,
        "summary": (
            f"{steps} steps, all bit-equal"
            if ok
            else f"not bit-equal: {differ}; control None vs None bit-equal: {control}"
        ),
        "details": {
            "size": size.to_dict(),
            "steps": steps,
            "weights_copied": none.copied,
            "first_losses": {
                "none": [float(t) for t in none.train[:3]],
                "sparse_dist": [float(t) for t in sparse.train[:3]],
                "raw_pipeline": [float(t) for t in raw_losses[:3]],
            },
            "comparisons": comparisons,
        },
    }


# ----------------------------------------------------------------------------- b. sync audit

#: Path markers of the packages whose frames are reported (checked in this order).
PACKAGES = (
    ("lightning_torchrec", "/lightning_torchrec/"),
    ("benchmarks", "/benchmarks/"),
    ("torchrec", "/torchrec/"),
    ("fbgemm_gpu", "/fbgemm_gpu/"),
    ("torchmetrics", "/torchmetrics/"),
    ("lightning", "/lightning/"),
    ("lightning", "/pytorch_lightning/"),
    ("lightning", "/lightning_fabric/"),
    ("torch", "/torch/"),
)
OWNERS = {"lightning_torchrec", "benchmarks", "torchrec", "fbgemm_gpu", "torchmetrics", "lightning"}
SYNC_MESSAGE = "synchroniz"  # torch: "called a synchronizing CUDA operation"


def frame_label(frame: traceback.FrameSummary) -> tuple[str, str] | None:
    """``(package, "path/inside/package.py:line function")`` for a frame of a known package."""
    path = frame.filename.replace(os.sep, "/")
    for package, marker in PACKAGES:
        i = path.rfind(marker)
        if i >= 0:
            return package, f"{path[i + 1 :]}:{frame.lineno} {frame.name}"
    return None


class SyncAudit(Callback):
    """Records every GPU-to-host sync from the start of step ``start`` to the start of ``stop``.

    On CUDA ``torch.cuda.set_sync_debug_mode("warn")`` makes each sync a warning; a
    ``warnings.showwarning`` hook takes the Python stack at that point. That mode does not see
    ``torch.cuda.Event.synchronize`` nor ``torch.cuda.synchronize``, so they warn too (an event
    only when it had not been reached yet: waiting for one that was costs nothing). With
    ``proxy=True`` (CPU testing) ``Tensor.item``, ``tolist``, ``__bool__``, ``__float__`` and
    ``__int__`` warn instead.
    """

    PROXIED = ("item", "tolist", "__bool__", "__float__", "__int__")

    def __init__(self, start: int, stop: int, proxy: bool = False) -> None:
        self.start, self.stop, self.proxy = start, stop, proxy
        self.events: list[tuple[str, list[traceback.FrameSummary]]] = []
        self.active = False
        self.steps_seen: list[int] = []
        self._cm: Any = None
        self._saved: dict[str, Any] = {}
        self._waits: dict[str, Any] = {}

    def _show(self, message: Any, category: Any, filename: Any, lineno: Any, *rest: Any) -> None:
        text = str(message)
        if SYNC_MESSAGE in text:
            self.events.append((text, traceback.extract_stack()[:-1]))

    def _begin(self) -> None:
        self._cm = warnings.catch_warnings()
        self._cm.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._show
        if self.proxy:
            for name in self.PROXIED:
                self._saved[name] = original = getattr(torch.Tensor, name)
                setattr(torch.Tensor, name, self._proxy(name, original))
        else:
            torch.cuda.set_sync_debug_mode("warn")
            event, cuda = torch.cuda.Event, torch.cuda
            self._waits = {"event": event.synchronize, "device": cuda.synchronize}
            event.synchronize = self._event_wait(self._waits["event"])  # type: ignore[method-assign]
            cuda.synchronize = self._device_wait(self._waits["device"])
        self.active = True

    @staticmethod
    def _event_wait(original: Callable[..., Any]) -> Callable[..., Any]:
        def synchronize(event: Any, *args: Any, **kwargs: Any) -> Any:
            if not event.query():  # not reached yet: the host waits
                warnings.warn("called a synchronizing CUDA operation (CUDA event)", stacklevel=2)
            return original(event, *args, **kwargs)

        return synchronize

    @staticmethod
    def _device_wait(original: Callable[..., Any]) -> Callable[..., Any]:
        def synchronize(*args: Any, **kwargs: Any) -> Any:
            text = "called a synchronizing CUDA operation (torch.cuda.synchronize)"
            warnings.warn(text, stacklevel=2)
            return original(*args, **kwargs)

        return synchronize

    @staticmethod
    def _proxy(name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def method(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            text = f"called a synchronizing CUDA operation (CPU proxy: Tensor.{name})"
            warnings.warn(text, stacklevel=2)
            return original(self, *args, **kwargs)

        return method

    def _end(self) -> None:
        if not self.active:
            return
        self.active = False
        if self.proxy:
            for name, original in self._saved.items():
                setattr(torch.Tensor, name, original)
            self._saved.clear()
        else:
            torch.cuda.set_sync_debug_mode(0)
            if self._waits:
                torch.cuda.Event.synchronize = self._waits["event"]  # type: ignore[method-assign]
                torch.cuda.synchronize = self._waits["device"]
                self._waits = {}
        self._cm.__exit__(None, None, None)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        if batch_idx == self.stop:
            self._end()
        if batch_idx == self.start:
            self._begin()
        if self.active:
            self.steps_seen.append(batch_idx)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._end()

    def on_exception(
        self, trainer: L.Trainer, pl_module: L.LightningModule, exception: BaseException
    ) -> None:
        self._end()

    def report(self, top: int = 25, depth: int = 6) -> dict[str, Any]:
        """Syncs per step, per owner (innermost frame outside torch) and per call site."""
        owners: Counter[str] = Counter()
        sites: Counter[tuple[str, tuple[str, ...]]] = Counter()
        messages: Counter[str] = Counter()
        for text, stack in self.events:
            labelled = [lab for f in reversed(stack) if (lab := frame_label(f)) is not None]
            mine = [lab for lab in labelled if not lab[1].startswith("benchmarks/cuda_checks.py")]
            owner = next((p for p, _ in mine if p in OWNERS), "other")
            owners[owner] += 1
            # innermost torch frames (at most 2) up to the first frame of another package, then
            # that package's and the callers' frames
            first = next((i for i, (p, _) in enumerate(mine) if p != "torch"), len(mine))
            chain = mine[:first][:2] + [lab for lab in mine[first:] if lab[0] != "torch"]
            sites[(owner, tuple(f"{p}: {where}" for p, where in chain[:depth]))] += 1
            messages[text] += 1
        steps = len(self.steps_seen)
        return {
            "steps": self.steps_seen,
            "syncs": len(self.events),
            "syncs_per_step": len(self.events) / steps if steps else None,
            "by_owner": dict(owners.most_common()),
            "messages": dict(messages.most_common(5)),
            "sites": [
                {
                    "count": n,
                    "per_step": n / steps if steps else None,
                    "owner": o,
                    "frames": list(f),
                }
                for (o, f), n in sites.most_common(top)
            ],
        }


def check_sync_audit(ctx: Context, start: int = 10, stop: int = 16) -> dict[str, Any]:
    """GPU-to-host syncs of steady-state Trainer steps, per pipeline, with their call sites."""
    from lightning_torchrec import TorchRecStrategy
    from lightning_torchrec.training.pipelines import PIPELINES

    if not ctx.cuda and not ctx.audit_on_cpu:
        raise Skip("no CUDA")
    size = ModelSize.demo()
    steps = stop + 2
    data = dataset(size, steps + 4)
    data.prepare(list(rank_sampler(data, 0, 1)))
    if ctx.cuda:
        pin_cached(data)
    root = Path(tempfile.mkdtemp(prefix="cuda_checks_sync_"))
    pipelines: list[str | None] = [p for p in (None, "sparse_dist", "semi_sync") if p in PIPELINES]
    details: dict[str, Any] = {"mode": "cuda" if ctx.cuda else "cpu proxy (Tensor.item & co.)"}
    for pipeline in pipelines:
        L.seed_everything(SEED, verbose=False)
        audit = SyncAudit(start, stop, proxy=not ctx.cuda)
        try:
            strategy = TorchRecStrategy(
                fused_params=FUSED,
                constraints=table_wise(size),
                pipeline=pipeline,  # type: ignore[arg-type]
                log_plan=False,
                **strategy_kwargs(pipeline),
            )
            trainer = quiet_trainer(ctx, strategy, root, max_steps=steps, callbacks=[audit])
            trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
            details[str(pipeline)] = audit.report()
        except Exception as e:
            audit._end()
            details[str(pipeline)] = {
                "error": f"{type(e).__name__}: {e}"[:2000],
                "traceback": traceback.format_exc()[-3000:],
            }
    counts = {
        p: (v["syncs_per_step"] if "syncs" in v else v["error"][:80])
        for p, v in details.items()
        if isinstance(v, dict)
    }
    ok = all(isinstance(v, dict) and "error" not in v for k, v in details.items() if k != "mode")
    return {"ok": ok, "summary": f"syncs per step: {counts}", "details": details}


# ----------------------------------------------------------------------------- c. sharding


@dataclass
class Case:
    """One sharding/optimizer/precision configuration."""

    name: str
    sharding: str = "table_wise"
    fused: dict[str, Any] | None = None
    precision: str = "32-true"
    cuda_only: bool = False


def cases() -> list[Case]:
    """The configurations ``check_sharding`` trains."""
    from fbgemm_gpu.split_embedding_configs import EmbOptimType

    return [
        Case("row_wise", "row_wise", cuda_only=True),
        Case("table_row_wise", "table_row_wise", cuda_only=True),
        Case("column_wise", "column_wise"),
        Case("data_parallel", "data_parallel"),
        Case(
            "fused_exact_rowwise_adagrad",
            fused={"optimizer": EmbOptimType.EXACT_ROWWISE_ADAGRAD, "learning_rate": 0.05},
        ),
        Case(
            "fused_adam",
            fused={"optimizer": EmbOptimType.ADAM, "learning_rate": 0.01},
            cuda_only=True,
        ),
        Case("bf16_mixed", precision="bf16-mixed"),
    ]


class TableWatch(Callback):
    """Snapshot of the tables at the start of training, and every training loss."""

    def __init__(self) -> None:
        self.start: dict[str, Any] = {}
        self.losses: list[torch.Tensor] = []

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self.start = tables_of(pl_module)

    def on_before_backward(
        self, trainer: L.Trainer, pl_module: L.LightningModule, loss: torch.Tensor
    ) -> None:
        self.losses.append(loss.detach().float().clone())


def tables_of(module: L.LightningModule) -> dict[str, Any]:
    """This rank's view of every embedding table of ``module``."""
    return {
        k: local_view(v)
        for k, v in module.state_dict().items()
        if ".embedding_bags." in k and k.endswith("weight")
    }


def run_case(ctx: Context, case: Case, root: Path, tables: int = 4, steps: int = 6) -> dict:
    """Trains ``case``, checks losses and tables, saves, reloads into a fresh Trainer, compares."""
    from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy

    names = [f"t_cat_{i}" for i in range(tables)]

    def parts() -> tuple[Any, Any, Any]:
        from torchrec.distributed.planner.types import ParameterConstraints

        constraints = {n: ParameterConstraints(sharding_types=[case.sharding]) for n in names}
        data = SyntheticClickData(
            num_embeddings=200,
            num_sparse_features=tables,
            batch_size=64,
            train_batches=2 * steps,
            val_batches=2,
            test_batches=2,
            ids_per_feature=2,
        )
        model = DLRMClickModule([200] * tables, embedding_dim=8, dense_arch_layer_sizes=[16, 8])
        strategy = TorchRecStrategy(
            constraints=constraints, fused_params=case.fused, log_plan=False
        )
        return data, model, strategy

    L.seed_everything(SEED, verbose=False)
    data, model, strategy = parts()
    watch = TableWatch()
    trainer = quiet_trainer(
        ctx,
        strategy,
        root / case.name,
        max_steps=steps,
        precision=case.precision,
        limit_val_batches=0,
        callbacks=[watch],
    )
    try:
        trainer.fit(model, datamodule=data)
    except Exception as e:
        if case.cuda_only and not ctx.cuda and "CUDA" in str(e):
            return {"ok": True, "refused_on_cpu": f"{type(e).__name__}: {str(e)[:300]}"}
        raise
    if case.cuda_only and not ctx.cuda:
        return {"ok": False, "error": "a CUDA-only configuration trained on CPU"}
    plan = {
        table: (ps.sharding_type, ps.compute_kernel, len(ps.ranks or []))
        for module_plan in (strategy.sharding_plan.plan.values() if strategy.sharding_plan else [])
        for table, ps in module_plan.items()  # type: ignore[attr-defined]
    }
    losses = torch.stack(watch.losses).cpu()
    end = tables_of(model)
    changed = {k: not compare(watch.start[k], end[k])["bit_equal"] for k in end}
    ckpt = root / case.name / "saved.ckpt"
    trainer.save_checkpoint(ckpt)
    saved_model = local_view(model.state_dict())
    saved_optim = local_view(trainer.optimizers[0].state_dict()["state"])
    data2, model2, strategy2 = parts()
    trainer2 = quiet_trainer(
        ctx,
        strategy2,
        root / case.name / "reload",
        max_steps=steps,
        precision=case.precision,
        limit_val_batches=0,
    )
    trainer2.fit(model2, datamodule=data2, ckpt_path=ckpt)  # already at max_steps: restores only
    weights = compare(local_view(model2.state_dict()), saved_model)
    optim = compare(local_view(trainer2.optimizers[0].state_dict()["state"]), saved_optim)
    finite = bool(torch.isfinite(losses).all())
    ok = (
        finite
        and len(losses) == steps
        and all(changed.values())
        and weights["bit_equal"]
        and optim["bit_equal"]
        and trainer2.global_step == trainer.global_step
    )
    return {
        "ok": ok,
        "plan": plan,
        "losses": [round(float(x), 6) for x in losses],
        "finite": finite,
        "tables_changed": changed,
        "checkpoint_weights": weights,
        "checkpoint_optimizer_state": optim,
        "global_steps": [trainer.global_step, trainer2.global_step],
    }


def check_sharding(ctx: Context) -> dict[str, Any]:
    """Every case of :func:`cases`; one failing case does not stop the others."""
    root = Path(tempfile.mkdtemp(prefix="cuda_checks_shard_"))
    details: dict[str, Any] = {}
    for case in cases():
        start = time.perf_counter()
        try:
            details[case.name] = run_case(ctx, case, root)
        except Exception as e:
            details[case.name] = {
                "ok": False,
                "error": f"{type(e).__name__}: {e}"[:3000],
                "traceback": traceback.format_exc()[-4000:],
            }
        details[case.name]["seconds"] = round(time.perf_counter() - start, 2)
        print(f"  sharding case {case.name}: ok={details[case.name]['ok']}", flush=True)
    failed = [n for n, d in details.items() if not d["ok"]]
    return {
        "ok": not failed,
        "summary": f"{len(details) - len(failed)}/{len(details)} cases ok"
        + (f"; failed: {failed}" if failed else ""),
        "details": details,
    }


# ----------------------------------------------------------------------------- d. demo


def cli_available() -> tuple[bool, str]:
    """Whether LightningCLI (jsonargparse with signatures) can run here, and why not."""
    try:
        from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE as available
    except Exception as e:
        return False, f"lightning.pytorch.cli: {e!r}"
    return bool(available), "" if available else f"LightningCLI needs {available}"


def check_demo(ctx: Context) -> dict[str, Any]:
    """The demo job for a short run: through its CLI, or built in code without jsonargparse."""
    steps, every, val_batches = (400, 200, 10) if ctx.cuda else (20, 10, 2)
    root = ctx.out / "demo"
    available, why = cli_available()
    mode = ctx.demo_mode if ctx.demo_mode != "auto" else ("cli" if available else "code")
    details: dict[str, Any] = {"mode": mode, "steps": steps}
    if mode == "cli" and not available:
        raise Skip(why)
    if not available:
        details["cli_unavailable"] = why
    start = time.perf_counter()
    if mode == "cli":
        from lightning_torchrec import demo

        cli = demo.main(
            [
                "fit",
                f"--trainer.accelerator={ctx.accelerator}",
                "--trainer.devices=1",
                f"--trainer.max_steps={steps}",
                f"--trainer.val_check_interval={every}",
                f"--trainer.limit_val_batches={val_batches}",
                "--trainer.enable_progress_bar=false",
                f"--trainer.default_root_dir={root}",
                f"--trainer.logger.init_args.save_dir={root}",
            ]
        )
        trainer = cli.trainer
    else:
        trainer = demo_in_code(ctx, root, steps, every, val_batches)
    details["seconds"] = round(time.perf_counter() - start, 2)
    logged = {**trainer.logged_metrics, **trainer.callback_metrics}  # throughput: logged only
    metrics = {k: float(v) for k, v in logged.items()}
    details["global_step"] = trainer.global_step
    details["metrics"] = metrics
    auroc = metrics.get("val/auroc")
    ok = trainer.global_step == steps and auroc is not None and math.isfinite(auroc)
    rates = [v for k, v in metrics.items() if k.endswith("samples_per_sec")]
    rate = max(rates) if rates else None
    summary = (
        f"{mode}: {trainer.global_step} steps, val/auroc {auroc}, val/ne {metrics.get('val/ne')}"
        f", samples/s {rate}"
    )
    return {"ok": ok, "summary": summary, "details": details}


def demo_in_code(ctx: Context, root: Path, steps: int, every: int, val_batches: int) -> L.Trainer:
    """The demo's job (its trainer defaults, callbacks, data and model) without LightningCLI."""
    from lightning.pytorch.callbacks import LearningRateMonitor, ThroughputMonitor
    from lightning.pytorch.loggers import TensorBoardLogger

    from lightning_torchrec import DLRMClickModule, SyntheticClickData, TorchRecStrategy
    from lightning_torchrec.demo import TRAINER_DEFAULTS
    from lightning_torchrec.lightning import EmbeddingNormCallback, WeightNormCallback
    from lightning_torchrec.training.metrics import batch_size_of

    L.seed_everything(0)
    data = SyntheticClickData(num_embeddings=200, ids_per_feature=2, train_batches=4000)
    model = DLRMClickModule(data.num_embeddings_per_feature, num_dense_features=13)
    fused = TRAINER_DEFAULTS["strategy"]["init_args"]["fused_params"]
    trainer = L.Trainer(
        accelerator=ctx.accelerator,
        devices=1,
        strategy=TorchRecStrategy(fused_params=fused),
        max_steps=steps,
        val_check_interval=every,
        limit_val_batches=val_batches,
        log_every_n_steps=TRAINER_DEFAULTS["log_every_n_steps"],
        enable_checkpointing=False,
        enable_progress_bar=False,
        default_root_dir=root,
        logger=TensorBoardLogger(save_dir=root, name="dlrm"),
        callbacks=[
            LearningRateMonitor("step"),
            WeightNormCallback(),
            EmbeddingNormCallback(),
            ThroughputMonitor(batch_size_fn=batch_size_of, window_size=20),
        ],
    )
    trainer.fit(model, datamodule=data)
    return trainer


class _PinnedSeen(Callback):
    """Records, after a step, whether the step guard's copies to the host use pinned buffers."""

    def __init__(self) -> None:
        self.seen: dict[str, Any] = {}

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        guard = trainer.strategy._runner.guard  # type: ignore[attr-defined]
        deferred = guard.deferred
        self.seen = {
            "deferred": deferred is not None,
            "flags_pinned": deferred is not None and deferred._copy._pinned,
            "loss_pinned": guard._loss_copy._pinned,
        }


def check_bad_step(ctx: Context, at: int = 2) -> dict[str, Any]:
    """A bad batch, then a NaN loss, at step ``at``: each stops the fit at the next step."""
    from lightning_torchrec import TorchRecStrategy
    from lightning_torchrec.errors import BatchValidationError, NonFiniteLossError

    size = ModelSize.tiny()
    root = Path(tempfile.mkdtemp(prefix="cuda_checks_bad_step_"))
    details: dict[str, Any] = {"batch_checks": "auto" if ctx.cuda else "next_step"}
    expected = {"bad_batch": BatchValidationError, "nan_loss": NonFiniteLossError}
    for case, kind in expected.items():
        L.seed_everything(SEED, verbose=False)
        data = dataset(size, at + 6)
        data.prepare(list(rank_sampler(data, 0, 1)))
        if case == "bad_batch":
            data[at].sparse_features.values()[3] = size.rows + 7
        module = dlrm_module(size)
        if case == "nan_loss":
            step = module.training_step

            def nan_at(batch: Any, batch_idx: int, step: Any = step) -> Any:
                loss = step(batch, batch_idx)
                return loss * float("nan") if batch_idx == at else loss

            module.training_step = nan_at
        strategy = TorchRecStrategy(
            fused_params=FUSED,
            constraints=table_wise(size),
            pipeline=None,
            log_plan=False,
            batch_checks=details["batch_checks"],
        )
        seen = _PinnedSeen()
        trainer = quiet_trainer(ctx, strategy, root, max_steps=at + 4, callbacks=[seen])
        found: BaseException | None = None
        try:
            trainer.fit(module, train_dataloaders=DataLoader(data, batch_size=None))
        except Exception as e:  # noqa: BLE001 - recorded, judged below
            found = e
        message = "" if found is None else f"{type(found).__name__}: {found}"[:500]
        details[case] = {"error": message, "global_step": trainer.global_step, **seen.seen}
        named = f"step {at}" if case == "bad_batch" else f"global step {at} "
        details[case]["ok"] = (
            isinstance(found, kind)
            and named in str(found)
            and trainer.global_step == at + 1  # step ``at`` ran; the next one did not
            and seen.seen.get("loss_pinned") == ctx.cuda
            and (case != "bad_batch" or seen.seen.get("flags_pinned") == ctx.cuda)
        )
    ok = all(details[case]["ok"] for case in expected)
    summary = ", ".join(
        f"{case}: {'stopped' if details[case]['ok'] else 'NOT stopped as expected'} at "
        f"global step {details[case]['global_step']}"
        for case in expected
    )
    return {"ok": ok, "summary": summary, "details": details}


# ----------------------------------------------------------------------------- running

FUNCTIONS: dict[str, Callable[[Context], dict[str, Any]]] = {
    "equality": check_equality,
    "sync_audit": check_sync_audit,
    "sharding": check_sharding,
    "demo": check_demo,
    "bad_step": check_bad_step,
}


def run_check(name: str, ctx: Context) -> dict[str, Any]:
    """Runs one check; never raises (errors become the entry's ``error``)."""
    start = time.perf_counter()
    entry: dict[str, Any] = {"name": name}
    try:
        entry |= FUNCTIONS[name](ctx)
    except Skip as e:
        entry |= {"ok": None, "skipped": str(e), "summary": f"skipped: {e}"}
    except Exception as e:
        entry |= {
            "ok": False,
            "error": f"{type(e).__name__}: {e}"[:3000],
            "traceback": traceback.format_exc()[-6000:],
            "summary": f"{type(e).__name__}: {str(e)[:300]}",
        }
    entry["seconds"] = round(time.perf_counter() - start, 2)
    return jsonable(entry)


def summary_line(entry: dict[str, Any]) -> str:
    """``PASS name (12.3 s): ...``."""
    word = {True: "PASS", False: "FAIL", None: "SKIP"}[entry.get("ok")]
    text = " ".join(str(entry.get("summary", "")).split())
    return f"{word} {entry['name']} ({entry.get('seconds', 0):.1f} s): {text[:400]}"


def write_summary(ctx: Context, entries: list[dict[str, Any]], info: dict[str, Any]) -> Path:
    """Writes ``cuda_checks.json``."""
    ctx.out.mkdir(parents=True, exist_ok=True)
    path = ctx.out / "cuda_checks.json"
    counts = Counter(
        {True: "passed", False: "failed", None: "skipped"}[e.get("ok")] for e in entries
    )
    payload = {
        "accelerator": ctx.accelerator,
        **info,
        "counts": dict(counts),
        "checks": entries,
    }
    path.write_text(json.dumps(jsonable(payload), indent=2))
    return path


def worker(ctx: Context, names: list[str]) -> None:
    """Runs ``names`` in turn, writing ``check_{name}.json`` and markers for the parent."""
    if os.environ.get("PYTHONUNBUFFERED") is None:
        sys.stdout.reconfigure(line_buffering=True)  # type: ignore[union-attr]
    if ctx.accelerator == "cpu":
        torch.set_num_threads(1)
    parent = os.getppid()

    def orphaned() -> None:  # the parent was killed (e.g. SIGKILL by `timeout -k`): stop too
        while os.getppid() == parent:
            time.sleep(2)
        os._exit(3)

    threading.Thread(target=orphaned, daemon=True).start()
    for name in names:
        print(f"{MARK}START {name}", flush=True)
        entry = run_check(name, ctx)
        (ctx.out / f"check_{name}.json").write_text(json.dumps(entry, indent=2))
        print(f"{MARK}DONE {name}", flush=True)


def _clean_env() -> dict[str, str]:
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("PL_", "MASTER_", "LOCAL_", "TORCHELASTIC"))
        and k not in ("RANK", "WORLD_SIZE", "NODE_RANK", "GROUP_RANK")
    }
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _tail(path: Path, chars: int = 4000) -> str:
    try:
        return path.read_text(errors="replace")[-chars:]
    except OSError:
        return ""


def supervise(
    ctx: Context, names: list[str], extra: list[str], scale: float, info: dict[str, Any]
) -> list[dict]:
    """Runs the checks in worker processes with time limits; restarts after a hang or crash."""
    entries: dict[str, dict[str, Any]] = {}
    remaining = list(names)
    log_path = ctx.out / "cuda_checks_worker.log"
    attempt = 0
    while remaining:
        attempt += 1
        cmd = [sys.executable, "-m", "benchmarks.cuda_checks", "--out", str(ctx.out)]
        cmd += ["--accelerator", ctx.accelerator, "--worker", ",".join(remaining), *extra]
        log = log_path.open("a")
        log.write(f"\n===== worker {attempt}: {' '.join(cmd)}\n")
        log.flush()
        proc = subprocess.Popen(
            cmd,
            cwd=ROOT,
            env=_clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
        )
        marks: queue.Queue[str | None] = queue.Queue()

        def pump(stream: Any = proc.stdout, sink: Any = log, out: Any = marks) -> None:
            for line in stream:
                sink.write(line)
                sink.flush()
                if line.startswith(MARK):
                    out.put(line[len(MARK) :].strip())
            out.put(None)

        threading.Thread(target=pump, daemon=True).start()

        def stop(signum: int, frame: Any, pid: int = proc.pid) -> None:
            # e.g. SIGTERM from `timeout`: the worker is in its own session, end it too
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            raise SystemExit(128 + signum)

        signal.signal(signal.SIGTERM, stop)
        signal.signal(signal.SIGINT, stop)
        current: str | None = None
        since = time.monotonic()
        limit = STARTUP_TIMEOUT * scale
        failure: str | None = None
        while True:
            try:
                mark = marks.get(timeout=1.0)
            except queue.Empty:
                if time.monotonic() - since > limit:
                    failure = f"timed out after {limit:.0f} s"
                    break
                continue
            if mark is None:  # the worker's output ended: it exited
                proc.wait()
                if current is not None or remaining:
                    failure = f"worker exited with code {proc.returncode}"
                break
            kind, _, name = mark.partition(" ")
            if kind == "START":
                current, since, limit = name, time.monotonic(), TIMEOUTS[name] * scale
                print(f"... {name} started", flush=True)
            elif kind == "DONE":
                path = ctx.out / f"check_{name}.json"
                entries[name] = json.loads(path.read_text())
                remaining.remove(name)
                current, since, limit = None, time.monotonic(), STARTUP_TIMEOUT * scale
                print(summary_line(entries[name]), flush=True)
                write_summary(ctx, [entries[n] for n in names if n in entries], info)
        if failure is not None:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            victims = [current] if current is not None else list(remaining)
            for name in victims:
                entries[name] = {
                    "name": name,
                    "ok": False,
                    "error": f"{failure} (during {name if current else 'start-up'})",
                    "summary": f"{failure} (during {name if current else 'start-up'})",
                    "log_tail": _tail(log_path),
                    "seconds": round(time.monotonic() - since, 1),
                }
                remaining.remove(name)
                print(summary_line(entries[name]), flush=True)
            write_summary(ctx, [entries[n] for n in names if n in entries], info)
        else:
            log.close()
    return [entries[n] for n in names]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--accelerator", choices=["cpu", "cuda"], default="cuda")
    p.add_argument("--only", action="append", choices=CHECKS, help="run only these (repeatable)")
    p.add_argument("--in-process", action="store_true", help="no worker processes")
    p.add_argument("--audit-on-cpu", action="store_true", help="CPU proxy for the sync audit")
    p.add_argument("--demo-mode", choices=["auto", "cli", "code"], default="auto")
    p.add_argument("--timeout-scale", type=float, default=1.0, help="multiplies every time limit")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    ctx = Context(args.accelerator, args.out, args.audit_on_cpu, args.demo_mode)
    ctx.out.mkdir(parents=True, exist_ok=True)
    if args.worker is not None:
        worker(ctx, args.worker.split(","))
        return 0
    if ctx.cuda and not torch.cuda.is_available():
        print("--accelerator cuda: no CUDA device is visible", flush=True)
    info = {"versions": versions()}
    print(f"versions: {info['versions']}", flush=True)
    names = [n for n in CHECKS if not args.only or n in args.only]
    if args.in_process:
        entries = []
        for name in names:
            entries.append(run_check(name, ctx))
            print(summary_line(entries[-1]), flush=True)
            write_summary(ctx, entries, info)
    else:
        extra = ["--demo-mode", args.demo_mode] + (["--audit-on-cpu"] if args.audit_on_cpu else [])
        entries = supervise(ctx, names, extra, args.timeout_scale, info)
    path = write_summary(ctx, entries, info)
    failed = [e["name"] for e in entries if e.get("ok") is False]
    print(f"cuda_checks: wrote {path}; failed: {failed or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
