"""Shared test helpers: running the CLI (serially and under mpirun), config files, one-line
errors and diagnostics files compared."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import warnings

import pytest

from rankpool import RankPool, run_in_process

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# a pytest-xdist worker inherits the C environment of the controlling process, where
# importing dolfinx (below) initialised MPI: that job's variables would make the worker's
# own MPI and every mpirun a test starts fail, so they go before anything starts MPI here
if os.environ.get("PYTEST_XDIST_WORKER"):
    for key in [k for k in os.environ if k.startswith(("OMPI_", "PMIX_", "ORTE_"))]:
        del os.environ[key]
    # one BLAS thread per worker (before numpy loads): the workers share the cores, and
    # OpenBLAS threads that wait for a core spin (a fifth of the suite's CPU went there)
    for key in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
        os.environ.setdefault(key, "1")
# the ranks of the jobs tests start share the cores with the other test worker: a rank
# that waits yields its core instead of polling (Open MPI's default only when oversubscribed)
os.environ.setdefault("OMPI_MCA_mpi_yield_when_idle", "1")
# the Pythons the tests start (mpirun jobs, commands) keep their compiled modules, in a
# folder of their own where the environment asks not to write them beside the sources:
# compiling pdeformer afresh costs each of them about 0.1 s
if os.environ.pop("PYTHONDONTWRITEBYTECODE", None):
    import tempfile
    os.environ.setdefault("PYTHONPYCACHEPREFIX",
                          os.path.join(tempfile.gettempdir(), f"pdeformer-tests-pycache-{os.getuid()}"))
# the costs the attention's choices are made from, pinned (pdeformer/attention/costs.py):
# no test depends on this machine's speed; subprocesses inherit it
os.environ.setdefault("PDEFORMER_COSTS", os.path.join(ROOT, "tests", "costs.json"))
# OpenBLAS's kernels chosen before numpy loads, as the pdeformer command chooses them
# (pdeformer/tools/blas.py); the commands the tests start inherit the choice
if "numpy" not in sys.modules:
    from pdeformer.tools.blas import choose_core
    choose_core()


def has_dolfinx() -> bool:
    try:
        import dolfinx  # noqa: F401
        return True
    except ImportError:
        return False


requires_dolfinx = pytest.mark.skipif(not has_dolfinx(), reason="dolfinx not importable")


RUN_COMMANDS = ("forward", "gradient", "train", "particles")   # they draw pictures when they end


def run_cli(args, nprocs: int = 1, cwd: str | None = None, timeout: int = 600,
            check: bool = True, isolated: bool = False, plots: bool = False) -> subprocess.CompletedProcess:
    """``pdeformer ARGS``: under ``mpirun -n nprocs`` when nprocs > 1 (or ``isolated``: a
    fresh process, where its peak memory or environment is the point), else in this
    process through ``pdeformer.commands.cli.main`` (what the command runs, without the start-up of
    a Python and dolfinx per call). A run under mpirun that is to succeed (``check``) goes
    to ranks kept between tests (tests/rankpool.py). Either way a CompletedProcess: exit status, stdout,
    stderr. Runs draw no pictures unless ``plots`` (``--set output.plots=false`` is added:
    drawing takes about a second a run; tests/test_plot.py checks the pictures)."""
    args = list(map(str, args))
    if not plots and args and args[0] in RUN_COMMANDS and "--help" not in args:
        args += ["--set", "output.plots=false"]
    proc = None
    if nprocs == 1 and not isolated:
        proc = run_in_process(args, cwd or ROOT)
    elif check and not isolated and POOLS_WANTED:
        proc = _pool_run(args, nprocs, cwd or ROOT, timeout)
    if proc is None:
        cmd = [sys.executable, "-m", "pdeformer", *map(str, args)]
        if nprocs > 1:
            from pdeformer.tools.parallel import mpirun_command
            cmd = mpirun_command(nprocs) + cmd
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        proc = subprocess.run(cmd, cwd=cwd or ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"pdeformer {' '.join(map(str, args))} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


# ranks kept between the tests' mpirun runs (tests/rankpool.py); PDEFORMER_TEST_POOLS=0
# starts a job for each run instead
POOLS_WANTED = os.environ.get("PDEFORMER_TEST_POOLS", "1") != "0"
_pools: dict = {}


def _pool_run(args: list, nprocs: int, cwd: str, timeout: int, **kwargs) -> subprocess.CompletedProcess | None:
    """A run expected to succeed, on the kept ranks; None where it failed there (the
    caller then runs it as a job of its own, whose outcome is the test's)."""
    pool = _pools.get(nprocs)
    if pool is False:             # could not start here before
        return None
    if pool is None or not pool.alive:
        try:
            pool = _pools[nprocs] = RankPool(nprocs)
        except RuntimeError as e:
            warnings.warn(f"{e}: each run starts a job of its own")
            _pools[nprocs] = False
            return None
    proc = pool.run(args, cwd, timeout, **kwargs)
    if proc is not None and proc.returncode == 0:
        return proc
    command = " ".join(map(str, [kwargs.get("script") or "pdeformer", *args]))
    warnings.warn(f"{command} failed on the ranks kept between tests; run as a job of its own")
    return None


def run_script(script, args=(), nprocs: int = 1, cwd: str | None = None, timeout: int = 300,
               env: dict | None = None) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` under ``mpirun -n nprocs`` (a plain python for 1), for a
    script that is to succeed and leaves the modules it imports as it found them: on
    ranks kept between tests (tests/rankpool.py, a one-rank pool for 1), else, or where
    it fails there, as a job of its own. ``env``: its environment (default: this
    process's, one OpenMP thread)."""
    script, args, cwd = str(script), list(map(str, args)), str(cwd or ROOT)
    env = dict(os.environ if env is None else env, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = _pool_run(args, nprocs, cwd, timeout, script=script, env=env) if POOLS_WANTED else None
    if proc is None:
        cmd = [sys.executable, script, *args]
        if nprocs > 1:
            from pdeformer.tools.parallel import mpirun_command
            cmd = mpirun_command(nprocs) + cmd
        proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout, env=env)
    return proc


def pytest_sessionfinish(session, exitstatus):
    for pool in _pools.values():
        if pool:
            pool.close()


def write_config(folder, text: str, name: str = "run.toml") -> str:
    path = os.path.join(str(folder), name)
    with open(path, "w") as f:
        f.write(textwrap.dedent(text))
    return path


def check_one_line_error(proc, expected, status=2):
    """The CLI ended with ``status`` and one ``pdeformer: error:`` line containing
    ``expected``, without a traceback."""
    assert proc.returncode == status, proc.stderr
    text = proc.stdout + proc.stderr
    assert "Traceback" not in text, text
    ours = [l for l in proc.stderr.splitlines() if l.startswith("pdeformer: error:")]
    assert len(ours) == 1 and expected in ours[0], proc.stderr


def assert_same_diagnostics(file_a, file_b, tol=1e-10):
    """Two diagnostics.csv files have the same rows, prompt by prompt, every number within
    tol (NaN matching NaN); returns both as read."""
    import numpy as np
    from pdeformer.tools.output import read_diagnostics
    a, b = read_diagnostics(str(file_a)), read_diagnostics(str(file_b))
    assert len(a) == len(b) > 0
    for ra, rb in zip(a, b):
        assert ra["prompt"] == rb["prompt"]
        for k in ra:
            if k != "prompt" and not (np.isnan(ra[k]) and np.isnan(rb[k])):
                assert abs(ra[k] - rb[k]) < tol, (k, ra[k], rb[k])
    return a, b


def pytest_collection_modifyitems(config, items):
    """The tests that start mpirun jobs first (the longest; order kept otherwise): run
    in two workers, a long one started last would end the suite alone."""
    items.sort(key=lambda item: item.get_closest_marker("mpi") is None)
