"""DG transport against exact solutions: translation under uniform attention, mass
conservation with outflow, the positivity limiter. In-process, one rank."""

from __future__ import annotations

import numpy as np
import pytest

from configs import make_solver
from conftest import requires_dolfinx

pytestmark = [requires_dolfinx]


def uniform_attention_heads(d, layers=2, heads=1):
    """Q = 0 (uniform attention): the exact solution is a translation. V: an expansion
    with a rotation, then a contraction with a rotation, alternating over layers."""
    from pdeformer.model.heads import HeadMeasure
    h = HeadMeasure.random(layers, heads, 1, d, seed=0)
    h.Q[:] = 0.0
    R = np.triu(np.ones((d, d)), 1) - np.tril(np.ones((d, d)), -1)
    for l in range(layers):
        h.V[l] = (1.2 * np.eye(d) + 0.5 * R) if l % 2 == 0 else (-0.3 * np.eye(d) + 0.4 * R)
    return h


def translation_error(tmp_path, dim, cell, degree, n, half_width=3.5, variance=0.25):
    """L2 error at t = 1 of a Gaussian translated by uniform attention."""
    import ufl
    from pdeformer.model.exact import uniform_attention_shift
    from pdeformer.fem.transport import l2_norm
    mean = [0.6, 0.3, -0.2][:dim]
    lo, hi = -half_width, half_width
    heads = uniform_attention_heads(dim)
    solver = make_solver(tmp_path, lower=[lo] * dim, upper=[hi] * dim, cells=[n] * dim,
                         cell=cell, degree=degree, heads=heads,
                         prompt={"kind": "gaussian_mixture", "means": [mean], "covs": [variance]},
                         disc={"cfl": 0.3, "limiter": False})
    coeffs, _ = solver.solve_prompt(0)
    gauss = solver.problem.prompts[0][1]
    shift = uniform_attention_shift(heads, gauss.mean(), 1.0)
    assert 0.2 < np.linalg.norm(shift) < 1.0          # it moves several cells, stays inside
    tr = solver.transport
    tr.set_state(coeffs)
    x = ufl.SpatialCoordinate(tr.mesh)
    exact = gauss.ufl_density(x - ufl.as_vector([float(s) for s in shift]))
    return l2_norm(tr.comm, tr.u - exact, 2 * degree + 6)


class TranslationConvergence:
    """Uniform attention translates rho exactly; DG-k with an SSP scheme of order k+1
    and dt ~ h converges at order k+1 in L2. Subclasses swap mesh and element only."""

    dim, cell, degree, cells = 2, "triangle", 1, (8, 16, 32)
    half_width, variance = 3.5, 0.25   # domain [-w, w]^d; truncated mass < 1e-6

    @property
    def rate(self):
        return self.degree + 1

    def test_rate(self, tmp_path):
        """Observed order between the two finest meshes (as a convergence table reports
        it) within 0.3 of k+1; errors fall at every refinement."""
        errors = [translation_error(tmp_path, self.dim, self.cell, self.degree, n,
                                    self.half_width, self.variance) for n in self.cells]
        rates = np.log(np.array(errors[:-1]) / errors[1:]) / np.log(2.0)
        assert np.all(rates > 0), errors
        assert abs(rates[-1] - self.rate) < 0.3, (errors, rates)


class TestIntervalDG1(TranslationConvergence):
    dim, cell, degree, cells = 1, "interval", 1, (20, 40, 80)
    half_width = 5.0


class TestIntervalDG2(TranslationConvergence):
    dim, cell, degree, cells = 1, "interval", 2, (40, 80, 160)
    half_width = 5.0


class TestIntervalDG3(TranslationConvergence):
    dim, cell, degree, cells = 1, "interval", 3, (10, 20, 40)
    half_width = 5.0


class TestTriangleDG1(TranslationConvergence):
    dim, cell, degree, cells = 2, "triangle", 1, (8, 16, 32)


class TestQuadrilateralDG1(TranslationConvergence):
    dim, cell, degree, cells = 2, "quadrilateral", 1, (8, 16, 32)


class TestTriangleDG2(TranslationConvergence):
    dim, cell, degree, cells = 2, "triangle", 2, (6, 12, 24)
    half_width, variance = 4.0, 0.4    # wider Gaussian: asymptotic on coarser meshes


@pytest.mark.slow
class TestTriangleDG2Fine(TranslationConvergence):
    dim, cell, degree, cells = 2, "triangle", 2, (8, 16, 32)
    half_width, variance = 4.0, 0.4


@pytest.mark.slow
class TestTetrahedronDG1(TranslationConvergence):
    dim, cell, degree, cells = 3, "tetrahedron", 1, (4, 8, 16)


@pytest.mark.slow
class TestQuadrilateralDG3(TranslationConvergence):
    dim, cell, degree, cells = 2, "quadrilateral", 3, (6, 12, 24)
    half_width, variance = 4.0, 0.4


def test_mass_plus_outflow_is_conserved(tmp_path):
    """Expanding uniform attention (V = 2 I) pushes a third of the mass out of the box:
    mass + accumulated outflow stays 1 to round-off, at every layer boundary."""
    from pdeformer.solvers.forward import Tracker
    heads = uniform_attention_heads(2, layers=3)
    heads.V[:] = 2.0 * np.eye(2)
    solver = make_solver(tmp_path, lower=[-2.0, -2.0], upper=[2.0, 2.0], cells=[12, 12],
                         degree=2, heads=heads, disc={"max_outflow": 1.0},   # (it is the point)
                         prompt={"kind": "gaussian_mixture", "means": [[0.5, 0.2]], "covs": [0.1]})

    class Record(Tracker):
        def __init__(self):
            self.rows = []

        def frame(self, s, frame):
            self.rows.append(s.diagnostics(frame))

    record = Record()
    solver.run([record])
    rows = record.rows
    assert len(rows) == 4
    assert rows[-1]["outflow"] > 0.5
    for r in rows:
        assert abs(r["mass"] + r["outflow"] - 1.0) < 1e-12, r


def test_a_run_whose_mass_has_left_is_a_breakdown(tmp_path):
    """The same expansion with discretisation.max_outflow at its default (0.5): the frame
    where more than half the mass has left stops the run, saying how much is left."""
    from pdeformer.tools.errors import SolverBreakdown
    heads = uniform_attention_heads(2, layers=3)
    heads.V[:] = 2.0 * np.eye(2)
    solver = make_solver(tmp_path, lower=[-2.0, -2.0], upper=[2.0, 2.0], cells=[12, 12], degree=2,
                         heads=heads, prompt={"kind": "gaussian_mixture", "means": [[0.5, 0.2]], "covs": [0.1]})
    with pytest.raises(SolverBreakdown, match=r"t = [\d.]+: (0.\d+|all but [\d.e-]+) of the mass has left the mesh \(more than "
                       r"discretisation.max_outflow = 0.5\); the moments of the [\d.e-]+ left say little"):
        solver.run([])


def test_limiter_keeps_means_and_positivity(tmp_path):
    """A uniform prompt (discontinuous) projected on DG-2 undershoots; the limiter
    removes every negative nodal value without changing the mass."""
    from pdeformer.model.heads import HeadMeasure
    heads = HeadMeasure.random(1, 2, 2, 2, seed=3)
    kw = dict(lower=[-2.0, -2.0], upper=[2.0, 2.0], cells=[10, 10], degree=2, heads=heads,
              prompt={"kind": "uniform", "lower": [-0.73, -0.61], "upper": [0.52, 0.68]})
    raw = make_solver(tmp_path, disc={"limiter": False}, **kw)
    lim = make_solver(tmp_path, disc={"limiter": True}, **kw)
    u_raw, info = raw.initial_state(0)
    u_lim, _ = lim.initial_state(0)
    tr = lim.transport
    assert u_raw.min() < -1e-2                       # Gibbs undershoot without the limiter
    assert tr.min_value(u_lim) > -1e-14 * u_lim.max()  # nodes, vertices, sources, facet points
    centre = np.zeros(2)
    m_raw, m_lim = tr.moments(u_raw, centre)[0], tr.moments(u_lim, centre)[0]
    assert abs(m_raw - 1.0) < 1e-13 and abs(m_lim - 1.0) < 1e-13
    means = lambda u: np.einsum("ki,ki->k", tr.mean_weights, u[tr.cell_dofs])
    np.testing.assert_allclose(means(u_lim), means(u_raw), rtol=0, atol=1e-13 * u_raw.max())
    assert info["truncated_mass"] == 0.0   # the box lies inside the mesh
    assert abs(info["mass_on_mesh"] - 1) < 5e-2  # quadrature of the cut cells
    # and through the transport: positivity is kept at every step
    end, _ = lim.solve_prompt(0)
    assert tr.min_value(end) > -1e-14 * end.max()


def record_steps(solver):
    """Wrap the solver's step and CFL functions to record (layer, dt, dt_cfl) per step."""
    steps, cfl = [], []
    step, cfl_step = solver._step, solver.transport.cfl_step

    def recording_cfl(c):
        cfl.append(cfl_step(c)[0])
        return cfl[-1], 0.0

    def recording_step(state, dt, layer, first, tape=None):
        steps.append((layer, dt, cfl[-1]))
        return step(state, dt, layer, first, tape)

    solver._step, solver.transport.cfl_step = recording_step, recording_cfl
    return steps


def frame_times(solver):
    from pdeformer.solvers.forward import Tracker
    seen = []

    class Times(Tracker):
        def frame(self, s, frame):
            seen.append((frame.t, frame.layer_boundary))

    solver.run([Times()])
    return seen


def test_cfl_step_lands_on_layer_boundaries(tmp_path):
    """Every CFL step stays below the CFL limit, the steps of a frame add up to it
    exactly, and frames (and so layer boundaries) are hit exactly."""
    heads = uniform_attention_heads(1, layers=3)
    solver = make_solver(tmp_path, lower=[-3.0], upper=[3.0], cells=[30], degree=1, heads=heads,
                         prompt={"kind": "gaussian_mixture", "means": [[0.3]], "covs": [0.2]})
    solver.frames_per_layer = 2
    steps = record_steps(solver)
    seen = frame_times(solver)
    assert [t for t, _ in seen] == [0.0, 1 / 6, 1 / 3, 0.5, 2 / 3, 5 / 6, 1.0]
    assert [b for _, b in seen] == [True, False, True, False, True, False, True]
    assert len(steps) > 3 * 4
    for layer, dt, dt_cfl in steps:
        assert 0 < dt <= dt_cfl * (1 + 1e-12)
    for l in range(3):
        assert abs(sum(dt for layer, dt, _ in steps if layer == l) - 1 / 3) < 1e-14


def test_fixed_steps_per_layer(tmp_path):
    heads = uniform_attention_heads(1, layers=2)
    kw = dict(lower=[-3.0], upper=[3.0], cells=[20], degree=1, heads=heads,
              prompt={"kind": "gaussian_mixture", "means": [[0.3]], "covs": [0.2]})
    solver = make_solver(tmp_path, disc={"steps_per_layer": 12}, **kw)
    solver.frames_per_layer = 3
    steps = record_steps(solver)
    assert [t for t, _ in frame_times(solver)] == pytest.approx([0, 1 / 6, 1 / 3, 1 / 2, 2 / 3, 5 / 6, 1])
    assert len(steps) == 24
    assert all(abs(dt - 1 / 24) < 1e-15 for _, dt, _ in steps)
    from pdeformer.tools.errors import ConfigError
    with pytest.raises(ConfigError, match="^output.frames_per_layer: 5 does not divide"):
        from pdeformer.model.config import check_config
        from pdeformer.solvers.problem import build_problem
        from mpi4py import MPI
        raw = {"mesh": {"lower": [-1.0], "upper": [1.0], "cells": [4]},
               "discretisation": {"steps_per_layer": 12}, "model": {"layers": 1, "heads": 1},
               "output": {"frames_per_layer": 5},
               "prompts": [{"kind": "uniform", "lower": [-0.5], "upper": [0.5]}]}
        build_problem(check_config(raw, str(tmp_path)), MPI.COMM_WORLD)


def test_velocity_degree_above_density_degree(tmp_path):
    """P2 velocity with DG-1 density: the translation is still converging at order 2."""
    heads = uniform_attention_heads(2)
    errors = []
    for n in (16, 32):
        import ufl
        from pdeformer.model.exact import uniform_attention_shift
        from pdeformer.fem.transport import l2_norm
        solver = make_solver(tmp_path, lower=[-3.5] * 2, upper=[3.5] * 2, cells=[n, n], degree=1,
                             heads=heads, disc={"velocity_degree": 2, "limiter": False},
                             prompt={"kind": "gaussian_mixture", "means": [[0.6, 0.3]], "covs": [0.25]})
        coeffs, _ = solver.solve_prompt(0)
        gauss = solver.problem.prompts[0][1]
        shift = uniform_attention_shift(heads, gauss.mean(), 1.0)
        tr = solver.transport
        tr.set_state(coeffs)
        x = ufl.SpatialCoordinate(tr.mesh)
        errors.append(l2_norm(tr.comm, tr.u - gauss.ufl_density(x - ufl.as_vector(list(shift))), 8))
    assert 1.7 < np.log2(errors[0] / errors[1]) < 2.3, errors


def test_file_prompt_truncation(tmp_path, caplog):
    """Data on [-6, 6] (not normalised) meets the mesh [-4, 4]: a third of its mass is
    cut off, reported and warned about; the rest is normalised to mass 1."""
    x = np.linspace(-6, 6, 121)
    np.savez(tmp_path / "flat.npz", points=x[:, None], density=np.full_like(x, 2.5))
    heads = uniform_attention_heads(1, layers=1)
    solver = make_solver(tmp_path, lower=[-4.0], upper=[4.0], cells=[16], degree=1, heads=heads,
                         prompt={"kind": "file", "path": "flat.npz"})
    info = solver.prompt_info[0]
    assert abs(info["truncated_mass"] - 1 / 3) < 1e-12
    assert abs(info["mass_on_mesh"] - 20.0) < 1e-11
    assert any("of its mass lies outside the mesh" in r.message for r in caplog.records)
    centre = np.zeros(1)
    assert abs(solver.transport.moments(solver.initial_coeffs[0], centre)[0] - 1) < 1e-13


GHOSTS_SCRIPT = r'''
import json, sys
import numpy as np
from mpi4py import MPI
from pdeformer.model.config import load_config
from pdeformer.solvers.forward import ForwardSolver
from pdeformer.solvers.problem import build_problem

comm = MPI.COMM_WORLD
cfg = load_config(sys.argv[2], ["mesh.cells=[12,12]", "output.fields=false"])
solver = ForwardSolver(build_problem(cfg, comm, differentiable=True))
tr = solver.transport
a, _ = solver.initial_state(0)
rng = np.random.default_rng(comm.rank)
b = 2.0 * a + 1e-3 * rng.normal(size=a.shape)
vel = solver.velocity(a, 0)                      # sets v (and its ghosts)
bar = rng.normal(size=a.shape)

def fresh(c):
    tr.set_state(c)
    return tr.rate()[0], *tr.rate_vjp(bar)

def lazy(c):
    tr.set_state(a)
    tr.set_state(c, ghosts=False)
    ghosts = tr.u.x.array[tr.n_owned:].copy()    # still a's: stale
    out = [tr.rate()[0]]
    tr.set_state(a)
    tr.set_state(c, ghosts=False)
    out += list(tr.rate_vjp(bar))
    return ghosts, out

tr.set_state(a)
ghosts_a = tr.u.x.array[tr.n_owned:].copy()
expected = fresh(b)
ghosts_b = tr.u.x.array[tr.n_owned:].copy()
stale, got = lazy(b)
again = fresh(b)
# the adjoint's tape: ghost entries kept after rate() and set back without communication
tr.set_state(b)
kept = tr.ghost_values()
tr.set_state(a)
tr.set_velocity(2.0 * vel)                       # other ghosts in place, of u and v
tr.set_state(b, ghosts=kept[0])
tr.set_velocity(vel, ghosts=kept[1])
taped = [tr.rate()[0], *tr.rate_vjp(bar)]
# what reads owned cells only (sources, limiter check points, moments) reads no ghost:
# the same with the ghost copies poisoned
centre = np.zeros(tr.d)
owned_reads = lambda: (tr.sources.weights(), tr.cell_minima(b), tr.summary(b, centre)["cov"])
clean = owned_reads()
tr.set_state(b, ghosts=False)
tr.u.x.array[tr.n_owned:] = np.nan
poisoned = owned_reads()
tr.set_state(b)

rel = lambda x, y: comm.allreduce(float(np.abs(x - y).max(initial=0.0)), op=MPI.MAX) / \
    comm.allreduce(float(np.abs(y).max(initial=0.0)), op=MPI.MAX)
res = {"ghosts": comm.allreduce(len(ghosts_b), op=MPI.SUM),
       "stale_is_a": comm.allreduce(bool(np.array_equal(stale, ghosts_a)), op=MPI.LAND),
       "ghosts_differ": comm.allreduce(float(np.abs(ghosts_b - ghosts_a).max(initial=0.0)), op=MPI.MAX),
       "lazy": max(rel(x, y) for x, y in zip(got, expected)),
       "repeat": max(rel(x, y) for x, y in zip(again, expected)),
       "taped": max(rel(x, y) for x, y in zip(taped, expected)),
       "kept": comm.allreduce(len(kept[0]) + len(kept[1]), op=MPI.SUM),
       "owned": comm.allreduce(all(np.array_equal(x, y) for x, y in zip(poisoned, clean)), op=MPI.LAND)}
if comm.rank == 0:
    json.dump(res, open(sys.argv[1], "w"))
'''


@pytest.mark.mpi
def test_density_ghosts_are_updated_where_the_forms_read_them(tmp_path):
    """On 2 ranks: a density set without its ghost cells' copies (what the sources, the
    limiter and the moments read: owned cells only, the same with the ghosts poisoned by
    NaN) leaves them stale, and the right-hand side and its reverse mode update them
    before assembling -- the same rate and cotangents as a density set with them; a
    second reverse mode on the same inputs gives the same cotangents (its vectors are
    reused, zeroed); ghost entries kept with ghost_values() and set back with the state
    and velocity (the adjoint's tape) give them too, with other ghosts in place before."""
    import json
    import os
    from conftest import ROOT, run_script
    script, out = tmp_path / "ghosts.py", tmp_path / "out.json"
    script.write_text(GHOSTS_SCRIPT)
    proc = run_script(script, [out, os.path.join(ROOT, "runs", "default.toml")], nprocs=2, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    res = json.loads(out.read_text())
    assert res["ghosts"] > 0 and res["stale_is_a"] and res["ghosts_differ"] > 1e-3, res
    assert res["lazy"] == 0.0 and res["repeat"] == 0.0 and res["owned"], res
    assert res["kept"] > 0 and res["taped"] == 0.0, res      # the tape's ghosts: no update needed
