"""Quantized inference export: artifact size, CPU latency, export time and peak memory.

A DLRM with ``--tables`` tables of ``--rows`` x ``--dim`` (fp32) trains one step on one rank
(``TorchRecStrategy``) and is saved as a sharded checkpoint. Then, each in a fresh subprocess:

- ``export``: one export per dtype (int8, int4, fp16, fp32; pt2, and int8 also TorchScript):
  export seconds and peak RSS of the export (``VmHWM`` after resetting it, minus ``VmRSS``
  before), against the bytes of the float tables and of the largest table;
- the float reference: ``load_unsharded`` (the whole float model) with the same measurement;
- ``latency``: the float unsharded model and every artifact, loaded side by side, predicting
  the same batches of 512 in interleaved rounds; median per batch and ratio to float.

Writes ``benchmarks/results/export_cost.json`` and prints the Markdown table of
``docs/export.md``. Run: ``python -m benchmarks.export_cost [--rows 1000000 --tables 4]``;
``--quick`` for a smoke run.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.common import ROOT, stats, write_result

DTYPES = ["fp32", "fp16", "int8", "int4"]
MODULE = "lightning_torchrec.DLRMClickModule"
BATCH = 512


def _status(field: str) -> int:
    """A ``/proc/self/status`` field in bytes."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def _data(args: argparse.Namespace, batches: int) -> Any:
    from lightning_torchrec import SyntheticClickData

    return SyntheticClickData(
        num_embeddings=args.rows,
        num_sparse_features=args.tables,
        ids_per_feature=4,
        batch_size=BATCH,
        train_batches=batches,
        val_batches=1,
        test_batches=batches,
    )


# ------------------------------------------------------------------ phases (subprocesses)


def make_checkpoint(args: argparse.Namespace) -> None:
    """Phase ``checkpoint``: one training step on one rank, then a sharded checkpoint."""
    import lightning as L

    from lightning_torchrec import DLRMClickModule, TorchRecStrategy

    L.seed_everything(0, verbose=False)
    model = DLRMClickModule(
        [args.rows] * args.tables,
        embedding_dim=args.dim,
        dense_arch_layer_sizes=[256, args.dim],
        over_arch_layer_sizes=[256, 1],
    )
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        strategy=TorchRecStrategy(log_plan=False),
        max_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model, datamodule=_data(args, 2))
    trainer.save_checkpoint(args.checkpoint)


def export_one(args: argparse.Namespace) -> None:
    """Phase ``export``: one export (or the float load) with its time and peak RSS per stage.

    Stages of :func:`lightning_torchrec.export.export`, each measured: ``quantize`` (stream the
    checkpoint into the quantized model), ``trace`` (``torch.export``/TorchScript) and ``save``.
    Peaks are relative to the RSS before the export began.
    """
    from lightning_torchrec.checkpoint import load_unsharded
    from lightning_torchrec.export.artifact import (
        example_inputs,
        quantize_from_checkpoint,
        save_artifact,
        trace,
    )
    from lightning_torchrec.lightning.dlrm import DLRMClickModule

    base_rss = _status("VmRSS")

    def stage(fn: Any) -> tuple[Any, float, int]:
        Path("/proc/self/clear_refs").write_text("5")
        t0 = time.perf_counter()
        result = fn()
        return result, time.perf_counter() - t0, _status("VmHWM") - base_rss

    if args.dtype == "float":
        _, seconds, peak = stage(lambda: load_unsharded(args.checkpoint, DLRMClickModule))
        out: dict[str, Any] = {"seconds": seconds, "peak_rss_increase_bytes": peak}
    else:
        (model, facts), q_s, q_peak = stage(
            lambda: quantize_from_checkpoint(args.checkpoint, MODULE, args.dtype)
        )
        inputs = example_inputs(facts["features"], facts["dense_width"])
        artifact, t_s, t_peak = stage(lambda: trace(model, args.format, inputs))
        path, s_s, s_peak = stage(lambda: save_artifact(artifact, args.format, args.output))
        out = {
            "artifact_bytes": path.stat().st_size,
            "quantized_table_bytes": facts["quantized_table_bytes"],
            "float_table_bytes": facts["float_table_bytes"],
            "stages": {
                "quantize": {"seconds": q_s, "peak_rss_increase_bytes": q_peak},
                "trace": {"seconds": t_s, "peak_rss_increase_bytes": t_peak},
                "save": {"seconds": s_s, "peak_rss_increase_bytes": s_peak},
            },
            "seconds": q_s + t_s + s_s,
            "peak_rss_increase_bytes": max(q_peak, t_peak, s_peak),
        }
    out["rss_before"] = base_rss
    print("RESULT " + json.dumps(out))


def latency(args: argparse.Namespace) -> None:
    """Phase ``latency``: float model and artifacts on the same batches, interleaved."""
    from lightning_torchrec.checkpoint import load_unsharded
    from lightning_torchrec.export.artifact import load_artifact
    from lightning_torchrec.lightning.dlrm import DLRMClickModule

    torch.set_num_threads(1)
    models = {"float": load_unsharded(args.checkpoint, DLRMClickModule).eval()}
    models["float"] = models["float"].model_and_loss.model
    for path in args.artifacts:
        models[Path(path).name] = load_artifact(path)
    batches = list(_data(args, args.batches).dataset("test"))
    times: dict[str, list[float]] = {name: [] for name in models}
    with torch.inference_mode():
        for model in models.values():  # warm-up (TorchScript's profiling executor needs a few)
            for b in batches[:3]:
                model(b.dense_features, b.sparse_features)
        for _ in range(args.rounds):
            for name, model in models.items():
                t0 = time.perf_counter()
                for b in batches:
                    model(b.dense_features, b.sparse_features)
                times[name].append((time.perf_counter() - t0) / len(batches))
    print("RESULT " + json.dumps({name: stats(v) for name, v in times.items()}))


# ------------------------------------------------------------------ driver


def _phase(*argv: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PL_", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.export_cost", *argv],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1800,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"phase {argv[:2]} failed:\n{proc.stderr[-6000:]}")
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return json.loads(lines[-1][len("RESULT ") :]) if lines else {}


def table(result: dict[str, Any]) -> str:
    """The Markdown table of ``docs/export.md``."""
    mib = 2**20
    size = result["size"]
    float_bytes = size["float_table_bytes"]
    ref = result["float_load"]
    lat = result["latency"]
    float_ms = lat["float"]["median"] * 1e3
    lines = [
        f"{size['tables']} tables x {size['rows']:,} rows x {size['dim']} "
        f"(float tables {float_bytes / mib:.0f} MiB, largest table "
        f"{size['largest_table_bytes'] / mib:.0f} MiB); batch {BATCH}, 1 thread.",
        "",
        "| what | file | file / fp32 file | latency / batch | vs float | export time | "
        "peak RSS increase: quantize / whole export | whole export / float tables |",
        "|---|---|---|---|---|---|---|---|",
        f"| float unsharded model (`load_unsharded`) | - | - | {float_ms:.2f} ms | 1.00 | "
        f"{ref['seconds']:.1f} s (load) | {ref['peak_rss_increase_bytes'] / mib:.0f} MiB | "
        f"{ref['peak_rss_increase_bytes'] / float_bytes:.2f} |",
    ]
    fp32_file = result["exports"]["fp32.pt2"]["artifact_bytes"]
    for name, r in result["exports"].items():
        ms = lat[f"model_{name}"]["median"] * 1e3
        lines.append(
            f"| {name} | {r['artifact_bytes'] / mib:.1f} MiB | "
            f"{r['artifact_bytes'] / fp32_file:.2f} | {ms:.2f} ms | {ms / float_ms:.2f} | "
            f"{r['seconds']:.1f} s | "
            f"{r['stages']['quantize']['peak_rss_increase_bytes'] / mib:.0f} / "
            f"{r['peak_rss_increase_bytes'] / mib:.0f} MiB | "
            f"{r['peak_rss_increase_bytes'] / float_bytes:.2f} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    """Runs the benchmark (or one of its phases).

    Args:
        argv: arguments (defaults to ``sys.argv[1:]``).
    """
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--phase", choices=["checkpoint", "export", "latency"], default=None)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--tables", type=int, default=4)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--batches", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    parser.add_argument("--out", type=Path, default=None, help="results directory")
    parser.add_argument("--checkpoint", type=Path, default=None)
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--dtype", default="int8")
    parser.add_argument("--format", default="pt2")
    parser.add_argument("--artifacts", nargs="*", default=[])
    args = parser.parse_args(argv)
    if args.quick:
        args.rows, args.tables, args.dim, args.batches, args.rounds = 1000, 2, 16, 2, 2
    if args.phase == "checkpoint":
        return make_checkpoint(args)
    if args.phase == "export":
        return export_one(args)
    if args.phase == "latency":
        return latency(args)

    tmp = Path(tempfile.mkdtemp(prefix="export-cost-"))
    common = ["--rows", str(args.rows), "--tables", str(args.tables), "--dim", str(args.dim)]
    try:
        ckpt = tmp / "ckpt"
        _phase("--phase", "checkpoint", "--checkpoint", str(ckpt), *common)
        float_load = _phase("--phase", "export", "--checkpoint", str(ckpt), "--dtype", "float")
        exports: dict[str, Any] = {}
        runs = [(d, "pt2") for d in DTYPES] + [("int8", "torchscript")]
        for dtype, fmt in runs:
            name = f"{dtype}.{'pt2' if fmt == 'pt2' else 'ts'}"
            exports[name] = _phase(
                "--phase", "export", "--checkpoint", str(ckpt),
                "--output", str(tmp / f"model_{name}"), "--dtype", dtype, "--format", fmt,
            )  # fmt: skip
        lat = _phase(
            "--phase", "latency", "--checkpoint", str(ckpt), *common,
            "--batches", str(args.batches), "--rounds", str(args.rounds),
            "--artifacts", *(str(tmp / f"model_{n}") for n in exports),
        )  # fmt: skip
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    table_bytes = args.rows * args.dim * 4
    result = {
        "size": {
            "tables": args.tables,
            "rows": args.rows,
            "dim": args.dim,
            "float_table_bytes": table_bytes * args.tables,
            "largest_table_bytes": table_bytes,
            "batch_size": BATCH,
        },
        "float_load": float_load,
        "exports": exports,
        "latency": lat,
    }
    path = write_result("export_cost", result, args.out)
    print(table(result))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
