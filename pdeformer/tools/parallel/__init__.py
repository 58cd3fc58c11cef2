"""MPI helpers: collectives that keep the ranks in step, work divided by rows and the
large sums over ranks, rank-0 logging, the mpirun line, prompt groups and the accounting
of compute and communication.

The rule that keeps jobs from hanging: an error is raised on every rank or on none.
Files are read by rank 0 through :func:`on_root`, which broadcasts either the result
or the error; numerical checks are all-reduced (:func:`any_rank`).

* :mod:`.collectives`: :func:`on_root`, :func:`any_rank`, :func:`moment_sums`,
  :func:`allgather_rows`;
* :mod:`.shares`: rows divided over ranks (:func:`share`, :func:`allgather_shares`,
  :func:`reduce_shares`) and the ring sums (:func:`reduce_scatter_sum`,
  :func:`allreduce_sum`);
* :mod:`.logs`: rank-0 logging and the log file; :mod:`.launch`: :func:`mpirun_command`;
* :mod:`.meter`: :class:`Meter`, :class:`MeteredComm` and the metered ghost updates;
* :mod:`.report`: :class:`Timer` and the ``parallel`` section of summary.json;
* :mod:`.groups`: :class:`PromptGroups` and the ``[parallel]`` table's keys.
"""

from .collectives import allgather_rows, any_rank, moment_sums, on_root
from .groups import PARALLEL_KEYS, PromptGroups
from .launch import mpirun_command
from .logs import add_log_file, remove_log_file, setup_logging
from .meter import Meter, MeteredComm, ghost_update_add, metered, scatter_forward
from .report import Timer, describe_parallel, parallel_report
from .shares import (RING_BLOCK_BYTES, RING_TAG, allgather_shares, allreduce_sum, reduce_scatter_sum,
                     reduce_shares, share, share_bounds, share_counts)

__all__ = ["Meter", "MeteredComm", "PARALLEL_KEYS", "PromptGroups", "RING_BLOCK_BYTES", "RING_TAG", "Timer",           "add_log_file", "allgather_rows", "allgather_shares", "allreduce_sum", "any_rank",
           "describe_parallel", "ghost_update_add", "metered", "moment_sums", "mpirun_command",
           "on_root", "parallel_report", "reduce_scatter_sum", "reduce_shares", "remove_log_file",
           "scatter_forward", "setup_logging", "share", "share_bounds", "share_counts"]
