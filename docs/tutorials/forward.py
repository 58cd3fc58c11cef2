"""A forward pass and its pictures.

A prompt of tokens in the plane (a mixture of two Gaussians) is carried through two
layers of four random softmax-attention heads: the mean-field transformer solved by
discontinuous Galerkin on a mesh. The solution's arrays over depth (mass, mean,
covariance), the density of a frame as cell values, the densities picture and the
ParaView series.

Run it (it takes a few seconds)::

    python docs/tutorials/forward.py [OUTDIR]

The picture and the ParaView files go to OUTDIR, else to $PDEFORMER_TUTORIAL_OUT, else
to a new temporary folder. The script runs unchanged under ``mpirun -n P``.
"""

# %% [markdown]
# ## Set-up
#
# `import pdeformer as pf` is the whole API. The output folder is the first argument,
# the environment variable `PDEFORMER_TUTORIAL_OUT`, or a temporary folder (made by
# rank 0 and shared, so that every rank writes into the same one under `mpirun`);
# `say` prints on rank 0 only.

# %%
import os
import sys
import tempfile

import numpy as np
from mpi4py import MPI

import pdeformer as pf

comm = MPI.COMM_WORLD
out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PDEFORMER_TUTORIAL_OUT")
if not out:
    out = comm.bcast(tempfile.mkdtemp(prefix="pdeformer-forward-") if comm.rank == 0 else None)
if comm.rank == 0:
    os.makedirs(out, exist_ok=True)
comm.Barrier()


def say(*args):
    if comm.rank == 0:
        print(*args, flush=True)


# %% [markdown]
# ## Parameters
#
# Tokens in d = 2 dimensions; L = 2 layers of H = 4 heads. Depth is a time t in
# [0, 1]: layer l acts on [l/L, (l+1)/L). Two frames per layer are kept besides t = 0.

# %%
layers, heads, dim = 2, 4, 2
frames_per_layer = 2

# %% [markdown]
# ## Mesh
#
# The box [-4, 4]² in 24 × 24 squares, each cut into two triangles (1,152 cells).

# %%
mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[24, 24])

# %% [markdown]
# ## Model and prompt
#
# `pf.Transformer.random` draws every entry of Q, K, V from N(0, 1/d), head (l, h) from
# its own seeded stream: the same heads on any number of ranks. The prompt is
# ½ N((-1, 0), 0.3 I) + ½ N((1, 0.5), 0.2 I), whose mean is (0, 0.25) and whose
# covariance is 0.25 I plus the spread of the two means,
# [[1.25, 0.25], [0.25, 0.3125]].

# %%
model = pf.Transformer.random(layers=layers, heads=heads, dim=dim, seed=0)
say("heads: Q", model.params["attention"]["Q"].shape, "V", model.params["attention"]["V"].shape)
prompt = pf.GaussianMixture(weights=[0.5, 0.5], means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2], name="blobs")
exact_mean = np.array([0.0, 0.25])
exact_cov = np.array([[1.25, 0.25], [0.25, 0.3125]])

# %% [markdown]
# ## Solve
#
# `pf.DG(mesh)` is the density in DG of degree 1, stepped by SSP Runge–Kutta at CFL 0.5
# with the positivity limiter. `pf.solve` returns a `Solution` with arrays over the
# frames (the same on every rank).

# %%
sol = pf.solve(model, prompt, pf.DG(mesh, degree=1), frames_per_layer=frames_per_layer)

# %% [markdown]
# ## Output
#
# `sol.t` (F,), `sol.mass` and `sol.outflow` (F,), `sol.mean` (F, d), `sol.cov`
# (F, d, d). DG conserves mass: what the mesh loses leaves through its boundary, so
# mass + outflow stays 1 to round-off. At t = 0 the moments are those of the prompt
# projected onto the mesh: within 10⁻³ of the exact ones on this mesh (the projection
# error is O(h²)).

# %%
say("t:", np.array2string(sol.t, separator=", "))
say(f"mass + outflow - 1: largest {np.abs(sol.mass + sol.outflow - 1).max():.1e}")
say(f"mean at t = 0: ({sol.mean[0, 0]:.4f}, {sol.mean[0, 1]:.4f})")
say(f"mean at t = 1: ({sol.mean[-1, 0]:.4f}, {sol.mean[-1, 1]:.4f})")
c = sol.cov[-1]
say(f"cov at t = 1: [[{c[0, 0]:.4f}, {c[0, 1]:.4f}], [{c[1, 0]:.4f}, {c[1, 1]:.4f}]]")
say(f"prompt's moments on the mesh: mean error {np.abs(sol.mean[0] - exact_mean).max():.1e}, "
      f"cov error {np.abs(sol.cov[0] - exact_cov).max():.1e}")

# %% [markdown]
# `sol.density(frame)` gathers the density of a frame on every rank: the cells'
# centroids and the density's mean on each cell (for `pf.Particles`, the tokens and
# their weights). The cells of this mesh all have the area 8²/1152, so the cell means
# times that area sum to the mass on the mesh.

# %%
points, values = sol.density(frame=-1)
_, first = sol.density(frame=0)
area = 8.0 * 8.0 / len(values)
say(f"cells: {len(values)}, sum of cell means x area: {np.sum(values) * area:.12f}")
say(f"largest cell mean: t = 0 {first.max():.4f}, t = 1 {values.max():.4f}")

# %% [markdown]
# The pictures: `sol.plot` draws the density over the frames (one colour scale),
# `sol.write_vtk` writes the series `density_blobs.pvd` for ParaView (File → Open, the
# time slider is depth t).

# %%
picture = sol.plot(os.path.join(out, "densities.png"))
files = sol.write_vtk(os.path.join(out, "vtk"))
say("picture:", picture)
say("ParaView:", files[0])

# %% [markdown]
# ## Check
#
# It prints (the lines `tests/test_tutorials.py` looks for):
#
#     t: [0.  , 0.25, 0.5 , 0.75, 1.  ]
#     mean at t = 0: (0.0000, 0.2500)
#     mean at t = 1: (0.0078, 0.1326)
#     cov at t = 1: [[1.0175, 0.1219], [0.1219, 0.2640]]
#     cells: 1152, sum of cell means x area: 1.000000000000
#     largest cell mean: t = 0 0.3725, t = 1 0.3989
#
# and the asserts hold these numbers to the digits printed, mass + outflow = 1 to
# 10⁻¹², and the prompt's moments to 10⁻³.

# %%
assert sol.t.shape == (5,) and sol.mean.shape == (5, 2) and sol.cov.shape == (5, 2, 2)
assert np.allclose(sol.t, [0, 0.25, 0.5, 0.75, 1])
assert np.abs(sol.mass + sol.outflow - 1).max() < 1e-12
assert np.abs(sol.mean[0] - exact_mean).max() < 1e-3 and np.abs(sol.cov[0] - exact_cov).max() < 1e-3
assert np.abs(sol.mean[-1] - [0.0078, 0.1326]).max() < 5e-5
assert np.abs(sol.cov[-1] - [[1.0175, 0.1219], [0.1219, 0.2640]]).max() < 5e-5
assert len(values) == 1152 and abs(np.sum(values) * area - sol.mass[-1]) < 1e-12
assert abs(values.max() - 0.3989) < 5e-5
assert files[0].endswith("density_blobs.pvd") and os.path.exists(files[0])
assert comm.rank != 0 or os.path.getsize(picture) > 0
