"""A SASRec-style next-item model on TorchRec's ``EmbeddingCollection``, with its loss.

:class:`SASRec` embeds each history with one item table (``t_item``, an ``EmbeddingConfig`` of
an ``EmbeddingCollection``: one vector per id, no pooling), adds a learnt embedding of each
item's distance from the end of the history, and runs a small causal transformer (Kang and
McAuley, *Self-Attentive Sequential Recommendation*, 2018). Position ``t``'s output is the
user's state after their ``t``-th item; its score for an item is the dot product with that
item's row of the same table (input and output embeddings are shared).

:class:`NextItemModelAndLoss` trains it with a sampled softmax: at every position of every
history, the next item against the batch's shared uniformly drawn negatives (a negative equal to
the position's next item is masked out). With uniform sampling the sampled logits differ from
the full softmax's only by a constant, so no correction term is needed, and the negatives cost
one table lookup per batch whatever the batch size. It follows the ``ModelAndLoss`` contract:
``forward(batch) -> (loss, outputs)`` with ``loss``, ``labels`` and ``weights`` in the outputs,
plus ``ranks``: the 0-based rank of each sample's target among the batch's candidates (the whole
catalogue in evaluation), ties counted against the target.

Dropout is off by default: Lightning does not restore the random generator on resume, so a
model with dropout does not continue bit for bit after a checkpoint.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torchrec.modules.embedding_configs import EmbeddingConfig
from torchrec.modules.embedding_modules import EmbeddingCollection
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

__all__ = ["ITEM_TABLE", "NextItemModelAndLoss", "SASRec", "padded", "sasrec_model"]

#: The item table's name; the ``item_seq``, ``item_target`` and ``item_candidates`` features
#: read it.
ITEM_TABLE = "t_item"
_FEATURES = ("item_seq", "item_target", "item_candidates")


def padded(values: torch.Tensor, lengths: torch.Tensor, max_length: int) -> torch.Tensor:
    """Jagged rows ``[sum(lengths), D]`` as a left-aligned ``[B, max_length, D]`` zero-padded block.

    A sample of more than ``max_length`` rows keeps its last ``max_length`` (its oldest rows go
    to a spare slot that is cut off): the block is never indexed out of bounds, whatever the
    lengths. The batch checks refuse such samples before the forward (see :class:`SASRec`).

    Args:
        values: the rows of every sample, concatenated.
        lengths: ``[B]`` rows per sample.
        max_length: the block's length.

    Returns:
        The block.
    """
    lengths = lengths.long()
    sample = torch.repeat_interleave(torch.arange(len(lengths), device=values.device), lengths)
    # Where each sample's kept rows start: its end less the rows kept.
    first = torch.cumsum(lengths, 0) - lengths.clamp(max=max_length)
    position = torch.arange(values.shape[0], device=values.device) - first[sample]
    position = torch.where(position < 0, max_length, position)
    out = values.new_zeros(len(lengths), max_length + 1, values.shape[1])
    out[sample, position] = values
    return out[:, :max_length]


class SASRec(nn.Module):
    """A causal transformer over item histories, items from an ``EmbeddingCollection``.

    A history holds at most ``max_length`` items (the positional table's size). The model
    declares that limit in :attr:`max_ids_per_sample`, which the batch checks of
    ``TorchRecStrategy`` read: a longer history is refused before the forward with the same
    :class:`~lightning_torchrec.errors.BatchValidationError` on every rank, naming the rank,
    step, feature, sample and length. Should one reach the forward anyway (a batch checked on
    the GPU is judged a step later), its last ``max_length`` items are read.

    Args:
        num_items: rows of the item table.
        embedding_dim: width of the table and the transformer.
        max_length: longest history.
        num_blocks: transformer blocks.
        num_heads: attention heads.
        dropout: dropout inside the blocks (0 keeps resumes bit-exact; see the module doc).
        init_scale: item rows start uniform in ``[-init_scale, init_scale]``.
        device: where the table is built; ``meta`` (the default) leaves it to sharding.

    Raises:
        ValueError: if ``embedding_dim`` is not a multiple of ``num_heads``.
    """

    def __init__(
        self,
        num_items: int,
        embedding_dim: int = 32,
        max_length: int = 20,
        num_blocks: int = 1,
        num_heads: int = 1,
        dropout: float = 0.0,
        init_scale: float = 0.1,
        device: torch.device | str = "meta",
    ) -> None:
        super().__init__()
        if embedding_dim % num_heads:
            raise ValueError(f"embedding_dim {embedding_dim} is not a multiple of {num_heads=}")
        self.max_length = max_length
        self.embedding_dim = embedding_dim
        #: The most ids one sample of each feature may hold (read by the batch checks).
        self.max_ids_per_sample = {"item_seq": max_length, "item_target": 1}
        #: The fewest ids one sample of each feature must hold: one target per sample.
        self.min_ids_per_sample = {"item_target": 1}
        self.item_embeddings = EmbeddingCollection(
            tables=[
                EmbeddingConfig(
                    name=ITEM_TABLE,
                    embedding_dim=embedding_dim,
                    num_embeddings=num_items,
                    feature_names=list(_FEATURES),
                    weight_init_min=-init_scale,
                    weight_init_max=init_scale,
                )
            ],
            device=torch.device(device),
        )
        self.positions = nn.Embedding(max_length, embedding_dim)
        nn.init.normal_(self.positions.weight, std=0.02)
        layer = nn.TransformerEncoderLayer(
            embedding_dim,
            num_heads,
            dim_feedforward=2 * embedding_dim,
            dropout=dropout,
            batch_first=True,
            norm_first=True,
        )
        self.blocks = nn.TransformerEncoder(
            layer, num_blocks, norm=nn.LayerNorm(embedding_dim), enable_nested_tensor=False
        )

    def forward(self, features: KeyedJaggedTensor) -> dict[str, torch.Tensor]:
        """Encodes the histories and looks up the targets and candidates.

        Args:
            features: ``item_seq``, ``item_target`` and ``item_candidates`` (see
                :mod:`lightning_torchrec.data.sequence_batch`).

        Returns:
            ``states`` ``[B, L, D]`` (position ``t``: after the history's ``t``-th item; rows
            past a history's length are padding), ``lengths`` ``[B]`` (the items read, at most
            ``L``), ``seq`` ``[B, L, D]``
            (the history's item rows, padded), ``target`` ``[B, D]``, ``candidates``
            ``[C, D]`` and ``candidate_ids`` ``[C]``.
        """
        looked_up = self.item_embeddings(features)
        seq = looked_up["item_seq"]
        length = self.max_length
        items = padded(seq.values(), seq.lengths(), length)
        lengths = seq.lengths().long().clamp(max=length)
        # Distance from the history's end: the latest item is always at distance 0.
        t = torch.arange(length, device=items.device)
        distance = (lengths.unsqueeze(1) - 1 - t).clamp(0, length - 1)
        valid = (t.unsqueeze(0) < lengths.unsqueeze(1)).unsqueeze(2)
        x = (items * self.embedding_dim**0.5 + self.positions(distance)) * valid
        causal = nn.Transformer.generate_square_subsequent_mask(length, device=items.device)
        states = self.blocks(x, mask=causal, is_causal=True)
        return {
            "states": states,
            "lengths": lengths,
            "seq": items,
            "target": looked_up["item_target"].values(),
            "candidates": looked_up["item_candidates"].values(),
            "candidate_ids": features["item_candidates"].values(),
        }


def target_ranks(
    scores: torch.Tensor, candidate_ids: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The 0-based rank of each target among the candidates; ties count against the target.

    Args:
        scores: ``[B, C]`` each sample's score of each candidate.
        candidate_ids: ``[C]`` the candidates' item ids.
        targets: ``[B]`` each sample's target item.

    Returns:
        ``[B]`` int64 ranks: the candidates other than the target scoring at least as high;
        ``C`` for a target that is not among the candidates.
    """
    hit = candidate_ids.unsqueeze(0) == targets.unsqueeze(1)
    target_score = torch.where(hit, scores, torch.zeros_like(scores)).sum(1, keepdim=True)
    ahead = ((scores >= target_score) & ~hit).sum(1)
    return torch.where(hit.any(1), ahead, torch.full_like(ahead, scores.shape[1]))


class NextItemModelAndLoss(nn.Module):
    """:class:`SASRec` with a sampled-softmax next-item loss, in the ``ModelAndLoss`` contract.

    Args:
        model: the sequence model.
    """

    def __init__(self, model: SASRec) -> None:
        super().__init__()
        self.model = model

    def forward(self, batch: Any) -> tuple[torch.Tensor, dict[str, Any]]:
        """Runs the model and the loss on one batch.

        Args:
            batch: a :class:`~lightning_torchrec.data.sequence_batch.SequenceBatch`.

        Returns:
            ``(loss, outputs)``: the weighted mean cross-entropy over every position of every
            history (0 for a batch whose weights are all 0); ``outputs`` holds ``loss``,
            ``labels``, ``weights``, ``loss_weight`` (the total weight of the positions the loss
            averages: each position weighs its sample's weight), ``scores`` ``[B, C]`` (the last
            position against the candidates) and ``ranks`` ``[B]``.
        """
        out = self.model(batch.sparse_features)
        states, lengths = out["states"], out["lengths"]
        size, length, _ = states.shape
        labels = batch.labels
        weights = batch.weights
        if weights is None:
            weights = torch.ones(size, dtype=torch.float32, device=states.device)
        # The next item of position t: the history's item t + 1, or the target at the end.
        positives = torch.cat(
            [out["seq"][:, 1:], out["seq"].new_zeros(size, 1, states.shape[2])], 1
        )
        last = (lengths - 1).clamp_min(0)
        rows = torch.arange(size, device=states.device)
        positives = positives.index_put((rows, last), out["target"])
        t = torch.arange(length, device=states.device)
        valid = t.unsqueeze(0) < lengths.unsqueeze(1)
        seq_ids = self._seq_ids(batch, length)
        next_ids = torch.cat([seq_ids[:, 1:], seq_ids.new_zeros(size, 1)], 1)
        next_ids = next_ids.index_put((rows, last), labels)
        state, positive = states[valid], positives[valid]
        negatives = state @ out["candidates"].T
        accidental = out["candidate_ids"].unsqueeze(0) == next_ids[valid].unsqueeze(1)
        logits = torch.cat(
            [(state * positive).sum(1, keepdim=True), negatives.masked_fill(accidental, -1e9)], 1
        )
        per_position = F.cross_entropy(
            logits,
            torch.zeros(len(logits), dtype=torch.long, device=logits.device),
            reduction="none",
        )
        position_weights = weights.unsqueeze(1).expand(size, length)[valid]
        loss_weight = position_weights.sum()
        loss = (per_position * position_weights).sum() / loss_weight.clamp_min(1e-12)
        scores = states[rows, last] @ out["candidates"].T
        ranks = target_ranks(scores.detach(), out["candidate_ids"], labels)
        outputs = {
            "loss": loss,
            "labels": labels,
            "weights": weights,
            "loss_weight": loss_weight.detach(),
            "scores": scores,
            "ranks": ranks,
        }
        return loss, outputs

    @staticmethod
    def _seq_ids(batch: Any, length: int) -> torch.Tensor:
        seq = batch.sparse_features["item_seq"]
        return padded(seq.values().unsqueeze(1), seq.lengths(), length).squeeze(2)


def sasrec_model(
    num_items: int,
    embedding_dim: int = 32,
    max_length: int = 20,
    num_blocks: int = 1,
    num_heads: int = 1,
    dropout: float = 0.0,
    init_scale: float = 0.1,
) -> NextItemModelAndLoss:
    """SASRec with its sampled-softmax loss, the item table on the meta device.

    Args:
        num_items: rows of the item table.
        embedding_dim: width of the table and the transformer.
        max_length: longest history.
        num_blocks: transformer blocks.
        num_heads: attention heads.
        dropout: dropout inside the blocks.
        init_scale: item rows start uniform in ``[-init_scale, init_scale]``.

    Returns:
        The model and loss.
    """
    return NextItemModelAndLoss(
        SASRec(num_items, embedding_dim, max_length, num_blocks, num_heads, dropout, init_scale)
    )
