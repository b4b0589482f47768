#!/usr/bin/env bash
# Runs the multi-process core tests against the oldest and the newest supported TorchRec stacks,
# each in its own virtual environment in the repository root (built by scripts/install.sh when
# missing or out of date; a stamp file records the stack it was built for).
#
#   scripts/test_compat.sh [PYTEST_ARGS...]      # e.g. scripts/test_compat.sh -k checkpoint
#   COMPAT_ENVS=oldest scripts/test_compat.sh    # one stack only
#   COMPAT_SRC=../ltr-head scripts/test_compat.sh   # test another checkout (e.g. a worktree of
#       HEAD while this one is mid-edit): pytest runs there with it first on PYTHONPATH
#
# PyPI's Linux torch wheels (all but the tested 2.13.0 CPU build) are CUDA builds that need the
# nvidia-* wheels even to import on CPU (libtorch_cuda.so links libcudnn, libcublas, libnccl, ...),
# so each environment downloads a few GB once. The environments run one after the other.
set -uo pipefail

TESTS=(
    tests/test_strategy_multiprocess.py
    tests/test_checkpoint_multiprocess.py
    tests/test_norms_distributed.py
    tests/test_callbacks_multiprocess.py
    tests/test_faults_multiprocess.py
    tests/test_strategy.py
    tests/test_trust_training.py
    tests/test_trust_checkpoint.py
    tests/test_pipeline.py
    tests/test_pipeline_features.py
    tests/test_key_order.py
    tests/test_lifetime.py
    tests/test_device_checks.py
    tests/test_step_runner.py
    tests/test_lightning_step.py
    tests/test_fabric.py
    tests/test_managed_collision.py
    tests/test_managed_collision_multiprocess.py
    tests/test_mid_epoch.py
    tests/test_sequence.py
    tests/test_sequence_multiprocess.py
    tests/test_torchrun_cluster.py
    # TorchRec's test models on every CPU sharding type; the row-wise types are left out by name
    # where the stack's gloo has no reduce_scatter (torch < 2.8; see its module docstring)
    tests/test_conformance.py
    # Online training: the stream, delta checkpoints and the served model kept fresh by them
    tests/test_stream.py
    tests/test_deltas.py
    tests/test_online.py
    tests/test_fresh.py
    tests/test_fresh_managed.py
)

# name: torch fbgemm-gpu-cpu torchrec [extra requirement files for the torchrec step]
declare -A STACKS=(
    [oldest]="2.11.0 1.6.0 1.6.1 requirements/compat-oldest.txt"
    [newest]="2.14.1 1.9.0 1.9.2"
)
ENVS=(${COMPAT_ENVS:-oldest newest})

root="$(cd "$(dirname "$0")/.." && pwd)"
cd "$root"
summary=()
status=0
for name in "${ENVS[@]}"; do
    read -r torch_v fbgemm_v torchrec_v extra <<<"${STACKS[$name]:?unknown stack $name}"
    venv=".venv-compat-$name"
    stamp="$venv/.installed"
    want="torch==$torch_v fbgemm-gpu-cpu==$fbgemm_v torchrec==$torchrec_v $extra"
    echo "=== $name: $want"
    build="up to date"
    if [ ! -f "$stamp" ] || [ "$(cat "$stamp")" != "$want" ] \
        || [ -n "$(find scripts/install.sh pyproject.toml requirements -newer "$stamp" -print -quit)" ]; then
        start=$SECONDS
        if ! TORCH_VERSION="$torch_v" FBGEMM_VERSION="$fbgemm_v" TORCHREC_VERSION="$torchrec_v" \
            EXTRA_REQUIREMENTS="$extra" INSTALL_DOCS=0 scripts/install.sh "$venv"; then
            echo "=== $name: install failed"
            summary+=("$name: INSTALL FAILED after $((SECONDS - start)) s")
            status=1
            continue
        fi
        echo "$want" >"$stamp"
        build="built in $((SECONDS - start)) s"
        echo "=== $name: $build"
    else
        echo "=== $name: up to date ($stamp)"
    fi
    versions="$("$venv/bin/python" - <<'PY'
from importlib.metadata import version
print(", ".join(f"{d} {version(d)}" for d in
                ("torch", "fbgemm-gpu-cpu", "torchrec", "lightning", "tensordict", "torchmetrics")))
PY
)"
    echo "=== $name: $versions"
    start=$SECONDS
    if [ -n "${COMPAT_SRC:-}" ]; then
        (cd "$COMPAT_SRC" && PYTHONPATH="$COMPAT_SRC${PYTHONPATH:+:$PYTHONPATH}" \
            "$root/$venv/bin/python" -m pytest -x -q "${TESTS[@]}" "$@")
    else
        "$venv/bin/python" -m pytest -x -q "${TESTS[@]}" "$@"
    fi
    rc=$?
    test_s=$((SECONDS - start))
    [ "$rc" = 0 ] || status=1
    summary+=("$name: pytest exit $rc, tests ${test_s} s, env $build ($versions)")
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit "$status"
