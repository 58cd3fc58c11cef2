"""A convergence study: mesh refinement against an exact solution.

With uniform attention (Q = 0) every token attends to all tokens equally, the velocity
of a layer is the same at every point, and the prompt is translated rigidly: an exact
solution. The mesh is refined from 16² to 64² squares and the errors of the density and
of the output mean are measured against it; DG-1 converges at order 2.

Run it (a few seconds)::

    python docs/tutorials/convergence.py

From the command line the same study, with its table and picture, is
``mpirun -n 2 pdeformer converge runs/studies/mesh.toml`` (runs/studies/ holds the
others: DG degree, layers, heads, tokens; docs/verification.md shows their results).
"""

# %% [markdown]
# ## Set-up

# %%
import numpy as np
from scipy.linalg import expm

import pdeformer as pf

# %% [markdown]
# ## Parameters
#
# The base run of runs/studies/mesh.toml (runs/studies/translation.toml) on the box
# [-4, 4]²: L = 2 layers of H = 2 heads with Q = 0 (`query_scale=0`), a Gaussian prompt
# N(m₀, 0.25 I), DG-1 without the limiter (the scheme's own order), CFL 0.3.

# %%
layers, heads, dim = 2, 2, 2
m0, variance = np.array([0.6, 0.3]), 0.25
cells = [16, 32, 64]
side = 8.0                      # the box [-4, 4]²

# %% [markdown]
# ## Model and exact solution
#
# The exact solution (pdeformer/model/exact.py has it, and its gradient): on layer l
# the velocity is V̄_l m_t, V̄_l = (1/H) Σ_h V_{l,h}, so the mean follows
# m' = V̄_l m, m_{(l+1)/L} = e^{V̄_l / L} m_{l/L}, and ρ_t is ρ₀ moved by m_t − m₀ (the
# covariance stays 0.25 I).

# %%
model = pf.Transformer.random(layers=layers, heads=heads, dim=dim, seed=1, init_scale=0.8, query_scale=0.0)
prompt = pf.GaussianMixture(means=[m0], covs=[variance])
mean = m0.copy()
for vbar in model.params["attention"]["V"].mean(axis=1):
    mean = expm(vbar / layers) @ mean
print(f"exact mean at t = 1: ({mean[0]:.6f}, {mean[1]:.6f})")


def exact_density(x):
    d = x - mean
    return np.exp(-0.5 * np.sum(d * d, axis=1) / variance) / (2 * np.pi * variance)


# %% [markdown]
# ## Solve on each mesh
#
# The density error is measured from `sol.density()`: the cell means against the exact
# density at the cells' centroids, in the discrete L2 norm (Σ_K |K| e_K²)^(1/2). A cell
# mean differs from the value at the centroid by O(h²), so this is an O(h²) measure of
# the error, as the L2 error itself is. The mean's error is the largest of its
# components.

# %%
errors = []
for n in cells:
    sol = pf.solve(model, prompt, pf.DG(pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[n, n]),
                                        limiter=False, cfl=0.3))
    x, values = sol.density(frame=-1)
    area = side * side / len(values)               # every cell of this mesh has the same area
    l2 = np.sqrt(area * np.sum((values - exact_density(x)) ** 2))
    errors.append((l2, np.abs(sol.mean[-1] - mean).max()))
errors = np.array(errors)

# %% [markdown]
# ## Observed orders
#
# Between successive meshes, log2 of the error ratio; over all meshes, the slope of a
# least-squares line through (log h, log error).

# %%
h = side / np.array(cells)
successive = np.log2(errors[:-1] / errors[1:])
fitted = [np.polyfit(np.log(h), np.log(errors[:, q]), 1)[0] for q in range(2)]
print(" cells   L2 density  order   mean       order")
for i, n in enumerate(cells):
    o = ("  —  ", "  —  ") if i == 0 else tuple(f"{p:5.2f}" for p in successive[i - 1])
    print(f"{n:3d}²    {errors[i, 0]:.3e}   {o[0]}  {errors[i, 1]:.3e}  {o[1]}".rstrip())
print(f"fitted orders: L2 density {fitted[0]:.2f}, mean {fitted[1]:.2f}")

# %% [markdown]
# ## Check
#
# It prints (the lines `tests/test_tutorials.py` looks for):
#
#     exact mean at t = 1: (0.599598, 0.408190)
#      16²    3.000e-02     —    1.911e-05    —
#      32²    6.953e-03    2.11  5.127e-06   1.90
#      64²    1.682e-03    2.05  1.341e-06   1.93
#     fitted orders: L2 density 2.08, mean 1.92
#
# The asserts: the exact mean and the fitted orders to the digits printed, every order
# (successive and fitted) within 0.25 of 2, and the finest density error below 2·10⁻³.

# %%
assert np.abs(mean - [0.599598, 0.408190]).max() < 5e-7
assert np.abs(np.array(fitted) - [2.08, 1.92]).max() < 5e-3
assert np.abs(successive - 2).max() < 0.25 and np.abs(np.array(fitted) - 2).max() < 0.25
assert errors[-1, 0] < 2e-3
