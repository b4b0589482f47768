"""Shared helpers for tests that launch real processes or need a process group."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist

from lightning_torchrec.compat.upstream_warnings import UPSTREAM_LOG_RECORDS

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = Path(__file__).resolve().parent / "scripts"
_DIST_VARS = (
    "MASTER_ADDR",
    "MASTER_PORT",
    "RANK",
    "LOCAL_RANK",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "NODE_RANK",
    "GROUP_RANK",
    "TORCHELASTIC_RUN_ID",
    "SLURM_NTASKS",
    "SLURM_JOB_ID",
)


def clean_env(**extra: str) -> dict[str, str]:
    """The test process's environment without distributed variables an earlier test set."""
    env = {k: v for k, v in os.environ.items() if k not in _DIST_VARS and not k.startswith("PL_")}
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra)
    return env


#: What a warning looks like on stderr: Python's (``file.py:12: UserWarning: ...``, Lightning's
#: ``file.py:12: message``), a logging record at WARNING (``WARNING:name:``, glog-style ``W1123``
#: from torch) or any line naming a warning.
_WARNING_LINE = re.compile(r"\.py:\d+: |^WARNING[: ]|^W\d{4} |Warning", re.MULTILINE)


def warning_lines(stderr: str) -> list[str]:
    """The lines of a process's stderr that are warnings.

    Args:
        stderr: the captured stderr.

    Returns:
        The warning lines (empty when the process printed none).
    """
    return [line for line in stderr.splitlines() if _WARNING_LINE.search(line)]


def bad_id_requests(batch: Any, cases: list[tuple[str, int, int]]) -> list[tuple[dict, tuple]]:
    """Served requests made of ``batch``, each with one id put outside its table.

    Args:
        batch: a batch with ``dense_features`` and a KJT of ``cat_{i}`` features.
        cases: ``(feature, id, sample)``: the sample's first id of that feature becomes ``id``
            (the sample must have one).

    Returns:
        ``(request, case)`` pairs; a request holds ``dense``, ``values`` and ``lengths``.
    """
    kjt = batch.sparse_features
    size = batch.dense_features.shape[0]
    offsets = torch.cumsum(kjt.lengths(), 0) - kjt.lengths()
    requests = []
    for feature, value, sample in cases:
        bag = int(feature[-1]) * size + sample
        assert kjt.lengths()[bag] > 0
        values = kjt.values().clone()
        values[offsets[bag]] = value
        plain = {"dense": batch.dense_features, "values": values, "lengths": kjt.lengths()}
        requests.append((plain, (feature, value, sample)))
    return requests


#: Lines the oldest supported stack (torch 2.11, fbgemm 1.6) prints in a bare serving process,
#: which no code of the package runs in: fbgemm's import logs its missing compatibility entry on
#: the root logger (a bare ``WARNING:root:`` line, its text on the next lines), and torch 2.11's
#: ``.pt2`` loader warns for each of the archive's tensors it wraps without a copy and for each
#: empty one (later torch loads them silently).
OLDER_STACK_LINES = [
    "WARNING:root:",
    "The given buffer is not writable",
    "Cannot call torch.frombuffer() on empty bytes",
]


def serve_bare(
    tmp: Path, inputs: dict, artifacts: list[Path], script: str = "export_serve.py"
) -> dict:
    """Serves exported ``artifacts`` on ``inputs`` in a process that cannot import the package.

    ``tests/scripts/{script}`` (``export_serve.py``; ``fresh_serve.py``: with deltas) runs in
    ``tmp``; the process must exit 0, import none of
    the training code, unpickle nothing, and log no warning but torch's one line when the first
    KeyedJaggedTensor is built (TorchRec's KJT asks ``is_fx_tracing()``;
    ``compat.upstream_warnings.UPSTREAM_LOG_RECORDS``), which docs/export.md shows.

    Args:
        tmp: the working folder.
        inputs: what the script reads (``bad``, ``keys``, ``batches``, ...).
        artifacts: the artifacts to serve.
        script: the serving script.

    Returns:
        The script's predictions.
    """
    torch.save(inputs, tmp / "inputs.pt")
    command = [sys.executable, str(SCRIPTS / script), str(tmp / "inputs.pt")]
    proc = subprocess.run(
        [*command, str(tmp / "preds.pt"), *map(str, artifacts)],
        cwd=tmp,
        env=clean_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-6000:]
    assert "modules: []" in proc.stdout, proc.stdout  # not even Lightning was imported
    assert "weights_only=False" not in proc.stderr, proc.stderr[-3000:]  # nothing unpickled
    upstream = [start for _, start, _ in UPSTREAM_LOG_RECORDS] + OLDER_STACK_LINES
    unexpected = [x for x in warning_lines(proc.stderr) if not any(s in x for s in upstream)]
    assert unexpected == [], proc.stderr[-3000:]
    return torch.load(tmp / "preds.pt", weights_only=True)


def run_script(
    name: str, *args: str, timeout: float = 300, **env: str
) -> subprocess.CompletedProcess:
    """Runs ``tests/scripts/{name}`` (Lightning relaunches it per rank); fails with its output.

    The script runs in a session of its own: at the timeout every process of it is killed, a
    stuck DataLoader worker too (which would otherwise hold the output pipes open forever).
    """
    with subprocess.Popen(
        [sys.executable, str(SCRIPTS / name), *args],
        cwd=ROOT,
        env=clean_env(**env),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    ) as popen:
        try:
            stdout, stderr = popen.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            stdout, stderr = popen.communicate()
            raise AssertionError(
                f"{name} did not finish within {timeout} s\n--- stdout ---\n{stdout[-4000:]}"
                f"\n--- stderr ---\n{stderr[-8000:]}"
            ) from None
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(popen.pid, signal.SIGKILL)  # nothing of the script outlives it
    proc = subprocess.CompletedProcess(popen.args, popen.returncode, stdout, stderr)
    if proc.returncode != 0:
        raise AssertionError(
            f"{name} exited {proc.returncode}\n--- stdout ---\n{proc.stdout[-4000:]}"
            f"\n--- stderr ---\n{proc.stderr[-8000:]}"
        )
    return proc


def load_ranks(out: Path, name: str, world: int = 2) -> list:
    return [torch.load(out / f"{name}_rank{r}.pt", weights_only=False) for r in range(world)]


def assert_same(a, b, path: str = "") -> None:
    """Recursively equal: tensors bit for bit, lists/dicts by key."""
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor), path
        assert a.shape == b.shape and torch.equal(a, b), f"{path} differs"
    elif isinstance(a, dict):
        assert set(a) == set(b), f"{path}: keys {sorted(set(a) ^ set(b))}"
        for k in a:
            assert_same(a[k], b[k], f"{path}/{k}")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), path
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a} != {b}"


@pytest.fixture
def one_rank_group(tmp_path: Path) -> Iterator[None]:
    """A one-rank gloo default process group for one test, destroyed after it.

    Use with ``@pytest.mark.usefixtures("one_rank_group")`` after importing it into the test file.
    """
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        yield
    finally:
        dist.destroy_process_group()
