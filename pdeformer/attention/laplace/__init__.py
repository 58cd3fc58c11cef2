r"""Fast attention: the log-Laplace transform of rho tabulated once for all heads.

Every head's velocity is V_h grad Lambda_rho(A_h x) with
Lambda_rho(b) = log int e^{<b,y>} rho(y) dy (design §4). Lambda depends on rho alone, so
its gradient m(b) is tabulated on a tensor Chebyshev-Lobatto grid covering every
b = A_h x, and each head and target costs an interpolation. The modules, from the bottom:

* :mod:`.chebyshev`: the grids, barycentric interpolation, the table sizes and the error
  estimate from the decay of Chebyshev coefficients;
* :mod:`.box`: the heads' b-range and the box it is rounded to;
* :mod:`.panels`: panel nodes, on which e^{b y} is a polynomial to 1e-14, for sums over
  many sources;
* :mod:`.layout`: the sources' tiles (log-domain safety) and this rank's panel windows;
* :mod:`.cost_model`: what a table and direct summation cost on this machine;
* :mod:`.head_sums`: the velocity of all heads from an interpolant, and its reverse mode;
  signed weights (m = mu / zeta);
* :mod:`.table_sums`, :mod:`.table_reverse`, :mod:`.table`: the table
  (:class:`LaplaceTable`): its sums (one Allreduce of the n^d tables, no source gather),
  its reverse mode towards the sources, its interpolation;
* :mod:`.accuracy`: the errors of a table and its fine grid, and the velocity's bound;
* :mod:`.fine_grids`: the uniform fine grid with local degree-5 interpolation (d = 2, 3);
* :mod:`.search`: the size search from a trial table of a subsample (:func:`choose_table`);
* :mod:`.exact_pairs`: the pairs a table of signed weights leaves out, summed exactly;
* :mod:`.planner`: the plans that keep box and sizes from one evaluation to the next and
  that the adjoint replays (:class:`TablePlanner`).

Implemented for d = 1, 2 and 3. In 3-D the table has n^3 nodes (sizes SIZES3, at most
N3_MAX_FORCED) and the fine grid nf^3 nodes of four values with its own compiled loops
(kernels/fine3_loops.h). The table pays where |b| x the sources' extent is moderate
(tokens of unit scale, the sphere): its cost grows like (|b| extent)^3, direct
summation's like targets x heads x sources.
"""

from .accuracy import PANEL_ROUNDING, Assessment, assess, velocity_bound
from .box import b_range, grid_box, hull_candidates
from .chebyshev import (N_MAX, N_MAX_FORCED, N_MIN, SIZES, SIZES3, barycentric_weights,
                        chebyshev_coefficients, chebyshev_lobatto, differentiation_matrix,
                        largest_size, shell_maxima, table_sizes)
from .cost_model import (dense_seconds, direct_seconds, laplace_seconds, panel_nodes, panel_seconds,
                         source_extent, table_flops)
from .exact_pairs import exact_pair_velocity, exact_pair_vjp
from .fine_grids import FineGrid, fine_grid
from .head_sums import HeadSums
from .layout import SourceLayout
from .panels import Panels, panel_degree
from .planner import TablePlan, TablePlanner
from .search import SUBSAMPLE, choose_table, coordinate_scale, subsample
from .table import LaplaceTable

__all__ = ["Assessment", "FineGrid", "HeadSums", "LaplaceTable", "N_MAX", "N_MAX_FORCED", "N_MIN",
           "PANEL_ROUNDING", "Panels", "SIZES", "SIZES3", "SUBSAMPLE", "SourceLayout", "TablePlan",
           "TablePlanner", "assess", "b_range", "barycentric_weights", "chebyshev_coefficients",
           "chebyshev_lobatto", "choose_table", "coordinate_scale", "dense_seconds",
           "differentiation_matrix", "direct_seconds", "exact_pair_velocity", "exact_pair_vjp",
           "fine_grid", "grid_box", "hull_candidates", "laplace_seconds", "largest_size",
           "panel_degree", "panel_nodes", "panel_seconds", "shell_maxima", "source_extent",
           "subsample", "table_flops", "table_sizes", "velocity_bound"]
