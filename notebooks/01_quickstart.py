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
# # Quickstart: TorchRec with a plain `lightning.Trainer`
#
# This notebook follows the path of TorchRec's *Introduction to TorchRec* tutorial (embeddings,
# `KeyedJaggedTensor`, `EmbeddingBagCollection`, sharding, fused optimizers) and trains the result
# with `Trainer(strategy="torchrec")`. It then logs weight and embedding-table norms with the two
# norm callbacks and reads them back from TensorBoard's event files.
#
# Everything runs on the CPU in about a minute.

# %%
import os
import tempfile
from pathlib import Path

import lightning as L
import matplotlib.pyplot as plt
import torch
from lightning.pytorch.loggers import TensorBoardLogger
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from torchrec import EmbeddingBagCollection, EmbeddingBagConfig, JaggedTensor, KeyedJaggedTensor
from torchrec.models.dlrm import DLRM

import lightning_torchrec  # registers Trainer(strategy="torchrec"), "torchrec_notebook", ...
from lightning_torchrec import ModelAndLoss, SyntheticClickData, TorchRecModule
from lightning_torchrec.lightning import EmbeddingNormCallback, WeightNormCallback

torch.manual_seed(0)
L.seed_everything(0, verbose=False)
print("lightning", L.__version__, "| torch", torch.__version__)

# %% [markdown]
# ## 1. Embeddings and `EmbeddingBag`
#
# An embedding table maps an id to a learned vector. Recommendation models look up *bags* of ids
# (e.g. the last items a user clicked) and pool them: `torch.nn.EmbeddingBag` does lookup and
# pooling in one call. Bags of different lengths are given flat, with offsets.

# %%
bag = torch.nn.EmbeddingBag(num_embeddings=10, embedding_dim=4, mode="sum")
ids = torch.tensor([1, 2, 4, 5, 4, 3, 2, 9])  # two bags: [1, 2, 4, 5] and [4, 3, 2, 9]
offsets = torch.tensor([0, 4])
print(bag(ids, offsets).shape)  # one pooled vector per bag

# %% [markdown]
# ## 2. `JaggedTensor` and `KeyedJaggedTensor`
#
# TorchRec's input is jagged: each sample has a variable number of ids per feature. A
# `KeyedJaggedTensor` (KJT) holds several features for a whole batch as flat `values` and
# `lengths` ordered feature-major (`F x B` lengths).

# %%
jt = JaggedTensor(values=torch.tensor([5, 7, 1, 2, 3]), lengths=torch.tensor([2, 0, 3]))
print(jt.to_dense())

kjt = KeyedJaggedTensor(
    keys=["user", "item"],
    values=torch.tensor([11, 12, 13, 101, 102, 103, 104]),
    lengths=torch.tensor([2, 1, 3, 1]),  # user: sample0 2 ids, sample1 1 id; item: 3 and 1
)
print(kjt)
print("ids of 'item':", kjt["item"].to_dense())

# %% [markdown]
# ## 3. `EmbeddingBagCollection`
#
# An `EmbeddingBagCollection` (EBC) holds many tables and maps each KJT feature to its table. Its
# output is a `KeyedTensor`: one pooled vector per feature and sample. This is the module TorchRec
# shards.

# %%
ebc = EmbeddingBagCollection(
    tables=[
        EmbeddingBagConfig(
            name="t_user", embedding_dim=8, num_embeddings=100, feature_names=["user"]
        ),
        EmbeddingBagConfig(
            name="t_item", embedding_dim=8, num_embeddings=200, feature_names=["item"]
        ),
    ],
    device=torch.device("cpu"),
)
pooled = ebc(kjt)
print(pooled.keys(), pooled.values().shape)
print("user vectors:", pooled["user"].shape)

# %% [markdown]
# ## 4. A click model: DLRM wrapped in `ModelAndLoss`
#
# Real tables are large, so they are created on the `meta` device: no memory is allocated until
# the strategy shards the model and each rank materialises only its own shards.
#
# `ModelAndLoss` (the contract of the-algorithm-ml) wraps the model with its loss: `forward(batch)`
# returns `(loss, outputs)`. `TorchRecModule` turns it into a LightningModule that logs
# `train/loss`, `val/loss` and `val/auroc`. The data module yields learnable synthetic clicks:
# labels depend on interactions of the hidden vectors of the ids, which is what DLRM models.

# %%
data = SyntheticClickData(
    num_embeddings=500,
    num_sparse_features=4,
    ids_per_feature=2,
    batch_size=256,
    train_batches=400,
    val_batches=8,
    test_batches=8,
    seed=0,
)
tables = [
    EmbeddingBagConfig(
        name=f"t_cat_{i}",
        embedding_dim=16,
        num_embeddings=rows,
        feature_names=[f"cat_{i}"],
        weight_init_min=-0.1,
        weight_init_max=0.1,
    )
    for i, rows in enumerate(data.num_embeddings_per_feature)
]
dlrm = DLRM(
    embedding_bag_collection=EmbeddingBagCollection(tables=tables, device=torch.device("meta")),
    dense_in_features=data.num_dense_features,
    dense_arch_layer_sizes=[32, 16],
    over_arch_layer_sizes=[32, 1],
)
module = TorchRecModule(ModelAndLoss(dlrm))
print([name for name, _ in module.named_parameters()][:3], "...")

# %% [markdown]
# ## 5. Train with `Trainer(strategy="torchrec")` and the norm callbacks
#
# The strategy plans the sharding (TorchRec's `EmbeddingShardingPlanner`), wraps the module in
# `DistributedModelParallel`, and combines the dense optimizer (Adam, from `TorchRecModule`) with
# the *fused* embedding optimizer (row-wise Adagrad, updated inside the backward pass; its
# settings come from `fused_params`).
#
# * `WeightNormCallback` logs the L2 norm of every parameter (`model/l2_norm/<param>`); the norm of
#   a sharded table is the norm of the whole table, gathered over ranks.
# * `EmbeddingNormCallback` logs the mean row norm of every table, per rank and overall
#   (`embedding_norms/<table>-norm-<rank>`, `embedding_norms/<table>-norm-mean`).
#
# Both log at the Trainer's `log_every_n_steps`.
#
# **Processes.** In a script, `Trainer(devices=2, strategy="torchrec")` starts two processes.
# A notebook cannot re-run itself, so processes are forked from the kernel:
# `strategy="torchrec_notebook"`, or `TorchRecStrategy(start_method="fork", ...)` to pass settings
# such as the fused learning rate. Each rank trains its shards in its own process; what comes
# back to the notebook is the trainer's state and `callback_metrics` (the sharded model lives and
# dies in the workers: read the logs, or save a checkpoint, to look at it afterwards).

# %%
log_root = Path(os.environ.get("QUICKSTART_LOG_DIR", tempfile.mkdtemp(prefix="quickstart-")))
# A fixed `version`: the forked workers and the notebook must agree on the log directory (left
# to itself, the notebook's logger would pick the next free version after the workers' one).
logger = TensorBoardLogger(save_dir=str(log_root), name="dlrm", version="quickstart")
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=lightning_torchrec.TorchRecStrategy(
        fused_params={"learning_rate": 0.1}, start_method="fork"
    ),
    max_steps=300,
    val_check_interval=100,
    limit_val_batches=8,
    log_every_n_steps=10,
    logger=logger,
    callbacks=[WeightNormCallback(), EmbeddingNormCallback()],
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, datamodule=data)
print({k: round(float(v), 4) for k, v in trainer.callback_metrics.items()})

# %% [markdown]
# Rank 0 wrote the sharding plan it used next to the logs (and to TensorBoard's *Text* tab):
# which table went to which rank, with which kernel.

# %%
print((Path(logger.log_dir) / "sharding_plan.md").read_text())

# %% [markdown]
# ## 6. Read the norms back from TensorBoard
#
# The callbacks write ordinary TensorBoard scalars. `tensorboard --logdir <dir>` shows them; here we
# read the event files with TensorBoard's `EventAccumulator` and plot them inline.

# %%
acc = EventAccumulator(logger.log_dir, size_guidance={"scalars": 0})
acc.Reload()
tags = acc.Tags()["scalars"]
print(len(tags), "scalar tags, e.g.", sorted(tags)[:4])


def series(tag: str) -> tuple[list[int], list[float]]:
    """Steps and values of one scalar tag."""
    events = acc.Scalars(tag)
    return [e.step for e in events], [e.value for e in events]


weight_tags = sorted(t for t in tags if t.startswith("model/l2_norm/"))
table_tags = sorted(
    t for t in tags if t.startswith("embedding_norms/") and t.endswith("-norm-mean")
)
assert weight_tags and table_tags, f"norm scalars missing from {sorted(tags)}"

fig, axes = plt.subplots(1, 3, figsize=(16, 4))
for tag in weight_tags:
    if tag.endswith(".weight"):
        axes[0].plot(*series(tag), label=tag.removeprefix("model/l2_norm/"))
axes[0].set_title("L2 norm of weights")
axes[0].legend(fontsize=6)
for tag in table_tags:
    axes[1].plot(*series(tag), label=tag.removeprefix("embedding_norms/"))
axes[1].set_title("mean row norm of each table")
axes[1].legend(fontsize=7)
axes[2].plot(*series("train/loss"), label="train/loss")
if "val/loss" in tags:
    axes[2].plot(*series("val/loss"), "o-", label="val/loss")
axes[2].set_title("loss")
axes[2].legend()
for ax in axes:
    ax.set_xlabel("step")
fig.tight_layout()
plt.show()

# %% [markdown]
# The tables start uniform in [-0.1, 0.1] (a mean row norm of about 0.23 for 16 columns). Row-wise
# Adagrad with learning rate 0.1 moves the rows the data uses within the first logged steps, and
# the norms keep growing while the loss falls as the model learns the interactions.

# %%
first, last = series(table_tags[0])[1][0], series(table_tags[0])[1][-1]
print(f"{table_tags[0]}: {first:.3f} -> {last:.3f}")
assert last != first, "the embedding table did not change during training"

# %% [markdown]
# ## 7. The same functions without the callbacks
#
# The callbacks are thin: the maths (`weights_to_log`, `log_ebc_norms`) works on any model,
# sharded (`DistributedModelParallel`, inside the workers) or plain, in or out of Lightning. Here
# on the unsharded EBC of section 3, in this single process.

# %%
from lightning_torchrec.sharding.tables import embedding_tables
from lightning_torchrec.training.ebc_norms import log_ebc_norms
from lightning_torchrec.training.norms import weights_to_log

print({k: round(float(v), 3) for k, v in weights_to_log(ebc).items()})
tables_now = embedding_tables(ebc)
print({k: round(float(v), 3) for k, v in log_ebc_norms(tables_now, sorted(tables_now)).items()})
