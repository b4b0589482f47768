"""``make demo-online`` at a small size: the fresh served model beats the stale one.

The demo (``python -m lightning_torchrec.demo_online``) runs a writer of drifting partitions, a
2-rank trainer publishing a delta per partition, the export of the chain's base and a server
process that cannot import the package. After each delta the server scores the next partition
with the fresh model and with a stale copy that took only the first delta: from the second delta
on, the fresh one must score it better (a lower NE), and always exactly as the trainer's progressive
evaluation did (the served model is the trained one).
Multi-process time: one 2-rank launch and a server (~40 s).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, clean_env


def test_fresh_served_model_beats_the_stale_one_on_the_drifting_stream(tmp_path: Path) -> None:
    args = ["--partitions", "4", "--rows", "2048", "--num-embeddings", "5000", "--interval", "0.5"]
    proc = subprocess.run(
        [sys.executable, "-m", "lightning_torchrec.demo_online", "--workdir", str(tmp_path), *args],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    served = json.loads((tmp_path / "served.json").read_text())
    trained = json.loads((tmp_path / "train.json").read_text())
    assert [r["delta"] for r in served] == [f"delta-00000{i}" for i in (1, 2, 3, 4)]
    scored = [r for r in served if "fresh_ne" in r]
    assert len(scored) == 3  # the last partition has no next one to score
    progressive = {r["partition"]: r["ne"] for r in trained["progressive"]}
    assert scored[0]["fresh_ne"] == scored[0]["stale_ne"]  # both after partition 0
    for record in scored[1:]:
        assert record["fresh_ne"] < record["stale_ne"], record
    for record in scored:
        assert abs(record["fresh_ne"] - progressive[record["next"]]) < 1e-4, record
    assert "| delta-000004 |" in proc.stdout
