"""The set-up behind `make run` / `make test` (.ci/bootstrap.sh) and the CI entry point."""

import os
import shutil
import subprocess
import sys
import tempfile

import pytest

from conftest import ROOT


def test_ci_runs_the_readme_test_command(tmp_path):
    """.ci/run, started from anywhere, runs in the repository the test command the
    README's "two commands" block gives (a `make` on PATH records what it was asked),
    and fails when that command fails."""
    import re
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read()
    block = readme.split("## The two commands", 1)[1].split("\n\n")[1]
    commands = [re.sub(r"\s*#.*", "", line).split() for line in block.splitlines()]
    assert ["make", "run"] in commands and ["make", "test"] in commands, block
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "make").write_text('#!/bin/sh\necho "$PWD $*" >> "$MAKE_LOG"\nexit "${MAKE_STATUS:-0}"\n')
    os.chmod(fake / "make", 0o755)
    log = tmp_path / "make.log"
    env = dict(os.environ, PATH=f"{fake}:{os.environ['PATH']}", MAKE_LOG=str(log))
    for status in (0, 4):
        proc = subprocess.run(["bash", os.path.join(ROOT, ".ci", "run")], cwd=str(tmp_path),
                              env=dict(env, MAKE_STATUS=str(status)), capture_output=True, text=True,
                              timeout=60)
        assert proc.returncode == status, proc.stderr
    assert log.read_text().splitlines() == [f"{ROOT} test"] * 2


def test_no_tests_is_a_failure():
    """pytest's exit status 5 (nothing collected) makes `make test` fail."""
    proc = subprocess.run(["make", "-s", "test", "TEST_WORKERS=1",
                           "PYTEST_ARGS=-k no_test_has_this_name -p no:cacheprovider"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "exit" in proc.stderr.lower() or "Error 5" in proc.stderr, proc.stderr


def copy_project(dest):
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(os.path.join(ROOT, name), dest)
    for name in ("pdeformer", ".ci"):
        shutil.copytree(os.path.join(ROOT, name), os.path.join(dest, name),
                        ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    return os.path.join(dest, ".ci", "bootstrap.sh")


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root to run the script as an unprivileged user")
def test_without_dolfinx_and_root_it_says_what_to_install():
    folder = tempfile.mkdtemp(prefix="pdeformer-setup-")   # readable by 'nobody'
    try:
        os.chmod(folder, 0o755)
        script = copy_project(folder)
        env = dict(os.environ, PDEFORMER_SETUP_CANDIDATES="/nonexistent/python3")
        env.pop("PDEFORMER_PYTHON", None)
        proc = subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups",
                               "bash", script], capture_output=True, text=True, env=env,
                              timeout=120, cwd="/")
        assert proc.returncode == 2, proc.stderr
        assert "dolfinx not found" in proc.stderr and "python3-dolfinx-real" in proc.stderr
        assert not os.path.exists(os.path.join(folder, ".venv"))
    finally:
        shutil.rmtree(folder)


def test_bad_pdeformer_python_is_refused(tmp_path):
    script = copy_project(str(tmp_path))
    proc = subprocess.run(["bash", script], capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, PDEFORMER_PYTHON="/bin/false"))
    assert proc.returncode == 2 and "cannot import dolfinx" in proc.stderr


@pytest.mark.skipif(not os.path.exists("/usr/bin/python3"), reason="needs /usr/bin/python3")
def test_venv_of_another_python_is_rebuilt(tmp_path):
    """A .venv recorded as made by another Python (the other Debian release) is rebuilt;
    a second run then does nothing."""
    script = copy_project(str(tmp_path))
    base = subprocess.run([sys.executable, "-c", "import sys; print(sys._base_executable)"],
                          capture_output=True, text=True).stdout.strip()
    env = dict(os.environ, PDEFORMER_PYTHON=base)
    venv = tmp_path / ".venv"
    subprocess.run([base, "-m", "venv", "--without-pip", str(venv)], check=True)
    (venv / ".pdeformer-setup").write_text("/usr/bin/python3 3.13.5 0.9.0\n")
    proc = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "rebuilding .venv" in proc.stdout and "ready" in proc.stdout
    out = subprocess.run([str(venv / "bin" / "pdeformer"), "--version"], capture_output=True, text=True)
    assert out.stdout.startswith("pdeformer ")
    again = subprocess.run(["bash", script], capture_output=True, text=True, env=env, timeout=120)
    assert again.returncode == 0 and again.stdout == ""
