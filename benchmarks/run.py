"""Runs every benchmark (one after the other) and writes ``results/README.md``.

Usage::

    python -m benchmarks.run                 # all, full sizes (~10 min on 2 CPU cores)
    python -m benchmarks.run --quick --out runs/bench-smoke   # tiny sizes (smoke test)
    python -m benchmarks.run --only strategy_overhead --only callback_cost
    python -m benchmarks.run --table-only    # rebuild the Markdown table from the JSON files

Each benchmark runs in its own subprocess (Lightning's launcher re-runs a multi-process one per
rank; a single-process one's memory does not disturb the next). ``--in-process`` runs the selected
ones in this process instead, one after the other: several 2-rank benchmarks then share one launch
(the smoke test uses this; do not mix them with single-process ones, which open their own group).
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import time
from pathlib import Path
from typing import Any

from benchmarks.common import RESULTS, SYNC_RAW, fmt_ratio, run_module

BENCHMARKS = [
    "strategy_overhead",
    "callback_cost",
    "norm_throughput",
    "sampling_scale",
    "checkpoint_cost",
    "planner_scale",
    "pipeline_throughput",
    "lightning_step_cost",
    "step_phases",
    "vote_ahead",
    "semi_sync_gap",
    "data_loading",
    "export_cost",
    "fork_race",
]


def _load(out: Path, name: str) -> dict[str, Any] | None:
    path = out / f"{name}.json"
    return json.loads(path.read_text()) if path.exists() else None


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def _ms(s: dict[str, float]) -> str:
    return f"{1e3 * s['median']:.1f} ms (IQR {1e3 * s['iqr']:.1f})"


def _size(size: dict[str, int]) -> str:
    return (
        f"{size['tables']} tables x {size['rows']:,} rows x {size['dim']}, "
        f"{size['ids_per_feature']} ids/feature, batch {size['batch_size']}/rank"
    )


def _to_best_synchronous(step: dict[str, float], steps: dict[str, dict[str, float]]) -> str:
    """``step``'s median over the fastest synchronous raw loop's, as table text ("" if none)."""
    sync = [steps[k]["median"] for k in SYNC_RAW if k in steps]
    return f"{step['median'] / min(sync):.3f}" if sync else ""


def _paired(v: dict[str, Any]) -> str:
    """The paired ratio to the best synchronous raw loop, as ``median [q1, q3]`` ("" if none)."""
    p = v.get("paired_ratio_to_best_synchronous_raw")
    return f"{p['median']:.3f} [{p['q1']:.3f}, {p['q3']:.3f}]" if p and p.get("n") else ""


def pipeline_table(out: Path) -> list[str]:
    """The train-pipeline section of the report (empty without its result file)."""
    r = _load(out, "pipeline_throughput")
    if not r:
        return []
    rounds = max((s.get("rounds", 0) for s in r["sizes"].values()), default=0)
    lines = [
        "## The Trainer against raw TorchRec loops (CPU, 2 gloo ranks)",
        "",
        f"Table-wise plan; each variant runs in turn, {rounds} interleaved rounds in the same "
        "processes, each after a warm-up. Step = the median over rounds of each round's median "
        "step time (IQR over rounds). `trainer_defaults`: Lightning's and the strategy's "
        'defaults (progress bar, logger, checkpointing; `pipeline="auto"`, batch checks and '
        "the loss guard on); `trainer_parity`: the strategy's defaults, Lightning's extras off; "
        "`trainer_none`/`trainer_sparse_dist`: parity with that pipeline. Ratios = step time / "
        "the best raw loop's, and / the best synchronous raw loop's (`raw_base`, "
        "`raw_sparse_dist`: the Trainer's defaults are bit-equal to them, semi-sync training "
        "is not). Bandwidth = the embedding rows' bytes per step (read, re-read and "
        "written by the fused update) over the step time, as a fraction of the measured memory "
        "copy bandwidth: the physical floor. Paired = each round's step over the best "
        "synchronous raw loop's in the same round (they ran back to back): median [q1, q3].",
        "",
        "| model | variant | step | samples/s | ratio to best raw | ratio to best synchronous "
        "raw | paired | bandwidth |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, sized in r["sizes"].items():
        steps = {
            k: v.get("round_median_step_s", v["step_s"])
            for k, v in sized.items()
            if isinstance(v, dict) and "samples_per_s" in v
        }
        for variant, step in steps.items():
            v = sized[variant]
            ratio = v.get("ratio_to_best_raw", v.get("ratio_to_raw_base", 0.0))
            frac = v.get("memory_bandwidth_fraction")
            lines.append(
                f"| {name}: {_size(sized['size'])} | {variant} | {_ms(step)} | "
                f"{v['samples_per_s']:,.0f} | {ratio:.3f} | {_to_best_synchronous(step, steps)} | "
                f"{_paired(v)} | {'' if frac is None else f'{100 * frac:.1f}%'} |"
            )
        limit = sized.get("physical_limit")
        if limit:
            lines.append(
                f"| {name} | floor: {limit['bytes_per_step'] / 2**20:.1f} MiB of rows per rank "
                f"and step at {limit['bytes_per_s'] / 1e9:.1f} GB/s | "
                f"{1e3 * limit['floor_step_s']:.2f} ms | | | | | 100% |"
            )
    return [*lines, ""]


def step_cost_table(out: Path) -> list[str]:
    """What the Trainer adds per step, piece by piece (empty without its result file)."""
    r = _load(out, "lightning_step_cost_benchmark") or _load(out, "lightning_step_cost_tiny")
    if not r:
        return []
    lines = [
        "## What the Trainer adds to a step, piece by piece (CPU, 2 gloo ranks)",
        "",
        f"{_size(r['size'])}; {r['rounds']} interleaved rounds, each starting one variant "
        "later; step = median over rounds of each round's median (IQR over rounds). Each `-` row "
        "removes one more piece; `- vote` patches out the per-step vote that carries Lightning's "
        "SIGTERM flag (in the benchmark only); `vote before forward` is `vote_ahead=False`; "
        'the Trainer\'s rows at defaults and parity resolve `pipeline="auto"` (sparse-dist '
        "on 2 CPU ranks), the others name that pipeline. Ratios to the raw base loop and to "
        "the best synchronous raw loop; paired: each round's step over that loop's in the same "
        "round, median [q1, q3]. `python -m benchmarks.lightning_step_cost`.",
        "",
        "| variant | step | ratio to raw base | ratio to best synchronous raw | paired | "
        "extra per step |",
        "|---|---|---|---|---|---|",
    ]
    steps = {k: v["round_median_step_s"] for k, v in r["variants"].items()}
    for variant, v in r["variants"].items():
        step = steps[variant]
        lines.append(
            f"| {variant} | {_ms(step)} | {v['ratio_to_raw_base']:.3f} | "
            f"{_to_best_synchronous(step, steps)} | {_paired(v)} | "
            f"{v['extra_ms_per_step']:+.2f} ms |"
        )
    return [*lines, ""]


def vote_ahead_table(out: Path) -> list[str]:
    """The vote ahead against the vote before each forward (empty without its result file)."""
    r = _load(out, "vote_ahead") or _load(out, "vote_ahead_tiny")
    if not r:
        return []
    diff = r["ahead_minus_before_s"]
    return [
        "## The step's vote ahead against the vote before each forward (CPU, 2 gloo ranks)",
        "",
        f"{_size(r['size'])}; the Trainer at parity settings, "
        f"{r.get('pipeline') or 'unpipelined'}; {r['rounds']} rounds in ABBA "
        "order (A B, B A, ...); step = median over rounds of each round's median (IQR over "
        "rounds). `python -m benchmarks.vote_ahead`.",
        "",
        "| variant | step |",
        "|---|---|",
        f"| `vote_ahead=True` (the default) | {_ms(r['vote_ahead'])} |",
        f"| `vote_ahead=False` | {_ms(r['vote_before_forward'])} |",
        f"| ahead minus before, per round | {1e3 * diff['median']:+.2f} ms (IQR "
        f"{1e3 * diff['iqr']:.2f}); ahead faster in {r['rounds_ahead_faster']} of "
        f"{r['rounds']} rounds |",
        "",
    ]


GPU_VARIANTS = [
    "raw_base",
    "raw_sparse_dist",
    "raw_semi_sync",
    "trainer_none",
    "trainer_sparse_dist",
    "trainer_semi_sync",
]


def gpu_table(out: Path) -> list[str]:
    """The GPU section (one H100, world size 1): throughput, checks, step profile."""
    names = (
        "pipeline_throughput_cuda",
        "pipeline_throughput_cuda_65536",
        "pipeline_throughput_cuda_65536_nochecks",
    )
    runs = [r for r in (_load(out, n) for n in names) if r]
    if not runs:
        return []
    v = runs[0]["versions"]
    lines = [
        "## On a GPU: one H100, world size 1 (nccl)",
        "",
        f"{v.get('device')}, torch {v.get('torch')}, torchrec {v.get('torchrec')}, fbgemm-gpu "
        f"{v.get('fbgemm-gpu')}, lightning {v.get('lightning')}. Throughput from a timed window "
        "(synchronised at both ends) after a warm-up; batches pinned; the raw loops keep losses "
        "on the GPU. The Trainer runs at parity settings with the strategy's defaults (batch "
        "checks and the loss guard on). `python -m benchmarks.pipeline_throughput "
        "--accelerator cuda --devices 1 ...` (`scripts/gpu_run.sh`).",
        "",
        "Each run is on a fresh machine: compare ratios within a run.",
        "",
        "| run | model | variant | samples/s | ratio to raw base |",
        "|---|---|---|---|---|",
    ]
    for run, r in enumerate(runs, 1):
        for name, sized in r["sizes"].items():
            for variant in GPU_VARIANTS + [v for v in sized if v.endswith("_nochecks")]:
                x = sized.get(variant)
                if isinstance(x, dict) and "samples_per_s" in x:
                    lines.append(
                        f"| {run} | {name}: {_size(sized['size'])} | {variant} | "
                        f"{x['samples_per_s']:,.0f} | {x['ratio_to_raw_base']:.2f} |"
                    )
    lines += [
        "",
        "Reading: the strategy adds no GPU-to-host synchronisation (sync audit below: the "
        "remaining ones are TorchRec's own input-dist and recat syncs). The Trainer is host-bound "
        "at these sizes: a raw step is 5 ms of host work for a GPU that finishes it as fast, "
        "while Lightning's step costs about 5 ms more on the host (`trainer_none_nochecks` in the "
        "profile), and the strategy's host-side batch check (every id of every step: 2.6M ids "
        "at batch 16384, 10.5M at 65536) costs 1.5 to 30 ms per step depending on the machine's "
        "CPU thread pool (the two profiles, same code, two machines). `validate_batches=N` "
        "(check the first N steps) or `False` takes it off the critical path once the data "
        "is trusted: at batch 65536, `trainer_sparse_dist_nochecks` runs at 0.91x the raw "
        "base loop's step time (faster than it) and within 5% of raw TorchRec's sparse-dist "
        "loop (running the check on a background thread was tried and measured: no gain, "
        "`*_background_checks.json`). Raw TorchRec's sparse-dist pipeline gains 19-29% at "
        "batch 65536; at 16384 and below it costs more than it overlaps on one GPU.",
    ]
    checks = _load(out, "cuda_checks")
    if checks:
        lines += ["", "| CUDA check | result |", "|---|---|"]
        for c in checks["checks"]:
            lines.append(f"| {c['name']} | {'pass' if c['ok'] else 'FAIL'}: {c['summary']} |")
    for name in ("step_profile_cuda", "step_profile_cuda_rerun"):
        prof = _load(out, name)
        if prof:
            steps = ", ".join(f"{k} {p['ms_per_step']:.1f} ms" for k, p in prof["variants"].items())
            lines += [
                "",
                f"Host step under cProfile ({name}, batch {prof['size']['batch_size']}): {steps}.",
            ]
    return [*lines, ""]


def semi_sync_table(out: Path) -> list[str]:
    """The semi-sync drift section of the report (empty without its result file)."""
    r = _load(out, "semi_sync_gap")
    if not r:
        return []
    g, v = r["rank0_loss_gap"], r["val"]
    lines = [
        "## Semi-sync: how far it drifts from synchronous training",
        "",
        f"2 gloo ranks, the demo DLRM and data, {r['steps']} steps with `pipeline=None` and with "
        f'`pipeline="semi_sync"` from step {r["semi_sync_from_step"]} (tables read one update '
        "late), then validation. Loss gap on rank 0: max |semi - sync| per step "
        f"{g['max']:.2e}, mean {g['mean']:.2e}; max gap of the {g['moving_average_window']}-step "
        f"moving averages {g['max_moving_average']:.2e} (mean loss {g['mean_loss_sync']:.3f}).",
        "",
        "| metric | synchronous | semi-sync |",
        "|---|---|---|",
    ]
    for key in sorted(v["sync"]):
        lines.append(
            f"| {key} | {v['sync'][key]:.4f} | {v['semi_sync'].get(key, float('nan')):.4f} |"
        )
    return [*lines, ""]


def fork_race_table(out: Path) -> list[str]:
    """Children forked right after a gloo collective that never started (empty without it)."""
    r = _load(out, "fork_race")
    if not r:
        return []
    python = r["machine"]["python"]
    lines = [
        "## Loader workers forked next to gloo's threads",
        "",
        f"2 gloo ranks, Python {python}: each rank runs `all_gather_object` and starts a process "
        "at once, as a `DataLoader` starts a worker, in alternating blocks of "
        f"{r['block']} through multiprocessing's fork context and through `QuietForkContext` "
        f"(the GIL released for {1e3 * r['quiet_s']:.0f} ms first). A child not finished "
        f"within {r['limit_s']:.0f} s hung (python/cpython#112275, fixed in 3.12"
        + ("" if r["affected_interpreter"] else "; this interpreter is not affected")
        + ").",
        "",
        "| start | forks | hung | rate |",
        "|---|---|---|---|",
    ]
    for mode, label in (("fork", "fork"), ("quiet_fork", "`QuietForkContext`")):
        m = r["modes"][mode]
        rate = f"1 in {m['forks'] / m['hung']:,.0f}" if m["hung"] else "0"
        lines.append(f"| {label} | {m['forks']:,} | {m['hung']} | {rate} |")
    return [*lines, ""]


def phases_table(out: Path) -> list[str]:
    """Where a step's host time goes, phase by phase (empty without its result file)."""
    r = _load(out, "step_phases_cpu") or _load(out, "step_phases_cuda")
    if not r:
        return []
    variants = r["variants"]
    order = ["raw_sparse_dist", "trainer_parity", "trainer_defaults"]
    names: list[str] = []
    for v in order[1:] + order[:1]:  # the Trainer's phases in its order, then the raw loop's own
        names += [k for k in variants[v]["phases_s"] if k not in names]
    lines = [
        f"## Where a step's host time goes, phase by phase ({r['accelerator'].upper()}, "
        f"{r['world_size']} rank{'s' if r['world_size'] > 1 else ''})",
        "",
        f"{_size(r['size'])}; rounds: {r['rounds']}, variants alternating. Host time between "
        "consecutive marks: the boundaries both loops share (TorchRec's `progress()` and its "
        "input all-to-all, the sharded model's forward, `Tensor.backward`, the dense "
        "optimizer's `step`, which under Lightning runs the training step's closure) and the "
        "Trainer's hooks; each phase's median over the timed steps, median over rounds. A "
        "blank: the loop has no such phase. The marks themselves add a little to every phase. "
        "`python -m benchmarks.step_phases`.",
        "",
        "| phase | " + " | ".join(order) + " |",
        "|---|" + "---|" * len(order),
    ]
    for name in names:
        cells = [variants[v]["phases_s"].get(name) for v in order]
        lines.append(
            f"| {name} | "
            + " | ".join("" if c is None else f"{1e3 * c:.2f} ms" for c in cells)
            + " |"
        )
    sums = [sum(variants[v]["phases_s"].values()) for v in order]
    lines.append("| sum of the phases | " + " | ".join(f"{1e3 * x:.2f} ms" for x in sums) + " |")
    lines.append(
        "| step (median) | " + " | ".join(_ms(variants[v]["step_s"]) for v in order) + " |"
    )
    return [*lines, ""]


def instructions_table(out: Path) -> list[str]:
    """Instructions per training step under cachegrind (empty without its result file)."""
    r = _load(out, "step_instructions_benchmark") or _load(out, "step_instructions_tiny")
    if not r or "best_raw" not in r:
        return []
    short, long = r["steps"]
    lines = [
        "## Instructions per step: the Trainer against raw TorchRec loops (CPU, 2 gloo ranks)",
        "",
        f"{_size(r['size'])}; each variant run for {short} and for {long} steps under "
        "`valgrind --tool=cachegrind`, on the same cached batches: the difference in executed "
        f"instructions over the {long - short} steps between, per rank, mean of the ranks. "
        "Counts do not move with the load of a shared host (step times do); they leave out "
        "cache misses and waits. Ratio: over the best raw loop (**bold**). "
        "`python -m benchmarks.step_instructions` (about an hour; not part of `make bench`).",
        "",
        "| variant | instructions per step | per rank | ratio |",
        "|---|---|---|---|",
    ]
    for name, v in r["variants"].items():
        shown = f"**{name}**" if name == r["best_raw"] else name
        ranks = ", ".join(f"{x / 1e6:.2f}M" for x in v["per_step_by_rank"])
        lines.append(
            f"| {shown} | {v['per_step'] / 1e6:.2f}M | {ranks} | {v['ratio_to_best_raw']:.3f} |"
        )
    return [*lines, ""]


def overhead_table(out: Path) -> list[str]:
    """Benchmark 1: the Trainer against both raw loops, in blocks (empty without its file)."""
    r = _load(out, "strategy_overhead")
    if not r or "fits" not in r:
        return []
    lines = [
        "## 1. Strategy overhead: `Trainer` + `TorchRecStrategy` vs raw TorchRec loops, in blocks",
        "",
        f"Model: DLRM, {_size(r['size'])}; 2 gloo ranks on CPU, {r['plan']} plan. Inside one "
        f"run, each block of {r['block']} Lightning steps follows a block of each raw loop (the "
        "plain loop and TorchRec's sparse-dist pipeline written by hand, in alternating order), "
        "so the three see the same spell of the shared machine; the first step of every block is "
        'dropped. The Lightning blocks alternate the strategy\'s defaults (`pipeline="auto"`, '
        f"batch checks and the loss guard) and its per-step checks off (`{r['no_checks']}`). "
        "Two fits: Lightning's defaults (progress bar, logger, model summary; checkpointing off) "
        "and parity (all off). Same batches, same starting weights. Step-time ratio = the "
        "median Lightning step over the median raw step of the paired blocks; per block: each "
        "block's median over the raw block's before it, median [q1, q3]. The goals are read "
        "against the faster raw loop (**bold**), with the 95% interval of the step-time ratio "
        "(whole blocks resampled, 2000 rounds): a goal inside it is not resolved by the run.",
        "",
        "| fit | Lightning variant | raw loop | raw step | Lightning step | step-time ratio | "
        "per-block ratio: median [q1, q3] |",
        "|---|---|---|---|---|---|---|",
    ]
    goals = {"defaults": "<= 1.03", "parity": "<= 1.02"}
    for name, f in r["fits"].items():
        for variant, v in f["variants"].items():
            for raw, a in v["against"].items():
                ratio = a["step_time_ratio"]["ratio_of_medians"]
                best = raw == f["best_raw"]
                interval = a.get("step_time_ratio_95")
                text = (
                    fmt_ratio(ratio, goals[name], interval)
                    if best and variant == "lightning"
                    else ""
                )
                b = a["block_median_ratio"]
                lines.append(
                    f"| {name} | {variant} | {f'**{raw}**' if best else raw} | "
                    f"{_ms(a['raw_step_s'])} | {_ms(a['lightning_step_s'])} | "
                    f"{text or f'{ratio:.3f}'} | {b['paired_median']:.3f} "
                    f"[{b['paired_q1']:.3f}, {b['paired_q3']:.3f}] |"
                )
    lines.append("")
    for name, f in r["fits"].items():
        lines.append(
            f"**Loss trajectories ({name})**: Lightning against both raw loops, max absolute "
            f"difference over {f['loss_steps_compared']} steps = {f['loss_max_abs_diff']:.3g} "
            f"(identical: {f['losses_identical']}).",
        )
        lines.append("")
    return lines


def table(out: Path) -> str:
    """The Markdown report of every result file present in ``out``."""
    lines = [
        "# Benchmark results",
        "",
        "Produced by `python -m benchmarks.run` (`make bench`). Ratios are the headline; times",
        "depend on the machine. Variants alternate (A B A B ...) after a warm-up; times are",
        "medians with the interquartile range (IQR).",
        "",
    ]
    lines += pipeline_table(out)
    lines += step_cost_table(out)
    lines += phases_table(out)
    lines += instructions_table(out)
    lines += vote_ahead_table(out)
    lines += semi_sync_table(out)
    lines += fork_race_table(out)
    lines += gpu_table(out)
    lines += overhead_table(out)
    r = _load(out, "callback_cost")
    if r:
        v = r["variants"]
        lines += [
            "## 2. Callback cost (step-time ratio against no callback)",
            "",
            f"Same model and run settings as 1 ({_size(r['size'])}); "
            f"`log_every_n_steps={r['log_every_n_steps']}`; no-callback step "
            f"{_ms(v['none_step_s'])}.",
            "",
            "| callback | every step (goal <= 1.05) | every step, ratio of lower quartiles | "
            "default cadence (goal <= 1.01) |",
            "|---|---|---|---|",
        ]
        for name, label in (
            ("weight", "`WeightNormCallback`"),
            ("embedding", "`EmbeddingNormCallback`"),
        ):
            every = v[f"{name}_every"]["ratio_of_medians"]
            default = v[f"{name}_default"]
            cadence = (
                fmt_ratio(default["derived_amortised_ratio"], "<= 1.01")
                + f" (+{1e3 * default['derived_extra_per_logging_step_s']:.1f} ms per event)"
            )
            if default.get("amortised_ratio") is not None:
                cadence += (
                    f"; direct: {default['amortised_ratio']:.3f} from "
                    f"{default['logging_steps']} logging steps"
                )
            q1 = v[f"{name}_every"]["ratio_of_q1"]
            lines.append(f"| {label} | {fmt_ratio(every, '<= 1.05')} | {q1:.3f} | {cadence} |")
        lines += [
            "",
            "Default cadence = 1 + extra / (50 x median no-callback step), the amortised cost of "
            "one logging event per 50 steps; extra = median every-step step - median "
            "no-callback step. Direct: extra = median logging step - median quiet step of the "
            "default-cadence variant (few samples, noisy).",
            "",
        ]
    r = _load(out, "callback_cost_demo")
    if r:
        v = r["variants"]
        lines += [
            f"On the demo model ({_size(r['size'])}; `python -m benchmarks.callback_cost "
            f"--demo`), no-callback step {_ms(v['none_step_s'])}:",
            "",
            "| callback | one logging step / quiet step | default cadence |",
            "|---|---|---|",
        ]
        for name, label in (
            ("weight", "`WeightNormCallback`"),
            ("embedding", "`EmbeddingNormCallback`"),
        ):
            every = v[f"{name}_every"]["ratio_of_medians"]
            default = v[f"{name}_default"]["derived_amortised_ratio"]
            lines.append(f"| {label} | {every:.3f} | {default:.3f} |")
        lines.append("")
    r = _load(out, "norm_throughput")
    if r:
        lines += [
            "## 3. Norm throughput: `weights_to_log` vs a plain reduction",
            "",
            "Bytes of parameters read per second, ratio to `torch._foreach_norm` and to "
            "`sum(t.sum())` over the same tensors (goal >= 0.5), one process.",
            "",
            "| model | bytes | weights_to_log | ratio vs foreach_norm | ratio vs sum |",
            "|---|---|---|---|---|",
        ]
        for key, res in r["results"].items():
            if key.endswith("/size"):
                continue
            w = res["weights_to_log"]
            lines.append(
                f"| {key} | {_mib(res['bytes'])} | {w['bytes_per_s'] / 1e9:.2f} GB/s "
                f"({1e3 * w['seconds']['median']:.2f} ms) | "
                f"{fmt_ratio(res['ratio_vs_foreach_norm'], '>= 0.5')} | "
                f"{res['ratio_vs_sum']:.3f} |"
            )
        lines.append("")
    r = _load(out, "sampling_scale")
    if r:
        lines += [
            "## 4. Sampling scale: `log_ebc_norms` on one table, fixed sample",
            "",
            f"dim {r['dim']}, sample {r['sample_size']:,} rows ({_mib(r['sample_bytes'])} of "
            "rows); torch allocations counted with a `TorchDispatchMode`; RSS = growth of the "
            "peak resident set during one call.",
            "",
            "| rows | table | time | torch alloc peak | torch alloc total | RSS peak growth |",
            "|---|---|---|---|---|---|",
        ]
        for rows, s in r["sizes"].items():
            rss = s["rss_peak_growth_bytes"]
            lines.append(
                f"| {int(rows):,} | {_mib(s['table_bytes'])} | {_ms(s['seconds'])} | "
                f"{_mib(s['torch_alloc_peak_bytes'])} | {_mib(s['torch_alloc_total_bytes'])} | "
                f"{'n/a' if rss is None else _mib(rss)} |"
            )
        lines += [
            "",
            f"Table {r['table_growth']:.0f}x larger: time x{r['time_growth']:.2f}, "
            f"allocation peak x{r['alloc_peak_growth']:.2f}.",
            "",
        ]
    r = _load(out, "checkpoint_cost")
    if r:
        lines += [
            "## 5. Checkpoint cost (`trainer.save_checkpoint`, resume with `fit(ckpt_path=...)`)",
            "",
            f"Model: {_size(r['size'])}; 2 ranks; {r['rounds']} rounds.",
            "",
            "| measure | value |",
            "|---|---|",
            f"| size on disk | {_mib(r['checkpoint_bytes'])} ({r['bytes_over_tables']:.2f}x "
            f"the table weights, {_mib(r['table_bytes'])}) |",
            f"| save | {_ms(r['save_s'])} ({r['save_bytes_per_s'] / 2**20:.0f} MiB/s) |",
            f"| load (resume fit - fresh fit) | {_ms(r['load_s'])} |",
            f"| fresh fit setup (shard, optimizers) | {_ms(r['fresh_fit_s'])} |",
            "",
        ]
    r = _load(out, "planner_scale")
    if r:
        s = r["size"]
        lines += [
            "## 6. Scale on paper: the planner's plan for a 100x larger model",
            "",
            f"{s['tables']} tables x {s['rows']:,} rows x {s['dim']} fp32 "
            f"({_mib(r['total_table_bytes'])}), `Topology(world_size=N, compute_device='cuda', "
            "local_world_size=8)`, default sharders (fused row-wise Adagrad); no GPU used.",
            "",
            "| GPUs | sharding types | ranks per table | ranks holding tables | table bytes "
            "per holding rank | planner HBM estimate per rank (max) | planning time |",
            "|---|---|---|---|---|---|---|",
        ]
        for p in r["plans"]:
            types = ", ".join(f"{k} x{n}" for k, n in p["sharding_types"].items())
            hbm = p["planner_hbm_per_rank"]
            lines.append(
                f"| {p['world_size']} | {types} | {p['ranks_per_table']['median']:.0f} | "
                f"{p['ranks_holding_tables']} | "
                f"{_mib(p['table_bytes_per_holding_rank']['median'])} | "
                f"{'n/a' if hbm is None else _mib(hbm['max'])} | {p['planning_s']:.1f} s |"
            )
        lines.append("")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true", help="tiny sizes (smoke test)")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--only", action="append", choices=BENCHMARKS)
    p.add_argument("--table-only", action="store_true")
    p.add_argument("--in-process", action="store_true", help="no subprocess per benchmark")
    args = p.parse_args(argv)
    if not args.table_only:
        for name in args.only or BENCHMARKS:
            start = time.perf_counter()
            bench_args = ["--out", str(args.out), *(["--quick"] if args.quick else [])]
            if args.in_process:
                importlib.import_module(f"benchmarks.{name}").main(bench_args)
            else:
                run_module(f"benchmarks.{name}", *bench_args)
            print(f"{name}: {time.perf_counter() - start:.0f} s", flush=True)
    if int(os.environ.get("LOCAL_RANK", "0")) != 0:
        return
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "README.md").write_text(table(args.out) + "\n")
    print(f"wrote {args.out / 'README.md'}")


if __name__ == "__main__":
    main()
