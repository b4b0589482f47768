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
# | `ModelAndLoss(model, loss_fn)` | `lightning_torchrec.ModelAndLoss(model, loss_fn, unpack_batch)` | same `(losses, outputs)` contract; any batch type (an `unpack_batch` hook), `weights` optional |
# | `maybe_shard_model(model, device)` | `lightning_torchrec.maybe_shard_model` / `TorchRecStrategy` | plans with the real world size and processes per host; the Trainer path shards, checkpoints and combines optimizers for you |
# | `weights_to_log(model, how_to_log)` | `lightning_torchrec.weights_to_log` / `WeightNormCallback` | built-in norms of a sharded table are of the whole table (all ranks), not of one rank's shard |
# | `log_ebc_norms(state_dict, ebc_keys, sample_size)` | `lightning_torchrec.log_ebc_norms` / `EmbeddingNormCallback` | works on CPU and GPU and on ranks holding 0, 1 or several shards (-1 where none); no state-dict rebuild |
# | `log_sharded_tensor_content(...)` | `lightning_torchrec.log_sharded_tensor_content` | any world size and backend; returns the table on rank 0; refuses huge tables unless asked |
# | custom training loop (`core/custom_training_loop.py`) | `lightning.Trainer(strategy="torchrec")` | loop, logging cadence, checkpoints, validation, LR schedules from Lightning |
#
# Everything below runs in one process (no process group); the same calls work unchanged in
# every rank of a distributed job.

# %%
# ruff: noqa: E501
import torch
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, KeyedJaggedTensor

from lightning_torchrec import Batch, ModelAndLoss
from lightning_torchrec.ebc_norms import log_ebc_norms
from lightning_torchrec.layout import log_sharded_tensor_content
from lightning_torchrec.norms import weights_to_log
from lightning_torchrec.planning import maybe_shard_model
from lightning_torchrec.tables import embedding_tables

torch.manual_seed(0)

# %% [markdown]
# ## `ModelAndLoss`
#
# The original wraps a model and `loss_fn(logits, labels)`; `forward(batch)` returns
# `(losses, outputs)` with `loss`, `labels` and `weights` added to `outputs`. Ours keeps that and:
#
# * calls `loss_fn(logits, labels, weights)`: sample weights belong in the loss (default: weighted
#   binary cross-entropy on logits); a loss may return a mapping with `"loss"` and extra entries;
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
# Same behaviour: `DistributedModelParallel` when a process group is up, the model itself
# otherwise. The original planned with a default topology; ours passes the world size, the
# processes per host (`LOCAL_WORLD_SIZE`) and the device type to the planner, and takes an explicit
# `plan`, `sharders`, `constraints` or `fused_params`.
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
# Same signature and keys: `how_to_log` is one callable for every parameter or a dict of
# parameter name to callable; keys are `model/{fn.__name__}/{parameter}`. The difference: in the
# original, each rank sees only its own shard of a sharded table, so the logged "norm" of a table
# is the norm of rank 0's shard. Here the built-in norms (`torch.norm`, `l2_norm`, `l1_norm`,
# `max_norm`...) are computed on the whole table across ranks with one all-reduce; any other
# callable is applied per shard and keyed `/rank{r}`. An unknown name in the dict is an error
# listing the close names.

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
# Same contract: the mean L2 norm of at most `sample_size` sampled rows per table and rank, keyed
# `{key}-norm-{rank}`, with -1 for a rank that holds no rows of the table. The original crashes on
# such ranks and hard-codes CUDA; ours runs on CPU and GPU, on ranks with zero, one or several
# shards, adds `{key}-norm-mean` (the row-weighted mean over ranks), and reads only the sampled
# rows. `embedding_tables(model)` gives the tables without building `model.state_dict()` (which
# the original rebuilt at every logging step).

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
# | `train_log_every_n` with `weights_to_log`/`log_ebc_norms` on a rebuilt state dict | `WeightNormCallback` / `EmbeddingNormCallback`, at `log_every_n_steps`, on the live shards |
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
