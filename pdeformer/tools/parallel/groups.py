"""Prompt groups (``[parallel] prompt_groups = G``): the ranks split into G groups of
consecutive ranks, each holding the mesh partitioned over its own ranks and a contiguous
block of the prompts.

Work on a group's prompts uses only the group communicator (so an error there is raised
on every rank of that group), and the groups meet only at combination points
(:meth:`PromptGroups.combined`), where they first agree whether any group failed and then
combine their results over the world.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np

from ..errors import ConfigError, PdeformerError
from ..keys import Key, integer

# The [parallel] table
PARALLEL_KEYS = {
    "prompt_groups": Key(integer(1, 10**6), 1,
                         "split the ranks into this many groups, each with its own mesh "
                         "partition and a block of the prompts (--prompt-groups)"),
}


class PromptGroups:
    """The split of the ranks into ``count`` prompt groups, and where they meet.

    Ranks ``g * size .. (g + 1) * size - 1`` form group g (``size = world.size / count``,
    so a group maps onto nodes x cores); :attr:`comm` is this rank's group communicator,
    on which its mesh is partitioned. The prompts are dealt in contiguous blocks
    (``np.array_split`` order: group g holds prompts ``blocks[g]``, the first
    ``S mod G`` groups one more): with prompts of equal cost this balances as well as
    round robin, keeps each group's prompts in prompt order, and makes the first failing
    group hold the first failing prompt, as a run with one group would report it.

    Bad input (``key`` names it): count < 1, a rank count that ``count`` does not
    divide, more groups than prompts."""

    def __init__(self, world, count: int, names: list[str], key: str = "parallel.prompt_groups"):
        S = len(names)
        if isinstance(count, bool) or not isinstance(count, int) or count < 1:
            raise ConfigError(key, f"expected an integer >= 1, got {count!r}")
        if world.size % count:
            raise ConfigError(key, f"{count} groups cannot split {world.size} rank(s) into equal "
                                   f"groups: use a divisor of the rank count")
        if count > S:
            raise ConfigError(key, f"{count} groups for {S} prompt(s): at most one group per prompt")
        self.world = world
        self.count = count
        self.names = list(names)
        self.size = world.size // count
        self.index = world.rank // self.size
        self.comm = world if count == 1 else world.Split(self.index, world.rank)
        self.blocks = [[int(i) for i in b] for b in np.array_split(np.arange(S), count)]
        self.owned = self.blocks[self.index]
        self.owner = {i: g for g, b in enumerate(self.blocks) for i in b}

    @classmethod
    def single(cls, comm, names: list[str]) -> "PromptGroups":
        """One group: every rank of ``comm`` works on every prompt."""
        return cls(comm, 1, names)

    @property
    def lead(self) -> bool:
        """Is this the first rank of its group (the one that speaks for it)?"""
        return self.comm.rank == 0

    # -- combination points (world collectives: every rank of every group calls them)
    def agree(self, error: PdeformerError | None) -> None:
        """Raise on every rank the error of the first failing group (or nothing)."""
        if self.count == 1:
            if error is not None:
                raise error
            return
        errors = self.world.allgather(error)
        first = next((e for e in errors if e is not None), None)
        if first is not None:
            raise first

    @contextmanager
    def combined(self):
        """Group work inside; on leaving, all groups agree on failure (:meth:`agree`)."""
        error = None
        try:
            yield
        except PdeformerError as e:
            error = e
        self.agree(error)

    def gather_prompts(self, local: dict) -> list:
        """Per-prompt values (``{prompt index: value}`` of this group's prompts, the same
        on every rank of the group) -> a list in prompt order on every rank (None where no
        group had a value)."""
        if self.count > 1:
            merged = {}
            for part in self.world.allgather(local if self.lead else None):
                merged.update(part or {})
            local = merged
        return [local.get(i) for i in range(len(self.names))]

    def gather_lists(self, items: list) -> list:
        """Concatenate the groups' lists (the same on every rank of a group), in group order."""
        if self.count == 1:
            return list(items)
        return [x for part in self.world.allgather(items if self.lead else None) for x in part or ()]

    def sum_stats(self, stats: dict) -> dict:
        """Counters summed over groups; keys starting with ``largest``/``max`` maximised;
        anything not a number taken from group 0."""
        if self.count == 1:
            return dict(stats)
        parts = [p for p in self.world.allgather(stats if self.lead else None) if p is not None]
        out = dict(parts[0])
        for k, v in out.items():
            vals = [p.get(k) for p in parts]
            if all(isinstance(x, (int, float, np.number)) and not isinstance(x, bool) for x in vals):
                out[k] = max(vals) if k.startswith(("largest", "max")) else sum(vals)
        return out
