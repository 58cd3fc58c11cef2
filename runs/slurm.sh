#!/bin/bash
# pdeformer batch job (SLURM template).
#
#   sbatch --ntasks=32 --time=04:00:00 runs/slurm.sh train runs/default.toml [--set key=value ...]
#   sbatch --ntasks=32 --time=04:00:00 runs/slurm.sh train runs/default.toml --restart
#   sbatch --ntasks=8  --time=01:00:00 runs/slurm.sh converge runs/studies/mesh.toml
#
# The output folder is named by the run, not the job, so that a resubmission finds it:
# $PDEFORMER_OUT if set, else ${SCRATCH:-runs/output}/pdeformer/<config name> (the config's
# file name without .toml). A training stopped by the walltime guard continues with the
# same command and --restart; give other runs of the same config their own folder
# (PDEFORMER_OUT=... sbatch ...). Relative paths are relative to the submit directory.
#
# Walltime guard (train, converge): the job's time left (squeue) minus
# $PDEFORMER_GUARD_MARGIN seconds (default 300) is passed as --walltime.
#
# Build the environment once on a login node first: module load ...; make setup
#SBATCH --job-name=pdeformer
#SBATCH --output=pdeformer-%j.out
#SBATCH --ntasks=8
#SBATCH --time=01:00:00

set -euo pipefail
command=${1:?usage: slurm.sh COMMAND CONFIG [pdeformer options]}
config=${2:?usage: slurm.sh COMMAND CONFIG [pdeformer options]}
shift 2

# module load dolfinx          # or: source /path/to/conda/bin/activate fenicsx
cd "${SLURM_SUBMIT_DIR:-.}"
export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1        # one rank per core
export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$HOME/.cache}  # FFCx JIT cache: a shared disk
name=$(basename "$config")
out=${PDEFORMER_OUT:-${SCRATCH:-runs/output}/pdeformer/${name%.toml}}
margin=${PDEFORMER_GUARD_MARGIN:-300}
[[ "$margin" =~ ^[0-9]+$ ]] || { echo "slurm.sh: PDEFORMER_GUARD_MARGIN must be whole seconds, got '$margin'" >&2; exit 2; }

# the walltime guard stops $margin seconds before the job's limit (train and converge)
guard=()
if [[ "$command" == train || "$command" == converge ]]; then
  limit=$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %L 2>/dev/null || true)   # [D-][HH:]MM:SS left
  if [[ "$limit" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
    d=${BASH_REMATCH[2]:-0} h=${BASH_REMATCH[4]:-0} m=${BASH_REMATCH[5]} s=${BASH_REMATCH[6]}
    left=$(( 10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s - 10#$margin ))
    (( left > 0 )) && guard=(--walltime "$left")
  fi
  if (( ${#guard[@]} )); then
    echo "slurm.sh: walltime guard ${guard[1]} s (time left $limit, less $margin s)" >&2
  else
    echo "slurm.sh: no walltime guard (time left '${limit:-unknown}', margin $margin s)" >&2
  fi
fi
echo "slurm.sh: output in $out" >&2

srun .venv/bin/pdeformer "$command" "$config" "${guard[@]}" --set "output.dir=$out" "$@"
