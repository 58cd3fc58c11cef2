"""Weighted heads and head laws. Layer l's velocity sum_h w_{l,h} Gamma_h instead of the
1/H mean, the weights fixed (not trained): a weighted model is the unweighted one with
V_h scaled by H w_h (forward, gradient, particles); weights read from parameter files,
checked as bad input, and kept in the files a training writes. Random heads drawn from a
gaussian law with means, or i.i.d. from a file's weighted atoms."""

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


def test_ntk_of_weighted_heads_is_that_of_the_heads_repeated(tmp_path):
    """ntk's Gram matrix of a layer of weighted run heads is sum_j w_j J_j J_j^T: heads
    with weights 1/2, 1/4, 1/4 give the eigenvalues (1e-12) of the unweighted layer that
    holds the first head twice, whose Gram is the 1/H mean; the weights are not ignored
    (the same heads unweighted give other eigenvalues)."""
    import json
    rng = np.random.default_rng(3)
    Q, K, V = (0.7 * rng.normal(size=(1, 3, 2, 2)) for _ in range(3))
    repeat = [0, 0, 1, 2]
    files = {"weighted": dict(Q=Q, K=K, V=V, weights=[[0.5, 0.25, 0.25]]),
             "repeated": dict(Q=Q[:, repeat], K=K[:, repeat], V=V[:, repeat]),
             "unweighted": dict(Q=Q, K=K, V=V)}
    found = {}
    for name, arrays in files.items():
        np.savez(tmp_path / f"{name}.npz", **arrays)
        config = write_config(tmp_path, CONFIG.replace("PARAMS", str(tmp_path / f"{name}.npz")), f"{name}.toml")
        run_cli(["ntk", config, "--set", 'ntk.heads="run"', 'ntk.params="all"', f"output.dir={tmp_path}/{name}"],
                cwd=str(tmp_path))
        found[name] = np.array(json.loads((tmp_path / name / "ntk.json").read_text())["ntk"]["eigenvalues"])
    assert found["weighted"][0] > 0
    np.testing.assert_allclose(found["weighted"], found["repeated"], rtol=1e-12, atol=1e-14 * found["weighted"][0])
    assert np.abs(found["weighted"] - found["unweighted"]).max() > 1e-3 * found["weighted"][0]


# ------------------------------------------------------------------ head laws

def heads_of(tmp_path, model_table: str):
    """The heads ``[model]`` gives (the CLI's path: config checked, heads built)."""
    from pdeformer.model.config import load_config
    from pdeformer.model.schema import options
    from pdeformer.solvers.problem import build_heads
    from mpi4py import MPI
    text = CONFIG.replace('params = "PARAMS"', model_table)
    return build_heads(MPI.COMM_SELF, options(load_config(write_config(tmp_path, text))).model, 2)


def test_gaussian_law_with_means_is_the_centred_draw_moved(tmp_path):
    """query_mean, key_mean, value_mean move every head of the centred draw by the same
    matrices, from the config and from pf.Transformer.random alike."""
    import pdeformer as pf
    from pdeformer.model.heads import HeadMeasure
    means = {"query_mean": [[0.5, 0.0]], "key_mean": [[0.0, 1.0]], "value_mean": [[1.0, 0.2], [0.0, -1.0]]}
    table = "layers = 2\nheads = 3\nkey_dim = 1\nseed = 4\n" + "".join(f"{k} = {v}\n" for k, v in means.items())
    h = heads_of(tmp_path, table)
    centred = HeadMeasure.random(2, 3, 1, 2, seed=4)
    api = pf.Transformer.random(layers=2, heads=3, dim=2, key_dim=1, seed=4, **means).params["attention"]
    for n, key in zip("QKV", means):
        np.testing.assert_allclose(getattr(h, n), getattr(centred, n) + np.array(means[key]), rtol=0, atol=1e-15)
        np.testing.assert_array_equal(api[n], getattr(h, n))


def test_atoms_law_draws_each_atom_with_its_weight(tmp_path):
    """H = 4000 heads per layer from 3 atoms of weights (0.5, 0.5, 0) and (0.2, 0.2, 0.6):
    every head is an atom, each atom's share within 4 binomial standard deviations of
    its weight (an atom of weight 0 never drawn); the first H heads of a larger draw are
    the same heads."""
    rng = np.random.default_rng(0)
    atoms = {n: rng.normal(size=(2, 3) + shape) for n, shape in (("Q", (2, 2)), ("K", (2, 2)), ("V", (2, 2)))}
    weights = np.array([[0.5, 0.5, 0.0], [0.2, 0.2, 0.6]])
    np.savez(tmp_path / "atoms.npz", **atoms, weights=weights)
    h = heads_of(tmp_path, 'layers = 2\nheads = 4000\nseed = 1\nlaw = "atoms"\natoms = "atoms.npz"\n')
    H = 4000
    for l in range(2):
        which = np.array([[np.array_equal(h.V[l, i], atoms["V"][l, j]) and np.array_equal(h.Q[l, i], atoms["Q"][l, j])
                           for j in range(3)] for i in range(H)])
        assert np.all(which.sum(axis=1) == 1), l
        share = which.mean(axis=0)
        assert np.all(np.abs(share - weights[l]) <= 4 * np.sqrt(weights[l] * (1 - weights[l]) / H)), (l, share)
    few = heads_of(tmp_path, 'layers = 2\nheads = 5\nseed = 1\nlaw = "atoms"\natoms = "atoms.npz"\n')
    np.testing.assert_array_equal(few.V, h.V[:, :5])


@pytest.mark.parametrize("model_table, expected", [
    ('layers = 2\nheads = 2\nlaw = "atoms"', "model.atoms: missing: law = 'atoms'"),
    ('layers = 2\nheads = 2\natoms = "atoms.npz"', "model.atoms: given, but model.law is 'gaussian'"),
    ('layers = 2\nheads = 2\nlaw = "atoms"\natoms = "atoms.npz"\nvalue_mean = [[1.0, 0.0], [0.0, 1.0]]',
     "model.value_mean: given, but model.law is 'atoms'"),
    ('params = "atoms.npz"\nquery_mean = [[1.0, 0.0], [0.0, 1.0]]', "model.query_mean: the heads are read"),
    ('layers = 2\nheads = 2\nvalue_mean = [[1.0, 0.0]]', "model.value_mean: shape (1, 2), expected (2, 2)"),
    ('layers = 3\nheads = 2\nlaw = "atoms"\natoms = "atoms.npz"', "model.atoms: "),
    ('layers = 2\nheads = 2\nlaw = "atoms"\natoms = "none.npz"', "model.atoms: "),
])
def test_bad_laws_are_one_line_errors(tmp_path, model_table, expected):
    """A law's keys without the law, a law beside heads that are read, means of the wrong
    shape, an atoms file of another depth or none: one line naming the key, exit 2."""
    np.savez(tmp_path / "atoms.npz", Q=np.zeros((2, 3, 2, 2)), K=np.zeros((2, 3, 2, 2)), V=np.zeros((2, 3, 2, 2)))
    config = write_config(tmp_path, CONFIG.replace('params = "PARAMS"', model_table))
    check_one_line_error(run_cli(["forward", config], cwd=str(tmp_path), check=False), expected)


LAW_RUN = """
[mesh]
lower = [-3.0, -3.0]
upper = [3.0, 3.0]
cells = [16, 16]
[discretisation]
limiter = false
[model]
layers = 2
heads = 2
LAW
[attention]
backend = "direct"
[output]
fields = false
plots = false
[[prompts]]
kind = "gaussian_mixture"
means = [[0.3, -0.2]]
covs = [[[0.2, 0.03], [0.03, 0.15]]]
"""


@pytest.mark.parametrize("law", [
    'query_mean = [[0.6, 0.0], [0.1, 0.6]]\nkey_mean = [[0.8, 0.2], [0.0, 0.8]]\n'
    'value_mean = [[0.5, -0.3], [0.3, 0.5]]\ninit_scale = 1e-7',
    'law = "atoms"\natoms = "atoms.npz"',
])
def test_expectation_reference_of_a_law_is_its_mean_field_limit(tmp_path, law):
    """converge's `expectation` reference for a law that moves the prompt: a gaussian law
    of almost no spread around its means (every head is the mean head), or atoms of which
    one has all the weight (every head is that atom). Each finite H then is its own
    limit, so the errors against the closed form are DG-1's on 16^2 (mean 1.1e-3, cov
    1.4e-3, the density's L2 2.7e-2), while the limit itself moves the prompt's mean by
    more than 0.2."""
    import csv
    import json
    np.savez(tmp_path / "atoms.npz", Q=np.array([[[[0.6, 0.0], [0.1, 0.6]]] * 2] * 2),
             K=np.array([[[[0.8, 0.2], [0.0, 0.8]]] * 2] * 2), V=np.array([[[[0.5, -0.3], [0.3, 0.5]], np.eye(2)]] * 2),
             weights=[[1.0, 0.0], [1.0, 0.0]])
    write_config(tmp_path, LAW_RUN.replace("LAW", law), "run.toml")
    study = write_config(tmp_path, '[study]\nrun = "run.toml"\nparameter = "model.heads"\nvalues = [2, 4]\n'
                         'reference = "expectation"\nquantities = ["mean", "cov", "l2"]\n', "study.toml")
    run_cli(["converge", study, "--set", f"output.dir={tmp_path}/out"], cwd=str(tmp_path))
    with open(tmp_path / "out" / "convergence.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    bound = {"mean": 3e-3, "cov": 3e-3, "l2": 0.05}
    assert len(rows) == 6 and all(float(r["error"]) < bound[r["quantity"]] for r in rows), rows
    with open(tmp_path / "out" / "summary.json") as f:
        assert "mean head" in json.load(f)["reference"]
    from pdeformer.model.exact import mean_head_moments
    m1, _ = mean_head_moments(([[0.6, 0.0], [0.1, 0.6]], [[0.8, 0.2], [0.0, 0.8]], [[0.5, -0.3], [0.3, 0.5]]),
                              2, np.array([0.3, -0.2]), np.array([[0.2, 0.03], [0.03, 0.15]]))
    assert np.linalg.norm(m1 - [0.3, -0.2]) > 0.2


def test_atoms_reference_is_the_atoms_own_weighted_run(tmp_path):
    """converge with reference = 'atoms': the reference is the run whose heads are the
    atoms, weighted (read back here from a forward run of the atoms file), and each case's
    mean error is its distance to that run's final mean; the reference is refused for a
    law that is not of atoms."""
    import csv
    import json
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "atoms.npz", Q=0.6 * rng.normal(size=(2, 3, 2, 2)), K=0.6 * rng.normal(size=(2, 3, 2, 2)),
             V=0.5 * rng.normal(size=(2, 3, 2, 2)), weights=[[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    write_config(tmp_path, LAW_RUN.replace("LAW", 'law = "atoms"\natoms = "atoms.npz"\nseed = 2'), "run.toml")
    study = write_config(tmp_path, '[study]\nrun = "run.toml"\nparameter = "model.heads"\nvalues = [4, 64]\n'
                         'reference = "atoms"\nquantities = ["mean", "cov"]\n', "study.toml")
    run_cli(["converge", study, "--set", f"output.dir={tmp_path}/out"], cwd=str(tmp_path))
    with open(tmp_path / "out" / "convergence.csv", newline="") as f:
        found = {(r["value"], r["quantity"]): float(r["error"]) for r in csv.DictReader(f)}
    law = LAW_RUN.replace("LAW", 'law = "atoms"\natoms = "atoms.npz"\nseed = 2')
    own = LAW_RUN.replace("LAW", 'params = "atoms.npz"').replace("layers = 2\nheads = 2\n", "")
    means = {}
    for name, text, sets in (("ref", own, []), ("h4", law, ["model.heads=4"])):
        config = write_config(tmp_path, text, f"{name}.toml")
        run_cli(["forward", config, "--set", f"output.dir={tmp_path}/{name}", *sets], cwd=str(tmp_path))
        summary = json.loads((tmp_path / name / "summary.json").read_text())
        means[name] = np.array(summary["final_diagnostics"][0]["mean"])
    assert found[("4", "mean")] == pytest.approx(np.linalg.norm(means["h4"] - means["ref"]), rel=1e-9)
    assert found[("64", "mean")] < found[("4", "mean")]
    write_config(tmp_path, LAW_RUN.replace("LAW", ""), "run.toml")
    proc = run_cli(["converge", study, "--set", f"output.dir={tmp_path}/no"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "study.reference: 'atoms' needs heads drawn from atoms")


def test_bias_quantities_are_the_members_deviations_along_their_mean(tmp_path):
    """mean_bias and cov_bias over 3 members: ensemble.csv gives each member's deviation
    along one direction per quantity, no longer than the member's own error (which
    `mean` reports); the table's error is their mean; an ensemble of 2 is refused."""
    import csv
    rng = np.random.default_rng(5)
    np.savez(tmp_path / "atoms.npz", Q=0.6 * rng.normal(size=(2, 3, 2, 2)), K=0.6 * rng.normal(size=(2, 3, 2, 2)),
             V=0.5 * rng.normal(size=(2, 3, 2, 2)), weights=[[0.2, 0.5, 0.3], [0.6, 0.1, 0.3]])
    write_config(tmp_path, LAW_RUN.replace("LAW", 'law = "atoms"\natoms = "atoms.npz"\nseed = 2'), "run.toml")
    study = write_config(tmp_path, '[study]\nrun = "run.toml"\nparameter = "model.heads"\nvalues = [2, 4]\n'
                         'reference = "atoms"\nseeds = 3\nquantities = ["mean", "mean_bias", "cov_bias"]\n',
                         "study.toml")
    run_cli(["converge", study, "--set", f"output.dir={tmp_path}/out"], cwd=str(tmp_path))
    with open(tmp_path / "out" / "ensemble.csv", newline="") as f:
        members = {(r["value"], r["member"], r["quantity"]): float(r["error"]) for r in csv.DictReader(f)}
    with open(tmp_path / "out" / "convergence.csv", newline="") as f:
        rows = {(r["value"], r["quantity"]): float(r["error"]) for r in csv.DictReader(f)}
    for value in ("2", "4"):
        for q in ("mean_bias", "cov_bias"):
            along = [members[(value, str(j), q)] for j in range(3)]
            assert rows[(value, q)] == pytest.approx(np.mean(along), rel=1e-12, abs=1e-15)
        for j in range(3):
            assert abs(members[(value, str(j), "mean_bias")]) <= members[(value, str(j), "mean")] * (1 + 1e-12)
    assert rows[("2", "mean_bias")] > 0
    proc = run_cli(["converge", study, "--set", "study.seeds=2", f"output.dir={tmp_path}/two"],
                   cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "study.quantities: 'mean_bias' is a mean over an ensemble: it needs study.seeds >= 3")
