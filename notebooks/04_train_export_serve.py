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
# # Train, export, serve
#
# From a sharded training run to a quantized model a serving process loads without the
# training code:
#
# 1. train a DLRM on 2 forked CPU processes and save a sharded checkpoint;
# 2. export it with int8 tables (`lightning_torchrec.export`), in this one process, without a
#    process group;
# 3. load the artifact with `torch` and `torchrec` only, in a fresh process, and serve;
# 4. compare its predictions with the float model.
#
# See [the export guide](../docs/export.md) for the formats, dtypes and numbers.

# %%
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torchmetrics.functional.classification import binary_auroc

import lightning_torchrec
from lightning_torchrec import DLRMClickModule, SyntheticClickData
from lightning_torchrec.checkpoint import load_unsharded
from lightning_torchrec.export import export

L.seed_everything(0, verbose=False)
work = Path(os.environ.get("EXPORT_NOTEBOOK_DIR", tempfile.mkdtemp(prefix="export-")))
checkpoint = work / "dlrm_ckpt"

# %% [markdown]
# ## 1. Train on 2 processes and save a sharded checkpoint
#
# The forked workers hold the sharded model; a checkpoint is how it leaves them. Saving is a
# collective, so every rank calls `trainer.save_checkpoint` (here from a callback at the end of
# training). Each rank writes only its own shards.


# %%
class SaveAtEnd(Callback):
    """Saves a sharded checkpoint on every rank when training ends."""

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        # The full training state (weights_only=False: said, not left to Lightning's default).
        trainer.save_checkpoint(checkpoint, weights_only=False)


data = SyntheticClickData(
    num_embeddings=200,
    num_sparse_features=4,
    ids_per_feature=2,
    batch_size=128,
    train_batches=400,
    val_batches=4,
    test_batches=8,
)
module = DLRMClickModule(
    data.num_embeddings_per_feature,
    embedding_dim=16,
    optimizer=lambda params: torch.optim.Adam(params, lr=1e-2),
)
trainer = L.Trainer(
    accelerator="cpu",
    devices=2,
    strategy=lightning_torchrec.TorchRecStrategy(
        fused_params={"learning_rate": 0.3}, start_method="fork", log_plan=False
    ),
    max_steps=200,
    limit_val_batches=4,
    val_check_interval=200,
    callbacks=[SaveAtEnd()],
    logger=False,
    enable_checkpointing=False,
    enable_progress_bar=False,
    enable_model_summary=False,
)
trainer.fit(module, datamodule=data)
print("val AUROC", round(float(trainer.callback_metrics["val/auroc"]), 4))
print(sorted(p.name for p in checkpoint.iterdir()))

# %% [markdown]
# ## 2. Export with int8 tables
#
# One call, one process, no process group. The model is rebuilt from the hyper-parameters saved
# in the checkpoint (`DLRMClickModule` by its dotted path); the tables stream from the
# checkpoint one at a time and are quantized row-wise (int8 with a per-row fp16 scale and bias)
# into TorchRec's quantized `EmbeddingBagCollection`; the dense layers stay fp32. What is
# exported is `module.model_and_loss.model`: DLRM's `forward(dense_features, sparse_features)`.
#
# The same from a shell:
#
# ```bash
# python -m lightning_torchrec.export CKPT dlrm_int8.pt2 \
#     --module lightning_torchrec.DLRMClickModule --dtype int8
# ```

# %%
result = export(
    checkpoint, "lightning_torchrec.DLRMClickModule", work / "dlrm_int8.pt2", dtype="int8"
)
print(f"{result.format} artifact: {result.path.name}, {result.path.stat().st_size:,} bytes")
print(
    f"tables: {result.float_table_bytes:,} bytes in float -> "
    f"{result.quantized_table_bytes:,} bytes int8 (with scale and bias)"
)
print(json.dumps(json.loads(Path(f"{result.path}.json").read_text())["inputs"]))

# %% [markdown]
# ## 3. Serve it without the training code
#
# A serving process needs `torch` and `torchrec` (TorchRec registers fbgemm's quantized
# operators and teaches `torch.export` the `KeyedJaggedTensor` input). It does not need
# `lightning_torchrec`, Lightning, or the model's class: the script below makes importing them
# impossible, loads the artifact and predicts click probabilities for a batch.

# %%
serve = work / "serve.py"
serve.write_text('''
import sys
sys.modules["lightning_torchrec"] = None  # importing the training package now fails
sys.modules["lightning"] = None
import torch
import torchrec  # fbgemm's operators and the KeyedJaggedTensor pytree
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

model = torch.export.load(sys.argv[1]).module()

def predict(dense, ids_per_feature):
    """dense: [B, 13] float; ids_per_feature: {"cat_0": [[ids of sample 0], ...], ...}."""
    keys = list(ids_per_feature)
    lengths = [len(ids) for k in keys for ids in ids_per_feature[k]]
    values = [i for k in keys for ids in ids_per_feature[k] for i in ids]
    kjt = KeyedJaggedTensor(
        keys=keys,
        values=torch.tensor(values, dtype=torch.int64),
        lengths=torch.tensor(lengths, dtype=torch.int32),
    )
    with torch.inference_mode():
        return torch.sigmoid(model(dense, kjt)).reshape(-1)

torch.manual_seed(0)
request = {f"cat_{i}": [[3, 17], [5], [199, 0, 42]] for i in range(4)}
print("click probabilities:", predict(torch.randn(3, 13), request).tolist())
''')
out = subprocess.run(
    [sys.executable, str(serve), str(result.path)], capture_output=True, text=True, check=True
)
print(out.stdout)

# %% [markdown]
# ## 4. How much did int8 change the predictions?
#
# The float reference is the unsharded model loaded from the same checkpoint
# (`load_unsharded`, also one process). On the held-out test batches:

# %%
served = torch.export.load(result.path).module()
float_model = load_unsharded(checkpoint, DLRMClickModule).eval().model_and_loss.model
batches = list(data.dataset("test"))
with torch.inference_mode():
    p_float = torch.cat(
        [
            torch.sigmoid(float_model(b.dense_features, b.sparse_features)).reshape(-1)
            for b in batches
        ]
    )
    p_int8 = torch.cat(
        [torch.sigmoid(served(b.dense_features, b.sparse_features)).reshape(-1) for b in batches]
    )
labels = torch.cat([b.labels for b in batches]).long()
delta = (p_int8 - p_float).abs()
auroc_float, auroc_int8 = float(binary_auroc(p_float, labels)), float(binary_auroc(p_int8, labels))
print(f"{len(labels)} samples: max |dp| {delta.max():.2e}, mean |dp| {delta.mean():.2e}")
change = auroc_int8 - auroc_float
print(f"AUROC float {auroc_float:.4f}, int8 {auroc_int8:.4f} (difference {change:+.1e})")
assert abs(auroc_int8 - auroc_float) < 1e-3
