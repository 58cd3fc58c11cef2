r"""Convergence studies: one base run, one swept parameter, a reference.

``pdeformer converge STUDY.toml`` runs every case of the study in the current MPI job
(one after the other, all ranks together) and writes ``convergence.csv``,
``convergence.md`` (value, error and observed order between successive cases, per
quantity), ``convergence.png`` (log-log, with a reference slope) and ``summary.json``.

Study file::

    [study]
    run = "translation.toml"        # the base run configuration (relative to this file)
    command = "forward"             # forward | particles | gradient
    parameter = "mesh.cells"        # the swept key: mesh.cells, discretisation.degree,
                                    # model.layers, model.heads, particles.tokens,
                                    # discretisation.cfl, ... (any config key)
    values = [[8, 8], [16, 16], [32, 32]]
    reference = "exact"             # exact | expectation | finest | run | paired | draw | atoms
    reference_run = "other.toml"    # with reference = "run"/"paired" (relative to this file)
    reference_command = "forward"
    reference_set = []              # overrides of the reference run (run, paired, draw)
    quantities = ["l2", "mean", "cov"]  # also risk, l1, mmd, gradient, mean_bias, cov_bias
    expected_order = 2.0            # drawn as a reference slope and reported
    set = ["output.fields=false"]   # overrides applied to every case
    bandwidth = 0.5                 # kernel width of the mmd distance
    seeds = 16                      # an ensemble of 16 draws per case (default 1)
    seed_keys = ["model.seed", "particles.seed"]   # the random part an ensemble redraws
    groups = 1                      # run the ensemble's members in this many rank groups

References: ``exact`` is the exact solution of uniform attention (Q = 0: a translation of
the prompt); ``expectation`` the H -> infinity limit exactly, where the head law allows
it: heads drawn by a centred gaussian law have V centred and independent of (Q, K), so
the mean-field velocity E[V m_theta(x)] = E[V] E[m_theta(x)] vanishes and the limit of
every draw is the prompt itself; with ``query_mean``, ``key_mean``, ``value_mean`` (or
``law = "atoms"``) a Gaussian prompt stays Gaussian in the limit, its moments those of
the one mean head (of the weighted atoms: pdeformer.model.exact); ``finest`` the last case (of the same member of an
ensemble); ``run`` another run (``reference_run`` with ``reference_set``), computed once;
``paired`` that run with each member's seeds, computed per member (e.g. the Eulerian
solution for the same heads as the member's particles); ``draw`` an independent draw of
the study's own run with ``reference_set`` applied (e.g. ``model.heads=4096``) and every
seed key set to base + seeds, a seed no member uses; ``atoms`` (for ``model.law = "atoms"``)
the run with the atoms themselves as its heads, weighted by their weights: the exact
H -> infinity limit of i.i.d. draws from them, for any prompt.

Ensembles (``seeds = n``): member j of every case runs with each of ``seed_keys`` set to
its base value + j (so member 0 is the base run, and any member is reproduced with
``--set model.seed=...``); the seeds do not depend on the rank count. The tables give
the mean error over the members with its 95% interval (Student's t), and an order fitted
by weighted least squares over all cases with its 95% interval from the members'
jackknife (pdeformer.tools.stats; the cases of a member share its draw, the members are
independent). ``ensemble.csv`` lists every member's errors; a member the walltime guard
cut short is left out of the tables. ``groups = G``
splits the ranks into G groups that run blocks of members side by side (G divides the
rank count, G <= seeds); the results do not depend on G.

Quantities: ``mean`` (|mean - mean_ref|), ``cov`` (||cov - cov_ref||_F) and ``risk``
(|R - R_ref|) for every command; ``l2``, ``l1`` (density errors, the reference field's
quadrature; with reference = exact the exact translated prompt) for forward; ``mmd``
(the kernel distance between tokens and a reference density) for particles; ``gradient``
(||g - g_ref|| / ||g_ref||) for gradient and particles. The maximum over prompts is
reported. ``mean_bias`` and ``cov_bias`` (an ensemble of 3 or more) measure the bias
|E q - q_ref| where ``mean`` and ``cov`` measure the fluctuation E|q - q_ref|: each
member's deviation (every prompt's mean, or covariance, less the reference's) along the
common direction of the cases' mean deviations, averaged over the members
(pdeformer.commands.study_tables.bias_matrix); a bias of order p in h has order p here
while the fluctuation of a Monte Carlo draw keeps order 1/2. The size that orders refer to: h ~ 1/cells, 1/L, 1/H, 1/N, 1/steps per layer,
the cfl number; for other parameters the value itself.

Every case runs on all ranks of its group together: prompt groups (``[parallel]
prompt_groups`` > 1 in a case's run configuration) are refused. summary.json has the
``parallel`` accounting of the whole study (see pdeformer.tools.parallel.Meter).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import ufl

from ..fem import _dolfinx as dfx
from ..solvers.budget import check_memory
from ..tools.errors import ConfigError, InputError, PdeformerError, status_of, within
from ..tools.output import provenance, write_json
from ..tools.parallel import (Meter, PromptGroups, Timer, allgather_rows, describe_parallel, metered,
                              on_root, parallel_report)
from .study import BIASES, check_members_differ, describe_reference, exact_reference, prepare, study_inputs
from .study_tables import error_rows, write_study

log = logging.getLogger("pdeformer")

# --------------------------------------------------------------------------- cases

class Case:
    """The outcome of one run: per prompt mean, cov (and risk, gradient, density)."""

    def __init__(self, command: str, cfg: dict, context, timer: Timer, gradient: bool):
        from ..solvers.problem import build_problem
        self.command, self.cfg = command, cfg
        if cfg["parallel"]["prompt_groups"] > 1:
            raise ConfigError("parallel.prompt_groups", "converge runs every case as one group of "
                              f"all ranks: prompt groups are not supported (set 1, got "
                              f"{cfg['parallel']['prompt_groups']})")
        if cfg["mesh"]["shape"] != "box":
            raise ConfigError("mesh.shape", "convergence studies on a circle or sphere are not "
                              "supported yet (tests/test_sphere.py measures the orders there)")
        t0 = time.perf_counter()
        self.problem = build_problem(cfg, context.comm, command == "gradient", context=context)
        if self.problem.geometry.name != "flat":
            raise ConfigError("mesh.file", "convergence studies on a circle or sphere are not "
                              "supported yet (tests/test_sphere.py measures the orders there)")
        self.means, self.covs, self.risks, self.grad = [], [], [], None
        if command == "particles":
            self._run_particles(timer, gradient)
        else:
            self._run_mesh(timer)
        self.seconds = time.perf_counter() - t0

    def _run_particles(self, timer: Timer, gradient: bool) -> None:
        """The particle model: every prompt's tokens, moments, risk (and gradient)."""
        from ..model.particles import ParticleAdjoint, ParticleSolver, weighted_moments
        p = self.problem
        self.solver = ParticleSolver(p, timer)
        self.tokens = []
        for s in range(len(p.prompts)):
            x, w = self.solver.solve_prompt(s)
            _, m, c = weighted_moments(p.comm, x, w, np.zeros(p.dim))
            self.means.append(m)
            self.covs.append(c)
            self.tokens.append((x, w))
        if p.objective is not None:
            adj = ParticleAdjoint(self.solver, p.objective, p.targets)
            self.risks = [adj.objective.particle_value_and_gradient(x, w, adj.targets[s], p.comm)[0]
                          for s, (x, w) in enumerate(self.tokens)]
            if gradient:
                self.grad = adj.gradient()

    def _run_mesh(self, timer: Timer) -> None:
        """The PDE on the mesh: every prompt's final density, moments, risk (and, for
        the gradient command, the gradient)."""
        from ..api.solve import adjoint_of
        from ..solvers.forward import ForwardSolver
        p = self.problem
        self.solver = ForwardSolver(p, timer)
        adj = adjoint_of(p, self.solver) if p.objective else None
        if self.command == "gradient":
            self.grad = adj.gradient()
        self.coeffs = []
        for s in range(len(p.prompts)):
            c, _ = self.solver.solve_prompt(s)
            _, m, cov = self.solver.transport.moments(c, np.zeros(p.dim))
            self.coeffs.append(c)
            self.means.append(m)
            self.covs.append(cov)
            if adj is not None:
                self.risks.append(adj.objective_at(s, c)[0])

    def density_rule(self, s: int):
        """(points, measure, values) of prompt s's final density on this rank's cells,
        by a quadrature of degree 2k + 2."""
        from ..fem.transport import CellQuadrature
        tr = self.solver.transport
        tr.set_state(self.coeffs[s])
        rule = CellQuadrature(tr.mesh, 2 * tr.degree + 2, tr.u)
        return rule.points, rule.measure, rule.values()

    def gradient_vector(self):
        return self.grad.vector()


def errors(case: Case, ref, kind: str, quantities, bandwidth: float) -> dict:
    """Error of every quantity of ``case`` against the reference: a Case, or the exact
    solution (``kind`` exact or expectation). A bias quantity gives the signed deviation
    instead, a list: every prompt's mean (or covariance) less the reference's, in turn."""
    comm = case.problem.comm
    out = {}
    S = len(case.problem.prompts)
    exact = exact_reference(case.problem, case.cfg, kind) if kind in ("exact", "expectation") else None
    for q in quantities:
        vals = []
        for s in range(S):
            if q in BIASES:
                ours, theirs = (case.means, ref.means) if q == "mean_bias" else (case.covs, ref.covs)
                r = exact[s][0 if q == "mean_bias" else 1] if exact else theirs[s]
                vals.extend(np.ravel(ours[s] - r).tolist())
            elif q == "mean":
                r = exact[s][0] if exact else ref.means[s]
                vals.append(np.linalg.norm(case.means[s] - r))
            elif q == "cov":
                r = exact[s][1] if exact else ref.covs[s]
                vals.append(np.linalg.norm(case.covs[s] - r))
            elif q == "risk":
                if exact or not case.risks:
                    raise ConfigError("study.quantities", "'risk' needs an [objective] and a run reference")
                vals.append(abs(case.risks[s] - ref.risks[s]))
            elif q == "gradient":
                if exact or case.grad is None:
                    raise ConfigError("study.quantities", "'gradient' needs command gradient (or particles) "
                                      "and a run reference")
                if s == 0:
                    g, gr = case.gradient_vector(), ref.gradient_vector()
                    vals.append(np.linalg.norm(g - gr) / np.linalg.norm(gr))
            elif q in ("l2", "l1"):
                vals.append(_density_error(case, ref, exact, s, q))
            elif q == "mmd":
                vals.append(_mmd(case, ref, s, bandwidth, comm))
        out[q] = vals if q in BIASES else float(max(vals))
    return out


def _density_error(case, ref, exact, s, q):
    """L2 or L1 norm of rho_case - rho_ref: against the exact translated prompt on the
    case's mesh, or on the reference's quadrature with rho_case evaluated there."""
    from mpi4py import MPI
    if exact:
        tr = case.solver.transport
        tr.set_state(case.coeffs[s])
        x = ufl.SpatialCoordinate(tr.mesh)
        _, _, prompt, shift = exact[s]
        diff = tr.u - prompt.ufl_density(x - ufl.as_vector([float(v) for v in shift]))
        integrand = diff * diff if q == "l2" else abs(diff)
        import dolfinx.fem
        dx = ufl.dx(metadata={"quadrature_degree": 2 * tr.degree + 6})
        val = tr.comm.allreduce(dolfinx.fem.assemble_scalar(dolfinx.fem.form(integrand * dx)), op=MPI.SUM)
        return math.sqrt(val) if q == "l2" else val
    if not hasattr(ref, "coeffs"):
        raise ConfigError("study.quantities", f"{q!r} needs a forward reference")
    pts, meas, rho_ref = ref.density_rule(s)
    tr = case.solver.transport
    tr.set_state(case.coeffs[s])
    comm = ref.problem.comm
    start = sum(comm.allgather(len(pts))[:comm.rank])      # this rank's points in the gather
    rho = dfx.evaluate_at_points(tr.u, allgather_rows(comm, pts))[start:start + len(pts)]
    if np.any(np.isnan(rho)):
        raise InputError("study: the reference mesh reaches beyond the case's mesh")
    diff = rho - rho_ref
    local = meas @ (diff * diff) if q == "l2" else meas @ np.abs(diff)
    val = tr.comm.allreduce(float(local), op=MPI.SUM)
    return math.sqrt(val) if q == "l2" else val


def _mmd(case, ref, s, bandwidth, comm):
    """MMD between the case's tokens and the reference's final density (or tokens)."""
    from ..model.objectives import MMD
    if case.command != "particles":
        raise ConfigError("study.quantities", "'mmd' is measured for particles")
    x, w = case.tokens[s]
    if hasattr(ref, "coeffs"):
        pts, meas, rho = ref.density_rule(s)
        z, b = allgather_rows(comm, pts), allgather_rows(comm, meas * rho)
    else:
        z, b = allgather_rows(comm, ref.tokens[s][0]), allgather_rows(comm, ref.tokens[s][1])
    F, _ = MMD(bandwidth).particle_terms(x, w, z, b, comm)
    return math.sqrt(max(2 * F, 0.0))


# --------------------------------------------------------------------------- the study

def run_study(study: dict, comm=None, walltime: float | None = None) -> dict:
    """Run the cases of a study (every member of its ensemble, and its reference),
    compare them, write the tables and summary.json; a PdeformerError still writes
    summary.json with its status."""
    from mpi4py import MPI
    from .run import output_session
    world = metered(comm or MPI.COMM_WORLD, Meter())   # the study's own count, members' included
    timer = Timer(world.meter)
    n = study["seeds"]
    cfgs, reference_cfgs, sets = prepare(study)
    groups = PromptGroups(world, study["groups"], [f"member {j}" for j in range(n)], "study.groups")
    outdir = study["output_dir"]
    info = provenance(world, dfx.versions()) if world.rank == 0 else {}

    def on_error(e):   # agreed on every rank: the summary says how the study ended
        on_root(world, write_json, os.path.join(outdir, "summary.json"), {
            "command": "converge", "status": status_of(e), "error": str(e), "study": study,
            "provenance": info, "ranks": world.size, "timings": timer.report(world)})

    reads = [("the study file", study["study_file"])] + study_inputs(cfgs, reference_cfgs)
    with output_session("converge", outdir, world, _announcement(study, world, groups), on_error,
                        reads=reads) as begin:
        begin()
        records, status = run_ensemble(study, cfgs, reference_cfgs, groups, timer, walltime)
        check_members_differ(study, records)
        rows, fits = error_rows(study, records)
        meter = world.meter.snapshot()
        summary = _study_summary(study, status, info, world, sets, rows, fits, timer)
        summary["parallel"] = parallel_report(world, groups, meter, timer)
        summary["files"] = on_root(world, write_study, outdir, study, rows, fits, records, summary)
        _log_results(study["parameter"], rows, fits)
        if world.rank == 0:
            log.info(describe_parallel(summary["parallel"]))
        return summary


def _announcement(study: dict, world, groups) -> str:
    """The study's first log line: the swept parameter and its values, the ensemble,
    the ranks and groups, the reference and the output folder."""
    n = study["seeds"]
    return (f"pdeformer converge {study['study_file']}: {study['parameter']} over {study['values']}"
            + (f", {n} seeds each" if n > 1 else "") + f" on {world.size} rank(s)"
            + (f" in {groups.count} groups" if groups.count > 1 else "")
            + f", reference {study['reference']}, output in {study['output_dir']}")


def _study_summary(study: dict, status: str, info: dict, world, sets: list, rows: list, fits: dict,
                   timer: Timer) -> dict:
    """summary.json of a completed (or walltime-stopped) study, less its ``parallel``
    accounting; ``files`` names every file the study writes (_write_study drops
    convergence.png where it cannot be drawn). Collective (the timings)."""
    n = study["seeds"]
    return {"command": "converge", "status": status, "study": study, "provenance": info,
            "ranks": world.size, "reference": describe_reference(study),
            "seeds": _seed_table(study, sets[:n]) if sets[0] else None,
            "reference_seeds": sets[n] if study["reference"] == "draw" else None,
            "rows": rows, "fits": fits, "timings": timer.report(world),
            "files": ["convergence.csv", "convergence.md", "convergence.png", "pdeformer.log"]
            + (["ensemble.csv"] if n > 1 else [])}


def _log_results(param: str, rows: list, fits: dict) -> None:
    """Log every row (error, its 95% interval over an ensemble, the observed order) and
    every fitted order."""
    for r in rows:
        log.info("%-8s %-10s %-12s error %.4e%s  order %s", r["quantity"], param, r["value"], r["error"],
                 f" [{r['ci_low']:.3e}, {r['ci_high']:.3e}]" if r["seeds"] > 1 else "",
                 "-" if math.isnan(r["order"]) else f"{r['order']:.2f}")
    for q, f in fits.items():
        log.info("%-8s fitted order %.3f, 95%% interval [%.3f, %.3f]%s", q, f["order"], f["low"],
                 f["high"], "" if f["expected"] is None else f" (expected {f['expected']:g})")


def _seed_table(study: dict, sets: list) -> dict:
    """{seed key: [its value for member 0, 1, ...]}."""
    return {k: [int(x.split("=", 1)[1]) for m in sets for x in m if x.startswith(k + "=")]
            for k in study["seed_keys"]}


def run_ensemble(study: dict, cfgs: list, reference_cfgs, groups, timer, walltime) -> tuple[list, str]:
    """(records, status): every group runs the reference (if it is a run; a paired one
    per member) and then its members' cases, the finest first where it is the member's
    reference, stopping before a run the walltime guard would not fit (each group's
    first rank decides for its group). A record is one error: {case, member, quantity,
    error, seconds}; the records of all groups are gathered on every rank. The memory
    check and the attention costs are settled first, on all ranks together."""
    wants_grad = "gradient" in study["quantities"]
    context = _settle_costs_and_memory(study, cfgs, reference_cfgs, groups, wants_grad)
    run = _GuardedRuns(context, timer, walltime, wants_grad)
    records = []
    with groups.combined():
        ref, stopped = None, False
        if reference_cfgs and study["reference"] != "paired":
            ref = run(study["reference_command"], reference_cfgs[0], f"the reference ({study['reference']})",
                      "reference")
            stopped = ref is None
        for j in groups.owned:
            if stopped:
                break
            stopped = _run_member(study, j, cfgs[j], reference_cfgs, ref, run, records)
        status = "walltime" if stopped else "completed"
    records = sorted(groups.gather_lists(records), key=lambda r: (r["case"], r["member"]))
    statuses = groups.gather_lists([status])
    return records, ("walltime" if "walltime" in statuses else "completed")


def _settle_costs_and_memory(study: dict, cfgs: list, reference_cfgs, groups, wants_grad: bool):
    """The context of this group's runs, with the attention costs loaded once on all ranks
    (every group chooses alike); the memory of member 0's cases and the first reference run checked."""
    from ..attention.costs import machine_costs
    from ..model.context import RunContext
    context = RunContext.create(groups.comm, costs=machine_costs(groups.world))   # one measurement
    for command, cfg in [(study["command"], c) for c in cfgs[0]] + \
            [(study["reference_command"], c) for c in (reference_cfgs or [])[:1]]:
        check_memory(cfg, command, groups.comm, groups.world,
                     differentiable=wants_grad or command == "gradient")
    return context


class _GuardedRuns:
    """The runs of one rank group, one at a time, under the walltime guard: a run starts
    only if the time elapsed plus twice the longest run so far (the next may be finer)
    stays within ``walltime``, as the group's first rank decides for the group."""

    def __init__(self, context, timer: Timer, walltime: float | None, wants_grad: bool):
        self.context, self.timer, self.walltime, self.wants_grad = context, timer, walltime, wants_grad
        self.seconds = []

    def __call__(self, command: str, cfg: dict, what: str, phase: str) -> Case | None:
        """One run, or None where the walltime guard stops before it."""
        comm = self.context.comm
        expected = 2.0 * max(self.seconds) if self.seconds else 0.0   # the next may be finer
        if self.walltime is not None and comm.bcast(
                self.timer.elapsed() + expected > self.walltime if comm.rank == 0 else None):
            if comm.rank == 0:
                log.warning("warning: stopping before %s: the walltime guard (%.0f s) would be "
                            "passed", what, self.walltime)
            return None
        try:
            with self.timer.phase(phase):
                case = Case(command, cfg, self.context, self.timer, self.wants_grad)
        except PdeformerError as e:    # say which run of the study it was
            raise within(e, what) from None
        self.seconds.append(case.seconds)
        log.info("%s: %.1f s", what, case.seconds)
        return case


def _run_member(study: dict, j: int, member_cfgs: list, reference_cfgs, ref, run: _GuardedRuns,
                records: list) -> bool:
    """Run member j's cases (after its paired reference, if any; the finest first where
    it is the member's reference) and append their errors to ``records``; True where the
    walltime guard stopped before a run."""
    param, values = study["parameter"], study["values"]
    kind = study["reference"] if study["reference"] in ("exact", "expectation") else "case"
    member = f", member {j}" if study["seeds"] > 1 else ""
    if study["reference"] == "paired":
        ref = run(study["reference_command"], reference_cfgs[j], f"the reference{member}", "reference")
        if ref is None:
            return True
    order = list(range(len(values)))
    finest = study["reference"] == "finest"
    if finest:   # the finest first: it is the reference of its member's cases
        order = order[-1:] + order[:-1]
    for i in order:
        case = run(study["command"], member_cfgs[i], f"case {param} = {json.dumps(values[i])}{member}", "cases")
        if case is None:
            return True
        if finest and i == len(values) - 1:
            ref = case
            continue
        for q, e in errors(case, ref, kind, study["quantities"], study["bandwidth"]).items():
            record = {"case": i, "member": j, "quantity": q, "error": e, "seconds": case.seconds}
            if q in BIASES:       # the member's own |q - q_ref|; the deviation for the tables
                record.update(error=float(np.linalg.norm(e)), deviation=e)
            records.append(record)
    return False
