"""On 2 gloo ranks: the OS's refusal of a write, and hostile checkpoints, agreed on every rank.

Issue 20 class 8 with real refusals: ``RLIMIT_FSIZE`` on one rank (``EFBIG``) and, as root, a
1 MiB tmpfs (``ENOSPC``); every rank raises ``CheckpointWriteError`` with the OS's errno, naming
the file and the rank, the previous checkpoint is kept and nothing partial is left. Then classes
1, 3, 5 and 6 on both ranks (``tests/scripts/stranger_ranks.py``).
"""

from __future__ import annotations

import errno
import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ROOT, SCRIPTS, clean_env

TMPFS_SKIP = "mounting a tmpfs was refused here (not root, or no CAP_SYS_ADMIN)"


@pytest.fixture(scope="module")
def tmpfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path | None]:
    mount = tmp_path_factory.mktemp("tmpfs")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True
    )
    yield mount if proc.returncode == 0 else None
    if proc.returncode == 0:
        subprocess.run(["umount", str(mount)], check=False)


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory, tmpfs: Path | None) -> Path:
    out = tmp_path_factory.mktemp("stranger_ranks")
    script = str(SCRIPTS / "stranger_ranks.py")
    procs = [
        subprocess.Popen(
            [sys.executable, script, str(rank), str(out), str(tmpfs or "")],
            cwd=ROOT,
            env=clean_env(),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for rank in (0, 1)
    ]
    try:
        logs = [p.communicate(timeout=300)[0] for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, log in zip(procs, logs, strict=True):
        assert p.returncode == 0, log[-6000:]
    return out


def phase(run: Path, name: str) -> list[dict[str, Any]]:
    return [json.loads((run / f"results_rank{r}.json").read_text())[name] for r in (0, 1)]


@pytest.mark.parametrize(
    ("name", "code", "file", "rank"),
    [
        ("efbig_param_groups", errno.EFBIG, "param_groups.rank1.pt", 1),
        ("efbig_meta", errno.EFBIG, "meta.pt", 0),
        ("enospc_param_groups", errno.ENOSPC, "param_groups.rank1.pt", 1),
        ("enospc_meta", errno.ENOSPC, "meta.pt", 0),
    ],
)
def test_a_refused_write_carries_the_os_errno_on_every_rank(
    run: Path, tmpfs: Path | None, name: str, code: int, file: str, rank: int
) -> None:
    if name.startswith("enospc") and tmpfs is None:
        pytest.skip(TMPFS_SKIP)
    for rec in phase(run, name):
        assert rec["error"] == "CheckpointWriteError", rec
        assert rec["errno"] == code, rec  # not None, not "basic_ios::clear"
        assert file in rec["message"] and f"rank {rank}" in rec["message"], rec
        assert "basic_ios" not in rec["message"]
        assert rec["same"] and rec["left"] == [], rec  # the previous checkpoint, nothing partial


@pytest.mark.parametrize(
    ("name", "error", "needle"),
    [
        ("leave", "UnsafeCheckpointError", "not a plain file name"),
        ("fifo", "UnsafeCheckpointError", "FIFO"),
        ("uncovered", "CheckpointCorruptError", "state_dict.2.weight"),
        ("build_class", "UnsafeCheckpointError", "sets the state of"),
    ],
)
def test_a_hostile_checkpoint_is_the_same_named_error_on_every_rank(
    run: Path, name: str, error: str, needle: str
) -> None:
    for rec in phase(run, name):
        assert rec["error"] == error and needle in rec["message"], rec
    assert all(r["same"] for r in phase(run, "classes_unchanged"))
