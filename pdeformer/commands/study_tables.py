"""The tables of a convergence study: from its records (every member's error in every
case) the rows (mean error, 95% interval, observed order), the fitted orders, and the
files convergence.csv, convergence.md, convergence.png, ensemble.csv (rank 0)."""

from __future__ import annotations

import json
import logging
import math
import os

import numpy as np

from ..tools.output import atomic_write, save_figure, write_csv, write_json
from .study import BIASES, describe_reference, size_of

log = logging.getLogger("pdeformer")


def orders(sizes, errs):
    """Observed orders between successive cases: log(e_{i-1}/e_i) / log(h_{i-1}/h_i)."""
    out = [math.nan]
    for i in range(1, len(errs)):
        a, b, sa, sb = errs[i - 1], errs[i], sizes[i - 1], sizes[i]
        ok = a > 0 and b > 0 and sa > 0 and sb > 0 and sa != sb
        out.append(math.log(a / b) / math.log(sa / sb) if ok else math.nan)
    return out


def ensemble_matrix(records: list, quantity: str, key: str = "error") -> tuple[list, list, np.ndarray]:
    """(cases, members, errors (cases x members)) of one quantity over the members that
    have every case (a member the walltime guard cut short is left out; where none has
    every case, the cases every member has); with ``key = "deviation"`` (a bias
    quantity) cases x members x components."""
    have = {}
    for r in records:
        if r["quantity"] == quantity:
            have.setdefault(r["member"], {})[r["case"]] = r[key]
    if not have:
        return [], [], np.zeros((0, 0))
    cases = sorted(set().union(*have.values()))
    members = sorted(j for j, c in have.items() if len(c) == len(cases))
    if not members:
        cases = sorted(set.intersection(*(set(c) for c in have.values())))
        members = sorted(have)
    E = np.array([[have[j][i] for j in members] for i in cases], dtype=float)
    return cases, members, E.reshape(len(cases), len(members), *E.shape[2:])


def bias_matrix(records: list, quantity: str) -> tuple[list, list, np.ndarray]:
    """(cases, members, B) of a bias quantity: B[i, j] = <d_ij, u>, member j's deviation
    d_ij = q - q_ref in case i along u = sum_i mean_j d_ij / |...|, the common direction
    of the cases' mean deviations. A bias E d_i = b h_i^p + o(h_i^p) lies along b, so
    the mean of B[i] estimates |E d_i| and its interval is that of a mean of independent
    members (u is fitted to the same members: with n members it adds about
    |Var d|^(1/2) / n to the mean, far inside the interval)."""
    cases, members, D = ensemble_matrix(records, quantity, "deviation")
    if not cases:
        return cases, members, np.zeros((0, 0))
    u = D.mean(axis=1).sum(axis=0)
    norm = np.linalg.norm(u)
    return cases, members, D @ (u / norm if norm > 0 else u)


def error_rows(study: dict, records: list) -> tuple[list, dict]:
    """One row per case and quantity (the mean error over the ensemble's members, its
    95% interval, the observed order against the case before it) and per quantity the
    order fitted over all cases (pdeformer.tools.stats)."""
    from ..tools.stats import fit_order, mean_interval
    param, values = study["parameter"], study["values"]
    sizes = [size_of(param, v) for v in values]
    seconds = {}
    for r in records:
        seconds.setdefault(r["case"], {})[r["member"]] = r["seconds"]
    rows, fits = [], {}
    for q in study["quantities"]:
        cases, members, E = (bias_matrix if q in BIASES else ensemble_matrix)(records, q)
        if not cases:
            continue
        ivs = [mean_interval(e) for e in E]
        for i, iv, o in zip(cases, ivs, orders([sizes[i] for i in cases], [iv.mean for iv in ivs])):
            rows.append({"case": i, "value": json.dumps(values[i]), "size": sizes[i], "quantity": q,
                         "error": iv.mean, "sem": iv.sem, "ci_low": iv.low, "ci_high": iv.high,
                         "seeds": iv.n, "order": o,
                         "seconds": float(np.mean([seconds[i][j] for j in members]))})
        fit = fit_order([sizes[i] for i in cases], E, signed=q in BIASES)
        if math.isfinite(fit.order):
            fits[q] = {"order": fit.order, "low": fit.low, "high": fit.high, "constant": fit.constant,
                       "cases": fit.cases, "seeds": fit.members, "expected": study["expected_order"]}
    return rows, fits


COLUMNS = ("case", "value", "size", "quantity", "error", "sem", "ci_low", "ci_high", "seeds", "order", "seconds")


def write_study(outdir: str, study: dict, rows: list, fits: dict, records: list, summary: dict) -> list:
    """convergence.csv, .md, .png, ensemble.csv and summary.json (rank 0); the files
    written. A bias quantity's member errors in ensemble.csv are its deviations along the
    common direction (bias_matrix)."""
    write_csv(os.path.join(outdir, "convergence.csv"), list(COLUMNS), [[r[k] for k in COLUMNS] for r in rows])
    if study["seeds"] > 1:
        along = {}
        for q in set(study["quantities"]) & set(BIASES):
            cases, members, B = bias_matrix(records, q)
            along.update({(q, i, j): B[a, b] for a, i in enumerate(cases) for b, j in enumerate(members)})
        write_csv(os.path.join(outdir, "ensemble.csv"), ["case", "value", "member", "quantity", "error"],
                  [[r["case"], json.dumps(study["values"][r["case"]]), r["member"], r["quantity"],
                    along.get((r["quantity"], r["case"], r["member"]), r["error"])] for r in records])
    _markdown(os.path.join(outdir, "convergence.md"), study, rows, fits)
    if not _plot(os.path.join(outdir, "convergence.png"), study, rows, fits):
        summary["files"].remove("convergence.png")
    write_json(os.path.join(outdir, "summary.json"), summary)
    return summary["files"]


def _markdown(filename, study, rows, fits):
    n = study["seeds"]
    keys = ", ".join(study["seed_keys"])
    lines = [f"# Convergence: {study['parameter']} ({study['command']}, reference {study['reference']})", "",
             f"Base run: `{os.path.relpath(study['run'], os.path.dirname(study['study_file']))}`"
             + (f"; expected order {study['expected_order']:g}" if study["expected_order"] is not None else ""),
             "", f"Reference: {describe_reference(study)}.", ""]
    if n > 1:
        lines += [f"Ensembles of {n} draws per case ({keys} = base + 0..{n - 1}): the error is the mean "
                  "over the draws, with its 95% interval (Student's t).", ""]
    lines += [f"| {study['parameter']} | size | quantity | error | 95% interval | order |",
              "|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["quantity"], r["case"])):
        o = "—" if math.isnan(r["order"]) else f"{r['order']:.2f}"
        ci = f"[{r['ci_low']:.3e}, {r['ci_high']:.3e}]" if r["seeds"] > 1 else "—"
        lines.append(f"| {r['value']} | {r['size']:.4g} | {r['quantity']} | {r['error']:.3e} | {ci} | {o} |")
    if fits:
        how = ("weighted least squares over all cases, 95% intervals by the members' jackknife"
               if n > 1 else "least squares over all cases, one draw each; 95% intervals from "
               "their scatter about the power law")
        lines += ["", f"Orders fitted to error = C size^p ({how}):", "",
                  "| quantity | order p | 95% interval | expected | C | members |", "|---|---|---|---|---|---|"]
        for q, f in fits.items():
            exp = "—" if f["expected"] is None else f"{f['expected']:g}"
            ci = "—" if math.isnan(f["low"]) else f"[{f['low']:.3f}, {f['high']:.3f}]"
            lines.append(f"| {q} | {f['order']:.3f} | {ci} | {exp} | {f['constant']:.3g} | {f['seeds']} |")
    with atomic_write(filename) as f:
        f.write("\n".join(lines) + "\n")


def _plot(filename, study, rows, fits) -> bool:
    """Log-log error against size, one line per quantity (the ensemble's 95% band, the
    fitted power law), with the expected slope."""
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
        _plot_quantity(ax, [r for r in rows if r["quantity"] == q], q, fits.get(q), by_value)
    sizes = sorted({r["size"] for r in rows if r["size"] > 0})
    if study["expected_order"] is not None and len(sizes) >= 2:
        top = max((r["error"] for r in rows), default=1.0)
        s0 = sizes[-1]
        xs = np.array([sizes[0], s0])
        ax.loglog(xs, top * (xs / s0) ** study["expected_order"], "k--",
                  label=f"slope {study['expected_order']:g}")
    ax.set_xlabel(study["parameter"] if by_value else f"size ({study['parameter']})")
    ax.set_ylabel("error" + (f" (mean of {study['seeds']}, 95% band)" if study["seeds"] > 1 else ""))
    ax.set_title(f"{study['command']}: {study['parameter']}")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    save_figure(filename, fig, dpi=110)
    plt.close(fig)
    return True


def _plot_quantity(ax, rows: list, q: str, fit: dict | None, by_value: bool) -> None:
    """One quantity's line: its positive errors against size (log-log; against the value,
    log-linear, where the parameter has no size), the ensemble's 95% band where every
    case has one, and the fitted power law C size^p."""
    sel = sorted((r for r in rows if r["error"] > 0),
                 key=lambda r: float(json.loads(r["value"])) if by_value else r["size"])
    if not sel:
        return
    x = np.array([float(json.loads(r["value"])) if by_value else r["size"] for r in sel])
    y = np.array([r["error"] for r in sel])
    label = q if fit is None else f"{q}: p = {fit['order']:.2f}" + (
        "" if math.isnan(fit["low"]) else f" [{fit['low']:.2f}, {fit['high']:.2f}]")
    line, = (ax.semilogy if by_value else ax.loglog)(x, y, "o-", label=label)
    if all(r["seeds"] > 1 for r in sel):
        lo = np.maximum([r["ci_low"] for r in sel], 1e-3 * y)
        ax.fill_between(x, lo, [r["ci_high"] for r in sel], color=line.get_color(), alpha=0.2, lw=0)
    if fit is not None and not by_value:
        ax.loglog(x, fit["constant"] * x ** fit["order"], ":", color=line.get_color(), lw=1)
