"""Exit soak: launches a short 2-rank run many times and counts the launches that end badly.

Each launch runs this file as a worker under Lightning's own launcher (``strategy="torchrec"``,
2 CPU ranks, the user's way): fit a small DLRM for 12 steps, ``trainer.save_checkpoint``,
``trainer.predict``, save each rank's predictions. A launch is bad when the launcher's process
(rank 0) exits non-zero or by a signal, when any rank prints
``terminate called without an active exception`` (C++'s ``std::terminate`` for a
``std::thread`` destroyed while joinable: rank 1's exit status is not seen by the caller, its
stderr is), when a rank leaves a core file, or when a rank did not write its predictions.

``python -m benchmarks.exit_soak --launches 200`` (one launch at a time, about 8 s each on 2
cores). Not part of ``make test``. ``--workers N`` gives the loaders N DataLoader workers;
``--defaults`` keeps the Trainer's default logger, progress bar, checkpointing and summary;
``--keep-cores`` lets aborting ranks dump core (``ulimit -c unlimited``) into the launch folder.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import resource
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TERMINATE = "terminate called without an active exception"
STEPS = 12
#: What a script's module-level names would hold at its end: the trainer, model and data.
KEPT: dict[str, object] = {}


def worker(out: Path, workers: int, defaults: bool) -> None:
    """One launch's work, on every rank (Lightning re-runs this file for rank 1).

    ``defaults``: the Trainer's own logger (TensorBoard), progress bar, checkpointing and model
    summary, as a plain script has them; otherwise all four are off.
    """
    import lightning as L
    import torch

    from lightning_torchrec import DLRMClickModule, SyntheticClickData

    data = SyntheticClickData(
        num_embeddings=500,
        num_sparse_features=2,
        batch_size=32,
        train_batches=STEPS,
        val_batches=1,
        test_batches=2,
        num_workers=workers,
        seed=0,
    )
    model = DLRMClickModule(
        data.num_embeddings_per_feature,
        embedding_dim=8,
        dense_arch_layer_sizes=[8],
        over_arch_layer_sizes=[8, 1],
    )
    quiet = {
        "logger": False,
        "enable_checkpointing": False,
        "enable_progress_bar": False,
        "enable_model_summary": False,
    }
    trainer = L.Trainer(
        accelerator="cpu",
        devices=2,
        strategy="torchrec",
        max_steps=STEPS,
        limit_val_batches=0,
        num_sanity_val_steps=0,
        default_root_dir=out,
        **({} if defaults else quiet),  # type: ignore[arg-type]
    )
    trainer.fit(model, datamodule=data)
    trainer.save_checkpoint(out / "last.ckpt")
    preds = trainer.predict(model, datamodule=data)
    assert preds is not None
    torch.save(torch.cat(list(preds)), out / f"preds_rank{trainer.global_rank}.pt")  # type: ignore[arg-type]
    KEPT.update(trainer=trainer, model=model, data=data)  # alive until the interpreter's exit


def allow_cores() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def launch(
    out: Path, extra: list[str], keep_cores: bool, timeout: float, env: dict[str, str]
) -> dict[str, object]:
    """One launch; its outcome: ``rc``, ``signal``, ``terminate`` (lines), ``cores``, ``preds``."""
    start = time.perf_counter()
    command = [sys.executable, "-m", "benchmarks.exit_soak", "--worker", str(out)]
    with subprocess.Popen(
        [*command, *extra],
        cwd=Path(__file__).resolve().parent.parent,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
        preexec_fn=allow_cores if keep_cores else None,
    ) as popen:
        try:
            output, _ = popen.communicate(timeout=timeout)
            rc = popen.returncode
        except subprocess.TimeoutExpired:
            os.killpg(popen.pid, signal.SIGKILL)
            output, _ = popen.communicate()
            rc = "timeout"
    cores = sorted(p.name for p in out.glob("core*"))
    preds = len(list(out.glob("preds_rank*.pt")))
    return {
        "rc": rc,
        "signal": signal.Signals(-rc).name if isinstance(rc, int) and rc < 0 else None,
        "terminate": output.count(TERMINATE),
        "observer": len(re.findall(r"Child process with PID \d+ terminated with code", output)),
        "cores": cores,
        "preds": preds,
        "seconds": round(time.perf_counter() - start, 1),
        "tail": output[-3000:],
    }


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--workers", type=int, default=0, help="DataLoader workers per loader")
    p.add_argument("--defaults", action="store_true", help="the Trainer's logger, bar, ...")
    p.add_argument("--launches", type=int, default=60)
    p.add_argument("--timeout", type=float, default=180)
    p.add_argument("--keep-cores", action="store_true", help="ulimit -c unlimited for the ranks")
    p.add_argument("--keep-bad", type=Path, help="copy each bad launch's output here")
    args = p.parse_args()
    if args.worker is not None:
        worker(args.worker, args.workers, args.defaults)
        return
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "MASTER_"))}
    env["PYTHONUNBUFFERED"] = "1"
    counts: collections.Counter[str] = collections.Counter()
    root = Path(tempfile.mkdtemp(prefix="exit_soak_"))
    started = time.perf_counter()
    for i in range(args.launches):
        out = root / f"launch_{i}"
        out.mkdir()
        extra = ["--workers", str(args.workers)] + (["--defaults"] if args.defaults else [])
        r = launch(out, extra, args.keep_cores, args.timeout, env)
        bad = r["rc"] != 0 or r["terminate"] or r["observer"] or r["cores"] or r["preds"] != 2
        counts["launches"] += 1
        counts["bad"] += bool(bad)
        counts["aborts"] += bool(r["signal"] == "SIGABRT" or r["terminate"] or r["cores"])
        if r["signal"]:
            counts[f"rank0 {r['signal']}"] += 1
        if bad:
            outcome = {k: v for k, v in r.items() if k != "tail"}
            print(f"launch {i}: BAD {outcome}", flush=True)
            print(r["tail"], flush=True)
            if args.keep_bad:
                args.keep_bad.mkdir(parents=True, exist_ok=True)
                (args.keep_bad / f"launch_{i}.log").write_text(str(r["tail"]))
        else:
            for f in out.iterdir():  # keep the disk small: only bad launches keep their files
                if f.is_file():
                    f.unlink()
        if (i + 1) % 10 == 0:
            rate = (time.perf_counter() - started) / (i + 1)
            print(f"{i + 1} launches, {dict(counts)}, {rate:.1f} s/launch", flush=True)
    print(f"RESULT {dict(counts)} (folder {root})")


if __name__ == "__main__":
    main()
