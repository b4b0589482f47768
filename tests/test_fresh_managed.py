"""A served managed-collision model kept fresh by deltas equals a full export after each.

``tests/scripts/mc_model.py``'s click model (two managed tables of 32 rows, 200 raw ids a
feature over ``[0, 2**40)``, LFU eviction every 2 steps) trains 12 steps in this process with
the package's ``DeltaPublisher`` (a delta every 4 steps) and a full checkpoint at each delta's
step. The chain's base (written before any id was admitted) is exported (``.pt2`` and
TorchScript, fp32 and int8) and served with ``FreshModel``; after each delta its remap tensors,
table bytes and outputs on every raw id of the data (admitted since the base, evicted since the
last delta, never admitted), ids never seen and both ends of the raw-id range equal those of
the full export of the same step: bit for bit at fp32, the re-quantized export's at int8.
About 25 s on 2 busy cores.

No ``from __future__ import annotations`` here: TorchScript cannot resolve the string
annotations of the traced ``PooledClick.forward``.
"""

import json
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from lightning.pytorch.callbacks import Callback

import lightning_torchrec.export.fresh as fresh
from lightning_torchrec.checkpoint import chain_of
from lightning_torchrec.errors import DeltaRefusedError
from lightning_torchrec.export.artifact import export
from lightning_torchrec.export.fresh import FreshModel, read_delta
from lightning_torchrec.lightning import DeltaPublisher
from tests.scripts import mc_model
from tests.scripts.factory import cpu_trainer
from tests.test_export_managed_collision import PooledClick
from tests.test_fresh import _table_bytes, write_delta

EVERY, STEPS = 4, 12
#: (format, dtype) served; TorchScript through ``PooledClick`` (as the managed export's test).
KINDS = (("pt2", "fp32"), ("pt2", "int8"), ("torchscript", "fp32"), ("torchscript", "int8"))


class SaveAtPublish(Callback):
    """A full checkpoint ``full-<step>`` at every step the publisher (placed before) publishes."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_batch_end(self, trainer: Any, *args: Any) -> None:
        if trainer.global_step % EVERY == 0:
            trainer.save_checkpoint(self.out / f"full-{trainer.global_step}")


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fresh_mc")
    publisher = DeltaPublisher(out / "chain", every_n_steps=EVERY)
    trainer = cpu_trainer(
        mc_model.strategy(),
        max_steps=STEPS,
        limit_val_batches=0,
        callbacks=[publisher, SaveAtPublish(out)],
    )
    trainer.fit(mc_model.module(), mc_model.data())
    if torch.distributed.is_initialized():  # neither export nor serving needs one
        torch.distributed.destroy_process_group()
    return out


def _export(checkpoint: Path, fmt: str, dtype: str, path: Path) -> Path:
    root = mc_model.module()
    if fmt == "torchscript":
        click = root.model_and_loss.model
        root.inference_model = lambda: PooledClick(click.mc_ec, click.over)  # type: ignore[method-assign]
    return export(
        checkpoint, root, path, dtype=dtype, format=fmt, example_inputs=mc_model.probe_batch()
    ).path


def _remap(model: FreshModel) -> dict[str, torch.Tensor]:
    out = {}
    for path, remap in model.managed.items():
        for attr in fresh.REMAP_TENSORS:
            out[f"{path}.{attr}"] = fresh._resolve(model.module, remap[attr]).clone()
    return out


def _admitted(model: FreshModel) -> set[int]:
    ids = next(v for k, v in _remap(model).items() if k.endswith(".sorted_ids"))
    return set(ids[ids != fresh.EMPTY].tolist())


def _logits(model: Any) -> torch.Tensor:
    dense, kjt = mc_model.probe_batch()
    with torch.inference_mode():
        return model(dense, kjt).reshape(-1)


@pytest.mark.parametrize(("fmt", "dtype"), KINDS)
def test_served_model_equals_the_full_export_after_every_delta(
    run: Path, fmt: str, dtype: str, tmp_path: Path
) -> None:
    base = _export(run / "chain" / "base", fmt, dtype, tmp_path / "base")
    served = FreshModel(base)
    before, admitted = _logits(served), []
    deltas = chain_of(run / "chain")
    assert len(deltas) == STEPS // EVERY
    for delta in deltas:
        served.apply(delta)  # refused before managed-collision deltas could be applied
        assert served.step is not None and list(served.managed) == ["mc_ec.remap"]
        reference = FreshModel(
            _export(run / f"full-{served.step}", fmt, dtype, tmp_path / str(served.step))
        )
        got, want = _remap(served), _remap(reference)
        assert got.keys() == want.keys()
        for name in want:
            assert torch.equal(got[name], want[name]), (delta.name, name)
        got, want = _table_bytes(served), _table_bytes(reference)
        for table in want:
            assert torch.equal(got[table], want[table]), (delta.name, table)
        assert torch.equal(_logits(served), _logits(reference)), delta.name
        admitted.append(_admitted(served))
    assert not _admitted(FreshModel(base))  # the base admitted nothing: the deltas' ids are new
    assert all(admitted)
    evicted = [old - new for old, new in zip(admitted, admitted[1:], strict=False)]
    assert any(evicted)  # ids served by one delta and evicted by the next
    assert not torch.equal(_logits(served), before)


def _moved(run: Path, tmp_path: Path, change: Any) -> Path:
    """``delta-000001`` written again, its ``dense.pt`` changed by ``change``."""
    delta = read_delta(run / "chain" / "delta-000001")
    dense = dict(delta.dense or {})
    change(dense)
    tables = {t: (delta.ids[t], delta.rows[t]) for t in delta.ids}
    folder, _ = write_delta(
        tmp_path / "chain",
        1,
        delta.parent,
        delta.base,
        tables,
        dense,
        rows=mc_model.ZCH,
        ranks=1,
    )
    return folder


def test_a_delta_of_another_managed_layout_is_refused_whole(run: Path, tmp_path: Path) -> None:
    served = FreshModel(_export(run / "chain" / "base", "pt2", "fp32", tmp_path / "base"))
    before = _remap(served)
    segments = next(n for t in served.managed["mc_ec.remap"]["tables"] for n in [t["segments"]])

    def two_shards(dense: dict[str, torch.Tensor]) -> None:
        dense[segments] = torch.tensor([0, mc_model.ZCH // 2, mc_model.ZCH])

    with pytest.raises(DeltaRefusedError, match=r"in 2 row-wise shards .* export's in 1"):
        served.apply(_moved(run, tmp_path, two_shards))
    sources = served.managed["mc_ec.remap"]["tables"][0]["sorted_raw_ids"]
    with pytest.raises(DeltaRefusedError, match=r"dense.pt lacks dense tensors .*sorted_raw_ids"):
        served.apply(_moved(run, tmp_path, lambda dense: dense.pop(sources)))
    assert served.sequence == 0
    assert all(torch.equal(t, before[n]) for n, t in _remap(served).items())
    served.apply(run / "chain" / "delta-000001")  # the delta itself applies
    assert served.sequence == 1


def test_an_export_from_before_managed_deltas_is_told_to_export_again(
    run: Path, tmp_path: Path
) -> None:
    """A side file without ``managed`` (its remap recorded as dense tensors, as exports did)."""
    artifact = _export(run / "chain" / "base", "pt2", "fp32", tmp_path / "base")
    side = Path(f"{artifact}.json")
    info = json.loads(side.read_text())
    state = info["served_state"]
    for path, remap in state.pop("managed").items():
        for attr in fresh.REMAP_TENSORS:
            shape = [int(fresh._resolve(FreshModel(artifact).module, remap[attr]).shape[0])]
            state["dense"][f"{path}.{attr}"] = {
                "state": remap[attr],
                "shape": shape,
                "dtype": "torch.int64",
                "persistent": True,
            }
    old = tmp_path / "old"
    old.mkdir()
    shutil.copy(artifact, old / artifact.name)
    (old / side.name).write_text(json.dumps(info))
    served = FreshModel(old / artifact.name)
    with pytest.raises(DeltaRefusedError, match="exported before deltas of such models"):
        served.apply(run / "chain" / "delta-000001")
    assert served.sequence == 0
