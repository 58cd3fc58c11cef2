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
    reference = "exact"             # exact (uniform attention) | finest | run
    reference_run = "other.toml"    # with reference = "run" (relative to this file)
    reference_command = "forward"
    quantities = ["l2", "mean", "cov"]
    expected_order = 2.0            # drawn as a reference slope and reported
    set = ["output.fields=false"]   # overrides applied to every case
    bandwidth = 0.5                 # kernel width of the mmd distance

Quantities: ``mean`` (|mean - mean_ref|), ``cov`` (||cov - cov_ref||_F) and ``risk``
(|R - R_ref|) for every command; ``l2``, ``l1`` (density errors, the reference field's
quadrature; with reference = exact the exact translated prompt) for forward; ``mmd``
(the kernel distance between tokens and a reference density) for particles; ``gradient``
(||g - g_ref|| / ||g_ref||) for gradient and particles. The maximum over prompts is
reported. The size that orders refer to: h ~ 1/cells, 1/L, 1/H, 1/N, the cfl number;
for other parameters the value itself.

Every case runs on all ranks together: prompt groups (``[parallel] prompt_groups`` > 1
in a case's run configuration) are refused. summary.json has the ``parallel`` accounting
of the whole study (see pdeformer.tools.parallel.Meter).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time

import numpy as np
import ufl

from ..tools.budget import check_memory
from ..tools.config import Key, check_table, load_config, number, path, string
from ..tools.errors import ConfigError, InputError, status_of
from ..tools.output import atomic_write, provenance, save_figure, write_csv, write_json
from ..tools.parallel import (METER, Timer, allgather_rows, describe_parallel, metered, on_root,
                       parallel_report)

log = logging.getLogger("pdeformer")

QUANTITIES = ("mean", "cov", "risk", "l2", "l1", "mmd", "gradient")
DEFAULTS = {"forward": ["l2", "mean", "cov"], "particles": ["mean", "cov", "mmd"],
            "gradient": ["risk", "gradient"]}
STUDY = {
    "run": Key(path),
    "command": Key(string(("forward", "particles", "gradient")), "forward"),
    "parameter": Key(string()),
    "values": Key(lambda k, v: _values(k, v)),
    "reference": Key(string(("exact", "finest", "run")), "finest"),
    "reference_run": Key(path, None),
    "reference_command": Key(string(("forward", "particles", "gradient")), "forward"),
    "reference_set": Key(lambda k, v: _strings(k, v), []),
    "quantities": Key(lambda k, v: _quantities(k, v), None),
    "expected_order": Key(number(), None),
    "set": Key(lambda k, v: _strings(k, v), []),
    "bandwidth": Key(number(positive=True), 0.5),
}


def _values(key, v):
    if not isinstance(v, list) or len(v) < 2:
        raise ConfigError(key, "expected a list of at least two values")
    return v


def _strings(key, v):
    if not isinstance(v, list) or not all(isinstance(x, str) and "=" in x for x in v):
        raise ConfigError(key, "expected a list of \"section.key=value\" strings")
    return v


def _quantities(key, v):
    if not isinstance(v, list) or not v:
        raise ConfigError(key, f"expected a list of quantities ({', '.join(QUANTITIES)})")
    for q in v:
        if q not in QUANTITIES:
            raise ConfigError(key, f"unknown quantity {q!r} (use {', '.join(QUANTITIES)})")
    return v


def load_study(filename: str, overrides=()) -> dict:
    """Read and check a study file (the [study] and an optional [output] table)."""
    from ..tools.config import apply_override, parse_override, read_toml
    raw = read_toml(filename, "study file")
    base = os.path.dirname(os.path.abspath(filename))
    for text in overrides:
        apply_override(raw, *parse_override(text), os.getcwd(), base)
    for k in raw:
        if k not in ("study", "output"):
            raise ConfigError(k, "unknown section (a study file has [study] and [output])")
    study = check_table("study", raw.get("study", {}), STUDY)
    out = check_table("output", raw.get("output", {}), {"dir": Key(path, None)})
    stem = os.path.splitext(os.path.basename(filename))[0]
    study["run"] = os.path.normpath(os.path.join(base, study["run"]))
    if study["reference"] == "run":
        if study["reference_run"] is None:
            raise ConfigError("study.reference_run", "missing (needed by reference = 'run')")
        study["reference_run"] = os.path.normpath(os.path.join(base, study["reference_run"]))
    study["quantities"] = study["quantities"] or DEFAULTS[study["command"]]
    allowed = {"forward": {"mean", "cov", "risk", "l2", "l1"},
               "particles": {"mean", "cov", "risk", "mmd", "gradient"},
               "gradient": {"mean", "cov", "risk", "gradient"}}[study["command"]]
    for q in study["quantities"]:
        if q not in allowed:
            raise ConfigError("study.quantities", f"{q!r} is not measured by command {study['command']!r}")
    study["output_dir"] = os.path.normpath(os.path.join(base, out["dir"] or os.path.join("output", stem)))
    study["study_file"] = os.path.abspath(filename)
    return study


def size_of(parameter: str, value) -> float:
    """The discretisation size the observed order refers to."""
    if parameter == "mesh.cells":
        return 1.0 / float(value[0])
    if parameter in ("model.layers", "model.heads", "particles.tokens"):
        return 1.0 / float(value)
    if parameter == "discretisation.degree":
        return math.nan       # errors per degree; an order in the degree means nothing
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


# --------------------------------------------------------------------------- cases

class Case:
    """The outcome of one run: per prompt mean, cov (and risk, gradient, density)."""

    def __init__(self, command: str, cfg: dict, comm, timer: Timer, gradient: bool):
        from ..solvers.forward import build_problem
        self.command, self.cfg = command, cfg
        if cfg["parallel"]["prompt_groups"] > 1:
            raise ConfigError("parallel.prompt_groups", "converge runs every case as one group of "
                              f"all ranks: prompt groups are not supported (set 1, got "
                              f"{cfg['parallel']['prompt_groups']})")
        if cfg["mesh"]["shape"] != "box":
            raise ConfigError("mesh.shape", "convergence studies on a circle or sphere are not "
                              "supported yet (tests/test_sphere.py measures the orders there)")
        t0 = time.perf_counter()
        check_memory(cfg, command, comm, differentiable=gradient or command == "gradient")
        differentiable = command == "gradient"
        self.problem = build_problem(cfg, comm, differentiable)
        if self.problem.radius is not None:
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
        from ..solvers.adjoint import AdjointSolver
        from ..solvers.forward import ForwardSolver
        p = self.problem
        self.solver = ForwardSolver(p, timer)
        adj = AdjointSolver(self.solver, p.objective, p.targets,
                            p.opts.objective.quadrature_degree) if p.objective else None
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
        g = self.grad
        return np.concatenate([g.dQ.ravel(), g.dK.ravel(), g.dV.ravel()])


def _exact(case: Case):
    """Exact final mean and cov (and density expression) of uniform attention."""
    from ..model.exact import uniform_attention_mean
    from ..model.prompts import GaussianMixture
    p = case.problem
    if np.any(p.heads.Q != 0):
        raise ConfigError("study.reference", "'exact' needs uniform attention (Q = 0: model.query_scale = 0)")
    out = []
    for name, prompt in p.prompts:
        if not isinstance(prompt, GaussianMixture):
            raise ConfigError("study.reference", f"'exact' needs Gaussian-mixture prompts ({name!r} is not)")
        m1 = uniform_attention_mean(p.heads, prompt.mean(), 1.0)
        out.append((m1, prompt.cov(), prompt, m1 - prompt.mean()))
    return out


def errors(case: Case, ref, kind: str, quantities, bandwidth: float) -> dict:
    """Error of every quantity of ``case`` against the reference (a Case, or 'exact')."""
    comm = case.problem.comm
    out = {}
    S = len(case.problem.prompts)
    exact = _exact(case) if kind == "exact" else None
    for q in quantities:
        vals = []
        for s in range(S):
            if q == "mean":
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
        out[q] = float(max(vals))
    return out


def _density_error(case, ref, exact, s, q):
    """L2 or L1 norm of rho_case - rho_ref: against the exact translated prompt on the
    case's mesh, or on the reference's quadrature with rho_case evaluated there."""
    from mpi4py import MPI
    from ..fem import _dolfinx as dfx
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

def orders(sizes, errs):
    out = [math.nan]
    for i in range(1, len(errs)):
        a, b, sa, sb = errs[i - 1], errs[i], sizes[i - 1], sizes[i]
        ok = a > 0 and b > 0 and sa > 0 and sb > 0 and sa != sb
        out.append(math.log(a / b) / math.log(sa / sb) if ok else math.nan)
    return out


def run_study(study: dict, comm=None, walltime: float | None = None) -> dict:
    """Run the cases of a study (and its reference), compare them, write the tables and
    summary.json; a PdeformerError still writes summary.json with its status."""
    from mpi4py import MPI
    from .run import output_session
    METER.reset()
    comm = metered(comm or MPI.COMM_WORLD)
    timer = Timer()
    param, values = study["parameter"], study["values"]
    cfgs = [load_config(study["run"], study["set"] + [f"{param}={json.dumps(v)}"]) for v in values]
    reference_cfg = None
    if study["reference"] == "run":
        reference_cfg = load_config(study["reference_run"], study["reference_set"])
    outdir = study["output_dir"]
    info = provenance(comm) if comm.rank == 0 else {}

    def on_error(e):   # agreed on every rank: the summary says how the study ended
        on_root(comm, write_json, os.path.join(outdir, "summary.json"), {
            "command": "converge", "status": status_of(e), "error": str(e), "study": study,
            "provenance": info, "ranks": comm.size, "timings": timer.report(comm)})

    announce = (f"pdeformer converge {study['study_file']}: {param} over {values} on {comm.size} "
                f"rank(s), reference {study['reference']}, output in {outdir}")
    with output_session("converge", outdir, comm, announce, on_error):
        cases, ref, status = _run_cases(study, cfgs, reference_cfg, comm, timer, walltime)
        rows = _error_rows(study, cases, ref)
        meter = METER.snapshot()
        summary = {"command": "converge", "status": status, "study": study, "provenance": info,
                   "ranks": comm.size, "rows": rows, "timings": timer.report(comm),
                   "files": ["convergence.csv", "convergence.md", "convergence.png", "pdeformer.log"]}
        summary["parallel"] = parallel_report(comm, None, meter)
        summary["files"] = on_root(comm, _write_study, outdir, study, rows, summary)
        for r in rows:
            log.info("%-8s %-10s %-12s error %.4e  order %s", r["quantity"], param, r["value"], r["error"],
                     "-" if math.isnan(r["order"]) else f"{r['order']:.2f}")
        if comm.rank == 0:
            log.info(describe_parallel(summary["parallel"]))
        return summary


def _run_cases(study: dict, cfgs: list, reference_cfg, comm, timer, walltime) -> tuple[list, object, str]:
    """(cases, reference, status): the reference run, then the cases (the finest first
    where it is the reference), stopping before a case the walltime guard would not fit
    (rank 0 decides for all ranks)."""
    param, values = study["parameter"], study["values"]
    wants_grad = "gradient" in study["quantities"]
    ref = None
    if reference_cfg is not None:
        with timer.phase("reference"):
            ref = Case(study["reference_command"], reference_cfg, comm, timer, wants_grad)
        log.info("reference run %s: %.1f s", study["reference_run"], ref.seconds)
    order = list(range(len(values)))
    if study["reference"] == "finest":   # the finest first: it is every case's reference
        order = order[-1:] + order[:-1]
    cases = [None] * len(values)
    for i in order:
        if walltime is not None and comm.bcast(
                timer.elapsed() + _expected(cases) > walltime if comm.rank == 0 else None):
            if comm.rank == 0:
                log.warning("warning: stopping before %s = %s: the walltime guard (%.0f s) would "
                            "be passed", param, values[i], walltime)
            return cases, ref, "walltime"
        with timer.phase("cases"):
            cases[i] = Case(study["command"], cfgs[i], comm, timer, wants_grad)
        log.info("case %s = %s: %.1f s", param, json.dumps(values[i]), cases[i].seconds)
        if study["reference"] == "finest" and i == len(values) - 1:
            ref = cases[i]
    return cases, ref, "completed"


def _error_rows(study: dict, cases: list, ref) -> list[dict]:
    """One row per case run and quantity: its error against the reference and the
    observed order against the case before it."""
    param, values = study["parameter"], study["values"]
    kind = "exact" if study["reference"] == "exact" else "case"
    sizes = [size_of(param, v) for v in values]
    table = {}
    for i, case in enumerate(cases):
        if case is None or (study["reference"] == "finest" and i == len(values) - 1):
            continue
        for q, e in errors(case, ref, kind, study["quantities"], study["bandwidth"]).items():
            table.setdefault(q, []).append((i, e))
    rows = []
    for q, entries in table.items():
        idx = [i for i, _ in entries]
        errs = [e for _, e in entries]
        for (i, e), o in zip(entries, orders([sizes[i] for i in idx], errs)):
            rows.append({"case": i, "value": json.dumps(values[i]), "size": sizes[i],
                         "quantity": q, "error": e, "order": o, "seconds": cases[i].seconds})
    return rows


def _write_study(outdir: str, study: dict, rows: list, summary: dict) -> list:
    """convergence.csv, .md, .png and summary.json (rank 0); the files written."""
    write_csv(os.path.join(outdir, "convergence.csv"),
              ["case", "value", "size", "quantity", "error", "order", "seconds"],
              [[r[k] for k in ("case", "value", "size", "quantity", "error", "order", "seconds")]
               for r in rows])
    _markdown(os.path.join(outdir, "convergence.md"), study, rows)
    if not _plot(os.path.join(outdir, "convergence.png"), study, rows):
        summary["files"].remove("convergence.png")
    write_json(os.path.join(outdir, "summary.json"), summary)
    return summary["files"]


def _expected(cases) -> float:
    done = [c.seconds for c in cases if c is not None]
    return 2.0 * max(done) if done else 0.0   # the next case is finer: allow twice the largest


def _markdown(filename, study, rows):
    lines = [f"# Convergence: {study['parameter']} ({study['command']}, reference {study['reference']})", "",
             f"Base run: `{os.path.relpath(study['run'], os.path.dirname(study['study_file']))}`"
             + (f"; expected order {study['expected_order']:g}" if study["expected_order"] is not None else ""),
             "", f"| {study['parameter']} | size | quantity | error | order |", "|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["quantity"], r["case"])):
        o = "—" if math.isnan(r["order"]) else f"{r['order']:.2f}"
        lines.append(f"| {r['value']} | {r['size']:.4g} | {r['quantity']} | {r['error']:.3e} | {o} |")
    with atomic_write(filename) as f:
        f.write("\n".join(lines) + "\n")


def _plot(filename, study, rows) -> bool:
    """Log-log error against size, one line per quantity, with the expected slope."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log.warning("warning: matplotlib is missing: no convergence.png (Debian: python3-matplotlib)")
        return False
    fig, ax = plt.subplots(figsize=(5.5, 4.2))
    by_value = all(math.isnan(r["size"]) for r in rows)   # e.g. the DG degree: error per value
    for q in sorted({r["quantity"] for r in rows}):
        pts = sorted((float(json.loads(r["value"])) if by_value else r["size"], r["error"])
                     for r in rows if r["quantity"] == q and r["error"] > 0)
        if pts:
            (ax.semilogy if by_value else ax.loglog)(*zip(*pts), "o-", label=q)
    sizes = sorted({r["size"] for r in rows if r["size"] > 0})
    if study["expected_order"] is not None and len(sizes) >= 2:
        top = max((r["error"] for r in rows), default=1.0)
        s0 = sizes[-1]
        xs = np.array([sizes[0], s0])
        ax.loglog(xs, top * (xs / s0) ** study["expected_order"], "k--",
                  label=f"slope {study['expected_order']:g}")
    ax.set_xlabel(study["parameter"] if by_value else f"size ({study['parameter']})")
    ax.set_ylabel("error")
    ax.set_title(f"{study['command']}: {study['parameter']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    save_figure(filename, fig, dpi=110)
    plt.close(fig)
    return True
