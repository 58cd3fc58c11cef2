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
from .attention import Sources, attention_velocity
from .heads import HeadMeasure


class AttentionVelocity:
    def __init__(self, W, heads: HeadMeasure, chunk_mb: float = 2.0):
        self.targets = owned_node_coordinates(W)
        self.heads = heads
        self.chunk_mb = chunk_mb
        self._A = [heads.attention_matrices(l) for l in range(heads.layers)]

    def __call__(self, sources: Sources, layer: int) -> np.ndarray:
        """Velocity of ``layer`` at the owned nodes, (n_nodes, d)."""
        return attention_velocity(self.targets, sources, self._A[layer], self.heads.values(layer),
                                  chunk_mb=self.chunk_mb)
