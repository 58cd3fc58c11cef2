r"""DG discretisation of the continuity equation d/dt rho + div(rho v) = 0.

Density rho_h in DG-k (discontinuous Lagrange), velocity v_h in the vector Lagrange
space of degree k_v (continuous, so one normal velocity per facet). For every test
function w:

.. math::

    \int_\Omega \partial_t\rho\, w
      = \int_\Omega \rho\, v\cdot\nabla w
        - \sum_{F\ \mathrm{interior}} \int_F \hat F\, [\![w]\!]
        - \int_{\partial\Omega} (v\cdot n)^+ \rho\, w,
    \qquad
    \hat F = u_n^+ \rho^+ - u_n^- \rho^-, \quad u_n = \{v\}\cdot n^+,

the upwind flux: a single value per facet point, added to one cell and subtracted
from its neighbour, so interior fluxes cancel and the mass changes only by the
outflow :math:`\int_{\partial\Omega}(v\cdot n)^+\rho`. Nothing flows in. The DG mass
matrix is block-diagonal (one block per cell); PETSc factors it once (options prefix
``pdeformer_mass_``, defaults ``-ksp_type preonly -pc_type bjacobi -sub_pc_type lu``).

Also here: the positivity limiter (Zhang-Shu scaling about the cell mean), the CFL
length of each cell, the quadrature sources that feed the attention kernel, and the
moments reported as diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass

import basix
import numpy as np
import ufl
from mpi4py import MPI
from petsc4py import PETSc

import dolfinx.fem
import dolfinx.fem.petsc

from . import _dolfinx as dfx
from .mesh import is_manifold, token_dim
from ..tools.errors import ConfigError, InputError, SolverBreakdown
from ..tools.parallel import any_rank, ghost_update_add, moment_sums, scatter_forward

MASS_PREFIX = "pdeformer_mass_"
MASS_DEFAULTS = {"ksp_type": "preonly", "pc_type": "bjacobi", "sub_pc_type": "lu"}


def quadrature(mesh, degree: int) -> tuple[np.ndarray, np.ndarray]:
    """Reference quadrature points and weights of the mesh's cell, exact to ``degree``."""
    cell = getattr(basix.CellType, dfx.cell_type_name(mesh))
    return basix.make_quadrature(cell, degree)


def reference_vertices(mesh) -> np.ndarray:
    return basix.geometry(getattr(basix.CellType, dfx.cell_type_name(mesh)))


FACET_TYPES = {"triangle": "interval", "quadrilateral": "interval",
               "tetrahedron": "triangle", "hexahedron": "quadrilateral"}


def reference_facet_points(mesh, degree: int) -> np.ndarray:
    """The points of a facet quadrature of ``degree`` on every facet of the reference
    cell, in reference-cell coordinates (none in 1-D: facets are vertices)."""
    name = dfx.cell_type_name(mesh)
    tdim = mesh.topology.dim
    if tdim == 1:
        return np.zeros((0, 1))
    geom = basix.geometry(getattr(basix.CellType, name))
    X, _ = basix.make_quadrature(getattr(basix.CellType, FACET_TYPES[name]), degree)
    pts = []
    for verts in basix.topology(getattr(basix.CellType, name))[tdim - 1]:
        v = geom[verts]  # the reference facet's map is affine: v0 + X (v_i - v0), i = 1..tdim-1
        pts.append(v[0] + X @ (v[1:tdim] - v[0]))
    return np.vstack(pts)


class CellQuadrature:
    """A quadrature rule on the owned cells: physical points y_q, measure
    omega_q = |J(y_q)| w_q, and the values of a DG function u there -- so integrals of
    u become weighted sums, and their derivatives with respect to u's coefficients
    come back through :meth:`transpose`."""

    def __init__(self, mesh, degree: int, u):
        self.mesh = mesh
        self.u = u
        self.cells = dfx.owned_cells(mesh)
        X, ref_weights = quadrature(mesh, degree)
        self.X = X
        self.nq = X.shape[0]
        d = mesh.geometry.dim
        detJ = abs(ufl.JacobianDeterminant(mesh))
        xq = dfx.evaluate(dfx.expression(ufl.SpatialCoordinate(mesh), X), mesh, self.cells)
        self.points = xq.reshape(-1, d)  # (cells * nq, d), cell-major
        self.measure = (dfx.evaluate(dfx.expression(detJ, X), mesh, self.cells) * ref_weights).ravel()
        self._values = dfx.expression(u, X)
        self._basis = None

    def values(self) -> np.ndarray:
        """u(y_q) at every owned quadrature point (for the u set now)."""
        return dfx.evaluate(self._values, self.mesh, self.cells).ravel()

    def weights(self) -> np.ndarray:
        """u(y_q) omega_q: the weights of u as a sum of point masses."""
        return self.values() * self.measure

    def transpose(self, bar: np.ndarray, cell_dofs: np.ndarray, n_owned: int) -> np.ndarray:
        """Coefficient cotangent c_i = sum_q bar_q phi_i(y_q) of point-value cotangents
        ``bar`` (the transpose of c -> u(y_q)); owned DG coefficients."""
        if self._basis is None:  # phi_i(y_q), (cells, nq, dofs per cell)
            V = self.u.function_space
            vals = dfx.evaluate(dfx.expression(ufl.TestFunction(V), self.X), self.mesh, self.cells)
            self._basis = vals.reshape(len(self.cells), self.nq, cell_dofs.shape[1])  # a rank may own no cell
        out = np.zeros(n_owned)
        out[cell_dofs] = np.einsum("kq,kqi->ki", bar.reshape(len(self.cells), self.nq), self._basis)
        return out


@dataclass
class LimitedCells:
    """What the limiter did at one stage, for its Jacobian (see DGTransport.limit_vjp):
    the limited owned cells, theta, mean, minimum, c - mean and d min / d c per cell."""

    cells: np.ndarray
    theta: np.ndarray
    mean: np.ndarray
    low: np.ndarray
    dev: np.ndarray
    min_gradient: np.ndarray

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for a in (self.cells, self.theta, self.mean, self.low, self.dev,
                                      self.min_gradient))


class DGTransport:
    """Spaces, forms and solvers of the DG transport step (one instance per run).

    ``comm`` (default ``mesh.comm``) is the communicator of pdeformer's own collectives
    (the mesh's, possibly a :class:`~pdeformer.tools.parallel.MeteredComm` of it); PETSc gets
    ``mesh.comm``."""

    def __init__(self, mesh, degree: int, velocity_degree: int, source_degree: int,
                 petsc_options: dict | None = None, comm=None):
        self.mesh = mesh
        self.comm = mesh.comm if comm is None else comm
        self.meter = getattr(self.comm, "meter", None)   # the run's count of communication
        self.d = token_dim(mesh)          # the tokens' (ambient) dimension
        self.tdim = mesh.topology.dim     # the cells'
        self.manifold = is_manifold(mesh)
        self.degree = degree
        self.velocity_degree = velocity_degree
        self.facet_degree = velocity_degree + 2 * degree  # exact for v.n rho w on facets
        self.V = dfx.function_space(mesh, "DG", degree)
        # in 1-D the velocity is a scalar Lagrange function (a 1-component vector space is
        # "mixed" to dolfinx 0.5 and cannot be written to VTK); forms see a vector
        self.W = dfx.function_space(mesh, "Lagrange", velocity_degree,
                                    None if self.d == 1 else (self.d,))
        self.u = dolfinx.fem.Function(self.V, name="density")   # the state being evaluated
        self.v = dolfinx.fem.Function(self.W, name="velocity")
        self.velocity_vector = ufl.as_vector([self.v]) if self.d == 1 else self.v
        self.z = dolfinx.fem.Function(self.V, name="adjoint")   # M^{-1} of a rate cotangent
        self._ghosts_stale = False
        self._adjoint_forms = None
        self.n_owned = self.V.dofmap.index_map.size_local * self.V.dofmap.index_map_bs
        self.n_velocity_owned = self.W.dofmap.index_map.size_local * self.W.dofmap.index_map_bs
        self._build_forms()
        self._build_mass_solver(petsc_options or {})
        self._build_cell_data()
        self.sources = CellQuadrature(mesh, source_degree, self.u)
        self.n_sources = self.comm.allreduce(len(self.sources.points), op=MPI.SUM)
        simplex = dfx.cell_type_name(mesh) in ("interval", "triangle", "tetrahedron")
        self.moment_rule = CellQuadrature(mesh, degree + 2 if simplex else degree + 4, self.u)
        # rho is checked (limiter, min_rho) at the vertices, the attention sources and the
        # facet points where the upwind flux reads it, besides the Lagrange nodes
        self._check_points = np.vstack([reference_vertices(mesh), quadrature(mesh, source_degree)[0],
                                        reference_facet_points(mesh, self.facet_degree)])
        self._check_expr = dfx.expression(self.u, self._check_points)
        self._check_basis = None

    # ---------------------------------------------------------------- forms
    def _residual(self, w):
        """R(u, v; w): the weak form above, for a test function (or any DG function) w.
        On a circle or sphere grad is the gradient along the cells and n the co-normal
        (in the cell's plane, out of the cell); there the two cells' co-normals at a kinked
        facet are not opposite, and u_n = (v^+ . n^+ - v^- . n^-) / 2 is what leaves the
        + cell and enters the - one (one flux per facet: mass is conserved)."""
        u, v = self.u, self.velocity_vector
        n = ufl.FacetNormal(self.mesh)
        if self.manifold:
            un = 0.5 * (ufl.dot(v("+"), n("+")) - ufl.dot(v("-"), n("-")))
        else:
            un = ufl.dot(ufl.avg(v), n("+"))
        flux = 0.5 * (un + abs(un)) * u("+") - 0.5 * (abs(un) - un) * u("-")
        return (u * ufl.dot(v, ufl.grad(w)) * ufl.dx
                - flux * ufl.jump(w) * self._dS
                - self._vn_out * u * w * self._ds)

    def _build_forms(self):
        u, v = self.u, self.velocity_vector
        n = ufl.FacetNormal(self.mesh)
        self._vn_out = 0.5 * (ufl.dot(v, n) + abs(ufl.dot(v, n)))
        # one facet rule everywhere: the residual removes exactly the outflow recorded,
        # and the limiter checks rho where the fluxes read it
        facet_rule = {"quadrature_degree": self.facet_degree}
        self._ds, self._dS = ufl.ds(metadata=facet_rule), ufl.dS(metadata=facet_rule)
        w = ufl.TestFunction(self.V)
        self.residual_form = dolfinx.fem.form(self._residual(w))
        self.outflow_form = dolfinx.fem.form(self._vn_out * u * self._ds)
        trial = ufl.TrialFunction(self.V)
        self.mass_form = dolfinx.fem.form(trial * w * ufl.dx)
        self.load_vector = dolfinx.fem.petsc.create_vector(self.residual_form)
        self.solution = self.load_vector.duplicate()

    def _build_mass_solver(self, user_options: dict):
        self.petsc_options = dict(user_options)   # the user's ([petsc]), named when a solve fails
        M = dolfinx.fem.petsc.assemble_matrix(self.mass_form)
        M.assemble()
        self.mass_matrix = M
        opts = PETSc.Options()
        options = {**MASS_DEFAULTS, **self._pivot_tolerance(M), **user_options}
        for k, val in options.items():
            opts[MASS_PREFIX + k] = val
        ksp = PETSc.KSP().create(self.mesh.comm)
        ksp.setOptionsPrefix(MASS_PREFIX)
        ksp.setOperators(M)
        try:
            ksp.setFromOptions()
            ksp.setUp()
        except PETSc.Error as e:  # collective: every rank fails alike
            opts_text = " ".join(f"{k}={v}" for k, v in user_options.items())
            raise ConfigError("petsc", f"PETSc rejected the mass solver options ({opts_text}): "
                                       f"error code {e.ierr}") from None
        finally:
            for k in options:
                opts.delValue(MASS_PREFIX + k)
        self.ksp = ksp

    @staticmethod
    def _pivot_tolerance(M) -> dict:
        """PETSc's zero-pivot tolerance of the cell blocks' LU (default 100 eps, absolute:
        meant for entries of order 1) scaled by the mass matrix's largest entry, which is
        of the cells' volume: so that a mesh of cells of any size (a sphere of radius
        1e-9, cells of 1e-20 area) factors, and a singular block is still refused."""
        diag = M.getDiagonal()
        scale = diag.norm(PETSc.NormType.INFINITY)
        diag.destroy()
        tol = f"{100 * np.finfo(float).eps * scale:.17g}"
        return {"pc_factor_zeropivot": tol, "sub_pc_factor_zeropivot": tol}

    def _build_cell_data(self):
        """Per owned cell: volume, CFL length l_K = 2 d |K| / |dK|, dof lists."""
        mesh = self.mesh
        V0 = dfx.function_space(mesh, "DG", 0)
        w0 = ufl.TestFunction(V0)
        one = dolfinx.fem.Constant(mesh, PETSc.ScalarType(1.0))
        vol = dolfinx.fem.petsc.assemble_vector(dolfinx.fem.form(one * w0 * ufl.dx))
        surf = dolfinx.fem.petsc.assemble_vector(dolfinx.fem.form(
            one * w0 * ufl.ds + one * (w0("+") + w0("-")) * ufl.dS))
        for b in (vol, surf):
            ghost_update_add(b, meter=self.meter)
        ncell = mesh.topology.index_map(self.tdim).size_local
        dofs0 = dfx.cell_dofs(V0)[:ncell, 0]
        self.cell_volume = vol.array_r[dofs0].copy()
        if any_rank(self.comm, np.any(~(self.cell_volume > 0))):
            raise InputError("mesh: it has cells of zero volume (degenerate or inverted)")
        self.cell_length = 2 * self.tdim * self.cell_volume / surf.array_r[dofs0]
        self.cell_dofs = dfx.cell_dofs(self.V)[:ncell]
        self.velocity_cell_nodes = dfx.cell_dofs(self.W)[:ncell]
        # cell mean = sum_i mean_weights[K, i] * c_i  (integrals of the basis / |K|)
        w = ufl.TestFunction(self.V)
        basis_int = dolfinx.fem.petsc.assemble_vector(dolfinx.fem.form(one * w * ufl.dx))
        ghost_update_add(basis_int, meter=self.meter)
        self.mean_weights = basis_int.array_r[self.cell_dofs] / self.cell_volume[:, None]
        for b in (vol, surf, basis_int):
            b.destroy()

    # ---------------------------------------------------------------- state
    def set_state(self, coeffs: np.ndarray, ghosts: bool | np.ndarray = True) -> None:
        """Make ``coeffs`` (owned DG coefficients) the density the forms see. ``ghosts``:
        True updates the ghost cells' copies from their owners; False leaves them for
        :meth:`rate` and :meth:`rate_vjp` to update when they assemble (values on owned
        cells -- sources, check points, moments -- read none, a DG dof belonging to one
        cell); an array is the copies themselves, as :meth:`ghost_values` returned them
        for these coefficients (no communication)."""
        self.u.x.array[:self.n_owned] = coeffs
        if isinstance(ghosts, np.ndarray):
            self.u.x.array[self.n_owned:] = ghosts
            self._ghosts_stale = False
            return
        self._ghosts_stale = not ghosts
        if ghosts:
            scatter_forward(self.u, self.comm)

    def ghost_values(self) -> tuple[np.ndarray, np.ndarray]:
        """Copies of the ghost entries of the density and of the velocity as the forms
        read them (updated first where stale): what :meth:`set_state` and
        :meth:`set_velocity` take back later without communication (the adjoint's tape)."""
        self._update_ghosts()
        return self.u.x.array[self.n_owned:].copy(), self.v.x.array[self.n_velocity_owned:].copy()

    def _update_ghosts(self) -> None:
        """The ghost cells' copies of the density, where :meth:`set_state` left them."""
        if self._ghosts_stale:
            scatter_forward(self.u, self.comm)
            self._ghosts_stale = False

    def set_velocity(self, owned_values: np.ndarray, ghosts: np.ndarray | None = None) -> None:
        """Owned velocity node values (n_nodes, d) -> v, and its ghosts: updated from their
        owners, or ``ghosts`` as :meth:`ghost_values` returned them for these values."""
        self.v.x.array[:owned_values.size] = owned_values.ravel()
        if ghosts is not None:
            self.v.x.array[owned_values.size:] = ghosts
            return
        scatter_forward(self.v, self.comm)

    def source_weights(self) -> tuple[np.ndarray, bool]:
        """rho omega at this rank's attention quadrature points (zeros included), and
        whether any rank has a negative one (a signed density; one Allreduce for both); a
        density that is zero everywhere (all mass gone) stops the run."""
        w = self.sources.weights()
        flags = np.array([float(np.any(w != 0)), float(np.any(w < 0))])
        self.comm.Allreduce(MPI.IN_PLACE, flags, op=MPI.MAX)
        if not flags[0]:
            raise SolverBreakdown("the density is zero everywhere: all mass has left the mesh")
        return w, bool(flags[1])

    # ---------------------------------------------------------------- operator
    def rate(self) -> tuple[np.ndarray, float]:
        """M^{-1} R(u; v) (owned coefficients) and this rank's part of the outflow rate
        int (v.n)^+ u ds (its boundary facets; the sum over ranks is the outflow: the
        time integral is linear, so it is summed where it is reported), for the u and v
        set now."""
        self._update_ghosts()
        b = self.load_vector
        with b.localForm() as loc:
            loc.set(0.0)
        dolfinx.fem.petsc.assemble_vector(b, self.residual_form)
        ghost_update_add(b, meter=self.meter)
        self._solve_mass(b, self.solution)
        return self.solution.array_r.copy(), float(dolfinx.fem.assemble_scalar(self.outflow_form))

    def rate_vjp(self, rate_bar: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Reverse mode of rate(): for the cotangent of M^{-1} R(u; v) (owned DG
        coefficients), the cotangents of u (owned DG coefficients) and of v (owned
        velocity nodes, (n, d)), at the u and v set now:
        z = M^{-1} rate_bar, u_bar = (dR/du)^T z, v_bar = (dR/dv)^T z."""
        if self._adjoint_forms is None:  # compiled on first use: forward runs never need them
            J = self._residual(self.z)
            forms = (dolfinx.fem.form(ufl.derivative(J, self.u, ufl.TestFunction(self.V))),
                     dolfinx.fem.form(ufl.derivative(J, self.v, ufl.TestFunction(self.W))))
            self._adjoint_forms = [(f, dolfinx.fem.petsc.create_vector(f)) for f in forms]
        self._update_ghosts()
        b = self.load_vector
        b.array_w[:] = rate_bar
        self._solve_mass(b, self.solution)
        self.z.x.array[:self.n_owned] = self.solution.array_r
        scatter_forward(self.z, self.comm)
        for form, vec in self._adjoint_forms:
            with vec.localForm() as loc:
                loc.set(0.0)
            dolfinx.fem.petsc.assemble_vector(vec, form)
        vecs = [vec for _, vec in self._adjoint_forms]
        ghost_update_add(*vecs, meter=self.meter)                  # both at once: one exchange
        return vecs[0].array_r.copy(), vecs[1].array_r.copy().reshape(-1, self.d)

    def project(self, rho0, quadrature_degree: int) -> tuple[np.ndarray, float]:
        """L2 projection of a UFL density (of x = SpatialCoordinate) onto DG-k:
        owned coefficients and the projected mass int_Omega rho0. ``rho0`` may also be a
        sum of parts (:class:`pdeformer.model.prompts.DensityParts`: its ``expression``,
        ``count`` and ``load(i)``), whose load vectors one form assembles in turn."""
        w = ufl.TestFunction(self.V)
        dx = ufl.dx(metadata={"quadrature_degree": quadrature_degree})
        parts = rho0 if hasattr(rho0, "load") else None
        form = dolfinx.fem.form((rho0.expression if parts else rho0) * w * dx)
        b = dolfinx.fem.petsc.create_vector(form)
        with b.localForm() as local:
            local.set(0.0)
        for i in range(parts.count if parts else 1):
            if parts:
                parts.load(i)
            dolfinx.fem.petsc.assemble_vector(b, form)    # adds to b
        ghost_update_add(b, meter=self.meter)
        x = b.duplicate()
        self._solve_mass(b, x)
        mass = self.comm.allreduce(float(b.array_r.sum()), op=MPI.SUM)
        coeffs = x.array_r.copy()
        b.destroy()
        x.destroy()
        return coeffs, mass

    def _solve_mass(self, b, x) -> None:
        self.ksp.solve(b, x)
        reason = self.ksp.getConvergedReason()
        if reason < 0:
            cause = "check the [petsc] options" if self.petsc_options else \
                "its cell blocks are singular (degenerate cells in the mesh?)"
            raise SolverBreakdown(f"the DG mass solve failed (PETSc KSP reason {reason}); {cause}")

    def constant(self, value):
        """A dolfinx Constant on the mesh (a form using it compiles once for all values)."""
        return dolfinx.fem.Constant(self.mesh, np.asarray(value, dtype=PETSc.ScalarType))

    def interpolant(self, density, degree: int):
        """A DG-``degree`` interpolant of a numpy density(x (N,d)), as a UFL coefficient."""
        space = dfx.function_space(self.mesh, "DG", degree)
        f = dolfinx.fem.Function(space)
        d = self.d
        f.interpolate(lambda x: density(x[:d].T))
        return f

    # ---------------------------------------------------------------- limiter, CFL
    def cell_minima(self, coeffs: np.ndarray, where: bool = False):
        """min of rho over each owned cell's check points: its vertices, attention sources
        and facet flux points, then its Lagrange nodes (where the coefficients are the
        values). With ``where`` also the index of the point of the minimum in that order."""
        self.set_state(coeffs, ghosts=False)
        vals = np.hstack([dfx.evaluate(self._check_expr, self.mesh, self.sources.cells),
                          self.u.x.array[self.cell_dofs]])
        low = vals.min(axis=1) if vals.shape[0] else np.zeros(0)
        return (low, vals.argmin(axis=1) if vals.shape[0] else np.zeros(0, int)) if where else low

    def limit(self, coeffs: np.ndarray, record: list | None = None) -> np.ndarray:
        """Scale each cell's deviation from its mean so that rho >= 0 at its check points
        (see cell_minima); cell means, hence mass, are unchanged:
        c_i <- m_K + theta_K (c_i - m_K), theta_K = min(1, m_K / (m_K - min_K)).
        A cell whose mean is negative (a step past the positivity CFL) is flattened to its
        mean (theta = 0): mass is kept, the rest of the run sees its negative mass.

        With ``record`` (a list) appends what :meth:`limit_vjp` needs: None if no cell
        was limited, else a :class:`LimitedCells`."""
        if record is not None and self._check_basis is None:
            # compiled here, on every rank (a JIT compilation is collective): a rank whose
            # cells need no limiting yet must not leave the others waiting in it
            self._check_basis = dfx.expression(ufl.TestFunction(self.V), self._check_points)
        low, arg = self.cell_minima(coeffs, where=True)
        c = self.u.x.array
        bad = low < 0.0
        if not np.any(bad):
            if record is not None:
                record.append(None)
            return coeffs
        dofs = self.cell_dofs[bad]
        mean = np.einsum("ki,ki->k", self.mean_weights[bad], c[dofs])
        with np.errstate(divide="ignore", invalid="ignore"):
            theta = np.where(mean > 0, np.minimum(1.0, mean / (mean - low[bad])), 0.0)
        dev = c[dofs] - mean[:, None]
        out = coeffs.copy()
        out[dofs] = mean[:, None] + theta[:, None] * dev
        if record is not None:
            cells = np.flatnonzero(bad)
            record.append(LimitedCells(cells, theta, mean, low[bad], dev,
                                       self._minimum_gradient(cells, arg[bad])))
        return out

    def _minimum_gradient(self, cells: np.ndarray, points: np.ndarray) -> np.ndarray:
        """d min_K / d c_K: the basis functions of each cell at its minimum's check point
        (``_check_basis``: phi_i at the check points, compiled by :meth:`limit`; a row per
        cell; a unit vector where the minimum is a Lagrange node)."""
        n = self.cell_dofs.shape[1]
        basis = dfx.evaluate(self._check_basis, self.mesh, self.sources.cells[cells])
        basis = basis.reshape(len(cells), -1, n)
        out = np.zeros((len(cells), n))
        at_point = points < basis.shape[1]
        out[at_point] = basis[np.flatnonzero(at_point), points[at_point]]
        nodes = np.flatnonzero(~at_point)
        out[nodes, points[nodes] - basis.shape[1]] = 1.0
        return out

    def limit_vjp(self, limited: "LimitedCells | None", bar: np.ndarray) -> np.ndarray:
        """Cotangent of the limiter's input from that of its output (owned coefficients):
        the transpose of its Jacobian at the recorded state. For a limited cell,
        out_i = (1 - theta) m + theta c_i with m = w . c, theta = m / (m - min) and
        d min = g . dc (g: the basis at the minimum's point), so
        dtheta = (-min dm + m dmin) / (m - min)^2; flattened cells (m <= 0) have
        out_i = m. Exact away from the switching set (min = 0, ties of the minimum)."""
        if limited is None:
            return bar
        L = limited
        dofs = self.cell_dofs[L.cells]
        ob = bar[dofs]
        w = self.mean_weights[L.cells]
        total = ob.sum(axis=1)
        cb = L.theta[:, None] * ob + ((1 - L.theta) * total)[:, None] * w
        active = L.mean > 0
        with np.errstate(divide="ignore", invalid="ignore"):
            g = np.where(active, np.einsum("ki,ki->k", ob, L.dev) / (L.mean - L.low) ** 2, 0.0)
        cb += (g * -L.low)[:, None] * w + (g * L.mean)[:, None] * L.min_gradient
        out = bar.copy()
        out[dofs] = cb
        return out

    def cfl_step(self, cfl: float) -> tuple[float, float]:
        """dt = cfl * min_K l_K / ((2k+1) max_{v-nodes of K} |v|) and max |v|, for the v set now."""
        speed = np.linalg.norm(self.v.x.array.reshape(-1, self.d), axis=1)
        cell_speed = speed[self.velocity_cell_nodes].max(axis=1)
        top = np.array([np.max(cell_speed / self.cell_length) if cell_speed.size else 0.0,
                        speed.max() if speed.size else 0.0])
        self.comm.Allreduce(MPI.IN_PLACE, top, op=MPI.MAX)
        rate, vmax = float(top[0]), float(top[1])
        dt = np.inf if rate == 0 else cfl / ((2 * self.degree + 1) * rate)
        return dt, vmax

    # ---------------------------------------------------------------- diagnostics
    def moments(self, coeffs: np.ndarray, centre: np.ndarray) -> tuple[float, np.ndarray, np.ndarray]:
        """Mass, mean and covariance of the normalised density, by a quadrature exact for
        rho * polynomials of degree 2 on affine cells."""
        s = self.summary(coeffs, centre)
        return s["mass"], s["mean"], s["cov"]

    def summary(self, coeffs: np.ndarray, centre: np.ndarray) -> dict:
        """mass = int rho, negative_mass ~ int max(0, -rho) (the same points with the
        weights' magnitudes: some rules on tetrahedra have negative weights), mean and
        covariance of rho / mass: one Allreduce."""
        self.set_state(coeffs, ghosts=False)
        rule = self.moment_rule
        values = rule.values()
        w = values * rule.measure
        negative = np.abs(rule.measure) @ np.maximum(0.0, -values)
        mass, m1, m2, (neg,) = moment_sums(self.comm, w, rule.points - centre, [negative])
        with np.errstate(divide="ignore", invalid="ignore"):
            first = m1 / mass
            cov = m2 / mass - np.outer(first, first)
        return {"mass": float(mass), "negative_mass": float(neg), "mean": centre + first, "cov": cov}

    def order_parameter(self, coeffs: np.ndarray, geometry) -> dict:
        """What the tokens' geometry adds to the density's moments, by the moments'
        quadrature (:meth:`pdeformer.model.geometry.Geometry.order_parameter`: on a circle
        or sphere the order parameter and Fourier amplitudes; empty on a flat mesh)."""
        self.set_state(coeffs, ghosts=False)
        rule = self.moment_rule
        return geometry.order_parameter(rule.points, rule.values() * rule.measure, self.comm)

    def min_value(self, coeffs: np.ndarray) -> float:
        """min rho over all check points of all cells (see cell_minima)."""
        low = self.cell_minima(coeffs)
        return self.comm.allreduce(float(low.min()) if low.size else np.inf, op=MPI.MIN)


def l2_norm(comm, expr, quadrature_degree: int) -> float:
    """sqrt(int_Omega expr^2) for a UFL expression (e.g. rho_h - rho_exact)."""
    dx = ufl.dx(metadata={"quadrature_degree": quadrature_degree})
    local = dolfinx.fem.assemble_scalar(dolfinx.fem.form(expr * expr * dx))
    return float(np.sqrt(comm.allreduce(local, op=MPI.SUM)))
