"""The ranks kept between tests (tests/rankpool.py): a command run there sees the
caller's environment and folder and prints what a job of its own would; one that ends
the job, or outlasts its timeout, ends the pool, which says so instead of hanging."""

from __future__ import annotations

import time

import pytest

from rankpool import RankPool

SCRIPT = """
import os, sys
from mpi4py import MPI
comm = MPI.COMM_WORLD
total = comm.allreduce(comm.rank + 1)
print(f"rank {comm.rank} of {comm.size}: {os.environ['POOL_TEST']} in {os.path.basename(os.getcwd())}, "
      f"sum {total}, argv {sys.argv[1:]}")
if sys.argv[1:] == ["abort"]:
    comm.Abort(3)
if sys.argv[1:] == ["hang"] and comm.rank == 1:
    comm.barrier()
if sys.argv[1].isdigit():
    sys.exit(int(sys.argv[1]))
"""


@pytest.mark.mpi
def test_a_pool_runs_scripts_in_the_callers_environment_and_ends_with_an_abort(tmp_path):
    script = tmp_path / "echo.py"
    script.write_text(SCRIPT)
    (tmp_path / "here").mkdir()
    pool = RankPool(2)
    try:
        for value, status in (("a", 0), ("b", 2)):
            proc = pool.run([str(status)], str(tmp_path / "here"), 60, script=str(script),
                            env={"POOL_TEST": value})
            assert proc.returncode == status, proc.stderr
            assert proc.stdout.splitlines() == [f"rank {r} of 2: {value} in here, sum 3, argv ['{status}']"
                                                for r in (0, 1)], proc.stdout
        assert pool.alive
        assert pool.run(["abort"], str(tmp_path), 60, script=str(script), env={"POOL_TEST": "c"}) is None
        assert not pool.alive
    finally:
        pool.close()
    pool = RankPool(2)
    try:
        start = time.monotonic()
        assert pool.run(["hang"], str(tmp_path), 2, script=str(script), env={"POOL_TEST": "d"}) is None
        assert not pool.alive and time.monotonic() - start < 30
    finally:
        pool.close()
