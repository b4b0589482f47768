"""Norm callbacks on 2 real ranks: what the loggers received equals the exact norms."""

from __future__ import annotations

import csv
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from tests.helpers import run_script


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("norm_callbacks")
    run_script("norm_callbacks.py", str(out))
    return out


def _tensorboard_scalars(out: Path) -> dict[str, dict[int, float]]:
    (run_dir,) = (out / "tb").iterdir()
    ea = EventAccumulator(str(run_dir), size_guidance={"scalars": 0})
    ea.Reload()
    return {t: {e.step: e.value for e in ea.Scalars(t)} for t in ea.Tags()["scalars"]}


def test_plan_mixes_sharding_types(run: Path) -> None:
    plan = torch.load(run / "expected.pt", weights_only=False)["plan"]
    assert plan["t_cat_0"][0] == plan["t_cat_1"][0] == "table_wise"
    assert {plan["t_cat_0"][1][0], plan["t_cat_1"][1][0]} == {0, 1}, "one table-wise table per rank"
    assert plan["t_cat_2"] == ("column_wise", [0, 1]), "column shards on both ranks"
    assert plan["t_cat_3"][0] == "data_parallel"


def test_the_model_summary_counts_every_table_whole_on_every_rank(run: Path) -> None:
    # It counted each rank's own shards: a table-wise table on the other rank as 0.
    for name in ("expected.pt", "expected.rank1.pt"):
        saved = torch.load(run / name, weights_only=False)
        summary, unsharded = saved["summary"], saved["unsharded"]
        assert summary["total"] == unsharded[""]
        layers = [k for k in summary if k != "total"]
        assert layers and all(summary[k] == unsharded[k] for k in layers), name


def test_tensorboard_scalars_equal_exact_norms_of_the_full_tables(run: Path) -> None:
    saved = torch.load(run / "expected.pt", weights_only=False)
    scalars = _tensorboard_scalars(run)
    step = saved["step"]
    for tag, value in saved["expected"].items():
        assert tag in scalars, f"{tag} not logged"
        assert sorted(scalars[tag]) == [5, 10], f"{tag} logged at {sorted(scalars[tag])}"
        assert scalars[tag][step] == pytest.approx(value, rel=1e-5), tag


def test_per_rank_embedding_norms_and_sentinels(run: Path) -> None:
    plan = torch.load(run / "expected.pt", weights_only=False)["plan"]
    scalars = _tensorboard_scalars(run)
    for table in ("t_cat_0", "t_cat_1"):
        owner = plan[table][1][0]
        assert scalars[f"embedding_norms/{table}-norm-{1 - owner}"][10] == -1.0
        assert scalars[f"embedding_norms/{table}-norm-{owner}"][10] == pytest.approx(
            scalars[f"embedding_norms/{table}-norm-mean"][10], rel=1e-5
        )
    for table in ("t_cat_2", "t_cat_3"):  # column-wise and data-parallel
        for rank in range(2):
            value = scalars[f"embedding_norms/{table}-norm-{rank}"][10]
            assert value > 0 if rank in plan[table][1] else value == -1.0, (table, rank)
    # Column-wise: each rank reports row norms over its own columns; the mean is over whole
    # rows (checked exactly against the full table above), so it exceeds every partial value.
    cw = [scalars[f"embedding_norms/t_cat_2-norm-{r}"][10] for r in range(2)]
    assert scalars["embedding_norms/t_cat_2-norm-mean"][10] > max(cw)
    # Data-parallel: both ranks hold the same rows, so they report the same value (counted once).
    dp = [scalars[f"embedding_norms/t_cat_3-norm-{r}"][10] for r in range(2)]
    assert dp[0] == dp[1] == pytest.approx(scalars["embedding_norms/t_cat_3-norm-mean"][10])


def test_every_logger_receives_the_norms(run: Path) -> None:
    (version,) = (run / "csv").iterdir()
    with open(version / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    tb = _tensorboard_scalars(run)
    norm_cols = [c for c in rows[0] if c.startswith(("model/", "embedding_norms/"))]
    assert set(norm_cols) == {t for t in tb if t.startswith(("model/", "embedding_norms/"))}
    last = [r for r in rows if r["step"] == "10" and r[norm_cols[0]]]
    assert last and float(last[0][norm_cols[0]]) == pytest.approx(tb[norm_cols[0]][10], rel=1e-6)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_tensorboard_server_serves_the_norm_tags(run: Path) -> None:
    port = _free_port()
    server = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tensorboard.main",
            "--logdir",
            str(run / "tb"),
            "--host",
            "127.0.0.1",
            "--port",
            str(port),
            "--load_fast",
            "false",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        url = f"http://127.0.0.1:{port}/data/plugin/scalars/tags"
        deadline, body = time.monotonic() + 90, ""
        while time.monotonic() < deadline:
            try:
                body = urllib.request.urlopen(url, timeout=5).read().decode()
                if "embedding_norms" in body:
                    break
            except OSError:
                pass
            time.sleep(1)
        assert "embedding_norms/t_cat_0-norm-mean" in body
        assert "model/l2_norm/" in body
    finally:
        server.terminate()
        server.wait(timeout=30)
