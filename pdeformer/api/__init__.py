"""The Python API: the model's objects and the two functions that solve it.

    import pdeformer as pf

    mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[48, 48])
    model = pf.Transformer.random(layers=4, heads=8, dim=2, seed=0)
    prompt = pf.GaussianMixture(weights=[0.5, 0.5], means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2])
    sol = pf.solve(model, prompt, pf.DG(mesh, degree=1))
    sol.t, sol.mean, sol.cov                       # arrays over the frames
    sol.plot("densities.png")
    risk, grad = pf.value_and_grad(pf.Moments(mean=[0, 0], cov=[[0.5, 0], [0, 0.5]]),
                                   model, [prompt], pf.DG(mesh))
    grad["attention"]["Q"].shape                   # (4, 8, 2, 2), like model.params
    trained = pf.train(pf.Moments(mean=[0, 0], cov=0.5), model, [prompt], pf.DG(mesh), steps=10, lr=0.05)
    trained.risk, trained.model                    # R over the steps, the trained model

Runs unchanged under ``mpirun -n P python script.py``.
"""

from .objects import (DG, L2, MMD, BoxMesh, CircleMesh, DensityFile, GaussianMixture, Harmonics, Interaction,
                      MeshFile, Moments, Particles, Points, Potential, SphereMesh, Transformer, Uniform,
                      VonMisesFisher)
from .solve import Solution, solve, value_and_grad
from .train import Training, train

__all__ = ["BoxMesh", "CircleMesh", "SphereMesh", "MeshFile", "Transformer", "GaussianMixture", "Uniform",
           "Points", "DensityFile", "VonMisesFisher", "Harmonics", "DG", "Particles", "Moments", "Potential",
           "Interaction", "L2", "MMD", "solve", "value_and_grad", "Solution", "train", "Training"]
