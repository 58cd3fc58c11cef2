r"""train: the gradient flow of a model's parameters on prompts, from Python.

Each step is the one ``pdeformer train`` takes (:class:`pdeformer.solvers.train.Trainer`,
docs/training.md): for gd,

    theta <- theta - lr (L W dR/dtheta + weight_decay theta) + sqrt(2 lr temperature) xi,

L W the layers times the particles per layer of each block of the parameter tree (L H
for the heads), R the mean of the objective over the prompts (or a minibatch of
``batch_size``), xi ~ N(0, I) seeded by (seed, step); adam takes Adam's step on
L W dR/dtheta. The steps are those of :func:`pdeformer.api.solve.value_and_grad`.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from ..model.heads import BLOCK
from ..solvers.train import Trainer
from ..tools.errors import ConfigError
from .objects import DG, Objective, Transformer
from .solve import _prompt_list, _solver, adjoint_of


@dataclass
class Training:
    """What :func:`train` returns: the trained model and the history of the steps.

    Attributes
    ----------
    model : Transformer
        The parameters after the last step (a new model; the given one is unchanged).
    history : dict
        {column: array over steps 0..steps}: ``risk`` (R at theta_k), ``grad_norm``,
        ``step_size``, ``displacement`` (``|theta_{k+1} - theta_k|``), ``wall_time`` and,
        where they apply, ``penalty``, ``epoch``, ``train_risk``.
    """

    model: Transformer
    history: dict

    @property
    def risk(self) -> np.ndarray:
        """R at every step, (steps + 1,)."""
        return self.history["risk"]


def train(objective: Objective, model: Transformer, prompts, disc, *, steps: int, lr: float,
          optimizer: str = "gd", weight_decay: float = 0.0, temperature: float = 0.0,
          batch_size: int | None = None, seed: int = 0, frames_per_layer: int = 1,
          backend: str = "auto", tol: float = 1e-8, outdir: str | None = None,
          restart: bool = False, comm=None, **adam) -> Training:
    """Train ``model`` for ``steps`` steps on ``prompts`` (module docstring).

    Parameters
    ----------
    objective, model, prompts, disc :
        As :func:`pdeformer.api.solve.value_and_grad` takes them (``disc``: pf.DG or
        pf.Particles).
    steps, lr, optimizer, weight_decay, temperature, batch_size, seed :
        The ``[train]`` options of the same names (``adam``: beta1, beta2, eps).
    outdir :
        A folder for the files ``pdeformer train`` writes there (history.csv,
        params_XXXX.npz, heads_XXXX.vtu, checkpoint.npz); None: no files.
    restart :
        Continue from ``outdir``'s checkpoint.npz (``pdeformer train --restart``): the
        parameters, optimiser state, random state and history of the step it was written
        at, so that the history equals that of one uninterrupted run of ``steps`` steps.
        A checkpoint of another problem is refused (InputError).

    Returns
    -------
    Training
        The trained model and the history, the same on every rank.
    """
    prompts, _ = _prompt_list(prompts)
    if not isinstance(disc, DG):
        raise ConfigError("discretisation", "pf.train trains on the mesh: expected pf.DG(mesh, ...)")
    if restart and outdir is None:
        raise ConfigError("restart", "continues from outdir's checkpoint.npz: give outdir")
    options = {"steps": steps, "lr": lr, "optimizer": optimizer, "weight_decay": weight_decay,
               "temperature": temperature, "seed": seed, **adam,
               **({"batch_size": batch_size} if batch_size is not None else {})}
    problem, solver = _solver(model, prompts, disc, objective, comm, True, frames_per_layer=frames_per_layer,
                              backend=backend, tol=tol, train=options)
    if outdir is not None and solver.comm.rank == 0:
        os.makedirs(outdir, exist_ok=True)
    trainer = trainer_for(problem, solver, outdir)
    if restart:
        trainer.restart()
    rows = trainer.run()
    columns = {c: np.array([np.nan if r.get(c) is None else r[c] for r in rows], dtype=float)
               for c in trainer.columns}
    trained = {**trainer.params, BLOCK: {**trainer.params[BLOCK], **problem.heads.files()}}
    return Training(Transformer(trained, model.beta, model.options), columns)   # (copies them)


def trainer_for(problem, solver, outdir: str | None = None, walltime: float | None = None,
                started: float | None = None) -> Trainer:
    """The :class:`~pdeformer.solvers.train.Trainer` of ``problem``'s ``[train]`` options
    through ``solver`` (a ForwardSolver): what :func:`train` and ``pdeformer train`` run.
    ``outdir``: the folder of the training's files (None: none); ``walltime``: seconds
    from ``started`` after which it stops with a checkpoint."""
    return Trainer(adjoint_of(problem, solver), problem.opts, outdir, walltime, started=started)
