#!/bin/bash
# pdeformer batch job (SLURM template).
#
#   sbatch --ntasks=32 --time=04:00:00 runs/slurm.sh train runs/default.toml [--set key=value ...]
#   sbatch --ntasks=8  --time=01:00:00 runs/slurm.sh converge runs/studies/mesh.toml
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
out=${SCRATCH:-runs/output}/pdeformer/${SLURM_JOB_ID:-local}

# the walltime guard stops 5 minutes before the job's limit (train and converge)
guard=()
if [[ "$command" == train || "$command" == converge ]]; then
  limit=$(squeue -h -j "${SLURM_JOB_ID:-0}" -o %L 2>/dev/null || true)   # [D-][HH:]MM:SS left
  if [[ "$limit" =~ ^(([0-9]+)-)?(([0-9]+):)?([0-9]+):([0-9]+)$ ]]; then
    d=${BASH_REMATCH[2]:-0} h=${BASH_REMATCH[4]:-0} m=${BASH_REMATCH[5]} s=${BASH_REMATCH[6]}
    left=$(( 10#$d * 86400 + 10#$h * 3600 + 10#$m * 60 + 10#$s - 300 ))
    (( left > 0 )) && guard=(--walltime "$left")
  fi
fi

srun .venv/bin/pdeformer "$command" "$config" "${guard[@]}" --set "output.dir=$out" "$@"
