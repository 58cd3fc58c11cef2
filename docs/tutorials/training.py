"""A gradient and a short training.

The risk of a model is a function of its heads: here the moments objective, how far the
output density's mean and covariance at depth t = 1 are from targets. ``pf.value_and_grad``
returns the risk and its exact gradient with respect to every head (an adjoint solved
backwards in depth); a Taylor test and a central difference check it. ``pf.train`` then
takes a few steps of gradient descent, and the risk falls.

Run it (a few seconds)::

    python docs/tutorials/training.py [OUTDIR]

The training's files (history.csv, params_XXXX.npz, heads.pvd, checkpoint.npz) go to
OUTDIR/train, OUTDIR being the argument, else $PDEFORMER_TUTORIAL_OUT, else a new
temporary folder.
"""

# %% [markdown]
# ## Set-up

# %%
import os
import sys
import tempfile

import numpy as np

import pdeformer as pf

out = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("PDEFORMER_TUTORIAL_OUT")
out = out or tempfile.mkdtemp(prefix="pdeformer-training-")

# %% [markdown]
# ## Parameters
#
# L = 2 layers of H = 2 heads in d = 2; the targets of the moments objective
#
#     R = 1/2 |m - m*|² + 1/2 |C - C*|²_F   (m, C: mean and covariance at t = 1).

# %%
layers, heads, dim = 2, 2, 2
target_mean = np.array([0.3, -0.2])
target_cov = np.array([[0.6, 0.0], [0.0, 0.4]])
steps, lr = 5, 0.1

# %% [markdown]
# ## Mesh and discretisation
#
# 16 × 16 squares of [-4, 4]², DG-1. A fixed number of steps per layer (16 SSP-RK2
# steps) makes the discrete risk a smooth function of the heads (but for the limiter's
# tiny kinks, below), which the finite differences below need; CFL steps (the default)
# choose the count per frame from the velocity at its start, and the count can jump as
# the heads move.

# %%
mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[16, 16])
disc = pf.DG(mesh, degree=1, steps_per_layer=16)

# %% [markdown]
# ## Model, prompt and objective

# %%
model = pf.Transformer.random(layers=layers, heads=heads, dim=dim, seed=0, init_scale=0.8)
prompt = pf.GaussianMixture(weights=[0.5, 0.5], means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2], name="blobs")
objective = pf.Moments(mean=target_mean, cov=target_cov)

# %% [markdown]
# ## The gradient
#
# `grad` is a tree shaped like `model.params`: `grad["attention"]["Q"]` has the shape of
# Q, (L, H, k, d). The risk is the objective of the solution `pf.solve` gives with the
# same discretisation (one discrete map), to round-off.

# %%
risk, grad = pf.value_and_grad(objective, model, [prompt], disc)
print(f"risk: {risk:.6f}")
print("gradient shapes:", {name: g.shape for name, g in grad["attention"].items()})


def risk_of(params):
    """R of heads ``params`` from the solution's final moments."""
    sol = pf.solve(pf.Transformer(params), prompt, disc)
    m, c = sol.mean[-1], sol.cov[-1]
    return 0.5 * np.sum((m - target_mean) ** 2) + 0.5 * np.sum((c - target_cov) ** 2)


print(f"risk from pf.solve: relative difference {abs(risk_of(model.params) / risk - 1):.0e}")

# %% [markdown]
# Along a random direction d of all heads, the first-order Taylor remainder
# |R(θ + εd) − R(θ) − ε⟨∇R, d⟩| falls as ε² when ∇R is the gradient of R: halving ε
# divides it by 4 (observed orders near 2). A central difference with ε = 10⁻⁵ agrees
# with ⟨∇R, d⟩ to about 10⁻⁷ relative (its truncation error; the positivity limiter
# switching on or off in a cell makes kinks far smaller than that).

# %%
rng = np.random.default_rng(1)
direction = {name: rng.normal(size=a.shape) for name, a in model.params["attention"].items()}
slope = sum(np.sum(grad["attention"][name] * direction[name]) for name in direction)


def moved(eps):
    return {"attention": {name: a + eps * direction[name] for name, a in model.params["attention"].items()}}


epsilons = [4e-2, 2e-2, 1e-2]
remainders = np.array([abs(risk_of(moved(e)) - risk - e * slope) for e in epsilons])
orders = np.log2(remainders[:-1] / remainders[1:])
central = (risk_of(moved(1e-5)) - risk_of(moved(-1e-5))) / 2e-5
print("Taylor remainders:", ", ".join(f"{r:.2e}" for r in remainders))
print("Taylor orders:", ", ".join(f"{p:.2f}" for p in orders))
print(f"central difference against the gradient: relative {abs(central / slope - 1):.0e}")

# %% [markdown]
# ## Training
#
# `pf.train` takes the steps `pdeformer train` takes: gradient descent, every head moved
# by −lr · L · H · ∂R/∂θ (the mean-field scale), here for 5 steps with lr = 0.1. It
# returns the trained model (the given one is left as it was) and the history over the
# steps; `outdir` receives the files the command writes.

# %%
trained = pf.train(objective, model, [prompt], disc, steps=steps, lr=lr, outdir=os.path.join(out, "train"))
print("risk over the steps:", ", ".join(f"{r:.4f}" for r in trained.risk))
print("gradient norm over the steps:", ", ".join(f"{g:.4f}" for g in trained.history["grad_norm"]))
trained_risk = risk_of(trained.model.params)
print(f"trained risk from pf.solve: {trained_risk:.4f}")
print("files:", ", ".join(sorted(f for f in os.listdir(os.path.join(out, "train")) if not f.startswith("params_"))))

# %% [markdown]
# ## Check
#
# It prints (the lines `tests/test_tutorials.py` looks for):
#
#     risk: 0.307678
#     Taylor orders: 2.05, 2.01
#     risk over the steps: 0.3077, 0.2146, 0.1837, 0.1659, 0.1542, 0.1460
#     trained risk from pf.solve: 0.1460
#
# The risk falls at every step and is more than halved in five; the gradient norm falls
# too. `trained.model` holds the heads after the last step: its risk is the last entry
# of the history. The asserts hold these numbers to the digits printed, the Taylor orders within
# 0.1 of 2 and the central difference to 10⁻⁶.

# %%
assert grad["attention"]["Q"].shape == (layers, heads, dim, dim)
assert abs(risk - 0.307678) < 5e-7
assert abs(risk_of(model.params) / risk - 1) < 1e-12
assert np.all(np.abs(orders - 2) < 0.1)
assert abs(central / slope - 1) < 1e-6
assert trained.risk.shape == (steps + 1,) and np.all(np.diff(trained.risk) < 0)
assert trained.risk[-1] < 0.5 * trained.risk[0]
assert np.abs(trained.risk - [0.3077, 0.2146, 0.1837, 0.1659, 0.1542, 0.1460]).max() < 5e-5
assert abs(trained_risk / trained.risk[-1] - 1) < 1e-12
assert trained.history["grad_norm"][-1] < trained.history["grad_norm"][0]
assert os.path.exists(os.path.join(out, "train", "history.csv"))
