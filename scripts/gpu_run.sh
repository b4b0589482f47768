#!/usr/bin/env bash
# One GPU session: install the carried wheels, print versions, run the CUDA checks and/or the
# CUDA pipeline benchmark. Run from anywhere; it works in the repository root.
#
#   scripts/gpu_run.sh [checks|bench|all|setup]      (default: all)
#
# Needs the fbgemm-gpu wheel split in parts named fb.part.* (cat in name order rebuilds it), in
# .gpu/ or $PARTS (default: the system temp folder's parts/, where shared/GPU.md's route copies each part: a carried
# path does not stay in the checkout after its call; a part found in both is taken once), and
# .gpu/small/*.whl (torchrec, torchmetrics, iopath, tensordict, pyvers); installs them into
# $SITE (the system temp folder's site/, once per machine) and runs with PYTHONPATH=$SITE:$PWD. Modules that torchrec or
# this package import but that are not installed (pyre_extensions, portalocker, pyarrow) get
# minimal stubs in $STUBS (site_stubs/ beside it), announced loudly, so that imports work.
#
# Output under $OUT (default ./gpu_out): setup.log, preflight.log, checks.log, bench.log,
# cuda_checks.json, cuda_checks_worker.log, pipeline_throughput_cuda.json: at most 8 files, as
# many as come back from a lent machine's $OUT (the per-check check_*.json, whose entries are in
# cuda_checks.json, and the demo's TensorBoard logs are removed at the end).
#
# Environment (all optional):
#   OUT             output folder
#   PYTHON          interpreter (default python3)
#   DEADLINE        seconds the whole run may take (default 540); each step's `timeout` is cut
#                   to what is left
#   CHECKS_TIMEOUT  seconds for the checks (default 270; with `all`, at most DEADLINE minus
#                   BENCH_MIN)
#   BENCH_MIN       seconds kept for the benchmark after the checks with `all` (default 200)
#   CHECKS_ARGS     extra arguments for benchmarks.cuda_checks (e.g. "--only equality")
#   BENCH_ARGS      arguments for benchmarks.pipeline_throughput after "--accelerator ... --out"
#                   (default below: BENCH_DEFAULT)
#   ACCEL           cuda (default) or cpu (to try this script on a machine without a GPU)
#   SKIP_INSTALL=1  do not install wheels (the environment already has them)
#   FORCE_STUBS     space-separated module names to stub even if installed (testing only)
#
# What only a GPU runs (docs/benchmarks.md, "What only a GPU runs"): the CPU suite runs the rest of
# the same code with CPU tensors standing in. The checks here cover the first three (one rank:
# no vote runs; cuda_checks' bad_step: a bad batch and a NaN loss through the pinned copies):
#   - HostCopy.start (training/device_checks.py): the pinned buffer and torch.cuda.Event of the
#     deferred batch flags (batch_checks="auto" defers on CUDA) and of the recorded loss;
#   - judged_next_step: "auto" judging batches a step later on CUDA only;
#   - TorchRec's stream hand-offs in the train pipelines ("sparse_dist", "semi_sync": TorchRec's
#     own methods; on the CPU compat/pipelines.py overrides three);
#   - not here (two GPUs): collective_device() under nccl (the votes on the GPU) and the vote
#     ahead carrying the previous step's loss (host_runs_ahead, StepMode.loss_after_vote).
# CUDA-only conformance, not yet among the checks (the CPU suite, tests/test_conformance.py,
# cannot run them; the strategy refuses them on CPU by name): TorchRec's TestTowerSparseNN and
# TestTowerCollectionSparseNN with EmbeddingTowerSharder / EmbeddingTowerCollectionSharder (each
# tower's interaction is wrapped in DDP(device_ids=[device])), compared with an unsharded copy
# trained on the global batch as torchrec's sharding_single_rank_test does.
set -uo pipefail

PART="${1:-all}"
case "$PART" in
  checks | bench | all | setup) ;;
  *)
    echo "usage: $0 [checks|bench|all|setup]" >&2
    exit 2
    ;;
esac

cd "$(dirname "$0")/.." || exit 2
ROOT="$PWD"
OUT="${OUT:-$ROOT/gpu_out}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
ACCEL="${ACCEL:-cuda}"
TMPROOT="$(dirname "$(mktemp -u)")" # the system temp folder; kept while the machine is warm
SITE="$TMPROOT/site"
STUBS="$TMPROOT/site_stubs"
WHEELS="$TMPROOT/wheels"
PARTS="${PARTS:-$TMPROOT/parts}" # where the route in shared/GPU.md copies the wheel's parts
DEADLINE="${DEADLINE:-540}"
BENCH_MIN="${BENCH_MIN:-200}"
BENCH_DEFAULT="--devices 1 --sizes benchmark,demo --batch-size 16384,2048 --steps 100 --warmup 20 --rounds 2"
BENCH_ARGS="${BENCH_ARGS:-$BENCH_DEFAULT}"
export PYTHONUNBUFFERED=1
START=$(date +%s)

say() { echo "[gpu_run +$(($(date +%s) - START))s] $*"; }
left() { echo $((DEADLINE - ($(date +%s) - START))); }
cap() { # cap N: N, or the seconds left before the deadline if fewer (at least 10)
  local n=$1 l
  l=$(left)
  ((l < n)) && n=$l
  ((n < 10)) && n=10
  echo "$n"
}

install_wheels() {
  if [[ -f "$SITE/.installed" ]]; then
    say "wheels already installed in $SITE"
    return 0
  fi
  local small=(.gpu/small/*.whl) name part parts=()
  local -A seen=()
  while IFS= read -r part; do # each part name once, in name order, from either folder
    [[ -n "${seen[${part##*/}]:-}" ]] && continue
    seen[${part##*/}]=1
    parts+=("$part")
  done < <(for part in .gpu/fb.part.* "$PARTS"/fb.part.*; do
    [[ -f "$part" ]] && printf '%s\t%s\n' "${part##*/}" "$part"
  done | sort -t $'\t' -k1,1 -s | cut -f2)
  if ((${#parts[@]} == 0)); then
    say "ERROR: no fb.part.* in .gpu/ ($ROOT) nor in $PARTS"
    return 1
  fi
  rm -rf "$SITE" # a half-finished earlier install: pip --target would skip what exists
  mkdir -p "$WHEELS" "$SITE"
  say "assembling fbgemm-gpu from ${#parts[@]} parts: ${parts[*]}"
  cat "${parts[@]}" >"$WHEELS/fbgemm.zip" || return 1
  # pip wants the wheel's real file name: {dist-info name}-{first tag}.whl, read from the wheel
  name=$("$PY" - "$WHEELS/fbgemm.zip" <<'EOF'
import sys
import zipfile

z = zipfile.ZipFile(sys.argv[1])
info = next(n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/WHEEL"))
tags = [l.split(":", 1)[1].strip() for l in z.read(info).decode().splitlines() if l.startswith("Tag:")]
print(f"{info.split('/')[0][: -len('.dist-info')]}-{tags[0]}.whl")
EOF
  ) || {
    say "ERROR: the assembled fbgemm-gpu wheel is not a readable wheel"
    return 1
  }
  mv "$WHEELS/fbgemm.zip" "$WHEELS/$name"
  say "installing $WHEELS/$name and ${small[*]} into $SITE"
  if ! "$PY" -m pip install -q --no-index --no-deps --target "$SITE" "$WHEELS/$name" "${small[@]}"; then
    say "pip failed: unpacking the wheels into $SITE instead (a wheel is a zip of the package)"
    for w in "$WHEELS/$name" "${small[@]}"; do
      "$PY" -m zipfile -e "$w" "$SITE" || return 1
    done
  fi
  touch "$SITE/.installed"
  say "installed: $(ls "$SITE" | grep -v -e '^bin$' -e '__pycache__' | tr '\n' ' ')"
}

# The preflight: prints versions and the GPU, stubs missing pure-Python imports (into $STUBS,
# already on PYTHONPATH), then imports the package and both benchmark modules.
write_preflight() {
  cat >"$TMPROOT/gpu_run_preflight.py" <<'EOF'
import importlib
import importlib.metadata as md
import os
import sys
from pathlib import Path

stubs = Path(os.environ["STUBS"])
force = set(os.environ.get("FORCE_STUBS", "").split())
STUB = {
    # torchrec 1.6.1 imports none_throws (and ParameterSpecification in test_utils)
    "pyre_extensions": (
        "from typing import ParamSpec\n"
        "def none_throws(optional, message='Unexpected `None`'):\n"
        "    if optional is None:\n"
        "        raise AssertionError(message)\n"
        "    return optional\n"
        "def ParameterSpecification(name):\n"
        "    return ParamSpec(name)\n"
        "def safe_cast(new_type, value):\n"
        "    return value\n"
    ),
    # iopath imports portalocker at import time; only its file locks use it
    "portalocker": (
        "LOCK_EX, LOCK_SH, LOCK_NB, LOCK_UN = 2, 1, 4, 8\n"
        "class LockException(Exception):\n"
        "    pass\n"
        "class Lock:\n"
        "    def __init__(self, *args, **kwargs):\n"
        "        raise LockException('portalocker is a stub here (scripts/gpu_run.sh)')\n"
        "def lock(*args, **kwargs):\n"
        "    raise LockException('portalocker is a stub here (scripts/gpu_run.sh)')\n"
        "def unlock(*args, **kwargs):\n"
        "    pass\n"
    ),
    # lightning_torchrec.data imports pyarrow for its Parquet/Criteo readers (unused here)
    "pyarrow": (
        "__version__ = '0+stub'\n"
        "def __getattr__(name):\n"
        "    raise AttributeError(f'pyarrow is a stub here (scripts/gpu_run.sh): no {name}')\n"
    ),
}
SUBMODULES = {"pyarrow": ["compute", "parquet", "csv"]}


def version(dist):
    try:
        return md.version(dist)
    except md.PackageNotFoundError:
        return None


stubbed = []
for mod, text in STUB.items():
    if mod not in force:
        try:
            importlib.import_module(mod)
            continue
        except Exception as e:  # missing, or broken
            print(f"  cannot import {mod}: {e!r}")
    pkg = stubs / mod
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text('"""Stub written by scripts/gpu_run.sh."""\n' + text)
    for sub in SUBMODULES.get(mod, []):
        (pkg / f"{sub}.py").write_text(f"from {mod} import __getattr__  # noqa: F401\n")
    stubbed.append(mod)
if stubbed:
    print(f"!!! STUBBED (not installed here): {stubbed} -> {stubs}", flush=True)
    importlib.invalidate_caches()

print("python", sys.version.split()[0], sys.executable)
for dist in (
    "torch", "lightning", "pytorch-lightning", "torchrec", "fbgemm-gpu", "fbgemm-gpu-cpu",
    "torchmetrics", "tensordict", "pyvers", "iopath", "numpy", "tensorboard", "jsonargparse",
    "pyre-extensions", "portalocker", "pyarrow", "typing-extensions",
):
    print(f"  {dist:18s} {version(dist)}")
import torch

print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print(
        f"device {torch.cuda.get_device_name()} cc {p.major}.{p.minor} "
        f"{p.total_memory / 2**30:.1f} GiB, count {torch.cuda.device_count()}"
    )
import fbgemm_gpu
import torchrec
from lightning.pytorch.cli import _JSONARGPARSE_SIGNATURES_AVAILABLE as cli

import benchmarks.cuda_checks
import benchmarks.pipeline_throughput  # noqa: F401
import lightning_torchrec
from lightning_torchrec.training.pipelines import PIPELINES

print("fbgemm_gpu", getattr(fbgemm_gpu, "__version__", "?"), "from", fbgemm_gpu.__file__)
print("torchrec from", torchrec.__file__, "| lightning_torchrec from", lightning_torchrec.__file__)
print("pipelines", PIPELINES, "| LightningCLI usable:", bool(cli))
if torch.cuda.is_available():
    x = torch.ones(4, device="cuda")
    print("cuda tensor ok:", float(x.sum()))
print("PREFLIGHT OK")
EOF
}

run_step() { # run_step NAME SECONDS CMD...: timeout, unbuffered, tee'd into $OUT/NAME.log
  local name=$1 secs=$2 rc
  shift 2
  say "$name: timeout ${secs}s: $*"
  timeout -k 15 "$secs" "$@" 2>&1 | tee "$OUT/$name.log"
  rc=${PIPESTATUS[0]}
  if ((rc == 124 || rc == 137)); then
    say "$name: TIMED OUT after ${secs}s (rc $rc); partial results stay in $OUT"
  else
    say "$name: exit code $rc"
  fi
  return "$rc"
}

{
  say "part=$PART accel=$ACCEL out=$OUT deadline=${DEADLINE}s root=$ROOT"
  command -v nvidia-smi >/dev/null && nvidia-smi -L
  if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
    install_wheels || {
      say "ERROR: installing the wheels failed"
      exit 3
    }
  fi
} 2>&1 | tee "$OUT/setup.log"
((PIPESTATUS[0] == 0)) || exit 3

if [[ "${SKIP_INSTALL:-0}" != 1 ]]; then
  export PYTHONPATH="$SITE:$ROOT:$STUBS${PYTHONPATH:+:$PYTHONPATH}"
else
  export PYTHONPATH="$ROOT:$STUBS${PYTHONPATH:+:$PYTHONPATH}"
fi
if [[ -n "${FORCE_STUBS:-}" ]]; then
  export PYTHONPATH="$STUBS:$PYTHONPATH" # testing: stubs shadow the installed modules
fi
rm -rf "$STUBS"
mkdir -p "$STUBS"
write_preflight
export STUBS FORCE_STUBS="${FORCE_STUBS:-}"
run_step preflight "$(cap 120)" "$PY" "$TMPROOT/gpu_run_preflight.py" || {
  say "ERROR: preflight failed (see $OUT/preflight.log); nothing else runs"
  exit 4
}

status=0
if [[ "$PART" == checks || "$PART" == all ]]; then
  secs=${CHECKS_TIMEOUT:-270}
  if [[ "$PART" == all ]]; then
    l=$(($(left) - BENCH_MIN))
    ((l < secs)) && secs=$l
  fi
  # shellcheck disable=SC2086
  run_step checks "$(cap "$secs")" "$PY" -m benchmarks.cuda_checks --out "$OUT" \
    --accelerator "$ACCEL" ${CHECKS_ARGS:-} || status=1
fi
if [[ "$PART" == bench || "$PART" == all ]]; then
  # shellcheck disable=SC2086
  run_step bench "$(cap $(($(left) - 5)))" "$PY" -m benchmarks.pipeline_throughput \
    --accelerator "$ACCEL" --out "$OUT" $BENCH_ARGS || status=1
fi
# What comes back from a lent machine's $OUT is at most 8 files, 2 folders down: drop the copies.
if [[ -f "$OUT/cuda_checks.json" ]]; then
  rm -f "$OUT"/check_*.json
fi
rm -rf "$OUT/demo"
say "done (status $status); results in $OUT:"
ls -la "$OUT"
exit "$status"
