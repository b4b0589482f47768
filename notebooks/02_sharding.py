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
# # Sharding: the planner, constraints and plans
#
# TorchRec's `EmbeddingShardingPlanner` decides, for every table, how to split it (the *sharding
# type*), which ranks hold the pieces, and which *compute kernel* runs it. `TorchRecStrategy` runs
# the planner for you at `trainer.fit`; this notebook runs it directly to show what it decides and
# how to steer it. Planning needs no process group and no GPU: it is arithmetic on sizes.

# %%
from torchrec.distributed.planner.types import ParameterConstraints

from lightning_torchrec import DLRMClickModule, summarize_plan
from lightning_torchrec.sharding.planning import default_sharders, make_planner, make_topology

# %% [markdown]
# ## A model with tables of very different sizes
#
# `DLRMClickModule` builds its tables on the `meta` device: a 5-million-row table costs nothing
# until it is sharded.

# %%
rows = [5_000_000, 1_000_000, 200_000, 50_000, 10_000, 1_000, 100, 10]
model = DLRMClickModule(
    num_embeddings_per_feature=rows, embedding_dim=64, dense_arch_layer_sizes=[128, 64]
)
for name, p in model.named_parameters():
    if "embedding_bags" in name:
        print(f"{name.split('.')[-2]:>8}: {tuple(p.shape)} on {p.device}")

# %% [markdown]
# ## Plan for 2 CPU processes
#
# `make_topology` builds the planner's `Topology` the way the strategy does (world size, processes
# per host, device), and `make_planner` TorchRec's `EmbeddingShardingPlanner` for it, reserving
# memory for the dense part from the model's own parameters (TorchRec's default guesses it, wrongly
# for tables on the meta device, and warns). `default_sharders` are the EBC/EC sharders with the
# fused optimizer settings (row-wise Adagrad unless `fused_params` says otherwise).

# %%
sharders = default_sharders(None)
planner = make_planner(model, make_topology(2, 2, "cpu"))
plan = planner.plan(model, sharders)
summary = summarize_plan(model, plan, world_size=2)
print(summary.to_markdown())

# %% [markdown]
# `summary.tables` has one `TablePlacement` per table; `summary.bytes_per_rank` the table bytes
# each rank holds (weights only; the optimizer state adds to it: one float per row for row-wise
# Adagrad).

# %%
for t in summary.tables[:3]:
    print(t.table, t.sharding_type, t.compute_kernel, t.ranks, t.bytes_per_rank)
print([f"{b / 2**20:.1f} MiB" for b in summary.bytes_per_rank])

# %% [markdown]
# ## Constraints
#
# `ParameterConstraints` restrict the planner per table: allowed sharding types, kernels, minimum
# partition sizes... On CPU the usable types are `table_wise`, `column_wise`,
# `table_column_wise` and `data_parallel` (row-wise needs CUDA; the strategy refuses it on CPU with
# a message that says so). Here: split the largest table by columns, and replicate the tiny ones
# (`data_parallel`: every rank holds a full copy, trained by the dense optimizer).

# %%
constraints = {
    "t_cat_0": ParameterConstraints(sharding_types=["column_wise"]),
    "t_cat_6": ParameterConstraints(sharding_types=["data_parallel"]),
    "t_cat_7": ParameterConstraints(sharding_types=["data_parallel"]),
}
planner = make_planner(model, make_topology(2, 2, "cpu"), constraints)
constrained = summarize_plan(model, planner.plan(model, sharders), world_size=2)
print(constrained.to_markdown())

# %% [markdown]
# In training, the same constraints go to the strategy, which also checks them against the model
# (a misspelled table name is an error, not silently ignored):
#
# ```python
# trainer = L.Trainer(devices=2, strategy=TorchRecStrategy(constraints=constraints))
# ```

# %%
from lightning_torchrec.sharding.setup_checks import (
    check_constraints_for_device,
    check_constraints_match_model,
)

try:
    check_constraints_match_model({"t_cat_O": ParameterConstraints()}, model)
except ValueError as err:
    print("ValueError:", err)
try:
    check_constraints_for_device(
        {"t_cat_0": ParameterConstraints(sharding_types=["row_wise"])}, "cpu"
    )
except ValueError as err:
    print("ValueError:", err)

# %% [markdown]
# ## The same model on a larger cluster
#
# Planning is pure arithmetic, so a laptop can ask how the model would shard on 8 hosts of 8 GPUs:
# a topology of 64 ranks, 8 per host, on CUDA. The planner now can use row-wise and
# table-row-wise sharding (rows split over ranks, or over the GPUs of one host), and the CUDA
# kernels' costs.

# %%
big = make_topology(64, 8, "cuda")
big_plan = make_planner(model, big).plan(model, sharders)
big_summary = summarize_plan(model, big_plan, world_size=64)
for t in big_summary.tables:
    print(
        f"{t.table:>8} {t.shape[0]:>9} rows  {t.sharding_type:<16} {t.compute_kernel:<6} "
        f"on {len(t.ranks)} ranks"
    )

# %%
import matplotlib.pyplot as plt

per_rank = [b / 2**20 for b in big_summary.bytes_per_rank]
fig, ax = plt.subplots(figsize=(10, 3))
ax.bar(range(64), per_rank)
ax.set_xlabel("rank")
ax.set_ylabel("table MiB")
ax.set_title("table bytes per rank, 64 simulated GPUs")
plt.show()
assert sum(big_summary.bytes_per_rank) >= sum(rows) * 64 * 4

# %% [markdown]
# The planner balances its *cost estimate* (lookup, communication and compute time, plus memory
# caps), not bytes alone, so bytes per rank need not be equal. Every table's bytes appear at least
# once; replicated tables count on every rank that holds them.
