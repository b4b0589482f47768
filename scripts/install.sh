#!/usr/bin/env bash
# Installs the pinned CPU stack and lightning_torchrec (editable) into a virtual environment.
#
#   scripts/install.sh [VENV_DIR]
#
# Order matters: torch and fbgemm-gpu-cpu first, then torchrec with --no-deps plus its needs by
# name, then the rest under constraints that forbid replacing the stack, then this package with
# --no-deps (pip would otherwise resolve torchrec's requirements again and pull CUDA fbgemm-gpu).
# Extra pip arguments for torch (e.g. a CPU index on machines without a local torch wheel) go in
# TORCH_PIP_ARGS, e.g. TORCH_PIP_ARGS="--index-url https://download.pytorch.org/whl/cpu".
set -euo pipefail
venv="${1:-.venv}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# shellcheck disable=SC2086
"${pip[@]}" ${TORCH_PIP_ARGS:-} -r requirements/stack.txt
"${pip[@]}" --no-deps torchrec==1.8.0
"${pip[@]}" -c requirements/constraints.txt -r requirements/torchrec.txt -r requirements/dev.txt \
    -r requirements/docs.txt
"${pip[@]}" --no-deps -e .
"$venv/bin/python" - <<'PY'
import fbgemm_gpu, torch, torchrec, lightning  # noqa: F401  # fails loudly on a broken stack
from importlib.metadata import PackageNotFoundError, version
try:
    version("fbgemm-gpu")
    raise SystemExit("the CUDA fbgemm-gpu wheel is installed beside fbgemm-gpu-cpu; remove it")
except PackageNotFoundError:
    pass
print(f"stack ok: torch {torch.__version__}, torchrec {version('torchrec')}, "
      f"fbgemm-gpu-cpu {version('fbgemm-gpu-cpu')}, lightning {lightning.__version__}")
PY
