"""MovieLens rating files: read into per-user sequences, and written with a known structure.

Two layouts are read, the two MovieLens ships:

* ``ratings.dat`` (MovieLens 1M and 10M): ``user::item::rating::timestamp``, no header;
* ``ratings.csv`` (MovieLens 20M, 25M, 32M and "latest"): ``userId,movieId,rating,timestamp``
  with that header.

Every rating counts as an interaction (the usual implicit-feedback reading of MovieLens). A user's
interactions are sorted by time; interactions with the same timestamp keep their order in the
file. Raw item ids become contiguous indices ``0 .. num_items - 1`` in increasing raw-id order
(:attr:`UserSequences.item_ids` maps them back).

:func:`write_cycle_ratings` writes a file in either layout whose sequences follow a known rule:
every item has a fixed successor (a random permutation of the items); a user's next item is the
successor of their last one with probability ``1 - noise``, and otherwise an item drawn from a
skewed popularity distribution. Since the next item depends only on the last one, the best
recall@k and NDCG@k any model can reach are known exactly (:func:`best_achievable`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.csv as pacsv

__all__ = [
    "CycleStructure",
    "UserSequences",
    "best_achievable",
    "cycle_structure",
    "read_ratings",
    "write_cycle_ratings",
]

CSV_HEADER = ("userId", "movieId", "rating", "timestamp")


@dataclass(frozen=True)
class UserSequences:
    """Every user's items in time order.

    Attributes:
        user_ids: the raw user id of each sequence.
        item_ids: the raw item id of each item index (sorted, so index order is raw-id order).
        offsets: ``[num_users + 1]``; user ``u``'s items are ``items[offsets[u]:offsets[u + 1]]``.
        items: item indices of every user, concatenated, each user's in time order.
    """

    user_ids: np.ndarray
    item_ids: np.ndarray
    offsets: np.ndarray
    items: np.ndarray

    @property
    def num_users(self) -> int:
        """Users (sequences)."""
        return len(self.user_ids)

    @property
    def num_items(self) -> int:
        """Distinct items: the rows the item table needs."""
        return len(self.item_ids)

    def sequence(self, user: int) -> np.ndarray:
        """One user's item indices in time order.

        Args:
            user: the sequence's index (not the raw user id).

        Returns:
            The items.
        """
        return self.items[self.offsets[user] : self.offsets[user + 1]]


def _read_csv(path: Path, **options: object) -> pa.Table:
    """``pyarrow.csv.read_csv``; a line it cannot parse is a ``ValueError`` naming the file."""
    try:
        return pacsv.read_csv(path, **options)
    except pa.ArrowInvalid as e:  # e.g. "CSV parse error: Expected 4 columns, got 3: 1,5,4"
        raise ValueError(f"{path}: {e}") from e


def _read_table(path: Path) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The (user, item, timestamp) columns of a ratings file in either layout."""
    with path.open("rb") as f:  # "utf-8-sig": a byte-order mark (as Excel writes) is no text
        first = f.readline().decode("utf-8-sig", errors="replace").strip()
    if "::" in first:
        # ``a::b::c::d`` split at every ``:`` gives empty columns between the fields.
        table = _read_csv(
            path,
            read_options=pacsv.ReadOptions(autogenerate_column_names=True),
            parse_options=pacsv.ParseOptions(delimiter=":"),
        )
        if table.num_columns != 7:
            raise ValueError(
                f"{path}: a ratings.dat line has 4 fields user::item::rating::timestamp, "
                f"found {(table.num_columns + 1) // 2} in {first!r}"
            )
        columns = [table.column(i) for i in (0, 2, 6)]
    else:
        header = tuple(h.strip() for h in first.split(","))
        if header != CSV_HEADER:
            raise ValueError(
                f"{path}: expected a ratings.csv header {','.join(CSV_HEADER)} or ratings.dat "
                f"lines user::item::rating::timestamp, found {first!r}"
            )
        # Named as checked: the file's own names may carry spaces (``userId, movieId``).
        names = pacsv.ReadOptions(skip_rows=1, column_names=list(CSV_HEADER))
        table = _read_csv(path, read_options=names)
        columns = [table.column(name) for name in ("userId", "movieId", "timestamp")]
    out = []
    for name, column in zip(("user", "item", "timestamp"), columns, strict=True):
        if not pa.types.is_integer(column.type):
            raise ValueError(f"{path}: the {name} column holds {column.type}, not integers")
        if column.null_count:
            raise ValueError(f"{path}: the {name} column has {column.null_count} empty values")
        out.append(column.to_numpy().astype(np.int64))
    return out[0], out[1], out[2]


def read_ratings(path: str | Path, min_interactions: int = 3) -> UserSequences:
    """Reads a MovieLens ratings file into time-ordered user sequences.

    Args:
        path: a ``ratings.dat`` (``user::item::rating::timestamp``) or ``ratings.csv``
            (``userId,movieId,rating,timestamp`` with header) file; the layout is recognised
            from the first line.
        min_interactions: users with fewer interactions are dropped (leave-last-out needs 3:
            at least one to learn from, one to validate, one to test).

    Returns:
        The sequences, users in increasing raw-id order.

    Raises:
        FileNotFoundError: if ``path`` does not exist.
        ValueError: naming the file, for another layout, non-integer ids or timestamps, or no
            user with ``min_interactions`` interactions.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no ratings file at {path}")
    users, items, stamps = _read_table(path)
    # Stable: by user, then time; ties keep the file's order.
    order = np.lexsort((np.arange(len(users)), stamps, users))
    users, items = users[order], items[order]
    user_ids, starts, counts = np.unique(users, return_index=True, return_counts=True)
    keep = counts >= min_interactions
    if not keep.any():
        raise ValueError(
            f"{path}: no user has {min_interactions} interactions (the most is "
            f"{int(counts.max()) if len(counts) else 0})"
        )
    rows = np.concatenate(
        [np.arange(s, s + c) for s, c in zip(starts[keep], counts[keep], strict=True)]
    )
    item_ids, item_index = np.unique(items[rows], return_inverse=True)
    offsets = np.concatenate([[0], np.cumsum(counts[keep])]).astype(np.int64)
    return UserSequences(user_ids[keep], item_ids, offsets, item_index.astype(np.int64))


@dataclass(frozen=True)
class CycleStructure:
    """The rule of :func:`write_cycle_ratings`'s files, for item indices ``0 .. n - 1``.

    Attributes:
        successor: ``[n]``: the item that follows each item when there is no noise.
        popularity: ``[n]``: the distribution noise items (and first items) are drawn from.
        noise: the probability that the next item is drawn from ``popularity`` instead.
    """

    successor: np.ndarray
    popularity: np.ndarray
    noise: float

    def next_item_probabilities(self, last: np.ndarray) -> np.ndarray:
        """The distribution of the next item given the last one.

        Args:
            last: ``[m]`` last items.

        Returns:
            ``[m, n]`` probabilities.
        """
        probs = np.tile(self.noise * self.popularity, (len(last), 1))
        probs[np.arange(len(last)), self.successor[last]] += 1.0 - self.noise
        return probs


def cycle_structure(
    num_items: int, noise: float = 0.3, popularity_skew: float = 1.0, seed: int = 0
) -> CycleStructure:
    """The rule :func:`write_cycle_ratings` writes with these arguments.

    Args:
        num_items: items ``n``.
        noise: probability that the next item is a popularity draw instead of the successor.
        popularity_skew: Zipf exponent of the popularity distribution (0: uniform).
        seed: fixes the successor permutation and which items are popular.

    Returns:
        The structure.

    Raises:
        ValueError: for fewer than 2 items or a noise outside [0, 1].
    """
    if num_items < 2:
        raise ValueError(f"num_items must be at least 2, got {num_items}")
    if not 0.0 <= noise <= 1.0:
        raise ValueError(f"noise must be in [0, 1], got {noise}")
    rng = np.random.default_rng(seed)
    successor = rng.permutation(num_items)
    rank = rng.permutation(num_items)
    weights = 1.0 / (rank + 1.0) ** popularity_skew
    return CycleStructure(successor, weights / weights.sum(), noise)


def write_cycle_ratings(
    path: str | Path,
    num_users: int = 2000,
    num_items: int = 500,
    min_length: int = 10,
    max_length: int = 40,
    noise: float = 0.3,
    popularity_skew: float = 1.0,
    seed: int = 0,
) -> CycleStructure:
    """Writes a ratings file of known structure, in the layout its name asks for.

    A name ending in ``.csv`` gets the ``ratings.csv`` layout, any other the ``ratings.dat``
    layout. User and item ids start at 1 (item index ``i`` is raw id ``i + 1``), timestamps
    increase along each user's sequence, and the lines are shuffled (readers must sort).

    Args:
        path: the file to write.
        num_users: users, each with one sequence.
        num_items: items.
        min_length: shortest sequence (at least 3).
        max_length: longest sequence.
        noise: see :func:`cycle_structure`.
        popularity_skew: see :func:`cycle_structure`.
        seed: fixes the structure and the sequences.

    Returns:
        The structure the sequences follow.

    Raises:
        ValueError: for fewer than 3 items per user or ``min_length > max_length``.
    """
    if not 3 <= min_length <= max_length:
        raise ValueError(f"need 3 <= min_length <= max_length, got {min_length}, {max_length}")
    structure = cycle_structure(num_items, noise, popularity_skew, seed)
    rng = np.random.default_rng(seed + 1)
    lengths = rng.integers(min_length, max_length + 1, num_users)
    total = int(lengths.sum())
    draws = rng.choice(num_items, size=total, p=structure.popularity)
    follow = rng.random(total) >= noise
    items = np.empty(total, dtype=np.int64)
    users = np.repeat(np.arange(1, num_users + 1), lengths)
    stamps = np.empty(total, dtype=np.int64)
    pos = 0
    for length in lengths:
        last = draws[pos]
        items[pos] = last
        for i in range(pos + 1, pos + length):
            last = structure.successor[last] if follow[i] else draws[i]
            items[i] = last
        start = 978_300_000 + int(rng.integers(0, 10_000_000))
        stamps[pos : pos + length] = start + np.cumsum(rng.integers(1, 1000, length))
        pos += length
    ratings = rng.integers(1, 6, total)
    order = rng.permutation(total)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    sep = "," if path.suffix == ".csv" else "::"
    lines = [
        f"{u}{sep}{i + 1}{sep}{r}{sep}{t}\n"
        for u, i, r, t in zip(
            users[order].tolist(),
            items[order].tolist(),
            ratings[order].tolist(),
            stamps[order].tolist(),
            strict=True,
        )
    ]
    with path.open("w") as f:
        if sep == ",":
            f.write(",".join(CSV_HEADER) + "\n")
        f.writelines(lines)
    return structure


def best_achievable(structure: CycleStructure, last: np.ndarray, k: int = 10) -> dict[str, float]:
    """The expected recall@k and NDCG@k of the best possible ranking, for given last items.

    The best ranking of a user whose last item is ``a`` orders items by their probability of
    coming next (:meth:`CycleStructure.next_item_probabilities`); its expected recall@k is the
    mass of its top ``k`` items, its expected NDCG@k (one relevant item) the sum of those masses
    discounted by ``1 / log2(rank + 1)``. No model can do better in expectation.

    Args:
        structure: the rule the sequences follow (item indices).
        last: ``[m]`` each evaluated user's last item before the target.
        k: the cut-off.

    Returns:
        ``{"recall": ..., "ndcg": ...}`` averaged over the users.
    """
    probs = -np.sort(-structure.next_item_probabilities(np.asarray(last)), axis=1)[:, :k]
    discounts = 1.0 / np.log2(np.arange(2, k + 2))
    return {
        "recall": float(probs.sum(axis=1).mean()),
        "ndcg": float((probs * discounts[: probs.shape[1]]).sum(axis=1).mean()),
    }
