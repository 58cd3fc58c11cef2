r"""The error budget of a finite transformer: how far are L layers, H heads and N tokens
from the mean-field limit (L, H, N -> infinity, the density PDE with the head law's
expected velocity)?

``pdeformer budget BUDGET.toml`` estimates, per quantity q (the final mean or covariance,
the largest over the prompts), the distance E|q(L, H, N) - q_inf| of a transformer whose
heads are drawn from the run's random law as a sum of four terms, each measured by an
ensemble sweep of pdeformer converge (pdeformer.commands.converge) with the other
parameters at the transformer's values (L0, H0, N0, the run's mesh h0):

    E|q(L,H,N) - q_inf|  ~  C_L L^-2 s(H)  +  C_H H^-1/2  +  C_N N^-1/2  +  C_h h0^(k+1) s(H)
                              depth            width         tokens         mesh

* depth: E|q_E(L) - q_E(L_ref)|, the Eulerian (DG) solution at L layers against L_ref
  layers of the same draw (heads smooth in depth: a midpoint rule, order 2);
* width: E|q_E(H) - q_inf| against the exact H -> infinity limit (``expectation``: V is
  centred, the limit velocity vanishes) or an independent draw of many heads (``draw``);
* tokens: E|q_particles(N) - q_E| against the Eulerian solution of the same heads;
* mesh: E|q_E(h) - q_E(h_ref)|, the discretisation error of the Eulerian reference, order
  k + 1 (the density's; moments of upwind DG converge faster in space, but the SSP time
  step dt ~ h of order k + 1 bounds them), taken at the run's mesh h0.

The model's random law has V centred, so a draw's velocity is a mean of H centred terms,
of size H^-1/2: the depth and mesh errors, which are proportional to the velocity, scale
with it, s(H) = (H0/H)^(1/2) (measured at H0). Each constant is fitted at the expected
order (the mean of e_i / size_i^p over the sweep, 95% interval by the members'
jackknife), and the order is fitted freely as a check. Along the chain q(L,H,N) ->
q_E(L,H,h0) -> q_E(L,H) -> q_E(inf,H) -> q_inf the triangle inequality makes the sum a
bound where the terms are measured; elsewhere it is a model, and for independent random
terms the root of the sum of squares (rss) is the closer estimate: both are reported,
and checked against direct measurements: ensembles of particle runs at ``checks`` =
[[L, H, N], ...] (points not in the sweeps, draws independent of theirs) against the
limit. The width sweep runs at L0 and h0, so its term also holds their (small) depth and
mesh errors, which the sum counts again.

Budget file::

    [budget]
    run = "../default.toml"           # heads law, prompts, mesh, particle settings
    set = ["model.depth=\"smooth\""]  # overrides of every run (heads smooth in depth)
    transformer = [8, 8, 1000]        # L, H, N of the transformer asked about
    layers = [2, 4, 8, 16]            # the depth sweep ...
    layers_reference = 64             # ... against this many layers of the same draw
    heads = [4, 16, 64, 256]          # the width sweep
    width_reference = "expectation"   # or "draw": an independent draw of ...
    width_reference_heads = 4096      # ... this many heads
    tokens = [250, 1000, 4000]        # the token sweep
    cells = [[8, 8], [16, 16]]        # the mesh sweep ...
    cells_reference = [64, 64]        # ... against this mesh, same draw
    seeds = 16                        # ensemble size of every sweep and check
    groups = 1                        # rank groups running members side by side
    quantities = ["mean", "cov"]
    checks = [[4, 32, 4000], [16, 4, 250]]

Writes budget.md, budget.json, budget.csv (every sweep's rows), budget.png and
summary.json.
"""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np

from ..fem import _dolfinx as dfx
from ..model.config import load_config
from ..tools.keys import Key, integer, path, positive_int_list, string
from .converge import run_ensemble
from .study_tables import COLUMNS, ensemble_matrix, error_rows
from .study import (check_members_differ, describe_reference, override_strings, prepare, read_study_file, size_of,
                    study_inputs)
from ..tools.errors import ConfigError, PdeformerError, status_of, within
from ..tools.output import atomic_write, provenance, save_figure, write_csv, write_json
from ..tools.parallel import (Meter, PromptGroups, Timer, describe_parallel, metered, on_root,
                              parallel_report)

log = logging.getLogger("pdeformer")

TERMS = ("depth", "width", "tokens", "mesh")
PARAMETER = {"depth": "model.layers", "width": "model.heads", "tokens": "particles.tokens",
             "mesh": "mesh.cells"}
SYMBOL = {"depth": "C_L L^-2 s(H)", "width": "C_H H^-1/2", "tokens": "C_N N^-1/2", "mesh": "C_h h^(k+1) s(H)"}


def _ints(n_min: int, length: int | None = None):
    def check(key, v):
        ok = isinstance(v, list) and len(v) >= n_min and all(
            isinstance(x, int) and not isinstance(x, bool) and x >= 1 for x in v)
        if not ok or (length is not None and len(v) != length):
            what = f"{length} positive integers" if length else f"a list of at least {n_min} positive integers"
            raise ConfigError(key, f"expected {what}")
        return v
    return check


def _cells(key, v):
    if not isinstance(v, list) or len(v) < 2:
        raise ConfigError(key, "expected a list of at least two meshes, e.g. [[8, 8], [16, 16]]")
    return [positive_int_list(f"{key}[{i}]", c) for i, c in enumerate(v)]


def _checks(key, v):
    if not isinstance(v, list):
        raise ConfigError(key, "expected a list of [L, H, N] points")
    for c in v:
        _ints(3, 3)(key, c)
    return v


def _quantities(key, v):
    if not isinstance(v, list) or not v or not all(q in ("mean", "cov") for q in v):
        raise ConfigError(key, "expected a list of quantities from mean, cov")
    return v


BUDGET = {
    "run": Key(path),
    "set": Key(override_strings, []),
    "transformer": Key(_ints(3, 3)),
    "layers": Key(_ints(2)),
    "layers_reference": Key(integer(1, 10**5)),
    "heads": Key(_ints(2)),
    "width_reference": Key(string(("expectation", "draw")), "expectation"),
    "width_reference_heads": Key(integer(1, 10**6), 4096),
    "tokens": Key(_ints(2)),
    "cells": Key(_cells),
    "cells_reference": Key(positive_int_list),
    "seeds": Key(integer(2, 10**5), 16),
    "groups": Key(integer(1, 10**5), 1),
    "quantities": Key(_quantities, ["mean", "cov"]),
    "checks": Key(_checks, []),
}


def load_budget(filename: str, overrides=()) -> dict:
    """Read and check a budget file (a [budget] and an optional [output] table)."""
    b, _ = read_study_file(filename, "budget", BUDGET, overrides)
    if b["layers_reference"] <= max(b["layers"]):
        raise ConfigError("budget.layers_reference", f"{b['layers_reference']} is not above the depth "
                          f"sweep's {max(b['layers'])} layers")
    if b["cells_reference"][0] <= max(c[0] for c in b["cells"]):
        raise ConfigError("budget.cells_reference", f"{b['cells_reference']} is not finer than the "
                          "mesh sweep")
    most = max(b["heads"] + [b["transformer"][1]] + [c[1] for c in b["checks"]])
    if b["width_reference"] == "draw" and b["width_reference_heads"] <= most:
        raise ConfigError("budget.width_reference_heads", f"{b['width_reference_heads']} heads is not "
                          f"above the {most} of the width sweep, transformer and checks: the H -> "
                          "infinity reference must have more heads than every case")
    if b["groups"] > b["seeds"]:
        raise ConfigError("budget.groups", f"{b['groups']} groups for {b['seeds']} seeds: at most "
                          "one group per member of the ensembles")
    cfg = load_config(b["run"], b["set"])
    if cfg["model"]["depth"] != "smooth":
        raise ConfigError("budget.set", "the depth term needs heads smooth in depth: add "
                          "'model.depth=\"smooth\"' (iid layers have no L^-2 term)")
    if cfg["model"]["params"] is not None or cfg["model"]["init"] != "random":
        raise ConfigError("budget.run", "a budget is for heads drawn from the model's random law "
                          "(no model.params, model.init = 'random')")
    if cfg["mesh"]["shape"] != "box":
        raise ConfigError("budget.run", "budgets on a circle or sphere are not supported yet")
    b["degree"] = cfg["discretisation"]["degree"]
    b["run_cells"] = cfg["mesh"]["cells"]
    return b


def term_studies(b: dict) -> dict:
    """The converge study (a dict run_study's helpers take) that measures each term."""
    L0, H0, _ = b["transformer"]
    common = {"run": b["run"], "study_file": b["budget_file"], "seeds": b["seeds"],
              "groups": b["groups"], "quantities": b["quantities"], "bandwidth": 0.5,
              "reference_run": None, "reference_set": [], "reference_command": "forward",
              "command": "forward", "seed_keys": ["model.seed"]}
    at = {"L": f"model.layers={L0}", "H": f"model.heads={H0}"}
    width_ref = {"reference": b["width_reference"]}
    if b["width_reference"] == "draw":
        width_ref["reference_set"] = [f"model.heads={b['width_reference_heads']}"]
    return {
        "depth": dict(common, parameter="model.layers", values=b["layers"] + [b["layers_reference"]],
                      reference="finest", set=b["set"] + [at["H"]], expected_order=2.0),
        "width": dict(common, parameter="model.heads", values=b["heads"], set=b["set"] + [at["L"]],
                      expected_order=0.5, **width_ref),
        "tokens": dict(common, command="particles", parameter="particles.tokens", values=b["tokens"],
                       reference="paired", reference_run=b["run"],
                       reference_set=b["set"] + [at["L"], at["H"]], set=b["set"] + [at["L"], at["H"]],
                       seed_keys=["model.seed", "particles.seed"], expected_order=0.5),
        "mesh": dict(common, parameter="mesh.cells", values=b["cells"] + [b["cells_reference"]],
                     reference="finest", set=b["set"] + [at["L"], at["H"]],
                     expected_order=float(b["degree"] + 1)),
    }


def check_study(b: dict, point, index: int) -> dict:
    """The ensemble of particle runs at (L, H, N) against the limit: a direct measurement,
    with draws independent of the sweeps' and of each other's (check i, member j: seeds
    base + (i + 1)(n + 1) + j; its drawn reference, if any, base + (i + 2)(n + 1) - 1)."""
    L, H, N = point
    cfg = load_config(b["run"], b["set"])
    shift = (index + 1) * (b["seeds"] + 1)
    seeds = [f"model.seed={cfg['model']['seed'] + shift}", f"particles.seed={cfg['particles']['seed'] + shift}"]
    s = dict(term_studies(b)["tokens"], values=[N], set=b["set"] + [f"model.layers={L}", f"model.heads={H}"] + seeds,
             reference=b["width_reference"], reference_run=None, reference_set=[], expected_order=None)
    if b["width_reference"] == "draw":
        s["reference_set"] = [f"model.layers={L}", f"model.heads={b['width_reference_heads']}"]
    return s


def term_value(term: str, constant: float, point, b: dict) -> float:
    """One term of the budget at (L, H, N): C L^-2 s(H), C H^-1/2, C N^-1/2 or
    C h0^(k+1) s(H), s(H) = (H0/H)^(1/2) (see the module docstring)."""
    L, H, N = point
    s = (b["transformer"][1] / H) ** 0.5
    return constant * {"depth": L ** -2.0 * s, "width": H ** -0.5, "tokens": N ** -0.5,
                       "mesh": (1.0 / b["run_cells"][0]) ** (b["degree"] + 1) * s}[term]


def run_budget(b: dict, comm=None) -> dict:
    """Measure the terms, fit them, check the sum; write the files (see the module doc)."""
    from mpi4py import MPI
    from .run import output_session
    world = metered(comm or MPI.COMM_WORLD, Meter())   # the study's own count, members' included
    timer = Timer(world.meter)
    groups = PromptGroups(world, b["groups"], [f"member {j}" for j in range(b["seeds"])], "budget.groups")
    studies = term_studies(b)
    points = [list(b["transformer"])] + [list(c) for c in b["checks"]]
    checks = [check_study(b, c, i) for i, c in enumerate(points)]
    outdir = b["output_dir"]
    info = provenance(world, dfx.versions()) if world.rank == 0 else {}

    def on_error(e):
        on_root(world, write_json, os.path.join(outdir, "summary.json"), {
            "command": "budget", "status": status_of(e), "error": str(e), "budget": b,
            "provenance": info, "ranks": world.size, "timings": timer.report(world)})

    announce = (f"pdeformer budget {b['budget_file']}: L, H, N = {b['transformer']}, {b['seeds']} seeds "
                f"per case, on {world.size} rank(s) in {groups.count} group(s), output in {outdir}")
    sweeps = list(studies.items()) + [(f"check {i}", s) for i, s in enumerate(checks)]
    prepared = {name: prepare(study) for name, study in sweeps}
    reads = [("the budget file", b["budget_file"])] + \
        sorted({kp for cfgs, refs, _ in prepared.values() for kp in study_inputs(cfgs, refs)})
    with output_session("budget", outdir, world, announce, on_error, reads=reads) as begin:
        begin()
        measured = _measure(sweeps, studies, prepared, groups, timer)
        result = fit_budget(b, studies, measured, points)
        summary = {"command": "budget", "status": "completed", "budget": b, "provenance": info,
                   "ranks": world.size, **result, "timings": timer.report(world),
                   "files": ["budget.md", "budget.json", "budget.csv", "budget.png", "pdeformer.log"]}
        summary["parallel"] = parallel_report(world, groups, world.meter.snapshot(), timer)
        summary["files"] = on_root(world, _write_budget, outdir, b, studies, measured, summary)
        for c in result["checks"]:
            log.info("L, H, N = %s %-4s measured %.3e [%.3e, %.3e]  budget sum %.3e  rss %.3e",
                     c["point"], c["quantity"], c["measured"], c["low"], c["high"], c["sum"], c["rss"])
        if world.rank == 0:
            log.info(describe_parallel(summary["parallel"]))
        return summary


def _measure(sweeps: list, studies: dict, prepared: dict, groups, timer: Timer) -> dict:
    """{sweep name: (rows, fits, records)}: the ensemble of every term's sweep and of
    every check point (pdeformer.commands.converge), in the order of ``sweeps``, each
    timed as a phase named by its first word (depth, width, tokens, mesh, check)."""
    measured = {}
    for name, study in sweeps:
        what = f"the {name} {'sweep' if name in studies else '(a direct measurement)'}"
        with timer.phase(name.split()[0]):
            cfgs, refs, _ = prepared[name]
            try:
                records, _ = run_ensemble(study, cfgs, refs, groups, timer, None)
            except PdeformerError as e:   # which sweep it was
                raise within(e, what) from None
            check_members_differ(study, records, "budget.seeds")
            measured[name] = (*error_rows(study, records), records)
        log.info("%s: measured", name)
    return measured


def fit_budget(b: dict, studies: dict, measured: dict, points: list) -> dict:
    """The constants (at the expected orders) with intervals, the free orders, and the
    budget at every check point against its direct measurement."""
    from ..tools.stats import fit_constant
    terms = {}
    for name, study in studies.items():
        _, fits, records = measured[name]
        for q in b["quantities"]:
            cases, _, E = ensemble_matrix(records, q)
            p = study["expected_order"]
            c = fit_constant([size_of(study["parameter"], study["values"][i]) for i in cases], E, p)
            f = fits.get(q, {})
            terms.setdefault(name, {})[q] = {
                "constant": c.mean, "low": c.low, "high": c.high, "expected_order": p,
                "order": f.get("order", math.nan), "order_low": f.get("low", math.nan),
                "order_high": f.get("high", math.nan), "members": c.n}
    checks = []
    for i, point in enumerate(points):
        rows = measured[f"check {i}"][0]
        for q in b["quantities"]:
            r = next(r for r in rows if r["quantity"] == q)
            parts = {t: term_value(t, terms[t][q]["constant"], point, b) for t in TERMS}
            lo = sum(term_value(t, max(terms[t][q]["low"], 0.0), point, b) for t in TERMS)
            hi = sum(term_value(t, terms[t][q]["high"], point, b) for t in TERMS)
            total = sum(parts.values())
            checks.append({"point": point, "quantity": q, "transformer": i == 0,
                           "measured": r["error"], "low": r["ci_low"], "high": r["ci_high"],
                           "terms": parts, "sum": total, "sum_low": lo, "sum_high": hi,
                           "rss": math.sqrt(sum(v * v for v in parts.values())),
                           "dominant": max(parts, key=parts.get)})
    return {"terms": terms, "checks": checks}


def _write_budget(outdir: str, b: dict, studies: dict, measured: dict, summary: dict) -> list:
    write_csv(os.path.join(outdir, "budget.csv"), ["sweep"] + list(COLUMNS),
              [[name] + [r[k] for k in COLUMNS] for name, (rows, _, _) in measured.items() for r in rows])
    write_json(os.path.join(outdir, "budget.json"), {k: summary[k] for k in ("terms", "checks")})
    _markdown(os.path.join(outdir, "budget.md"), b, studies, summary)
    if not _plot(os.path.join(outdir, "budget.png"), b, studies, measured, summary):
        summary["files"].remove("budget.png")
    write_json(os.path.join(outdir, "summary.json"), summary)
    return summary["files"]


def crossovers(terms: dict, q: str, b: dict) -> list[str]:
    """Where one term overtakes another, in words (the constants of quantity q; the depth
    and mesh terms scale like the width term, so their ratios to it do not depend on H)."""
    c = {t: terms[t][q]["constant"] for t in TERMS}
    H0 = b["transformer"][1]
    depth = c["depth"] * math.sqrt(H0)          # depth term = depth * L^-2 * H^-1/2
    out = []
    if c["width"] > 0 and c["tokens"] > 0:
        out.append(f"tokens dominate width where N < {(c['tokens'] / c['width']) ** 2:.3g} H")
    if c["width"] > 0 and depth > 0:
        out.append(f"depth dominates width where L < {math.sqrt(depth / c['width']):.3g} (any H)")
    if c["tokens"] > 0 and depth > 0:
        out.append(f"depth dominates tokens where N > {(c['tokens'] / depth) ** 2:.3g} L^4 H")
    if c["width"] > 0:
        mesh = term_value("mesh", c["mesh"], b["transformer"], b) * math.sqrt(H0)
        out.append(f"the mesh term is {mesh / c['width']:.2g} of the width term on the run's "
                   f"{b['run_cells'][0]}-cell mesh (any H)")
    return out


def _markdown(filename: str, b: dict, studies: dict, summary: dict) -> None:
    """budget.md: the budget's equation, the terms' constants and orders, the direct
    measurements against the sum of the terms, and which term dominates where."""
    L0, H0, N0 = b["transformer"]
    limit = describe_reference(studies["width"])
    rel = os.path.relpath(b["run"], os.path.dirname(b["budget_file"]))
    lines = [f"# Error budget: L = {L0}, H = {H0}, N = {N0}", "",
             f"Heads drawn from the law of `{rel}`" + (f" with {', '.join(b['set'])}" if b["set"] else "")
             + f"; {b['seeds']} draws per case; 95% intervals. The limit q_∞: {limit}.", "",
             f"E|q(L, H, N) − q_∞| ≈ C_L L⁻² s(H) + C_H H^(−1/2) + C_N N^(−1/2) + C_h h^(k+1) s(H) "
             f"(depth, width, tokens, mesh of the Eulerian reference), s(H) = ({b['transformer'][1]}/H)^(1/2): "
             "the depth and mesh errors scale with the velocity of a draw, like the width term.", ""]
    lines += _terms_table(b, studies, summary["terms"])
    lines += ["", "Direct measurements (particle runs against the limit, draws independent of the "
              "sweeps'; the first row is the transformer itself) against the budget (sum range: "
              "the sum of the terms' interval ends, not itself a 95% interval):", ""]
    lines += _checks_table(summary["checks"])
    lines += ["", "Which term dominates:", ""]
    for q in b["quantities"]:
        lines.append(f"- {q}: " + "; ".join(crossovers(summary["terms"], q, b)) + ".")
    with atomic_write(filename) as f:
        f.write("\n".join(lines) + "\n")


def _terms_table(b: dict, studies: dict, terms: dict) -> list[str]:
    """The Markdown rows of the terms: per term and quantity the constant C at the
    expected order and the freely fitted order, with 95% intervals, and the sweep that
    measured it (the swept values and their reference)."""
    lines = ["| term | quantity | constant C | 95% interval | fitted order | 95% interval | expected | measured by |",
             "|---|---|---|---|---|---|---|---|"]
    against = {"depth": f"L = {b['layers_reference']}, same draw",
               "width": "the exact limit" if b["width_reference"] == "expectation"
               else f"a draw of {b['width_reference_heads']} heads",
               "tokens": "the Eulerian solution, same heads", "mesh": f"{b['cells_reference']}, same draw"}
    for t in TERMS:
        s = studies[t]
        how = f"{s['parameter']} over {json.dumps(s['values'][:len(s['values']) - (t in ('depth', 'mesh'))])} against {against[t]}"
        for q, f in terms[t].items():
            oci = "—" if math.isnan(f["order_low"]) else f"[{f['order_low']:.2f}, {f['order_high']:.2f}]"
            lines.append(f"| {t} | {q} | {f['constant']:.3g} | [{f['low']:.3g}, {f['high']:.3g}] | "
                         f"{f['order']:.2f} | {oci} | {f['expected_order']:g} | {how} |")
    return lines


def _checks_table(checks: list) -> list[str]:
    """The Markdown rows of the direct measurements: per check point and quantity the
    measured error (95% interval), each term, their sum (and the range of the sum of the
    terms' interval ends), their root sum of squares, and measured / sum, measured / rss."""
    lines = ["| L | H | N | quantity | measured | 95% interval | depth | width | tokens | mesh | sum | "
             "sum range | rss | measured / sum | measured / rss |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in checks:
        L, H, N = c["point"]
        p = c["terms"]
        lines.append(f"| {L} | {H} | {N} | {c['quantity']} | {c['measured']:.3e} | "
                     f"[{c['low']:.2e}, {c['high']:.2e}] | {p['depth']:.1e} | {p['width']:.1e} | "
                     f"{p['tokens']:.1e} | {p['mesh']:.1e} | {c['sum']:.3e} | "
                     f"[{c['sum_low']:.2e}, {c['sum_high']:.2e}] | {c['rss']:.3e} | "
                     f"{c['measured'] / c['sum']:.2f} | {c['measured'] / c['rss']:.2f} |")
    return lines


def _plot(filename, b, studies, measured, summary) -> bool:
    """Left: every sweep's mean errors (95% band) and its fitted term against the swept
    value; right: the dominant term over (H, N) at the transformer's L, with the budget's
    contours and the check points."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.colors import ListedColormap
    except ImportError:
        log.warning("warning: matplotlib is missing: no budget.png (Debian: python3-matplotlib)")
        return False
    q = b["quantities"][0]
    fig, (ax, bx) = plt.subplots(1, 2, figsize=(11, 4.4))
    colours = dict(zip(TERMS, ("C0", "C1", "C2", "C3")))
    _plot_terms(ax, q, studies, measured, summary["terms"], colours)
    _plot_dominant(bx, q, b, summary, ListedColormap([colours[t] for t in TERMS]))
    fig.tight_layout()
    save_figure(filename, fig, dpi=110)
    plt.close(fig)
    return True


def _plot_terms(ax, q: str, studies: dict, measured: dict, terms: dict, colours: dict) -> None:
    """Every sweep's mean errors of quantity q against the swept value (cells per side for
    the mesh), their 95% band and the fitted term C (1/x)^p, log-log."""
    for t in TERMS:
        rows = [r for r in measured[t][0] if r["quantity"] == q]
        x = np.array([json.loads(r["value"])[0] if t == "mesh" else float(r["value"]) for r in rows])
        y = np.array([r["error"] for r in rows])
        ax.loglog(x, y, "o", color=colours[t], label=f"{t}: {SYMBOL[t]}, C = {terms[t][q]['constant']:.2g}")
        ax.fill_between(x, np.maximum([r["ci_low"] for r in rows], 1e-3 * y), [r["ci_high"] for r in rows],
                        color=colours[t], alpha=0.2, lw=0)
        p = studies[t]["expected_order"]
        ax.loglog(x, terms[t][q]["constant"] * (1.0 / x) ** p, "-", color=colours[t], lw=1)
    ax.set_xlabel("L, H, N or cells per side")
    ax.set_ylabel(f"mean error of {q}")
    ax.set_title("the terms, measured and fitted")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7)


def _plot_dominant(bx, q: str, b: dict, summary: dict, cmap) -> None:
    """The dominant term of quantity q over heads H in [1, 10^4] and tokens N in
    [10, 10^6] at the transformer's L (coloured by ``cmap``, one colour per term), the
    contours of the budget's sum, and the check points (*: the transformer) with their
    measured errors."""
    terms = summary["terms"]
    L0 = b["transformer"][0]
    H = np.logspace(0, 4, 161)
    N = np.logspace(1, 6, 201)
    HH, NN = np.meshgrid(H, N)
    parts = np.array([term_value(t, terms[t][q]["constant"], (L0, HH, NN), b) * np.ones_like(HH) for t in TERMS])
    bx.pcolormesh(H, N, parts.argmax(axis=0), cmap=cmap, vmin=-0.5, vmax=3.5, alpha=0.35, shading="auto")
    cs = bx.contour(H, N, parts.sum(axis=0), levels=np.logspace(-4, 0, 9), colors="k", linewidths=0.6)
    bx.clabel(cs, fmt="%.0e", fontsize=6)
    for c in summary["checks"]:
        if c["quantity"] == q:
            L, Hc, Nc = c["point"]
            bx.plot(Hc, Nc, "k*" if c["transformer"] else "kx", ms=8)
            bx.annotate(f"L={L}: {c['measured']:.1e}", (Hc, Nc), fontsize=6, xytext=(4, 4),
                        textcoords="offset points")
    bx.set_xscale("log")
    bx.set_yscale("log")
    bx.set_xlabel("heads H")
    bx.set_ylabel("tokens N")
    bx.set_title(f"dominant term at L = {L0} (blue depth, orange width, green tokens, red mesh);\n"
                 "contours: the budget's sum; *: the transformer, x: checks", fontsize=8)
