"""Online training end to end: a 2-rank stream fit publishes deltas, killed and resumed midway,
and a served model kept fresh by them equals a full export after every delta.

``tests/scripts/online_ranks.py`` trains 3 drifting partitions on 2 ranks (row-wise and
table-wise tables), publishing every 4 steps and at each partition's end, with a full checkpoint
after each delta; its first run stops at step 13 after a checkpoint at step 10 (a kill), its second
resumes from that checkpoint. The served side (``FreshModel``) starts from the export of the
chain's base and applies the chain: after each delta its table bytes and outputs equal those of
the full export of the same step (fp32 bit-equal; int8 equal to the re-quantized export).
Multi-process time: two 2-rank launches (~25 s).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from lightning_torchrec.checkpoint import chain_of
from lightning_torchrec.export.artifact import export
from lightning_torchrec.export.fresh import FreshModel
from tests.helpers import run_script
from tests.test_fresh import _batches, _logits, _table_bytes

sys.path.insert(0, str(Path(__file__).parent / "scripts"))
from online_ranks import clicks  # noqa: E402  (the script's generator, as the script sees it)

MODULE = "lightning_torchrec.DLRMClickModule"


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("online")
    generator = clicks()
    for t in range(3):
        generator.write(out / "stream", t, row_group_size=128)
    run_script("online_ranks.py", str(out), "first")
    first = sorted(p.name for p in (out / "deltas").glob("delta-*"))
    second = run_script("online_ranks.py", str(out), "second")
    (out / "first.json").write_text(json.dumps(first))
    (out / "second.log").write_text(second.stderr)
    return out


def test_the_chain_continues_across_the_kill(run: Path) -> None:
    # The killed run published at steps 4, 8, 12 and 13 (its epoch ended there); the resumed run
    # (from step 10) removes the deltas that followed its checkpoint and publishes from there.
    assert json.loads((run / "first.json").read_text()) == [f"delta-00000{i}" for i in (1, 2, 3, 4)]
    log = (run / "second.log").read_text()
    assert "delta-000003" in log and "delta-000004" in log
    steps = [json.loads((d / "delta.json").read_text())["step"] for d in chain_of(run / "deltas")]
    assert steps == [4, 8, 12, 16, 20, 24]
    partitions = [
        json.loads((d / "delta.json").read_text())["partition"] for d in chain_of(run / "deltas")
    ]
    assert partitions[1] == clicks().name(0) and partitions[-1] == clicks().name(2)


@pytest.mark.parametrize("dtype", ["fp32", "int8"])
def test_served_model_equals_the_full_export_after_every_delta(
    run: Path, dtype: str, tmp_path: Path
) -> None:
    base = export(run / "deltas" / "base", MODULE, tmp_path / f"base_{dtype}.pt2", dtype=dtype)
    served = FreshModel(base.path)
    batches = _batches()
    before = _logits(served, batches)
    for delta in chain_of(run / "deltas"):
        served.apply(delta)
        full = export(
            run / f"full-{served.step}",
            MODULE,
            tmp_path / f"{served.step}_{dtype}.pt2",
            dtype=dtype,
        )
        reference = FreshModel(full.path)
        got, want = _table_bytes(served), _table_bytes(reference)
        assert got.keys() == want.keys()
        for table in want:
            assert torch.equal(got[table], want[table]), (delta.name, table)
        assert torch.equal(_logits(served, batches), _logits(reference, batches)), delta.name
    assert not torch.equal(_logits(served, batches), before)  # the deltas changed the model
