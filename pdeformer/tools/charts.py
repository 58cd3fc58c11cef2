"""Charts of the circle and the sphere for pictures: the angle theta of a point of S^1
and the longitude and latitude (degrees) of a point of S^2 (numpy only: ``pdeformer plot``
uses them without the finite-element stack)."""

from __future__ import annotations

import numpy as np

CHART_BOX = {"circle": np.array([[-np.pi], [np.pi]]), "sphere": np.array([[-180.0, -90.0], [180.0, 90.0]])}


def chart(corners: np.ndarray, kind: str) -> np.ndarray:
    """Chart coordinates of points (cells, nodes, d) of a circle (the angle theta) or a
    sphere (longitude, latitude in degrees), (cells, nodes, 1 or 2): each cell's angles
    unwrapped to within pi (180 degrees) of each other (a node at a pole takes its
    cell's mean longitude), the cell's mean angle in [-pi, pi) (degrees: [-180, 180)).
    Single points are cells of one node."""
    x = corners
    period = 2 * np.pi if kind == "circle" else 360.0
    angle = np.arctan2(x[..., 1], x[..., 0])
    if kind == "sphere":
        angle = np.degrees(angle)
        r = np.linalg.norm(x, axis=-1)
        lat = np.degrees(np.arcsin(np.clip(x[..., 2] / r, -1, 1)))
        polar = np.abs(x[..., 2]) >= r * (1 - 1e-12)
        ref = np.take_along_axis(angle, np.argmax(~polar, axis=1)[:, None], axis=1)   # a non-polar node
    else:
        ref = angle[:, :1]
    angle = angle + period * np.round((ref - angle) / period)
    if kind == "sphere" and np.any(polar):
        mean = np.array([np.mean(a[~p]) if np.any(~p) else 0.0 for a, p in zip(angle, polar)])
        angle = np.where(polar, mean[:, None], angle)
    # the whole cell shifted so that its mean angle lies in [-period/2, period/2): the
    # same chart whatever node comes first
    angle -= period * np.floor(angle.mean(axis=1, keepdims=True) / period + 0.5)
    if kind == "circle":
        return angle[..., None]
    return np.stack([angle, lat], axis=-1)
