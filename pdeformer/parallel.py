"""MPI helpers: rank-0 logging, collective error handling, gathers, the mpirun line.

The rule that keeps jobs from hanging: an error is raised on every rank or on none.
Files are read by rank 0 through :func:`on_root`, which broadcasts either the result
or the error; numerical checks are all-reduced (:func:`any_rank`).
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time

import numpy as np
from mpi4py import MPI

from .errors import PdeformerError

log = logging.getLogger("pdeformer")


def on_root(comm, fn, *args, **kwargs):
    """Run ``fn`` on rank 0 only and return its result on every rank. A
    PdeformerError raised there is raised on every rank."""
    result, error = None, None
    if comm.rank == 0:
        try:
            result = fn(*args, **kwargs)
        except PdeformerError as e:
            error = e
    result, error = comm.bcast((result, error), root=0)
    if error is not None:
        raise error
    return result


def any_rank(comm, flag: bool) -> bool:
    return bool(comm.allreduce(bool(flag), op=MPI.LOR))


def allgather_rows(comm, a: np.ndarray) -> np.ndarray:
    """Concatenate the row blocks of all ranks, in rank order, on every rank."""
    a = np.ascontiguousarray(a, dtype=np.float64)
    if comm.size == 1:
        return a.copy()
    tail = a.shape[1:]
    width = int(np.prod(tail)) if tail else 1
    counts = np.array(comm.allgather(a.shape[0] * width), dtype=np.int64)
    out = np.empty(int(counts.sum()), dtype=np.float64)
    comm.Allgatherv(a.ravel(), [out, counts, np.concatenate([[0], np.cumsum(counts)[:-1]]), MPI.DOUBLE])
    return out.reshape((-1,) + tail)


class _RankFilter(logging.Filter):
    def __init__(self, rank):
        super().__init__()
        self.prefix = f"[rank {rank}] " if rank else ""

    def filter(self, record):
        record.rankprefix = self.prefix
        return True


def setup_logging(comm, level=logging.INFO) -> None:
    """Rank 0 logs at ``level`` to stderr; other ranks only warnings, prefixed.

    The root logger gets a warnings-only handler first, so that libraries calling
    ``logging.basicConfig`` (FFCx) do not print their JIT compiler chatter."""
    if not logging.root.handlers:
        logging.root.addHandler(logging.StreamHandler(sys.stderr))
    for h in logging.root.handlers:
        h.setLevel(max(h.level, logging.WARNING))
    for h in list(log.handlers):
        if getattr(h, "_pdeformer", False):
            log.removeHandler(h)
    handler = logging.StreamHandler(sys.stderr)
    handler._pdeformer = True
    handler.addFilter(_RankFilter(comm.rank))
    handler.setFormatter(logging.Formatter("%(rankprefix)s%(message)s"))
    log.addHandler(handler)
    log.setLevel(level if comm.rank == 0 else logging.WARNING)
    log.propagate = False


def add_log_file(comm, filename: str) -> logging.Handler | None:
    """Also log (rank 0) into ``filename``, with time stamps."""
    if comm.rank != 0:
        return None
    handler = logging.FileHandler(filename, mode="w")
    handler._pdeformer = True
    handler.addFilter(_RankFilter(0))
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
    log.addHandler(handler)
    return handler


def remove_log_file(handler: logging.Handler | None) -> None:
    if handler is not None:
        log.removeHandler(handler)
        handler.close()


class Timer:
    """Accumulates wall time per named phase (max over ranks when reported)."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.start = time.perf_counter()

    def phase(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.perf_counter()

            def __exit__(self, *exc):
                timer.phases[name] = timer.phases.get(name, 0.0) + time.perf_counter() - self.t0

        return _Phase()

    def elapsed(self) -> float:
        return time.perf_counter() - self.start

    def report(self, comm) -> dict:
        """Wall time per phase, the maximum over ranks (a phase one rank never entered
        counts 0 there), and the total."""
        names = sorted(set().union(*comm.allgather(set(self.phases))))
        local = np.array([self.phases.get(n, 0.0) for n in names] + [self.elapsed()])
        worst = np.empty_like(local)
        comm.Allreduce(local, worst, op=MPI.MAX)
        out = {n: float(v) for n, v in zip(names, worst[:-1])}
        out["total"] = float(worst[-1])
        return out


def mpirun_command(nprocs: int) -> list[str]:
    """``mpirun -n P`` with the flags Open MPI needs here (root, more ranks than cores).

    Launch it with ``env=dict(os.environ)``: once mpi4py has initialised MPI in the
    calling process, that process's C environment carries the job's variables, and a
    child mpirun inheriting them fails."""
    exe = shutil.which("mpirun") or shutil.which("mpiexec")
    if exe is None:
        raise RuntimeError("mpirun not found (Debian: apt-get install openmpi-bin)")
    cmd = [exe]
    try:
        banner = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        banner = ""
    if "Open MPI" in banner or "OpenRTE" in banner:
        cmd.append("--oversubscribe")
        if os.geteuid() == 0:
            cmd.append("--allow-run-as-root")
    return cmd + ["-n", str(nprocs)]
