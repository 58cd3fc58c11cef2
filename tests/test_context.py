"""Two problems in one process keep apart (pdeformer/model/context.py): each solver reads
the communicator, meter and attention costs of the RunContext it is given, never
process-wide state."""

from __future__ import annotations

import copy
import dataclasses
import json
import os
import sys
from contextlib import contextmanager

import numpy as np
import pytest
from mpi4py import MPI

from conftest import ROOT, requires_dolfinx, run_script

pytestmark = [requires_dolfinx]

PINNED = os.path.join(ROOT, "tests", "costs.json")
RAW = {"mesh": {"lower": [-3.0, -3.0], "upper": [3.0, 3.0], "cells": [8, 8]},
       "discretisation": {"steps_per_layer": 4},
       "model": {"layers": 1, "heads": 2, "seed": 3, "init_scale": 0.5},
       "attention": {"backend": "auto"}, "output": {"fields": False, "plots": False},
       "prompts": [{"kind": "gaussian_mixture", "means": [[0.3, -0.2]], "covs": [0.5]}]}


def pinned_costs(**changes):
    """The pinned costs (tests/costs.json) with ``changes``."""
    from pdeformer.attention.costs import Costs
    return dataclasses.replace(Costs.from_dict(json.load(open(PINNED)), PINNED), **changes)


@contextmanager
def machine_costs_unreachable():
    """Every module's ``machine_costs`` (the process's memo of this machine's costs)
    raises inside: what runs there reads the costs of its context alone."""
    from pdeformer.attention import costs

    def refuse(comm=None):
        raise AssertionError("a solver read the process's costs")
    bound = [m for name, m in list(sys.modules.items())
             if name.startswith("pdeformer") and getattr(m, "machine_costs", None) is costs.machine_costs]
    original = costs.machine_costs
    for m in bound:
        m.machine_costs = refuse
    try:
        yield
    finally:
        for m in bound:
            m.machine_costs = original


def solve_three(comm, folder: str) -> dict:
    """Problems A and B on ``comm``, built side by side, each with a context of its own:
    A's costs make direct sums nearly free (auto sums directly), B's make them dear (auto
    takes laplace tables). Solved A, B, A, with the process's costs out of reach; per
    solve its coefficients, and the communication each context's meter counted."""
    from pdeformer.model.config import check_config
    from pdeformer.model.context import RunContext
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    contexts = {"A": RunContext.create(comm, costs=pinned_costs(pair=1e-15)),
                "B": RunContext.create(comm, costs=pinned_costs(pair=1.0))}
    solvers, solves = {}, []
    with machine_costs_unreachable():
        for name, context in contexts.items():
            cfg = check_config(copy.deepcopy(RAW), folder)
            solvers[name] = ForwardSolver(build_problem(cfg, comm, context=context))
        for name in "ABA":
            start = {n: c.meter.comm_calls for n, c in contexts.items()}
            coeffs, _ = solvers[name].solve_prompt(0)
            solves.append({"name": name, "coeffs": np.array(coeffs),
                           "calls": {n: c.meter.comm_calls - start[n] for n, c in contexts.items()}})
    return {"contexts": contexts, "solvers": solvers, "solves": solves}


def check_apart(run: dict, ranks: int) -> None:
    """Each problem planned with its own costs, solving B between A's solves left A's
    results unchanged bit for bit, and each context's meter counted its own problem's
    communication alone (on one rank nothing is communicated)."""
    contexts, solvers, (a1, b, a2) = run["contexts"], run["solvers"], run["solves"]
    for name in "AB":
        attention = solvers[name].velocity_field.attention
        assert solvers[name].problem.context is contexts[name]
        assert attention.costs is contexts[name].costs and attention.planner.costs is contexts[name].costs
    stats_a, stats_b = solvers["A"].velocity_field.stats, solvers["B"].velocity_field.stats
    assert stats_a["laplace"] == 0 and stats_a["direct"] > 0, stats_a
    assert stats_b["laplace"] > 0 and stats_b["direct"] == 0, stats_b
    assert solvers["B"].velocity_field.last_sum.table.costs is contexts["B"].costs
    assert np.array_equal(a1["coeffs"], a2["coeffs"])
    gap = np.abs(a1["coeffs"] - b["coeffs"]).max()       # B's tables meet tol, not bit for bit
    assert 0 < gap < 1e-6 * np.abs(a1["coeffs"]).max(), gap
    assert contexts["A"].meter is not contexts["B"].meter
    for solve in (a1, b, a2):
        other = "B" if solve["name"] == "A" else "A"
        assert solve["calls"][other] == 0, solve
        assert (solve["calls"][solve["name"]] > 0) == (ranks > 1), solve


def test_two_problems_in_one_process_keep_apart(tmp_path):
    check_apart(solve_three(MPI.COMM_WORLD, str(tmp_path)), MPI.COMM_WORLD.size)


def test_a_context_meters_its_communicator_and_loads_the_costs_once():
    """RunContext.create wraps a plain communicator in a fresh meter, keeps a metered one,
    and takes given costs as they are."""
    from pdeformer.attention.costs import machine_costs
    from pdeformer.model.context import RunContext
    from pdeformer.tools.parallel import Meter, metered
    plain = RunContext.create(MPI.COMM_WORLD)
    assert isinstance(plain.meter, Meter) and plain.costs is machine_costs()
    world = metered(MPI.COMM_WORLD, Meter())
    costs = pinned_costs(pair=1.0)
    given = RunContext.create(world, costs=costs)
    assert given.comm is world and given.meter is world.meter and given.costs is costs
    assert RunContext.create(MPI.COMM_WORLD).meter is not plain.meter


SCRIPT = """
import json, sys
from mpi4py import MPI
sys.path.insert(0, sys.argv[1])
from test_context import check_apart, solve_three
check_apart(solve_three(MPI.COMM_WORLD, sys.argv[2]), MPI.COMM_WORLD.size)
print("apart", flush=True)
"""


@pytest.mark.mpi
def test_two_problems_keep_apart_on_two_ranks(tmp_path):
    """The same on 2 ranks, where each context's meter counts its own problem's
    collectives and ghost updates and none of the other's."""
    script = tmp_path / "apart.py"
    script.write_text(SCRIPT)
    proc = run_script(script, [os.path.join(ROOT, "tests"), tmp_path], nprocs=2)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("apart") == 2, proc.stdout
