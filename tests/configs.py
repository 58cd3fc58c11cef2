"""Configs, builders and output readers shared by several test modules (a test module
imports them from here, never from another test module)."""

from __future__ import annotations

import csv
import os

# a two-prompt training on a 10 x 10 mesh: 2 layers of 2 heads, 5 steps of gd,
# checkpoints every 2 (tests/test_train.py, test_reliability.py, test_converge.py)
CONFIG = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [10, 10]

[discretisation]
limiter = false
steps_per_layer = 8

[model]
layers = 2
heads = 2
seed = 3
init_scale = 0.8

[objective]
kind = "moments"

[train]
steps = 5
lr = 0.05
checkpoint_every = 2

[output]
dir = "out"
fields = false

[[prompts]]
name = "a"
kind = "gaussian_mixture"
means = [[0.5, 0.2], [-0.6, 0.1]]
covs = [0.2, 0.3]
target = { mean = [0.3, -0.2], cov = [[0.4, 0.1], [0.1, 0.3]] }

[[prompts]]
name = "b"
kind = "gaussian_mixture"
means = [[-0.2, -0.4]]
covs = [0.25]
target = { mean = [0.0, 0.5], cov = 0.3 }
"""


def history(folder):
    with open(os.path.join(folder, "history.csv"), newline="") as f:
        return [{k: float(v) for k, v in r.items()} for r in csv.DictReader(f)]


def make_solver(tmp_path, *, lower, upper, cells, cell=None, degree=1, heads=None,
                prompt=None, disc=None, attention=None):
    from mpi4py import MPI
    from pdeformer.model.config import check_config
    from pdeformer.model.schema import options
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import Problem
    from pdeformer.fem.mesh import make_mesh
    from pdeformer.model.prompts import make_prompt
    d = len(lower)
    raw = {"mesh": {"lower": lower, "upper": upper, "cells": cells},
           "discretisation": {"degree": degree, **(disc or {})},
           "model": {"layers": heads.layers, "heads": heads.heads},
           "output": {"fields": False},
           "prompts": [prompt]}
    if cell:
        raw["mesh"]["cell"] = cell
    if attention:
        raw["attention"] = attention
    cfg = check_config(raw, str(tmp_path))
    mesh = make_mesh(MPI.COMM_WORLD, options(cfg).mesh)
    problem = Problem(MPI.COMM_WORLD, cfg, mesh, heads,
                      [(p["name"], make_prompt(p, d, i)) for i, p in enumerate(cfg["prompts"])])
    return ForwardSolver(problem)
