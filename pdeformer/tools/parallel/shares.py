"""Work divided over ranks by rows, and the large sums over ranks.

Row shares: ``count`` rows are divided into the contiguous shares
[r count / P, (r + 1) count / P) of the P ranks (:func:`share`); an array computed one
share per rank is assembled on every rank by one Allgatherv (:func:`allgather_shares`),
and an array summed over ranks is delivered to each rank as its share of rows by one
reduce-scatter (:func:`reduce_shares`). The counts follow from the row count, so none
are exchanged.

Large sums (:func:`reduce_scatter_sum`, :func:`allreduce_sum`) go round the ring of
ranks where each rank's block is large enough that bandwidth, not latency, sets their
time; each block is then summed in one fixed order, so the result does not depend on
timing. Where the communicator is a :class:`~.meter.MeteredComm` they count as one call
with the bytes of the MPI call they replace.
"""

from __future__ import annotations

from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from .meter import MeteredComm


RING_BLOCK_BYTES = 1 << 15   # sums whose blocks per rank reach 32 KiB go round the ring
RING_TAG = 7121              # point-to-point tag of the ring's messages (on its own duplicate)


def share_bounds(count: int, size: int) -> np.ndarray:
    """Bounds of the contiguous shares [r count / P, (r + 1) count / P) of ``count`` rows
    over P = ``size`` ranks, (P + 1,)."""
    return np.array([count * r // size for r in range(size + 1)], dtype=np.int64)


def share(count: int, comm) -> slice:
    """This rank's contiguous share [r count / P, (r + 1) count / P) of ``count`` rows."""
    return slice(count * comm.rank // comm.size, count * (comm.rank + 1) // comm.size)


def share_counts(count: int, comm, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Entries and offsets of every rank's share of ``count`` rows of ``width`` entries
    (the counts and displacements of a gather or reduce-scatter of the shares)."""
    bounds = share_bounds(count, comm.size) * width
    return np.diff(bounds), bounds[:-1]


def allgather_shares(comm, local: np.ndarray, count: int) -> np.ndarray:
    """The row shares (:func:`share`) of a (count, ...) array, computed one per rank,
    assembled on every rank (one Allgatherv; the counts are known, none exchanged)."""
    if comm.size == 1:
        return local
    tail = local.shape[1:]
    counts, displs = share_counts(count, comm, int(np.prod(tail)))
    out = np.empty((count,) + tail)
    comm.Allgatherv(np.ascontiguousarray(local).ravel(), [out, counts, displs, MPI.DOUBLE])
    return out


def reduce_shares(comm, full: np.ndarray) -> np.ndarray:
    """The sum over ranks of (count, ...) arrays, this rank's share of its rows only (one
    reduce-scatter, :func:`reduce_scatter_sum`)."""
    if comm.size == 1:
        return full
    count, tail = full.shape[0], full.shape[1:]
    counts, _ = share_counts(count, comm, int(np.prod(tail)))
    return reduce_scatter_sum(comm, full, counts).reshape((-1,) + tail)


def _by_ring(comm, nbytes: int) -> bool:
    """Whether a sum of ``nbytes`` per rank goes round the ring: where each rank's block
    is large enough that bandwidth, not the P - 1 steps' latency, sets its time (the same
    answer on every rank: the sizes agree)."""
    return nbytes >= RING_BLOCK_BYTES * comm.size


def reduce_scatter_sum(comm, full: np.ndarray, counts) -> np.ndarray:
    """sum_ranks full[displ_r : displ_r + counts[r]] on rank r (a flat float64 array of
    sum(counts) entries on every rank): MPI_Reduce_scatter with op SUM. Where the blocks
    are large (:func:`_by_ring`), by the ring of ranks: in step s = 0 .. P-2 rank r sends
    its partial sum of block (r - s - 1) mod P to rank r + 1 and adds its own entries to
    the partial sum of block (r - s - 2) mod P it receives from rank r - 1, so each block
    is summed in one fixed order (ranks b+1, .., P-1, 0, .., b for block b; the result
    does not depend on timing) and each rank moves (P-1)/P of the array. Open MPI 4.1's
    own Reduce_scatter measured 3-4x slower for 0.3-1 MB on 2 ranks (docs/hpc.md)."""
    P, r = comm.size, comm.rank
    counts = np.asarray(counts, dtype=np.int64)
    full = np.ascontiguousarray(full, dtype=np.float64).ravel()
    if P == 1:
        return full[:counts[0]].copy()
    if not _by_ring(comm, full.nbytes):
        mine = np.empty(int(counts[r]))
        comm.Reduce_scatter(full, mine, counts, op=MPI.SUM)
        return mine
    with _metering(comm, full.nbytes + 8 * int(counts[r])):
        return _ring_reduce_scatter(comm, full, counts)


def _ring_reduce_scatter(comm, full: np.ndarray, counts: np.ndarray) -> np.ndarray:
    """The ring of :func:`reduce_scatter_sum` (P - 1 Sendrecv, not metered), on the
    communicator's own duplicate (:func:`_ring_comm`)."""
    ring = _ring_comm(comm)
    P, r = ring.size, ring.rank
    displs = np.concatenate([[0], np.cumsum(counts)[:-1]])
    right, left = (r + 1) % P, (r - 1) % P
    b = (r - 1) % P
    partial = full[displs[b]:displs[b] + counts[b]]
    for s in range(P - 1):
        b = (r - s - 2) % P
        received = np.empty(int(counts[b]))
        ring.Sendrecv(partial, dest=right, sendtag=RING_TAG, recvbuf=received, source=left,
                      recvtag=RING_TAG)
        received += full[displs[b]:displs[b] + counts[b]]
        partial = received
    return partial


_RING_KEY = None


def _ring_comm(comm) -> MPI.Intracomm:
    """A duplicate of ``comm`` kept as an attribute of it (made on first use, a
    collective call; freed with it): the ring's messages can meet no other point-to-point
    traffic of the program on ``comm``, as PETSc and dolfinx keep theirs on duplicates."""
    global _RING_KEY
    if _RING_KEY is None:
        _RING_KEY = MPI.Comm.Create_keyval(delete_fn=lambda c, k, dup: dup.Free())
    dup = comm.Get_attr(_RING_KEY)
    if dup is None:
        dup = MPI.Intracomm(MPI.Intracomm.Dup(comm))     # a plain one (not metered)
        comm.Set_attr(_RING_KEY, dup)
    return dup


def allreduce_sum(comm, array: np.ndarray) -> np.ndarray:
    """``array`` (float64, C-contiguous) summed over ranks in place: MPI_Allreduce with
    op SUM; where the blocks are large (:func:`_by_ring`) as :func:`reduce_scatter_sum`
    over equal blocks of the flat array, then one Allgatherv of the blocks. Every rank
    gets the same bits."""
    if array.dtype != np.float64 or not array.flags.c_contiguous:
        raise TypeError(f"allreduce_sum: a C-contiguous float64 array, not {array.dtype} "
                        f"({'' if array.flags.c_contiguous else 'not '}C-contiguous)")
    if comm.size == 1:
        return array
    if not _by_ring(comm, array.nbytes):
        comm.Allreduce(MPI.IN_PLACE, array, op=MPI.SUM)
        return array
    flat = array.reshape(-1)
    bounds = share_bounds(flat.size, comm.size)
    counts = np.diff(bounds)
    with _metering(comm, 2 * array.nbytes):       # counted as the Allreduce it is
        mine = _ring_reduce_scatter(comm, flat, counts)
        _ring_comm(comm).Allgatherv(mine, [flat, counts, bounds[:-1], MPI.DOUBLE])
    return array


@contextmanager
def _metering(comm, nbytes: int):
    """Count a section of point-to-point messages as one call of a :class:`MeteredComm`
    (nothing for other communicators)."""
    if not isinstance(comm, MeteredComm):
        yield
        return
    with comm.meter:
        yield
    comm.meter.add(nbytes)
