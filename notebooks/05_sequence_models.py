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
# # Sequence models: SASRec with a row-wise item table
#
# Next-item prediction: from a user's items in time order, rank the whole catalogue for the item
# that comes next.
#
# 1. write a small MovieLens-layout `ratings.dat` whose structure is known, and read it with
#    `MovieLensSequenceData` (leave-last-out splits);
# 2. train the SASRec model on 2 forked CPU processes, its item table sharded **row-wise**;
# 3. compare its recall@10 and NDCG@10 with the best any model can reach on this data and with a
#    popularity list.
#
# See [the sequence models guide](../docs/sequence_models.md) for the batch layout, the loss and
# the figures of the full-size demo (`make demo-seq`).

# %%
import os
import tempfile
from pathlib import Path

import lightning as L
import numpy as np
import torch
from torchrec.distributed.planner.types import ParameterConstraints

import lightning_torchrec
from lightning_torchrec.data.movielens import best_achievable, write_cycle_ratings
from lightning_torchrec.data.sequences import MovieLensSequenceData, leave_last_out
from lightning_torchrec.lightning.sequence import SASRecModule
from lightning_torchrec.training.ranking import popularity_ranks, ranking_values

L.seed_everything(0, verbose=False)
work = Path(os.environ.get("SEQUENCE_NOTEBOOK_DIR", tempfile.mkdtemp(prefix="seq-")))

# %% [markdown]
# ## 1. Data of known structure
#
# `write_cycle_ratings` gives every item a fixed successor (a random permutation). A user's next
# item is the successor of the last one with probability `1 - noise`, otherwise a draw from a
# Zipf popularity distribution. The file has the `ratings.dat` layout
# (`user::item::rating::timestamp`, lines shuffled); a name ending in `.csv` would get the
# `ratings.csv` layout instead. It returns the rule it followed, which gives the best achievable
# metrics below.

# %%
structure = write_cycle_ratings(
    work / "ratings.dat", num_users=600, num_items=100, min_length=8, max_length=24, noise=0.3
)
print((work / "ratings.dat").read_text().splitlines()[:3])

data = MovieLensSequenceData(str(work / "ratings.dat"), max_length=12, batch_size=64)
seqs = data.sequences
print(f"{seqs.num_users} users, {seqs.num_items} items, {len(seqs.items)} interactions")
print("user 0, items in time order:", seqs.item_ids[seqs.sequence(0)].tolist())

# %% [markdown]
# Leave-last-out: each user's last item is the test target, the second-last the validation
# target, and the training samples end at the third-last. The histories keep their last
# `max_length` items. `leave_last_out` says where each sample's history starts and where its
# target is in the flat item array.

# %%
starts, targets = leave_last_out(seqs, "val")
print("user 0, validation history:", seqs.item_ids[seqs.items[starts[0] : targets[0]]].tolist())
print("user 0, validation target: ", seqs.item_ids[seqs.items[targets[0]]])

# %% [markdown]
# ## 2. Train on 2 processes, the item table sharded row-wise
#
# `SASRecModule` builds the item table (`t_item`, a TorchRec `EmbeddingCollection`) on the meta
# device; the strategy shards it. Row-wise puts half the rows on each rank. It is normally a
# CUDA-only sharding, but an `EmbeddingCollection` returns its rows with an all-to-all, which gloo
# has, so the strategy accepts it on CPU when a constraint (or a plan) asks for it. The history,
# the target and the candidate items all go through the same sharded lookup.
#
# The transformer trains with Adam; the table with the fused row-wise Adagrad (`fused_params`).
# The forked workers hold the trained model; what comes back to the notebook is
# `trainer.callback_metrics`. Validation at the last step ranks the whole catalogue for every
# user and logs `val/recall@10` and `val/ndcg@10` (summed over both ranks).
#
# Why the validation split and not `trainer.test`: each `fit` or `test` call forks fresh workers,
# and the trained shards end with the workers of `fit`. Nothing here picks a model on validation,
# so its metrics are as fair as the test split's. A script (one process per rank for the whole
# run, as `python -m lightning_torchrec.demo_seq`) calls `trainer.test` after `fit` instead.

# %%
module = SASRecModule(
    data.num_items,
    embedding_dim=32,
    max_length=data.max_length,
    optimizer=lambda params: torch.optim.Adam(params, lr=3e-3),
)
steps = 150
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=lightning_torchrec.TorchRecStrategy(
        constraints={"t_item": ParameterConstraints(sharding_types=["row_wise"])},
        fused_params={"learning_rate": 0.05},
        start_method="fork",
        log_plan=False,
    ),
    max_steps=steps,
    val_check_interval=steps,
    check_val_every_n_epoch=None,
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, datamodule=data)
model = {m: float(trainer.callback_metrics[f"val/{m}"]) for m in ("recall@10", "ndcg@10")}
print({name: round(float(value), 4) for name, value in trainer.callback_metrics.items()})

# %% [markdown]
# ## 3. Against the best achievable and a popularity list
#
# The next item depends only on the last one, so the best expected ranking of a user orders the
# items by their probability of coming next; `best_achievable` computes its recall@10 and NDCG@10
# exactly for the evaluated users (the generator's item `i` is raw id `i + 1`). The popularity
# baseline gives every user the same list, the most frequent items first, counted on everything
# but the evaluated targets and the test items after them.

# %%
_, val_targets = leave_last_out(seqs, "val")
last = seqs.item_ids[seqs.items[val_targets - 1]] - 1
best = best_achievable(structure, last, k=10)

seen = np.ones(len(seqs.items), dtype=bool)
seen[val_targets] = False
seen[leave_last_out(seqs, "test")[1]] = False
ranks = popularity_ranks(seqs.items[seen], seqs.items[val_targets], seqs.num_items)
popularity = {name: float(v) for name, v in ranking_values(torch.from_numpy(ranks), [10]).items()}

rows = {
    "best achievable": (best["recall"], best["ndcg"]),
    "SASRec, row-wise": (model["recall@10"], model["ndcg@10"]),
    "popularity": (popularity["recall@10"], popularity["ndcg@10"]),
}
print(f"{'validation, ' + str(len(val_targets)) + ' users':28} recall@10  NDCG@10")
for name, (recall, ndcg) in rows.items():
    print(f"{name:28} {recall:9.3f} {ndcg:8.3f}")
print(
    f"SASRec reaches {model['recall@10'] / best['recall']:.0%} of the achievable recall@10, "
    f"popularity {popularity['recall@10'] / best['recall']:.0%}"
)

# %% [markdown]
# Sanity: no model beats the best achievable in expectation (a little above it is sampling
# luck on a few hundred users), and the model, which sees each user's last item, beats a list
# that ignores it.

# %%
for m in ("recall@10", "ndcg@10"):
    assert model[m] > 1.5 * popularity[m], (m, model[m], popularity[m])
    assert model[m] < best[m.split("@")[0]] + 0.05, (m, model[m], best)
