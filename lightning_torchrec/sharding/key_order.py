"""Sharded embedding modules return their outputs in the unsharded module's key order.

A sharded ``EmbeddingBagCollection`` groups its output ``KeyedTensor``'s keys by sharding type
(TorchRec builds one output dist per sharding type and concatenates them), not in the order of
its tables. A model reading ``ebc(kjt).values()`` positionally (TorchRec's DLRM avoids it with
``to_dict()``) then computes one function under one plan and another under another plan, world
size, or unsharded after consolidation. :func:`keep_key_order` appends one callback to the
awaitable every sharded EBC/EC returns (from ``output_dist`` and ``compute_and_output_dist``,
the calls TorchRec's train pipelines make too) that restores the unsharded order: for pooled
outputs a ``KeyedTensor`` in the unsharded order that reads each key from the sharded output
(``kt[key]``, ``to_dict()``: no copy, what DLRM-style models read) and permutes the columns
(fbgemm's ``permute_pooled_embs``, one block copy per key) only when its values are read whole
(``values()``, ``regroup``); a re-keyed dict for an ``EmbeddingCollection``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from fbgemm_gpu.permute_pooled_embedding_modules import PermutePooledEmbeddings
from torch import nn
from torchrec.modules.embedding_configs import BaseEmbeddingConfig, EmbeddingBagConfig
from torchrec.modules.embedding_modules import get_embedding_names_by_table
from torchrec.sparse.jagged_tensor import KeyedTensor

_OUTPUT_CALLS = ("output_dist", "compute_and_output_dist")


def unsharded_key_order(configs: list[BaseEmbeddingConfig]) -> list[str]:
    """The output keys of an unsharded EBC/EC with these tables, in its order.

    Args:
        configs: the module's table configs, in module order.

    Returns:
        Feature names (``feature@table`` for a feature read by several tables).
    """
    return [name for names in get_embedding_names_by_table(configs) for name in names]


class _PlanOrderedKeyedTensor(KeyedTensor):
    """A ``KeyedTensor`` in the target order over a sharded output in another order.

    Per-key reads (``[key]``, ``to_dict()``) are views of the sharded output; the whole values
    tensor (``values()``, and every other reader of ``_values``) is the permuted copy, made once
    on first read. Both give the same numbers, and gradients, as a permuted copy would.
    """

    def __init__(
        self,
        keys: list[str],
        lengths: list[int],
        source: KeyedTensor,
        permute: PermutePooledEmbeddings,
    ) -> None:
        self._source = source
        self._permute = permute
        self._ordered: torch.Tensor | None = None
        super().__init__(
            keys=keys,
            length_per_key=lengths,
            values=None,  # type: ignore[arg-type]  # made on first read
            key_dim=source.key_dim(),
        )

    @property  # type: ignore[override]
    def _values(self) -> torch.Tensor:
        if self._ordered is None:
            values = self._source.values()
            one = self._source.key_dim() == 1
            self._ordered = self._permute(values) if one else self._permute(values.t()).t()
        return self._ordered

    @_values.setter
    def _values(self, values: torch.Tensor | None) -> None:
        if values is not None:
            self._ordered = values

    def device(self) -> torch.device:
        """The device of the values (no permutation)."""
        return self._source.device()

    def size_in_bytes(self) -> int:
        """The size of the values in bytes (no permutation)."""
        return self._source.size_in_bytes()

    def record_stream(self, stream: torch.cuda.streams.Stream) -> None:
        """Marks the sharded output (and the permuted copy, once made) as used on ``stream``."""
        self._source.record_stream(stream)
        if self._ordered is not None:
            self._ordered.record_stream(stream)

    def __getitem__(self, key: str) -> torch.Tensor:
        """The columns of ``key``: a view of the sharded output."""
        return self._source[key]

    def to_dict(self) -> dict[str, torch.Tensor]:
        """``{key: columns}`` in the target order: views of the sharded output."""
        parts = self._source.to_dict()
        return {key: parts[key] for key in self._keys}


class KeyedTensorOrder:
    """Re-keys ``KeyedTensor`` outputs to a target key order (idempotent; caches the index).

    Args:
        keys: the target order.
    """

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)
        # Per (source keys, device): the permutation and the lengths in the target order.
        self._permute: dict[
            tuple[tuple[str, ...], torch.device], tuple[PermutePooledEmbeddings, list[int]]
        ] = {}

    def __call__(self, kt: KeyedTensor) -> KeyedTensor:
        """Returns ``kt`` with its keys in the target order.

        Args:
            kt: a pooled output.

        Returns:
            ``kt`` itself when the order matches, else a ``KeyedTensor`` in the target order
            whose columns are permuted only when its values are read whole.
        """
        keys = kt.keys()
        if keys == self.keys:
            return kt
        device = kt.device()
        cache_key = (tuple(keys), device)
        cached = self._permute.get(cache_key)
        if cached is None:
            # fbgemm's pooled-embedding permutation (what TorchRec's own output dists use): one
            # block copy per key, with its own backward.
            position = {k: i for i, k in enumerate(keys)}
            order = [position[k] for k in self.keys]
            lengths = kt.length_per_key()
            permute = PermutePooledEmbeddings(lengths, order, device)
            cached = self._permute[cache_key] = (permute, [lengths[i] for i in order])
        permute, lengths = cached
        return _PlanOrderedKeyedTensor(self.keys, list(lengths), kt, permute)


class DictOrder:
    """Re-keys dict outputs (an ``EmbeddingCollection``'s ``{feature: JaggedTensor}``).

    Args:
        keys: the target order; keys not listed keep their order after them.
    """

    def __init__(self, keys: list[str]) -> None:
        self.keys = list(keys)

    def __call__(self, out: dict[str, Any]) -> dict[str, Any]:
        """Returns ``out`` with its keys in the target order.

        Args:
            out: ``{feature: JaggedTensor}``.

        Returns:
            ``out`` itself when the order matches, else a reordered dict.
        """
        if list(out) == self.keys:
            return out
        ordered = {k: out[k] for k in self.keys if k in out}
        ordered.update((k, v) for k, v in out.items() if k not in ordered)
        return ordered


def _with_callback(call: Callable[..., Any], reorder: Callable[[Any], Any]) -> Callable[..., Any]:
    def ordered_call(*args: Any, **kwargs: Any) -> Any:
        awaitable = call(*args, **kwargs)
        if reorder not in awaitable.callbacks:
            awaitable.callbacks.append(reorder)
        return awaitable

    return ordered_call


def keep_key_order(sharded: nn.Module, configs: list[BaseEmbeddingConfig]) -> None:
    """Makes a sharded EBC/EC return its outputs in the unsharded module's key order.

    Args:
        sharded: the ``ShardedEmbeddingBagCollection``/``ShardedEmbeddingCollection``.
        configs: the table configs of the unsharded module it replaced, in module order.
    """
    keys = unsharded_key_order(configs)
    pooled = all(isinstance(c, EmbeddingBagConfig) for c in configs)
    reorder: Callable[[Any], Any] = KeyedTensorOrder(keys) if pooled else DictOrder(keys)
    for name in _OUTPUT_CALLS:
        call = getattr(sharded, name, None)
        if callable(call):
            # An instance attribute: TorchRec's forward and its pipelines' rewritten forwards
            # call these through the instance.
            object.__setattr__(sharded, name, _with_callback(call, reorder))
