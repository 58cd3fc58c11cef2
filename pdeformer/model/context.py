"""What a run's solvers are given besides the problem's data (:class:`RunContext`): the
communicator its mesh lives on, with the meter that counts its communication, its
prompt groups and the costs its attention sums are chosen by.

The solvers read these from the context they are given, never from process-wide
state, so two problems in one process (two API calls, the cases of a study) keep apart:
each counts its own communication and chooses its sums from its own costs.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..attention.costs import Costs, machine_costs
from ..tools.parallel import Meter, MeteredComm, PromptGroups, metered


@dataclass(frozen=True)
class RunContext:
    """The communicator, prompt groups and costs of one run.

    ``comm``: this rank's group communicator (the world without prompt groups), on
    which the mesh is partitioned, metered into :attr:`meter`; ``groups``: the prompt
    groups (None: one group of all ranks of ``comm``); ``costs``: the seconds per
    operation the attention's choices between ways of summing are made from
    (:mod:`pdeformer.attention.costs`)."""

    comm: MeteredComm
    costs: Costs
    groups: PromptGroups | None = None

    @property
    def meter(self) -> Meter:
        """The count of this run's communication."""
        return self.comm.meter

    @classmethod
    def create(cls, comm, groups: PromptGroups | None = None, costs: Costs | None = None) -> "RunContext":
        """The context of a run on ``comm`` (with ``groups``: the world they split,
        the context's communicator being this rank's group's, ``groups.comm``), metered
        (a fresh meter where ``comm`` has none). ``costs`` default to this
        machine's (:func:`~pdeformer.attention.costs.machine_costs`), loaded on the whole
        world, ahead of any group's sums, so that every rank and group chooses alike:
        collective over the world then."""
        world = groups.world if groups is not None else comm
        if costs is None:
            costs = machine_costs(world)
        return cls(metered(groups.comm if groups is not None else comm), costs, groups)
