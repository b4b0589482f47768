"""Every benchmark runs end to end at tiny sizes and writes its JSON and the Markdown table.

Two launches side by side: the three 2-rank benchmarks share one Lightning launch
(``--in-process``), the single-process ones run in a second subprocess. Nothing here asserts a
time.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run import table
from tests.helpers import ROOT, clean_env

MULTI = [
    "strategy_overhead",
    "callback_cost",
    "checkpoint_cost",
    "pipeline_throughput",
    "step_phases",
]
SINGLE = ["norm_throughput", "sampling_scale", "planner_scale", "fork_race"]


def _start(out: Path, names: list[str]) -> subprocess.Popen:
    only = [arg for name in names for arg in ("--only", name)]
    return subprocess.Popen(
        [sys.executable, "-m", "benchmarks.run", "--quick", "--in-process", "--out", str(out)]
        + only,
        cwd=ROOT,
        env=clean_env(OMP_NUM_THREADS="1"),
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _finish(proc: subprocess.Popen, names: list[str]) -> None:
    try:
        stdout, stderr = proc.communicate(timeout=300)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
    if proc.returncode != 0:
        raise AssertionError(
            f"benchmarks {names} exited {proc.returncode}\n--- stdout ---\n"
            f"{stdout[-4000:]}\n--- stderr ---\n{stderr[-8000:]}"
        )


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    multi, single = tmp_path_factory.mktemp("bench_multi"), tmp_path_factory.mktemp("bench_one")
    procs = [(_start(multi, MULTI), MULTI), (_start(single, SINGLE), SINGLE)]
    for proc, names in procs:
        _finish(proc, names)
    out = tmp_path_factory.mktemp("bench")
    for src in (multi, single):
        for path in src.glob("*.json"):
            (out / path.name).write_text(path.read_text())
    (out / "README.md").write_text(table(out))
    return out


def _load(out: Path, name: str) -> dict:
    return json.loads((out / f"{name}.json").read_text())


def test_raw_loops_and_trainer_see_identical_losses(results: Path) -> None:
    r = _load(results, "strategy_overhead")
    assert set(r["fits"]) == {"defaults", "parity"}
    for f in r["fits"].values():
        assert f["weights_copied"] > 0
        assert f["loss_steps_compared"] == f["steps_per_variant"]
        assert f["loss_max_abs_diff"] == 0.0 and f["losses_identical"]
        assert set(f["first_losses"]) == {"lightning", "raw_base", "raw_sparse_dist"}
        assert f["best_raw"] in ("raw_base", "raw_sparse_dist")
        for v in f["variants"].values():
            assert set(v["against"]) == {"raw_base", "raw_sparse_dist"}
            # The headline figures are those against the faster raw loop.
            assert v["step_time_ratio"] == v["against"][f["best_raw"]]["step_time_ratio"]
            for a in v["against"].values():
                assert a["lightning_step_s"]["n"] > 0 and a["raw_step_s"]["n"] > 0
                assert a["step_time_ratio"]["ratio_of_medians"] > 0
                interval = a["step_time_ratio_95"]  # resampled when there are 2 blocks
                blocks = -(-a["lightning_step_s"]["n"] // (r["block"] - 1))  # 1st steps dropped
                assert bool(interval) is (blocks >= 2), (blocks, interval)
                assert not interval or 0 < interval["lo"] <= interval["hi"]
    assert "## 1. Strategy overhead" in (results / "README.md").read_text()


def test_the_block_bootstrap_bounds_the_ratio_it_resamples() -> None:
    from benchmarks.common import block_bootstrap_ratio, fmt_ratio

    exact = [([1.1 * t, 1.1 * t], [t, t]) for t in (1.0, 2.0, 3.0, 4.0)]
    assert block_bootstrap_ratio(exact) == pytest.approx({"lo": 1.1, "hi": 1.1, "rounds": 2000})
    assert block_bootstrap_ratio(exact[:1]) == {}  # one block: nothing to resample
    # One slow spell hitting both loops of a block moves both: the interval stays narrow.
    spells = [([1.03 * s, 1.01 * s], [s, 1.02 * s]) for s in (1.0, 1.5, 0.8, 2.0, 1.2, 0.9)]
    interval = block_bootstrap_ratio(spells, seed=3)
    assert interval == block_bootstrap_ratio(spells, seed=3)  # recomputable from the seed
    assert 0.95 < interval["lo"] <= interval["hi"] < 1.1
    assert "goal inside it" in fmt_ratio(1.02, "<= 1.02", {"lo": 1.0, "hi": 1.04})
    assert fmt_ratio(1.05, "<= 1.02", {"lo": 1.03, "hi": 1.06}).endswith("[1.030, 1.060])")


def test_callback_variants_all_measured(results: Path) -> None:
    r = _load(results, "callback_cost")
    variants = r["variants"]
    assert variants["none_step_s"]["n"] > 0
    for name in ("weight_every", "embedding_every", "weight_default", "embedding_default"):
        assert variants[name]["step_s"]["n"] > 0, name
        assert variants[name]["ratio_of_medians"] > 0, name


def test_norm_throughput_ratios(results: Path) -> None:
    r = _load(results, "norm_throughput")["results"]
    for key in ("demo/plain", "demo/dmp_1rank"):
        assert r[key]["bytes"] > 0
        assert r[key]["num_keys_logged"] > 0
        assert r[key]["ratio_vs_foreach_norm"] > 0


def test_sampling_memory_does_not_grow_with_the_table(results: Path) -> None:
    r = _load(results, "sampling_scale")
    peaks = [s["torch_alloc_peak_bytes"] for s in r["sizes"].values()]
    table_bytes = [s["table_bytes"] for s in r["sizes"].values()]
    assert table_bytes[-1] == 100 * table_bytes[0]
    # Allocation sizes are deterministic: bounded by the sample, not the table.
    assert max(peaks) <= 2 * min(peaks)
    assert max(peaks) < table_bytes[-1] / 10
    assert all(s["mean_norm"] > 0 for s in r["sizes"].values())


def test_checkpoint_is_written_and_resumed(results: Path) -> None:
    r = _load(results, "checkpoint_cost")
    assert r["checkpoint_bytes"] > r["table_bytes"]
    assert r["save_s"]["n"] == r["rounds"] == r["resume_fit_s"]["n"]


def test_planner_scale_plans_every_world_size(results: Path) -> None:
    r = _load(results, "planner_scale")
    assert [p["world_size"] for p in r["plans"]] == [8, 16]
    for plan in r["plans"]:
        assert sum(plan["sharding_types"].values()) == r["size"]["tables"]
        held = plan["table_bytes_per_holding_rank"]
        assert held["n"] * held["mean"] == pytest.approx(r["total_table_bytes"])


def test_pipeline_variants_all_measured(results: Path) -> None:
    sized = _load(results, "pipeline_throughput")["sizes"]["tiny"]
    variants = ["raw_base", "raw_sparse_dist", "trainer_none", "trainer_sparse_dist"]
    for variant in [*variants, "trainer_defaults", "trainer_parity"]:
        assert sized[variant]["samples_per_s"] > 0
        assert sized[variant]["step_s"]["n"] >= 5
        assert 0 < sized[variant]["memory_bandwidth_fraction"] < 1
        assert sized[variant]["ratio_to_best_raw"] > 0
    assert sized["raw_base"]["ratio_to_raw_base"] == 1.0
    # The best raw loop (whichever it is on this run) is the unit of every ratio.
    raws = [v for v in sized if v.startswith("raw_")]
    assert {"raw_base", "raw_sparse_dist"} <= set(raws)
    assert min(sized[v]["ratio_to_best_raw"] for v in raws) == 1.0
    assert all(sized[v]["ratio_to_best_raw"] >= 1.0 for v in raws)
    # Paired per round with the faster synchronous raw loop: that loop's own ratios are all 1.
    best = min(("raw_base", "raw_sparse_dist"), key=lambda v: sized[v]["ratio_to_best_raw"])
    paired = {v: sized[v]["paired_ratio_to_best_synchronous_raw"] for v in variants}
    assert paired[best]["min"] == paired[best]["median"] == 1.0
    assert all(p["n"] == sized["rounds"] and p["min"] > 0 for p in paired.values())
    limit = sized["physical_limit"]
    assert limit["bytes_per_step"] > 0 and limit["bytes_per_s"] > 1e8


def test_step_phases_line_up_with_the_raw_loop(results: Path) -> None:
    r = _load(results, "step_phases_cpu")["variants"]
    shared = [f"{p} < -> {p} >" for p in ("forward", "backward", "input dist wait")]
    for variant in ("raw_sparse_dist", "trainer_parity", "trainer_defaults"):
        phases = r[variant]["phases_s"]
        assert all(phases[name] > 0 for name in shared), (variant, sorted(phases))
        assert r[variant]["step_s"]["n"] == 1
    # The Trainer's own phases: its hooks around the shared ones.
    assert "progress > -> on_before_zero_grad" in r["trainer_parity"]["phases_s"]
    assert not any("on_train_batch" in name for name in r["raw_sparse_dist"]["phases_s"])


def test_markdown_table_has_every_section(results: Path) -> None:
    text = (results / "README.md").read_text()
    for section in (
        "## 1.",
        "## 2.",
        "## 3.",
        "## 4.",
        "## 5.",
        "## 6.",
        "## The Trainer against raw TorchRec loops",
        "## Where a step's host time goes, phase by phase",
    ):
        assert section in text
    assert "NaN" not in text and "nan" not in text.split()


def test_children_forked_after_a_collective_all_start(results: Path) -> None:
    r = _load(results, "fork_race")
    for mode in ("fork", "quiet_fork"):
        assert r["modes"][mode]["forks"] == 2 * r["forks_per_mode_and_rank"]
        assert r["modes"][mode]["failed"] == 0
    assert r["modes"]["quiet_fork"]["hung"] == 0
    assert "Loader workers forked next to gloo's threads" in (results / "README.md").read_text()


def test_the_sync_audit_sees_the_waits_cudas_debug_mode_misses() -> None:
    # set_sync_debug_mode reports neither Event.synchronize nor torch.cuda.synchronize: the
    # deferred batch verdict and the loss are read through events, semi-sync's sync phase
    # synchronizes the device. The audit's wrappers report them (an event only while unreached).
    import warnings

    from benchmarks.cuda_checks import SyncAudit

    class Event:
        def __init__(self, reached: bool) -> None:
            self.reached = reached

        def query(self) -> bool:
            return self.reached

    calls: list[object] = []
    event_wait = SyncAudit._event_wait(calls.append)
    device_wait = SyncAudit._device_wait(lambda: calls.append("device"))
    audit = SyncAudit(0, 1)
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = audit._show
        event_wait(Event(reached=True))
        event_wait(Event(reached=False))
        device_wait()
    assert len(calls) == 3  # each still synchronizes
    assert [text for text, _ in audit.events] == [
        "called a synchronizing CUDA operation (CUDA event)",
        "called a synchronizing CUDA operation (torch.cuda.synchronize)",
    ]


def test_the_call_counter_counts_each_call_of_a_step_once() -> None:
    from benchmarks.step_calls import CallCounter, _stable

    def leaf() -> int:
        return len([1])  # one C call

    def body() -> None:
        leaf()
        leaf()

    counter = CallCounter(warmup=1, steps=3)
    for _ in range(4):
        counter.mark()
        body()
    counter.mark()
    assert counter.done
    # Per step: body and two leaves (Python), two len (C); nothing of the loop's or mark's own.
    assert [(c, cc) for c, cc, _ in counter.per_step] == [(3, 2)] * 3
    # This file is no library's: every call is charged to "other".
    assert counter.owners_per_step == [{"other": 3}] * 3
    assert all(sum(files.values()) == 3 for _, _, files in counter.per_step)
    run = {"calls_by_step": [3, 3], "c_calls_by_step": [2, 2], "all_files": {"a.py": 3}}
    assert _stable([run, dict(run)])
    assert not _stable([run, {**run, "calls_by_step": [3, 4]}])


def test_step_calls_counts_a_steady_step_the_same_twice(tmp_path: Path) -> None:
    # One 2-rank launch: the sparse-dist raw loop and the Trainer at parity, each run twice.
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "benchmarks.step_calls",
            "--size",
            "tiny",
            "--warmup",
            "4",  # at 2, the first counted step still differs (the run's first in its process)
            "--steps",
            "2",
            "--variants",
            "raw_sparse_dist,trainer_parity",
            "--out",
            str(tmp_path),
        ],
        cwd=ROOT,
        env=clean_env(OMP_NUM_THREADS="1"),
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-8000:]
    r = _load(tmp_path, "step_calls_tiny")
    for name, v in r["variants"].items():
        assert v["repeats"] == 2 and v["identical_in_every_repeat"], name
        assert v["same_in_every_step"], name
        first, second = v["calls_by_step_by_repeat"]
        assert first == second and len(first) == 2 and min(first) > 0, name
        assert v["c_calls_per_step"] > 0
    trainer = r["variants"]["trainer_parity"]
    for name, v in r["variants"].items():  # each call charged to one owner
        assert sum(v["calls_by_owner"].values()) == v["calls_per_step"], name
    assert trainer["calls_by_owner"]["lightning"] > 0
    assert trainer["calls_by_owner"]["lightning_torchrec"] > 0
    assert r["variants"]["raw_sparse_dist"]["calls_by_owner"]["lightning"] == 0
    assert "lightning_torchrec/lightning/module.py" in trainer["package_files"]
    assert all(calls > 0 for calls in trainer["package_files"].values())
    assert r["variants"]["raw_sparse_dist"]["ratio_to_raw_sparse_dist"] == 1.0
    assert trainer["ratio_to_raw_sparse_dist"] > 1.0
    text = (tmp_path / "step_calls_tiny.txt").read_text()
    assert "lightning_torchrec/lightning/module.py" in text


def test_the_gpu_checks_bad_step_runs_on_the_cpu(tmp_path: Path) -> None:
    # The one-GPU check of a bad batch and a NaN loss on the device's paths, through the same
    # code on the CPU (batch_checks="next_step", what "auto" is on CUDA; buffers not pinned).
    from benchmarks.cuda_checks import Context, run_check

    entry = run_check("bad_step", Context("cpu", tmp_path))
    assert entry["ok"], entry
    for case in ("bad_batch", "nan_loss"):
        found = entry["details"][case]
        assert found["global_step"] == 3 and found["deferred"] and not found["loss_pinned"]
    assert entry["details"]["bad_batch"]["error"].startswith("BatchValidationError: rank 0, step 2")
