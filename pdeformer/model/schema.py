"""The run configuration's schema, assembled from the components that declare its keys.

Each section of a run's TOML file is a table of :class:`~pdeformer.tools.keys.Key`
declared beside the code that reads it; a choice among registered parts takes the
names of their registry:

* ``[mesh]``: :data:`pdeformer.model.geometry.MESH_KEYS` (``shape``: ``SHAPES``);
* ``[discretisation]``: here, its ``scheme`` :data:`pdeformer.integrator.schemes.SCHEME_KEY`
  (``SCHEMES``);
* ``[model]``: :data:`pdeformer.model.heads.MODEL_KEYS` and each token-wise term's
  ``model_keys`` (:func:`pdeformer.model.terms.term_classes`);
* ``[attention]``: :data:`pdeformer.model.velocity.ATTENTION_KEYS` (``backend``: ``BACKENDS``);
* ``[output]``: here;
* ``[objective]``: each objective class's ``keys``, merged by
  :func:`pdeformer.model.objectives.objective_keys` (``kind``: ``OBJECTIVES``);
* ``[train]``: here;
* ``[particles]``: :data:`pdeformer.model.particles.PARTICLES_KEYS`;
* ``[ntk]``: here;
* ``[data]``: :data:`pdeformer.tools.datasets.DATA_KEYS` (``family``: ``FAMILIES``);
* ``[parallel]``: :data:`pdeformer.tools.parallel.PARALLEL_KEYS`;
* ``[petsc]``: free-form PETSc options (:func:`pdeformer.tools.keys.petsc_options`);
* ``[[prompts]]``: ``name``, ``kind`` (:data:`PROMPT_KINDS`: the ``PROMPTS`` of every
  geometry's family, :data:`pdeformer.model.geometry.GEOMETRIES`), the kind's keys and
  ``target``.

The sections read only above the core -- the DG discretisation (``fem``), the output
(``solvers``, ``commands``), training (``solvers.train``) and the NTK test
(``commands.ntk``) -- are declared here, the lowest layer that sees every section: the
configuration is checked without dolfinx, and a module imports only its own layer or
lower ones. :mod:`pdeformer.model.config` checks a run's file against :data:`SCHEMA`.

A checked configuration is a dict, the record of the run (summary.json, checkpoints);
:func:`options` turns it into :class:`Options`, one frozen dataclass per section
(:data:`SECTIONS`) whose fields have the keys' types and defaults:
``options(cfg).discretisation.cfl``; ``AttentionOptions(backend="laplace")`` makes one
with every other key at its default. Solvers read these, never the dict.
"""

from __future__ import annotations

import dataclasses

from ..integrator.schemes import SCHEME_KEY
from ..tools.datasets import DATA_KEYS
from ..tools.keys import (REQUIRED, Key, array, boolean, integer, merge_keys, number, options_class, path,
                          string)
from ..tools.outdir import PICTURE_FORMATS
from ..tools.parallel import PARALLEL_KEYS
from .geometry import GEOMETRIES, MESH_KEYS
from .heads import MODEL_KEYS
from .objectives import objective_keys
from .particles import PARTICLES_KEYS
from .terms import term_classes
from .prompts import PromptKind, family_kinds
from .velocity import ATTENTION_KEYS

DISCRETISATION_KEYS = {
    "degree": Key(integer(1, 3), 1, "DG degree of the density"),
    "velocity_degree": Key(integer(1, 4), None, "Lagrange degree of the velocity (default: degree)"),
    "scheme": SCHEME_KEY,
    "cfl": Key(number(positive=True), 0.5, "dt = cfl * min_K l_K / ((2k+1) |v|_K)"),
    "steps_per_layer": Key(integer(1, 10**7), None, "fixed steps per layer instead of the CFL step"),
    "limiter": Key(boolean, True, "positivity limiter (keeps cell means)"),
    "quadrature_degree": Key(integer(1, 12), None,
                             "quadrature of the attention sources (default: degree)"),
    "prompt_quadrature_degree": Key(integer(1, 20), None,
                                    "quadrature projecting prompts (default: 2*degree + 4)"),
    "tail_tolerance": Key(number(nonnegative=True), 1e-6,
                          "warn when more prompt mass than this lies outside the mesh "
                          "(cut off at t = 0, or flowed out later)"),
    "max_outflow": Key(number(positive=True, hi=1.0), 0.5,
                       "a run whose outflow passes this share of the mass is a breakdown: the "
                       "moments of what is left say little (1: never)"),
}

OUTPUT_KEYS = {
    "dir": Key(path, None, "output folder (default: output/<config name> beside the config)"),
    "fields": Key(boolean, True, "write density (and velocity) fields for ParaView"),
    "velocity": Key(boolean, True, "also write the velocity fields"),
    "format": Key(string(("vtk", "vtx")), "vtk", "field format: vtk (.pvd) or vtx (.bp, dolfinx with ADIOS2)"),
    "frames_per_layer": Key(integer(1, 10**4), 1, "field and diagnostics frames per layer"),
    "plots": Key(boolean, True, "draw the run's pictures (PNG) into the output folder when it "
                 "ends, and write paraview.py; `pdeformer plot DIR` draws them again"),
    "plot_format": Key(string(PICTURE_FORMATS), "png", "image format of the pictures"),
    "max_memory_gb": Key(number(positive=True), None,
                         "refuse runs whose memory estimate for the ranks of a node exceeds "
                         "this (default: the node's available memory)"),
}

TRAIN_KEYS = {
    "steps": Key(integer(0, 10**6), None, "training steps (default: 20, or from train.epochs)"),
    "epochs": Key(integer(1, 10**6), None, "train this many passes over the training prompts "
                  "(steps = epochs x batches per epoch; instead of train.steps)"),
    "batch_size": Key(integer(1, 10**6), None, "minibatch SGD: training prompts per step, "
                      "drawn without replacement in an order shuffled every epoch "
                      "(default: all, full-batch)"),
    "seed": Key(integer(0, 2**63 - 1), 0, "seed of the minibatch order and of the Langevin noise"),
    "test_every": Key(integer(1, 10**6), 10, "every n steps (and at the last) the risk on all "
                      "training prompts (with minibatches) and on the held-out prompts"),
    "temperature": Key(number(nonnegative=True), 0.0,
                       "Langevin noise: gd adds sqrt(2 lr temperature) N(0, 1) to every "
                       "head parameter (mean-field Langevin dynamics)"),
    "weight_decay": Key(number(nonnegative=True), 0.0, "L2 penalty (weight_decay / 2) x the mean "
                        "over heads of |Q|^2 + |K|^2 + |V|^2, added to the risk"),
    "lr": Key(number(positive=True), 0.05, "learning rate (gd: particles move by -lr L H dR/dtheta)"),
    "optimizer": Key(string(("gd", "heun", "adam")), "gd",
                     "gd (the gradient flow's Euler step), heun (its second-order Heun step: two "
                     "gradients a step) or adam"),
    "beta1": Key(number(nonnegative=True, hi=0.999999), 0.9, "adam: first-moment decay"),
    "beta2": Key(number(nonnegative=True, hi=0.999999999), 0.999, "adam: second-moment decay"),
    "eps": Key(number(positive=True), 1e-8, "adam: denominator floor"),
    "checkpoint_every": Key(integer(1, 10**6), 5, "write a checkpoint every n steps"),
    "output_every": Key(integer(1, 10**6), 1, "write params_XXXX.npz and head points every n steps"),
}

NTK_KEYS = {
    "depth": Key(number(nonnegative=True, hi=1.0), None,
                 "test the densities of a forward run at this depth t (default: the prompts)"),
    "b_range": Key(number(positive=True), 3.0, "LSE test: b sampled in [-b_range, b_range]^d"),
    "b_count": Key(integer(2, 10**6), 256, "LSE test: number of sample points b"),
    "seed": Key(integer(0, 2**63 - 1), 0, "seed of the b sample and of sampled heads"),
    "tol": Key(number(positive=True, hi=1.0), 1e-6,
               "verdicts: sigma_min/sigma_max > tol, lambda_min/lambda_max > tol^2"),
    "params": Key(string(("A", "V", "all")), "A", "trained parameters in the NTK: A, V or all (Q, K, V)"),
    "heads": Key(string(("sampled", "run")), "sampled", "head measure of the NTK: sampled, or the run's heads"),
    "head_count": Key(integer(1, 10**6), 256, "sampled heads: how many"),
    "head_scale": Key(number(positive=True), 1.0, "sampled heads: Q, K, V entries ~ N(0, scale^2 / d)"),
    "layer": Key(integer(0, 10**5), None, "run heads: the layer (default: the one holding depth, or 0)"),
    "queries": Key(array, None, "query points x_p, d-vectors (default: one, (1,...,1)/sqrt(d))"),
    "pairing": Key(string(("all", "matched")), "all",
                   "data (mu_i, x_p): every prompt with every query, or prompt i with query i"),
    "quadrature_degree": Key(integer(1, 20), None,
                             "quadrature of mesh densities (default: 2 * degree + 2)"),
}

SCHEMA: dict[str, dict[str, Key]] = {
    "mesh": MESH_KEYS,
    "discretisation": DISCRETISATION_KEYS,
    "model": merge_keys([MODEL_KEYS, *(cls.model_keys for cls in term_classes())]),
    "attention": ATTENTION_KEYS,
    "output": OUTPUT_KEYS,
    "objective": objective_keys(),
    "train": TRAIN_KEYS,
    "particles": PARTICLES_KEYS,
    "ntk": NTK_KEYS,
    "data": DATA_KEYS,
    "parallel": PARALLEL_KEYS,
    "petsc": {},  # free-form PETSc options for the DG mass solver, see petsc_options
}

# Config keys that are paths, relative to the config file's folder
PATH_KEYS = (("mesh", "file"), ("model", "params"), ("model", "atoms"), ("output", "dir"),
             ("data", "teacher"), ("data", "folder"))


def is_path_key(parts: tuple) -> bool:
    """Whether the key ``parts`` (``("mesh", "file")``, ``("prompts", 0, "path")``) holds a
    path relative to the config file's folder (pdeformer.tools.tomlfile.apply_override)."""
    return parts in PATH_KEYS or (parts[0] == "prompts" and parts[-1] == "path")


# ----------------------------------------------------------------------------------
# [[prompts]]

# every prompt kind, in the order the configuration lists them
PROMPT_KINDS: dict[str, PromptKind] = {k: kind for space in GEOMETRIES
                                       for k, kind in family_kinds(space)[1].items()}
NAME = r"[A-Za-z0-9_-]{1,64}"   # prompt names go into file names: short and portable

# the keys of every [[prompts]] table, beside those of its kind and its target
PROMPT_COMMON_KEYS = {
    "name": Key(string(pattern=NAME), None, "prompt name (default: prompt<i>)"),
    "kind": Key(string(tuple(PROMPT_KINDS)), REQUIRED, "the prompt's kind (a target's too)"),
}


def target_kinds(sorts: tuple) -> tuple[str, ...]:
    """The target kinds an objective whose ``targets`` are ``sorts`` takes: "moments" (a
    table of mean and cov) and the prompt kinds of those sorts, in the order of
    PROMPT_KINDS."""
    return (("moments",) if "moments" in sorts else ()) + \
        tuple(k for k, kind in PROMPT_KINDS.items() if kind.target in sorts)


# ----------------------------------------------------------------------------------
# typed options


def _options_class(name: str, keys: dict[str, Key]) -> type:
    title = name.title().replace("_", "") + "Options"
    return options_class(title, keys, __name__, f"The checked ``[{name}]`` table (SCHEMA[{name!r}]).")


SECTIONS = {name: _options_class(name, keys) for name, keys in SCHEMA.items() if name != "petsc"}
MeshOptions, DiscretisationOptions = SECTIONS["mesh"], SECTIONS["discretisation"]
ModelOptions, AttentionOptions = SECTIONS["model"], SECTIONS["attention"]
OutputOptions, ObjectiveOptions = SECTIONS["output"], SECTIONS["objective"]
TrainOptions, ParticlesOptions = SECTIONS["train"], SECTIONS["particles"]
NtkOptions, DataOptions, ParallelOptions = SECTIONS["ntk"], SECTIONS["data"], SECTIONS["parallel"]

Options = dataclasses.make_dataclass(
    "Options", [(name, cls) for name, cls in SECTIONS.items()]
    + [("petsc", dict[str, str]), ("prompts", tuple[dict, ...])], frozen=True)
Options.__module__ = __name__
Options.__doc__ = """A checked configuration as typed sections: ``opts.mesh.cells``, ``opts.train.lr``.
    ``petsc`` is the free-form PETSc options table, ``prompts`` the checked prompt tables
    (their keys depend on each prompt's kind; read by the prompt and target factories)."""


def section(cfg: dict, name: str):
    """The checked ``[name]`` table of ``cfg`` as its frozen dataclass (SECTIONS)."""
    return SECTIONS[name](**cfg[name])


def options(cfg: dict) -> Options:
    """A checked config (:func:`pdeformer.model.config.load_config`) as :class:`Options`:
    made once, where a run starts; solvers read it, never the dict (which stays the
    record of the run)."""
    if isinstance(cfg, Options):
        return cfg
    typed = {name: section(cfg, name) for name in SECTIONS}
    return Options(**typed, petsc=dict(cfg["petsc"]), prompts=tuple(cfg["prompts"]))
