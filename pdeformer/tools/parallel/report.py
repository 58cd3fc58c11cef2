"""Timers per named phase and the ``parallel`` section of summary.json: compute and
communication per rank and per phase, and the one line the log gives them."""

from __future__ import annotations

import time

import numpy as np
from mpi4py import MPI

from .meter import Meter


class Timer:
    """Accumulates per named phase its wall time (max over ranks when reported) and, per
    rank, its compute CPU seconds and metered communication seconds (:class:`~.meter.Meter`:
    ``compute_cpu_s`` and ``comm_s`` as the run's totals count them), each phase
    inclusive of the phases nested in it. ``meter``: the run's (default: one that counts
    nothing, so that communication counts 0)."""

    def __init__(self, meter: Meter | None = None):
        self.meter = Meter() if meter is None else meter
        self.phases: dict[str, float] = {}
        self.compute: dict[str, float] = {}
        self.communicated: dict[str, float] = {}
        self.start = time.perf_counter()

    def phase(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.perf_counter()
                self.cpu0 = time.process_time() - timer.meter.comm_cpu_s
                self.comm0 = timer.meter.comm_s

            def __exit__(self, *exc):
                timer.phases[name] = timer.phases.get(name, 0.0) + time.perf_counter() - self.t0
                cpu = time.process_time() - timer.meter.comm_cpu_s - self.cpu0
                timer.compute[name] = timer.compute.get(name, 0.0) + cpu
                timer.communicated[name] = timer.communicated.get(name, 0.0) + timer.meter.comm_s - self.comm0

        return _Phase()

    def by_rank(self, comm) -> dict:
        """Per phase (over all ranks' phases) and rank: ``phase_compute_cpu_s`` and
        ``phase_comm_s``, lists in rank order on rank 0 (other ranks: their own, one
        entry). Collective."""
        names = self._names(comm)
        mine = [[self.compute.get(n, 0.0) for n in names], [self.communicated.get(n, 0.0) for n in names]]
        rows = comm.gather(mine, root=0) or [mine]
        return {key: {n: [r[j][i] for r in rows] for i, n in enumerate(names)}
                for j, key in enumerate(("phase_compute_cpu_s", "phase_comm_s"))}

    def _names(self, comm) -> list:
        """Every rank's phase names, sorted (one allgather): a phase one rank never
        entered still gets an entry, 0 there."""
        return sorted(set().union(*comm.allgather(set(self.phases))))

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self, comm) -> dict:
        """Wall time per phase, the maximum over ranks (a phase one rank never entered
        counts 0 there), and the total."""
        names = self._names(comm)
        local = np.array([self.phases.get(n, 0.0) for n in names] + [self.elapsed()])
        worst = np.empty_like(local)
        comm.Allreduce(local, worst, op=MPI.MAX)
        out = {n: float(v) for n, v in zip(names, worst[:-1])}
        out["total"] = float(worst[-1])
        return out


def parallel_report(world, groups, snapshot: dict, timer: Timer | None = None) -> dict:
    """The ``parallel`` section of summary.json: ranks, groups (None: one group, no
    prompts to list), the prompts of every group and per rank (lists in rank order)
    compute_cpu_s, comm_s, comm_bytes, comm_calls (see :class:`Meter`), with ``timer``
    also per phase (:meth:`Timer.by_rank`), gathered on rank 0 (other ranks get their
    own numbers only)."""
    keys = ("compute_cpu_s", "comm_s", "comm_bytes", "comm_calls")
    rows = world.gather([snapshot[k] for k in keys], root=0)
    count, size = (groups.count, groups.size) if groups is not None else (1, world.size)
    out = {"ranks": world.size, "groups": count, "ranks_per_group": size,
           "group_prompts": [[groups.names[i] for i in b] for b in groups.blocks]
           if groups is not None else None}
    if rows is None:
        rows = [[snapshot[k] for k in keys]]
    out["group_of_rank"] = [r // size for r in range(world.size)] if world.rank == 0 \
        else [world.rank // size]
    for j, k in enumerate(keys):
        out[k] = [r[j] for r in rows]
    if timer is not None:
        out.update(timer.by_rank(world))
    return out


def describe_parallel(report: dict) -> str:
    """One line for the log: ranks, groups, the largest compute and comm time, bytes."""
    mb = max(report["comm_bytes"]) / 1e6
    return (f"parallel: {report['ranks']} rank(s) in {report['groups']} group(s), compute "
            f"{max(report['compute_cpu_s']):.1f} s, comm {max(report['comm_s']):.2f} s, "
            f"{mb:.3g} MB (max over ranks)")
