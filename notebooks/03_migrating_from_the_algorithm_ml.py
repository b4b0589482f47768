# ---
# jupyter:
#   jupytext:
#     formats: ipynb,py:percent
#     text_representation:
#       extension: .py
#       format_name: percent
#       format_version: '1.3'
#       jupytext_version: 1.19.6
#   kernelspec:
#     display_name: Python 3 (ipykernel)
#     language: python
#     name: python3
# ---

# %% [markdown]
# # Migrating from the-algorithm-ml
#
# twitter/the-algorithm-ml trains TorchRec models with its own loop and a few helpers
# (`model.py`, `common/log_weights.py`). Each has a counterpart here, with the same contract where
# it was sound and a fix where it was not.
#
# | the-algorithm-ml | lightning-torchrec | what differs |
# |---|---|---|
# | `ModelAndLoss(model, loss_fn)` | `lightning_torchrec.models.model_and_loss.ModelAndLoss(model, loss_fn, unpack_batch)` | same `(losses, outputs)` contract and `loss_fn(logits, labels, weights)` call; any batch type (an `unpack_batch` hook), `weights` optional |
# | `maybe_shard_model(model, device)` | `lightning_torchrec.sharding.planning.maybe_shard_model` / `TorchRecStrategy` | both plan for the world size, processes per host and device type (the original through DMP's default planner); ours is the strategy's one sharding path: default sharders with fused params, setup checks, a planning failure raised on every rank |
# | `weights_to_log(model, how_to_log)` | `lightning_torchrec.training.norms.weights_to_log` / `WeightNormCallback` | the original raises `AttributeError` on a model not wrapped in DMP; built-in norms of a sharded table are of the whole table (all ranks), not of one rank's shard; other callables keyed `/rank{r}` |
# | `log_ebc_norms(state_dict, ebc_keys, sample_size)` | `lightning_torchrec.training.ebc_norms.log_ebc_norms` / `EmbeddingNormCallback` | the original never emits -1 (it keeps only ranks whose gathered value is not -1); ours emits every rank, -1 where a rank holds no row, plus `-norm-mean`; CPU and GPU, ranks holding 0, 1 or several shards; no state-dict rebuild |
# | `log_sharded_tensor_content(...)` | `lightning_torchrec.sharding.layout.log_sharded_tensor_content` | any world size and backend; returns the table on rank 0; refuses huge tables unless asked |
# | custom training loop (`core/custom_training_loop.py`) | `lightning.Trainer(strategy="torchrec")` | loop, logging cadence, checkpoints, validation, LR schedules from Lightning; norms under other tags, logged one update later (see the end) |
#
# Everything below runs in one process (no process group); the same calls work unchanged in
# every rank of a distributed job.

# %%
# ruff: noqa: E501
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_torchrec import Batch, ModelAndLoss
from lightning_torchrec.sharding.layout import log_sharded_tensor_content
from lightning_torchrec.sharding.planning import maybe_shard_model
from lightning_torchrec.sharding.tables import embedding_tables
from lightning_torchrec.training.ebc_norms import log_ebc_norms
from lightning_torchrec.training.norms import weights_to_log

torch.manual_seed(0)

# %% [markdown]
# ## `ModelAndLoss`
#
# The original wraps a model and a loss and calls
# `loss_fn(outputs["logits"], batch.labels.float(), batch.weights.float())` (its docstring says
# "should accept logits and labels", its code passes the weights too); `forward(batch)` returns
# `(losses, outputs)` with `loss`, `labels` and `weights` added to `outputs`. Ours keeps that and:
#
# * makes the same `loss_fn(logits, labels, weights)` call, with a default loss (weighted binary
#   cross-entropy on logits); a loss may return a mapping with `"loss"` and extra entries;
# * takes `unpack_batch` to turn any batch into the model's inputs (default:
#   `(batch.dense_features, batch.sparse_features)`, TorchRec's DLRM convention), instead of
#   assuming `RecapBatch`;
# * treats missing `weights` as 1.


# %%
class TinyModel(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.ebc = EmbeddingBagCollection(
            tables=[
                EmbeddingBagConfig(
                    name="t_user", embedding_dim=4, num_embeddings=50, feature_names=["user"]
                )
            ],
        )
        self.head = torch.nn.Linear(4 + 3, 1)

    def forward(self, dense: torch.Tensor, sparse: KeyedJaggedTensor) -> torch.Tensor:
        return self.head(torch.cat([dense, self.ebc(sparse)["user"]], dim=1))


batch = Batch(
    dense_features=torch.randn(2, 3),
    sparse_features=KeyedJaggedTensor(
        keys=["user"], values=torch.tensor([1, 7, 9]), lengths=torch.tensor([2, 1])
    ),
    labels=torch.tensor([1.0, 0.0]),
)
model_and_loss = ModelAndLoss(TinyModel())
loss, outputs = model_and_loss(batch)
print(loss, sorted(outputs))

# %% [markdown]
# ## `maybe_shard_model`
#
# Same contract: `DistributedModelParallel` when a process group is up, the model itself
# otherwise. The original calls `DistributedModelParallel(module=model, device=device)` with no
# plan, so TorchRec's DMP plans with
# `Topology(world_size=..., local_world_size=get_local_size(world_size), compute_device=device.type)`
# and `get_default_sharders()` (no `fused_params`): world size, processes per host and device type
# were already used. (`get_local_size` assumes 8 per host when `LOCAL_WORLD_SIZE` is unset and the
# world size is a multiple of 8.) Ours calls `lightning_torchrec.sharding.planning.shard_model`, the same
# path as `TorchRecStrategy`: `LOCAL_WORLD_SIZE` per host (else the world size), default sharders
# carrying the fused optimizer of `default_fused_params()` (or your `fused_params`), the setup
# checks of `lightning_torchrec.sharding.setup_checks`, planning on rank 0 with a failure raised on every
# rank; and it takes an explicit `plan`, `sharders`, `constraints` or `fused_params`.
#
# With Lightning you do not call it: `Trainer(strategy="torchrec")` plans, shards (also for a
# standalone `validate`/`test`/`predict`), combines the dense and fused optimizers, and saves
# sharded checkpoints.

# %%
same = maybe_shard_model(model_and_loss, torch.device("cpu"))
print("no process group -> unchanged:", same is model_and_loss)

# %% [markdown]
# ## `weights_to_log`
#
# Same signature and key format: `how_to_log` is one callable for every parameter or a dict of
# parameter name to callable; keys are `model/{fn.__name__}/{parameter}`. The differences:
#
# * the original reads `model._dmp_wrapped_module` in a `logging.info` outside its
#   `isinstance(model, DistributedModelParallel)` check, so on a plain model (what its
#   `maybe_shard_model` returns without a process group) it raises `AttributeError: ... has no
#   attribute '_dmp_wrapped_module'`; ours takes plain and DMP-wrapped models (as below);
# * `how_to_log=None` means `l2_norm` (keys `model/l2_norm/...`); the original returns None;
# * in the original each rank sees only its own shard of a sharded table, so a table's "norm" is
#   one shard's. Here the built-in norms (`torch.norm`, `l2_norm`, `l1_norm`, `max_norm`...) are
#   computed on the whole table across ranks with one all-reduce; any other callable is applied
#   per shard and keyed `/rank{r}` (`/rank{r}/shard{i}` for several shards on a rank);
# * an unknown name in the dict is an error listing the close names (the original skips it).

# %%
print(weights_to_log(model_and_loss, how_to_log=torch.norm))
print(weights_to_log(model_and_loss, how_to_log={"model.head.bias": lambda t: t.abs().max()}))
try:
    weights_to_log(model_and_loss, how_to_log={"model.head.weights": torch.norm})
except KeyError as err:
    print("KeyError:", err)

# %% [markdown]
# ## `log_ebc_norms`
#
# Same value: the mean L2 norm of at most `sample_size` sampled rows per table and rank, keyed
# `{key}-norm-{rank}`. Not the same keys: the original starts each rank at -1, computes a norm
# only `if emb_key in model_state_dict`, all-gathers, and keeps an entry only `if norm != -1.0`,
# so -1 never reaches its logs. It also crashes on a rank holding zero or several shards
# (`ShardedTensor.local_tensor()` raises `NotImplementedError`) and hard-codes CUDA. Ours emits
# `{key}-norm-{rank}` for every rank, -1 for a rank holding no row (drop values `< 0` to get the
# original's keys), adds `{key}-norm-mean` (the mean norm of whole rows of the table, exact for
# any sharding), runs on CPU and GPU, on ranks with zero, one or several shards, and reads only
# the sampled rows of a sample fixed by `seed`. `embedding_tables(model)` gives the tables without
# building `model.state_dict()` (which the original rebuilt at every logging step).

# %%
tables = embedding_tables(model_and_loss)
print(sorted(tables))
print(log_ebc_norms(tables, sorted(tables), sample_size=10))

# %% [markdown]
# ## `log_sharded_tensor_content`
#
# The original worked on single-GPU machines only. Ours gathers a table from any number of ranks
# (gloo or NCCL) to rank 0, returns it there (None elsewhere) and logs it; tables with more than
# `max_rows` rows are refused before any communication.

# %%
name = "model.ebc.embedding_bags.t_user.weight"
full = log_sharded_tensor_content(name, "t_user", tables[name], max_rows=100)
print(full.shape, torch.equal(full, tables[name].detach()))

# %% [markdown]
# ## The training loop
#
# The-algorithm-ml's custom loop does by hand what the Trainer does. The mapping:
#
# | custom loop | Lightning |
# |---|---|
# | `maybe_shard_model(model, device)` | `Trainer(strategy="torchrec")` shards at `fit`/`validate`/`test`/`predict` |
# | `apply_optimizer_in_backward` / `fused_params` for tables, a dense optimizer for the rest | `TorchRecStrategy(fused_params=...)` + `configure_optimizers` on `dense_parameters(self)`; combined into one optimizer |
# | `loss, outputs = model(batch)`; `loss.backward()`; `optimizer.step()` | `training_step` returns `loss`; Lightning runs backward/step |
# | `train_log_every_n` with `weights_to_log`/`log_ebc_norms` on a rebuilt state dict | `WeightNormCallback` / `EmbeddingNormCallback`, at `log_every_n_steps` (or `every_n_steps`), on the live shards |
# | key `model/{fn.__name__}/{param}` (`param` named in the model given to the loop) | tag `model/{fn.__name__}/{param}` (`param` named in the LightningModule, e.g. `model_and_loss.model.head.weight`; default `model/l2_norm/...`; `/rank{r}` for custom callables on sharded tables) |
# | key `{state-dict key}-norm-{rank}`, ranks with -1 dropped | tags `embedding_norms/{table}-norm-{rank}` (-1 for a rank without rows) and `embedding_norms/{table}-norm-mean` |
# | logs at `step % train_log_every_n == 0`, counting from 0 before the update: steps 0, N, 2N after updates 1, N+1, 2N+1 | logs at `global_step % N == 0` after the update: step N after update N; shift the original's curve by one update (its step L is update L+1) to compare |
# | `torchsnapshot` checkpoints | sharded DCP checkpoints from `ModelCheckpoint` / `trainer.save_checkpoint`; resume with `ckpt_path` |
# | LR schedule applied to the dense optimizer only | a scheduler on the combined optimizer drives the fused embedding LR too |
#
# The module you write:
#
# ```python
# class MyModule(L.LightningModule):
#     def __init__(self, model):
#         super().__init__()
#         self.model_and_loss = ModelAndLoss(model)   # model's tables on the meta device
#
#     def training_step(self, batch, batch_idx):
#         loss, outputs = self.model_and_loss(batch)
#         self.log("train/loss", loss)
#         return loss
#
#     def configure_optimizers(self):
#         return combine_optimizers(torch.optim.Adam(dense_parameters(self)), self)
#
# trainer = L.Trainer(
#     devices=2,
#     strategy=TorchRecStrategy(fused_params={"optimizer": "exact_rowwise_adagrad",
#                                             "learning_rate": 0.05}),
#     callbacks=[WeightNormCallback(), EmbeddingNormCallback(sample_size=4_000_000)],
#     log_every_n_steps=1000,
# )
# trainer.fit(MyModule(model), datamodule=...)
# ```
#
# `TorchRecModule(ModelAndLoss(model), optimizer=..., lr_scheduler=...)` is that module, ready
# made, with validation loss and AUROC.
