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
#
# Another stack (scripts/test_compat.sh builds the oldest and newest supported ones):
#   TORCH_VERSION=2.11.0 FBGEMM_VERSION=1.6.0 TORCHREC_VERSION=1.6.1 scripts/install.sh .venv-x
# Unset, each defaults to its pin in requirements/constraints.txt (the tested stack); a stack
# other than that one is pinned through a constraints file generated from constraints.txt.
# EXTRA_REQUIREMENTS names more requirement files for the torchrec step (e.g. a release's own
# needs, such as iopath for torchrec 1.6); INSTALL_DOCS=0 skips requirements/docs.txt.
set -euo pipefail
venv="${1:-.venv}"
root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
py="${PYTHON:-python3}"
pin() { sed -n "s/^$1==\([^[:space:]#]*\).*/\1/p" requirements/constraints.txt; }
torch_version="${TORCH_VERSION:-$(pin torch)}"
fbgemm_version="${FBGEMM_VERSION:-$(pin fbgemm-gpu-cpu)}"
torchrec_version="${TORCHREC_VERSION:-$(pin torchrec)}"
stack=requirements/stack.txt
constraints=requirements/constraints.txt
if [ "$torch_version" != "$(pin torch)" ] || [ "$fbgemm_version" != "$(pin fbgemm-gpu-cpu)" ] \
    || [ "$torchrec_version" != "$(pin torchrec)" ]; then
    gen="$(mktemp -d)"
    trap 'rm -rf "$gen"' EXIT
    printf 'torch==%s\nfbgemm-gpu-cpu==%s\n' "$torch_version" "$fbgemm_version" >"$gen/stack.txt"
    sed -e "s/^torch==.*/torch==$torch_version/" \
        -e "s/^fbgemm-gpu-cpu==.*/fbgemm-gpu-cpu==$fbgemm_version/" \
        -e "s/^torchrec==.*/torchrec==$torchrec_version/" requirements/constraints.txt \
        >"$gen/constraints.txt"
    stack="$gen/stack.txt"
    constraints="$gen/constraints.txt"
fi
extra=()
for f in ${EXTRA_REQUIREMENTS:-}; do extra+=(-r "$f"); done
[ "${INSTALL_DOCS:-1}" = 0 ] || extra+=(-r requirements/docs.txt)
[ -x "$venv/bin/python" ] || "$py" -m venv "$venv"
pip=("$venv/bin/python" -m pip install --disable-pip-version-check -q)
# shellcheck disable=SC2086
"${pip[@]}" ${TORCH_PIP_ARGS:-} -r "$stack"
"${pip[@]}" --no-deps "torchrec==$torchrec_version"
"${pip[@]}" -c "$constraints" -r requirements/torchrec.txt -r requirements/dev.txt "${extra[@]}"
"${pip[@]}" --no-deps -e .
EXPECT_TORCH="$torch_version" EXPECT_FBGEMM="$fbgemm_version" EXPECT_TORCHREC="$torchrec_version" \
    "$venv/bin/python" - <<'PY'
import fbgemm_gpu, torch, torchrec, lightning  # noqa: F401  # fails loudly on a broken stack
import os
from importlib.metadata import PackageNotFoundError, version
try:
    version("fbgemm-gpu")
    raise SystemExit("the CUDA fbgemm-gpu wheel is installed beside fbgemm-gpu-cpu; remove it")
except PackageNotFoundError:
    pass
for dist, want in (("torch", "EXPECT_TORCH"), ("fbgemm-gpu-cpu", "EXPECT_FBGEMM"),
                   ("torchrec", "EXPECT_TORCHREC")):
    if version(dist).split("+")[0] != os.environ[want]:
        raise SystemExit(f"{dist} {version(dist)} is installed, {os.environ[want]} was asked for")
print(f"stack ok: torch {torch.__version__}, torchrec {version('torchrec')}, "
      f"fbgemm-gpu-cpu {version('fbgemm-gpu-cpu')}, lightning {lightning.__version__}")
PY
