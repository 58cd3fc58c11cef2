"""pdeformer: the mean-field limit of transformers (infinitely deep and wide) as PDEs.

Token densities are transported by multi-head softmax attention,
d/dt rho + div(rho v_t[rho]) = 0, discretised with discontinuous Galerkin in dolfinx
and solved in parallel with PETSc. The public API is what the ``pdeformer`` command
calls::

    from pdeformer import load_config, run_forward
    result = run_forward(load_config("runs/default.toml"))

Parts that import without dolfinx or PETSc: the kernel and head measure
(``pdeformer.attention``, ``pdeformer.heads``, ``pdeformer.laplace``,
``pdeformer.velocity``), prompts, objectives, timestepping, the particle model
(``pdeformer.particles``), ``pdeformer.frames`` and ``pdeformer.config``.
"""

__version__ = "0.1.0"

_LAZY = {
    "load_config": ("config", "load_config"),
    "run_forward": ("run", "run_forward"),
    "HeadMeasure": ("heads", "HeadMeasure"),
    "attention_velocity": ("attention", "attention_velocity"),
    "tilted_moments": ("attention", "tilted_moments"),
    "Sources": ("attention", "Sources"),
    "ForwardSolver": ("forward", "ForwardSolver"),
    "build_problem": ("forward", "build_problem"),
}


def __getattr__(name):
    if name in _LAZY:
        import importlib
        module, attr = _LAZY[name]
        return getattr(importlib.import_module(f"{__name__}.{module}"), attr)
    raise AttributeError(f"module 'pdeformer' has no attribute {name!r}")


__all__ = ["__version__", *_LAZY]
