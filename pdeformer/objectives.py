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
  quadrature points) or a target point cloud.

Pure numpy (plus MPI reductions): testable without dolfinx.
"""

from __future__ import annotations

import math

import numpy as np
from mpi4py import MPI

from .errors import ConfigError
from .parallel import allgather_rows

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


def _sum(comm, local):
    """Allreduce a scalar or array sum."""
    local = np.asarray(local, dtype=float)
    out = np.empty_like(local)
    comm.Allreduce(local, out, op=MPI.SUM)
    return out


class Potential:
    kind = "potential"
    needs_target = False

    def __init__(self, potential: str, center, weight: float, direction=None, width: float = 1.0):
        self.potential = potential
        self.center = np.asarray(center, float)
        self.weight = float(weight)
        self.direction = None if direction is None else np.asarray(direction, float)
        self.width = float(width)

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


class Moments:
    """Mean and covariance of the normalised density against a target (mean, cov)."""

    kind = "moments"
    needs_target = True

    def value_and_gradient(self, points, measure, rho, target, comm):
        mstar, Cstar = target["mean"], target["cov"]
        y = points - mstar                      # about the target mean: no cancellation
        d = y.shape[1]
        w = measure * rho
        tot = _sum(comm, np.concatenate([[w.sum()], w @ y, np.einsum("q,qi,qj->ij", w, y, y).ravel()]))
        m0, m1, m2 = tot[0], tot[1:1 + d], tot[1 + d:].reshape(d, d)
        mean = m1 / m0                          # mean - m*
        G = m2 / m0 - np.outer(mean, mean) - Cstar
        F = 0.5 * mean @ mean + 0.5 * np.sum(G * G)
        a = mean - 2 * G @ mean
        dF = measure * ((y - mean) @ a / m0
                        + (np.einsum("qi,ij,qj->q", y, G, y) - np.sum(G * m2) / m0) / m0)
        return float(F), dF

    def particle_value_and_gradient(self, x, w, target, comm):
        """Weighted moments of tokens: dF/dx_i = w_i/W [(mean - m*) + 2 G (x_i - mean)]."""
        F, _ = self.value_and_gradient(x, w, np.ones(len(w)), target, comm)
        y = x - target["mean"]
        d = y.shape[1]
        tot = _sum(comm, np.concatenate([[w.sum()], w @ y, np.einsum("q,qi,qj->ij", w, y, y).ravel()]))
        W, mean = tot[0], tot[1:1 + d] / tot[0]
        G = tot[1 + d:].reshape(d, d) / W - np.outer(mean, mean) - target["cov"]
        return F, (w / W)[:, None] * (mean + 2 * (y - mean) @ G)


class L2:
    kind = "l2"
    needs_target = True

    def value_and_gradient(self, points, measure, rho, target, comm):
        diff = rho - target["density"].density(points)
        return float(_sum(comm, 0.5 * measure @ (diff * diff))), measure * diff


class MMD:
    """1/2 MMD^2 with a Gaussian kernel; the kernel sums run over all ranks' points
    (gathered) in row chunks of about ``chunk_mb`` megabytes."""

    kind = "mmd"
    needs_target = True

    def __init__(self, bandwidth: float, chunk_mb: float = 8.0):
        self.bandwidth = float(bandwidth)
        self.chunk_mb = chunk_mb
        self._self_term = {}  # target id -> 1/2 b^T K b (fixed)

    def kernel_apply(self, x: np.ndarray, y: np.ndarray, c: np.ndarray) -> np.ndarray:
        """(K c)_i = sum_j k(x_i, y_j) c_j."""
        out = np.empty(x.shape[0])
        rows = max(1, int(self.chunk_mb * 2**20 / (8 * max(len(y), 1))))
        y2 = np.sum(y * y, axis=1)
        s = -0.5 / self.bandwidth**2
        for i0 in range(0, x.shape[0], rows):
            xi = x[i0:i0 + rows]
            D = np.sum(xi * xi, axis=1)[:, None] + y2[None, :] - 2 * xi @ y.T
            np.maximum(D, 0, out=D)
            out[i0:i0 + rows] = np.exp(s * D) @ c
        return out

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
        F, _ = self._particle_terms(x, w, z, b, comm)
        return F, self._particle_gradient(x, w, z, b, comm)

    def _particle_terms(self, x, w, z, b, comm):
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
        out = np.zeros_like(x)
        s = 1.0 / self.bandwidth**2
        for ys, cs, sign in ((all_x, all_w, 1.0), (z, b, -1.0)):
            Kc = self.kernel_apply(x, ys, cs)                    # sum_j k c_j
            Kcy = np.stack([self.kernel_apply(x, ys, cs * ys[:, a]) for a in range(x.shape[1])], 1)
            out += sign * (-s) * (x * Kc[:, None] - Kcy)
        return w[:, None] * out

    @staticmethod
    def _my_rows(comm, n):
        per = -(-n // comm.size)
        return slice(comm.rank * per, min(n, (comm.rank + 1) * per))


def make_objective(cfg: dict):
    """The objective of a checked ``[objective]`` table (None when absent)."""
    if cfg is None or cfg.get("kind") is None:
        return None
    kind = cfg["kind"]
    if kind == "potential":
        return Potential(cfg["potential"], cfg["center"], cfg["weight"], cfg.get("direction"),
                         cfg.get("width", 1.0))
    if kind == "moments":
        return Moments()
    if kind == "l2":
        return L2()
    return MMD(cfg["bandwidth"])


def default_quadrature_degree(kind: str, degree: int) -> int:
    """Quadrature of rho_1 per objective: exact for rho * quadratics (potential, moments),
    for rho^2 plus a smooth target's share (l2); mmd sums kernels over all points, so it
    takes the fewest points that integrate rho itself exactly."""
    return {"potential": degree + 2, "moments": degree + 2, "l2": 2 * degree + 2,
            "mmd": degree + 1}[kind]


def make_target(spec: dict | None, d: int, index: int):
    """The target of ``prompts[index]`` for dimension d: {"kind": "moments", "mean", "cov"},
    {"kind": <density kind>, "density"} or {"kind": "points", "points", "weights"}."""
    from .errors import ConfigError
    from .prompts import _rectangular, _spd, make_prompt
    if spec is None:
        return None
    key = f"prompts[{index}].target"
    kind = spec["kind"]
    if kind == "moments":
        mean = np.asarray(spec["mean"], float) if _rectangular(spec["mean"]) else None
        if mean is None or mean.shape != (d,):
            raise ConfigError(f"{key}.mean", f"expected {d} numbers (d = {d}), got {spec['mean']!r}")
        cov = spec["cov"]
        if d == 1 and isinstance(cov, list) and len(cov) == 1 and isinstance(cov[0], float):
            cov = cov[0]
        return {"kind": kind, "mean": mean, "cov": _spd(f"{key}.cov", cov, d)}
    if kind == "points":
        cloud = make_prompt(spec, d, index, key)
        return {"kind": kind, "points": cloud.points, "weights": cloud.weights}
    return {"kind": kind, "density": make_prompt(spec, d, index, key)}
