"""Clustering on the sphere.

Tokens on the unit sphere S² (the geometry normalisation layers give them), one head per
layer with Q = K = V = I: attention pulls every token towards the others, the uniform
density is unstable and the tokens gather into one cluster (Geshkovski, Letrouit,
Polyanskiy, Rigollet, *A mathematical perspective on Transformers*). First the linear
growth of a small mode about the uniform density against its exact rate, then a
perturbed uniform density gathering into a cluster: the order parameter and the
density's largest value grow.

Run it (a few seconds)::

    python docs/tutorials/sphere.py [OUTDIR]

The densities picture goes to OUTDIR, else $PDEFORMER_TUTORIAL_OUT, else a new
temporary folder. docs/sphere.md has the mathematics.
"""

# %% [markdown]
# ## Set-up

# %%
import math
import os
import sys
import tempfile

import numpy as np

import pdeformer as pf

out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PDEFORMER_TUTORIAL_OUT")
out = out or tempfile.mkdtemp(prefix="pdeformer-sphere-")
os.makedirs(out, exist_ok=True)

# %% [markdown]
# ## Parameters
#
# Inverse temperature β = 1 (scores β⟨A x, y⟩); T is the time the heads run for: V = T I
# in every layer makes depth t ∈ [0, 1] the time t T of the particle system.

# %%
beta = 1.0


def identity_heads(layers: int, time: float = 1.0) -> pf.Transformer:
    """One head per layer with Q = K = I and V = time * I."""
    eye = np.broadcast_to(np.eye(3), (layers, 1, 3, 3)).copy()
    return pf.Transformer({"attention": {"Q": eye, "K": eye, "V": time * eye}}, beta=beta)


# %% [markdown]
# ## Mesh
#
# `pf.SphereMesh(refinements=r)`: the icosahedron with every triangle split in four r
# times, the vertices pushed out onto the sphere (20 · 4^r triangles). The velocity is
# projected onto the tangent plane: no mass leaves, the outflow is 0.

# %%
meshes = {r: pf.SphereMesh(refinements=r) for r in (2, 3)}

# %% [markdown]
# ## The linear growth rate
#
# ρ₀ = (1 + ε Y₁₀)/(4π), a small tilt of the uniform density towards the north pole
# (`pf.Harmonics`, ε = 10⁻⁴). Its amplitude grows as e^(λ t), with the exact rate
# (docs/sphere.md, by the Funk–Hecke formula)
#
#     λ₁ = 2 (coth β − 1/β) / β,
#
# 0.6261 at β = 1, so a(1)/a(0) = e^λ₁ = 1.8702. The mean's z component is
# proportional to the amplitude. With 4 layers of 20 SSP-RK2 steps (time error below
# 10⁻⁵) the discrete growth converges to e^λ₁ at order 2 in the mesh size: the error
# falls about 4× per refinement.

# %%
rate = 2 * (1 / math.tanh(beta) - 1 / beta) / beta
errors = []
for r, mesh in meshes.items():
    sol = pf.solve(identity_heads(4), pf.Harmonics(coefficients=[[1, 0, 1e-4]]),
                   pf.DG(mesh, limiter=False, steps_per_layer=20), backend="direct")
    growth = sol.mean[-1, 2] / sol.mean[0, 2]
    errors.append(abs(growth / math.exp(rate) - 1))
    print(f"r = {r} ({20 * 4 ** r} triangles): growth {growth:.4f} (exact {math.exp(rate):.4f}), "
          f"relative error {errors[-1]:.1e}")
growth_order = math.log2(errors[0] / errors[1])
print(f"observed order: {growth_order:.2f}")

# %% [markdown]
# ## Clustering
#
# A uniform density perturbed by a few modes (l = 1, 2, 3), run for a time T = 8 in
# L = 8 layers. The order parameter |∫ u ρ dσ| (u = x/|x|) is 1 for a single point mass
# and 0 for the uniform density; on the unit sphere it is the length of the mean (up to
# the O(h²) by which the flat cells lie inside the sphere). It grows from 0.06 to 0.98:
# one cluster. The cluster ends narrower than a cell, so the order stops at 1 − O(h²),
# and the largest cell mean, which grows over a hundredfold, is bounded by the cells'
# size.

# %%
prompt = pf.Harmonics(coefficients=[[1, 0, 0.3], [1, 1, -0.2], [2, 0, 0.3], [2, -1, 0.2], [3, 1, -0.2]])
sol = pf.solve(identity_heads(8, time=8.0), prompt, pf.DG(meshes[2]))
order = np.linalg.norm(sol.mean, axis=1)
largest = np.array([sol.density(frame=f)[1].max() for f in range(len(sol.t))])
print("t T:   " + " ".join(f"{8 * t:5.1f}" for t in sol.t))
print("order: " + " ".join(f"{o:5.3f}" for o in order))
print("max ρ: " + " ".join(f"{m:5.2f}" for m in largest))
print(f"mass: {sol.mass[-1]:.12f}, outflow: {sol.outflow[-1]:.1f}")
picture = sol.plot(os.path.join(out, "sphere-densities.png"))
print("picture:", picture)

# %% [markdown]
# ## Check
#
# It prints (the lines `tests/test_tutorials.py` looks for):
#
#     r = 2 (320 triangles): growth 1.8501 (exact 1.8702), relative error 1.1e-02
#     r = 3 (1280 triangles): growth 1.8652 (exact 1.8702), relative error 2.7e-03
#     observed order: 1.98
#     t T:     0.0   1.0   2.0   3.0   4.0   5.0   6.0   7.0   8.0
#     order: 0.058 0.106 0.191 0.335 0.548 0.780 0.923 0.969 0.980
#     max ρ:  0.12  0.14  0.20  0.35  0.80  1.78  4.78 10.69 16.48
#     mass: 1.000000000000, outflow: 0.0
#
# The asserts: the growth within 5·10⁻³ of e^λ₁ on 1,280 triangles and the observed
# order within 0.3 of 2 (what tests/test_sphere.py asks); the order parameter growing
# at every frame, from 0.058 to 0.980, and the largest cell mean over a hundredfold, to
# 16.48; the mass 1 to 10⁻¹² with no outflow.

# %%
assert errors[-1] < 5e-3 and abs(growth_order - 2) < 0.3
assert np.all(np.diff(order) > 0) and abs(order[0] - 0.058) < 5e-4 and abs(order[-1] - 0.980) < 5e-4
assert largest[-1] > 100 * largest[0] and abs(largest[-1] - 16.48) < 5e-3
assert abs(sol.mass[-1] - 1) < 1e-12 and sol.outflow[-1] == 0
