"""pdeformer: the mean-field limit of transformers (infinitely deep and wide) as PDEs.

Token densities are transported by multi-head softmax attention,
d/dt rho + div(rho v_t[rho]) = 0, discretised with discontinuous Galerkin in dolfinx
and solved in parallel with PETSc. From Python, the model's objects and two functions
(:mod:`pdeformer.api`)::

    import pdeformer as pf
    mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[48, 48])
    model = pf.Transformer.random(layers=4, heads=8, dim=2, seed=0)
    prompt = pf.GaussianMixture(means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2])
    sol = pf.solve(model, prompt, pf.DG(mesh))          # sol.t, sol.mean, sol.cov, ...
    risk, grad = pf.value_and_grad(pf.Moments(mean=[0, 0], cov=0.5), model, [prompt], pf.DG(mesh))

and what the ``pdeformer`` command calls::

    from pdeformer import load_config, run_forward
    result = run_forward(load_config("runs/default.toml"))

The package is in layers, each a subpackage that imports only its own layer or lower ones
(docs/architecture.md): ``tools`` (errors, option keys, MPI, output files); the core, which
imports neither dolfinx nor PETSc: ``integrator`` (schemes, the march through depth),
``attention`` (softmax sums, the log-Laplace table) and ``model`` (heads, velocity,
prompts, objectives, the particle model, the run configuration); ``fem`` (dolfinx: meshes, DG transport);
``solvers`` (forward, adjoint, training); ``api`` (the Python API); ``commands`` (the
CLI, runs, studies).
"""

__version__ = "0.1.0"

_LAZY = {
    "load_config": ("model.config", "load_config"),
    "run_forward": ("commands.run", "run_forward"),
    "HeadMeasure": ("model.heads", "HeadMeasure"),
    "attention_velocity": ("attention.softmax", "attention_velocity"),
    "tilted_moments": ("attention.softmax", "tilted_moments"),
    "Sources": ("attention.softmax", "Sources"),
    "ForwardSolver": ("solvers.forward", "ForwardSolver"),
    "build_problem": ("solvers.problem", "build_problem"),
    # the Python API (pdeformer.api): objects and the functions that solve them
    **{name: ("api", name) for name in (
        "BoxMesh", "CircleMesh", "SphereMesh", "MeshFile", "Transformer", "GaussianMixture", "Uniform",
        "Points", "DensityFile", "VonMisesFisher", "Harmonics", "DG", "Particles", "Moments", "Potential",
        "Interaction", "L2", "MMD", "solve", "value_and_grad", "Solution", "train", "Training")},
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module 'pdeformer' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
