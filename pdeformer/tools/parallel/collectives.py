"""Collectives that keep every rank in step: a file read on rank 0 with its result or
error on every rank (:func:`on_root`), flags and moment sums reduced over ranks, row
blocks gathered on every rank.

The rule that keeps jobs from hanging: an error is raised on every rank or on none.
Files are read by rank 0 through :func:`on_root`, which broadcasts either the result
or the error; numerical checks are all-reduced (:func:`any_rank`).
"""

from __future__ import annotations

import numpy as np
from mpi4py import MPI

from ..errors import PdeformerError


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
    """Whether ``flag`` holds on some rank (one small buffer Allreduce)."""
    buf = np.array([1.0 if flag else 0.0])
    comm.Allreduce(MPI.IN_PLACE, buf, op=MPI.MAX)
    return bool(buf[0])


def moment_sums(comm, w: np.ndarray, y: np.ndarray, extra=()) -> tuple:
    """Over all ranks, in one Allreduce: (sum_q w_q, sum_q w_q y_q (d,), sum_q w_q y_q y_q^T
    (d, d), the sums of ``extra`` (local scalars carried along))."""
    d = y.shape[1]
    local = np.concatenate([[w.sum(), *extra], w @ y, np.einsum("q,qi,qj->ij", w, y, y).ravel()])
    tot = np.empty_like(local)
    comm.Allreduce(local, tot, op=MPI.SUM)
    k = 1 + len(extra)
    return tot[0], tot[k:k + d], tot[k + d:].reshape(d, d), tot[1:k]


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
