"""MPI helpers: rank-0 logging, collective error handling, gathers, the mpirun line,
prompt groups and the accounting of compute and communication.

The rule that keeps jobs from hanging: an error is raised on every rank or on none.
Files are read by rank 0 through :func:`on_root`, which broadcasts either the result
or the error; numerical checks are all-reduced (:func:`any_rank`).

Prompt groups (:class:`PromptGroups`, ``[parallel] prompt_groups = G``) split the ranks
into G groups of consecutive ranks; each group holds the mesh partitioned over its own
ranks and a contiguous block of the prompts. Work on a group's prompts uses only the
group communicator (so an error there is raised on every rank of that group), and the
groups meet only at combination points (:meth:`PromptGroups.combined`), where they first
agree whether any group failed and then combine their results over the world.

Accounting (:data:`METER`, :class:`MeteredComm`): every collective pdeformer calls goes
through a :class:`MeteredComm`, which adds its wall time, the CPU time spent inside it
and its payload bytes to one meter per process; ghost updates of dolfinx/PETSc vectors
made by pdeformer (:func:`scatter_forward`, :func:`ghost_update_add`) count the same way,
and so do the ring sums (:func:`reduce_scatter_sum`, :func:`allreduce_sum`: one call with
the bytes of the MPI call they replace, where the communicator is a MeteredComm).
``summary.json`` reports per rank ``compute_cpu_s`` (CPU seconds outside communication),
``comm_s`` and ``comm_bytes``.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
import time
from contextlib import contextmanager

import numpy as np
from mpi4py import MPI

from .errors import ConfigError, PdeformerError

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


# ------------------------------------------------------------------ large sums over ranks
RING_BLOCK_BYTES = 1 << 15   # sums whose blocks per rank reach 32 KiB go round the ring
RING_TAG = 7121              # point-to-point tag of the ring's messages (on its own duplicate)


def share_bounds(count: int, size: int) -> np.ndarray:
    """Bounds of the contiguous shares [r count / P, (r + 1) count / P) of ``count`` rows
    over P = ``size`` ranks, (P + 1,)."""
    return np.array([count * r // size for r in range(size + 1)], dtype=np.int64)


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
    with METER:
        yield
    METER.add(nbytes)


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


class _LogFile(logging.FileHandler):
    """A log file that, when it cannot be written (disk full), says so in one line on
    stderr and stops, instead of printing a traceback per record."""

    def handleError(self, record):
        if not getattr(self, "_failed", False):
            self._failed = True
            sys.stderr.write(f"warning: cannot write {self.baseFilename}: the log goes on "
                             "on stderr only\n")
        self.emit = lambda record: None


def add_log_file(comm, filename: str) -> logging.Handler | None:
    """Also log (rank 0) into ``filename``, with time stamps."""
    if comm.rank != 0:
        return None
    try:
        handler = _LogFile(filename, mode="w")
    except OSError as e:
        sys.stderr.write(f"warning: cannot write {filename} ({e.strerror}): the log goes on stderr only\n")
        return None
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
    """Accumulates per named phase its wall time (max over ranks when reported) and, per
    rank, its compute CPU seconds and metered communication seconds (:class:`Meter`:
    ``compute_cpu_s`` and ``comm_s`` as the run's totals count them), each phase
    inclusive of the phases nested in it."""

    def __init__(self):
        self.phases: dict[str, float] = {}
        self.compute: dict[str, float] = {}
        self.communicated: dict[str, float] = {}
        self.start = time.perf_counter()

    def phase(self, name: str):
        timer = self

        class _Phase:
            def __enter__(self):
                self.t0 = time.perf_counter()
                self.cpu0 = time.process_time() - METER.comm_cpu_s
                self.comm0 = METER.comm_s

            def __exit__(self, *exc):
                timer.phases[name] = timer.phases.get(name, 0.0) + time.perf_counter() - self.t0
                cpu = time.process_time() - METER.comm_cpu_s - self.cpu0
                timer.compute[name] = timer.compute.get(name, 0.0) + cpu
                timer.communicated[name] = timer.communicated.get(name, 0.0) + METER.comm_s - self.comm0

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


# ------------------------------------------------------------------ accounting

class Meter:
    """Time and bytes of this process's MPI communication, and its CPU time outside it.

    * ``comm_s``: wall seconds inside metered communication (collectives of a
      :class:`MeteredComm`, metered ghost updates);
    * ``comm_cpu_s``: CPU seconds (``time.process_time``, all threads) inside it -- with
      oversubscribed ranks Open MPI spins or yields while it waits, which is not compute;
    * ``compute_cpu_s`` (:meth:`snapshot`): CPU seconds since :meth:`reset` minus
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


METER = Meter()


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
    """An intracommunicator that counts its collectives into :data:`METER`.

    ``MeteredComm(comm)`` shares ``comm``'s handle (nothing is duplicated); dolfinx takes
    it wherever it takes a communicator. petsc4py does not: give PETSc ``mesh.comm`` or
    ``MPI.Intracomm(comm)``. Communicators that dolfinx objects return (``mesh.comm``) are
    plain again, so pdeformer's collectives use the metered one it was given."""

    def __init__(self, comm=None):
        super().__init__()
        self._solo = self.Get_size() == 1   # nothing to communicate: not metered

    # -- reductions
    def Allreduce(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Allreduce(sendbuf, recvbuf, op)
        with METER:
            super().Allreduce(sendbuf, recvbuf, op)
        n = _buf_bytes(recvbuf)
        METER.add(n + (n if sendbuf is MPI.IN_PLACE else _buf_bytes(sendbuf)))

    def allreduce(self, sendobj, op=MPI.SUM):
        if self._solo:
            return super().allreduce(sendobj, op)
        with METER:
            out = super().allreduce(sendobj, op)
        METER.add(_obj_bytes(sendobj) + _obj_bytes(out))
        return out

    def Reduce(self, sendbuf, recvbuf, op=MPI.SUM, root=0):
        if self._solo:
            return super().Reduce(sendbuf, recvbuf, op, root)
        with METER:
            super().Reduce(sendbuf, recvbuf, op, root)
        n = _buf_bytes(recvbuf) if self.rank == root else 0
        METER.add(n + (n if sendbuf is MPI.IN_PLACE else _buf_bytes(sendbuf)))

    def reduce(self, sendobj, op=MPI.SUM, root=0):
        if self._solo:
            return super().reduce(sendobj, op, root)
        with METER:
            out = super().reduce(sendobj, op, root)
        METER.add(_obj_bytes(sendobj) + (_obj_bytes(out) if self.rank == root else 0))
        return out

    def Reduce_scatter(self, sendbuf, recvbuf, recvcounts=None, op=MPI.SUM):
        if self._solo:
            return super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)
        with METER:
            super().Reduce_scatter(sendbuf, recvbuf, recvcounts, op)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Reduce_scatter_block(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Reduce_scatter_block(sendbuf, recvbuf, op)
        with METER:
            super().Reduce_scatter_block(sendbuf, recvbuf, op)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Scan(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Scan(sendbuf, recvbuf, op)
        with METER:
            super().Scan(sendbuf, recvbuf, op)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Exscan(self, sendbuf, recvbuf, op=MPI.SUM):
        if self._solo:
            return super().Exscan(sendbuf, recvbuf, op)
        with METER:
            super().Exscan(sendbuf, recvbuf, op)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    # -- gathers and broadcasts
    def Allgather(self, sendbuf, recvbuf):
        if self._solo:
            return super().Allgather(sendbuf, recvbuf)
        with METER:
            super().Allgather(sendbuf, recvbuf)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def Allgatherv(self, sendbuf, recvbuf):
        if self._solo:
            return super().Allgatherv(sendbuf, recvbuf)
        with METER:
            super().Allgatherv(sendbuf, recvbuf)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def allgather(self, sendobj):
        if self._solo:
            return super().allgather(sendobj)
        with METER:
            out = super().allgather(sendobj)
        METER.add(_obj_bytes(sendobj) + _obj_bytes(out))
        return out

    def Gatherv(self, sendbuf, recvbuf, root=0):
        if self._solo:
            return super().Gatherv(sendbuf, recvbuf, root)
        with METER:
            super().Gatherv(sendbuf, recvbuf, root)
        METER.add(_buf_bytes(sendbuf) + (_buf_bytes(recvbuf) if self.rank == root else 0))

    def gather(self, sendobj, root=0):
        if self._solo:
            return super().gather(sendobj, root)
        with METER:
            out = super().gather(sendobj, root)
        METER.add(_obj_bytes(sendobj) + (_obj_bytes(out) if self.rank == root else 0))
        return out

    def Bcast(self, buf, root=0):
        if self._solo:
            return super().Bcast(buf, root)
        with METER:
            super().Bcast(buf, root)
        METER.add(_buf_bytes(buf))

    def bcast(self, obj=None, root=0):
        if self._solo:
            return super().bcast(obj, root)
        with METER:
            out = super().bcast(obj, root)
        METER.add(_obj_bytes(out))
        return out

    def Alltoall(self, sendbuf, recvbuf):
        if self._solo:
            return super().Alltoall(sendbuf, recvbuf)
        with METER:
            super().Alltoall(sendbuf, recvbuf)
        METER.add(_buf_bytes(sendbuf) + _buf_bytes(recvbuf))

    def alltoall(self, sendobj):
        if self._solo:
            return super().alltoall(sendobj)
        with METER:
            out = super().alltoall(sendobj)
        METER.add(_obj_bytes(sendobj) + _obj_bytes(out))
        return out

    def Barrier(self):
        if self._solo:
            return super().Barrier()
        with METER:
            super().Barrier()

    barrier = Barrier

    # -- new communicators stay metered
    def Split(self, color=0, key=0):
        with METER:
            return MeteredComm(super().Split(color, key))

    def Dup(self, info=None):
        with METER:
            return MeteredComm(super().Dup() if info is None else super().Dup(info))


def metered(comm) -> MeteredComm:
    """``comm`` as a :class:`MeteredComm` (itself if it already is one)."""
    return comm if isinstance(comm, MeteredComm) else MeteredComm(comm)


def scatter_forward(u, comm) -> None:
    """``u.x.scatter_forward()`` (owned values to the ghosts; ``comm``: the mesh's
    communicator), counted as communication: the rank's ghost entries x 8 bytes."""
    if comm.size == 1:
        u.x.scatter_forward()
        return
    dofmap = u.function_space.dofmap
    with METER:
        u.x.scatter_forward()
    METER.add(8 * dofmap.index_map.num_ghosts * dofmap.index_map_bs)


def ghost_update_add(*vectors) -> None:
    """Sum PETSc ghosted vectors' ghost contributions into their owners, all begun before
    any is finished (their messages travel together), counted as one communication
    (ghost entries x 8 bytes)."""
    from petsc4py import PETSc
    add, reverse = PETSc.InsertMode.ADD, PETSc.ScatterMode.REVERSE
    if vectors[0].getComm().getSize() == 1:
        for b in vectors:
            b.ghostUpdate(addv=add, mode=reverse)
        return
    ghosts = 0
    for b in vectors:
        with b.localForm() as loc:
            ghosts += loc.getSize() - b.getLocalSize()
    with METER:
        for b in vectors:
            b.ghostUpdateBegin(addv=add, mode=reverse)
        for b in vectors:
            b.ghostUpdateEnd(addv=add, mode=reverse)
    METER.add(8 * ghosts)


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


# ------------------------------------------------------------------ prompt groups

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
