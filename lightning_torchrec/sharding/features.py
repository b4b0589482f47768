"""What each sparse feature of a model may hold, for the batch checks.

:func:`feature_specs` reads, from the unsharded model, the tables behind every KJT key: the rows
an id must lie under, whether the batch must carry weights, the per-sample id limits a module
declares. A feature name is usually read by one collection. Where several collections read the
same name with different tables (two towers each with a feature ``"id"``: users and items), the
right table depends on which collection a ``KeyedJaggedTensor`` of the batch goes to.
:meth:`FeatureSpecs.for_keys` tells that by the KJT's keys: a KJT whose known keys all belong to
exactly one collection is checked against that collection's tables. A KJT that matches several
collections (or none, when one KJT feeds several collections) is checked against the smallest
table reading each feature, and an id refused there is named with the other tables that read it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from torch import nn
from torchrec.modules.mc_modules import ManagedCollisionCollection, ManagedCollisionModule

from lightning_torchrec.compat.feature_processors import processed_collections
from lightning_torchrec.sharding.tables import embedding_modules, unwrap


@dataclass(frozen=True)
class FeatureSpec:
    """What one sparse feature may hold.

    Attributes:
        feature: the KJT key.
        table: the (smallest) table reading it.
        num_embeddings: rows of that table: ids must lie in ``[0, num_embeddings)``; for a
            managed-collision table, its collision module's raw-id bound (``input_size()``),
            since the module remaps raw ids to rows.
        weighted: a weighted EBC reads the batch's weights of it (``is_weighted=True``): the
            batch must carry weights. Not set by the EBC of a
            ``FeatureProcessedEmbeddingBagCollection``, whose feature processors make the
            weights it reads (the batch's own, if any, are not read).
        max_ids: the most ids one sample may hold (None: no limit): the smallest that a module
            of the model declares in a ``max_ids_per_sample`` mapping (e.g. a sequence model's
            longest history) or that a feature processor's position weights allow
            (``PositionWeightedModule(max_feature_length=N)``).
        min_ids: the fewest ids one sample must hold (0: none), as a module declares it in a
            ``min_ids_per_sample`` mapping (e.g. a sequence model's one target per sample).
        max_ids_from: what sets ``max_ids``, for the message that refuses a longer sample.
        managed: a managed-collision table reads it: TorchRec remaps its raw ids into
            ``torch.int64`` rows, so its ids must be ``torch.int64``.
    """

    feature: str
    table: str
    num_embeddings: int
    weighted: bool = False
    max_ids: int | None = None
    min_ids: int = 0
    max_ids_from: str = "max_ids_per_sample"
    managed: bool = False


class FeatureSpecs(dict[str, FeatureSpec]):
    """``{feature: FeatureSpec}`` over the whole model, and each collection's own specs.

    As a mapping it gives, for a feature read by several collections, the smallest table (the
    check that refuses nothing any of them would take badly). :meth:`for_keys` narrows that to
    one collection where a KJT's keys tell which.

    Args:
        merged: the model-wide specs.
        collections: ``{collection path: {feature: FeatureSpec}}`` of each collection.
    """

    def __init__(
        self,
        merged: Mapping[str, FeatureSpec],
        collections: Mapping[str, Mapping[str, FeatureSpec]] | None = None,
    ) -> None:
        super().__init__(merged)
        #: Each collection's own specs, by module path.
        self.collections = {path: dict(specs) for path, specs in (collections or {}).items()}
        #: The features whose spec differs between the collections that read them.
        self.shared = frozenset(
            feature for feature in self if len(set(self._readers(feature).values())) > 1
        )
        self._resolved: dict[tuple[str, ...], Mapping[str, FeatureSpec]] = {}
        #: Batch features no table reads that a warning has named already (TorchRec ignores
        #: such features; they are named once, not at every step).
        self.unread_named: set[str] = set()

    def __reduce__(self) -> tuple[object, ...]:  # pickled into DataLoader workers
        return (FeatureSpecs, (dict(self), self.collections))

    def _readers(self, feature: str) -> dict[str, FeatureSpec]:
        return {p: specs[feature] for p, specs in self.collections.items() if feature in specs}

    def owners(self, keys: Iterable[str]) -> list[str]:
        """The collections that read every known key of a KJT.

        Args:
            keys: the KJT's keys.

        Returns:
            Their module paths, in model order.
        """
        known = {k for k in keys if k in self}
        return [path for path, specs in self.collections.items() if known <= specs.keys()]

    def for_keys(self, keys: Iterable[str]) -> Mapping[str, FeatureSpec]:
        """The specs to check a KJT with these keys against.

        Args:
            keys: the KJT's keys.

        Returns:
            This mapping, or (when one of ``keys`` is read by several collections with
            different tables and exactly one collection reads all of them) the specs of that
            collection over this mapping.
        """
        keys = tuple(keys)
        if not self.shared or self.shared.isdisjoint(keys):
            return self
        resolved = self._resolved.get(keys)
        if resolved is None:
            owners = self.owners(keys)
            resolved = {**self, **self.collections[owners[0]]} if len(owners) == 1 else self
            self._resolved[keys] = resolved
        return resolved

    def ambiguity(self, feature: str, keys: Iterable[str]) -> str:
        """Why a shared feature's ids were checked against its smallest table, for a message.

        Args:
            feature: the feature.
            keys: the keys of its KJT.

        Returns:
            A sentence naming the other tables that read it, or ``""`` when it is not shared.
        """
        if feature not in self.shared:
            return ""
        tables = sorted(
            {(s.table, s.num_embeddings, path) for path, s in self._readers(feature).items()}
        )
        listed = ", ".join(
            f"{t!r} ({rows} rows, in {path or 'the model'})" for t, rows, path in tables
        )
        owners = self.owners(keys)
        matched = f"collections {owners}" if owners else "no single collection"
        return (
            f" Feature {feature!r} is read by several tables: {listed}; this KeyedJaggedTensor's "
            f"keys {sorted(keys)} match {matched}, so its ids are checked against the smallest. "
            "Give each collection's features names of their own (e.g. 'user_id', 'item_id')."
        )


def specs_for(specs: Mapping[str, FeatureSpec], keys: Iterable[str]) -> Mapping[str, FeatureSpec]:
    """The specs to check a KJT with ``keys`` against (see :meth:`FeatureSpecs.for_keys`).

    Args:
        specs: a :class:`FeatureSpecs`, or any ``{feature: FeatureSpec}`` mapping.
        keys: the KJT's keys.

    Returns:
        The specs for that KJT (``specs`` itself for a plain mapping).
    """
    return specs.for_keys(keys) if isinstance(specs, FeatureSpecs) else specs


def managed_input_sizes(model: nn.Module) -> dict[str, int]:
    """The raw-id bound of each managed-collision table (its module's ``input_size()``).

    Args:
        model: an unsharded model.

    Returns:
        ``{table name: input size}``; empty without managed-collision collections.
    """
    sizes: dict[str, int] = {}
    for _, collection in unwrap(model).named_modules():
        if isinstance(collection, ManagedCollisionCollection):
            for path, module in collection.named_modules():
                if isinstance(module, ManagedCollisionModule):
                    sizes[path.rsplit(".", 1)[-1]] = int(module.input_size())
    return sizes


def _merge(old: FeatureSpec | None, new: FeatureSpec) -> FeatureSpec:
    """Two tables reading one feature: the smaller table, weighted or managed if either is."""
    if old is None:
        return new
    smaller = new if new.num_embeddings < old.num_embeddings else old
    return dataclasses.replace(
        smaller, weighted=old.weighted or new.weighted, managed=old.managed or new.managed
    )


def _declared(model: nn.Module) -> tuple[list[tuple[str, int, str]], dict[str, int]]:
    """The declared per-sample id limits: ``[(feature, most, by)]`` and ``{feature: least}``."""
    limits = [
        (f, n, by) for found in processed_collections(model) for f, (n, by) in found.max_ids.items()
    ]
    least: dict[str, int] = {}
    for module in model.modules():
        declared = getattr(module, "max_ids_per_sample", None)
        for feature, limit in (declared if isinstance(declared, Mapping) else {}).items():
            limits.append((feature, int(limit), "max_ids_per_sample"))
        declared = getattr(module, "min_ids_per_sample", None)
        for feature, count in (declared if isinstance(declared, Mapping) else {}).items():
            least[feature] = max(least.get(feature, 0), int(count))
    return limits, least


def _limited(
    specs: dict[str, FeatureSpec], limits: list[tuple[str, int, str]], least: dict[str, int]
) -> dict[str, FeatureSpec]:
    for feature, count in least.items():
        spec = specs.get(feature)
        if spec is not None and count > spec.min_ids:
            specs[feature] = dataclasses.replace(spec, min_ids=count)
    for feature, limit, by in limits:
        spec = specs.get(feature)
        if spec is not None and (spec.max_ids is None or limit < spec.max_ids):
            specs[feature] = dataclasses.replace(spec, max_ids=limit, max_ids_from=by)
    return specs


def feature_specs(model: nn.Module) -> FeatureSpecs:
    """The sparse features the tables of an unsharded model read.

    Args:
        model: a model holding EBC/EC modules (before sharding; tables may be on meta).

    Returns:
        One spec per feature name; a feature read by several tables gets the smallest table,
        the smallest ``max_ids_per_sample`` (or position-weight count of its feature
        processors) and the largest ``min_ids_per_sample`` any module of the model declares.
        Each collection's own specs are kept too (:meth:`FeatureSpecs.for_keys`).
    """
    inner = unwrap(model)
    raw = managed_input_sizes(inner)
    made = {id(found.embeddings) for found in processed_collections(inner)}  # processors' weights
    limits, least = _declared(inner)
    merged: dict[str, FeatureSpec] = {}
    collections: dict[str, dict[str, FeatureSpec]] = {}
    for path, configs in embedding_modules(inner).items():
        module = inner.get_submodule(path) if path else inner
        reads = bool(getattr(module, "is_weighted", lambda: False)()) and id(module) not in made
        own: dict[str, FeatureSpec] = {}
        for cfg in configs:
            rows = raw.get(cfg.name, cfg.num_embeddings)
            for feature in cfg.feature_names:
                spec = FeatureSpec(feature, cfg.name, rows, reads, managed=cfg.name in raw)
                own[feature] = _merge(own.get(feature), spec)
                merged[feature] = _merge(merged.get(feature), spec)
        collections[path] = _limited(own, limits, least)
    return FeatureSpecs(_limited(merged, limits, least), collections)
