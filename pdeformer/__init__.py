"""pdeformer: the mean-field limit of transformers (infinitely deep and wide) as PDEs.

Token densities are transported by multi-head softmax attention,
d/dt rho + div(rho v_t[rho]) = 0, discretised with discontinuous Galerkin in dolfinx
and solved in parallel with PETSc. The public API is what the ``pdeformer`` command
calls::

    from pdeformer import load_config, run_forward
    result = run_forward(load_config("runs/default.toml"))

The package is in layers, each a subpackage that imports only its own layer or lower ones
(docs/architecture.md): ``tools`` (errors, config, MPI, output files); the core, which
imports neither dolfinx nor PETSc: ``integrator`` (schemes, the march through depth),
``attention`` (softmax sums, the log-Laplace table) and ``model`` (heads, velocity,
prompts, objectives, the particle model); ``fem`` (dolfinx: meshes, DG transport);
``solvers`` (forward, adjoint, training); ``commands`` (the CLI, runs, studies).
"""

__version__ = "0.1.0"

_LAZY = {
    "load_config": ("tools.config", "load_config"),
    "run_forward": ("commands.run", "run_forward"),
    "HeadMeasure": ("model.heads", "HeadMeasure"),
    "attention_velocity": ("attention.softmax", "attention_velocity"),
    "tilted_moments": ("attention.softmax", "tilted_moments"),
    "Sources": ("attention.softmax", "Sources"),
    "ForwardSolver": ("solvers.forward", "ForwardSolver"),
    "build_problem": ("solvers.forward", "build_problem"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module 'pdeformer' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
