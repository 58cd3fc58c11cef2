"""Weighted heads: layer l's velocity sum_h w_{l,h} Gamma_h instead of the 1/H mean, the
weights fixed (not trained). A weighted model is the unweighted one with V_h scaled by
H w_h (forward, gradient, particles); weights read from parameter files, checked as bad
input, and kept in the files a training writes."""

from __future__ import annotations

import numpy as np
import pytest

from conftest import check_one_line_error, requires_dolfinx, run_cli, write_config

pytestmark = [requires_dolfinx, pytest.mark.filterwarnings("ignore")]

WEIGHTS = np.array([[0.5, 0.5, 0.0], [0.2, 0.7, 0.1]])


def models():
    """(weighted, the same heads unweighted with V_h scaled by H w_h)."""
    import pdeformer as pf
    heads = pf.Transformer.random(layers=2, heads=3, dim=2, seed=4, init_scale=0.7).params["attention"]
    scaled = dict(heads, V=heads["V"] * (3 * WEIGHTS)[:, :, None, None])
    return pf.Transformer({"attention": {**heads, "weights": WEIGHTS}}), pf.Transformer({"attention": scaled})


def setting():
    import pdeformer as pf
    prompt = pf.GaussianMixture(weights=[0.6, 0.4], means=[[-0.5, 0.2], [0.6, -0.3]], covs=[0.3, 0.2])
    mesh = pf.BoxMesh(lower=[-3, -3], upper=[3, 3], cells=[10, 10])
    return prompt, pf.DG(mesh, degree=1, steps_per_layer=6), pf.Moments(mean=[0, 0], cov=0.3)


def test_weighted_heads_are_the_heads_with_scaled_values():
    """Forward moments and the gradient of the weighted model equal those of the
    unweighted model with V_h scaled by H w_h: dQ, dK the same, dV_h = H w_h dV'_h (a
    head of weight 0 has no gradient); the particle model likewise; to 1e-12."""
    import pdeformer as pf
    weighted, scaled = models()
    assert weighted.weights is not None and "weights" not in weighted.params["attention"]
    prompt, disc, objective = setting()
    a, b = (pf.solve(m, prompt, disc, backend="direct") for m in (weighted, scaled))
    np.testing.assert_allclose(a.cov, b.cov, rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(a.mean, b.mean, rtol=1e-12, atol=1e-14)
    (ra, ga), (rb, gb) = (pf.value_and_grad(objective, m, [prompt], disc, backend="direct")
                          for m in (weighted, scaled))
    assert ra == pytest.approx(rb, rel=1e-12)
    scale = (3 * WEIGHTS)[:, :, None, None]
    for n, want in (("Q", gb["attention"]["Q"]), ("K", gb["attention"]["K"]), ("V", scale * gb["attention"]["V"])):
        np.testing.assert_allclose(ga["attention"][n], want, rtol=1e-11, atol=1e-14 * np.abs(want).max(), err_msg=n)
    assert np.all(ga["attention"]["V"][0, 2] == 0) and np.all(ga["attention"]["Q"][0, 2] == 0)
    tokens = pf.Particles(tokens=300, seed=2, steps_per_layer=4)
    pa, pb = (pf.solve(m, prompt, tokens, backend="direct") for m in (weighted, scaled))
    np.testing.assert_allclose(pa.mean, pb.mean, rtol=1e-12, atol=1e-14)


def test_bad_weights_are_one_line_errors(tmp_path):
    """Weights of the wrong shape, negative, or not summing to 1 over a layer: the Python
    API raises a ConfigError naming model.params.weights; a params file with
    them ends the command with one line naming the file, exit status 2."""
    import re
    import pdeformer as pf
    from pdeformer.tools.errors import ConfigError
    heads = pf.Transformer.random(layers=2, heads=3, dim=2, seed=4).params["attention"]
    bad = {"shape (3, 2)": np.full((3, 2), 0.5), "finite weights >= 0": [[1.5, -0.5, 0], [1, 0, 0]],
           "layer 1's weights sum to 0.9": [[1, 0, 0], [0.3, 0.3, 0.3]]}
    config = write_config(tmp_path, CONFIG.replace("PARAMS", str(tmp_path / "heads.npz")))
    for why, w in bad.items():
        with pytest.raises(ConfigError, match="^model.params.weights: .*" + re.escape(why)):
            pf.Transformer({"attention": {**heads, "weights": w}})
        np.savez(tmp_path / "heads.npz", **heads, weights=w)
        check_one_line_error(run_cli(["forward", config], cwd=str(tmp_path), check=False),
                             f"model.params: {tmp_path / 'heads.npz'}: weights: ")


CONFIG = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [8, 8]
[discretisation]
steps_per_layer = 4
[model]
params = "PARAMS"
[attention]
backend = "direct"
[objective]
kind = "moments"
[train]
steps = 2
lr = 0.05
[output]
dir = "out"
fields = false
plots = false
[[prompts]]
name = "a"
kind = "gaussian_mixture"
means = [[0.2, -0.1]]
covs = [0.3]
target = { mean = [0.0, 0.0], cov = 0.3 }
"""


def test_a_params_file_s_weights_are_used_and_kept_by_training(tmp_path):
    """A params file holding weights runs the weighted model (the risk of pf.value_and_grad
    on the same heads, 1e-12); training moves Q, K, V and writes the weights unchanged
    into every params_XXXX.npz, so the trained file is the trained weighted model."""
    import json
    import pdeformer as pf
    weighted, _ = models()
    np.savez(tmp_path / "heads.npz", **weighted.params["attention"], weights=weighted.weights)
    config = write_config(tmp_path, CONFIG.replace("PARAMS", str(tmp_path / "heads.npz")))
    run_cli(["train", config], cwd=str(tmp_path))
    with open(tmp_path / "out" / "history.csv") as f:
        first = float(f.read().splitlines()[1].split(",")[1])
    prompt = pf.GaussianMixture(weights=[1.0], means=[[0.2, -0.1]], covs=[0.3])
    disc = pf.DG(pf.BoxMesh(lower=[-3, -3], upper=[3, 3], cells=[8, 8]), steps_per_layer=4)
    risk, _ = pf.value_and_grad(pf.Moments(mean=[0, 0], cov=0.3), weighted, [prompt], disc, backend="direct")
    assert first == pytest.approx(risk, rel=1e-12)
    for k in (0, 2):
        with np.load(tmp_path / "out" / f"params_{k:04d}.npz") as f:
            np.testing.assert_array_equal(f["weights"], WEIGHTS)
            moved = np.abs(f["V"] - weighted.params["attention"]["V"]).max()
            assert (moved > 0) == (k > 0)
    assert json.loads((tmp_path / "out" / "summary.json").read_text())["status"] == "completed"


def test_ntk_refuses_the_run_s_weighted_heads(tmp_path):
    """ntk's Gram matrix takes the 1/H mean of a layer's heads: with weighted run heads it
    stops with one line naming ntk.heads (exit 2) rather than ignoring the weights."""
    weighted, _ = models()
    np.savez(tmp_path / "heads.npz", **weighted.params["attention"], weights=weighted.weights)
    config = write_config(tmp_path, CONFIG.replace("PARAMS", str(tmp_path / "heads.npz")))
    proc = run_cli(["ntk", config, "--set", 'ntk.heads="run"'], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "ntk.heads: the run's heads are weighted")
