"""A seeded fuzz of a real checkpoint (``tests/scripts/checkpoint_fuzz.py``), in one subprocess.

A few hundred mutations of ``.metadata``, ``meta.pt``, ``checksums.json`` and the chunk file;
every load must end in a correct load or a named error: never a hang, a raw exception, a
changed class, a command run, a file outside the folder touched, or memory growing with what a
file claims (peak RSS measured). The report (counts, outcomes, peak RSS) is printed.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, SCRIPTS, clean_env

COUNT, SEED = 300, 20


def test_fuzzed_checkpoints_load_correctly_or_fail_by_name(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPTS / "checkpoint_fuzz.py"), str(tmp_path), str(COUNT), str(SEED)],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=400,  # a hang inside is caught per case (20 s); this bounds the interpreter too
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    report = json.loads((tmp_path / "fuzz.json").read_text())
    print(json.dumps(report, indent=1))
    assert report["problems"] == [], report["problems"]
    assert sum(sum(v.values()) for v in report["outcomes"].values()) == COUNT
    named = {"CheckpointCorruptError", "UnsafeCheckpointError", "CheckpointLimitError"}
    named |= {"CheckpointMismatchError", "FileNotFoundError", "loaded", "loaded (restamped)"}
    assert {r for v in report["outcomes"].values() for r in v} <= named
    assert report["rss_growth_mb"] < 300, report  # a 64 MiB zip bomb, 2 GiB allocations...
