"""A batch job on a cluster.

The Python API runs under MPI as it is: start the script on P ranks and the mesh is
partitioned over them; every result is the same on every rank, and the same as the
serial run's to rounding. This script solves two prompts, takes the risk and its
gradient and trains three steps on all ranks, then checks both statements: it compares
the numbers across the ranks, and against the same objects solved on each rank alone
(``MPI.COMM_SELF``).

Run it on 2 ranks, or serially (a few seconds either way)::

    mpirun -n 2 python docs/tutorials/cluster.py [OUTDIR]
    python docs/tutorials/cluster.py [OUTDIR]

The training's files and numbers.json go to OUTDIR, else $PDEFORMER_TUTORIAL_OUT, else a
new temporary folder. Under SLURM, ``srun`` starts the ranks (below).
"""

# %% [markdown]
# ## A SLURM job
#
# A job script that runs this tutorial on 4 ranks (submit it with `sbatch job.sh` from
# the repository, where `.venv` is; `make setup` builds it once on a login node):
#
#     #!/bin/bash
#     #SBATCH --job-name=pdeformer-tutorial
#     #SBATCH --ntasks=4
#     #SBATCH --time=00:10:00
#     #SBATCH --output=tutorial-%j.out
#     set -euo pipefail
#     # module load dolfinx          # or activate the environment pdeformer runs in
#     export OMP_NUM_THREADS=1 OPENBLAS_NUM_THREADS=1        # one rank per core
#     export XDG_CACHE_HOME=${XDG_CACHE_HOME:-$HOME/.cache}  # the JIT cache, on a disk all nodes see
#     srun .venv/bin/python docs/tutorials/cluster.py "${SCRATCH:-$PWD}/tutorial-$SLURM_JOB_ID"
#
# `srun` takes the cluster's MPI plugin; for Open MPI that is usually PMIx
# (`srun --mpi=pmix ...`). Rank 0 compiles the forms and the others wait for it, so a
# first small job fills the JIT cache for the big ones.
#
# A run described by a TOML file is the command in the same place of a job script,
#
#     srun pdeformer train runs/default.toml
#
# (`.venv/bin/pdeformer` without an activated environment), and `runs/slurm.sh` is a
# template that adds what a long run needs (docs/howto/cluster.md):
#
#     sbatch --ntasks=32 --time=04:00:00 runs/slurm.sh train runs/default.toml
#
# runs `srun .venv/bin/pdeformer train runs/default.toml --walltime S --set
# output.dir=...`, the output folder named by the run ($PDEFORMER_OUT, else
# $SCRATCH/pdeformer/default). The walltime guard S is the job's time left less 5
# minutes: before each training step the command estimates its duration from the last
# one and, if it would end past the guard, stops with a checkpoint and `status:
# walltime` in summary.json. The same command with `--restart` continues from that
# checkpoint with the history an uninterrupted run writes:
#
#     sbatch --ntasks=32 --time=04:00:00 runs/slurm.sh train runs/default.toml --restart
#
# `pf.train` has neither the guard nor the restart: a training longer than one job
# belongs to the command.

# %% [markdown]
# ## Set-up
#
# The output folder is made by rank 0 and broadcast, so that every rank names the same
# one; `say` prints on rank 0 only.

# %%
import json
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import pdeformer as pf

world = MPI.COMM_WORLD
out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PDEFORMER_TUTORIAL_OUT")
if not out:
    out = world.bcast(tempfile.mkdtemp(prefix="pdeformer-cluster-") if world.rank == 0 else None)


def say(*args):
    if world.rank == 0:
        print(*args, flush=True)


say(f"ranks: {world.size}")

# %% [markdown]
# ## Parameters, mesh, model
#
# 24² squares of [-4, 4]², L = 2 layers of H = 4 heads, two prompts with moment
# targets; 3 steps of gradient descent.

# %%
mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[24, 24])
disc = pf.DG(mesh, degree=1)
model = pf.Transformer.random(layers=2, heads=4, dim=2, seed=1, init_scale=0.8)
prompts = [pf.GaussianMixture(weights=[0.5, 0.5], means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2], name="blobs"),
           pf.GaussianMixture(means=[[0.5, -0.5]], covs=[[[0.4, 0.1], [0.1, 0.2]]], name="tilted")]
objective = pf.Moments(mean=[0.2, 0.0], cov=[[0.5, 0.0], [0.0, 0.3]])

# %% [markdown]
# ## Solve, differentiate, train
#
# The same calls as serially, with the communicator to partition the mesh over (the
# default is `MPI.COMM_WORLD`; it is given here because the check below uses another).
# Only the world run writes files.


# %%
def run(comm, outdir=None):
    """The numbers of the job on ``comm``: the final moments of both prompts, the risk,
    its gradient and the risk over three training steps."""
    sols = pf.solve(model, prompts, disc, comm=comm)
    risk, grad = pf.value_and_grad(objective, model, prompts, disc, comm=comm)
    trained = pf.train(objective, model, prompts, disc, steps=3, lr=0.1, comm=comm, outdir=outdir)
    return {"mean": np.array([s.mean[-1] for s in sols]), "cov": np.array([s.cov[-1] for s in sols]),
            "risk": np.array([risk]), "grad": np.concatenate([g.ravel() for g in grad["attention"].values()]),
            "training": trained.risk}


result = run(world, os.path.join(out, "train"))
say(f"mean at t = 1: blobs ({result['mean'][0, 0]:.4f}, {result['mean'][0, 1]:.4f}), "
    f"tilted ({result['mean'][1, 0]:.4f}, {result['mean'][1, 1]:.4f})")
say(f"risk: {result['risk'][0]:.6f}, gradient norm: {np.linalg.norm(result['grad']):.6f}")
say("risk over the training:", ", ".join(f"{r:.4f}" for r in result["training"]))

# %% [markdown]
# ## The same on every rank
#
# Every rank holds the full arrays (the API gathers and broadcasts them): gathered from
# all ranks, they are equal bit for bit.

# %%
flat = np.concatenate([a.ravel() for a in result.values()])
identical = all(np.array_equal(flat, other) for other in world.allgather(flat))
say(f"identical on every rank: {identical}")

# %% [markdown]
# ## The same as the serial run
#
# The same objects on `MPI.COMM_SELF`: each rank solves the whole problem alone. The
# partitioned run adds its sums in another order, so the two agree to rounding, not bit
# for bit (the tests of the package ask for 10⁻¹⁰ relative). On one rank the world run
# is the serial run.

# %%
serial = run(MPI.COMM_SELF) if world.size > 1 else result
difference = max(np.abs(result[k] - serial[k]).max() / np.abs(serial[k]).max() for k in result)
say(f"largest relative difference to the serial run: {difference:.0e}")
if world.rank == 0:
    with open(os.path.join(out, "numbers.json"), "w") as f:
        json.dump({k: v.tolist() for k, v in result.items()} | {"ranks": world.size}, f)
say("numbers:", os.path.join(out, "numbers.json"))

# %% [markdown]
# ## Check
#
# It prints, on any number of ranks (the lines `tests/test_tutorials.py` looks for):
#
#     mean at t = 1: blobs (0.0683, 0.2384), tilted (0.3364, -0.4379)
#     risk: 0.231396, gradient norm: 0.171543
#     risk over the training: 0.2314, 0.2094, 0.1921, 0.1779
#     identical on every rank: True
#
# and a difference to the serial run of about 10⁻¹⁵ on 2 ranks. The asserts: these
# numbers to the digits printed, the same on every rank, and within 10⁻¹⁰ relative of
# the serial run.

# %%
assert np.abs(result["mean"] - [[0.0683, 0.2384], [0.3364, -0.4379]]).max() < 5e-5
assert abs(result["risk"][0] - 0.231396) < 5e-7 and abs(np.linalg.norm(result["grad"]) - 0.171543) < 5e-7
assert np.abs(result["training"] - [0.2314, 0.2094, 0.1921, 0.1779]).max() < 5e-5
assert identical
assert difference < 1e-10
