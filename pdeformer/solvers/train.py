r"""Training: the gradient flow of the head measure, one Euler step at a time.

Each particle theta_{l,w} of every block of the model's parameter tree (a head
(Q, K, V) of attention) moves by

    gd:    theta <- theta - lr * L * W * dR/dtheta      (explicit Euler step of the
                                                         conditional-Wasserstein flow,
                                                         mean-field scaling, design §2)
    adam:  Adam on the same scaled gradient L * W * dR/dtheta,

W the block's particles per layer (H heads).

Iteration k computes R and dR/dtheta at theta_k (a row of history.csv) and, for k < steps,
moves to theta_{k+1}. R is the mean of F_s over the training prompts (all but the
``[data] test_fraction`` held out), or over step k's minibatch (``batch_size``: SGD, see
:class:`Batches`); every ``test_every`` steps the risk on all training prompts and on the
held-out ones is added to the row. Regularisation and noise (mean-field Langevin
dynamics of the head measure mu, the flow of R + (lambda/2) int |theta|^2 dmu + T int mu log mu):

    theta <- theta - lr * (L * H * dR/dtheta + lambda * theta) + sqrt(2 lr T) * xi,

lambda = ``weight_decay`` (its penalty P is history.csv's ``penalty``; adam adds dP/dtheta
to the gradient), T = ``temperature`` (gd only), xi ~ N(0, I) seeded by (train.seed, k).
The entropy term of the free energy is not evaluated (it is infinite for the heads'
empirical measure). Checkpoints hold theta, the optimiser state, the next step, the
RNG state, the history so far and a fingerprint of the problem; they are written to a
temporary file and renamed, so a kill during the write leaves the previous one intact.
A restart continues from the last checkpoint (also after ``steps`` was raised) and
gives the same history as an uninterrupted run.

In parallel (also with prompt groups) every rank holds the same heads: the gradient is
summed over all ranks of all groups, so every rank makes the same step. World rank 0
writes the files and decides the walltime guard, and broadcasts the decision.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import os
import time
from contextlib import contextmanager

import numpy as np

from ..model.config import batches_per_epoch
from ..model.schema import options
from ..tools.errors import ConfigError, InputError, PdeformerError, SolverBreakdown, reworded
from ..tools.files import load_npz, open_regular
from ..model import params as tree
from ..model.heads import BLOCK, gauge
from ..tools.output import write_csv, write_npz, write_points, write_pvd
from ..tools.parallel import on_root
from .forward import MAX_STEPS_PER_LAYER

log = logging.getLogger("pdeformer")

HEADS_BLOWUP = 100.0        # an update that multiplies the steps a forward pass needs by this ...
STEPS_WORTH_A_LOOK = 1000   # ... to more than this many per layer is a blow-up of the heads
HISTORY = ["step", "risk", "grad_norm", "step_size", "displacement", "gauge_drift", "wall_time"]


def history_columns(train, minibatches: bool, held_out: bool) -> list[str]:
    """history.csv's columns: the basic ones, then epoch and train_risk (minibatches: the
    risk on all training prompts, every test_every steps), test_risk (held-out prompts),
    penalty (weight decay) where they apply."""
    extra = (["epoch", "train_risk"] if minibatches else []) + (["test_risk"] if held_out else []) \
        + (["penalty"] if train.weight_decay > 0 else [])
    return HISTORY[:2] + extra + HISTORY[2:]


class Batches:
    """The minibatches of SGD: epoch e visits the training prompts in the order
    ``default_rng([seed, 0, e]).permutation``, B at a time (the last batch of an epoch
    may be smaller); step k takes batch k mod (batches per epoch) of epoch k // (batches
    per epoch). A function of (seed, B, k) alone: the same on every rank, with any prompt
    groups, and after a restart. Without batch_size every step takes all training prompts."""

    def __init__(self, training: list[int], batch_size: int | None, seed: int):
        self.training = np.asarray(training)
        self.size = batch_size or len(training)
        self.seed = seed
        self.per_epoch = batches_per_epoch(batch_size, len(training))
        self._order = (None, None)   # (epoch, permutation)

    @property
    def full(self) -> bool:
        return self.size >= len(self.training)

    def epoch(self, k: int) -> int:
        return k // self.per_epoch

    def __call__(self, k: int) -> list[int]:
        """The prompt indices of step k's batch (sorted)."""
        if self.full:
            return [int(i) for i in self.training]
        e, j = divmod(k, self.per_epoch)
        if self._order[0] != e:
            self._order = (e, np.random.default_rng([self.seed, 0, e]).permutation(self.training))
        return sorted(int(i) for i in self._order[1][j * self.size:(j + 1) * self.size])


def weight_penalty(params: dict, weight_decay: float) -> tuple[float, dict]:
    """P = (weight_decay / 2) sum_blocks (1/(L W)) sum_{l,w} |theta_lw|^2 -- the L2 penalty
    (lambda/2) int |theta|^2 dmu of each block's measure -- and dP/dtheta =
    weight_decay theta / (L W), so that the gd step moves every particle by -lr lambda theta."""
    P = 0.0
    for arrays in params.values():
        LW = tree.mean_field_scale(arrays)
        P += 0.5 * weight_decay * sum(float(np.sum(a ** 2)) for a in arrays.values()) / LW
    return P, {block: {n: weight_decay * a / tree.mean_field_scale(arrays) for n, a in arrays.items()}
               for block, arrays in params.items()}


def langevin_noise(seed: int, k: int, shapes: dict) -> dict:
    """xi ~ N(0, I) for every parameter at step k (a tree of ``shapes``): drawn from
    ``default_rng([seed, 1, k])`` in the tree's order, the same on every rank and after
    a restart."""
    rng = np.random.default_rng([seed, 1, k])
    return {block: {n: rng.standard_normal(shape) for n, shape in names.items()}
            for block, names in shapes.items()}


class GradientDescent:
    """theta <- theta - lr L W dR/dtheta, L W per block (:func:`params.mean_field_scale`)."""

    name = "gd"

    def __init__(self, lr: float, params: dict):
        self.lr = lr
        self.scales = {}
        for block, arrays in params.items():
            L, W = tree.layers_width(arrays)
            self.scales[block] = lr * L * W

    @property
    def step_size(self) -> float:
        return max(self.scales.values())

    def step(self, params: dict, grads: dict) -> None:
        for (block, n), p in tree.leaves(params):
            p -= self.scales[block] * grads[block][n]

    def scaled(self, grads: dict) -> dict:
        """The step's part of each array: lr L W dR/dtheta."""
        return {block: {n: self.scales[block] * g for n, g in arrays.items()} for block, arrays in grads.items()}

    def state(self) -> dict:
        return {}

    def load_state(self, state: dict) -> None:
        pass


class Heun(GradientDescent):
    """Heun's step of the gradient flow: theta* = theta - s g(theta), then
    theta <- theta - (s/2) (g(theta) + g(theta*)), s = lr L W per block; second order in
    lr where gd is first order. ``regrad`` gives the gradient at the current parameters."""

    name = "heun"

    def step(self, params: dict, grads: dict, regrad=None) -> None:
        start = tree.copy(params)
        super().step(params, grads)
        trial = regrad()
        for (block, n), p in tree.leaves(params):
            p[...] = start[block][n] - 0.5 * self.scales[block] * (grads[block][n] + trial[block][n])


class Adam:
    """Adam on L W dR/dtheta (per block), its moments a tree like the parameters."""

    name = "adam"

    def __init__(self, lr, params: dict, beta1=0.9, beta2=0.999, eps=1e-8):
        self.lr, self.beta1, self.beta2, self.eps = lr, beta1, beta2, eps
        self.mf = {block: tree.mean_field_scale(arrays) for block, arrays in params.items()}
        self.t = 0
        self.m = tree.zeros_like(params)
        self.v = tree.zeros_like(params)

    @property
    def step_size(self) -> float:
        return self.lr

    def step(self, params: dict, grads: dict) -> None:
        self.t += 1
        for (block, n), p in tree.leaves(params):
            g = self.mf[block] * grads[block][n]
            m, v = self.m[block], self.v[block]
            m[n] = self.beta1 * m[n] + (1 - self.beta1) * g
            v[n] = self.beta2 * v[n] + (1 - self.beta2) * g * g
            mhat = m[n] / (1 - self.beta1**self.t)
            vhat = v[n] / (1 - self.beta2**self.t)
            p -= self.lr * mhat / (np.sqrt(vhat) + self.eps)

    def state(self) -> dict:
        return {"adam_t": np.array(self.t), **tree.to_files(self.m, "adam_m_"), **tree.to_files(self.v, "adam_v_")}

    def load_state(self, state: dict) -> None:
        self.t = int(state["adam_t"])
        self.m = tree.tree_map(np.array, tree.from_files(state, self.m, "adam_m_"))
        self.v = tree.tree_map(np.array, tree.from_files(state, self.v, "adam_v_"))


def make_optimizer(train, params: dict):
    """The optimizer of the ``[train]`` options for a parameter tree."""
    if train.optimizer == "adam":
        return Adam(train.lr, params, train.beta1, train.beta2, train.eps)
    return (Heun if train.optimizer == "heun" else GradientDescent)(train.lr, params)


# ------------------------------------------------------------------ fingerprints

def _file_digest(path: str | None) -> str | None:
    if path is None or not os.path.isfile(path):
        return None
    h = hashlib.sha256()
    with open_regular(path, "checkpoint fingerprint") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def fingerprint(opts) -> dict:
    """What a checkpoint must agree on to be continued (of :class:`Options`, or a checked
    config): section -> canonical JSON (a drawn data set's prompts are in ``prompts``;
    ``data`` adds its teacher, file and seed; ``sampling`` the minibatches' size and seed)."""
    opts = options(opts)
    mesh = dataclasses.asdict(opts.mesh)
    mesh["file_sha256"] = _file_digest(mesh["file"])
    if mesh["file"]:
        h5 = os.path.splitext(mesh["file"])[0] + ".h5"
        mesh["h5_sha256"] = _file_digest(h5)
    model = dataclasses.asdict(opts.model)
    model["params_sha256"] = _file_digest(model["params"])
    prompts = []
    for p in opts.prompts:
        p = json.loads(json.dumps(p))
        for table in (p, p.get("target") or {}):
            if "path" in table:
                table["sha256"] = _file_digest(table["path"])
        prompts.append(p)
    from ..model.objectives import OBJECTIVES
    kind = opts.objective.kind
    foreign = {k for name, c in OBJECTIVES.items() if name != kind for k in c.own_keys}
    objective = {k: v for k, v in dataclasses.asdict(opts.objective).items() if k not in foreign}
    parts = {"mesh": mesh, "model": model, "prompts": prompts,
             "discretisation": {k: v for k, v in dataclasses.asdict(opts.discretisation).items()
                                if k != "max_outflow"},   # (it decides only when a run stops)
             "objective": objective,
             "optimizer": opts.train.optimizer}
    data = dataclasses.asdict(opts.data)
    data["teacher_sha256"] = _file_digest(data["teacher"])
    parts["data"] = data
    train = opts.train
    if train.batch_size is not None or train.seed != 0:    # the data order and the noise
        parts["sampling"] = {"batch_size": train.batch_size, "seed": train.seed}
    return {k: json.dumps(v, sort_keys=True, default=str) for k, v in parts.items()}


# ------------------------------------------------------------------ checkpoints

def write_checkpoint(filename: str, params: dict, optimizer, step: int, history: list,
                     rng: np.random.Generator, opts, gauge0: np.ndarray | None = None) -> None:
    """Atomic: written next to the target, flushed to disk, then renamed over it
    (``gauge0``: the heads' gauge at step 0, which the drift is measured from)."""
    meta = {"step": step, "history": history, "optimizer": optimizer.name,
            "rng": rng.bit_generator.state, "fingerprint": fingerprint(opts),
            "gauge0": [] if gauge0 is None else gauge0.tolist()}
    write_npz(filename, sync=True, **tree.to_files(params), meta=np.array(json.dumps(meta)), **optimizer.state())


CHECKPOINT_META = {"step": int, "history": list, "optimizer": str, "rng": dict, "fingerprint": dict,
                   "gauge0": list}


def read_checkpoint(filename: str, opts, like: dict | None = None, columns: list | None = None) -> dict:
    """Arrays and metadata of a checkpoint; refused (InputError) when it is not one
    pdeformer wrote (not a regular file, metadata missing or of the wrong type, an RNG
    state numpy does not take, history rows that are not steps 0..step-1 with a number
    in every column of ``columns``), was made for another problem (fingerprint), or its
    arrays differ from this run's (``like``: name -> array, the parameters and the
    optimizer's state) in shape or kind (float, integer), or are not finite. Run on rank 0."""
    if not os.path.lexists(filename):
        raise InputError(f"--restart: no checkpoint at {filename}")
    data = load_npz(filename, "--restart")
    try:
        meta = json.loads(str(data.pop("meta")))
    except (KeyError, ValueError) as e:
        raise InputError(f"--restart: {filename}: not a pdeformer checkpoint (its metadata: "
                         f"{type(e).__name__}: {e})") from None
    for key, kind in CHECKPOINT_META.items():
        if not isinstance(meta, dict) or not isinstance(meta.get(key), kind) or isinstance(meta.get(key), bool):
            raise InputError(f"--restart: {filename}: not a pdeformer checkpoint "
                             f"(its metadata has no {kind.__name__} {key!r})")
    if meta["step"] < 0:
        raise InputError(f"--restart: {filename}: not a pdeformer checkpoint (step {meta['step']})")
    mine = fingerprint(opts)
    differ = [k for k in mine if meta["fingerprint"].get(k) != mine[k]]
    if differ:
        raise InputError(f"--restart: {filename} was made for another problem "
                         f"(different {', '.join(differ)}); use a fresh output.dir")
    try:
        np.random.default_rng().bit_generator.state = meta["rng"]
    except Exception as e:   # numpy checks the state's keys, kinds and ranges
        raise InputError(f"--restart: {filename}: its RNG state is damaged ({type(e).__name__}: {e})") from None
    _check_history(filename, meta["history"], meta["step"], columns)
    for name, ref in (like or {}).items():
        a, ref = data.get(name), np.asarray(ref)
        if a is None:
            raise InputError(f"--restart: {filename}: no array {name!r}")
        if a.shape != ref.shape:
            raise InputError(f"--restart: {filename}: array {name!r} has shape {a.shape}, "
                             f"this run's is {ref.shape}")
        if a.dtype.kind != ref.dtype.kind:
            raise InputError(f"--restart: {filename}: array {name!r} is {a.dtype}, this run's is {ref.dtype}")
        if not np.all(np.isfinite(a)):
            raise InputError(f"--restart: {filename}: array {name!r} is not finite")
    data["meta"] = meta
    return data


def _check_history(filename: str, history: list, step: int, columns: list | None) -> None:
    """A checkpoint's history: one row per step 0..step-1, each a table of finite numbers
    (None where a column was not evaluated at that step) with every one of ``columns``."""
    if len(history) != step:
        raise InputError(f"--restart: {filename}: its history has {len(history)} row(s) for "
                         f"{step} step(s): the checkpoint is damaged")
    for k, row in enumerate(history):
        if not isinstance(row, dict):
            raise InputError(f"--restart: {filename}: history row {k} is damaged (not a table)")
        missing = [c for c in (columns or ("step", "risk")) if c not in row]
        bad = [c for c, v in row.items()
               if not (isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v))
               and not (v is None and c not in ("step", "risk"))]
        why = (f"no {', '.join(missing)}" if missing else
               f"{bad[0]} = {json.dumps(row[bad[0]])[:40]}" if bad else
               f"step {row['step']}, not {k}" if row["step"] != k else None)
        if why is not None:
            raise InputError(f"--restart: {filename}: history row {k} is damaged ({why})")


# ------------------------------------------------------------------ the loop

class Trainer:
    """Gradient-flow training of the parameters of an :class:`AdjointSolver`'s problem."""

    def __init__(self, adjoint, opts, outdir: str, walltime: float | None = None,
                 started: float | None = None):
        """``opts``: the run's :class:`Options` (or its checked config); ``outdir``: the
        folder of the run's files (None: no files, no checkpoints); ``walltime``:
        seconds from ``started`` (a perf_counter time; default: when training starts), so
        that set-up counts against the batch job's limit."""
        self.adjoint = adjoint
        self.opts = options(opts)
        self.train = self.opts.train
        self.outdir = outdir
        self.params = adjoint.forward.velocity_field.params   # the arrays: updated in place
        self.comm = adjoint.forward.problem.groups.world   # all ranks of all groups
        self.optimizer = make_optimizer(self.train, self.params)
        self.rng = np.random.default_rng(self.opts.model.seed)
        self.history: list[dict] = []
        self.start = 0
        self.gauge0 = gauge(self.params[BLOCK])   # G_h = Q Q^T - K K^T at step 0: its drift is recorded
        self.frames = {block: [] for block in self.params}   # block -> [(step, .vtu file)]
        self.checkpoint_file = os.path.join(outdir, "checkpoint.npz") if outdir is not None else None
        self.walltime = walltime
        self.started = started
        self.status = "completed"
        problem = adjoint.forward.problem
        self.training, self.held_out = problem.training, list(problem.held_out)
        self.batches = Batches(self.training, self.train.batch_size, self.train.seed)
        self.columns = history_columns(self.train, not self.batches.full, bool(self.held_out))

    def restart(self) -> None:
        like = tree.to_files(self.params) | self.optimizer.state()
        data = on_root(self.comm, read_checkpoint, self.checkpoint_file, self.opts, like, self.columns)
        meta = data.pop("meta")
        for (block, n), a in tree.leaves(self.params):
            a[:] = data.pop(tree.file_key(block, n))
        self.optimizer.load_state(data)
        self.rng.bit_generator.state = meta["rng"]
        gauge0 = np.array(meta["gauge0"], dtype=float)
        if gauge0.shape != self.gauge0.shape or not np.all(np.isfinite(gauge0)):
            raise InputError(f"--restart: {self.checkpoint_file}: its gauge at step 0 is damaged "
                             f"(shape {gauge0.shape}, expected {self.gauge0.shape})")
        self.gauge0 = gauge0
        self.history = meta["history"]
        self.start = meta["step"]
        steps = [int(r["step"]) for r in self.history if self._is_output_step(int(r["step"]))]
        self.frames = {block: [(float(k), points_file(block, k)) for k in steps] for block in self.params}

    def _is_output_step(self, k: int) -> bool:
        return k % self.train.output_every == 0 or k == self.train.steps

    def run(self) -> list[dict]:
        t0 = time.perf_counter() - (self.history[-1]["wall_time"] if self.history else 0.0)
        started, last = self.started or time.perf_counter(), 0.0
        for k in range(self.start, self.train.steps + 1):
            if self.walltime is not None and k > self.start and self._out_of_time(started, last):
                self._stop_for_walltime(k, started)
                break
            step_start = time.perf_counter()
            self._step(k, t0)
            last = time.perf_counter() - step_start
        return self.history

    def _stop_for_walltime(self, k: int, started: float) -> None:
        """The walltime guard: stop with a checkpoint at theta_k (restart continues)."""
        self.status = "walltime"
        if self.comm.rank == 0:   # one line, not one per rank
            log.warning("warning: walltime guard: stopping before step %d (%.0f s of %.0f s "
                        "used); continue with --restart", k, time.perf_counter() - started, self.walltime)
        on_root(self.comm, write_checkpoint, self.checkpoint_file, self.params, self.optimizer,
                k, self.history, self.rng, self.opts, self.gauge0)

    def _step(self, k: int, t0: float) -> None:
        """Iteration k: R and dR/dtheta at theta_k (history row k), the files of step k,
        and for k < steps the update to theta_{k+1} and its checkpoint."""
        steps = self.train.steps
        batch = self.batches(k)
        with self._step_context(k):
            g = self.adjoint.gradient(prompts=batch)
        row = {"step": k, "risk": g.risk}
        if not self.batches.full:
            row["epoch"] = self.batches.epoch(k)
        dP = None
        if self.train.weight_decay > 0:
            row["penalty"], dP = weight_penalty(self.params, self.train.weight_decay)
            g = dataclasses.replace(g, params=tree.tree_map(np.add, g.params, dP))
        with self._step_context(k):
            row.update(self._evaluate(g, batch) if self._is_test_step(k) else
                       {c: None for c in ("train_risk", "test_risk") if c in self.columns})
        before = tree.copy(self.params) if k < steps else None
        if k < steps:
            with self._step_context(k):
                self._update(k, g.params, dP, lambda: self._gradient(batch))
        disp = math.sqrt(tree.sum_squares(tree.tree_map(np.subtract, self.params, before))) \
            if before is not None else 0.0
        row.update(grad_norm=g.norm(), step_size=self.optimizer.step_size, displacement=disp,
                   gauge_drift=self._gauge_drift(before if before is not None else self.params),
                   wall_time=time.perf_counter() - t0)
        self.history.append(row)
        log.info("train step %4d  risk=%.10e%s  |grad|=%.3e  step=%.3g  %7.1f s", k, g.risk,
                 "".join(f"  {c}={row[c]:.6e}" for c in ("train_risk", "test_risk", "penalty")
                         if row.get(c) is not None), row["grad_norm"], disp, row["wall_time"])
        if self.outdir is not None:
            on_root(self.comm, self._write, k, before)   # a full disk ends every rank
        if before is not None:
            self._check_heads(k, before)
        if self.outdir is not None and k < steps and ((k + 1) % self.train.checkpoint_every == 0
                                                      or k + 1 == steps):
            on_root(self.comm, write_checkpoint, self.checkpoint_file, self.params, self.optimizer,
                    k + 1, self.history, self.rng, self.opts, self.gauge0)
        self.last_gradient = g

    def _gauge_drift(self, params: dict) -> float:
        """max_h |G_h(theta) - G_h(theta_0)|_F (:func:`pdeformer.model.heads.gauge`)."""
        diff = gauge(params[BLOCK]) - self.gauge0
        return float(np.sqrt(np.sum(diff * diff, axis=(-2, -1))).max())

    def _gradient(self, batch: list[int]) -> dict:
        """dR/dtheta (with the weight decay's penalty) of ``batch`` at the current
        parameters: heun's second gradient."""
        g = self.adjoint.gradient(prompts=batch).params
        if self.train.weight_decay > 0:
            g = tree.tree_map(np.add, g, weight_penalty(self.params, self.train.weight_decay)[1])
        return g

    def _update(self, k: int, grads: dict, dP: dict | None, regrad=None) -> None:
        """theta_k -> theta_{k+1}: the optimiser's step (heun's asks ``regrad`` for its
        second gradient), then (gd) the Langevin noise sqrt(2 lr T) xi (Euler-Maruyama)."""
        if isinstance(self.optimizer, Heun):
            self.optimizer.step(self.params, grads, regrad)
        else:
            self.optimizer.step(self.params, grads)
        noise = 0.0
        if self.train.temperature > 0:
            xi = langevin_noise(self.train.seed, k, tree.shapes(self.params))
            sigma = np.sqrt(2 * self.train.lr * self.train.temperature)
            for (block, n), p in tree.leaves(self.params):
                p += sigma * xi[block][n]
            noise = sigma * math.sqrt(tree.sum_squares(xi))
        self.last_update = self._update_parts(grads, dP, noise)

    # ------------------------------------------------------------------ blow-ups of the heads
    def _update_parts(self, grads: dict, dP: dict | None, noise: float) -> dict:
        """{key: size of its part of the last update}: the gradient's (train.lr), the weight
        decay's (train.weight_decay) and the Langevin noise's (train.temperature); for adam
        the whole step is train.lr's (its steps are normalised)."""
        if not isinstance(self.optimizer, GradientDescent):
            return {"train.lr": self.train.lr * math.sqrt(tree.size(grads)), "train.temperature": noise}
        decay = tree.norm(self.optimizer.scaled(dP)) if dP is not None else 0.0
        risk = tree.norm(self.optimizer.scaled(grads if dP is None else tree.tree_map(np.subtract, grads, dP)))
        return {"train.lr": risk, "train.weight_decay": decay, "train.temperature": noise}

    def _blame(self) -> str:
        """The update's largest part, as the setting to lower."""
        parts = getattr(self, "last_update", None)
        if not parts:
            return ""
        key = max(parts, key=parts.get)
        what = {"train.lr": "the gradient step", "train.weight_decay": "the weight decay",
                "train.temperature": "the Langevin noise"}[key]
        value = getattr(self.train, key.split(".")[1])
        return (f"; the last update moved the heads by {sum(v * v for v in parts.values()) ** 0.5:.3g}, "
                f"mostly {what} ({parts[key]:.3g}): lower {key} (now {value:g})")

    @contextmanager
    def _step_context(self, k: int):
        """A failure inside training step k says so, and what the update before it did."""
        try:
            yield
        except PdeformerError as e:
            if isinstance(e, ConfigError):
                raise
            raise reworded(e, f"train step {k}: {e}{self._blame() if k > self.start else ''}") from None

    def _check_heads(self, k: int, before: dict) -> None:
        """A breakdown right after an update that blew the parameters up: to NaN or
        infinity, or to a velocity whose next forward pass needs more than
        MAX_STEPS_PER_LAYER CFL steps per layer, or HEADS_BLOWUP times the steps it
        needed before (and more than STEPS_WORTH_A_LOOK): a gradient flow's Euler step
        moves the velocity a little, an update that multiplies it is a blow-up (too much
        noise, decay or lr)."""
        fw = self.adjoint.forward
        layers = fw.problem.heads.layers
        if not all(np.all(np.isfinite(a)) for _, a in tree.leaves(self.params)):
            what = "they are not finite"
        else:
            after = max(fw.steps_bound(l) for l in range(layers))
            start = max(fw.steps_bound(l, before) for l in range(layers))
            if not (after > MAX_STEPS_PER_LAYER or
                    (after > STEPS_WORTH_A_LOOK and after > HEADS_BLOWUP * max(start, 1.0))):
                return
            what = (f"their velocity may need up to {after:.3g} CFL steps per layer, where the heads the "
                    f"update started from needed {start:.3g}")
        raise SolverBreakdown(f"train step {k}: the update blew the heads up: {what}{self._blame()}")

    def _is_test_step(self, k: int) -> bool:
        return k % self.train.test_every == 0 or k == self.train.steps

    def _evaluate(self, g, batch: list[int]) -> dict:
        """At theta_k: the risk on all training prompts (minibatches: the batch's risks and
        a forward pass of the others) and on the held-out prompts. The step's gradient has
        just planned afresh, so these prompts' step plans are made at theta_k, as a
        gradient there would make them (plans are kept per prompt)."""
        out = {}
        if not self.batches.full:
            taken = set(batch)
            rest = [s for s in self.training if s not in taken]
            risks = dict(zip(batch, g.risks)) | dict(zip(rest, self.adjoint.risk(rest)[1] if rest else []))
            out["train_risk"] = float(np.mean([risks[s] for s in self.training]))
        if self.held_out:
            out["test_risk"] = self.adjoint.risk(self.held_out)[0]
        return out

    def _out_of_time(self, started: float, last: float) -> bool:
        """Would the next step end past the walltime? Rank 0's clock decides for all
        ranks (clocks and step times differ between ranks: deciding apart would leave
        some ranks in the next step's collectives and the others gone)."""
        late = time.perf_counter() - started + 1.2 * last > self.walltime
        return bool(self.comm.bcast(late if self.comm.rank == 0 else None, root=0))

    def _write(self, k: int, before) -> None:
        """history.csv every step; the parameters (params_XXXX.npz) and each block's
        particles as VTK points (:func:`points_file`) of theta_k on output steps."""
        write_csv(os.path.join(self.outdir, "history.csv"), self.columns,
                  [[float("nan") if r.get(c) is None else r[c] for c in self.columns] for r in self.history])
        if not self._is_output_step(k):
            return
        current = before if before is not None else self.params
        write_npz(os.path.join(self.outdir, f"params_{k:04d}.npz"), **tree.to_files(current),
                  **self.adjoint.forward.problem.heads.files())   # and the heads' fixed weights
        for block, arrays in current.items():
            name = points_file(block, k)
            write_points(os.path.join(self.outdir, name), *tree.POINTS[block](arrays))
            self.frames[block] = [f for f in self.frames[block] if f[0] != k] + [(float(k), name)]
            write_pvd(os.path.join(self.outdir, f"{tree.PARTICLES[block]}.pvd"), self.frames[block])


def points_file(block: str, k: int) -> str:
    """The VTK points of a block's particles at step k: heads_XXXX.vtu for attention."""
    return f"{tree.PARTICLES[block]}_{k:04d}.vtu"
