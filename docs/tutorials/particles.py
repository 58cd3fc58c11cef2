"""Particles against the mesh.

The same model and prompt solved twice: as a density on a mesh (``pf.DG``, the
mean-field limit) and as N tokens drawn from the prompt and moved by the same attention
velocity (``pf.Particles``, a finite transformer). Their output moments agree to within
the tokens' sampling error, which falls as N^(-1/2), plus the mesh's error, which falls
as h².

Run it (a few seconds)::

    python docs/tutorials/particles.py
"""

# %% [markdown]
# ## Set-up

# %%
import numpy as np

import pdeformer as pf

# %% [markdown]
# ## Parameters
#
# L = 2 layers of H = 2 random heads in d = 2; token counts N = 1,000, 4,000 and 16,000,
# each drawn with 6 seeds; meshes of 16² and 32² squares.

# %%
layers, heads, dim = 2, 2, 2
token_counts = [1000, 4000, 16000]
seeds = range(6)
meshes = [16, 32]

# %% [markdown]
# ## Model and prompt

# %%
model = pf.Transformer.random(layers=layers, heads=heads, dim=dim, seed=3, init_scale=0.8)
prompt = pf.GaussianMixture(means=[[0.5, 0.2], [-0.6, 0.1]], covs=[0.2, 0.3])

# %% [markdown]
# ## Solve on the mesh
#
# DG-1 on [-3.5, 3.5]². The mean at t = 1 moves by δ between 16² and 32²; DG-1
# converges at order 2, so the 32² mean's own error is about δ/3, and δ bounds it.

# %%
dg = {n: pf.solve(model, prompt, pf.DG(pf.BoxMesh(lower=[-3.5, -3.5], upper=[3.5, 3.5], cells=[n, n])))
      for n in meshes}
mesh_mean = dg[32].mean[-1]
delta = np.abs(dg[16].mean[-1] - dg[32].mean[-1])
print(f"mesh 32²: mean at t = 1 ({mesh_mean[0]:.4f}, {mesh_mean[1]:.4f})")
print(f"mesh 16² against 32²: the mean moves by {delta.max():.1e}")

# %% [markdown]
# ## Solve with tokens
#
# `pf.Particles(tokens=N, seed=s)` draws N tokens from the prompt (the same tokens on
# any number of ranks) and moves them with the scheme of DG-1, SSP-RK2, 10 steps per
# layer. The mean of N tokens scatters about its limit by about σ/√N, σ² the output's
# variance along a coordinate (the mesh's covariance at t = 1); the tokens also feel each
# other's sampling noise through the attention, which here widens the scatter by up to
# about 1.5. So each draw lies, per coordinate, within
#
#     tol(N, h) = 4 σ/√N + δ
#
# of the mesh's mean: a tolerance that falls with the tokens (N^(-1/2)) and with the
# mesh (δ ~ h²). Over the 6 draws, the root mean square distance falls as N^(-1/2): an
# observed order near 1/2 in N.

# %%
sigma = np.sqrt(np.diag(dg[32].cov[-1]))
rows = []
for n in token_counts:
    tol = 4 * sigma / np.sqrt(n) + delta
    dist, worst = [], 0.0
    for s in seeds:
        tokens = pf.solve(model, prompt, pf.Particles(tokens=n, seed=s))
        error = np.abs(tokens.mean[-1] - mesh_mean)
        dist.append(np.linalg.norm(error))
        worst = max(worst, np.max(error / tol))
    rows.append((n, np.sqrt(np.mean(np.square(dist))), tol.max(), worst))

print("     N  rms distance  tol      largest error / tol")
for n, rms, tol, worst in rows:
    print(f"{n:6d}  {rms:.2e}      {tol:.1e}  {worst:.2f}")
rms = np.array([r[1] for r in rows])
order = -np.polyfit(np.log(token_counts), np.log(rms), 1)[0]
print(f"observed order in N: {order:.2f}")

# %% [markdown]
# ## Check
#
# It prints (the lines `tests/test_tutorials.py` looks for):
#
#     mesh 32²: mean at t = 1 (0.0123, 0.1831)
#     mesh 16² against 32²: the mean moves by 3.9e-04
#       1000  2.37e-02      8.9e-02  0.52
#       4000  1.65e-02      4.4e-02  0.55
#      16000  5.85e-03      2.2e-02  0.69
#     observed order in N: 0.50
#
# The asserts: the mesh's mean to the digits printed and δ below 10⁻³; every draw
# within its tolerance (the last column below 1); the tolerance falling fourfold from
# N = 1,000 to 16,000 (to within the mesh's part); the observed order within 0.2 of 1/2
# (6 draws per N leave it about that uncertain).

# %%
assert np.abs(mesh_mean - [0.0123, 0.1831]).max() < 5e-5
assert delta.max() < 1e-3
assert all(worst < 1 for _, _, _, worst in rows)
assert rows[-1][2] < rows[0][2] / 3.9
assert abs(order - 0.5) < 0.2
