"""Shared test helpers: running the CLI (serially and under mpirun), config files."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def has_dolfinx() -> bool:
    try:
        import dolfinx  # noqa: F401
        return True
    except ImportError:
        return False


requires_dolfinx = pytest.mark.skipif(not has_dolfinx(), reason="dolfinx not importable")


def run_cli(args, nprocs: int = 1, cwd: str | None = None, timeout: int = 600,
            check: bool = True) -> subprocess.CompletedProcess:
    """``pdeformer ARGS`` in a subprocess, under ``mpirun -n nprocs`` when nprocs > 1."""
    cmd = [sys.executable, "-m", "pdeformer", *map(str, args)]
    if nprocs > 1:
        from pdeformer.parallel import mpirun_command
        cmd = mpirun_command(nprocs) + cmd
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=cwd or ROOT, capture_output=True, text=True,
                          timeout=timeout, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)} failed ({proc.returncode}):\n"
                             f"{proc.stdout}\n{proc.stderr}")
    return proc


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
