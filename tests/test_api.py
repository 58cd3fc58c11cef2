"""The Python API (pdeformer.api): the issue's example as a test, serially and under
mpirun -n 2, against the CLI on the equivalent TOML, one discrete map for solve and
value_and_grad, and two models in one process."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import requires_dolfinx, run_cli, run_script, write_config

from pdeformer.tools.output import read_diagnostics

pytestmark = [requires_dolfinx]

# the API's example on a small mesh; prints its numbers as JSON (rank 0)
EXAMPLE = """
import json, sys
import numpy as np
import pdeformer as pf
from mpi4py import MPI

mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[12, 12])
model = pf.Transformer.random(layers=2, heads=3, dim=2, seed=0, init_scale=0.8)
prompt = pf.GaussianMixture(weights=[0.5, 0.5], means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2], name="a")
disc = pf.DG(mesh, degree=1, limiter=True, steps_per_layer=STEPS)
sol = pf.solve(model, prompt, disc, frames_per_layer=2, backend="auto", tol=1e-8)
points, values = sol.density(frame=-1)
objective = pf.Moments(mean=[0, 0], cov=[[0.5, 0], [0, 0.5]])
risk, grad = pf.value_and_grad(objective, model, [prompt], disc, frames_per_layer=2)
tokens = pf.solve(model, prompt, pf.Particles(tokens=400, seed=1, steps_per_layer=4), frames_per_layer=2)
x, w = tokens.density()
out = {"t": sol.t.tolist(), "mass": sol.mass.tolist(), "mean": sol.mean.tolist(), "cov": sol.cov.tolist(),
       "cells": len(values), "risk": risk,
       "grad": {n: g.tolist() for n, g in grad["attention"].items()},
       "shapes": {n: list(g.shape) for n, g in grad["attention"].items()},
       "token_mean": tokens.mean[-1].tolist(), "tokens": len(x), "weights": float(w.sum()),
       "params": {n: a.tolist() for n, a in model.params["attention"].items()}}
if MPI.COMM_WORLD.rank == 0:
    json.dump(out, open(sys.argv[1], "w"))
"""


def run_example(tmp_path, nprocs: int, steps: int = 8) -> dict:
    script = tmp_path / "example.py"
    script.write_text(EXAMPLE.replace("STEPS", str(steps)))
    result = tmp_path / f"out{nprocs}.json"
    proc = run_script(script, [result], nprocs, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    return json.loads(result.read_text())


def toml_of(example: dict, steps: int) -> str:
    """The run configuration the example's objects stand for (its heads in a file)."""
    return f"""
[mesh]
lower = [-4.0, -4.0]
upper = [4.0, 4.0]
cells = [12, 12]
[discretisation]
degree = 1
limiter = true
steps_per_layer = {steps}
[model]
params = "heads.npz"
[particles]
tokens = 400
seed = 1
steps_per_layer = 4
[output]
dir = "out"
fields = false
frames_per_layer = 2
[objective]
kind = "moments"
[[prompts]]
name = "a"
kind = "gaussian_mixture"
weights = [0.5, 0.5]
means = [[-1.0, 0.0], [1.0, 0.5]]
covs = [0.3, 0.2]
target = {{ mean = [0.0, 0.0], cov = [[0.5, 0.0], [0.0, 0.5]] }}
"""


@pytest.mark.mpi
def test_the_example_serially_under_mpirun_and_as_the_cli(tmp_path):
    """The example's numbers: arrays over the frames of the right shapes; the same on 1
    and 2 ranks (to 1e-11: sums over another partition); the CLI's forward, particles
    and gradient on the equivalent TOML give the same final moments, risk and gradient
    (to 1e-12: the same discrete map)."""
    one, two = run_example(tmp_path, 1), run_example(tmp_path, 2)
    assert one["t"] == [0.0, 0.25, 0.5, 0.75, 1.0] and np.shape(one["cov"]) == (5, 2, 2)
    assert one["shapes"] == {"Q": [2, 3, 2, 2], "K": [2, 3, 2, 2], "V": [2, 3, 2, 2]}
    assert one["cells"] == 2 * 144 and one["tokens"] == 400 and one["weights"] == pytest.approx(1.0, abs=1e-14)
    for key in ("mass", "mean", "cov", "risk", "token_mean"):
        np.testing.assert_allclose(two[key], one[key], rtol=1e-11, atol=1e-13, err_msg=key)
    for n in "QKV":   # entries far below the largest carry its rounding: measured against the largest
        np.testing.assert_allclose(two["grad"][n], one["grad"][n], rtol=0, atol=1e-11 * np.abs(one["grad"][n]).max())
    np.savez(tmp_path / "heads.npz", **{n: np.array(a) for n, a in one["params"].items()})
    cfg = write_config(tmp_path, toml_of(one, 8))
    run_cli(["forward", cfg], cwd=str(tmp_path))
    final = read_diagnostics(str(tmp_path / "out" / "diagnostics.csv"))[-1]
    np.testing.assert_allclose([final["mean_0"], final["mean_1"]], one["mean"][-1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose([final["cov_00"], final["cov_01"], final["cov_11"]],
                               [one["cov"][-1][0][0], one["cov"][-1][0][1], one["cov"][-1][1][1]], rtol=1e-12)
    run_cli(["gradient", cfg], cwd=str(tmp_path))
    g = np.load(tmp_path / "out" / "gradient.npz")
    assert float(g["risk"]) == pytest.approx(one["risk"], rel=1e-12)
    for n in "QKV":
        np.testing.assert_allclose(g[f"d{n}"], one["grad"][n], rtol=1e-12, atol=1e-14 * np.abs(g[f"d{n}"]).max())
    run_cli(["particles", cfg], cwd=str(tmp_path))
    final = read_diagnostics(str(tmp_path / "out" / "diagnostics.csv"))[-1]
    np.testing.assert_allclose([final["mean_0"], final["mean_1"]], one["token_mean"], rtol=1e-12, atol=1e-14)


def small(seed: int = 0):
    import pdeformer as pf
    mesh = pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[10, 10])
    model = pf.Transformer.random(layers=2, heads=2, dim=2, seed=seed, init_scale=0.8)
    prompt = pf.GaussianMixture(means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2])
    return model, prompt, pf.DG(mesh)


def test_solve_and_value_and_grad_take_one_discrete_map():
    """With CFL steps, solve takes the steps a gradient takes: the risk value_and_grad
    returns is the Moments objective of the solved final moments, to round-off."""
    import pdeformer as pf
    model, prompt, disc = small()
    target = pf.Moments(mean=[0.2, -0.1], cov=[[0.4, 0.1], [0.1, 0.3]])
    sol = pf.solve(model, prompt, disc)
    risk, _ = pf.value_and_grad(target, model, prompt, disc)
    m, c = sol.mean[-1], sol.cov[-1]
    direct = 0.5 * np.sum((m - [0.2, -0.1]) ** 2) + 0.5 * np.sum((c - [[0.4, 0.1], [0.1, 0.3]]) ** 2)
    assert risk == pytest.approx(direct, rel=1e-12)


def test_two_models_in_one_process_do_not_interfere():
    """Solving model A, then B, then A again gives A's numbers both times, and B's as
    B alone (no state shared between problems through caches or plans)."""
    import pdeformer as pf
    (a, prompt, disc), (b, _, _) = small(0), small(7)
    first = pf.solve(a, prompt, disc, backend="laplace")
    other = pf.solve(b, prompt, disc, backend="laplace")
    again = pf.solve(a, prompt, disc, backend="laplace")
    np.testing.assert_array_equal(first.cov, again.cov)
    assert np.abs(other.cov[-1] - first.cov[-1]).max() > 1e-3
    ga = pf.value_and_grad(pf.Moments(mean=[0, 0], cov=0.5), a, prompt, disc)[1]["attention"]["V"]
    pf.value_and_grad(pf.Moments(mean=[0, 0], cov=0.5), b, prompt, disc)
    np.testing.assert_array_equal(ga, pf.value_and_grad(pf.Moments(mean=[0, 0], cov=0.5), a, prompt,
                                                        disc)[1]["attention"]["V"])


def test_pictures_files_and_bad_objects(tmp_path):
    """The solution draws the densities picture and writes the ParaView series; objects
    that do not fit are one-line errors naming the key they stand for."""
    import pdeformer as pf
    from pdeformer.tools.errors import ConfigError
    model, prompt, disc = small()
    sol = pf.solve(model, [prompt, pf.GaussianMixture(means=[[0, 1]], covs=[0.4], name="b")], disc)
    assert [s.name for s in sol] == ["prompt0", "b"]
    assert sol[0].plot(str(tmp_path / "d.png")) == str(tmp_path / "d.png") and (tmp_path / "d.png").stat().st_size
    assert sol[1].write_vtk(str(tmp_path / "vtk")) == [str(tmp_path / "vtk" / "density_b.pvd")]
    with pytest.raises(ConfigError, match=r"prompts\[0\].covs"):
        pf.solve(model, pf.GaussianMixture(means=[[0, 0]], covs=[-1.0]), disc)
    with pytest.raises(ConfigError, match="model.params: the model's tokens are 3-D, the mesh's 2-D"):
        pf.solve(pf.Transformer.random(layers=1, heads=1, dim=3), prompt, disc)
    with pytest.raises(ConfigError, match="model.params: Q"):
        pf.Transformer({"attention": {"Q": np.zeros((1, 1, 2, 2)), "K": np.zeros((1, 1, 2, 2)),
                                      "V": np.zeros((1, 1, 3, 3))}})


def test_train_takes_the_steps_of_the_train_command(tmp_path):
    """pf.train and ``pdeformer train`` on the equivalent TOML (gd with weight decay and
    Langevin noise, fixed steps per layer) give the same history and trained heads to
    1e-12 (one Trainer); the given model is left as it was."""
    import pdeformer as pf
    model = pf.Transformer.random(layers=2, heads=3, dim=2, seed=0, init_scale=0.8)
    before = {n: a.copy() for n, a in model.params["attention"].items()}
    prompt = pf.GaussianMixture(weights=[0.5, 0.5], means=[[-1, 0], [1, 0.5]], covs=[0.3, 0.2], name="a")
    disc = pf.DG(pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[12, 12]), degree=1, limiter=True,
                 steps_per_layer=8)
    objective = pf.Moments(mean=[0, 0], cov=[[0.5, 0], [0, 0.5]])
    trained = pf.train(objective, model, [prompt], disc, steps=3, lr=0.05, weight_decay=0.1,
                       temperature=1e-6, seed=4, frames_per_layer=2)
    assert trained.risk.shape == (4,) and trained.risk[-1] < trained.risk[0]
    for n, a in model.params["attention"].items():
        np.testing.assert_array_equal(a, before[n])
    np.savez(tmp_path / "heads.npz", **before)
    cfg = write_config(tmp_path, toml_of({}, 8) + "[train]\nsteps = 3\nlr = 0.05\nweight_decay = 0.1\n"
                       "temperature = 1e-6\nseed = 4\n")
    run_cli(["train", cfg], cwd=str(tmp_path))
    with open(tmp_path / "out" / "history.csv") as f:
        rows = [line.split(",") for line in f.read().split()]
    cli = {c: np.array([float(r[i]) for r in rows[1:]]) for i, c in enumerate(rows[0])}
    for c in ("risk", "penalty", "grad_norm", "displacement"):
        np.testing.assert_allclose(trained.history[c], cli[c], rtol=1e-12, atol=1e-15, err_msg=c)
    last = np.load(tmp_path / "out" / "params_0003.npz")
    for n, a in trained.model.params["attention"].items():
        np.testing.assert_allclose(a, last[n], rtol=0, atol=1e-13 * np.abs(a).max())


def test_train_restarts_from_its_checkpoint(tmp_path):
    """pf.train(steps=2, outdir) then pf.train(steps=4, outdir, restart=True) reaches the
    history and parameters of one run of 4 steps, adam's state and the minibatches'
    random state included: the parameters are the checkpoint's, not the model given
    (another draw here); restart without outdir, or from a checkpoint of another
    problem, is refused."""
    import pdeformer as pf
    from pdeformer.tools.errors import ConfigError, InputError
    model = pf.Transformer.random(layers=2, heads=2, dim=2, seed=1, init_scale=0.8)
    prompts = [pf.GaussianMixture(weights=[1.0], means=[[x, 0]], covs=[0.3], name=f"p{i}")
               for i, x in enumerate((-0.5, 0.0, 0.5))]
    disc = pf.DG(pf.BoxMesh(lower=[-4, -4], upper=[4, 4], cells=[8, 8]), degree=1, steps_per_layer=2)
    objective = pf.Moments(mean=[0, 0], cov=0.5)
    kw = dict(lr=0.05, optimizer="adam", batch_size=2, seed=3)
    whole = pf.train(objective, model, prompts, disc, steps=4, **kw)
    pf.train(objective, model, prompts, disc, steps=2, outdir=str(tmp_path), **kw)
    other = pf.Transformer.random(layers=2, heads=2, dim=2, seed=2, init_scale=0.8)
    resumed = pf.train(objective, other, prompts, disc, steps=4, outdir=str(tmp_path), restart=True, **kw)
    for c in ("risk", "grad_norm", "step_size", "displacement"):
        np.testing.assert_allclose(resumed.history[c], whole.history[c], rtol=1e-12, atol=1e-15, err_msg=c)
    for n, a in whole.model.params["attention"].items():
        np.testing.assert_allclose(resumed.model.params["attention"][n], a, rtol=0, atol=1e-13)
    with pytest.raises(ConfigError, match="^restart: .*give outdir"):
        pf.train(objective, model, prompts, disc, steps=4, restart=True, **kw)
    with pytest.raises(InputError, match="another problem"):
        pf.train(pf.Moments(mean=[1, 0], cov=0.5), model, prompts, disc, steps=4, outdir=str(tmp_path),
                 restart=True, **kw)
