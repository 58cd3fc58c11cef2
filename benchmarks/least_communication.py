"""The ceiling of a case with the least communication any division of its sources needs.

    mpirun -n 2 python benchmarks/least_communication.py [--none | --table-pipeline] \\
        [--table-doubles N] forward COPIES.toml --prompt-groups 2 -q \\
        --set mesh.cells=[128,128] output.fields=false

COPIES.toml holds P identical copies of one prompt (what ``benchmarks/scaling.py --ideal``
writes: ``copies2.toml`` in its folder), solved by P prompt groups of one rank each: the
work divided exactly, nothing communicated during the solve. This script adds, over all
ranks, the two synchronisations that dividing one prompt's sources and cells cannot do
without:

* per velocity evaluation, one sum over ranks of a table-sized array (``--table-doubles``,
  default 3 x 193^2: the largest tables of the 128^2 forward pass), round the ring as
  pdeformer sums its tables (:func:`pdeformer.tools.parallel.allreduce_sum`); in a
  gradient also per reverse evaluation (the table's cotangent, summed over the targets of
  all ranks);
* per right-hand side of the transport, and per reverse right-hand side in a gradient,
  one barrier (the ghost exchange of the facet fluxes).

With ``--table-pipeline`` the velocity's synchronisations are instead those of the
laplace table divided over ranks as pdeformer divides it, at the same points of each
evaluation and with the same sizes: the reduce-scatter of the panel sums, the sum of the
tables and the gather of the fine grid's rows (and the reverse mode's), each on scratch
arrays of the size the one-rank group passes (nothing of the solve changes).

Timed against the same copies with ``--none`` (nothing added) and one rank solving all
copies, it says what these two cost on the machine, and so how much of the ceiling is
left for any design's other messages, waiting and repeated work. The groups must make
the same evaluations in the same order (identical copies do), or the sums pair
different evaluations.
"""

import atexit
import importlib
import pkgutil
import sys
from collections import Counter

from pdeformer.tools.blas import choose_core

choose_core()      # before numpy loads, as the pdeformer command does

import numpy as np  # noqa: E402
from mpi4py import MPI

from pdeformer.commands.cli import main
from pdeformer.fem import transport
from pdeformer.model import velocity
from pdeformer.tools.parallel import allreduce_sum

TABLE_DOUBLES = 3 * 193 ** 2
ADDED: Counter = Counter()   # the collectives added, by kind (this rank)


def report(comm, mode: str) -> None:
    """One line on rank 0 at the end: what was added per rank (the same on every rank)."""
    if comm.rank == 0:
        added = ", ".join(f"{n} {kind}" for kind, n in sorted(ADDED.items())) or "nothing"
        print(f"least_communication ({mode}): added per rank: {added}", file=sys.stderr)


def then(owner, name: str, action, kind: str) -> None:
    """Patch ``owner.name`` to call ``action()`` after it, counted as ``kind``."""
    method = getattr(owner, name)

    def method_then_action(*args, **kwargs):
        out = method(*args, **kwargs)
        action()
        ADDED[kind] += 1
        return out

    setattr(owner, name, method_then_action)


def add_least_communication(comm, table_doubles: int) -> None:
    """Patch the velocity and the right-hand side to synchronise ``comm`` as above."""
    table = np.ones(table_doubles)

    def table_sum():
        table[:] = 1.0
        allreduce_sum(comm, table)

    then(velocity.AttentionVelocity, "__call__", table_sum, "table sums")
    then(velocity.AttentionVelocity, "vjp", table_sum, "table cotangent sums")
    barrier_after_rate(comm)


def barrier_after_rate(comm) -> None:
    """Patch the transport's right-hand side and its reverse to end in a barrier of
    ``comm``."""
    then(transport.DGTransport, "rate", comm.Barrier, "barriers")
    then(transport.DGTransport, "rate_vjp", comm.Barrier, "reverse barriers")


def add_table_pipeline(comm) -> None:
    """Patch the laplace backend's sums and gathers over its group (one rank: no
    messages) to also make the same-sized collective over ``comm`` on scratch arrays, and
    the right-hand side to end in a barrier (the ghost exchange)."""
    from pdeformer.tools.parallel import allgather_shares, reduce_scatter_sum, reduce_shares, share_counts
    scratch: dict = {}

    def buffer(size: int) -> np.ndarray:
        if size not in scratch:
            scratch[size] = np.ones(size)
        return scratch[size]

    def reduce_shares_too(group, full):
        counts, _ = share_counts(full.shape[0], comm, full.size // full.shape[0])
        reduce_scatter_sum(comm, buffer(full.size), counts)
        ADDED["reduce-scatters"] += 1
        return reduce_shares(group, full)

    def allreduce_too(group, array):
        allreduce_sum(comm, buffer(array.size))
        ADDED["table sums"] += 1
        return allreduce_sum(group, array)

    def allgather_too(group, local, count):
        counts, displs = share_counts(count, comm, local.size // count)
        # the receive buffer one entry longer: never the send buffer, even where a rank's
        # share is all the rows
        comm.Allgatherv(buffer(int(counts[comm.rank])),
                        [buffer(local.size + 1), counts, displs, MPI.DOUBLE])
        ADDED["gathers"] += 1
        return allgather_shares(group, local, count)

    patch_laplace({reduce_shares: reduce_shares_too, allreduce_sum: allreduce_too,
                   allgather_shares: allgather_too})
    barrier_after_rate(comm)


def patch_laplace(patches: dict) -> None:
    """Replace each function of ``patches`` (its keys) by its patch in every module of the
    laplace backend that calls it."""
    from pdeformer.attention import laplace
    for info in pkgutil.iter_modules(laplace.__path__):
        module = importlib.import_module(f"{laplace.__name__}.{info.name}")
        for function, patch in patches.items():
            if getattr(module, function.__name__, None) is function:
                setattr(module, function.__name__, patch)


if __name__ == "__main__":
    args, mode, doubles = sys.argv[1:], "least", TABLE_DOUBLES
    while args and args[0] in ("--none", "--table-pipeline", "--table-doubles"):
        if args[0] == "--table-doubles":
            if len(args) < 2 or not args[1].isdigit() or int(args[1]) == 0:
                sys.exit("least_communication.py: --table-doubles needs a positive integer")
            doubles, args = int(args[1]), args[2:]
        else:
            mode, args = args[0][2:], args[1:]
    if mode == "least" and MPI.COMM_WORLD.size > 1:
        add_least_communication(MPI.COMM_WORLD, doubles)
    if mode == "table-pipeline" and MPI.COMM_WORLD.size > 1:
        add_table_pipeline(MPI.COMM_WORLD)
    atexit.register(report, MPI.COMM_WORLD, mode)
    sys.exit(main(args))
