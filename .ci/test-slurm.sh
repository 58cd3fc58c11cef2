#!/usr/bin/env bash
# `make test-slurm`: runs/slurm.sh under a real SLURM, set up on this machine for the test.
#
# 1. Installs what is missing (Debian: slurm-wlm munge; needs root).
# 2. Starts a private one-node cluster in a temporary folder: munged on its own socket and
#    key, slurmctld and slurmd on their own ports with a slurm.conf for this host
#    (`slurmd -C`), no cgroups (proctrack/linuxproc, task/none), MpiDefault=pmix (srun
#    starts the Open MPI ranks through PMIx). The daemons read no configuration under
#    /etc, and daemons the system may run (its own munged or slurmd) are left alone.
# 3. Runs the template with sbatch, 2 tasks, a small config (16x16 cells, 2 layers, 2 heads):
#    a. forward, into $PDEFORMER_OUT: completed, 2 ranks (one MPI job, not 2 singletons);
#    b. train (16 steps), into the default folder ($SCRATCH/pdeformer/default), in a
#       3-minute job with a guard margin leaving a few seconds: stopped by the guard
#       (status walltime, checkpoint) before the last step;
#    c. the same command with --restart in a 10-minute job (default margin): completed,
#       continuing from the checkpoint in the same folder;
#    and compares c's history.csv with that of an uninterrupted `mpirun -n 2 pdeformer
#    train` of the same config: the same steps, every column but wall_time equal to 1e-12
#    (relative).
# 4. Stops every daemon and job it started (also on failure, Ctrl-C or TERM) and removes the
#    temporary folder (kept on failure, with its logs, and its path printed; kept also
#    with TEST_SLURM_KEEP=1).
# Exit status 0 when all checks pass, 1 otherwise (with a line saying which failed).
set -euo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

say() { echo "test-slurm: $*"; }
fail() { echo "test-slurm: FAILED: $*" >&2; exit 1; }

NTASKS=2
SMALL=(mesh.cells=[16,16] model.layers=2 model.heads=2)
STEPS=${TEST_SLURM_STEPS:-16}
MPI=${TEST_SLURM_MPI:-pmix}            # srun's MPI plugin (MpiDefault)
CTLD_PORT=${TEST_SLURM_PORT:-16817}    # slurmd listens on the next port
PDEFORMER=$repo/.venv/bin/pdeformer
PY=$repo/.venv/bin/python

[ "$(id -u)" = 0 ] || fail "needs root (installs Debian packages, runs slurmd that starts jobs)"
[ -x "$PDEFORMER" ] || fail "no $PDEFORMER: run make setup"

# ---- 1. packages ---------------------------------------------------------------------
PACKAGES=(slurm-wlm munge)   # slurmctld, slurmd, slurm-client, the mpi plugins (pmix)
missing=()
for p in "${PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if (( ${#missing[@]} )); then
  command -v apt-get >/dev/null || fail "missing ${missing[*]} and no apt-get"
  say "installing Debian packages: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  apt-get update -qq >/dev/null || fail "apt-get update failed"
  apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null \
    || fail "apt-get install ${missing[*]} failed"
fi
for c in munged munge unmunge slurmctld slurmd sbatch squeue sinfo scancel srun; do
  command -v "$c" >/dev/null || fail "no $c after installing ${PACKAGES[*]}"
done

# ---- 2. a private one-node cluster -----------------------------------------------------
tmp=$(mktemp -d /tmp/pdeformer-slurm.XXXXXX)
chmod 700 "$tmp"
export SLURM_CONF=$tmp/slurm.conf      # every slurm command and job of this test reads it
ok=0

# processes of this test: the daemons (pid files) and anything that inherited SLURM_CONF
# (slurmstepd, job scripts, ranks); never other processes
ours() {
  local f pid
  for f in /proc/[0-9]*/environ; do
    pid=${f#/proc/}; pid=${pid%/environ}
    [ "$pid" = $$ ] || [ "$pid" = "$BASHPID" ] && continue
    { tr '\0' '\n' <"$f"; } 2>/dev/null | grep -qxF "SLURM_CONF=$SLURM_CONF" && echo "$pid"
  done
  return 0
}
stop_pid() {  # TERM, up to 10 s, then KILL
  local pid=$1 i
  kill -TERM "$pid" 2>/dev/null || return 0
  for i in $(seq 50); do kill -0 "$pid" 2>/dev/null || return 0; sleep 0.2; done
  kill -KILL "$pid" 2>/dev/null || true
}
cleanup() {
  local rc=$? pid f i
  trap - EXIT INT TERM
  if [ -f "$tmp/slurmctld.pid" ] && command -v scancel >/dev/null; then
    scancel --quiet --full $(squeue -h -o %i 2>/dev/null) 2>/dev/null || true
    for i in $(seq 30); do [ -z "$(squeue -h -o %i 2>/dev/null)" ] && break; sleep 1; done
  fi
  for f in slurmd slurmctld munged; do
    [ -s "$tmp/$f.pid" ] && stop_pid "$(cat "$tmp/$f.pid")"
  done
  for pid in $(ours); do stop_pid "$pid"; done
  if [ -n "$(ours)" ]; then echo "test-slurm: processes left running: $(ours)" >&2; rc=1; fi
  if [ "$ok" = 1 ] && [ "$rc" = 0 ]; then
    if [ -n "${TEST_SLURM_KEEP:-}" ]; then say "daemons stopped; files kept in $tmp"; else rm -rf "$tmp"; fi
  else
    for f in "$tmp"/log/*.log "$tmp"/jobs/*.out; do
      [ -f "$f" ] && { echo "---- $f (last 15 lines)"; tail -n 15 "$f"; } >&2
    done
    echo "test-slurm: daemons stopped; logs, configs and outputs kept in $tmp" >&2
    [ "$rc" = 0 ] && rc=1
  fi
  exit "$rc"
}
trap cleanup EXIT
trap 'fail "interrupted"' INT TERM

mkdir -p "$tmp"/{munge,log,state,spool,jobs,out}
chmod 755 "$tmp/munge"   # munged wants its socket's folder open to all (only root uses it)

# munge: its own key and socket
dd if=/dev/urandom of="$tmp/munge/munge.key" bs=1024 count=1 status=none
chmod 400 "$tmp/munge/munge.key"
socket=$tmp/munge/munge.socket
munged --force --key-file="$tmp/munge/munge.key" --socket="$socket" \
  --pid-file="$tmp/munged.pid" --log-file="$tmp/log/munged.log" --seed-file="$tmp/munge/seed" \
  || fail "munged did not start (see $tmp/log/munged.log)"
for i in $(seq 50); do [ -S "$socket" ] && break; sleep 0.1; done
munge -n -S "$socket" | unmunge -S "$socket" >/dev/null || fail "munge does not work"

# slurm.conf: this host as it is (`slurmd -C`: name, CPUs, sockets, cores, memory)
node=$(slurmd -C | head -n 1)
[[ "$node" =~ ^NodeName=([^ ]+)\  ]] || fail "slurmd -C said '$node'"
host=${BASH_REMATCH[1]}
cat >"$SLURM_CONF" <<EOF
# one-node test cluster of pdeformer's make test-slurm
ClusterName=pdeformer-test
SlurmctldHost=$host
SlurmctldPort=$CTLD_PORT
SlurmdPort=$((CTLD_PORT + 1))
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$socket
CredType=cred/munge
StateSaveLocation=$tmp/state
SlurmdSpoolDir=$tmp/spool
SlurmctldPidFile=$tmp/slurmctld.pid
SlurmdPidFile=$tmp/slurmd.pid
SlurmctldLogFile=$tmp/log/slurmctld.log
SlurmdLogFile=$tmp/log/slurmd.log
SlurmctldDebug=info
SlurmdDebug=info
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
MpiDefault=$MPI
ReturnToService=2
KillWait=10
$node State=UNKNOWN
PartitionName=test Nodes=$host Default=YES MaxTime=INFINITE State=UP
EOF

slurmctld -c || fail "slurmctld did not start"
slurmd || fail "slurmd did not start"
for i in $(seq 60); do
  state=$(sinfo -h -n "$host" -o %T 2>/dev/null || true)
  [ "$state" = idle ] && break
  sleep 1
done
[ "$state" = idle ] || fail "node $host is '${state:-not known}' after 60 s, not idle"
say "one-node cluster up: node $host ($(sed 's/^NodeName=[^ ]* //; s/ *$//' <<<"$node")), MpiDefault=$MPI, in $tmp"

# ---- 3. the jobs --------------------------------------------------------------------------
# long commands run in the background and are waited for, so that a signal to this
# script (not only Ctrl-C) cleans up at once
bg() { local log=$1; shift; "$@" >"$log" 2>&1 & wait $!; }   # bg LOG COMMAND...
# submit LABEL SBATCH-ARGS...: sbatch --wait, with the environment given before it
submit() {
  local label=$1; shift
  local start rc=0 id
  start=$(date +%s)
  bg "$tmp/jobs/$label.sbatch" sbatch --parsable --wait --job-name="$label" --ntasks=$NTASKS \
    --output="$tmp/jobs/$label-%j.out" "$@" || rc=$?
  id=$(head -n 1 "$tmp/jobs/$label.sbatch"); id=${id%%[!0-9]*}
  say "job $label ($id): exit $rc in $(( $(date +%s) - start )) s"
  if [ "$rc" != 0 ]; then
    cat "$tmp/jobs/$label.sbatch" "$tmp/jobs/$label-$id.out" >&2 2>/dev/null || true
    fail "job $label: sbatch --wait ended with exit status $rc"
  fi
  echo "$id" >"$tmp/jobs/$label.id"
}
field() {  # field SUMMARY.JSON KEY... -> the value
  "$PY" - "$@" <<'EOF'
import json, sys
v = json.load(open(sys.argv[1]))
for k in sys.argv[2:]:
    v = v[k]
print(v)
EOF
}

export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$HOME/.cache}

# reference: an uninterrupted training of the same config under mpirun, no guard
MPIRUN=(mpirun -n $NTASKS)
mpirun --version 2>/dev/null | grep -q "Open MPI" && MPIRUN+=(--oversubscribe --allow-run-as-root)
start=$(date +%s)
bg "$tmp/log/reference.log" "${MPIRUN[@]}" "$PDEFORMER" train runs/default.toml -q \
  --set "${SMALL[@]}" train.steps=$STEPS output.dir="$tmp/out/reference" \
  || { cat "$tmp/log/reference.log" >&2; fail "the reference training failed"; }
say "reference training ($STEPS steps, mpirun -n $NTASKS): $(( $(date +%s) - start )) s"
# the guard's budget: 1.5 steps of the reference, at least 3 s (the template reads the
# time left a second or so into the job). The first step always runs, and any stop before
# the last will do; the margin keeps it well before the last if the machine's load changes.
step_s=$("$PY" -c 'import csv, sys; w = [float(r["wall_time"]) for r in csv.DictReader(open(sys.argv[1]))]; print(max(w[-1] - w[0], 0.1) / (len(w) - 1))' "$tmp/out/reference/history.csv")
budget=$("$PY" -c 'import math, sys; print(max(3, math.ceil(1.5 * float(sys.argv[1]))))' "$step_s")
(( budget < 60 )) || fail "a training step takes $step_s s: too slow for a 3-minute job"

# a. forward, into PDEFORMER_OUT
PDEFORMER_OUT=$tmp/out/forward submit forward --time=00:05:00 \
  runs/slurm.sh forward runs/default.toml --set "${SMALL[@]}"
s=$tmp/out/forward/summary.json
[ -f "$s" ] || fail "forward: no $s (PDEFORMER_OUT not used?)"
[ "$(field "$s" status)" = completed ] || fail "forward: status $(field "$s" status)"
ranks=$(field "$s" parallel ranks)
[ "$ranks" = $NTASKS ] || fail "forward: $ranks rank(s) in the MPI job, not $NTASKS (srun --mpi=$MPI did not start one MPI job)"
say "a. forward: completed on $ranks ranks, output in \$PDEFORMER_OUT"

# b. train in a 3-minute job (start-up under load can take a minute), the guard leaving
#    about $budget s: stopped by the guard
train=$tmp/scratch/pdeformer/default
SCRATCH=$tmp/scratch PDEFORMER_GUARD_MARGIN=$((180 - budget)) submit train --time=00:03:00 \
  runs/slurm.sh train runs/default.toml --set "${SMALL[@]}" train.steps=$STEPS
id=$(cat "$tmp/jobs/train.id")
grep -q "^slurm.sh: walltime guard [0-9]" "$tmp/jobs/train-$id.out" || fail "train: the template set no walltime guard"
s=$train/summary.json
[ -f "$s" ] || fail "train: no $s (the output folder is not named by the config)"
[ "$(field "$s" status)" = walltime ] \
  || fail "train: status $(field "$s" status), not walltime (guard budget $budget s, steps of ~$step_s s)"
[ -f "$train/checkpoint.npz" ] || fail "train: stopped by the guard without checkpoint.npz"
rows=$(( $(wc -l <"$train/history.csv") - 1 ))
(( rows >= 1 && rows < STEPS + 1 )) || fail "train: $rows history rows after the guard's stop"
say "b. train: stopped by the guard before step $rows of 0..$STEPS ($(grep -o 'walltime guard [0-9]* s' "$tmp/jobs/train-$id.out")), checkpoint written"

# c. the same command with --restart: continues in the same folder
SCRATCH=$tmp/scratch submit restart --time=00:10:00 \
  runs/slurm.sh train runs/default.toml --set "${SMALL[@]}" train.steps=$STEPS --restart
[ "$(field "$s" status)" = completed ] || fail "restart: status $(field "$s" status)"
[ "$(field "$s" restarted_at)" = "$rows" ] \
  || fail "restart: restarted at step $(field "$s" restarted_at), the guard stopped before step $rows"
say "c. restart: completed from step $rows"

"$PY" - "$tmp/out/reference/history.csv" "$train/history.csv" <<'EOF' || fail "the history after --restart differs from the uninterrupted run"
import csv, sys
ref, got = (list(csv.DictReader(open(f))) for f in sys.argv[1:3])
if [r["step"] for r in ref] != [r["step"] for r in got]:
    sys.exit(f"steps {[r['step'] for r in got]} instead of {[r['step'] for r in ref]}")
worst = {}
for a, b in zip(ref, got):
    for c in a:
        if c in ("step", "wall_time"):
            continue
        x, y = float(a[c]), float(b[c])
        worst[c] = max(worst.get(c, 0.0), abs(x - y) / max(abs(x), abs(y), 1e-300) if x != y else 0.0)
print("test-slurm: history vs uninterrupted run, largest relative difference per column: "
      + ", ".join(f"{c} {w:.1e}" for c, w in worst.items()))
bad = {c: w for c, w in worst.items() if w > 1e-12}
if bad:
    sys.exit(f"columns beyond 1e-12: {bad}")
EOF

ok=1
say "all checks passed"
