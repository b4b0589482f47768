"""Jobs under torchrun as on a cluster: elastic restarts that resume exactly, and two nodes.

Each test starts real torchrun agents with c10d rendezvous on this host.
"""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import torch

from lightning_torchrec import DLRMClickModule, load_unsharded
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


def _full_tables(ranks: list[dict]) -> dict[str, torch.Tensor]:
    """Every table, put together from the ranks' shards."""
    parts: dict[str, list] = {}
    for r in ranks:
        for key, value in r["model"].items():
            if isinstance(value, list):
                parts.setdefault(key, []).extend(value)
    tables = {}
    for key, shards in parts.items():
        rows = max(o[0] + t.shape[0] for o, t in shards)
        cols = max(o[1] + t.shape[1] for o, t in shards)
        full = torch.full((rows, cols), float("nan"))
        for (r0, c0), t in shards:
            full[r0 : r0 + t.shape[0], c0 : c0 + t.shape[1]] = t
        tables[key] = full
    return tables


def test_two_nodes_train_and_their_checkpoint_resumes_on_one(tmp_path: Path) -> None:
    """Two agents of 2 ranks (``Trainer(num_nodes=2, devices=2)``), then one agent of 2 ranks."""
    port = _free_port()
    out = str(tmp_path)
    agents = [
        torchrun("two_nodes_fit.py", out, "train", nnodes=2, node_rank=n, port=port) for n in (0, 1)
    ]
    for agent in agents:
        _finish(agent)
    _finish(torchrun("two_nodes_fit.py", out, "resume"))
    train = load_ranks(tmp_path, "train", world=4)
    assert [r["ranks"] for r in train] == [(0, 0, 0), (1, 1, 0), (2, 0, 1), (3, 1, 1)]
    for r in train:
        assert r["world"] == 4 and r["step"] == 4 and r["nodes"] == 2
        assert r["owners"] == train[0]["owners"]
    # One table per rank: the planner saw 2 ranks per node, both nodes hold tables.
    assert sorted(rank for (rank,) in train[0]["owners"].values()) == [0, 1, 2, 3]
    assert "| rank | node | table bytes |" in train[0]["plan"]
    assert "| 3 | 1 | " in train[0]["plan"]
    tables = _full_tables(train)
    assert len(tables) == 4
    four = load_unsharded(tmp_path / "four.ckpt", DLRMClickModule).state_dict()
    resumed = load_unsharded(tmp_path / "resumed.ckpt", DLRMClickModule).state_dict()
    for key, table in tables.items():
        assert torch.equal(four[key], table), key  # one process reads the 4 ranks' tables
        assert torch.equal(resumed[key], table), key  # 2 ranks resumed with them
    for r in load_ranks(tmp_path, "resume"):
        assert r["world"] == 2 and r["nodes"] == 1 and r["step"] == 6
