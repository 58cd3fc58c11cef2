"""``pdeformer`` commands run in this process, or by ranks kept between tests.

A pdeformer command under ``mpirun -n P`` spends about 2 CPU-seconds starting P Pythons
and loading dolfinx before its first cell: more than most test runs themselves. A
:class:`RankPool` starts the P ranks once and runs each command in them through
``pdeformer.commands.cli.main``, as :func:`run_in_process` does serially. The ranks wait
for a command on a socket (no MPI polling while idle). A command that ends the job (an
``MPI_Abort``) ends the pool; the caller runs it again as a job of its own.

Run as a script, this file is one rank of a pool: ``mpirun -n P python rankpool.py SOCKET``.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile

MPI_PREFIXES = ("OMPI_", "PMIX_", "ORTE_", "OPAL_", "HYDRA_", "PMI_")


def run_in_process(args: list, cwd: str) -> subprocess.CompletedProcess:
    """cli.main(args) run from ``cwd`` with stdout and stderr captured: a CompletedProcess
    as ``pdeformer ARGS`` would give."""
    from pdeformer.commands.cli import main
    status, out, err = _captured(lambda: main(args), cwd)
    return subprocess.CompletedProcess(["pdeformer", *args], status, out, err)


def run_script_in_process(script: str, args: list, cwd: str) -> subprocess.CompletedProcess:
    """``python SCRIPT ARGS`` from ``cwd``, in this process (runpy, as ``__main__``, its
    folder first on sys.path)."""
    import runpy
    saved = sys.argv, list(sys.path)
    sys.argv, sys.path[0:0] = [script, *args], [os.path.dirname(os.path.abspath(script))]
    try:
        status, out, err = _captured(lambda: runpy.run_path(script, run_name="__main__"), cwd)
    finally:
        sys.argv, sys.path[:] = saved
    return subprocess.CompletedProcess([sys.executable, script, *args], status, out, err)


def _captured(call, cwd: str) -> tuple[int, str, str]:
    """(exit status, stdout, stderr) of ``call()`` run from ``cwd``: status 0, or that of
    the SystemExit it raises; an exception that escapes is printed as a traceback with
    status 1, as Python would. The logging set-up it makes is undone afterwards
    (pytest's capture keeps working)."""
    import contextlib
    import io
    import logging
    import traceback
    import warnings
    logger = logging.getLogger("pdeformer")
    saved = (list(logger.handlers), logger.propagate, logger.level,
             [(h, h.level) for h in logging.root.handlers])
    out, err = io.StringIO(), io.StringIO()

    def show(message, category, filename, lineno, file=None, line=None):   # as Python would: on stderr
        err.write(warnings.formatwarning(message, category, filename, lineno, line))
    here = os.getcwd()
    os.chdir(cwd)
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            try:
                result = call()
                status = result if isinstance(result, int) else 0
            except SystemExit as e:
                status = 0 if e.code is None else e.code if isinstance(e.code, int) else 1
            except Exception:
                traceback.print_exc()
                status = 1
    finally:
        os.chdir(here)
        logger.handlers[:] = saved[0]
        logger.propagate, logger.level = saved[1], saved[2]
        logging.root.handlers[:] = [h for h, _ in saved[3]]
        for h, level in saved[3]:
            h.setLevel(level)
    return status, out.getvalue(), err.getvalue()


def _send(conn: socket.socket, message: dict) -> None:
    """One line of JSON; a peer gone raises BrokenPipeError (no SIGPIPE: MPI may have
    taken over that signal in this process)."""
    conn.sendall(json.dumps(message).encode() + b"\n", socket.MSG_NOSIGNAL)


def _receive(stream) -> dict | None:
    line = stream.readline()
    return json.loads(line) if line else None


class RankPool:
    """P ranks of one ``mpirun`` job that run pdeformer commands one after another."""

    def __init__(self, nprocs: int, start_timeout: float = 120):
        from pdeformer.tools.parallel import mpirun_command
        self.nprocs = nprocs
        self.folder = tempfile.mkdtemp(prefix=f"pdeformer-pool{nprocs}-")
        path = os.path.join(self.folder, "socket")
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen(nprocs)
        listener.settimeout(start_timeout)
        env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
        self.log = open(os.path.join(self.folder, "ranks.log"), "w")
        self.job = subprocess.Popen(mpirun_command(nprocs) + [sys.executable, os.path.abspath(__file__), path],
                                    stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.ranks: dict[int, tuple] = {}
        try:
            while len(self.ranks) < nprocs:
                conn, _ = listener.accept()
                stream = conn.makefile("rb")
                hello = _receive(stream)
                self.ranks[hello["rank"]] = (conn, stream)
        except OSError:
            self.close(keep_log=True)
            raise RuntimeError(f"the {nprocs} ranks of a test pool did not start; see {self.log.name}")
        finally:
            listener.close()

    def run(self, args: list, cwd: str, timeout: float, script: str | None = None,
            env: dict | None = None) -> subprocess.CompletedProcess | None:
        """``pdeformer ARGS`` (or ``python SCRIPT ARGS``) from ``cwd`` on every rank, in
        the environment ``env`` (default: this process's): exit status (the largest of
        the ranks'), rank 0's output followed by the others'. None when the job ended on
        the way (the pool is closed then)."""
        env = os.environ if env is None else env
        request = {"args": list(args), "cwd": cwd, "script": script,
                   "env": {k: v for k, v in env.items() if not k.startswith(MPI_PREFIXES)}}
        replies = []
        try:
            for rank in range(self.nprocs):
                conn, stream = self.ranks[rank]
                conn.settimeout(timeout)
                _send(conn, request)
            for rank in range(self.nprocs):
                replies.append(_receive(self.ranks[rank][1]))
        except OSError:
            replies.append(None)
        if None in replies:       # a rank ended the job, or is past the timeout
            self.close(patience=1)
            return None
        return subprocess.CompletedProcess(([script] if script else ["pdeformer"]) + list(args),
                                           max(r["status"] for r in replies),
                                           "".join(r["stdout"] for r in replies),
                                           "".join(r["stderr"] for r in replies))

    @property
    def alive(self) -> bool:
        return self.job.poll() is None and len(self.ranks) == self.nprocs

    def close(self, keep_log: bool = False, patience: float = 30) -> None:
        """Tell the ranks to quit; after ``patience`` seconds end the job."""
        for conn, stream in self.ranks.values():
            try:
                _send(conn, {"quit": True})
                stream.close()
                conn.close()
            except OSError:
                pass
        self.ranks = {}
        for stop, wait in ((None, patience), (self.job.terminate, 10), (self.job.kill, None)):
            if stop:
                stop()      # mpirun passes SIGTERM on to the ranks
            try:
                self.job.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                pass
        self.log.close()
        if not keep_log:
            shutil.rmtree(self.folder, ignore_errors=True)


def _serve(path: str) -> None:
    """One rank of a pool: run each command received until told to quit."""
    from mpi4py import MPI
    rank = MPI.COMM_WORLD.rank
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    stream = conn.makefile("rb")
    _send(conn, {"rank": rank})
    own = {k: v for k, v in os.environ.items() if k.startswith(MPI_PREFIXES)}
    while True:
        request = _receive(stream)
        if request is None or request.get("quit"):
            break
        os.environ.clear()
        os.environ.update(request["env"], **own)
        if request["script"]:
            proc = run_script_in_process(request["script"], request["args"], request["cwd"])
        else:
            proc = run_in_process(request["args"], request["cwd"])
        _send(conn, {"status": proc.returncode, "stdout": proc.stdout, "stderr": proc.stderr})


if __name__ == "__main__":
    _serve(sys.argv[1])
