"""Pictures of a run, drawn from the files it wrote: ``pdeformer plot RUN_DIR``.

Every run draws them when it ends (unless ``[output] plots = false``); ``pdeformer
plot`` draws them again, from the folder alone, with numpy and matplotlib only (no
dolfinx, no MPI): a run copied from a cluster can be drawn on a laptop.

========================  ===============================  =====================================
picture                   drawn from                       what it shows
========================  ===============================  =====================================
densities.png             fields.npz                       per prompt a row of snapshots over
                                                           depth t on one colour scale (1-D:
                                                           curves; 2-D: the cell means; 3-D: a
                                                           slice), tokens of a particle run, the
                                                           objective's target
diagnostics.png           diagnostics.csv                  mean, covariance, mass and outflow
                                                           against depth t
training.png              history.csv                      risk, gradient norm, step size
                                                           against the training step
heads.png                 params_XXXX.npz                  each layer's heads at the first and
                                                           last step, in the two leading
                                                           principal directions of theta
gradient.png              gradient.npz                     |dR/dtheta| per layer and head
========================  ===============================  =====================================

With ``[output] plot_format = "svg"`` (or ``--format svg``) they are SVG files, the
cells and tokens inside them rasterised. Where the folder holds field series (density,
velocity, tokens, heads) ``paraview.py`` is written too (pdeformer.commands.paraview_session).
Figures are matplotlib ``Figure`` objects made without pyplot (no global state, no
display); the functions ``*_figure`` return them, so tests read back what they show.
"""

from __future__ import annotations

import os

import numpy as np

from ..model import params as tree
from ..tools.errors import InputError, OutputError
from ..tools.figures import CMAP, DPI, density_figure, diagnostics_figure, figure_grid, training_figure
from ..tools.output import save_figure
from .run_files import (read_diagnostics_table, read_gradient, read_npz, read_params, read_snapshots,
                        read_table, run_inputs, summary_format)

PICTURES = ("densities", "diagnostics", "training", "heads", "gradient")   # <name>.<format>


# ------------------------------------------------------------------ drawing a run

def draw_run(folder: str, fmt: str = "png", out: str | None = None, prompts: list[str] | None = None) -> dict:
    """Every picture the run's files allow, into ``out`` (default: the run folder), and
    paraview.py where it has field series: {"pictures": [file names], "paraview":
    "paraview.py"} (keys only for what was written). ``prompts``: the prompt names in
    the config's order (a run that has not written summary.json yet), else summary.json's."""
    from .paraview_session import write_session
    out = out or folder
    inputs = run_inputs(folder)
    figures = {}   # picture -> (the file it is drawn from, how)
    if "fields" in inputs:
        figures["densities"] = (inputs["fields"], lambda: density_figure(read_snapshots(inputs["fields"])))
    if "diagnostics" in inputs:
        figures["diagnostics"] = (inputs["diagnostics"],
                                  lambda: diagnostics_figure(read_diagnostics_table(inputs["diagnostics"])))
    if "history" in inputs:
        figures["training"] = (inputs["history"], lambda: training_figure(read_table(inputs["history"])))
    if "params" in inputs:
        figures["heads"] = (inputs["params"][-1],
                            lambda: heads_figure(read_params(folder), read_npz(inputs["params"][-1]).get("weights")))
    if "gradient" in inputs:
        figures["gradient"] = (inputs["gradient"], lambda: gradient_figure(read_gradient(inputs["gradient"])))
    drawn = []
    for name, (source, make) in figures.items():
        try:
            fig = make()
        except (KeyError, IndexError, ValueError, TypeError,
                np.linalg.LinAlgError) as e:   # a file that loads, but not ours
            raise InputError(f"{source}: not as pdeformer writes it ({type(e).__name__}: {e})") from None
        if fig is not None:
            filename = f"{name}.{fmt}"
            save_figure(os.path.join(out, filename), fig, dpi=DPI)
            drawn.append(filename)
    result = {"pictures": drawn} if drawn else {}
    script = write_session(folder, out, prompts)
    if script:
        result["paraview"] = script
    return result


# ------------------------------------------------------------------ heads

def head_vectors(params: dict, layer: int) -> np.ndarray:
    """theta of each particle of a layer of a parameter tree, every block's arrays
    flattened: (particles, entries)."""
    blocks = [tree.particle_vectors(arrays, layer) for arrays in params.values()]
    out = np.zeros((sum(len(b) for b in blocks), sum(b.shape[1] for b in blocks)))
    row = col = 0
    for b in blocks:   # several blocks: one cloud, each block's entries in its own columns
        out[row:row + len(b), col:col + b.shape[1]] = b
        row, col = row + len(b), col + b.shape[1]
    return out


def principal_coordinates(points: np.ndarray) -> np.ndarray:
    """Coordinates of points in their two leading principal directions (about their
    mean; zeros where there are fewer)."""
    centred = points - points.mean(axis=0)
    _, _, vt = np.linalg.svd(centred, full_matrices=False)
    out = np.zeros((len(points), 2))
    k = min(2, vt.shape[0])
    out[:, :k] = centred @ vt[:k].T
    return out


def heads_figure(params: list[tuple[int, dict]], weights: np.ndarray | None = None):
    """The head measure of each layer as a cloud: every head theta_{l,h} at the first
    (open) and last (filled) step in the two leading principal directions of that
    layer's heads at both steps, with the path between them; weighted heads (``weights``
    (L, H), the heads alone) with areas in proportion to their weights. None without
    params."""
    if not params:
        return None
    (first_step, first), (last_step, last) = params[0], params[-1]
    layers = max(tree.layers_width(arrays)[0] for arrays in first.values())
    columns = min(layers, 4)
    fig, axes = figure_grid(columns, -(-layers // columns), width=2.0, height=2.0)
    for l, ax in enumerate(axes.ravel()):
        if l >= layers:
            ax.set_visible(False)
            continue
        a, b = head_vectors(first, l), head_vectors(last, l)
        xy = principal_coordinates(np.vstack([a, b]))
        xa, xb = xy[:len(a)], xy[len(a):]
        for p, q in zip(xa, xb):
            ax.plot([p[0], q[0]], [p[1], q[1]], "-", color="0.7", lw=0.8)
        area = 16.0 if weights is None or len(first) > 1 else 16.0 * len(a) * np.asarray(weights)[l]
        ax.scatter(xa[:, 0], xa[:, 1], s=area, facecolors="none", edgecolors="C0", label=f"step {first_step}")
        ax.scatter(xb[:, 0], xb[:, 1], s=area, color="C1", label=f"step {last_step}")
        ax.set_title(f"layer {l}", fontsize=9)
        ax.tick_params(labelsize=7)
        ax.set_xlabel("θ · e₁", fontsize=8)
        if l % columns == 0:
            ax.set_ylabel("θ · e₂", fontsize=8)
    axes[0, 0].legend(fontsize=7)
    names = " and ".join(tree.PARTICLES[block] for block in first)
    fig.suptitle(f"{names} θ per layer, two leading principal directions", fontsize=10)
    return fig


def gradient_figure(gradient: dict):
    """|dR/dtheta_{l,w}| (all arrays of a particle together) per layer and particle,
    the blocks side by side."""
    norms = np.concatenate([tree.particle_norms(arrays) for arrays in gradient["params"].values()], axis=1)
    layers, heads = norms.shape
    what = tree.PARTICLES[next(iter(gradient["params"]))][:-1] if len(gradient["params"]) == 1 else "particle"
    fig, axes = figure_grid(1, 1, width=max(2.4, 0.35 * heads + 1), height=max(2.0, 0.3 * layers + 1))
    ax = axes[0, 0]
    image = ax.imshow(norms, origin="lower", cmap=CMAP, aspect="auto")
    ax.set_yticks(range(layers))                   # layers and particles are whole numbers
    ax.set_xticks(range(0, heads, max(1, heads // 16)))
    ax.set_xlabel(what, fontsize=8)
    ax.set_ylabel("layer", fontsize=8)
    ax.tick_params(labelsize=7)
    risk = f" (risk {float(gradient['risk']):.4g})" if "risk" in gradient else ""
    ax.set_title(f"|dR/dθ| per {what}{risk}", fontsize=9)
    fig.colorbar(image, ax=ax, label=f"|dR/dθ| of {what} (l, {what[0]})")
    return fig


# ------------------------------------------------------------------ the command

def plot_command(folder: str, fmt: str | None = None, out: str | None = None) -> dict:
    """``pdeformer plot``: the pictures (and paraview.py) of the run in ``folder``."""
    fmt = fmt or summary_format(folder)
    if out is not None:
        try:
            os.makedirs(out, exist_ok=True)
        except OSError as e:
            raise OutputError(f"{out}: cannot create the folder ({e.strerror or e})") from None
    result = draw_run(folder, fmt, out)
    if not result:
        raise InputError(f"{folder}: nothing to draw (no fields.npz, diagnostics.csv, history.csv, "
                         "params_*.npz or gradient.npz)")
    return result
