"""Python calls per steady training step, raw TorchRec loops against the Trainer (setprofile).

Step times on a shared machine move with its load; the Python work a step does does not. Two
gloo ranks are started here (as torchrun would start them), on the same cached batches as
``benchmarks.pipeline_throughput``. Each rank runs every variant ``--repeats`` times in turn
(A B C D E A B C D E), each run ``--warmup`` steps and then ``--steps`` counted ones; on rank 0
a ``sys.setprofile`` hook counts, over the counted steps, the Python function calls (``call``
events: every frame entered, a generator's resumption included) and, apart, the calls of C
functions (``c_call``), step by step, and which source files the Python calls enter.

A step is one whole cycle of the loop, from the start of one step to the start of the next:
for the Trainer, from one call of ``fit_loop.epoch_loop.advance`` to the next (the batch fetch,
the hooks, the step, ``on_advance_end`` and the loop's own checks); for a raw loop, from one
``RawLoop.step()`` (plain) or ``TrainPipelineSparseDist.progress()`` to the next. What starts
and times the steps here (the wrappers in this file) is not counted. Python's garbage
collector is off during the counted steps (collected just before), so that a collection's
finalizers do not land in one step or another by chance.

The counted steps lie in the middle of the first epoch: the dataset holds ``warmup + steps + 6``
batches per rank, the run stops 2 steps after the window; no validation and no checkpoint
fall inside it. At Lightning's defaults the logger writes every 50 steps (``log_every_n_steps``)
and the progress bar refreshes by wall time (the strategy throttles it to tqdm's 0.1 s): both
would make the count depend on the clock. ``trainer_defaults`` therefore counts steps 10-19
(defaults), between two log writes, with the bar's refresh interval at 10^9 s (the steady step
between two refreshes); ``trainer_defaults_bar`` is the same with ``TQDM_MININTERVAL=0``
(a refresh at every step, as Lightning's own bar does). Every per-step count is recorded.

Each call is also charged to the library whose code it serves (``calls_by_owner``): the
nearest frame on the stack, the call's own included, in the package, Lightning, TorchRec or tqdm
(else ``other``). A torch call made by Lightning's loop is Lightning's; one made by the package's
vote is the package's. At parity this separates the package's per-step work from the floor that
Lightning's own loop sets.

Variants: ``raw_base`` (the hand-written loop), ``raw_sparse_dist`` (TorchRec's
``TrainPipelineSparseDist.progress``), ``trainer_parity`` (``Trainer`` + ``TorchRecStrategy``
at the strategy's defaults, ``pipeline="auto"``, Lightning's extras off), ``trainer_defaults``
(Lightning's defaults too), ``trainer_none`` (``pipeline=None``, parity), and
``trainer_defaults_bar``. The module is the demo's ``DLRMClickModule`` (training metrics off,
as in every benchmark: the raw loops compute none).

Sizes: ``host_bound`` (default: 8 tables x 2,000 rows x 64, batch 64 per rank, where the
host's work is most of a step), ``benchmark`` (8 x 100k x 64, batch 1024) or ``tiny``.
Writes ``step_calls[_SIZE].json`` and ``.txt`` (per variant, the package's files crossed, in
the order first met, with their calls per step).

Run: ``python -m benchmarks.step_calls [--size host_bound|benchmark] [--variants a,b]``.
"""

from __future__ import annotations

import argparse
import gc
import os
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import FrameType
from typing import Any

from benchmarks.common import RESULTS, ModelSize, write_result

ROOT = Path(__file__).resolve().parent.parent
HERE = str(Path(__file__).resolve())
VARIANTS = (
    "raw_base",
    "raw_sparse_dist",
    "trainer_parity",
    "trainer_defaults",
    "trainer_none",
    "trainer_defaults_bar",
)
SIZES: dict[str, Callable[[], ModelSize]] = {
    "host_bound": ModelSize.host_bound,
    "benchmark": ModelSize,
    "tiny": ModelSize.tiny,
}
#: The source trees whose files are listed one by one (the rest is summed per top package).
PACKAGE = "lightning_torchrec"
#: ``TQDM_MININTERVAL`` per Trainer variant at Lightning's defaults (see the module docstring).
BAR_INTERVAL = {"trainer_defaults": "1e9", "trainer_defaults_bar": "0"}


#: The libraries a call is charged to (see :func:`owner_of`), nearest frame first.
OWNERS = (PACKAGE, "lightning", "torchrec", "tqdm")


def owner_of(frame: FrameType) -> str:
    """The library on whose behalf a call runs: the nearest frame (this one or a caller) in one
    of :data:`OWNERS`' source trees, else ``"other"``.

    A torch or stdlib call made by Lightning's code is Lightning's; one made by the package's
    is the package's: the split says which library's own code a step's Python work serves.
    """
    f: FrameType | None = frame
    while f is not None:
        parts = f.f_code.co_filename.split(os.sep)
        for owner in OWNERS:
            if owner in parts:
                return owner
        f = f.f_back
    return "other"


class CallCounter:
    """Counts Python and C calls between ``mark()`` calls ``warmup`` and ``warmup + steps``.

    ``mark()`` is called at the start of every step (and once after the last); the calls of
    this file's own frames (the wrappers that call ``mark``) are not counted.
    """

    def __init__(self, warmup: int, steps: int) -> None:
        self.warmup, self.steps = warmup, steps
        self.index = 0
        self.calls = 0
        self.c_calls = 0
        self.files: dict[str, int] = {}
        self.owners: dict[str, int] = {}
        self.per_step: list[tuple[int, int, dict[str, int]]] = []  # (calls, c_calls, files)
        self.owners_per_step: list[dict[str, int]] = []

    def _profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            name = frame.f_code.co_filename
            if name != HERE:
                self.calls += 1
                self.files[name] = self.files.get(name, 0) + 1
                owner = owner_of(frame)
                self.owners[owner] = self.owners.get(owner, 0) + 1
        elif event == "c_call" and frame.f_code.co_filename != HERE:
            self.c_calls += 1

    def mark(self) -> None:
        """The start of a step (or the end of the last)."""
        i = self.index
        self.index += 1
        if self.warmup < i <= self.warmup + self.steps:
            self.per_step.append((self.calls, self.c_calls, self.files))
            self.owners_per_step.append(self.owners)
            self.calls, self.c_calls, self.files, self.owners = 0, 0, {}, {}
        if i == self.warmup + self.steps:
            sys.setprofile(None)
            gc.enable()
        elif i == self.warmup:
            gc.collect()
            gc.disable()
            sys.setprofile(self._profile)

    @property
    def done(self) -> bool:
        """Whether every counted step was counted."""
        return len(self.per_step) == self.steps


def _prefixes() -> list[tuple[str, str]]:
    """``(directory prefix, label prefix)``: the project's tree, site-packages, the stdlib."""
    out = [(str(ROOT) + os.sep, "")]
    paths = sysconfig.get_paths()
    for key in ("purelib", "platlib"):
        out.append((paths[key] + os.sep, ""))
    out.append((paths["stdlib"] + os.sep, "stdlib/"))
    # The longest first: a virtual environment inside the project is site-packages, not ours.
    return sorted(out, key=lambda p: -len(p[0]))


def label(filename: str, prefixes: list[tuple[str, str]]) -> str:
    """``filename`` relative to the project, site-packages or the stdlib (``stdlib/...``)."""
    for prefix, tag in prefixes:
        if filename.startswith(prefix):
            return tag + filename[len(prefix) :]
    return filename


def summarize_counts(counter: CallCounter) -> dict[str, Any]:
    """Per-step counts, the mean, and the files entered (labelled, in the order first met)."""
    prefixes = _prefixes()
    files: dict[str, int] = {}
    for _, _, step_files in counter.per_step:
        for name, n in step_files.items():
            key = label(name, prefixes)
            files[key] = files.get(key, 0) + n
    n = len(counter.per_step)
    groups: dict[str, dict[str, float]] = {}
    for key, calls in files.items():
        top = key.split("/", 1)[0]
        group = groups.setdefault(top, {"files": 0, "calls_per_step": 0.0})
        group["files"] += 1
        group["calls_per_step"] += calls / n
    # Where a step that differs from the first counted one differs, file by file.
    first = {label(k, prefixes): v for k, v in counter.per_step[0][2].items()}
    differing: dict[str, dict[str, int]] = {}
    for i, (calls, _, step_files) in enumerate(counter.per_step):
        if calls == counter.per_step[0][0]:
            continue
        here = {label(k, prefixes): v for k, v in step_files.items()}
        delta = {k: here.get(k, 0) - first.get(k, 0) for k in {*here, *first}}
        differing[str(counter.warmup + i)] = dict(
            sorted(((k, d) for k, d in delta.items() if d), key=lambda kv: -abs(kv[1]))
        )
    return {
        "calls_per_step": sum(c for c, _, _ in counter.per_step) / n,
        "steps_differing_from_the_first": differing,
        "c_calls_per_step": sum(c for _, c, _ in counter.per_step) / n,
        "calls_by_step": [c for c, _, _ in counter.per_step],
        "c_calls_by_step": [c for _, c, _ in counter.per_step],
        "package_files": {k: v / n for k, v in files.items() if k.startswith(PACKAGE + "/")},
        "package_files_by_step": [
            sum(1 for name in f if label(name, prefixes).startswith(PACKAGE + "/"))
            for _, _, f in counter.per_step
        ],
        "groups": dict(sorted(groups.items(), key=lambda kv: -kv[1]["calls_per_step"])),
        "calls_by_owner": {
            owner: sum(step.get(owner, 0) for step in counter.owners_per_step) / n
            for owner in (*OWNERS, "other")
        },
        "all_files": {k: v / n for k, v in files.items()},
    }


def run_raw(size: ModelSize, data: Any, kind: str, counter: CallCounter) -> None:
    """``counter.warmup + counter.steps`` steps of a raw loop (as ``pipeline_throughput``'s)."""
    import torch
    from torchrec.distributed.train_pipeline import TrainPipelineSparseDist

    from benchmarks.harness import RawLoop

    device = torch.device("cpu")
    raw = RawLoop(size, data, device)
    pipeline = (
        TrainPipelineSparseDist(raw.model, raw.optimizer, device)
        if kind == "raw_sparse_dist"
        else None
    )
    step = raw.step if pipeline is None else (lambda: pipeline.progress(raw.batches))
    for _ in range(counter.warmup + counter.steps):
        counter.mark()
        step()
    counter.mark()


def run_trainer(size: ModelSize, data: Any, variant: str, counter: CallCounter, world: int) -> None:
    """A Trainer fit whose loop's ``advance`` marks each step (``warmup + steps + 2`` steps)."""
    import lightning as L
    from torch.utils.data import DataLoader

    from benchmarks.harness import FUSED, dlrm_module, table_wise
    from benchmarks.strategy_overhead import PARITY
    from lightning_torchrec import TorchRecStrategy

    chosen: dict[str, Any] = {"pipeline": None} if variant == "trainer_none" else {}
    defaults = variant in BAR_INTERVAL
    if defaults:
        os.environ["TQDM_MININTERVAL"] = BAR_INTERVAL[variant]
    trainer = L.Trainer(
        accelerator="cpu",
        devices=world,
        strategy=TorchRecStrategy(
            fused_params=FUSED, constraints=table_wise(size), log_plan=False, **chosen
        ),
        max_steps=counter.warmup + counter.steps + 2,
        num_sanity_val_steps=0,
        default_root_dir=tempfile.mkdtemp(prefix="bench_calls_"),
        **({} if defaults else PARITY),
    )
    loop = trainer.fit_loop.epoch_loop
    advance = loop.advance

    def counted_advance(*args: Any, **kwargs: Any) -> Any:
        counter.mark()
        return advance(*args, **kwargs)

    vars(loop)["advance"] = counted_advance
    try:
        trainer.fit(dlrm_module(size), train_dataloaders=DataLoader(data, batch_size=None))
    finally:
        os.environ.pop("TQDM_MININTERVAL", None)
    if not counter.done:
        raise RuntimeError(f"{variant}: counted {len(counter.per_step)} of {counter.steps} steps")


def worker(args: argparse.Namespace) -> None:
    """One rank: every variant ``--repeats`` times; rank 0 writes the result."""
    import lightning as L
    import torch
    import torch.distributed as dist

    from benchmarks.harness import SEED, dataset, rank_sampler

    torch.set_num_threads(1)
    size = SIZES[args.size]()
    variants = args.variants.split(",")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if not dist.is_initialized():  # the raw loops run in it; the Trainer finds it open
        dist.init_process_group("gloo")
    runs: dict[str, list[dict[str, Any]]] = {v: [] for v in variants}
    for repeat in range(args.repeats):
        for variant in variants:
            L.seed_everything(SEED, verbose=False)  # Lightning's sampler: the raw loops' order
            data = dataset(size, world * (args.warmup + args.steps + 6))
            data.prepare(list(rank_sampler(data, rank, world)))
            counter = CallCounter(args.warmup, args.steps)
            started = time.perf_counter()
            if variant.startswith("raw_"):
                run_raw(size, data, variant, counter)
            else:
                run_trainer(size, data, variant, counter, world)
            dist.barrier()
            if rank == 0:
                summary = summarize_counts(counter)
                summary["seconds"] = time.perf_counter() - started
                runs[variant].append(summary)
                print(
                    f"step_calls: {variant} (run {repeat + 1}): "
                    f"{summary['calls_per_step']:.1f} Python calls per step, "
                    f"{summary['c_calls_per_step']:.1f} C calls, "
                    f"{len(summary['package_files'])} package files",
                    flush=True,
                )
    if rank == 0:
        write(args, size, runs)
    dist.barrier()


def _stable(runs: list[dict[str, Any]]) -> bool:
    keys = ("calls_by_step", "c_calls_by_step", "all_files")
    return all(all(r[k] == runs[0][k] for k in keys) for r in runs[1:])


def write(args: argparse.Namespace, size: ModelSize, runs: dict[str, list[dict[str, Any]]]) -> None:
    """The result (the first run of each variant, and whether the others counted the same)."""
    from benchmarks.harness import versions

    variants: dict[str, Any] = {}
    for name, done in runs.items():
        first = dict(done[0])
        first["all_files"] = dict(
            sorted(first["all_files"].items(), key=lambda kv: -kv[1])[: args.top]
        )
        variants[name] = {
            **first,
            "repeats": len(done),
            "identical_in_every_repeat": _stable(done),
            "same_in_every_step": len(set(first["calls_by_step"])) == 1
            and len(set(first["c_calls_by_step"])) == 1,
            "calls_per_step_by_repeat": [r["calls_per_step"] for r in done],
            "calls_by_step_by_repeat": [r["calls_by_step"] for r in done],
        }
    for unit in ("raw_sparse_dist", "raw_base"):
        if unit in variants:
            for v in variants.values():
                v[f"ratio_to_{unit}"] = v["calls_per_step"] / variants[unit]["calls_per_step"]
    result = {
        "size": size.to_dict(),
        "size_name": args.size,
        "world_size": args.world,
        "counted_rank": 0,
        "warmup_steps": args.warmup,
        "counted_steps": args.steps,
        "window": f"steps {args.warmup}-{args.warmup + args.steps - 1} of the first epoch",
        "versions": versions(),
        "variants": variants,
    }
    name = args.name or ("step_calls" if args.size == "host_bound" else f"step_calls_{args.size}")
    write_result(name, result, args.out)
    lines = [
        f"Python calls per steady step, rank 0 of {args.world}, {args.size} "
        f"{size.to_dict()}, steps {args.warmup}-{args.warmup + args.steps - 1}",
        "",
    ]
    for variant, v in variants.items():
        lines.append(
            f"== {variant}: {v['calls_per_step']:.1f} Python calls, "
            f"{v['c_calls_per_step']:.1f} C calls per step; identical in every repeat: "
            f"{v['identical_in_every_repeat']}; the same in every step: {v['same_in_every_step']}"
        )
        for top, g in v["groups"].items():
            lines.append(f"   {top:28s} {g['files']:4d} files {g['calls_per_step']:9.1f} calls")
        owners = ", ".join(f"{k} {c:.1f}" for k, c in v["calls_by_owner"].items())
        lines.append(f"   charged to (the nearest library's frame on the stack): {owners}")
        lines.append(f"   {PACKAGE} files crossed, in the order first met (calls per step):")
        lines += [f"     {calls:7.1f}  {path}" for path, calls in v["package_files"].items()]
        lines.append("")
    (args.out / f"{name}.txt").write_text("\n".join(lines))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def launch(argv: list[str], world: int, timeout: float) -> None:
    """Starts ``world`` ranks of this module with ``--worker`` (torchrun's environment)."""
    port = str(_free_port())
    procs = []
    for rank in range(world):
        env = {
            k: v
            for k, v in os.environ.items()
            if not k.startswith(("PL_", "TORCHELASTIC"))
            and k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK", "WORLD_SIZE")
        }
        env.update(
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=port,
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(world),
            LOCAL_WORLD_SIZE=str(world),
            NODE_RANK="0",
            OMP_NUM_THREADS="1",
            PYTHONHASHSEED="0",  # the same set and dict orders, so the same calls, every launch
            PYTHONPATH=os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")]).rstrip(os.pathsep),
            PYTHONUNBUFFERED="1",
        )
        procs.append(
            subprocess.Popen(
                [sys.executable, "-m", "benchmarks.step_calls", *argv, "--worker"],
                cwd=ROOT,
                env=env,
                stdout=None if rank == 0 else subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
        )
    failed = []
    for rank, proc in enumerate(procs):
        try:
            _, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs:
                p.kill()
            raise
        if proc.returncode != 0:
            failed.append(f"rank {rank} exited {proc.returncode}:\n{err[-6000:]}")
    if failed:
        raise RuntimeError("\n".join(failed))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="host_bound")
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--steps", type=int, default=10, help="counted steps")
    p.add_argument("--repeats", type=int, default=2, help="runs of each variant (A B A B)")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--top", type=int, default=40, help="files of all_files kept in the JSON")
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--name", default=None, help="result name (default step_calls[_SIZE])")
    p.add_argument("--timeout", type=float, default=1800)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    unknown = set(args.variants.split(",")) - set(VARIANTS)
    if unknown:
        raise SystemExit(f"--variants: unknown {sorted(unknown)}; choose from {VARIANTS}")
    if args.warmup < 1 or args.steps < 1 or args.repeats < 1:
        raise SystemExit("--warmup, --steps and --repeats must be positive")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    if args.worker:
        worker(args)
        return
    argv = list(sys.argv[1:] if argv is None else argv)
    args.out.mkdir(parents=True, exist_ok=True)
    launch([*argv, "--out", str(args.out.resolve())], args.world, args.timeout)


if __name__ == "__main__":
    main()
