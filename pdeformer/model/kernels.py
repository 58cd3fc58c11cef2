r"""Attention kernels: what the attention term sums, apart from how it is summed (the
summation backends of :mod:`pdeformer.model.velocity`).

A kernel turns a layer's heads into the matrices its sums take, sums them directly at
the targets, and gives the reverse mode of both. The softmax kernel (design §1),

    w(x) = (1/H) sum_h V_h  int y e^{<b, y>} rho(dy) / int e^{<b, y>} rho(dy),   b = beta A_h x,

is the gradient of the log-Laplace transform Lambda_rho at b: its sums can be tabulated
in b (``tabulated``), which the ``laplace`` and ``auto`` backends do. A kernel whose sums
are no Laplace transform leaves ``tabulated`` False and is summed directly.
"""

from __future__ import annotations

import numpy as np

from ..attention.softmax import Sources, VelocityCotangent, attention_velocity, attention_velocity_vjp

KERNELS: dict[str, type] = {}


def register_kernel(cls):
    """Make a kernel known by its ``name`` (``[attention] kernel``); it is built from the
    ``[attention]`` options by its classmethod ``from_options``."""
    KERNELS[cls.name] = cls
    return cls


@register_kernel
class Softmax:
    """Softmax attention with inverse temperature ``beta`` (``[attention] beta``): the
    scores beta <A_h x, y>, A_h = K_h^T Q_h."""

    name = "softmax"
    tabulated = True

    def __init__(self, beta: float = 1.0):
        self.beta = beta

    @classmethod
    def from_options(cls, attention) -> "Softmax":
        """The kernel of the ``[attention]`` options (their ``beta``)."""
        return cls(attention.beta)

    def matrices(self, heads, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """beta A_h and V_h of ``layer`` (H, d, d) each."""
        A = heads.attention_matrices(layer)
        return (A if self.beta == 1 else self.beta * A), heads.values(layer)

    def matrices_vjp(self, ct: VelocityCotangent) -> VelocityCotangent:
        """The cotangent of A_h from that of the scaled matrix beta A_h."""
        if self.beta != 1:
            ct.A = self.beta * ct.A
        return ct

    def velocity(self, x: np.ndarray, sources: Sources, A: np.ndarray, V: np.ndarray,
                 chunk_mb: float) -> np.ndarray:
        """w at the targets x (n, d), every target meeting every source."""
        return attention_velocity(x, sources, A, V, chunk_mb=chunk_mb)

    def velocity_vjp(self, x, points, weights, A, V, g, chunk_mb: float, positions: bool) -> VelocityCotangent:
        """Cotangents of <g, w> (:func:`~pdeformer.attention.softmax.attention_velocity_vjp`)."""
        return attention_velocity_vjp(x, points, weights, A, V, g, chunk_mb=chunk_mb, positions=positions)
