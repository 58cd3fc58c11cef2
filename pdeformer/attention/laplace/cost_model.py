"""What a table costs, in flops and in seconds on this machine (the ``costs`` given, a
:class:`pdeformer.attention.costs.Costs`: a run's context's): a table's sums directly
over the sources (:func:`dense_seconds`) or through panel nodes (:func:`panel_seconds`),
whichever is less; interpolating it at the targets, from the table or its fine grid
(:func:`laplace_seconds`, :func:`fine_from`); and direct summation
(:func:`direct_seconds`). The table picks its path per tile from these, and the auto
backend picks between the table and direct summation."""

from __future__ import annotations

import numpy as np

from .chebyshev import N_MIN, table_sizes
from .layout import MAX_TILES, coordinate_range
from .panels import PANEL3_BYTES, PANEL_BETA, panel_degree


def panel_product_flops(n: int, d: int, ncols: int, nodes: list) -> float:
    """Flops of the products E_1 W (d = 1), E_1 W E_2^T (d = 2) or its 3-D analogue of
    ncols tables from the panel nodes, K_a per axis: 2 ncols n K_1, 2 ncols
    (n K_1 K_2 + n^2 K_2) or 2 ncols (n K_0 K_1 K_2 + n^2 K_1 K_2 + n^3 K_2)."""
    K = nodes
    if d == 3:
        return 2.0 * ncols * (n * K[0] * K[1] * K[2] + n * n * K[1] * K[2] + n**3 * K[2])
    return 2.0 * ncols * (n * K[0] if d == 1 else n * K[0] * K[1] + n * n * K[1])


def table_flops(n: int, d: int, ncols: int, sources: int, nodes: list | None) -> float:
    """Matrix-product flops of the ncols sums of a table: over the sources,
    2 ncols n^d M, or through ``nodes`` K_a panel nodes per axis (q per panel), the
    products plus the spread 2 ncols M q^d, whichever is less."""
    direct = 2.0 * ncols * n**d * sources
    if nodes is None:
        return direct
    spread = 2.0 * ncols * sources * panel_degree() ** d
    return min(direct, panel_product_flops(n, d, ncols, nodes) + spread)


def dense_seconds(costs, n: int, d: int, ncols: int, sources: int) -> float:
    """A table's ncols sums over the sources directly: the products (table_flops) and
    the work per grid node and source besides them (the per-axis factors' exponentials,
    in 2-D the factor times each column; in 3-D per n^2 nodes: E_0 (x) E_1 times each
    column; n per source in 1-D and 2-D, n^2 in 3-D)."""
    return table_flops(n, d, ncols, sources, None) * costs.flop + n ** max(1, d - 1) * sources * costs.dense_node


SPREAD3_SLOWDOWN = 2.5   # the 3-D spread's small products run this far below costs.flop, and
SPREAD3_NODE = 3.0       # each panel node and column costs 3 dense_node (zeroed, summed into,
                         # reordered): measured with 2.5e4-1e6 sources, K = 18-184


def panel_seconds(costs, n: int, d: int, ncols: int, sources: int, nodes: list, blocks: int,
                  compiled: bool) -> float:
    """The same sums through panel nodes (K_a per axis): the products, and the spread
    -- compiled: per source and column and per call; numpy: its products per source
    and column (2 q^d flops) and a loop step per block of sources (panel pair); in 3-D
    (numpy) also the work per panel node and column."""
    products = panel_product_flops(n, d, ncols, nodes) * costs.flop
    if d == 3:      # numpy, per triple: its small products, and the panel-major sums kept
        spread = 2.0 * ncols * sources * panel_degree() ** 3 * costs.flop * SPREAD3_SLOWDOWN
        return products + spread + SPREAD3_NODE * costs.dense_node * ncols * float(np.prod(nodes)) \
            + costs.numpy_block * min(blocks, sources)
    if compiled:
        return products + costs.spread * ncols * sources + costs.spread_call
    spread = 2.0 * ncols * sources * panel_degree() ** d * costs.flop
    return products + spread + costs.numpy_block * min(blocks, sources)


FINE3_POINT = 6.0     # a 3-D fine-grid point (6^3 nodes of 4 values) against a 2-D one (6^2
FINE3_COMPILED = 6.0  # of 2), numpy and compiled: measured (benchmarks/velocity.py --dim 3)


def fine_from(lib, costs, d: int = 2) -> int:
    """Table size from which the two-level interpolation is faster: every size with the
    compiled loop ``lib``; with numpy, the first where barycentric interpolation from
    the table (2 d n^d flops per point and head, d components) costs more than a point
    of the fine grid's."""
    if lib is not None:
        return N_MIN
    point = costs.numpy_point * (FINE3_POINT if d == 3 else 1.0)
    sizes = table_sizes(d)
    return next((n for n in sizes if 2.0 * d * n**d * costs.flop > point), sizes[-1])


def source_extent(points: np.ndarray, comm) -> np.ndarray:
    """Width of the sources' bounding box per axis (all ranks)."""
    lo, hi = coordinate_range(points, comm)
    return np.where(np.isfinite(hi - lo), hi - lo, 0.0)


def panel_nodes(bmax: float, extent: float) -> int:
    """Panel nodes on one axis for |b| <= bmax and sources spanning ``extent`` (capped:
    beyond MAX_TILES panels the table is not built anyway)."""
    panels = min(extent * bmax / (2 * PANEL_BETA), float(MAX_TILES))
    return max(1, int(np.ceil(panels))) * panel_degree()


def laplace_seconds(costs, n: int, d: int, sources: int, points: int, compiled: bool = True,
                    panel_nodes: list | None = None) -> float:
    """Cost of an order-1 table (1 + d sums over the sources: directly, or through
    ``panel_nodes`` K_a per axis, whichever is less) and of interpolating it at
    ``points`` (targets x heads): in 1-D barycentric (2 n d flops per point), in 2-D the
    fine grid, compiled or numpy, in 3-D the fine grid or barycentric from the table
    (2 d n^3 flops), whichever is less (for the auto backend)."""
    table = dense_seconds(costs, n, d, 1 + d, sources)
    if panel_nodes is not None and (d < 3 or (1 + d) * np.prod(panel_nodes, dtype=float) * 8 <= PANEL3_BYTES):
        blocks = int(np.prod([max(1, k // panel_degree()) for k in panel_nodes]))
        table = min(table, panel_seconds(costs, n, d, 1 + d, sources, panel_nodes, blocks, compiled))
    if d == 1:
        per_point = 2.0 * n * d * costs.flop
    elif d == 2:
        per_point = costs.fine_point if compiled else costs.numpy_point
    else:      # the fine grid or the table itself, whichever fine_grid would pick
        fine = (costs.fine_point * FINE3_COMPILED) if compiled else costs.numpy_point * FINE3_POINT
        per_point = min(fine, 2.0 * d * n**d * costs.flop)
    return table + points * per_point


def direct_seconds(costs, targets: int, heads: int, sources: int) -> float:
    """Direct summation of every (target, head, source) pair."""
    return costs.pair * targets * heads * sources
