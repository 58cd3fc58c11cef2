"""The attention velocity on the mesh: kernel sources from rho, targets at velocity nodes.

v_t[rho](x) = (1/H) sum_h V_h grad Lambda_rho(A_h x) (design §1). Sources are rho's
quadrature points on every rank's owned cells, gathered on all ranks (each rank then
holds the whole density); targets are the rank's own nodes of the Lagrange velocity
space, so no rank computes another's values and the result does not depend on the
partition beyond summation order.
"""

from __future__ import annotations

import numpy as np

from ._dolfinx import owned_node_coordinates
from .attention import Sources, VelocityCotangent, attention_velocity, attention_velocity_vjp
from .heads import HeadMeasure


class AttentionVelocity:
    def __init__(self, W, heads: HeadMeasure, chunk_mb: float = 2.0):
        self.targets = owned_node_coordinates(W)
        self.heads = heads  # read at every call: training updates it in place
        self.chunk_mb = chunk_mb

    def __call__(self, sources: Sources, layer: int) -> np.ndarray:
        """Velocity of ``layer`` at the owned nodes, (n_nodes, d)."""
        return attention_velocity(self.targets, sources, self.heads.attention_matrices(layer),
                                  self.heads.values(layer), chunk_mb=self.chunk_mb)

    def vjp(self, points: np.ndarray, weights: np.ndarray, layer: int, g: np.ndarray
            ) -> VelocityCotangent:
        """Cotangents (source weights, A, V of ``layer``) of <g, v> for this rank's
        nodes; the weight part is summed over ranks by the caller."""
        return attention_velocity_vjp(self.targets, points, weights,
                                      self.heads.attention_matrices(layer),
                                      self.heads.values(layer), g, chunk_mb=self.chunk_mb)
