"""Figures drawn from arrays: the densities over depth (the arrays of a run's
fields.npz), the diagnostics over depth and the training history.

Figures are matplotlib ``Figure`` objects made without pyplot (no global state, no
display); the functions ``*_figure`` return them, so tests read back what they show.
matplotlib is imported where a figure is made: without it, one line says so.
"""

from __future__ import annotations

import numpy as np

from .charts import chart
from .errors import InputError
from .output import PICTURE_PROMPTS

MOST_SNAPSHOTS = 5          # columns of the density picture (the first and last frame among them)
MOST_TOKENS = 3000          # tokens drawn per panel (every k-th one beyond)
DPI = 80
CMAP = "viridis"
PANEL = 2.0                 # inches per panel
SUBSCRIPT = str.maketrans("0123456789", "₀₁₂₃₄₅₆₇₈₉")


def coordinate(i: int) -> str:
    """The name of coordinate i of token space: x₀, x₁, x₂."""
    return f"x{str(i).translate(SUBSCRIPT)}"


CHART_AXES = {"circle": ["θ"], "sphere": ["longitude (°)", "latitude (°)"]}


def axis_names(snap: dict) -> list[str]:
    """The names of the axes the densities are drawn on: the token coordinates, or on a
    circle or sphere those of its chart (fields.npz's ``chart``)."""
    chart = str(snap.get("chart", ""))
    if chart:
        return CHART_AXES[chart]
    dim = snap["box"].shape[1]
    return ["x"] if dim == 1 else [coordinate(a) for a in range(dim)]



def figure_grid(columns: int, rows: int, width: float = PANEL, height: float = PANEL):
    """A matplotlib Figure (no pyplot: no global state, no display) with a grid of axes."""
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise InputError("matplotlib is missing: no pictures (Debian: apt-get install "
                         "python3-matplotlib)") from None
    fig = Figure(figsize=(width * columns + 0.9, height * rows + 0.5), layout="constrained")
    return fig, fig.subplots(rows, columns, squeeze=False)


def snapshot_frames(count: int, most: int = MOST_SNAPSHOTS) -> list[int]:
    """Up to ``most`` frame indices evenly over depth, the first and last among them."""
    return sorted({int(round(k)) for k in np.linspace(0, count - 1, min(count, most))})


# ------------------------------------------------------------------ densities

def density_figure(snap: dict):
    """Per prompt a row of snapshots over depth t on one colour scale (the density's
    range over all frames and the target's): 1-D curves of rho at the DG nodes of each
    cell, 2-D the cell means on the cells (tripcolor, flat), 3-D the cell means on the
    slice x₂ = const through the prompt's initial mean, tokens as points (1-D: a
    histogram); the target (a density: one more panel; moments: mean and 1-sigma
    ellipse; points) on the last snapshot. None when the file holds no frames."""
    names = [str(n) for n in snap["prompts"]]
    rows = [i for i in range(len(names)) if f"t_{i}" in snap][:PICTURE_PROMPTS]
    if not rows:
        return None
    frames = {i: snapshot_frames(len(snap[f"t_{i}"])) for i in rows}
    density_panel = any(f"target_density_{i}" in snap for i in rows) and snap["box"].shape[1] > 1
    columns = max(len(f) for f in frames.values()) + density_panel
    fig, axes = figure_grid(columns, len(rows))
    for r, i in enumerate(rows):
        _prompt_row(fig, axes[r], snap, i, names[i], frames[i], bottom=r == len(rows) - 1)
    caption = str(snap.get("caption", "")) + (f"{', ' if snap.get('caption', '') else ''}the first "
                                               f"{len(rows)} of {len(names)} prompts"
                                               if len(names) > len(rows) else "")
    fig.suptitle("densities over depth t" + (f" ({caption})" if caption else ""), fontsize=10)
    return fig


def _prompt_row(fig, axes, snap: dict, i: int, name: str, frames: list[int], bottom: bool) -> None:
    """One prompt's snapshots, then its density target (if any), on one colour scale
    (``bottom``: the last row, which labels the x axes)."""
    dim = snap["box"].shape[1]
    t = snap[f"t_{i}"]
    tokens = f"tokens_{i}" in snap
    scale = None if tokens else density_scale(snap, i)
    mappable = None
    for c, k in enumerate(frames):
        ax = axes[c]
        if tokens:
            _draw_tokens(ax, snap[f"tokens_{i}"][k], snap[f"weights_{i}"], snap["box"],
                         str(snap.get("chart", "")))
        elif dim == 1:
            _draw_curves(ax, snap["node_x"], snap[f"nodes_{i}"][k], scale)
        else:
            mappable = _draw_cells(ax, snap, snap[f"density_{i}"][k], scale, i)
        ax.set_title(f"t = {t[k]:.3g}", fontsize=9)
        _frame_axes(ax, snap["box"], dim, first=c == 0, bottom=bottom, names=axis_names(snap))
    last = axes[len(frames) - 1]
    _draw_target(last, snap, i, scale)
    if f"target_density_{i}" in snap and dim > 1:
        ax = axes[len(frames)]
        target_scale = scale or (0.0, float(np.max(snap[f"target_density_{i}"])))
        mappable = _draw_cells(ax, snap, snap[f"target_density_{i}"], target_scale, i)
        ax.set_title("target", fontsize=9)
        _frame_axes(ax, snap["box"], dim, first=False, bottom=bottom, names=axis_names(snap))
    for ax in axes[len(frames) + (f"target_density_{i}" in snap and dim > 1):]:
        ax.set_visible(False)
    label = name if dim < 3 or tokens else f"{name}\nslice {coordinate(2)} = {slice_level(snap, i):.2g}"
    axes[0].set_ylabel(f"{label}\n{'ρ' if dim == 1 and not tokens else axis_names(snap)[1] if dim > 1 else 'tokens'}",
                       fontsize=9)
    if mappable is not None:
        fig.colorbar(mappable, ax=list(axes), shrink=0.9, label="ρ (cell mean)")


def density_scale(snap: dict, i: int) -> tuple[float, float]:
    """The colour (1-D: value) range of prompt i: over all its frames and its density target."""
    values = snap[f"nodes_{i}"] if f"nodes_{i}" in snap else snap[f"density_{i}"]
    low, high = float(np.min(values)), float(np.max(values))
    if f"target_density_{i}" in snap:
        low = min(low, float(np.min(snap[f"target_density_{i}"])))
        high = max(high, float(np.max(snap[f"target_density_{i}"])))
    return low, high if high > low else low + 1.0


def _frame_axes(ax, box: np.ndarray, dim: int, first: bool, bottom: bool = True,
                names: list[str] | None = None) -> None:
    """Axes over the mesh's box, few ticks (y ticks on the first panel of a row only,
    the x label -- ``names[0]`` -- on the bottom row)."""
    from matplotlib.ticker import MaxNLocator
    ax.set_xlim(box[0, 0], box[1, 0])
    if bottom:
        ax.set_xlabel((names or [coordinate(0) if dim > 1 else "x"])[0], fontsize=8)
    ax.tick_params(labelsize=7)
    ax.xaxis.set_major_locator(MaxNLocator(4))
    ax.yaxis.set_major_locator(MaxNLocator(4))
    if dim > 1:
        ax.set_ylim(box[0, 1], box[1, 1])
        ax.set_aspect("equal")
    if not first:
        ax.set_yticks([])


def _draw_curves(ax, node_x: np.ndarray, values: np.ndarray, scale) -> None:
    """rho on each cell through its DG nodes (jumps between cells shown as they are)."""
    from matplotlib.collections import LineCollection
    ax.add_collection(LineCollection(np.stack([node_x, values], axis=-1), colors="C0", linewidths=1.2))
    low, high = scale
    pad = 0.05 * (high - low)
    ax.set_ylim(min(0.0, low) - pad, high + pad)


def cell_triangles(cells: np.ndarray, cell_type: str) -> tuple[np.ndarray, np.ndarray]:
    """Triangles of 2-D cells (a quadrilateral, vertices in tensor-product order, is
    two) and the cell each comes from."""
    if cell_type == "quadrilateral":
        tri = np.concatenate([cells[:, [0, 1, 3]], cells[:, [0, 3, 2]]])
        return tri, np.concatenate([np.arange(len(cells))] * 2)
    return cells, np.arange(len(cells))


def sphere_chart_triangles(x: np.ndarray, tri: np.ndarray, cell: np.ndarray):
    """The triangles to draw the sphere's cells on its chart: polar triangles as
    quadrilaterals (:func:`polar_quads`), and every cell also shifted by -+360 degrees, so
    that cells past +-180 show on both sides (points, triangles, the cell of each)."""
    x, tri, cell = polar_quads(x, tri, cell)
    n = len(x)
    x = np.concatenate([x, x - [360.0, 0.0], x + [360.0, 0.0]])
    return x, np.concatenate([tri, tri + n, tri + 2 * n]), np.tile(cell, 3)


def polar_quads(x: np.ndarray, tri: np.ndarray, cell: np.ndarray):
    """On the longitude-latitude chart a triangle with a vertex at a pole is a quadrilateral:
    the pole is the segment latitude = +-90 between its other vertices' longitudes. Each
    such triangle becomes two triangles over that segment (the chart's points, triangles
    and the cell of each)."""
    polar = np.abs(x[tri, 1]) >= 90.0 - 1e-9                   # (triangles, 3)
    one = np.flatnonzero(polar.sum(axis=1) == 1)
    if len(one) == 0:
        return x, tri, cell
    k = np.argmax(polar[one], axis=1)                           # the polar corner
    p = tri[one, k]
    a, b = tri[one, (k + 1) % 3], tri[one, (k + 2) % 3]
    pa = np.c_[x[a, 0], x[p, 1]]                                # the pole at a's and b's longitude
    pb = np.c_[x[b, 0], x[p, 1]]
    n, m = len(x), len(one)
    ia, ib = n + np.arange(m), n + m + np.arange(m)
    keep = np.setdiff1d(np.arange(len(tri)), one)
    tri = np.concatenate([tri[keep], np.c_[a, b, ib], np.c_[a, ib, ia]])
    cell = np.concatenate([cell[keep], cell[one], cell[one]])
    return np.concatenate([x, pa, pb]), tri, cell


EDGES = {   # vertex pairs of the edges of 3-D cells (dolfinx's vertex order)
    "tetrahedron": [(0, 1), (0, 2), (0, 3), (1, 2), (1, 3), (2, 3)],
    "hexahedron": [(0, 1), (0, 2), (0, 4), (1, 3), (1, 5), (2, 3), (2, 6), (3, 7),
                   (4, 5), (4, 6), (5, 7), (6, 7)],
}


def slice_polygons(points: np.ndarray, cells: np.ndarray, cell_type: str, level: float,
                   axis: int = 2) -> tuple[list, np.ndarray]:
    """The cross-sections of convex 3-D cells with the plane x_axis = level: polygons
    in the other two coordinates (their corners are where edges cross the plane,
    ordered by angle) and the cell of each."""
    x = points[cells]                                   # (cells, vertices, 3)
    s = x[..., axis] - level
    crossing = np.flatnonzero((s.min(axis=1) < 0) & (s.max(axis=1) > 0))
    e = np.array(EDGES[cell_type])
    xa, xb = x[crossing][:, e[:, 0]], x[crossing][:, e[:, 1]]
    sa, sb = s[crossing][:, e[:, 0]], s[crossing][:, e[:, 1]]
    cut = sa * sb < 0
    lam = np.where(cut, sa / np.where(cut, sa - sb, 1.0), np.nan)
    plane = [k for k in range(3) if k != axis]
    p = (xa + lam[..., None] * (xb - xa))[..., plane]  # (crossing, edges, 2), nan off the plane
    centre = np.nanmean(p, axis=1, keepdims=True)
    angle = np.where(cut, np.arctan2(p[..., 1] - centre[..., 1], p[..., 0] - centre[..., 0]), np.inf)
    order = np.argsort(angle, axis=1)
    p = np.take_along_axis(p, order[..., None], axis=1)
    counts = cut.sum(axis=1)
    return [poly[:n] for poly, n in zip(p, counts)], crossing


def slice_level(snap: dict, i: int) -> float:
    """Where 3-D densities are cut: x₂ of prompt i's mean at t = 0 (nudged off mesh
    planes), inside the box."""
    box = snap["box"]
    level = float(snap[f"mean_{i}"][0][2]) if f"mean_{i}" in snap else float(box[:, 2].mean())
    level = min(max(level, box[0, 2]), box[1, 2])
    return level + 1e-7 * float(box[1, 2] - box[0, 2])


def _draw_cells(ax, snap: dict, values: np.ndarray, scale, i: int):
    """Cell values as flat colours: 2-D on the cells, 3-D on the slice (see slice_level)."""
    low, high = scale
    if snap["box"].shape[1] == 2:
        tri, cell = cell_triangles(snap["cells"], str(snap["cell_type"]))
        x = snap["points"]
        if str(snap.get("chart", "")) == "sphere":
            x, tri, cell = sphere_chart_triangles(x, tri, cell)
        return ax.tripcolor(x[:, 0], x[:, 1], tri, facecolors=values[cell], vmin=low, vmax=high,
                            cmap=CMAP, shading="flat", rasterized=True)
    from matplotlib.collections import PolyCollection
    polys, cell = slice_polygons(snap["points"], snap["cells"], str(snap["cell_type"]), slice_level(snap, i))
    pc = PolyCollection(polys, array=values[cell], cmap=CMAP, edgecolors="face", linewidths=0.3,
                        rasterized=True)
    pc.set_clim(low, high)
    ax.add_collection(pc)
    return pc


def _draw_tokens(ax, x: np.ndarray, w: np.ndarray, box: np.ndarray, kind: str = "") -> None:
    """Tokens as points (every k-th beyond MOST_TOKENS; 3-D: projected on x₀x₁, on a
    sphere its chart), in 1-D (and on a circle's angle) a histogram of their weights."""
    if kind:
        x = chart(x[:, None, :], kind)[:, 0, :]
    if x.shape[1] == 1:
        ax.hist(x[:, 0], bins=40, range=(box[0, 0], box[1, 0]), weights=w, density=True, color="C0",
                alpha=0.8)
        return
    step = max(1, len(x) // MOST_TOKENS)
    ax.scatter(x[::step, 0], x[::step, 1], s=1.5, c="C0", alpha=0.6, linewidths=0, rasterized=True)


def _draw_target(ax, snap: dict, i: int, scale) -> None:
    """The target on a (the last) snapshot: moments as mean (x) and 1-sigma ellipse,
    points as grey crosses, a 1-D density target as a dashed curve, the potential's
    centre as a star (on a circle's or sphere's chart only the density: the others
    live in R^d)."""
    dim = snap["box"].shape[1]
    if str(snap.get("chart", "")):
        if f"target_density_{i}" in snap and dim == 1:
            _draw_density_target(ax, snap, i)
        return
    style = {"color": "white" if dim > 1 and f"tokens_{i}" not in snap else "C3", "lw": 1.2}
    if f"target_mean_{i}" in snap:
        mean, cov = snap[f"target_mean_{i}"], snap[f"target_cov_{i}"]
        if dim == 1:
            sd = float(np.sqrt(cov[0, 0]))
            ax.axvline(mean[0], ls="--", **style)
            ax.axvspan(mean[0] - sd, mean[0] + sd, color=style["color"], alpha=0.15, lw=0)
        else:
            ax.plot(*ellipse(mean[:2], cov[:2, :2]), ls="--", **style)
            ax.plot([mean[0]], [mean[1]], marker="x", ms=6, mew=1.5, color=style["color"], ls="none")
    if f"target_points_{i}" in snap:
        p = snap[f"target_points_{i}"]
        ax.plot(p[:, 0], p[:, 1] if dim > 1 else np.zeros(len(p)), "x", color="0.4", ms=3)
    if f"target_density_{i}" in snap and dim == 1:
        _draw_density_target(ax, snap, i)
    if "objective_center" in snap:
        centre = snap["objective_center"]
        ax.plot([centre[0]], [centre[1] if dim > 1 else 0.0], marker="*", ms=8, color="C1", ls="none")


def _draw_density_target(ax, snap: dict, i: int) -> None:
    """A 1-D density target at the cell centres, dashed."""
    c = snap["points"][snap["cells"]].mean(axis=1)[:, 0]
    order = np.argsort(c)
    ax.plot(c[order], snap[f"target_density_{i}"][order], ls="--", color="C3", lw=1)


def ellipse(mean: np.ndarray, cov: np.ndarray, points: int = 60) -> tuple[np.ndarray, np.ndarray]:
    """The 1-sigma ellipse {mean + L u : |u| = 1}, cov = L L^T, as x and y arrays."""
    vals, vecs = np.linalg.eigh(0.5 * (cov + cov.T))
    a = np.linspace(0, 2 * np.pi, points)
    u = np.stack([np.cos(a), np.sin(a)])
    xy = mean[:, None] + vecs @ (np.sqrt(np.maximum(vals, 0))[:, None] * u)
    return xy[0], xy[1]


# ------------------------------------------------------------------ diagnostics over depth

def diagnostics_figure(rows: list[dict]):
    """Mean, covariance, mass and outflow of every prompt against depth t (one colour
    per prompt; components: solid, dashed, dotted)."""
    dim = sum(1 for k in rows[0] if k.startswith("mean_"))
    every = list(dict.fromkeys(r["prompt"] for r in rows))
    prompts = every[:PICTURE_PROMPTS]
    drawn = set(prompts)
    rows = [r for r in rows if r["prompt"] in drawn]
    fig, axes = figure_grid(4, 1, width=2.4, height=2.1)
    axes = axes[0]
    styles = ["-", "--", ":", "-."]
    import matplotlib
    colours = matplotlib.colormaps["tab20" if len(prompts) > 10 else "tab10"]
    for p, name in enumerate(prompts):
        mine = [r for r in rows if r["prompt"] == name]
        t = np.array([r["t"] for r in mine])
        colour = colours(p)
        for a in range(dim):
            axes[0].plot(t, [r[f"mean_{a}"] for r in mine], styles[a], color=colour,
                         label=name if a == 0 else None)
        pairs = [(a, b) for a in range(dim) for b in range(a, dim)]
        for k, (a, b) in enumerate(pairs):
            axes[1].plot(t, [r[f"cov_{a}{b}"] for r in mine], styles[k % len(styles)], color=colour)
        mass = np.array([r["mass"] for r in mine])
        axes[2].plot(t, mass - mass[0], "-", color=colour)
        axes[3].plot(t, [r["outflow"] for r in mine], "-", color=colour)
    for ax, title in zip(axes, ("mean", "covariance", "mass(t) − mass(0) on the mesh", "outflow")):
        ax.set_title(title, fontsize=9)
        ax.set_xlabel("depth t", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    comps = ", ".join(f"{styles[a]} {coordinate(a)}" for a in range(dim))
    axes[0].set_ylabel(f"components ({comps})" if dim > 1 else "", fontsize=7)
    # the prompts' legend beside the panels (with many prompts it would cover the means)
    axes[3].legend(*axes[0].get_legend_handles_labels(), fontsize=7, loc="upper left", bbox_to_anchor=(1.02, 1.0),
                   title=f"the first {len(prompts)} of {len(every)}" if len(every) > len(prompts) else None,
                   title_fontsize=7)
    return fig


# ------------------------------------------------------------------ training

def training_figure(history: dict):
    """Risk (with minibatches: the batch's, and every test_every steps all training
    prompts'; the held-out prompts' test risk where history.csv has one) against the
    training step on a log scale, the gradient norm |dR/dtheta|, the step size and the
    heads' displacement per step."""
    step = history["step"]
    fig, axes = figure_grid(3, 1, width=2.6, height=2.2)
    axes = axes[0]
    minibatch = "train_risk" in history
    _log_line(axes[0], step, history["risk"], ".-" if minibatch else "o-",
              label="batch risk" if minibatch else "risk")
    for column, style, label in (("train_risk", "o-", "train risk"), ("test_risk", "s--", "test risk")):
        if column in history:
            known = np.isfinite(history[column])      # evaluated every test_every steps
            _log_line(axes[0], step[known], history[column][known], style, label=label)
    if minibatch or "test_risk" in history:
        axes[0].legend(fontsize=7)
    axes[0].set_title("risk R", fontsize=9)
    _log_line(axes[1], step, history["grad_norm"], "o-", label="gradient norm")
    axes[1].set_title("|dR/dθ|", fontsize=9)
    _log_line(axes[2], step, history["step_size"], "-", label="step size")
    if "displacement" in history:
        moved = history["displacement"] > 0
        _log_line(axes[2], step[moved], history["displacement"][moved], "o:", label="|Δθ|")
    axes[2].set_title("step size, |Δθ|", fontsize=9)
    axes[2].legend(fontsize=7)
    for ax in axes:
        ax.set_xlabel("training step", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
    return fig


def _log_line(ax, x, y, style: str, label: str):
    """A line on a log y axis where every value is positive (linear otherwise), with
    labelled ticks however few decades it spans."""
    line, = ax.plot(x, y, style, ms=3, label=label)
    y = np.asarray(y, float)
    if len(y) and np.all(y > 0):
        ax.set_yscale("log")
        _log_ticks(ax)
    return line


def _log_ticks(ax) -> None:
    """Major ticks at 1, 2, 5 (or finer) times powers of ten where the axis spans few
    decades (matplotlib would label none inside one decade); no minor ticks."""
    from matplotlib.ticker import FormatStrFormatter, LogLocator, NullLocator
    low, high = ax.get_ylim()
    decades = np.log10(high / low) if low > 0 else np.inf
    subs = (1.0, 1.5, 2.0, 3.0, 5.0, 7.0) if decades < 1 else (1.0, 2.0, 5.0) if decades < 3 else (1.0,)
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=subs, numticks=12))
    ax.yaxis.set_minor_locator(NullLocator())
    ax.yaxis.set_major_formatter(FormatStrFormatter("%.3g"))


