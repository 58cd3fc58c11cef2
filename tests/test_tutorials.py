"""The tutorials (docs/tutorials/*.py) as tests: each runs as a script, serially, and
cluster.py (with forward.py) also under mpirun -n 2. A tutorial's own asserts check its
numbers (exit status 0); here, besides, every line its "It prints" block states must be
a line of what it printed, so the text and the run cannot drift apart."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT, requires_dolfinx

pytestmark = [requires_dolfinx]

TUTORIALS = os.path.join(ROOT, "docs", "tutorials")
NAMES = ["forward", "training", "particles", "sphere", "convergence", "cluster"]


def stated_lines(path: str) -> list[str]:
    """The lines of the tutorial's "It prints" blocks: the indented comment lines
    (``#     text``) after a comment line that says "It prints"."""
    lines, out, inside = open(path, encoding="utf-8").read().splitlines(), [], False
    for line in lines:
        if line.startswith("#") and "It prints" in line:
            inside = True
            continue
        if inside:
            if line.rstrip() == "#":
                continue
            m = re.match(r"^#     (.*\S)\s*$", line)
            if m:
                out.append(m.group(1))
            else:
                inside = False
    return out


def run_tutorial(name: str, tmp_path, nprocs: int = 1) -> subprocess.CompletedProcess:
    """The tutorial as a user runs it: a fresh ``python`` (under ``mpirun -n nprocs``), not
    on the ranks kept between tests, whose imports earlier tests made."""
    cmd = [sys.executable, os.path.join(TUTORIALS, f"{name}.py"), str(tmp_path / name)]
    if nprocs > 1:
        from pdeformer.tools.parallel import mpirun_command
        cmd = mpirun_command(nprocs) + cmd
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("PDEFORMER_TUTORIAL_OUT", None)
    return subprocess.run(cmd, cwd=str(tmp_path), capture_output=True, text=True, timeout=300, env=env)


def check(proc: subprocess.CompletedProcess, name: str):
    assert proc.returncode == 0, f"{name}.py failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}"
    printed = [line.rstrip() for line in proc.stdout.splitlines()]
    stated = stated_lines(os.path.join(TUTORIALS, f"{name}.py"))
    assert stated, f"{name}.py states no printed lines"
    missing = [line for line in stated if line not in printed]
    assert not missing, f"{name}.py did not print the lines it states: {missing}\nit printed:\n{proc.stdout}"
    return printed


def test_every_tutorial_is_listed():
    """docs/tutorials/index.md names every tutorial, and every tutorial is tested here."""
    found = sorted(f[:-3] for f in os.listdir(TUTORIALS) if f.endswith(".py"))
    assert found == sorted(NAMES)
    index = open(os.path.join(TUTORIALS, "index.md"), encoding="utf-8").read()
    assert all(f"({name}.py)" in index for name in NAMES)


@pytest.mark.parametrize("name", NAMES)
def test_tutorial_runs_and_prints_what_it_states(name, tmp_path):
    """The tutorial as a script, serially: exit status 0 (its asserts hold) and the
    lines it states are printed; the files it writes go to the folder it is given."""
    printed = check(run_tutorial(name, tmp_path), name)
    if name == "forward":
        assert (tmp_path / name / "densities.png").stat().st_size > 0
        assert (tmp_path / name / "vtk" / "density_blobs.pvd").exists()
    if name in ("training", "cluster"):
        assert (tmp_path / name / "train" / "history.csv").exists()
    if name == "cluster":
        assert "ranks: 1" in printed


@pytest.mark.mpi
@pytest.mark.parametrize("name", ["cluster", "forward"])
def test_tutorial_under_mpirun(name, tmp_path):
    """cluster.py (and forward.py) under mpirun -n 2: the same stated lines, printed
    once (by rank 0), and cluster.py's checks that the numbers are the same on both
    ranks and within 1e-10 of the serial run."""
    printed = check(run_tutorial(name, tmp_path, nprocs=2), name)
    for line in stated_lines(os.path.join(TUTORIALS, f"{name}.py")):
        assert printed.count(line) == 1, line
    if name == "cluster":
        assert "ranks: 2" in printed
