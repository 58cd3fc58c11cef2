"""Head measure, prompt densities and closed-form solutions (pure numpy)."""

import numpy as np
import pytest

from pdeformer.tools.errors import InputError
from pdeformer.model.exact import expm, uniform_attention_mean
from pdeformer.model.heads import HeadMeasure
from pdeformer.model.prompt_files import PointDensity
from pdeformer.model.prompts import GaussianMixture, UniformBox


def test_random_heads_are_reproducible_and_nested():
    a = HeadMeasure.random(3, 4, 2, 2, seed=5, scale=0.7)
    b = HeadMeasure.random(5, 9, 2, 2, seed=5, scale=0.7)
    np.testing.assert_array_equal(a.Q, b.Q[:3, :4])   # same heads whatever L and H
    np.testing.assert_array_equal(a.V, b.V[:3, :4])
    c = HeadMeasure.random(3, 4, 2, 2, seed=6, scale=0.7)
    assert not np.allclose(a.Q, c.Q)
    big = HeadMeasure.random(1, 4000, 1, 2, seed=0, scale=0.7)
    assert abs(big.V.std() - 0.7 / np.sqrt(2)) < 0.01     # N(0, scale^2/d)


def test_layer_of_and_save_load(tmp_path):
    h = HeadMeasure.random(4, 2, 3, 2, seed=1)
    assert [h.layer_of(t) for t in (0.0, 0.2499, 0.25, 0.99, 1.0)] == [0, 0, 1, 3, 3]
    h.save(str(tmp_path / "p.npz"))
    g = HeadMeasure.load(str(tmp_path / "p.npz"), 2)
    np.testing.assert_array_equal(g.K, h.K)
    A = g.attention_matrices(2)
    np.testing.assert_allclose(A[1], h.K[2, 1].T @ h.Q[2, 1])


def test_gaussian_mixture_moments():
    g = GaussianMixture([1.0, 3.0], [[0.0, 1.0], [1.0, -1.0]],
                        [np.eye(2) * 0.3, [[0.5, 0.1], [0.1, 0.2]]])
    x = np.stack(np.meshgrid(np.linspace(-6, 7, 521), np.linspace(-7, 7, 561)), -1).reshape(-1, 2)
    w = g.density(x) * (13 / 520) * (14 / 560)
    assert abs(w.sum() - 1) < 1e-9
    np.testing.assert_allclose(w @ x, g.mean(), atol=1e-9)
    m = g.mean()
    np.testing.assert_allclose(((x - m) * w[:, None]).T @ (x - m), g.cov(), atol=1e-8)


def test_uniform_box():
    u = UniformBox([-1.0, 0.0], [1.0, 0.5])
    assert u.density(np.array([[0.0, 0.2], [1.5, 0.2]])).tolist() == [1.0, 0.0]
    np.testing.assert_allclose(u.cov(), np.diag([4 / 12, 0.25 / 12]))


def test_point_density_files(tmp_path):
    pts = np.stack(np.meshgrid(np.linspace(-1, 1, 5), np.linspace(-1, 1, 5)), -1).reshape(-1, 2)
    vals = 2.0 + pts[:, 0] - pts[:, 1]          # linear: reproduced exactly inside the hull
    np.savez(tmp_path / "d.npz", points=pts, density=vals)
    p = PointDensity.read(str(tmp_path / "d.npz"), 2, "prompts[0].path")
    q = np.array([[0.3, -0.2], [0.9, 0.9], [3.0, 0.0]])
    np.testing.assert_allclose(p.density(q), [2.5, 2.0, 0.0], atol=1e-12)
    with open(tmp_path / "d.csv", "w") as f:
        f.write("x0,density\n0,1\n1,3\n2,1\n")
    p1 = PointDensity.read(str(tmp_path / "d.csv"), 1, "prompts[0].path")
    np.testing.assert_allclose(p1.density(np.array([[0.5], [-1.0]])), [2.0, 0.0])
    with pytest.raises(InputError, match=r"^prompts\[0\].path: .*header must be x0,x1,density"):
        PointDensity.read(str(tmp_path / "d.csv"), 2, "prompts[0].path")
    np.savez(tmp_path / "neg.npz", points=pts, density=vals - 5)
    with pytest.raises(InputError, match=">= 0"):
        PointDensity.read(str(tmp_path / "neg.npz"), 2, "prompts[0].path")
    with pytest.raises(InputError, match="none.npz: no such file"):
        PointDensity.read(str(tmp_path / "none.npz"), 2, "prompts[0].path")


def test_expm_and_uniform_attention_mean():
    rng = np.random.default_rng(2)
    M = rng.normal(size=(3, 3)) * 3
    w, U = np.linalg.eig(M)
    np.testing.assert_allclose(expm(M), (U @ np.diag(np.exp(w)) @ np.linalg.inv(U)).real, rtol=1e-11)
    h = HeadMeasure.random(2, 3, 2, 2, seed=0)
    m0 = np.array([0.5, -0.2])
    V0, V1 = h.V[0].mean(0), h.V[1].mean(0)
    np.testing.assert_allclose(uniform_attention_mean(h, m0, 0.25), expm(0.25 * V0) @ m0, rtol=1e-13)
    np.testing.assert_allclose(uniform_attention_mean(h, m0, 1.0),
                               expm(0.5 * V1) @ expm(0.5 * V0) @ m0, rtol=1e-13)
