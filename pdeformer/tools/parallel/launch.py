"""The mpirun command line, for runs that start ranks of their own (tests, benchmarks)."""

from __future__ import annotations

import os
import shutil
import subprocess


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
