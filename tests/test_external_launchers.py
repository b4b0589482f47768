"""The strategy in processes started outside Lightning: torchrun, and SLURM's srun (simulated).

Lightning only joins such processes; the planner must still see the real local world size.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

from tests.helpers import ROOT, SCRIPTS, clean_env, load_ranks

SCRIPT = str(SCRIPTS / "external_launch_fit.py")


def _check(out: Path, environment: str) -> None:
    ranks = load_ranks(out, "run")
    assert [r["rank"] for r in ranks] == [0, 1]
    for r in ranks:
        assert r["env"] == environment
        assert r["world"] == 2 and r["step"] == 4
    # One table-wise table per rank: the planner saw 2 local ranks, not TorchRec's default 8.
    assert sorted(owner for _, (owner,) in ranks[0]["plan"]) == [0, 1]
    assert ranks[0]["plan"] == ranks[1]["plan"]


def test_trains_under_torchrun(tmp_path: Path) -> None:
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            SCRIPT,
            str(tmp_path),
        ],
        cwd=ROOT,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    _check(tmp_path, "TorchElasticEnvironment")
    assert all(r["launched_by"] for r in load_ranks(tmp_path, "run"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_trains_under_slurm_srun(tmp_path: Path) -> None:
    """The variables srun sets for 2 tasks on one node; each task is started by hand."""
    tasks, port = 2, str(_free_port())
    procs = []
    for rank in range(tasks):
        env = clean_env(
            SLURM_NTASKS=str(tasks),
            SLURM_NTASKS_PER_NODE=str(tasks),
            SLURM_NNODES="1",
            SLURM_NODEID="0",
            SLURM_PROCID=str(rank),
            SLURM_LOCALID=str(rank),
            SLURM_JOB_ID="4242",
            SLURM_JOB_NAME="recsys",
            SLURM_NODELIST="127.0.0.1",
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, SCRIPT, str(tmp_path)],
                cwd=ROOT,
                env=env,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    errors = [p.communicate(timeout=300)[1] for p in procs]
    assert all(p.returncode == 0 for p in procs), errors[0][-4000:] + errors[1][-4000:]
    _check(tmp_path, "SLURMEnvironment")
