"""Online training demo: a drifting stream trained on 2 CPU ranks, a served model kept fresh.

``python -m lightning_torchrec.demo_online`` (what ``make demo-online`` does) runs four things at
once in a work folder:

1. a *writer* (a thread of this process) that publishes hourly click partitions whose click rule
   drifts (:class:`~lightning_torchrec.data.drifting.DriftingClicks`), one every ``--interval``
   seconds;
2. the *trainer* (``python -m lightning_torchrec.demo_online train``: a plain ``Trainer`` with
   ``strategy="torchrec"`` on ``--devices`` CPU ranks) that trains the stream partition by
   partition (:class:`~lightning_torchrec.data.PartitionStreamData`), evaluates each partition
   before training on it (:class:`~lightning_torchrec.lightning.ProgressiveEvaluation`) and
   publishes a delta at each partition's end
   (:class:`~lightning_torchrec.lightning.DeltaPublisher`); the stream is the list of the
   ``--partitions`` the writer will publish, each waited for, and the fit ends after the last;
3. an *export* of the chain's base checkpoint (``lightning_torchrec.export``), done here;
4. a *server* (a process that cannot import ``lightning_torchrec``: it loads
   ``lightning_torchrec/export/fresh.py`` by its path, with ``torch`` and ``torchrec``) that
   applies each delta as it appears and, after each, scores the next partition with the fresh
   model and with a stale copy that took the first delta (partition 0) and no other.

It prints, per partition: the trainer's progressive NE, the fresh and the stale served model's NE
on the same rows, the delta's size against the full checkpoint's, the publish time and the
freshness (from the delta written, right after its last trained step, to the served model
answering with it). See ``docs/online.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import lightning as L
from lightning.pytorch.loggers import TensorBoardLogger

from lightning_torchrec.data import PartitionStreamData
from lightning_torchrec.data.drifting import DriftingClicks
from lightning_torchrec.export import export
from lightning_torchrec.export import fresh as fresh_module
from lightning_torchrec.lightning import DeltaPublisher, ProgressiveEvaluation
from lightning_torchrec.lightning.dlrm import DLRMClickModule

#: The served side: run with ``python -c`` in a process where ``lightning_torchrec`` cannot be
#: imported. argv: fresh.py, artifact, deltas folder, stream folder, results file, done file.
SERVER = r"""
import importlib.util, json, sys, time
from pathlib import Path
sys.modules["lightning_torchrec"] = None  # the served side must not need the training package
import pyarrow.parquet as pq, torch, torchrec
from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

fresh_py, artifact, deltas, stream, results, done = sys.argv[1:]
spec = importlib.util.spec_from_file_location("fresh", fresh_py)
fresh = importlib.util.module_from_spec(spec)
spec.loader.exec_module(fresh)
info = json.loads(Path(artifact + ".json").read_text())
features = info["features"]

def rows_of(partition):
    table = pq.read_table(partition)
    dense = torch.stack([torch.from_numpy(table.column(c).to_numpy()) for c in
                         [c for c in table.column_names if c.startswith("d")]], 1).float()
    ids = [torch.from_numpy(table.column(f"c{i}").to_numpy()) for i in range(len(features))]
    labels = torch.from_numpy(table.column("label").to_numpy()).float()
    lengths = torch.ones(len(ids) * len(labels), dtype=torch.int32)
    kjt = KeyedJaggedTensor.from_lengths_sync(keys=features, values=torch.cat(ids), lengths=lengths)
    return dense, kjt, labels

def ne(model, rows):
    dense, kjt, labels = rows
    with torch.no_grad():
        logits = model(dense, kjt).reshape(-1).float()
    loss = torch.nn.functional.binary_cross_entropy_with_logits(logits, labels)
    p = labels.mean().clamp(1e-6, 1 - 1e-6)
    return float(loss / -(p * p.log() + (1 - p) * (1 - p).log()))

served = fresh.FreshModel(artifact)
stale = fresh.FreshModel(artifact)  # takes the first delta (partition 0), then no other
records = []
Path(results).write_text("[]")  # ready: the writer goes on publishing partitions
while True:
    finished = Path(done).exists()
    for delta in served.apply_pending(deltas):
        applied = time.time()
        if stale.sequence == 0:
            stale.apply(Path(deltas) / delta.name)
        meta = json.loads((Path(deltas) / delta.name / "delta.json").read_text())
        record = {"delta": delta.name, "partition": meta.get("partition"), "step": delta.step,
                  "written": meta["written"], "freshness_s": applied - meta["written"]}
        names = sorted(p.name for p in Path(stream).iterdir() if (p / "_SUCCESS").exists())
        if record["partition"] in names and names.index(record["partition"]) + 1 < len(names):
            nxt = names[names.index(record["partition"]) + 1]
            rows = rows_of(Path(stream) / nxt)
            record |= {"next": nxt, "fresh_ne": ne(served, rows), "stale_ne": ne(stale, rows)}
        records.append(record)
        Path(results).write_text(json.dumps(records))
    if finished:
        break
    time.sleep(0.1)
Path(results).write_text(json.dumps(records))
"""


def _train(args: argparse.Namespace) -> None:
    """The trainer job (every rank runs it; Lightning's launcher starts the other ranks)."""
    work = Path(args.workdir)
    clicks = _clicks(args)
    L.seed_everything(0, verbose=False)
    # The partitions the writer will publish, in order: each is waited for (up to the timeout),
    # and the stream ends right after the last. A directory as the source would take whatever
    # appears, and end after a partition-less wait of the timeout.
    data = PartitionStreamData(
        [work / "stream" / clicks.name(t) for t in range(args.partitions)],
        clicks.dense_columns,
        clicks.sparse_columns,
        "label",
        batch_size=args.batch_size,
        feature_names=[f"cat_{i}" for i in range(clicks.num_sparse_features)],
        num_embeddings_per_feature=[clicks.num_embeddings] * clicks.num_sparse_features,
        poll_seconds=0.1,
        timeout_seconds=args.timeout,
    )
    model = DLRMClickModule(
        [clicks.num_embeddings] * clicks.num_sparse_features,
        num_dense_features=clicks.num_dense_features,
        embedding_dim=16,
    )
    progressive = ProgressiveEvaluation()
    publisher = DeltaPublisher(work / "deltas", at_partition_end=True)
    trainer = L.Trainer(
        accelerator="cpu",
        devices=args.devices,
        strategy="torchrec",
        max_epochs=-1,
        num_sanity_val_steps=-1,  # partition 0 is scored before any training too
        logger=TensorBoardLogger(work / "logs", name="online"),
        callbacks=[progressive, publisher],
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        log_every_n_steps=8,
    )
    trainer.fit(model, datamodule=data)
    if trainer.is_global_zero:
        out = {"progressive": progressive.history, "ended": data.ended}
        out["publish_s"] = publisher.publish_seconds
        (work / "train.json").write_text(json.dumps(out))


def _clicks(args: argparse.Namespace) -> DriftingClicks:
    return DriftingClicks(
        num_embeddings=args.num_embeddings, rows_per_partition=args.rows, seed=args.seed
    )


def _write_stream(args: argparse.Namespace, stop: threading.Event, ready: threading.Event) -> None:
    """Partitions 0 and 1 at once, the rest one per interval once the server is up."""
    clicks, stream = _clicks(args), Path(args.workdir) / "stream"
    for t in range(args.partitions):
        if t == 2:
            ready.wait()
        clicks.write(stream, t)
        if t >= 1 and stop.wait(args.interval):
            return


def _folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.rglob("*") if f.is_file())


def _wait_for(path: Path, what: str, process: subprocess.Popen[bytes], limit: float) -> None:
    deadline = time.monotonic() + limit
    while not path.exists():
        if process.poll() is not None:
            raise SystemExit(f"a process exited ({process.returncode}) before the {what}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no {what} after {limit:.0f} s")
        time.sleep(0.1)


def _report(
    work: Path, served: list[dict[str, Any]], trained: dict[str, Any], server_up: float
) -> str:
    deltas = work / "deltas"
    full = _folder_bytes(deltas / "base")
    by_partition = {r["partition"]: r for r in trained["progressive"]}
    publish = trained.get("publish_s") or []
    lines = [
        f"full checkpoint: {full / 1e6:.2f} MB ({deltas / 'base'})",
        "",
        "| delta | trained on | scored on | trainer NE | served fresh NE | served stale NE "
        "| delta MB | of full | publish s | freshness s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, record in enumerate(served):
        size = _folder_bytes(deltas / record["delta"])
        nxt = record.get("next")
        trainer_ne = by_partition.get(nxt, {}).get("ne")
        cells = [
            record["delta"],
            str(record["partition"]),
            str(nxt or "-"),
            f"{trainer_ne:.4f}" if trainer_ne is not None else "-",
            f"{record['fresh_ne']:.4f}" if "fresh_ne" in record else "-",
            f"{record['stale_ne']:.4f}" if "stale_ne" in record else "-",
            f"{size / 1e6:.3f}",
            f"{100 * size / full:.1f}%",
            f"{publish[i]:.2f}" if i < len(publish) else "-",
            f"{record['freshness_s']:.2f}"
            if record["written"] >= server_up
            else "(before the server)",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    lines.append(f"stream: {trained.get('ended')}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict[str, Any] | None:
    """Runs the demo (or, with ``train``, the trainer job it starts).

    Args:
        argv: command-line arguments (default: ``sys.argv[1:]``).

    Returns:
        The demo's figures: ``{"served": [...], "trained": {...}}`` (one record per delta as
        the server applied it; the trainer's progressive metrics); None for ``train``.

    Raises:
        SystemExit: when the trainer or the server fails.
    """
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("command", nargs="?", default="run", choices=["run", "train"])
    parser.add_argument("--workdir", type=Path, help="default: a new temporary folder")
    parser.add_argument("--partitions", type=int, default=8)
    parser.add_argument("--rows", type=int, default=4096, help="samples per partition")
    parser.add_argument("--num-embeddings", type=int, default=50_000)
    parser.add_argument("--interval", type=float, default=3.0, help="seconds between partitions")
    parser.add_argument(
        "--timeout", type=float, default=120.0, help="longest wait for a partition (seconds)"
    )
    parser.add_argument("--batch-size", type=int, default=128, help="per rank")
    parser.add_argument("--devices", type=int, default=2)
    parser.add_argument("--dtype", default="fp32", choices=["fp32", "fp16", "int8", "int4"])
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.command == "train":
        _train(args)
        return None
    work = args.workdir or Path(tempfile.mkdtemp(prefix="online_demo_"))
    work.mkdir(parents=True, exist_ok=True)
    args.workdir = work
    stop, ready = threading.Event(), threading.Event()
    writer = threading.Thread(target=_write_stream, args=(args, stop, ready), daemon=True)
    writer.start()
    forwarded = [f"--{k.replace('_', '-')}={v}" for k, v in vars(args).items() if k != "command"]
    trainer = subprocess.Popen(
        [sys.executable, "-m", "lightning_torchrec.demo_online", "train"] + forwarded
    )
    server = None
    try:
        _wait_for(work / "deltas" / "base" / "checksums.json", "base checkpoint", trainer, 300)
        artifact = work / f"served_{args.dtype}.pt2"
        export(
            work / "deltas" / "base",
            "lightning_torchrec.DLRMClickModule",
            artifact,
            dtype=args.dtype,
        )
        results, done = work / "served.json", work / "train.json"
        env = os.environ | {"PYTHONPATH": ""}
        server = subprocess.Popen(
            [
                sys.executable,
                "-c",
                SERVER,
                fresh_module.__file__,
                str(artifact),
                str(work / "deltas"),
                str(work / "stream"),
                str(results),
                str(done),
            ],
            env=env,
        )
        _wait_for(results, "server", server, 120)
        server_up = time.time()
        ready.set()
        if trainer.wait() != 0:
            raise SystemExit(f"the trainer failed (exit {trainer.returncode})")
        if server.wait(timeout=120) != 0:
            raise SystemExit(f"the server failed (exit {server.returncode})")
    finally:
        stop.set()
        ready.set()
        for process in (trainer, server):
            if process is not None and process.poll() is None:
                process.kill()
    served, trained = json.loads(results.read_text()), json.loads(done.read_text())
    print(_report(work, served, trained, server_up))
    print(f"\nwork folder: {work} (TensorBoard: tensorboard --logdir {work / 'logs'})")
    return {"served": served, "trained": trained}


if __name__ == "__main__":
    main()
