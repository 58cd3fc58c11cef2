"""What a solver loop emits, for the Eulerian and the particle model alike: frames (a
prompt's state at an output time), the trackers that watch them, and where a breakdown
happened. Pure Python and numpy: no dolfinx."""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np

from ..tools.errors import SolverBreakdown


@contextmanager
def located(where: str):
    """Prefix a breakdown raised inside with where it happened (prompt, layer, t)."""
    try:
        yield where
    except SolverBreakdown as e:
        raise SolverBreakdown(f"{where}: {e}") from None


@dataclass
class Frame:
    """The state of one prompt at an output time (t = 0 or the end of a frame)."""

    prompt: str
    prompt_index: int
    t: float
    layer: int            # layer in which the frame ends (-1 at t = 0)
    layer_boundary: bool
    steps: int            # steps taken so far for this prompt
    dt: float             # last step size (nan at t = 0)
    coeffs: np.ndarray
    outflow: float
    velocity: np.ndarray | None = None  # owned velocity nodes; heads of the layer holding t
                                        # (at a layer boundary: the layer starting there)
    extra: dict = field(default_factory=dict)


class Tracker:
    """Watches a forward run: ``start`` once, ``frame`` at t = 0 and every frame end,
    ``finish`` once. Set ``needs_velocity`` to get the velocity in every frame."""

    needs_velocity = False

    def start(self, solver: "ForwardSolver | ParticleSolver") -> None:
        pass

    def frame(self, solver: "ForwardSolver | ParticleSolver", frame: Frame) -> None:
        pass

    def finish(self, solver: "ForwardSolver | ParticleSolver") -> None:
        pass
