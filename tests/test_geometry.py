"""The tokens' geometries (pdeformer/model/geometry.py): Flat is the identity, the
sphere's projections and their reverse modes against finite differences, uniform draws,
charts of known points and the order parameter."""

from __future__ import annotations

import math

import numpy as np
import pytest
from mpi4py import MPI

from checks import assert_vjp
from pdeformer.model.geometry import (Flat, Sphere, geometry_of_config, geometry_of_points)

SPHERES = [Sphere(2, 1.0), Sphere(3, 1.0), Sphere(2, 0.3), Sphere(3, 2.5)]

# Central differences of a smooth function of O(1) arguments with step h err by
# h^2 |f'''| / 6 (truncation) plus eps |f| / h (rounding): at h = 1e-5 about 1e-10 +
# 1e-11 for the maps below, whose derivatives at |x| ~ 1 are O(1) (O(R) and O(1/|x|)
# factors stay within 10). 1e-7 relative leaves a margin of 100 on either.
STEP = 1e-5
FD_RTOL = 1e-7


def points_off_the_sphere(d: int, n: int = 7, seed: int = 0) -> np.ndarray:
    """n points with |x| in [0.5, 2] (not on the sphere, so that the maps' x-dependence shows)."""
    rng = np.random.default_rng(seed)
    u = rng.standard_normal((n, d))
    return u / np.linalg.norm(u, axis=1)[:, None] * rng.uniform(0.5, 2.0, (n, 1))


def test_flat_is_the_identity():
    rng = np.random.default_rng(1)
    flat = Flat(3)
    x, v, g = rng.normal(size=(3, 5, 3))
    assert flat.project(x) is x and flat.project_vjp(x, g) is g
    assert flat.tangential(x, v) is v and flat.tangential_vjp(x, g) is g
    assert flat.radial(x, v) is None and flat.tangential_position_vjp(x, v, None, g) == 0.0
    assert np.array_equal(flat.chart(x[None]), x[None])
    assert np.array_equal(flat.chart_box(x), np.stack([x.min(axis=0), x.max(axis=0)]))
    assert flat.order_parameter(x, np.ones(5), MPI.COMM_SELF) == {}
    assert (flat.name, flat.chart_name, flat.radius, flat.projects) == ("flat", "", None, False)


@pytest.mark.parametrize("sphere", SPHERES, ids=str)
def test_the_projection_lands_on_the_sphere_and_is_idempotent(sphere):
    x = points_off_the_sphere(sphere.dim)
    y = sphere.project(x)
    assert np.allclose(np.linalg.norm(y, axis=1), sphere.radius, rtol=1e-15, atol=0)
    assert np.allclose(sphere.project(y), y, rtol=0, atol=4e-16 * sphere.radius)
    assert np.allclose(y / sphere.radius, x / np.linalg.norm(x, axis=1)[:, None], atol=1e-15)


@pytest.mark.parametrize("sphere", SPHERES, ids=str)
def test_the_tangential_part_is_orthogonal_to_x_and_a_projection(sphere):
    rng = np.random.default_rng(2)
    x = points_off_the_sphere(sphere.dim)
    v = rng.normal(size=x.shape)
    t = sphere.tangential(x, v)
    scale = np.linalg.norm(v, axis=1) * np.linalg.norm(x, axis=1)
    assert np.all(np.abs(np.einsum("nd,nd->n", t, x)) <= 1e-15 * scale)
    assert np.allclose(sphere.tangential(x, t), t, atol=1e-15)
    # what it leaves out is the radial part: v = P_x v + <v, u> u
    u = x / np.linalg.norm(x, axis=1)[:, None]
    assert np.allclose(t + sphere.radial(x, v)[:, None] * u, v, atol=1e-15)


@pytest.mark.parametrize("sphere", SPHERES, ids=str)
def test_the_reverse_modes_match_central_differences(sphere):
    """project_vjp: d/dx <ybar, R x/|x|>; tangential_vjp: <g, P_x v> = <P_x g, v>;
    tangential_position_vjp: d/dx <g, P_x w> with w fixed."""
    rng = np.random.default_rng(3)
    x = points_off_the_sphere(sphere.dim)
    ybar, g, w = rng.normal(size=(3,) + x.shape)
    assert_vjp(sphere.project, sphere.project_vjp(x, ybar), x, ybar, STEP, FD_RTOL)
    assert np.sum(g * sphere.tangential(x, w)) == pytest.approx(np.sum(sphere.tangential_vjp(x, g) * w), rel=1e-14)
    v, radial = sphere.tangential(x, w), sphere.radial(x, w)
    assert_vjp(lambda z: sphere.tangential(z, w), sphere.tangential_position_vjp(x, v, radial, g), x, g, STEP, FD_RTOL)


@pytest.mark.parametrize("sphere", SPHERES, ids=str)
def test_uniform_draws_lie_on_the_sphere_with_mean_near_zero(sphere):
    """Each coordinate of a uniform point of the sphere has mean 0 and variance R^2/d, so
    the mean of n draws has standard deviation R / sqrt(d n) per coordinate: at n =
    40,000, 5 of those (a chance of 6e-7 each to exceed, seeded anyway)."""
    n = 40_000
    x = sphere.sample_uniform(n, np.random.default_rng(4))
    assert x.shape == (n, sphere.dim)
    assert np.allclose(np.linalg.norm(x, axis=1), sphere.radius, rtol=1e-15, atol=0)
    assert np.all(np.abs(x.mean(axis=0)) < 5 * sphere.radius / math.sqrt(sphere.dim * n))
    # the second moment R^2/d I, to 5 standard deviations of its entries (<= R^2/sqrt(n))
    assert np.allclose(x.T @ x / n, sphere.radius ** 2 / sphere.dim * np.eye(sphere.dim),
                       atol=5 * sphere.radius ** 2 / math.sqrt(n))


def test_flat_uniform_draws_fill_the_unit_cube():
    """Uniform in [0, 1)^d: mean 1/2, standard deviation sqrt(1/12 n) of the mean."""
    n = 40_000
    x = Flat(2).sample_uniform(n, np.random.default_rng(5))
    assert x.shape == (n, 2) and x.min() >= 0 and x.max() < 1
    assert np.all(np.abs(x.mean(axis=0) - 0.5) < 5 * math.sqrt(1 / (12 * n)))


def test_charts_of_known_points():
    """The circle's angle and the sphere's longitude and latitude (degrees) of points
    whose angles are known, one point a cell; the boxes the pictures show."""
    circle = Sphere(2, 2.0)
    x = 2.0 * np.array([[1.0, 0.0], [0.0, 1.0], [-1.0, 1e-300], [0.5, -0.5 * math.sqrt(3)]])
    theta = circle.chart(x[:, None, :])[:, 0, 0]
    assert np.allclose(theta, [0.0, math.pi / 2, -math.pi, -math.pi / 3], atol=1e-15)
    sphere = Sphere(3, 1.5)
    y = 1.5 * np.array([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0], [1 / math.sqrt(2), 0.0, 1 / math.sqrt(2)],
                        [0.0, -0.5, -0.5 * math.sqrt(3)], [0.0, 0.0, 1.0]])
    lon_lat = sphere.chart(y[:, None, :])[:, 0, :]
    assert np.allclose(lon_lat, [[0, 0], [90, 0], [0, 45], [-90, -60], [0, 90]], atol=1e-12)
    assert np.array_equal(circle.chart_box(theta[:, None]), [[-math.pi], [math.pi]])
    assert np.array_equal(sphere.chart_box(lon_lat), [[-180, -90], [180, 90]])
    assert (circle.name, circle.chart_name, sphere.name, sphere.chart_name) == ("circle", "circle", "sphere", "sphere")


def test_the_order_parameter_of_a_point_mass_and_of_the_uniform_density():
    """One point mass: order 1 and every Fourier amplitude 1; n equispaced points of the
    circle (the uniform density's midpoint rule, exact for modes below n): 0."""
    comm = MPI.COMM_SELF
    circle = Sphere(2, 3.0)
    one = circle.order_parameter(np.array([[0.0, 3.0]]), np.array([0.7]), comm)
    assert one == pytest.approx({"order": 1.0, "fourier_1": 1.0, "fourier_2": 1.0, "fourier_3": 1.0}, rel=1e-15)
    theta = 2 * np.pi * np.arange(16) / 16
    spread = circle.order_parameter(3.0 * np.c_[np.cos(theta), np.sin(theta)], np.full(16, 1 / 16), comm)
    assert max(spread.values()) < 1e-15
    sphere = Sphere(3, 1.0)
    octahedron = np.vstack([np.eye(3), -np.eye(3)])
    assert sphere.order_parameter(octahedron, np.ones(6), comm) == {"order": pytest.approx(0.0, abs=1e-16)}


def test_a_mesh_or_a_config_gives_the_geometry():
    comm = MPI.COMM_SELF
    u = points_off_the_sphere(3)
    u /= np.linalg.norm(u, axis=1)[:, None]
    assert geometry_of_points(comm, 2.0 * u, manifold=True) == Sphere(3, pytest.approx(2.0, rel=1e-15))
    assert geometry_of_points(comm, 2.0 * u * (1 + 1e-6 * np.arange(7))[:, None], manifold=True) is None
    assert geometry_of_points(comm, u[:, :2], manifold=False) == Flat(2)
    assert geometry_of_config({"shape": "box", "lower": [0, 0, 0], "upper": [1, 1, 1]}) == Flat(3)
    assert geometry_of_config({"shape": "circle", "cells": [8], "radius": 2.0}) == Sphere(2, 2.0)
    assert geometry_of_config({"shape": "sphere", "refinements": 1, "radius": 1.0}) == Sphere(3, 1.0)
    assert geometry_of_config({"file": "m.xdmf", "name": "mesh"}) is None
    from pdeformer.api.objects import BoxMesh, CircleMesh, MeshFile, SphereMesh
    assert BoxMesh([0, 0], [1, 1], [4, 4]).geometry == Flat(2)
    assert CircleMesh(8, radius=2.0).geometry == Sphere(2, 2.0)
    assert SphereMesh(1).geometry == Sphere(3, 1.0) and MeshFile("m.xdmf").geometry is None
    assert Sphere(2, 2.0).area == pytest.approx(4 * math.pi) and Sphere(3, 2.0).area == pytest.approx(16 * math.pi)
