"""The accounting of communication (:class:`Meter`, :class:`MeteredComm`).

Every collective pdeformer calls goes through a :class:`MeteredComm`, which adds its
wall time, the CPU time spent inside it and its payload bytes to the :class:`Meter` it
carries (one per run: the communicators split from it share it, and two runs in one
process count apart);
ghost updates of dolfinx/PETSc vectors made by pdeformer (:func:`scatter_forward`,
:func:`ghost_update_add`) count the same way, and so do the ring sums
(:mod:`.shares`). ``summary.json`` reports per rank ``compute_cpu_s`` (CPU seconds
outside communication), ``comm_s`` and ``comm_bytes``.
"""

from __future__ import annotations

import sys
import time

import numpy as np
from mpi4py import MPI


class Meter:
    """Time and bytes of this process's MPI communication, and its CPU time outside it.

    * ``comm_s``: wall seconds inside metered communication (collectives of a
      :class:`MeteredComm`, metered ghost updates);
    * ``comm_cpu_s``: CPU seconds (``time.process_time``, all threads) inside it -- with
      oversubscribed ranks Open MPI spins or yields while it waits, which is not compute;
    * ``compute_cpu_s`` (:meth:`snapshot`): CPU seconds of the process since :meth:`reset` minus
      ``comm_cpu_s``: what the rank would need of a core of its own;
    * ``comm_bytes``: payload bytes. For a collective, the bytes of this rank's input
      plus the bytes it delivers to this rank (Allreduce of n doubles: 16 n; in place
      the buffer counts twice; Bcast/bcast: the object on every rank; Allgatherv: the
      rank's block plus the gathered array; gather: the rank's object, plus all at the
      root). Pickled (lower-case) calls are counted by the size of their numpy arrays,
      strings and numbers (8 bytes each), without pickling. A ghost update counts the
      rank's ghost entries x 8 bytes. This is what MPI is handed and hands back at this
      rank, not the traffic of the algorithm MPI uses (trees, rings).

    Collectives on a communicator of one rank, and ghost updates on one rank, move
    nothing and are not counted. Nested sections count once (the outermost)."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.comm_s = 0.0
        self.comm_cpu_s = 0.0
        self.comm_bytes = 0
        self.comm_calls = 0
        self._depth = 0
        self._cpu0 = time.process_time()
        self._wall0 = time.perf_counter()

    def __enter__(self):
        self._depth += 1
        if self._depth == 1:
            self._w = time.perf_counter()
            self._c = time.process_time()
        return self

    def __exit__(self, *exc):
        self._depth -= 1
        if self._depth == 0:
            self.comm_cpu_s += time.process_time() - self._c
            self.comm_s += time.perf_counter() - self._w
            self.comm_calls += 1

    def add(self, nbytes: int) -> None:
        self.comm_bytes += int(nbytes)

    def snapshot(self) -> dict:
        """This rank's numbers since :meth:`reset`."""
        cpu = time.process_time() - self._cpu0
        return {"compute_cpu_s": cpu - self.comm_cpu_s, "comm_s": self.comm_s,
                "comm_cpu_s": self.comm_cpu_s, "comm_bytes": self.comm_bytes,
                "comm_calls": self.comm_calls, "wall_s": time.perf_counter() - self._wall0}



def _buf_bytes(buf) -> int:
    """Bytes of an upper-case buffer argument: an array, or [array, counts, ...]."""
    if buf is None or buf is MPI.IN_PLACE:
        return 0
    if isinstance(buf, (list, tuple)):
        return _buf_bytes(buf[0]) if buf else 0
    nbytes = getattr(buf, "nbytes", None)
    if nbytes is not None:
        return int(nbytes)
    try:
        return memoryview(buf).nbytes
    except TypeError:
        return 0


def _obj_bytes(obj, depth: int = 0) -> int:
    """Payload of a pickled object, estimated without pickling: arrays by nbytes,
    strings by length, numbers 8 bytes, containers (and object attributes) summed."""
    if obj is None or isinstance(obj, (bool, int, float, complex, np.generic)):
        return 8
    if isinstance(obj, np.ndarray):
        return int(obj.nbytes)
    if isinstance(obj, (str, bytes, bytearray)):
        return len(obj)
    if isinstance(obj, BaseException):
        return len(str(obj))
    if depth > 6:
        return 8
    if isinstance(obj, dict):
        return sum(_obj_bytes(k, depth + 1) + _obj_bytes(v, depth + 1) for k, v in obj.items())
    if isinstance(obj, (list, tuple, set, frozenset)):
        return sum(_obj_bytes(x, depth + 1) for x in obj)
    attrs = getattr(obj, "__dict__", None)
    if attrs is not None:
        return _obj_bytes(attrs, depth + 1)
    return sys.getsizeof(obj)


class MeteredComm(MPI.Intracomm):
    """An intracommunicator that counts its collectives into its :attr:`meter`.

    ``MeteredComm(comm)`` shares ``comm``'s handle (nothing is duplicated); dolfinx takes
    it wherever it takes a communicator. petsc4py does not: give PETSc ``mesh.comm`` or
    ``MPI.Intracomm(comm)``. Communicators that dolfinx objects return (``mesh.comm``) are
    plain again, so pdeformer's collectives use the metered one it was given."""

    def __new__(cls, comm=None, meter: Meter | None = None):
        return super().__new__(cls, comm)     # (mpi4py's constructor takes the comm alone)

    def __init__(self, comm=None, meter: Meter | None = None):
        super().__init__()
        self.meter = Meter() if meter is None else meter
        self._solo = self.Get_size() == 1   # nothing to communicate: not metered

    # -- reductions
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Allreduce(sendbuf, recvbuf, op)
        with self.meter:
            super().Allreduce(sendbuf, recvbuf, op)
        n = _buf_bytes(recvbuf)
        self.meter.add(n + (n if sendbuf is MPI.IN_PLACE else _buf_bytes(sendbuf)))

    def allreduce(self, sendobj, op=MPI.SUM):
        if self._solo:
            return super().allreduce(sendobj, op)
        with self.meter:
            out = super().allreduce(sendobj, op)
        self.meter.add(_obj_bytes(sendobj) + _obj_bytes(out))
        return out

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        if self._solo:
            return super().Reduce(sendbuf, recvbuf, op, root)
        with self.meter:
            super().Reduce(sendbuf, recvbuf, op, root)
        n = _buf_bytes(recvbuf) if self.rank == root else 0
        self.meter.add(n + (n if sendbuf is MPI.IN_PLACE else _buf_bytes(sendbuf)))

    def reduce(self, sendobj, op=MPI.SUM, root=0):
        if self._solo:
            return super().reduce(sendobj, op, root)
        with self.meter:
            out = super().reduce(sendobj, op, root)
        self.meter.add(_obj_bytes(sendobj) + (_obj_bytes(out) if self.rank == root else 0))
        return out

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        if self._solo:
            return super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)
        with self.meter:
            super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Reduce_scatter_block(sendbuf, recvbuf, op)
        with self.meter:
            super().Reduce_scatter_block(sendbuf, recvbuf, op)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Scan(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Scan(sendbuf, recvbuf, op)
        with self.meter:
            super().Scan(sendbuf, recvbuf, op)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Exscan(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Exscan(sendbuf, recvbuf, op)
        with self.meter:
            super().Exscan(sendbuf, recvbuf, op)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    # -- gathers and broadcasts
    def Allgather(self, sendbuf, recvbuf):
        if self._solo:
            return super().Allgather(sendbuf, recvbuf)
        with self.meter:
            super().Allgather(sendbuf, recvbuf)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Allgatherv(self, sendbuf, recvbuf):
        if self._solo:
            return super().Allgatherv(sendbuf, recvbuf)
        with self.meter:
            super().Allgatherv(sendbuf, recvbuf)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def allgather(self, sendobj):
        if self._solo:
            return super().allgather(sendobj)
        with self.meter:
            out = super().allgather(sendobj)
        self.meter.add(_obj_bytes(sendobj) + _obj_bytes(out))
        return out

    def Gatherv(self, sendbuf, recvbuf, root=0):
        if self._solo:
            return super().Gatherv(sendbuf, recvbuf, root)
        with self.meter:
            super().Gatherv(sendbuf, recvbuf, root)
        self.meter.add(_buf_bytes(sendbuf) + (_buf_bytes(recvbuf) if self.rank == root else 0))

    def gather(self, sendobj, root=0):
        if self._solo:
            return super().gather(sendobj, root)
        with self.meter:
            out = super().gather(sendobj, root)
        self.meter.add(_obj_bytes(sendobj) + (_obj_bytes(out) if self.rank == root else 0))
        return out

    def Bcast(self, buf, root=0):
        if self._solo:
            return super().Bcast(buf, root)
        with self.meter:
            super().Bcast(buf, root)
        self.meter.add(_buf_bytes(buf))

    def bcast(self, obj=None, root=0):
        if self._solo:
            return super().bcast(obj, root)
        with self.meter:
            out = super().bcast(obj, root)
        self.meter.add(_obj_bytes(out))
        return out

    def Alltoall(self, sendbuf, recvbuf):
        if self._solo:
            return super().Alltoall(sendbuf, recvbuf)
        with self.meter:
            super().Alltoall(sendbuf, recvbuf)
        self.meter.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def alltoall(self, sendobj):
        if self._solo:
            return super().alltoall(sendobj)
        with self.meter:
            out = super().alltoall(sendobj)
        self.meter.add(_obj_bytes(sendobj) + _obj_bytes(out))
        return out

    def Barrier(self):
        if self._solo:
            return super().Barrier()
        with self.meter:
            super().Barrier()

    barrier = Barrier

    # -- new communicators stay metered
    def Split(self, color=0, key=0):
        with self.meter:
            return MeteredComm(super().Split(color, key), self.meter)

    def Dup(self, info=None):
        with self.meter:
            return MeteredComm(super().Dup() if info is None else super().Dup(info), self.meter)


def metered(comm, meter: Meter | None = None) -> MeteredComm:
    """``comm`` as a :class:`MeteredComm` counting into ``meter`` (a fresh one by
    default; ``comm`` itself where it already is one and no meter is given)."""
    if isinstance(comm, MeteredComm) and meter is None:
        return comm
    return MeteredComm(comm, meter)


def scatter_forward(u, comm) -> None:
    """``u.x.scatter_forward()`` (owned values to the ghosts; ``comm``: the mesh's
    communicator), counted as communication where ``comm`` is metered: the rank's ghost
    entries x 8 bytes."""
    meter = getattr(comm, "meter", None)
    if comm.size == 1 or meter is None:
        u.x.scatter_forward()
        return
    dofmap = u.function_space.dofmap
    with meter:
        u.x.scatter_forward()
    meter.add(8 * dofmap.index_map.num_ghosts * dofmap.index_map_bs)


def ghost_update_add(*vectors, meter: Meter | None = None) -> None:
    """Sum PETSc ghosted vectors' ghost contributions into their owners, all begun before
    any is finished (their messages travel together), counted into ``meter`` (where
    given) as one communication (ghost entries x 8 bytes)."""
    from petsc4py import PETSc
    add, reverse = PETSc.InsertMode.ADD, PETSc.ScatterMode.REVERSE
    if vectors[0].getComm().getSize() == 1 or meter is None:
        for b in vectors:
            b.ghostUpdate(addv=add, mode=reverse)
        return
    ghosts = 0
    for b in vectors:
        with b.localForm() as loc:
            ghosts += loc.getSize() - b.getLocalSize()
    with meter:
        for b in vectors:
            b.ghostUpdateBegin(addv=add, mode=reverse)
        for b in vectors:
            b.ghostUpdateEnd(addv=add, mode=reverse)
    meter.add(8 * ghosts)
