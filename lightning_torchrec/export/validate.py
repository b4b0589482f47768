"""The served model refuses ids outside its tables: a check traced into the artifact.

fbgemm's inference kernels (every export dtype) do not refuse an id outside its table: with
TorchRec's default bounds-check mode an id ``>= rows`` or a negative id is looked up as row 0
(or, without bounds checks, reads another row), and the model returns a finite, wrong answer.
:class:`CheckedEmbeddings` puts an :class:`IdRangeCheck` in front of every (quantized)
embedding module before tracing, so the check is part of the exported graph and runs in a
server that imports only ``torch`` and ``torchrec``:

- ``pt2`` (``torch.export``): one assert per feature and side (negative, too large; see
  :func:`~lightning_torchrec.compat.upstream.assert_async`), each with a fixed message naming
  the feature, its table and its row count (an exported graph cannot format a message from a
  tensor's value);
- TorchScript: the check is scripted from its source (an fx leaf), and its message also names
  the first offending id and its sample;
- eager (``ExportResult.model``): :class:`~lightning_torchrec.errors.IdOutOfRangeError` with
  the id and sample.

Every message starts with :data:`MARKER`; :func:`named_error` turns the ``RuntimeError`` of an
artifact into :class:`~lightning_torchrec.errors.IdOutOfRangeError` (or
:class:`~lightning_torchrec.errors.ServedInputError` for lengths that do not match the ids),
finding the offending id in the request (what :func:`~lightning_torchrec.export.load_artifact`'s
model does). The check is a handful of vectorised operations per batch: one comparison per id
against its table's row count, plus ``2F + 2`` scalar asserts (``F`` features).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from torch import nn
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

from lightning_torchrec.compat.upstream import assert_async
from lightning_torchrec.errors import IdOutOfRangeError, ServedInputError

#: How every refusal of the check starts (also in a bare server's ``RuntimeError``).
MARKER = "id out of range: "

#: How a refusal of the lengths starts.
LENGTHS_MARKER = "bad lengths: "

#: How a message counts a feature's valid ids: its table's rows, or (managed-collision
#: tables) the raw-id range its ids are remapped from.
ROWS, RAW_IDS = "rows", "raw ids"

_FEATURE = re.compile(r"feature '([^']*)' \(table '([^']*)', (\d+) (rows|raw ids)\)")


def _range_message(feature: str, table: str, rows: int, what: str, unit: str = ROWS) -> str:
    return (
        f"{MARKER}feature '{feature}' (table '{table}', {rows} {unit}) got {what}; ids must be "
        f"int64 in [0, {rows})"
    )


def _outside(unit: str) -> str:
    return "an id outside the raw-id range" if unit == RAW_IDS else "an id outside the table"


def first_bad_id(
    values: torch.Tensor, lengths: torch.Tensor, limits: torch.Tensor
) -> tuple[int, int, int]:
    """The first id outside its feature's table, with its feature and bag (TorchScript-able).

    Args:
        values: the KJT's ids (feature-major, as ``KeyedJaggedTensor.values()``).
        lengths: its lengths (``F * B``, feature-major).
        limits: the row count of each of the ``F`` features' tables; a negative count: the
            feature is not checked (another module's feature in the same KJT).

    Returns:
        ``(feature index, bag index, id)``, or ``(-1, -1, 0)`` when every checked id is in
        range.
    """
    bags = lengths.numel()
    bag_of_id = torch.repeat_interleave(
        torch.arange(bags, device=values.device), lengths.long(), output_size=values.numel()
    )
    per_feature = bags // max(limits.numel(), 1)
    key_of_id = torch.div(bag_of_id, max(per_feature, 1), rounding_mode="floor")
    limit = limits[key_of_id]
    bad = torch.nonzero((limit >= 0) & ((values < 0) | (values >= limit))).reshape(-1)
    if bad.numel() == 0:
        return -1, -1, 0
    first = int(bad[0])
    return int(key_of_id[first]), int(bag_of_id[first]), int(values[first])


class IdRangeCheck(nn.Module):
    """Refuses a ``KeyedJaggedTensor`` with ids outside their tables or lengths off its ids.

    Returns it unchanged otherwise.

    Args:
        tables: ``{feature: (table, rows)}`` of the embedding module behind the check.
        raw_ids: the bounds are raw-id ranges (managed-collision tables), not row counts;
            the messages say so.
    """

    def __init__(self, tables: dict[str, tuple[str, int]], raw_ids: bool = False) -> None:
        super().__init__()
        self.table_of: dict[str, str] = {f: t for f, (t, _) in tables.items()}
        self.rows_of: dict[str, int] = {f: rows for f, (_, rows) in tables.items()}
        self.unit = RAW_IDS if raw_ids else ROWS
        # Attributes: TorchScript reads no module-level constants.
        self.marker = MARKER
        self.lengths_marker = LENGTHS_MARKER

    def forward(self, features: KeyedJaggedTensor) -> KeyedJaggedTensor:
        """Checks ``features`` (see the module's docstring for what each format raises).

        Args:
            features: the embedding module's input.

        Returns:
            ``features``, unchanged.
        """
        keys = features.keys()
        values = features.values()
        lengths = features.lengths()
        # A KJT may carry other modules' features too (TorchRec's EBC/EC ignore them): only
        # this module's own are checked (limit -1: not checked).
        limits = torch.tensor(
            [self.rows_of[k] if k in self.rows_of else -1 for k in keys], dtype=torch.int64
        )
        if torch.jit.is_scripting():
            self._raise_formatted(keys, values, lengths, limits)
        elif torch.compiler.is_exporting():
            self._assert(keys, values, lengths, limits)
        else:
            self._raise_named(keys, values, lengths, limits)
        return features

    @torch.jit.unused
    def _assert(
        self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, limits: torch.Tensor
    ) -> None:
        """The exported graph's check: fixed messages (no value of a tensor can be formatted).

        Few operations, as each costs a Python call when an ``ExportedProgram.module()`` runs:
        one comparison per id against its table's rows, a per-feature count of the failures,
        and one assert per feature.
        """
        features = ", ".join(keys)
        assert_async(
            (lengths >= 0).all() & (lengths.sum() == values.numel()),
            f"{LENGTHS_MARKER}negative, or not adding up to the number of ids (features "
            f"{features})",
        )
        own = [k in self.rows_of for k in keys]
        if not any(own):
            return
        per_key = lengths.view(len(keys), -1).sum(1)
        rows_seen = {self.rows_of[k] for k in keys if k in self.rows_of}
        if all(own) and len(rows_seen) == 1:  # one row count: no per-id limits
            limit: int | torch.Tensor = self.rows_of[keys[0]]
        else:
            limit = torch.repeat_interleave(limits, per_key, output_size=values.shape[0])
        outside = (values < 0) | (values >= limit)
        if not all(own):  # another module's features: not checked here
            outside = outside & (limit >= 0)
        ok = torch.segment_reduce(outside.float(), "sum", lengths=per_key, unsafe=True) == 0
        for key, fine, checked in zip(keys, ok.unbind(0), own, strict=True):
            if not checked:
                continue
            table, rows = self.table_of[key], self.rows_of[key]
            message = _range_message(key, table, rows, _outside(self.unit), self.unit)
            assert_async(fine, message)

    def _raise_formatted(
        self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, limits: torch.Tensor
    ) -> None:
        """TorchScript's check: the message names the first offending id and its sample."""
        if bool((lengths < 0).any()) or int(lengths.sum()) != values.numel():
            raise RuntimeError(
                self.lengths_marker
                + "negative, or not adding up to the number of ids (features "
                + ", ".join(keys)
                + ")"
            )
        key, bag, value = first_bad_id(values, lengths, limits)
        if key >= 0:
            name = keys[key]
            rows = self.rows_of[name]
            sample = bag % max(lengths.numel() // len(keys), 1)
            raise RuntimeError(
                self.marker
                + "feature '"
                + name
                + "' (table '"
                + self.table_of[name]
                + "', "
                + str(rows)
                + " "
                + self.unit
                + ") got id "
                + str(value)
                + " (sample "
                + str(sample)
                + "); ids must be int64 in [0, "
                + str(rows)
                + ")"
            )

    @torch.jit.unused
    def _raise_named(
        self, keys: list[str], values: torch.Tensor, lengths: torch.Tensor, limits: torch.Tensor
    ) -> None:
        """Eager: the package's named errors."""
        if bool((lengths < 0).any()) or int(lengths.sum()) != values.numel():
            raise ServedInputError(
                f"{LENGTHS_MARKER}lengths {lengths.tolist()[:20]} (features {keys}) are "
                f"negative or do not add up to the {values.numel()} ids"
            )
        key, bag, value = first_bad_id(values, lengths, limits)
        if key >= 0:
            name = keys[key]
            sample = bag % max(lengths.numel() // len(keys), 1)
            raise IdOutOfRangeError(
                _range_message(
                    name,
                    self.table_of[name],
                    self.rows_of[name],
                    f"id {value} (sample {sample})",
                    self.unit,
                )
            )


class CheckedEmbeddings(nn.Module):
    """An embedding module with an :class:`IdRangeCheck` in front (what the export traces).

    Args:
        check: the check of the module's features.
        embeddings: the (quantized) ``EmbeddingBagCollection`` or ``EmbeddingCollection``.
    """

    def __init__(self, check: IdRangeCheck, embeddings: nn.Module) -> None:
        super().__init__()
        self.check = check
        self.embeddings = embeddings

    def forward(self, features: KeyedJaggedTensor) -> Any:
        """Checks, then looks up.

        Args:
            features: the ids.

        Returns:
            What the embedding module returns.
        """
        return self.embeddings(self.check(features))


def _kjts(value: Any) -> list[KeyedJaggedTensor]:
    if isinstance(value, KeyedJaggedTensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, list | tuple):
        return [k for v in value for k in _kjts(v)]
    return []


def named_error(
    err: Exception, args: tuple[Any, ...], kwargs: dict[str, Any]
) -> ServedInputError | None:
    """The package's named error for an artifact's refusal of a request, or None.

    Args:
        err: what the artifact raised (a ``RuntimeError``; TorchScript: ``torch.jit.Error``).
        args: the request's positional inputs.
        kwargs: its keyword inputs.

    Returns:
        :class:`~lightning_torchrec.errors.IdOutOfRangeError` naming the feature, its table,
        the first offending id, its sample and the row count;
        :class:`~lightning_torchrec.errors.ServedInputError` for bad lengths; None when ``err``
        is not a refusal of the check.
    """
    text = str(err)
    if LENGTHS_MARKER in text:
        return ServedInputError(text[text.index(LENGTHS_MARKER) :].splitlines()[0])
    found = _FEATURE.search(text) if MARKER in text else None
    if found is None:
        return None
    feature, table, rows, unit = found.group(1), found.group(2), int(found.group(3)), found.group(4)
    for kjt in _kjts([*args, *kwargs.values()]):
        if feature not in kjt.keys():
            continue
        bags = kjt[feature]
        ids, lengths = bags.values(), bags.lengths()
        _, sample, value = first_bad_id(ids, lengths, torch.tensor([rows]))
        if sample >= 0:
            what = f"id {value} (sample {sample})"
            return IdOutOfRangeError(_range_message(feature, table, rows, what, unit))
    return IdOutOfRangeError(text[text.index(MARKER) :].splitlines()[0])


class ServedModel(nn.Module):
    """A loaded artifact that raises the package's named errors for the requests it refuses.

    Args:
        model: the loaded artifact (``ExportedProgram.module()`` or a ``ScriptModule``).
    """

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """Runs the artifact.

        Args:
            *args: its positional inputs.
            **kwargs: its keyword inputs.

        Returns:
            What the artifact returns.

        Raises:
            IdOutOfRangeError: for an id outside its table (naming the feature, table, id,
                sample and row count).
            ServedInputError: for lengths that do not match the ids.
        """
        try:
            return self.model(*args, **kwargs)
        except (RuntimeError, torch.jit.Error) as err:  # TorchScript: jit.Error
            named = named_error(err, args, kwargs)
            if named is None:
                raise
            raise named from err


def input_contract(feature_tables: list[dict[str, Any]]) -> dict[str, Any]:
    """What an artifact accepts, for its JSON side file.

    Args:
        feature_tables: ``{"feature", "table", "rows", "dim"}`` per feature, in KJT key order
            (managed-collision features also ``"raw_ids"`` and ``"remapped"``).

    Returns:
        The contract: the KJT's keys, the dtypes and ranges of its values and lengths, and what
        the artifact does with an input outside it.
    """
    values = "int64; each id of feature f in [0, rows of f's table)"
    if any(f.get("remapped") for f in feature_tables):
        values += (
            "; a managed-collision feature (remapped: true) takes raw ids in [0, raw_ids), "
            "remapped to rows in the artifact"
        )
    return {
        "keys": [f["feature"] for f in feature_tables],
        "values": values,
        "lengths": "int32 >= 0; len(keys) * batch entries, feature-major, summing to the ids",
        "refuses": f"an id outside its table or bad lengths: RuntimeError starting {MARKER!r} "
        f"or {LENGTHS_MARKER!r} naming the feature, its table and row count (TorchScript: and "
        "the id and sample); load_artifact() raises IdOutOfRangeError / ServedInputError",
    }
