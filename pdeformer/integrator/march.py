"""The march through depth that the Eulerian and the particle model share.

Depth t runs over [0, 1]: L layers (layer l holds t in [l/L, (l+1)/L)), each cut into F
frames. In every frame a step controller gives the steps (uniform, CFL-limited, or a
frozen plan replayed), the model takes them, and the last step lands exactly on the
frame's end; the model's ``emit`` sees t = 0 and every frame end. The adjoint sweeps the
tape the steps recorded backwards (:func:`sweep_back`). Pure Python: no dolfinx.
"""

from __future__ import annotations

from typing import Callable, Protocol


class StepController(Protocol):
    """Where the steps of a frame come from."""

    def start_layer(self, layer: int) -> None:
        """A new layer begins."""

    def start_frame(self, layer: int, frame: int) -> None:
        """Frame ``frame`` (1..F) of ``layer`` begins."""

    def next_step(self, t: float, t_end: float) -> tuple[float, bool]:
        """(dt, whether it is the frame's last step) for the step from t."""

    def took(self, dt: float) -> None:
        """The step was taken."""


class FixedSteps:
    """``per_frame`` steps of ``dt`` in every frame (dt = frame length / per_frame)."""

    def __init__(self, per_frame: int, dt: float):
        self.per_frame, self.dt, self.taken = per_frame, dt, 0

    def start_layer(self, layer: int) -> None:
        pass

    def start_frame(self, layer: int, frame: int) -> None:
        self.taken = 0

    def next_step(self, t: float, t_end: float) -> tuple[float, bool]:
        return self.dt, self.taken == self.per_frame - 1

    def took(self, dt: float) -> None:
        self.taken += 1


def march(layers: int, frames: int, controller: StepController,
          step: Callable[[float, float, int], None],
          emit: Callable[[float, int, bool], None]) -> int:
    """t from 0 to 1 through ``layers`` layers of ``frames`` frames: ``emit(0, -1, True)``,
    then in every frame ``step(t, dt, layer)`` with the controller's dt until its last
    step lands on the frame's end t_end = (layer + f / F) / L, and ``emit(t_end, layer,
    f == F)``. Returns the number of steps."""
    emit(0.0, -1, True)
    t, steps = 0.0, 0
    for layer in range(layers):
        controller.start_layer(layer)
        for f in range(1, frames + 1):
            t_end = (layer + f / frames) / layers
            controller.start_frame(layer, f)
            while t < t_end:
                dt, last = controller.next_step(t, t_end)
                step(t, dt, layer)
                controller.took(dt)
                steps += 1
                t = t_end if last else t + dt
            emit(t, layer, f == frames)
    return steps


def tape_nbytes(tape, tables: bool = True) -> int:
    """Bytes a tape holds: the ``nbytes`` of its arrays and recorded objects (tables,
    limiter records; an object's own ``nbytes`` first, so a kept table that is also its
    interpolant counts once), through nested lists and tuples; plain numbers and plans
    without ``nbytes`` count nothing. Without ``tables``, the kept tables (objects with a
    ``plan``: what a tape keeps of a summed evaluation) are left out."""
    if not tables and hasattr(tape, "plan") and hasattr(tape, "nbytes"):
        return 0
    nbytes = getattr(tape, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    if isinstance(tape, (list, tuple)):
        return sum(tape_nbytes(x, tables) for x in tape)
    return 0


def sweep_back(tape: list, costate, step_vjp: Callable):
    """The adjoint sweep: the costate at t = 1 carried back through every step of the
    tape, last first (``step_vjp(costate, *entry)`` returns the costate at the step's
    start)."""
    for entry in reversed(tape):
        costate = step_vjp(costate, *entry)
    return costate
