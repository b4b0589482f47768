"""The strategy under torchrun: processes come from outside, Lightning only joins them."""

from __future__ import annotations

import subprocess
import sys

from tests.helpers import ROOT, SCRIPTS, clean_env, load_ranks


def test_trains_under_torchrun(tmp_path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            str(SCRIPTS / "torchrun_fit.py"),
            str(tmp_path),
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    ranks = load_ranks(tmp_path, "torchrun")
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["env"] == "TorchElasticEnvironment" and r["launched_by"]
        assert r["world"] == 2 and r["step"] == 4
    # One table-wise table per rank: the planner saw 2 local ranks, not TorchRec's default 8.
    assert sorted(ranks[0]["plan"]) == [("t_cat_0", [0]), ("t_cat_1", [1])] or sorted(
        ranks[0]["plan"]
    ) == [("t_cat_0", [1]), ("t_cat_1", [0])]
    assert ranks[0]["plan"] == ranks[1]["plan"]
