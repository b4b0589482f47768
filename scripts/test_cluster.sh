#!/usr/bin/env bash
# make test-cluster: SLURM for real, on this host. Needs root on Debian/Ubuntu (installs
# slurm-wlm and munge with apt-get when missing).
#
# 1. starts munged, slurmctld -D and slurmd -D in the background with a one-node, 2-CPU,
#    cgroup-free slurm.conf under a temporary folder (torn down at exit, even on failure);
# 2. runs the batch script below once to the end (the reference), then again, sending SLURM's
#    requeue signal (scancel --signal=USR1) mid-epoch: the ranks save hpc_ckpt_1.ckpt between
#    steps, rank 0 runs `scontrol requeue`, SLURM restarts the job, and fit resumes from it;
# 3. checks that the job was requeued once and that the resumed run is bit-equal to the
#    reference (losses after the resume, weight shards, optimizer state), on both ranks.
#
# Environment: PY (python with the package's requirements; default .venv/bin/python),
# CLUSTER_STEPS (training steps, default 120), SIGNAL_AT (step after which to signal, 30),
# KEEP=1 keeps the temporary folder (logs, checkpoints) for inspection.
set -euo pipefail

ROOT=$(cd "$(dirname "$0")/.." && pwd)
PY=${PY:-$ROOT/.venv/bin/python}
PY=$(cd "$(dirname "$PY")" && pwd)/$(basename "$PY")
export CLUSTER_STEPS=${CLUSTER_STEPS:-120}
SIGNAL_AT=${SIGNAL_AT:-30}
START=$(date +%s)

say() { echo "[test-cluster $(($(date +%s) - START))s] $*"; }
fail() { say "FAILED: $*"; exit 1; }

[ "$(id -u)" = 0 ] || fail "needs root (it starts munged, slurmctld and slurmd)"
# Packages this run installs are removed at exit (KEEP_SLURM=1 keeps them): with `srun` on the
# PATH, Lightning warns in every process that is not started by srun, which the test suite's
# clean-stderr checks count as a warning.
INSTALLED=()
missing=()
for cmd in munged slurmctld slurmd sbatch srun scontrol scancel sinfo; do
  command -v "$cmd" >/dev/null || missing+=("$cmd")
done
if [ ${#missing[@]} -gt 0 ]; then
  say "installing slurm-wlm and munge (missing: ${missing[*]})"
  command -v apt-get >/dev/null || fail "no apt-get: install slurm-wlm and munge by hand"
  before=$(dpkg-query -W -f='${Package}\n' | sort)
  APT_LOG=$(mktemp -t test-cluster-apt.XXXXXX)
  DEBIAN_FRONTEND=noninteractive apt-get install -y --no-install-recommends slurm-wlm munge \
    >"$APT_LOG" 2>&1 || fail "apt-get install failed: see $APT_LOG"
  mapfile -t INSTALLED < <(comm -13 <(echo "$before") <(dpkg-query -W -f='${Package}\n' | sort))
fi
say "$(slurmctld -V), munge $(munged -V 2>&1 | awk '{print $1}' | sed 's/munge-//')"

PIDS=()
cleanup() {
  local status=$?
  set +e
  if [ -n "${SLURM_CONF:-}" ] && [ -f "$SLURM_CONF" ]; then
    scancel --full --quiet --user=root >/dev/null 2>&1
  fi
  for ((i = ${#PIDS[@]} - 1; i >= 0; i--)); do
    kill "${PIDS[i]}" 2>/dev/null
  done
  for pid in "${PIDS[@]}"; do
    for _ in $(seq 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    kill -9 "$pid" 2>/dev/null
  done
  if [ "$status" != 0 ]; then
    for log in "$WORK"/log/*.log "$WORK"/*/slurm-*.out; do
      [ -f "$log" ] && { echo "----- $log (tail)"; tail -n 25 "$log"; }
    done
  fi
  if [ "${KEEP:-0}" = 1 ]; then say "kept $WORK"; else rm -rf "$WORK"; fi
  if [ ${#INSTALLED[@]} -gt 0 ] && [ "${KEEP_SLURM:-0}" != 1 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get purge -y "${INSTALLED[@]}" >>"$APT_LOG" 2>&1 &&
      say "removed the packages this run installed: ${INSTALLED[*]}"
  fi
  say "daemons stopped; exit status $status"
}
trap cleanup EXIT
trap 'exit 130' INT TERM
WORK=$(mktemp -d -t lightning-torchrec-slurm.XXXXXX)
chmod 700 "$WORK"

free_port() { "$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }

# ---------------------------------------------------------------- munge
mkdir -p "$WORK/munge" "$WORK/state" "$WORK/spool" "$WORK/log"
chmod 700 "$WORK/munge"
dd if=/dev/urandom of="$WORK/munge/munge.key" bs=1 count=1024 status=none
chmod 400 "$WORK/munge/munge.key"
MUNGE_SOCKET=$WORK/munge/munge.socket
munged --foreground --force --key-file="$WORK/munge/munge.key" --socket="$MUNGE_SOCKET" \
  --pid-file="$WORK/munge/munged.pid" --seed-file="$WORK/munge/munged.seed" \
  --log-file="$WORK/log/munged.log" >"$WORK/log/munged.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do [ -S "$MUNGE_SOCKET" ] && break; sleep 0.1; done
munge -S "$MUNGE_SOCKET" -n | unmunge -S "$MUNGE_SOCKET" >/dev/null ||
  fail "munged does not answer on $MUNGE_SOCKET: $(cat "$WORK/log/munged.out")"

# ---------------------------------------------------------------- slurm.conf
HOST=$(hostname -s)
export SLURM_CONF=$WORK/slurm.conf
cat >"$SLURM_CONF" <<EOF
# One node ($HOST), 2 CPUs, no cgroups: processes are tracked through /proc.
ClusterName=lightning-torchrec
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
SlurmctldPort=$(free_port)
SlurmdPort=$(free_port)
AuthType=auth/munge
CredType=cred/munge
# cred_expire: a requeued job waits this long before it may start again (default 120 s).
AuthInfo=socket=$MUNGE_SOCKET,cred_expire=10
StateSaveLocation=$WORK/state
SlurmdSpoolDir=$WORK/spool
SlurmctldPidFile=$WORK/slurmctld.pid
SlurmdPidFile=$WORK/slurmd.pid
SlurmctldLogFile=$WORK/log/slurmctld.log
SlurmdLogFile=$WORK/log/slurmd.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
# Look at pending jobs every 5 s (default 60 s), so the requeued job starts soon after its delay.
SchedulerParameters=sched_interval=5
MpiDefault=none
MailProg=/bin/true
ReturnToService=2
JobRequeue=1
KillWait=30
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=2 State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -D -f "$SLURM_CONF" >"$WORK/log/slurmctld.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 100); do scontrol ping >/dev/null 2>&1 && break; sleep 0.2; done
scontrol ping >/dev/null 2>&1 || fail "slurmctld does not answer: $(tail -n 5 "$WORK/log/slurmctld.out")"
slurmd -D -f "$SLURM_CONF" >"$WORK/log/slurmd.out" 2>&1 &
PIDS+=($!)
for _ in $(seq 150); do
  sinfo -h -n "$HOST" -o %t 2>/dev/null | grep -qx idle && break
  sleep 0.2
done
sinfo -h -n "$HOST" -o %t | grep -qx idle ||
  fail "node $HOST is not idle: $(sinfo -h -N -o '%N %t %E'); $(tail -n 5 "$WORK/log/slurmd.out")"
say "munged, slurmctld and slurmd up: $(sinfo -h -o '%P %a %D %t %N')"

# ---------------------------------------------------------------- the job
"$PY" "$ROOT/scripts/make_click_files.py" "$WORK/files" --rows-per-day 10 --days 1 \
  --parquet-rows 6000 --parquet-files 3 --row-group-size 1000 >/dev/null
cat >"$WORK/train.sbatch" <<EOF
#!/bin/bash
#SBATCH --job-name=recsys
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=2
#SBATCH --cpus-per-task=1
#SBATCH --requeue
#SBATCH --signal=SIGUSR1@90
#SBATCH --open-mode=append
echo "job \$SLURM_JOB_ID attempt \${SLURM_RESTART_COUNT:-0} on \$SLURM_JOB_NODELIST"
export PYTHONPATH="$ROOT"
srun "$PY" -m tests.cluster.slurm_fit "\$RUN_DIR" "$WORK/files"
EOF

job_field() { scontrol show job "$1" | grep -o "$2=[^ ]*" | head -n1 | cut -d= -f2; }

wait_done() { # job, seconds: waits until the job has finished; prints its final state
  local state
  for _ in $(seq "$2"); do
    state=$(job_field "$1" JobState)
    case $state in COMPLETED | FAILED | CANCELLED | TIMEOUT | NODE_FAIL | OUT_OF_MEMORY | BOOT_FAIL | DEADLINE)
      echo "$state"; return 0 ;;
    esac
    sleep 1
  done
  echo "still $(job_field "$1" JobState) after $2 s"
}

submit() { # run directory -> job id
  mkdir -p "$1"
  RUN_DIR=$1 sbatch --parsable --output="$1/slurm-%j.out" "$WORK/train.sbatch"
}

# The reference: one attempt, to the end.
t0=$(date +%s)
job=$(submit "$WORK/full")
state=$(wait_done "$job" 600)
[ "$state" = COMPLETED ] || fail "reference job $job: $state"
say "reference job $job: COMPLETED, $CLUSTER_STEPS steps in $(($(date +%s) - t0)) s"

# The same job, sent SLURM's requeue signal mid-epoch.
t0=$(date +%s)
RUN=$WORK/preempted
job=$(submit "$RUN")
for _ in $(seq 1200); do
  [ "$(cat "$RUN/progress" 2>/dev/null || echo 0)" -ge "$SIGNAL_AT" ] && break
  [ "$(job_field "$job" JobState)" = RUNNING ] || [ "$(job_field "$job" JobState)" = PENDING ] ||
    fail "job $job ended before step $SIGNAL_AT: $(job_field "$job" JobState)"
  sleep 0.5
done
say "job $job at step $(cat "$RUN/progress"): scancel --signal=USR1 $job"
scancel --signal=USR1 "$job"
for _ in $(seq 300); do [ "$(job_field "$job" Restarts)" -ge 1 ] && break; sleep 0.5; done
[ "$(job_field "$job" Restarts)" -ge 1 ] || fail "job $job was not requeued"
say "job $job requeued ($(job_field "$job" JobState), Restarts=$(job_field "$job" Restarts))"
state=$(wait_done "$job" 900)
[ "$state" = COMPLETED ] || fail "requeued job $job: $state"
restarts=$(job_field "$job" Restarts)
[ "$restarts" = 1 ] || fail "job $job restarted $restarts times, expected 1"
grep -h "Requeue signal\|Restoring states" "$RUN/slurm-$job.out" | sed 's/^/    /'
say "job $job: COMPLETED after 1 requeue, $(($(date +%s) - t0)) s"

PYTHONPATH=$ROOT "$PY" -m tests.cluster.compare "$WORK/full" "$RUN" || fail "the requeued run is not exact"
say "PASSED"
