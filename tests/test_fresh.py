"""A served model kept fresh by deltas (``export/fresh.py``), checked against full exports.

Three checkpoints of one small DLRM (steps 3, 4 and 5, trained in this process) give two deltas
(``delta-000001``: step 3 to 4, ``delta-000002``: 4 to 5), written here in the version-1 format
by :func:`write_delta` (the rows that differ, dense from the newer step, the package's
manifest), independently of the trainer's writer. The export of step 3 (fp32 and int8, ``.pt2``
and TorchScript) is served in a process that cannot import ``lightning_torchrec``, with
``export/fresh.py`` loaded by file path; after each delta its outputs and table bytes must equal
the full export of the same step: bit for bit. About 70 s on 2 busy cores (serving: 30 s).
"""

from __future__ import annotations

import ast
import json
import re
import shutil
import sys
import threading
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

import lightning_torchrec.export.fresh as fresh
from lightning_torchrec import TorchRecStrategy
from lightning_torchrec.checkpoint import iter_plain_tensors
from lightning_torchrec.checkpoint.manifest import file_checksum, write_manifest
from lightning_torchrec.errors import DeltaRefusedError
from lightning_torchrec.export.artifact import export
from lightning_torchrec.export.fresh import FreshModel, checkpoint_id, read_delta
from tests.helpers import serve_bare
from tests.scripts.factory import adam, cpu_trainer, tiny_data, tiny_dlrm
from tests.test_export_sequence import SequenceClickModule

MODULE = "lightning_torchrec.DLRMClickModule"
ROWS, TABLES, DIM = 300, 2, 8
STEPS = (3, 4, 5)
PREFIX = "model_and_loss.model."
_TABLE_KEY = re.compile(r"(?:embedding_bags|embeddings)\.([^.]+)\.weight$")
KEY = b"k" * 32
FORMATS = {"pt2": "pt2", "torchscript": "ts"}


def _data() -> L.LightningDataModule:
    return tiny_data(ROWS, TABLES, ids_per_feature=2, batch_size=16, train_batches=40, seed=0)


def _train(out: Path, steps: int, source: Path | None) -> Path:
    L.seed_everything(0, verbose=False)
    model = tiny_dlrm(
        ROWS, TABLES, embedding_dim=DIM, dense_sizes=[16, DIM], over_sizes=[8, 1], **adam(1e-2)
    )
    trainer = cpu_trainer(
        TorchRecStrategy(fused_params={"learning_rate": 0.3}, log_plan=False),
        max_steps=steps,
        limit_val_batches=0,
        default_root_dir=out,
    )
    trainer.fit(model, datamodule=_data(), ckpt_path=source)
    trainer.save_checkpoint(out / f"step{steps}")
    return out / f"step{steps}"


def _state(checkpoint: Path) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """``(tables, dense)`` of a checkpoint, named as the inference model has them."""
    tables, dense = {}, {}
    for key, tensor in iter_plain_tensors(checkpoint):
        name = key.removeprefix(PREFIX)
        match = _TABLE_KEY.search(name)
        if match:
            tables[match.group(1)] = tensor.clone()
        else:
            dense[name] = tensor.clone()
    return tables, dense


def write_delta(
    root: Path,
    sequence: int,
    parent: str,
    base: str,
    tables: dict[str, tuple[torch.Tensor, torch.Tensor]],
    dense: dict[str, torch.Tensor] | None,
    *,
    rows: int = ROWS,
    ranks: int = 2,
    key: bytes | None = None,
    tamper: Callable[[Path], None] | None = None,
) -> tuple[Path, str]:
    """Writes a version-1 delta folder ``root/delta-<sequence:06d>`` (see the shared design).

    Args:
        root: the deltas' folder.
        sequence: its sequence number.
        parent: the id of the state it applies on.
        base: the base checkpoint's id.
        tables: ``{table: (ids, rows)}``; the ids are spread over ``ranks`` rank files
            (round robin, so every file holds sorted ids and the files are disjoint).
        dense: ``{name: tensor}``, or None.
        rows: every table's row count as written in ``delta.json``.
        ranks: rank files.
        key: sign the manifest.
        tamper: called on the temporary folder before the manifest is written.

    Returns:
        ``(folder, its id)``.
    """
    name = f"delta-{sequence:06d}"
    tmp = root / f".tmp-{name}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir(parents=True)
    files = [f"rank-{r:05d}.pt" for r in range(ranks)]
    for r, file in enumerate(files):
        part = {}
        for table, (ids, values) in tables.items():
            part[f"{table}/ids"] = ids[r::ranks].clone()
            part[f"{table}/rows"] = values[r::ranks].clone()
        torch.save(part, tmp / file)
    if dense is not None:
        torch.save(dense, tmp / "dense.pt")
    delta_id = uuid.uuid4().hex
    info = {
        "format": "lightning_torchrec.delta",
        "version": 1,
        "id": delta_id,
        "name": name,
        "sequence": sequence,
        "parent": parent,
        "base": base,
        "step": sequence,
        "partition": None,
        "tables": {
            t: {"rows": rows, "dim": int(v.shape[1]), "ids": int(i.numel())}
            for t, (i, v) in tables.items()
        },
        "dense": "dense.pt" if dense is not None else None,
        "optimizer": False,
        "files": files,
        "written": 0.0,
    }
    (tmp / "delta.json").write_text(json.dumps(info))
    if tamper is not None:
        tamper(tmp)
    sums = {p.name: file_checksum(p, strong=key is not None) for p in sorted(tmp.iterdir())}
    write_manifest(tmp, sums, 1, ranks, key=key)
    final = root / name
    if final.exists():
        shutil.rmtree(final)
    tmp.rename(final)
    return final, delta_id


def diff_delta(
    root: Path, older: Path, newer: Path, sequence: int, parent: str, base: str, **kwargs: Any
) -> tuple[Path, str, int]:
    """The delta from checkpoint ``older`` to ``newer``: the rows that differ, dense of newer.

    Returns:
        ``(folder, id, rows changed in all)``.
    """
    old_tables, _ = _state(older)
    new_tables, new_dense = _state(newer)
    tables, changed = {}, 0
    for table, new in new_tables.items():
        ids = torch.nonzero((new != old_tables[table]).any(dim=1)).reshape(-1)
        tables[table] = (ids, new[ids])
        changed += ids.numel()
    folder, delta_id = write_delta(root, sequence, parent, base, tables, new_dense, **kwargs)
    return folder, delta_id, changed


@pytest.fixture(scope="module")
def steps(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Path]:
    out = tmp_path_factory.mktemp("fresh")
    found, source = {}, None
    for n in STEPS:
        found[n] = source = _train(out, n, source)
    if torch.distributed.is_initialized():  # neither export nor serving needs one
        torch.distributed.destroy_process_group()
    return found


@pytest.fixture(scope="module")
def chain(steps: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """``delta-000001`` (step 3 to 4) and ``delta-000002`` (4 to 5) under one root."""
    root = tmp_path_factory.mktemp("deltas")
    base = checkpoint_id(steps[3])
    d1, id1, changed1 = diff_delta(root, steps[3], steps[4], 1, base, base)
    d2, id2, changed2 = diff_delta(root, steps[4], steps[5], 2, id1, base)
    return {
        "root": root,
        "base": base,
        "deltas": [d1, d2],
        "ids": [id1, id2],
        "changed": [changed1, changed2],
    }


@pytest.fixture(scope="module")
def exports(steps: dict[int, Path], tmp_path_factory: pytest.TempPathFactory) -> dict:
    """``{(step, format, dtype): artifact}``."""
    out = tmp_path_factory.mktemp("artifacts")
    found = {}
    for n in STEPS:
        for fmt, suffix in FORMATS.items():
            for dtype in ("fp32", "int8"):
                path = out / f"step{n}_{dtype}.{suffix}"
                found[(n, fmt, dtype)] = export(
                    steps[n], MODULE, path, dtype=dtype, format=fmt
                ).path
    return found


def _batches(count: int = 3, size: int = 64) -> list[dict[str, torch.Tensor]]:
    data = tiny_data(ROWS, TABLES, ids_per_feature=2, batch_size=size, test_batches=count)
    return [
        {
            "dense": b.dense_features,
            "values": b.sparse_features.values(),
            "lengths": b.sparse_features.lengths(),
        }
        for b in data.dataset("test")
    ]


KEYS = [f"cat_{i}" for i in range(TABLES)]


def _logits(model: Any, batches: list[dict[str, torch.Tensor]]) -> torch.Tensor:
    out = []
    with torch.inference_mode():
        for b in batches:
            kjt = KeyedJaggedTensor(keys=KEYS, values=b["values"], lengths=b["lengths"])
            out.append(model(b["dense"], kjt).reshape(-1))
    return torch.cat(out)


def _table_bytes(model: FreshModel) -> dict[str, torch.Tensor]:
    out = {}
    for table, spec in model.tables.items():
        buffer = fresh._resolve(model.module, spec["state"])
        start = spec["offset"]
        out[table] = buffer[start : start + spec["rows"] * spec["row_bytes"]].clone()
    return out


def test_the_side_file_names_the_checkpoint_and_the_rows(
    steps: dict[int, Path], exports: dict
) -> None:
    for fmt in FORMATS:
        for dtype, row_bytes in (("fp32", 4 * DIM), ("int8", DIM + 4)):
            info = json.loads(Path(f"{exports[(3, fmt, dtype)]}.json").read_text())
            assert info["checkpoint_id"] == checkpoint_id(steps[3])
            tables = info["served_state"]["tables"]
            assert sorted(tables) == [f"t_cat_{i}" for i in range(TABLES)]
            offsets = sorted(t["offset"] for t in tables.values())
            # fbgemm aligns each table's start in its buffer.
            assert offsets[0] == 0 and offsets[1] >= ROWS * row_bytes
            for spec in tables.values():
                assert (spec["rows"], spec["dim"], spec["dtype"]) == (ROWS, DIM, dtype)
                assert spec["row_bytes"] == row_bytes
            dense = info["served_state"]["dense"]
            assert (
                "over_arch.model.1.weight" in dense
                and "dense_arch.model._mlp.0._linear.bias" in dense
            )


def test_served_model_equals_the_full_export_after_each_delta(
    exports: dict, chain: dict[str, Any], tmp_path: Path
) -> None:
    """Served without the package: step 3 + deltas == the export of step 4, then of step 5."""
    # Each delta changes some rows, not all: the rows it leaves keep step 3's bytes.
    assert all(0 < c < TABLES * ROWS for c in chain["changed"]), chain["changed"]
    batches = _batches()
    fresh_ones = [exports[(3, fmt, dtype)] for fmt in FORMATS for dtype in ("fp32", "int8")]
    references = [exports[(n, fmt, d)] for n in (4, 5) for fmt in FORMATS for d in ("fp32", "int8")]
    # Refused next: delta-000001 again (out of order), then delta-000004 (a gap).
    ids = torch.arange(4)
    one = {"t_cat_0": (ids, torch.ones(4, DIM))}
    gap, _ = write_delta(chain["root"] / "gap", 4, chain["ids"][1], chain["base"], one, None)
    inputs = {
        "fresh": str(Path(fresh.__file__)),
        "keys": KEYS,
        "batches": batches,
        "deltas": {str(p): [str(d) for d in chain["deltas"]] for p in fresh_ones},
        "bad": {str(p): [str(chain["deltas"][0]), str(gap)] for p in fresh_ones},
    }
    got = serve_bare(tmp_path, inputs, [*fresh_ones, *references], script="fresh_serve.py")
    for fmt in FORMATS:
        for dtype in ("fp32", "int8"):
            served = got[str(exports[(3, fmt, dtype)])]
            assert len(served["outputs"]) == 3
            assert not torch.equal(served["outputs"][0], served["outputs"][1])
            for n, after in ((4, served["outputs"][1]), (5, served["outputs"][2])):
                full = got[str(exports[(n, fmt, dtype)])]
                assert torch.equal(after, full["outputs"][0]), (fmt, dtype, n)
            full = got[str(exports[(5, fmt, dtype)])]
            for table, data in served["tables"].items():
                assert torch.equal(data, full["tables"][table]), (fmt, dtype, table)
            assert served["sequence"] == 2 and served["id"] == chain["ids"][1]
            # Refused without the package: its own DeltaRefusedError; the last good state kept.
            (kind1, out_of_order, after1), (kind2, gap_message, after2) = served["refused"]
            assert kind1 == kind2 == "DeltaRefusedError"
            assert "delta-000001" in out_of_order and "out of order" in out_of_order
            assert "delta-000004" in gap_message and "gap" in gap_message
            assert "delta-000003 (sequence 3) is missing" in gap_message
            assert torch.equal(after1, served["outputs"][2])
            assert torch.equal(after2, served["outputs"][2])


@pytest.fixture
def served(exports: dict) -> FreshModel:
    return FreshModel(exports[(3, "pt2", "int8")])


def _refused(model: FreshModel, delta: Path, *words: str) -> None:
    batches = _batches(1)
    before, state = _logits(model, batches), (model.current_id, model.sequence)
    tables = _table_bytes(model)
    with pytest.raises(DeltaRefusedError) as caught:
        model.apply(delta)
    message = str(caught.value)
    assert delta.name in message and str(delta) in message, message
    for word in words:
        assert word in message, message
    assert torch.equal(_logits(model, batches), before)
    assert (model.current_id, model.sequence) == state
    for table, data in _table_bytes(model).items():
        assert torch.equal(data, tables[table])


def test_out_of_order_and_gap_refused(served: FreshModel, chain: dict[str, Any]) -> None:
    d1, d2 = chain["deltas"]
    _refused(served, d2, "gap", "delta-000001 (sequence 1) is missing")
    served.apply(d1)
    _refused(served, d1, "out of order", "serves already")
    served.apply(d2)
    _refused(served, d1, "out of order", "already applied")
    assert served.sequence == 2 and served.applied == "delta-000002"


def test_another_base_or_chain_refused(
    served: FreshModel, chain: dict[str, Any], steps: dict[int, Path], tmp_path: Path
) -> None:
    tables, dense = _state(steps[4])
    ids = torch.arange(3)
    one = {"t_cat_0": (ids, tables["t_cat_0"][ids])}
    other = "f" * 64
    folder, _ = write_delta(tmp_path / "a", 1, other, other, one, dense)
    _refused(served, folder, "another model or chain", other)
    folder, _ = write_delta(tmp_path / "b", 1, other, chain["base"], one, dense)
    _refused(served, folder, "another chain", other)


def test_another_model_refused(served: FreshModel, chain: dict[str, Any], tmp_path: Path) -> None:
    base = chain["base"]
    ids = torch.arange(2)
    folder, _ = write_delta(
        tmp_path / "a", 1, base, base, {"t_other": (ids, torch.ones(2, DIM))}, None
    )
    _refused(served, folder, "another model", "t_other")
    folder, _ = write_delta(
        tmp_path / "b", 1, base, base, {"t_cat_0": (ids, torch.ones(2, DIM))}, None, rows=ROWS * 2
    )
    _refused(served, folder, "another model", f"{ROWS * 2} rows")
    folder, _ = write_delta(
        tmp_path / "c", 1, base, base, {"t_cat_0": (ids, torch.ones(2, DIM))}, {"x.weight": ids}
    )
    _refused(served, folder, "another model", "x.weight")


def test_id_outside_the_table_refused(
    served: FreshModel, chain: dict[str, Any], tmp_path: Path
) -> None:
    base = chain["base"]
    ids = torch.tensor([0, 5, ROWS])
    folder, _ = write_delta(
        tmp_path, 1, base, base, {"t_cat_1": (ids, torch.ones(3, DIM))}, None, ranks=1
    )
    _refused(served, folder, f"id {ROWS} >= the table's rows ({ROWS})", "t_cat_1")


def test_non_finite_rows_or_dense_refused(
    served: FreshModel, chain: dict[str, Any], steps: dict[int, Path], tmp_path: Path
) -> None:
    base = chain["base"]
    rows = torch.ones(3, DIM)
    rows[1, 2] = float("nan")
    folder, _ = write_delta(
        tmp_path / "rows",
        1,
        base,
        base,
        {"t_cat_1": (torch.tensor([0, 5, 7]), rows)},
        None,
        ranks=1,
    )
    _refused(served, folder, "t_cat_1", "the row of id 5 holds NaN or inf")
    _, dense = _state(steps[4])
    name = sorted(dense)[0]
    dense[name] = dense[name].clone()
    dense[name].view(-1)[0] = float("inf")
    folder, _ = write_delta(tmp_path / "dense", 1, base, base, {}, dense, ranks=1)
    _refused(served, folder, f"{name} holds NaN or inf")


def test_damaged_missing_or_unlisted_files_refused(
    served: FreshModel, chain: dict[str, Any], tmp_path: Path
) -> None:
    for i, (what, damage) in enumerate(
        (
            ("damaged", lambda p: _flip(p / "rank-00001.pt")),
            ("missing", lambda p: (p / "dense.pt").unlink()),
            ("not listed", lambda p: (p / "extra.txt").write_text("x")),
            ("truncated", lambda p: _cut(p / "rank-00000.pt")),
        )
    ):
        folder = tmp_path / str(i) / "delta-000001"
        shutil.copytree(chain["deltas"][0], folder)
        damage(folder)
        _refused(served, folder, what)
    served.apply(chain["deltas"][0])  # the good one still applies after the refusals
    assert served.sequence == 1


def _flip(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[:-10])


def test_unsigned_refused_when_a_key_is_required(
    exports: dict, chain: dict[str, Any], steps: dict[int, Path], tmp_path: Path
) -> None:
    model = FreshModel(exports[(3, "torchscript", "int8")], key=KEY)
    _refused(model, chain["deltas"][0], "not signed")
    old, new, base = steps[3], steps[4], chain["base"]
    signed, _, _ = diff_delta(tmp_path / "other", old, new, 1, base, base, key=b"o" * 32)
    _refused(model, signed, "signature does not match")
    signed, _, _ = diff_delta(tmp_path / "good", old, new, 1, base, base, key=KEY)
    model.apply(signed)
    assert model.sequence == 1
    # Signed deltas read with the key: a changed file is refused by its SHA-256 too.
    assert read_delta(signed, KEY).sequence == 1


def test_requests_see_the_old_or_the_new_state_never_a_mix(
    exports: dict, chain: dict[str, Any]
) -> None:
    """Requests run in a thread while deltas setting every row to a constant apply."""
    model = FreshModel(exports[(3, "pt2", "fp32")])
    batches = _batches(1, size=256)
    base = chain["base"]
    ids = torch.arange(ROWS)
    states, parent = [_logits(model, batches)], base
    deltas = []
    for seq in range(1, 6):
        tables = {
            f"t_cat_{i}": (ids, torch.full((ROWS, DIM), 0.1 * seq + i)) for i in range(TABLES)
        }
        folder, parent = write_delta(chain["root"] / "mix", seq, parent, base, tables, None)
        deltas.append(folder)
    seen: list[torch.Tensor] = []
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            seen.append(_logits(model, batches))

    thread = threading.Thread(target=serve)
    thread.start()
    try:
        for folder in deltas:
            model.apply(folder)
            states.append(_logits(model, batches))
    finally:
        stop.set()
        thread.join()
    assert len({tuple(s.tolist()) for s in states}) == len(states)  # each delta changes them
    mixed = [i for i, out in enumerate(seen) if not any(torch.equal(out, s) for s in states)]
    assert mixed == [] and len(seen) > len(states), (len(mixed), len(seen))


def test_apply_pending_catches_up_in_order(exports: dict, chain: dict[str, Any]) -> None:
    model = FreshModel(exports[(3, "torchscript", "fp32")])
    root = chain["root"] / "pending"
    root.mkdir(exist_ok=True)
    for folder in chain["deltas"]:
        if not (root / folder.name).exists():
            shutil.copytree(folder, root / folder.name)
    assert [d.name for d in model.apply_pending(root)] == ["delta-000001", "delta-000002"]
    assert model.apply_pending(root) == [] and model.sequence == 2


def test_the_error_is_the_packages_when_importable() -> None:
    assert fresh.DeltaRefusedError is DeltaRefusedError


def test_fresh_imports_only_the_standard_library_torch_and_torchrec() -> None:
    """What a serving process without the package can load (the bare test runs it, too)."""
    tree = ast.parse(Path(fresh.__file__).read_text())
    top = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            top.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            if node.module == "lightning_torchrec.errors":  # in a try: its own class otherwise
                assert [a.name for a in node.names] == ["DeltaRefusedError"]
                continue
            top.add(node.module.split(".")[0])
    assert top - sys.stdlib_module_names == {"torch", "torchrec"}, top


@pytest.mark.parametrize("dtype", ["fp16", "int4"])
def test_fp16_and_int4_rows_as_the_export_quantizes_them(
    dtype: str, steps: dict[int, Path], chain: dict[str, Any], tmp_path: Path
) -> None:
    """In this process (the bare one runs fp32 and int8): step 3 + deltas == export of step 5."""
    paths = {n: export(steps[n], MODULE, tmp_path / f"s{n}.pt2", dtype=dtype).path for n in (3, 5)}
    model, full = FreshModel(paths[3]), FreshModel(paths[5])
    for folder in chain["deltas"]:
        model.apply(folder)
    batches = _batches(1)
    assert torch.equal(_logits(model, batches), _logits(full, batches))
    ours, theirs = _table_bytes(model), _table_bytes(full)
    assert all(torch.equal(ours[t], theirs[t]) for t in theirs)


def test_a_delta_that_leaves_dense_alone(
    exports: dict, chain: dict[str, Any], steps: dict[int, Path], tmp_path: Path
) -> None:
    """``dense: null``: only rows change; the dense layers stay the served ones."""
    model = FreshModel(exports[(3, "torchscript", "fp32")])
    dense_before = {n: t.clone() for n, t in model.module.named_parameters()}
    tables, _ = _state(steps[5])
    ids = torch.tensor([1, 7, 42])
    base = chain["base"]
    folder, _ = write_delta(
        tmp_path, 1, base, base, {"t_cat_1": (ids, tables["t_cat_1"][ids])}, None
    )
    delta = model.apply(folder)
    assert delta.dense is None and model.sequence == 1
    for name, tensor in model.module.named_parameters():
        assert torch.equal(tensor, dense_before[name]), name
    rows = _table_bytes(model)["t_cat_1"].view(ROWS, 4 * DIM)[ids].view(torch.float32)
    assert torch.equal(rows, tables["t_cat_1"][ids])


def test_an_embedding_collection_model(tmp_path: Path) -> None:
    """Sequence tables (``EmbeddingCollection``: one vector per id) are kept fresh the same way."""
    saved = {}
    for steps in (2, 3):
        torch.manual_seed(0)
        data = tiny_data(100, 2, ids_per_feature=3, batch_size=64, train_batches=10, seed=0)
        strategy = TorchRecStrategy(fused_params={"learning_rate": 0.1}, log_plan=False)
        trainer = cpu_trainer(
            strategy, max_steps=steps, limit_val_batches=0, default_root_dir=tmp_path
        )
        trainer.fit(SequenceClickModule(), datamodule=data, ckpt_path=saved.get(2))
        trainer.save_checkpoint(tmp_path / f"ec{steps}")
        saved[steps] = tmp_path / f"ec{steps}"
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    base = checkpoint_id(saved[2])
    delta, _, changed = diff_delta(tmp_path / "deltas", saved[2], saved[3], 1, base, base, rows=100)
    assert changed > 0
    paths = {
        n: export(saved[n], SequenceClickModule, tmp_path / f"ec{n}.pt2", dtype="int8").path
        for n in (2, 3)
    }
    model, full = FreshModel(paths[2]), FreshModel(paths[3])
    model.apply(delta)
    batch = tiny_data(100, 2, ids_per_feature=3, batch_size=64, seed=1).dataset("test")[0]
    with torch.inference_mode():
        ours = model(batch.dense_features, batch.sparse_features)
        theirs = full(batch.dense_features, batch.sparse_features)
    assert torch.equal(ours, theirs)
    assert all(
        torch.equal(a, b)
        for a, b in zip(_table_bytes(model).values(), _table_bytes(full).values(), strict=True)
    )
