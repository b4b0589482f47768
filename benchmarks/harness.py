"""Interleaved step timing inside one 2-rank Lightning run.

``Interleaver`` is a callback whose ``on_train_batch_start`` marks the start of every Lightning
step, so the time between two marks is one full Lightning step (hooks, forward, backward, optimizer,
logging, progress bar, next batch). Steps run in blocks of ``block`` steps; each block belongs to a
variant (A B A B ...). A ``RawLoop`` runs its own block of plain TorchRec steps inside the hook,
outside the measured Lightning interval, on the same batches and from the same weights.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, DistributedSampler
from torchrec.distributed.planner.types import ParameterConstraints
from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

from benchmarks.common import CachedBatches, ModelSize

SEED = 1234
FUSED = {"learning_rate": 0.01}  # row-wise Adagrad, the strategy's default optimizer


def table_wise(size: ModelSize) -> dict[str, ParameterConstraints]:
    """Constraints that force a table-wise plan."""
    return {
        f"t_cat_{i}": ParameterConstraints(sharding_types=["table_wise"])
        for i in range(size.tables)
    }


def dataset(size: ModelSize, num_batches: int) -> CachedBatches:
    """The benchmark's batches (cached per rank by ``Interleaver.setup``)."""
    from lightning_torchrec.data import SyntheticClickDataset

    return CachedBatches(
        SyntheticClickDataset(
            [size.rows] * size.tables,
            num_batches=num_batches,
            batch_size=size.batch_size,
            num_dense_features=size.dense,
            ids_per_feature=size.ids_per_feature,
            seed=SEED,
        )
    )


def dlrm_module(size: ModelSize) -> Any:
    """The LightningModule: DLRM with tables on the meta device, Adam(1e-3) on dense parameters.

    Training metrics are off: the raw loop it is compared with computes none.
    """
    from lightning_torchrec import DLRMClickModule

    return DLRMClickModule(
        [size.rows] * size.tables,
        num_dense_features=size.dense,
        embedding_dim=size.dim,
        train_metrics_every_n_steps=0,
    )


#: Cached datasets whose batches ``pin_cached`` pinned (value: ``id`` of the pinned ``items``).
_PINNED: weakref.WeakKeyDictionary[CachedBatches, int] = weakref.WeakKeyDictionary()


def pin_cached(data: CachedBatches) -> bool:
    """Pins the cached host batches (once) so copies to a GPU can be asynchronous.

    Returns whether the batches are pinned: False without CUDA, without cached batches or for a
    batch type without ``pin_memory`` (``lightning_torchrec.data.Batch`` has one).
    """
    if not data.items or not torch.cuda.is_available():
        return False
    if _PINNED.get(data) == id(data.items):
        return True
    if not all(hasattr(b, "pin_memory") for b in data.items.values()):
        return False
    data.items = {i: b.pin_memory() for i, b in data.items.items()}
    _PINNED[data] = id(data.items)
    return True


def synchronize(device: torch.device) -> None:
    """Waits for the device's queued work (CUDA); nothing on CPU."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def versions() -> dict[str, Any]:
    """Versions of the stack and the accelerator's name (for result files)."""
    from importlib import metadata

    out: dict[str, Any] = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu", "lightning", "torchmetrics"):
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    try:
        import fbgemm_gpu

        out["fbgemm_gpu.__version__"] = getattr(fbgemm_gpu, "__version__", None)
    except Exception as e:  # a broken fbgemm install is worth reporting, not crashing on
        out["fbgemm_gpu.__version__"] = f"import failed: {e!r}"
    out["device"] = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    return out


def rank_sampler(data: CachedBatches, rank: int, world: int) -> DistributedSampler:
    """The sampler Lightning injects into a training loader (shuffled, seeded, epoch 0)."""
    sampler = DistributedSampler(data, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
    sampler.set_epoch(0)
    return sampler


class RawLoop:
    """A hand-written TorchRec loop: DMP, ``CombinedOptimizer``(dense Adam, fused), no Lightning.

    Built on the process group Lightning opened; same tables, plan constraints, fused settings and
    loss as the Lightning module (``ModelAndLoss`` is a plain ``nn.Module``). On CUDA the cached
    host batches are pinned, each step copies its batch with ``non_blocking=True`` and the loss
    stays on the device (``device_losses``; no ``item()``, so the host runs ahead); on CPU every
    step records ``loss.item()`` in ``losses``.

    Args:
        size: model and data sizes.
        data: the cached batches (the same objects Lightning reads).
        device: this rank's device (default CPU).
        pipelined: steps run through TorchRec's ``TrainPipelineSparseDist`` (the sparse-dist
            loop written by hand) instead of the plain loop.
    """

    def __init__(
        self,
        size: ModelSize,
        data: CachedBatches,
        device: torch.device | None = None,
        pipelined: bool = False,
    ) -> None:
        from torchrec.distributed.model_parallel import DistributedModelParallel
        from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
        from torchrec.distributed.types import ShardingEnv
        from torchrec.models.dlrm import DLRM
        from torchrec.modules.embedding_modules import EmbeddingBagCollection
        from torchrec.optim.keyed import CombinedOptimizer, KeyedOptimizerWrapper

        from lightning_torchrec.models.dlrm import dlrm_tables
        from lightning_torchrec.models.model_and_loss import ModelAndLoss
        from lightning_torchrec.sharding.planning import default_sharders

        self.device = device = device if device is not None else torch.device("cpu")
        rank, world = dist.get_rank(), dist.get_world_size()
        ebc = EmbeddingBagCollection(
            tables=dlrm_tables([size.rows] * size.tables, size.dim, "mean", 0.1),
            device=torch.device("meta"),
        )
        model = ModelAndLoss(
            DLRM(
                embedding_bag_collection=ebc,
                dense_in_features=size.dense,
                dense_arch_layer_sizes=[64, size.dim],
                over_arch_layer_sizes=[64, 1],
            )
        )
        sharders = default_sharders(FUSED)
        planner = EmbeddingShardingPlanner(
            topology=Topology(world_size=world, compute_device=device.type, local_world_size=world),
            constraints=table_wise(size),
        )
        plan = planner.collective_plan(model, sharders, dist.group.WORLD)
        self.model = DistributedModelParallel(
            model,
            env=ShardingEnv.from_process_group(dist.group.WORLD),
            device=device,
            plan=plan,
            sharders=sharders,
        )
        dense = {
            n: p
            for n, p in self.model.named_parameters()
            if p.requires_grad and not hasattr(p, "_in_backward_optimizers")
        }
        self.optimizer = CombinedOptimizer(
            [
                ("dense", KeyedOptimizerWrapper(dense, lambda ps: torch.optim.Adam(ps, lr=1e-3))),
                ("embedding", self.model.fused_optimizer),
            ]
        )
        if device.type == "cuda":
            pin_cached(data)
        sampler = rank_sampler(data, rank, world)
        self.batches = iter(DataLoader(data, batch_size=None, sampler=sampler))
        self.pipeline = (
            TrainPipelineSparseDist(self.model, self.optimizer, device) if pipelined else None
        )
        self.losses: list[float] = []
        self.device_losses: list[torch.Tensor] = []
        self.times: list[tuple[int, float]] = []

    def step(self) -> torch.Tensor:
        """One step: next batch (copied to the device), zero_grad, forward, backward, update.

        With ``pipelined``, one ``progress()`` of the sparse-dist pipeline instead (it copies,
        zeroes, updates and reads ahead itself). Returns the detached loss; on CPU its value is
        also appended to ``losses``.
        """
        if self.pipeline is not None:
            detached = self.pipeline.progress(self.batches)["loss"].detach()
        else:
            batch = next(self.batches)
            if self.device.type != "cpu":
                batch = batch.to(self.device, non_blocking=True)
            self.optimizer.zero_grad()
            loss, _ = self.model(batch)
            loss.backward()
            self.optimizer.step()
            detached = loss.detach()
        if self.device.type == "cpu":
            self.losses.append(detached.item())
        else:
            self.device_losses.append(detached)
        return detached

    def run_block(self, block_index: int, steps: int) -> None:
        """Runs and times ``steps`` steps."""
        for _ in range(steps):
            start = time.perf_counter()
            self.step()
            self.times.append((block_index, time.perf_counter() - start))

    def copy_weights_to(self, module: torch.nn.Module, prefix: str = "model_and_loss.") -> int:
        """Copies every local weight (table shards, dense layers) into ``module``; returns count."""
        src = self.model.state_dict()
        dst = module.state_dict()
        copied = 0
        with torch.no_grad():
            for key, value in src.items():
                target = dst[prefix + key]
                if hasattr(value, "local_shards"):
                    for s, d in zip(value.local_shards(), target.local_shards(), strict=True):
                        d.tensor.copy_(s.tensor)
                        copied += 1
                elif isinstance(value, torch.Tensor) and value.is_floating_point():
                    target.copy_(value)
                    copied += 1
        return copied


class Interleaver(Callback):
    """Times Lightning steps per variant block; runs the raw loop's blocks in between.

    Args:
        variants: Lightning variants cycled block by block (e.g. ``["lightning"]``).
        block: steps per block.
        data: the cached batches (``setup`` fills this rank's).
        raw: builds the raw loop after the process group exists, or None; or several (e.g. the
            plain and the sparse-dist loop), each running a block at every block boundary, in
            alternating order, from the first one's weights.
        profile: a ``cProfile.Profile`` enabled during measured Lightning steps, or None.
        configure: ``configure(trainer, variant)`` called when a block of ``variant`` starts.
    """

    def __init__(
        self,
        variants: Sequence[str],
        block: int,
        data: CachedBatches,
        raw: Callable[[], RawLoop | list[RawLoop]] | None = None,
        profile: Any = None,
        configure: Callable[[L.Trainer, str], None] | None = None,
    ) -> None:
        self.variants = list(variants)
        self.block = block
        self.data = data
        self.make_raw = raw
        self.raws: list[RawLoop] = []
        self.profile = profile
        self.configure = configure
        self.current = self.variants[0]
        self.block_index = 0
        self.last: float | None = None
        self.times: dict[str, list[tuple[int, float]]] = {v: [] for v in self.variants}
        self.records: list[tuple[str, int, float]] = []  # (variant, batch_idx, seconds)
        self.losses: list[float] = []
        self.copied = 0

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        self.data.prepare(list(rank_sampler(self.data, trainer.global_rank, trainer.world_size)))
        if self.make_raw is not None:
            made = self.make_raw()
            self.raws = made if isinstance(made, list) else [made]
            for other in self.raws[1:]:
                self.raws[0].copy_weights_to(other.model, prefix="")

    @property
    def raw(self) -> RawLoop | None:
        """The first raw loop (whose weights the others and the Lightning model start from)."""
        return self.raws[0] if self.raws else None

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.raw is not None:
            self.copied = self.raw.copy_weights_to(pl_module)

    def on_train_batch_start(
        self, trainer: L.Trainer, pl_module: L.LightningModule, batch: Any, batch_idx: int
    ) -> None:
        now = time.perf_counter()
        if self.profile is not None:
            self.profile.disable()
        if self.last is not None:
            self.times[self.current].append((self.block_index, now - self.last))
            self.records.append((self.current, batch_idx - 1, now - self.last))
        if batch_idx % self.block == 0:
            self.block_index = batch_idx // self.block
            self.current = self.variants[self.block_index % len(self.variants)]
            if self.configure is not None:
                self.configure(trainer, self.current)
            # Flipped every len(variants) blocks: each variant follows each order equally often.
            flip = (self.block_index // len(self.variants)) % 2
            order = self.raws[::-1] if flip else self.raws
            for raw in order:
                raw.run_block(self.block_index, self.block)
        if self.profile is not None:
            self.profile.enable()
        self.last = time.perf_counter()

    def on_train_batch_end(
        self,
        trainer: L.Trainer,
        pl_module: L.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
    ) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.losses.append(float(loss))

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self.profile is not None:
            self.profile.disable()


def per_block(times: list[tuple[int, float]], skip_blocks: int) -> dict[int, list[float]]:
    """``{block: [step times]}`` for blocks after the warm-up, first step of a block dropped."""
    out: dict[int, list[float]] = {}
    for block, t in times:
        if block >= skip_blocks:
            out.setdefault(block, []).append(t)
    return {b: ts[1:] for b, ts in out.items() if len(ts) > 1}
