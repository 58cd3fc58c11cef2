"""Training on data sets: held-out prompts, minibatch SGD, weight decay and Langevin noise
([data] test_fraction, folder; [train] batch_size, epochs, seed, test_every, temperature,
weight_decay). The minibatch gradient is the mean of per-prompt gradients, a training
step is the formula of pdeformer.solvers.train applied to independently computed
gradients, the data order and the noise depend on the seed alone (1 and 2 ranks, prompt
groups, restart), and the risks of history.csv are those of independent forward runs."""

from __future__ import annotations

import csv
import json

import numpy as np
import pytest

from checks import central_derivative
from conftest import check_one_line_error, requires_dolfinx, run_cli, write_config
from pdeformer.solvers.train import Batches, history_columns, langevin_noise, weight_penalty
from pdeformer.model.config import check_config
from pdeformer.model.schema import section
from pdeformer.tools.errors import ConfigError

CONFIG = """
[mesh]
lower = [-4.0, -4.0]
upper = [4.0, 4.0]
cells = [8, 8]

[discretisation]
steps_per_layer = 6

[model]
layers = 2
heads = 2
seed = 1
init_scale = 0.7

[data]
count = 10
seed = 3
teacher_seed = 9
test_fraction = 0.2

[objective]
kind = "moments"

[train]
steps = 4
lr = 0.5
batch_size = 3
seed = 5
test_every = 2
temperature = 1e-5
weight_decay = 0.01
checkpoint_every = 1

[output]
fields = false
plots = false
"""


def history(folder) -> list[dict]:
    with open(folder / "history.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


# ------------------------------------------------------------------ without a mesh

def test_every_epoch_visits_every_training_prompt_once_in_a_seeded_order():
    """Batches of 3 from 8 training prompts: 3 per epoch (3, 3, 2), each epoch a permutation
    of the training prompts, another order every epoch and for another seed, the same
    for the same seed whatever was asked before (a function of the step alone)."""
    training = [0, 1, 2, 3, 4, 5, 6, 7]
    b = Batches(training, 3, seed=5)
    assert b.per_epoch == 3 and not b.full
    epochs = [[b(3 * e + j) for j in range(3)] for e in range(4)]
    for batches in epochs:
        assert [len(x) for x in batches] == [3, 3, 2]
        assert sorted(i for x in batches for i in x) == training
    assert len({tuple(map(tuple, e)) for e in epochs}) == 4
    assert [Batches(training, 3, seed=5)(k) for k in (7, 2, 11)] == [b(7), b(2), b(11)]
    assert [Batches(training, 3, seed=6)(k) for k in range(3)] != epochs[0]
    assert b.epoch(2) == 0 and b.epoch(3) == 1
    full = Batches(training, None, seed=5)
    assert full.full and full(0) == full(9) == training and full.epoch(4) == 4


def test_penalty_gradient_and_noise():
    """P = (lambda/2) sum_blocks mean_particles |theta|^2 (each block over its own L W):
    its gradient against central differences; the noise is standard normal, the same for
    the same (seed, step), other for others."""
    from pdeformer.model.params import leaves, tree_map
    rng = np.random.default_rng(0)
    params = {"heads": {"Q": rng.normal(size=(2, 3, 2, 2)), "K": rng.normal(size=(2, 3, 2, 2)),
                        "V": rng.normal(size=(2, 3, 2, 2))},
              "neurons": {"a": rng.normal(size=(2, 5, 2)), "b": rng.normal(size=(2, 5))}}
    P, dP = weight_penalty(params, 0.3)
    squares = {b: sum(np.sum(a ** 2) for a in arrays.values()) for b, arrays in params.items()}
    assert P == pytest.approx(0.15 * (squares["heads"] / 6 + squares["neurons"] / 10), rel=1e-14)
    d = tree_map(lambda a: rng.normal(size=a.shape), params)
    fd = central_derivative(lambda e: weight_penalty(tree_map(lambda a, b: a + e * b, params, d), 0.3)[0], 1e-6)
    slope = sum(np.sum(a * b) for (_, a), (_, b) in zip(leaves(dP), leaves(d)))
    assert fd == pytest.approx(slope, rel=1e-8)
    shapes = tree_map(np.shape, params)
    a, b = langevin_noise(7, 3, shapes), langevin_noise(7, 3, shapes)
    assert all(np.array_equal(x, y) for (_, x), (_, y) in zip(leaves(a), leaves(b)))
    assert not np.array_equal(langevin_noise(7, 4, shapes)["heads"]["Q"], a["heads"]["Q"])
    assert not np.array_equal(langevin_noise(8, 3, shapes)["neurons"]["b"], a["neurons"]["b"])
    xi = np.concatenate([x.ravel() for k in range(200) for _, x in leaves(langevin_noise(1, k, shapes))])
    assert abs(xi.mean()) < 5 / np.sqrt(xi.size) and abs(xi.std() - 1) < 5 / np.sqrt(2 * xi.size)


def raw(**train):
    return {"mesh": {"lower": [-3.0, -3.0], "upper": [3.0, 3.0], "cells": [8, 8]},
            "model": {"layers": 2, "heads": 2}, "objective": {"kind": "moments"},
            "data": {"count": 10, "teacher_seed": 1, "test_fraction": 0.2}, "train": train}


def test_epochs_give_the_steps_and_history_has_the_columns_that_apply():
    cfg = check_config(raw(epochs=3, batch_size=3), ".")
    assert cfg["train"]["steps"] == 9                       # 8 training prompts: 3 batches an epoch
    assert check_config(raw(epochs=2), ".")["train"]["steps"] == 2
    assert check_config(raw(), ".")["train"]["steps"] == 20
    t = section(cfg, "train")
    assert history_columns(t, True, True) == ["step", "risk", "epoch", "train_risk", "test_risk",
                                              "grad_norm", "step_size", "displacement", "gauge_drift",
                                              "wall_time"]
    t = section(check_config(raw(weight_decay=0.1), "."), "train")
    assert history_columns(t, False, False) == ["step", "risk", "penalty", "grad_norm", "step_size",
                                                "displacement", "gauge_drift", "wall_time"]


@pytest.mark.parametrize("train, data, message", [
    ({"batch_size": 9}, {}, "train.batch_size: 9 is more than the 8 training prompt(s)"),
    ({"epochs": 2, "steps": 3}, {}, "train.epochs: give either train.steps or train.epochs"),
    ({"temperature": 0.1, "optimizer": "adam"}, {}, "train.temperature: Langevin noise needs optimizer = 'gd'"),
    ({}, {"test_fraction": 0.04}, "data.test_fraction: 0.04 of 10 prompt(s) holds out none"),
    ({"batch_size": 9}, {"test_fraction": 0.15}, "train.batch_size: 9 is more than the 8 training"),  # 1.5 -> 2
    ({}, {"count": 1, "test_fraction": 0.9}, "data.test_fraction: 0.9 of 1 prompt(s) leaves no training prompt"),
    ({}, {"test_fraction": 0.95}, "data.test_fraction: expected a number <= 0.9, got 0.95"),
    ({"temperature": -1.0}, {}, "train.temperature: expected a non-negative number"),
    ({}, {"folder": "prompts"}, "data.folder: give either data.count (a drawn data set) or data.folder"),
])
def test_bad_training_options_are_one_line_errors(train, data, message):
    cfg = raw(**train)
    cfg["data"].update(data)
    with pytest.raises(ConfigError) as e:
        check_config(cfg, ".")
    assert str(e.value).startswith(message), str(e.value)


def _write_folder(tmp_path, n=4, cloud=True):
    """n Gaussian densities sampled on points (prompts data/pNN.npz), point-cloud targets
    (data/targets/pNN.npz); with ``cloud`` the last prompt a point cloud."""
    rng = np.random.default_rng(1)
    folder = tmp_path / "data"
    (folder / "targets").mkdir(parents=True)
    g = np.linspace(-3.5, 3.5, 29)
    x = np.stack(np.meshgrid(g, g), -1).reshape(-1, 2)
    for i in range(n):
        m = rng.uniform(-1, 1, 2)
        if cloud and i == n - 1:
            np.savez(folder / f"p{i:02d}.npz", points=m + 0.5 * rng.normal(size=(400, 2)))
        else:
            np.savez(folder / f"p{i:02d}.npz", points=x, density=np.exp(-np.sum((x - m) ** 2, 1) / 0.5))
        np.savez(folder / "targets" / f"p{i:02d}.npz", points=m + 0.4 * rng.normal(size=(300, 2)))
    (folder / "notes.txt").write_text("not a prompt")
    return folder


def test_a_data_set_from_a_folder(tmp_path):
    """Every .npz/.csv of the folder a prompt, in name order, densities as 'file' and clouds
    as 'points', their targets from targets/; a missing target, a bad name are one line."""
    _write_folder(tmp_path)
    base = {"mesh": {"lower": [-4.0, -4.0], "upper": [4.0, 4.0], "cells": [8, 8]},
            "model": {"layers": 1, "heads": 1}, "objective": {"kind": "mmd", "bandwidth": 1.0},
            "data": {"folder": "data", "test_fraction": 0.25}}
    cfg = check_config(base, str(tmp_path))
    assert [p["name"] for p in cfg["prompts"]] == ["p00", "p01", "p02", "p03"]
    assert [p["kind"] for p in cfg["prompts"]] == ["file", "file", "file", "points"]
    assert cfg["prompts"][1]["path"] == str(tmp_path / "data" / "p01.npz")
    assert cfg["prompts"][1]["target"] == {"kind": "points", "path": str(tmp_path / "data" / "targets" / "p01.npz"),
                                           "points": None, "weights": None}
    (tmp_path / "data" / "targets" / "p02.npz").unlink()
    with pytest.raises(ConfigError, match=r"^data.folder: prompt 'p02' has no target file \(targets/p02.npz\)"):
        check_config(base, str(tmp_path))
    (tmp_path / "data" / "bad name.csv").write_text("x0,x1\n0,0\n")
    with pytest.raises(ConfigError, match="^data.folder: .*bad name.csv: a prompt name must be"):
        check_config(base, str(tmp_path))
    with pytest.raises(ConfigError, match="^data.folder: .*nowhere: no such folder"):
        check_config(dict(base, data={"folder": "nowhere"}), str(tmp_path))
    (tmp_path / "data" / "bad name.csv").unlink()
    teacher = dict(base, objective={"kind": "moments"}, data={"folder": "data", "teacher_seed": 1})
    with pytest.raises(ConfigError, match=r"^data.folder: .*targets/p00.npz: a target file, but the "
                                          r"targets come from the teacher \(data.teacher_seed\)"):
        check_config(teacher, str(tmp_path))
    for f in (tmp_path / "data" / "targets").iterdir():
        f.unlink()
    with pytest.raises(ConfigError, match="^data.teacher_seed: prompt 'p03' is a point cloud"):
        check_config(teacher, str(tmp_path))
    (tmp_path / "data" / "p03.npz").unlink()
    assert len(check_config(teacher, str(tmp_path))["prompts"]) == 3
    with pytest.raises(ConfigError, match="^data.teacher: missing: objective.kind = 'moments' needs moment"):
        check_config(dict(teacher, data={"folder": "data"}), str(tmp_path))


# ------------------------------------------------------------------ with the solver

@requires_dolfinx
def test_the_minibatch_gradient_is_the_mean_of_per_prompt_gradients(tmp_path):
    """AdjointSolver.gradient over a batch = the mean of the gradients of its prompts taken
    one at a time; the default is over the training prompts only (not the held-out)."""
    from mpi4py import MPI
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from pdeformer.model.config import load_config
    cfg = load_config(write_config(tmp_path, CONFIG))
    p = build_problem(cfg, MPI.COMM_WORLD, differentiable=True)
    assert p.training == list(range(8)) and p.held_out == [8, 9]
    adj = AdjointSolver(ForwardSolver(p), p.objective, p.targets)
    batch = [1, 4, 6]
    g = adj.gradient(prompts=batch)
    ones = [adj.gradient(prompts=[s]) for s in batch]
    assert g.prompts == batch and g.risks == [o.risk for o in ones]
    for n in ("Q", "K", "V"):
        mean = np.mean([o.params["attention"][n] for o in ones], axis=0)
        np.testing.assert_allclose(g.params["attention"][n], mean, rtol=0, atol=1e-14 * np.abs(mean).max())
    whole = adj.gradient()
    assert whole.prompts == p.training and len(whole.risks) == 8
    assert adj.risk([8, 9])[0] == pytest.approx(np.mean([adj.gradient(prompts=[s]).risk for s in (8, 9)]), rel=1e-13)


@requires_dolfinx
def test_a_training_step_is_the_langevin_step_of_the_batch_gradient(tmp_path):
    """theta_1 = theta_0 - lr (L H dR_B/dtheta + lambda theta_0) + sqrt(2 lr T) xi(seed, 0)
    with B step 0's batch and dR_B/dtheta from the API; the history's risks at step 0 are
    those of a forward run at theta_0: train risk over the 8 training prompts, test risk
    over the 2 held out, batch risk over B."""
    from mpi4py import MPI
    from pdeformer.solvers.adjoint import AdjointSolver
    from pdeformer.solvers.forward import ForwardSolver
    from pdeformer.solvers.problem import build_problem
    from pdeformer.model.config import load_config
    path = write_config(tmp_path, CONFIG)
    run_cli(["train", path, "--set", "output.dir=out", "train.steps=1"], cwd=str(tmp_path))
    run_cli(["forward", path, "--set", "output.dir=fw"], cwd=str(tmp_path))
    cfg = load_config(path)
    p = build_problem(cfg, MPI.COMM_WORLD, differentiable=True)
    batch = Batches(p.training, 3, seed=5)(0)
    g = AdjointSolver(ForwardSolver(p), p.objective, p.targets).gradient(prompts=batch)
    theta0 = {n: getattr(p.heads, n).copy() for n in ("Q", "K", "V")}
    xi = langevin_noise(5, 0, {"attention": {n: a.shape for n, a in theta0.items()}})["attention"]
    theta1 = np.load(tmp_path / "out" / "params_0001.npz")
    lr, LH, lam, T = 0.5, 4, 0.01, 1e-5
    for n in ("Q", "K", "V"):
        want = theta0[n] - lr * (LH * g.params["attention"][n] + lam * theta0[n]) + np.sqrt(2 * lr * T) * xi[n]
        np.testing.assert_allclose(theta1[n], want, rtol=0, atol=1e-13)
    rows = history(tmp_path / "out")
    objective = json.loads((tmp_path / "fw" / "summary.json").read_text())["objective"]
    risks = objective["risks"]
    names = [f"data{i:04d}" for i in range(10)]
    assert rows[0]["risk"] == pytest.approx(np.mean([risks[names[s]] for s in batch]), rel=1e-12)
    assert rows[0]["train_risk"] == pytest.approx(objective["risk"], rel=1e-12)
    assert rows[0]["test_risk"] == pytest.approx(objective["test_risk"], rel=1e-12)
    assert objective["test_risk"] == pytest.approx(np.mean([risks[names[s]] for s in (8, 9)]), rel=1e-14)
    assert rows[0]["penalty"] == pytest.approx(weight_penalty({"attention": theta0}, lam)[0], rel=1e-14)


@requires_dolfinx
@pytest.mark.mpi
def test_sgd_is_the_same_on_two_ranks_in_groups_and_after_a_restart(tmp_path):
    """Minibatches, noise, weight decay and held-out prompts: the same history (every risk,
    the penalty, the steps) on 1 rank, on 2 ranks in 2 prompt groups, and cut after 2 steps
    and restarted; the test and train risks appear every test_every steps and at the
    last; another train.seed is refused on restart (one line naming sampling)."""
    path = write_config(tmp_path, CONFIG)
    run_cli(["train", path, "--set", "output.dir=serial"], cwd=str(tmp_path))
    run_cli(["train", path, "--set", "output.dir=groups", "--prompt-groups", "2"], nprocs=2, cwd=str(tmp_path))
    run_cli(["train", path, "--set", "output.dir=cut", "train.steps=2"], cwd=str(tmp_path))
    run_cli(["train", path, "--set", "output.dir=cut", "--restart"], cwd=str(tmp_path))
    ref = history(tmp_path / "serial")
    assert [r["epoch"] for r in ref] == [0, 0, 0, 1, 1]
    evaluated = [k for k, r in enumerate(ref) if np.isfinite(r["test_risk"])]
    assert evaluated == [0, 2, 4] and evaluated == [k for k, r in enumerate(ref) if np.isfinite(r["train_risk"])]
    for name in ("groups", "cut"):
        rows = history(tmp_path / name)
        assert len(rows) == len(ref)
        for a, b in zip(rows, ref):
            for c in a:
                if c != "wall_time" and np.isfinite(b[c]):
                    assert abs(a[c] - b[c]) <= 1e-10 * abs(b[c]), (name, a["step"], c, a[c], b[c])
    proc = run_cli(["train", path, "--restart", "--set", "output.dir=cut", "train.seed=6"],
                   cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "sampling")


@requires_dolfinx
def test_training_on_a_folder_data_set(tmp_path):
    """A folder of density files, mmd against the target clouds: train runs, its test risk
    is over the held-out last file, and the risk falls."""
    _write_folder(tmp_path, cloud=False)
    path = write_config(tmp_path, """
[mesh]
lower = [-4.0, -4.0]
upper = [4.0, 4.0]
cells = [12, 12]
[discretisation]
steps_per_layer = 8
[model]
layers = 2
heads = 2
seed = 1
init_scale = 0.5
[data]
folder = "data"
test_fraction = 0.25
[objective]
kind = "mmd"
bandwidth = 1.0
[train]
steps = 3
lr = 0.2
[output]
dir = "out"
fields = false
plots = false
""")
    run_cli(["train", path], cwd=str(tmp_path))
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    rows = history(tmp_path / "out")
    assert [p["name"] for p in summary["config"]["prompts"]] == ["p00", "p01", "p02", "p03"]
    assert rows[-1]["risk"] < rows[0]["risk"]
    assert np.isfinite(rows[0]["test_risk"]) and summary["final_test_risk"] == rows[-1]["test_risk"]
