"""Jobs under torchrun as on a cluster: elastic restarts that resume exactly, and two nodes.

Each test starts real torchrun agents with c10d rendezvous on this host.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

from tests.helpers import ROOT, SCRIPTS, assert_same, clean_env, load_ranks

#: The script's ``peer_timeout``, in seconds.
PEER_TIMEOUT = 3


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun(
    script: str,
    *args: str,
    nnodes: int = 1,
    node_rank: int = 0,
    port: int = 0,
    max_restarts: int = 0,
) -> subprocess.Popen:
    """One torchrun agent of 2 processes, c10d rendezvous on localhost (a fresh port by default)."""
    return subprocess.Popen(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nnodes={nnodes}",
            "--nproc-per-node=2",
            f"--node-rank={node_rank}",
            f"--max-restarts={max_restarts}",
            "--rdzv-backend=c10d",
            f"--rdzv-endpoint=localhost:{port or _free_port()}",
            str(SCRIPTS / script),
            *args,
        ],
        cwd=ROOT,
        env=clean_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )


def _finish(proc: subprocess.Popen, timeout: float = 240) -> str:
    out = proc.communicate(timeout=timeout)[0]
    assert proc.returncode == 0, out[-8000:]
    return out


def test_restarted_job_resumes_bit_equal_after_a_hang_and_a_kill(tmp_path: Path) -> None:
    """A hanging rank stops its peer within ``peer_timeout``; each restart forms its group."""
    faults = torchrun("elastic_fit.py", str(tmp_path), "faults", max_restarts=2)
    reference = torchrun("elastic_fit.py", str(tmp_path), "reference")
    log = _finish(faults)
    _finish(reference)
    hang = torch.load(tmp_path / "faults_hang.pt")
    assert hang["error"] == "PeerFailureError"
    assert hang["waited"] < PEER_TIMEOUT + 10  # not the 30-minute timeout
    assert "terminate called" not in log
    for resumed, uninterrupted in zip(
        load_ranks(tmp_path, "faults"), load_ranks(tmp_path, "reference"), strict=True
    ):
        assert resumed["attempt"] == 2 and resumed["resumed_from"] == "last.ckpt"
        assert resumed["global_step"] == uninterrupted["global_step"] == 16
        # The last attempt resumed after step 9 (mid second epoch) and trained 10 to 16.
        assert sorted(resumed["losses"]) == list(range(10, 17))
        for step, loss in resumed["losses"].items():
            assert torch.equal(loss, uninterrupted["losses"][step]), step
        assert_same(resumed["model"], uninterrupted["model"])
        assert_same(resumed["optimizer"], uninterrupted["optimizer"])
