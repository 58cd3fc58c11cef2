r"""Objectives F_s(rho_1) of the risk R = (1/S) sum_s F_s(rho_1^s) (design §2).

Each objective sees rho_1 through a quadrature on the rank's own cells -- points y_q,
measure omega_q, values rho_q -- and returns F (the same on every rank) and its
derivative dF/drho_q at the rank's own points, from which the adjoint starts.

* ``potential``: F = int U rho, U a named potential (``quadratic``: weight/2 |x - center|^2,
  ``linear``: <direction, x>, ``gaussian``: -weight exp(-|x - center|^2 / (2 width^2)));
* ``moments``: F = 1/2 |mean - m*|^2 + 1/2 ||cov - C*||_F^2 (moments of rho/int rho);
* ``l2``: F = 1/2 int (rho - rho*)^2;
* ``mmd``: F = 1/2 MMD^2 = 1/2 iint k d(rho - rho*) d(rho - rho*), Gaussian kernel
  k(x, y) = exp(-|x - y|^2 / (2 bandwidth^2)), against a target density (on the same
  quadrature points) or a target point cloud;
* ``interaction``: F = 1/2 iint W(x - y) drho(x) drho(y), the interaction energy of a
  Gaussian W = weight exp(-|r|^2 / (2 width^2)) or a softened Coulomb-like
  W = weight / sqrt(|r|^2 + softening^2) (no target).

Each objective is a class registered by its ``kind`` (:func:`register`) that declares
its ``[objective]`` keys (``keys``) and the targets it compares with: the config's
``objective.kind`` accepts it, :func:`objective_keys` makes the ``[objective]`` table of
the registered classes' keys and :func:`make_objective` builds it, so a new objective is
a class here. Pure numpy (plus MPI reductions): testable without dolfinx.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from ..tools.errors import ConfigError
from ..tools.keys import REQUIRED, Key, array, array_or_number, integer, merge_keys, number, number_list, string
from ..tools.parallel import allgather_rows, moment_sums

POTENTIALS = ("quadratic", "linear", "gaussian")

# The mmd kernel k(x, y) = exp(-|x - y|^2 / (2 bw^2)) in double precision:
# * bw^2 and 1/bw^2 must be finite doubles with room for squared distances: bw in
#   [1e-150, 1e150] whatever the mesh;
# * below 4.9e-324 exp underflows to 0, i.e. once |x - y| > sqrt(2 ln(1/4.9e-324)) bw
#   = 38.6 bw: a bandwidth below (shortest cell edge) / 38.6 makes the kernel 0 between
#   points one cell apart, and the MMD compares each cell with itself alone;
# * exp(-t) differs from 1 by at most 2^-53 (one rounding unit) for t <= 2^-53, i.e. for
#   every |x - y| <= diameter once bw >= diameter x 2^26 (6.7e7 diameters): the kernel is
#   1 on the whole mesh, and the MMD sees the total masses alone.
BANDWIDTH_LIMITS = (1e-150, 1e150)
KERNEL_REACH = math.sqrt(-2 * math.log(5e-324))         # 38.6 bandwidths
KERNEL_FLAT = 2.0**26                                   # diameters


def check_bandwidth(bandwidth: float, diameter: float | None = None, cell: float | None = None,
                    key: str = "objective.bandwidth") -> None:
    """ConfigError naming ``key`` where the mmd kernel is degenerate in double precision
    (see BANDWIDTH_LIMITS): out of [1e-150, 1e150]; with the mesh's ``diameter`` (of its
    bounding box) and ``cell`` (shortest cell edge), 0 between points one cell apart or 1
    across the whole mesh."""
    lo, hi = BANDWIDTH_LIMITS
    if not lo <= bandwidth <= hi:
        raise ConfigError(key, f"{bandwidth:g} is out of [{lo:g}, {hi:g}]: the Gaussian kernel's "
                               "1/bandwidth^2 must be a finite double")
    if cell is not None and bandwidth < cell / KERNEL_REACH:
        raise ConfigError(key, f"{bandwidth:g} is below {cell / KERNEL_REACH:.3g} = (cell size "
                               f"{cell:.3g}) / {KERNEL_REACH:.1f}: the kernel underflows to 0 "
                               "between points one cell apart, so the MMD would compare each "
                               "cell with itself alone; widen it or refine the mesh")
    if diameter is not None and bandwidth > diameter * KERNEL_FLAT:
        raise ConfigError(key, f"{bandwidth:g} is above {diameter * KERNEL_FLAT:.3g} = 2^26 x (mesh "
                               f"diameter {diameter:.3g}): the kernel is 1 to within one rounding unit "
                               "across the whole mesh, so the MMD would see the total masses alone")


OBJECTIVES: dict[str, type] = {}


def register(cls):
    """Make an objective class known by its ``kind`` (the config and make_objective read
    this registry)."""
    OBJECTIVES[cls.kind] = cls
    return cls


def objective_keys() -> dict[str, Key]:
    """The ``[objective]`` table: ``kind`` (a registered objective), the keys the
    registered classes declare (a key two of them read, like ``weight``, is one Key:
    :func:`pdeformer.tools.keys.merge_keys`) and ``quadrature_degree``."""
    return {"kind": Key(string(lambda: tuple(OBJECTIVES)), None,
                        "risk per prompt: a registered objective (pdeformer.model.objectives: potential, ...)"),
            **merge_keys(cls.keys for cls in OBJECTIVES.values()),
            "quadrature_degree": Key(integer(1, 20), None, "quadrature of rho_1 in the objective")}


# [objective] keys that two objectives read
WEIGHT = Key(number(), 1.0, "strength of the quadratic/gaussian potential or of W (interaction)")
WIDTH = Key(number(positive=True), 1.0, "width of the gaussian potential or W (interaction)")


class Objective:
    """F(rho_1) of one prompt: ``value_and_gradient`` on the rank's quadrature points
    (F on every rank, dF/drho_q at its own points) and, where tokens can be compared,
    ``particle_value_and_gradient`` on weighted tokens (F, dF/dx_i).

    Class attributes: ``kind`` (the config's name), ``keys`` (its ``[objective]`` keys
    beside ``kind`` and ``quadrature_degree``), ``targets`` (the sorts of target it
    compares with: "moments" (a mean and a covariance), "density" or "points", the sort
    each prompt kind declares, :class:`pdeformer.model.prompts.PromptKind`; empty: it
    needs none), ``adjoint_knob`` (the setting that scales F, named when an adjoint
    overflows from F's own size), ``checks_mesh`` (whether :meth:`check_mesh` has
    something to check)."""

    kind = ""
    keys: dict[str, Key] = {}
    targets: tuple = ()
    adjoint_knob = "the objective's target"
    checks_mesh = False
    own_keys: tuple = ()   # [objective] keys only this kind reads: they are left out of
                           # other kinds' checkpoint fingerprints (they change nothing there)

    @classmethod
    def from_config(cls, opts, d: int) -> "Objective":
        """The objective of the ``[objective]`` options (pdeformer.model.schema.SECTIONS) for tokens in R^d."""
        return cls()

    @classmethod
    def check_config(cls, cfg: dict, mesh: dict) -> None:
        """ConfigError for settings that are wrong whatever the mesh (``mesh``: the
        config's [mesh] table, for built-in boxes whose size is known already)."""

    def check_mesh(self, diameter: float, cell: float) -> None:
        """ConfigError for settings that are wrong on this mesh (its bounding box's
        diameter and shortest edge)."""

    @staticmethod
    def quadrature_degree(degree: int) -> int:
        """Quadrature of rho_1 for DG degree k: exact for rho times quadratics."""
        return degree + 2


def _sum(comm, local):
    """Allreduce a scalar or array sum."""
    local = np.asarray(local, dtype=float)
    out = np.empty_like(local)
    comm.Allreduce(local, out, op=MPI.SUM)
    return out


@register
class Potential(Objective):
    kind = "potential"
    keys = {
        "potential": Key(string(POTENTIALS), "quadratic", "named potential U"),
        "center": Key(number_list(), None, "centre of the quadratic/gaussian potential (default 0)"),
        "weight": WEIGHT,
        "direction": Key(number_list(), None, "direction of the linear potential"),
        "width": WIDTH,
    }
    adjoint_knob = "objective.weight"

    def __init__(self, potential: str, center, weight: float, direction=None, width: float = 1.0):
        self.potential = potential
        self.center = np.asarray(center, float)
        self.weight = float(weight)
        self.direction = None if direction is None else np.asarray(direction, float)
        self.width = float(width)

    @classmethod
    def from_config(cls, opts, d: int) -> "Potential":
        center = opts.center if opts.center is not None else np.zeros(d)
        return cls(opts.potential, center, opts.weight, opts.direction, opts.width)

    @classmethod
    def check_config(cls, cfg: dict, mesh: dict) -> None:
        if cfg["potential"] == "linear" and cfg["direction"] is None:
            raise ConfigError("objective.direction", "missing (needed by potential = 'linear')")

    def U(self, x: np.ndarray) -> np.ndarray:
        if self.potential == "linear":
            return x @ self.direction
        r2 = np.sum((x - self.center) ** 2, axis=1)
        if self.potential == "quadratic":
            return 0.5 * self.weight * r2
        return -self.weight * np.exp(-r2 / (2 * self.width**2))

    def value_and_gradient(self, points, measure, rho, target, comm):
        with np.errstate(over="ignore", invalid="ignore"):   # overflow: _check names it
            U = self.U(points)
            dF = measure * U
            F, bad = _sum(comm, [dF @ rho, np.count_nonzero(~np.isfinite(U))])
        self._check(F, bad)
        return float(F), dF

    def _check(self, F: float, bad: float) -> None:
        """ConfigError naming the setting that scales U where U (or F = int U rho) is not
        finite (the same on every rank: both are all-reduced)."""
        if bad == 0 and np.isfinite(F):
            return
        key = "objective.direction" if self.potential == "linear" else "objective.weight"
        value = np.abs(self.direction).max() if self.potential == "linear" else abs(self.weight)
        raise ConfigError(key, f"{value:g} is too large: the {self.potential} potential overflows "
                               f"double precision (the risk at t = 1 is {F:g})")

    def grad_U(self, x: np.ndarray) -> np.ndarray:
        if self.potential == "linear":
            return np.broadcast_to(self.direction, x.shape).copy()
        r = x - self.center
        if self.potential == "quadratic":
            return self.weight * r
        return self.weight * np.exp(-np.sum(r * r, axis=1) / (2 * self.width**2))[:, None] * r / self.width**2

    def particle_value_and_gradient(self, x, w, target, comm):
        """F = sum_i w_i U(x_i) and dF/dx_i for weighted tokens."""
        with np.errstate(over="ignore", invalid="ignore"):   # overflow: _check names it
            U, dU = self.U(x), self.grad_U(x)
            F, bad = _sum(comm, [w @ U, np.count_nonzero(~np.isfinite(U)) + np.count_nonzero(~np.isfinite(dU))])
        self._check(F, bad)
        return float(F), w[:, None] * dU


# A moments target: a prompt's ``target = { mean = [...], cov = [...] }`` (no kind)
MOMENTS_TARGET_KEYS = {
    "mean": Key(array, REQUIRED, "target mean (a d-vector)"),
    "cov": Key(array_or_number, REQUIRED, "target covariance (d x d, or a variance)"),
}


@register
class Moments(Objective):
    """Mean and covariance of the normalised density against a target (mean, cov:
    MOMENTS_TARGET_KEYS)."""

    kind = "moments"
    targets = ("moments",)

    @staticmethod
    def _fit(comm, w, y, Cstar):
        """Sums about the target mean (no cancellation), mean - m*, G = cov - C* and F."""
        m0, m1, m2, _ = moment_sums(comm, w, y)
        mean = m1 / m0                          # mean - m*
        G = m2 / m0 - np.outer(mean, mean) - Cstar
        return m0, m2, mean, G, 0.5 * mean @ mean + 0.5 * np.sum(G * G)

    def value_and_gradient(self, points, measure, rho, target, comm):
        y = points - target["mean"]
        m0, m2, mean, G, F = self._fit(comm, measure * rho, y, target["cov"])
        a = mean - 2 * G @ mean
        dF = measure * ((y - mean) @ a / m0
                        + (np.einsum("qi,ij,qj->q", y, G, y) - np.sum(G * m2) / m0) / m0)
        return float(F), dF

    @staticmethod
    def output_names(d: int) -> list[str]:
        """The model's outputs for one prompt (:meth:`outputs`): mean_i, cov_ii, and
        sqrt(2) cov_ij for i < j."""
        return [f"mean{i}" for i in range(d)] + [f"cov{i}{i}" for i in range(d)] + \
            [f"sqrt2*cov{i}{j}" for i in range(d) for j in range(i + 1, d)]

    @staticmethod
    def target_outputs(target: dict) -> np.ndarray:
        """y* of a moments target: F = 1/2 |y - y*|^2 (the sqrt(2) on the off-diagonal
        entries makes this the Frobenius norm of cov - C*)."""
        return _moment_vector(np.asarray(target["mean"], float), np.asarray(target["cov"], float))

    def outputs(self, points, measure, rho, comm) -> tuple[np.ndarray, np.ndarray]:
        """y = (mean, cov_ii, sqrt(2) cov_ij (i < j)) of rho/int rho (the same on every
        rank) and dy/drho_q (m, Q) at this rank's quadrature points, so that the moments
        objective is F = 1/2 |y - y*|^2 and dF/drho = (y - y*)^T dy/drho."""
        w = measure * rho
        m0, m1, m2, _ = moment_sums(comm, w, points)
        centre = m1 / m0                         # sums about the mean: no cancellation
        y = points - centre
        m0, m1, m2, _ = moment_sums(comm, w, y)
        mean = m1 / m0
        cov = m2 / m0 - np.outer(mean, mean)
        r = y - mean                             # d mean_i / d rho_q = omega_q r_qi / m0
        dmean = (measure[:, None] * r / m0).T
        # d cov_ij / d rho_q = omega_q (r_qi r_qj - cov_ij) / m0 (the mean's variation included)
        d = points.shape[1]
        dcov = measure[None, None, :] * (np.einsum("qi,qj->ijq", r, r) - cov[:, :, None]) / m0
        iu = np.triu_indices(d, 1)
        dy = np.concatenate([dmean, dcov[np.arange(d), np.arange(d)], np.sqrt(2) * dcov[iu]])
        return _moment_vector(mean + centre, cov), dy

    def particle_value_and_gradient(self, x, w, target, comm):
        """Weighted moments of tokens: dF/dx_i = w_i/W [(mean - m*) + 2 G (x_i - mean)]."""
        y = x - target["mean"]
        W, _, mean, G, F = self._fit(comm, w, y, target["cov"])
        return float(F), (w / W)[:, None] * (mean + 2 * (y - mean) @ G)


def _moment_vector(mean: np.ndarray, cov: np.ndarray) -> np.ndarray:
    """(mean, cov_ii, sqrt(2) cov_ij for i < j): |y - y*|^2 = |mean - m*|^2 + ||cov - C*||_F^2."""
    iu = np.triu_indices(len(mean), 1)
    return np.concatenate([mean, np.diag(cov), np.sqrt(2) * cov[iu]])


@register
class L2(Objective):
    kind = "l2"
    targets = ("density",)

    @staticmethod
    def quadrature_degree(degree: int) -> int:
        """Exact for rho^2 plus a smooth target's share."""
        return 2 * degree + 2

    def value_and_gradient(self, points, measure, rho, target, comm):
        diff = rho - target["density"].density(points)
        return float(_sum(comm, 0.5 * measure @ (diff * diff))), measure * diff


def _kernel_products(x: np.ndarray, y: np.ndarray, C: np.ndarray, kernel, chunk_mb: float) -> np.ndarray:
    """sum_j kernel(|x_i - y_j|^2) C[j, :] for every x_i (C: (M, k)), the kernel evaluated
    once per chunk of about ``chunk_mb`` megabytes of rows; x and y already centred."""
    out = np.empty((x.shape[0], C.shape[1]))
    rows = max(1, int(chunk_mb * 2**20 / (8 * max(len(y), 1))))
    y2 = np.sum(y * y, axis=1)
    for i0 in range(0, x.shape[0], rows):
        xi = x[i0:i0 + rows]
        D = np.sum(xi * xi, axis=1)[:, None] + y2[None, :] - 2 * xi @ y.T
        np.maximum(D, 0, out=D)
        out[i0:i0 + rows] = kernel(D) @ C
    return out


def _centred(x: np.ndarray, y: np.ndarray):
    """x and y about the mean of y: the distances |x|^2 + |y|^2 - 2<x, y> then do not
    cancel for points far from the origin."""
    if not len(y):
        return x, y
    centre = y.mean(axis=0)
    return x - centre, y - centre


def pair_sums(x: np.ndarray, y: np.ndarray, c: np.ndarray, kernel, chunk_mb: float = 8.0) -> np.ndarray:
    """sum_j kernel(|x_i - y_j|^2) c_j for every x_i, in row chunks of about ``chunk_mb``
    megabytes (``kernel`` maps an array of squared distances to kernel values)."""
    x, y = _centred(x, y)
    return _kernel_products(x, y, c[:, None], kernel, chunk_mb)[:, 0]


def pair_gradients(x: np.ndarray, y: np.ndarray, c: np.ndarray, slope, chunk_mb: float = 8.0) -> np.ndarray:
    """sum_j grad W(x_i - y_j) c_j for a radial W with grad W(r) = slope(|r|^2) r:
    x_i sum_j s_ij c_j - sum_j s_ij c_j y_j (one kernel evaluation for both sums)."""
    x, y = _centred(x, y)
    s = _kernel_products(x, y, np.column_stack([c, c[:, None] * y]), slope, chunk_mb)
    return x * s[:, :1] - s[:, 1:]


@register
class MMD(Objective):
    """1/2 MMD^2 with a Gaussian kernel; the kernel sums run over all ranks' points
    (gathered) in row chunks of about ``chunk_mb`` megabytes."""

    kind = "mmd"
    keys = {"bandwidth": Key(number(positive=True), None, "Gaussian kernel bandwidth of mmd")}
    targets = ("density", "points")
    checks_mesh = True

    def __init__(self, bandwidth: float, chunk_mb: float = 8.0):
        self.bandwidth = float(bandwidth)
        self.chunk_mb = chunk_mb
        self._self_term = {}  # target id -> 1/2 b^T K b (fixed)

    @classmethod
    def from_config(cls, opts, d: int) -> "MMD":
        return cls(opts.bandwidth)

    @classmethod
    def check_config(cls, cfg: dict, mesh: dict) -> None:
        if cfg["bandwidth"] is None:
            raise ConfigError("objective.bandwidth", "missing (needed by kind = 'mmd')")
        check_bandwidth(cfg["bandwidth"])
        if mesh["file"] is None and mesh["shape"] == "box":   # its size and cells are known now
            lo, hi = mesh["lower"], mesh["upper"]
            check_bandwidth(cfg["bandwidth"], math.dist(lo, hi),
                            min((b - a) / n for a, b, n in zip(lo, hi, mesh["cells"])))

    def check_mesh(self, diameter: float, cell: float) -> None:
        check_bandwidth(self.bandwidth, diameter, cell)

    @staticmethod
    def quadrature_degree(degree: int) -> int:
        """The kernel sums run over all points: the fewest that integrate rho exactly."""
        return degree + 1

    def kernel_apply(self, x: np.ndarray, y: np.ndarray, c: np.ndarray) -> np.ndarray:
        """(K c)_i = sum_j k(x_i, y_j) c_j."""
        s = -0.5 / self.bandwidth**2
        return pair_sums(x, y, c, lambda D: np.exp(s * D), self.chunk_mb)

    def target_measure(self, target, all_points, all_measure):
        if target["kind"] == "points":
            return target["points"], target["weights"]
        dens = target["density"]
        return all_points, all_measure * dens.density(all_points)

    def value_and_gradient(self, points, measure, rho, target, comm):
        a_local = measure * rho
        all_points = allgather_rows(comm, points)
        a = allgather_rows(comm, a_local)
        z, b = self.target_measure(target, all_points, allgather_rows(comm, measure))
        Ka = self.kernel_apply(points, all_points, a)
        Kb = self.kernel_apply(points, z, b)
        key = id(target)
        if key not in self._self_term:
            bKb = float(_sum(comm, b[self._my_rows(comm, len(b))] @
                             self.kernel_apply(z[self._my_rows(comm, len(b))], z, b)))
            self._self_term[key] = 0.5 * bKb
        F = float(_sum(comm, 0.5 * a_local @ Ka - a_local @ Kb)) + self._self_term[key]
        return F, measure * (Ka - Kb)

    def particle_value_and_gradient(self, x, w, target, comm):
        """1/2 MMD^2 between weighted tokens and the target (its point cloud, or tokens
        sampled from a target density: ``target["samples"]``), and dF/dx_i."""
        z, b = (target["points"], target["weights"]) if target["kind"] == "points" else target["samples"]
        F, _ = self.particle_terms(x, w, z, b, comm)
        return F, self._particle_gradient(x, w, z, b, comm)

    def particle_terms(self, x, w, z, b, comm):
        all_x, all_w = allgather_rows(comm, x), allgather_rows(comm, w)
        Kw, Kb = self.kernel_apply(x, all_x, all_w), self.kernel_apply(x, z, b)
        key = ("points", id(z))
        if key not in self._self_term:
            rows = self._my_rows(comm, len(b))
            self._self_term[key] = 0.5 * float(_sum(comm, b[rows] @ self.kernel_apply(z[rows], z, b)))
        return float(_sum(comm, 0.5 * w @ Kw - w @ Kb)) + self._self_term[key], (all_x, all_w)

    def _particle_gradient(self, x, w, z, b, comm):
        """dF/dx_i = w_i [sum_j w_j grad_1 k(x_i, x_j) - sum_t b_t grad_1 k(x_i, z_t)],
        grad_1 k(x, y) = -k(x, y) (x - y) / bandwidth^2."""
        all_x, all_w = allgather_rows(comm, x), allgather_rows(comm, w)
        s = 1.0 / self.bandwidth**2
        slope = lambda D: -s * np.exp(-0.5 * s * D)   # noqa: E731
        out = (pair_gradients(x, all_x, all_w, slope, self.chunk_mb)
               - pair_gradients(x, z, b, slope, self.chunk_mb))
        return w[:, None] * out

    @staticmethod
    def _my_rows(comm, n):
        per = -(-n // comm.size)
        return slice(comm.rank * per, min(n, (comm.rank + 1) * per))


@register
class Interaction(Objective):
    r"""The interaction energy F = 1/2 iint W(x - y) drho(x) drho(y) of a radial W:
    ``interaction = "gaussian"``, W(r) = weight exp(-|r|^2 / (2 width^2)), or
    ``"coulomb"``, the softened W(r) = weight / sqrt(|r|^2 + softening^2). W is symmetric,
    so dF/drho(y) = (W * rho)(y) and, for tokens, dF/dx_i = w_i sum_j w_j grad W(x_i - x_j).
    The pair sums run over all ranks' points (gathered), like mmd's."""

    kind = "interaction"
    keys = {
        "weight": WEIGHT,
        "width": WIDTH,
        "interaction": Key(string(("gaussian", "coulomb")), "gaussian",
                           "interaction W: weight exp(-|r|^2/(2 width^2)) or weight/sqrt(|r|^2 + softening^2)"),
        "softening": Key(number(positive=True), 0.1, "softening of the coulomb interaction"),
    }
    adjoint_knob = "objective.weight"
    own_keys = ("interaction", "softening")

    def __init__(self, interaction: str = "gaussian", weight: float = 1.0, width: float = 1.0,
                 softening: float = 0.1, chunk_mb: float = 8.0):
        self.interaction, self.weight = interaction, float(weight)
        self.width, self.softening, self.chunk_mb = float(width), float(softening), chunk_mb

    @classmethod
    def from_config(cls, opts, d: int) -> "Interaction":
        return cls(opts.interaction, opts.weight, opts.width, opts.softening)

    def W(self, r2: np.ndarray) -> np.ndarray:
        """W at squared distances r2."""
        if self.interaction == "gaussian":
            return self.weight * np.exp(-0.5 * r2 / self.width**2)
        return self.weight / np.sqrt(r2 + self.softening**2)

    def slope(self, r2: np.ndarray) -> np.ndarray:
        """s(|r|^2) with grad W(r) = s r."""
        if self.interaction == "gaussian":
            return -self.W(r2) / self.width**2
        return -self.weight * (r2 + self.softening**2) ** -1.5

    def value_and_gradient(self, points, measure, rho, target, comm):
        a_local = measure * rho
        Wa = pair_sums(points, allgather_rows(comm, points), allgather_rows(comm, a_local), self.W,
                       self.chunk_mb)
        return float(_sum(comm, 0.5 * a_local @ Wa)), measure * Wa

    def particle_value_and_gradient(self, x, w, target, comm):
        all_x, all_w = allgather_rows(comm, x), allgather_rows(comm, w)
        F = float(_sum(comm, 0.5 * w @ pair_sums(x, all_x, all_w, self.W, self.chunk_mb)))
        return F, w[:, None] * pair_gradients(x, all_x, all_w, self.slope, self.chunk_mb)


def make_objective(opts, d: int):
    """The objective of the ``[objective]`` options for tokens in R^d (None when absent)."""
    if opts is None or opts.kind is None:
        return None
    return OBJECTIVES[opts.kind].from_config(opts, d)


def default_quadrature_degree(kind: str, degree: int) -> int:
    """Quadrature of rho_1 for an objective of this kind and DG degree k."""
    return OBJECTIVES[kind].quadrature_degree(degree)


def make_target(spec: dict | None, d: int, index: int, geometry=None):
    """The target of ``prompts[index]`` for dimension d: {"kind": "moments", "mean", "cov"},
    {"kind": <density kind>, "density"} or {"kind": "points", "points", "weights"}
    (``geometry``: the tokens' space, :mod:`pdeformer.model.geometry`; default flat)."""
    from ..tools.errors import ConfigError
    from .prompts import is_rectangular, spd_matrix, make_prompt
    if spec is None:
        return None
    key = f"prompts[{index}].target"
    kind = spec["kind"]
    if kind == "moments":
        mean = np.asarray(spec["mean"], float) if is_rectangular(spec["mean"]) else None
        if mean is None or mean.shape != (d,):
            raise ConfigError(f"{key}.mean", f"expected {d} numbers (d = {d}), got {spec['mean']!r}")
        cov = spec["cov"]
        if d == 1 and isinstance(cov, list) and len(cov) == 1 and isinstance(cov[0], float):
            cov = cov[0]
        return {"kind": kind, "mean": mean, "cov": spd_matrix(f"{key}.cov", cov, d)}
    if kind == "points":
        cloud = make_prompt(spec, d, index, key, geometry)
        return {"kind": kind, "points": cloud.points, "weights": cloud.weights}
    return {"kind": kind, "density": make_prompt(spec, d, index, key, geometry)}
