"""OpenBLAS's kernels (pdeformer/tools/blas.py): a generic core on a CPU with AVX is
replaced by the core of its instructions before numpy loads; everything else is left."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

from conftest import ROOT
from pdeformer.tools import blas
from pdeformer.tools.machine import cpu_flags

AVX512 = {"sse2", "avx", "avx2", "fma", "avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"}
AVX2 = {"sse2", "avx", "avx2", "fma"}


@pytest.mark.parametrize("core, flags, expected", [
    ("Prescott", AVX512, "SkylakeX"),          # Debian 12's OpenBLAS on family 6 model 207
    ("PRESCOTT", AVX512, "SkylakeX"),
    ("Nehalem", AVX2, "Haswell"),
    ("Core2", {"sse2", "avx"}, "Sandybridge"),
    ("Prescott", AVX512 - {"avx512vl"}, "Haswell"),   # not all of SkylakeX's AVX-512
    ("Prescott", {"avx", "avx2"}, "Sandybridge"),       # AVX2 without FMA
    ("Prescott", {"sse2", "sse3"}, None),               # a CPU without AVX: nothing better
    ("SkylakeX", AVX512, None),                         # OpenBLAS knew the CPU
    ("Haswell", AVX512, None),
    ("Zen", AVX2, None),
    ("SapphireRapids", AVX512, None),
])
def test_better_core_only_replaces_generic_cores(core, flags, expected):
    assert blas.better_core(core, flags) == expected


def _before_numpy(monkeypatch):
    """As the command calls it: numpy not loaded yet (in this test process it is)."""
    monkeypatch.delitem(sys.modules, "numpy")


def test_choose_core_sets_the_variable_where_openblas_falls_back(monkeypatch):
    _before_numpy(monkeypatch)
    monkeypatch.setattr(blas, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(blas, "probe_core", lambda: {"library": "/lib/libopenblas.so.0", "core": "Prescott"})
    env = {}
    assert blas.choose_core(env) == {"detected": "Prescott", "set": "SkylakeX", "by": "pdeformer"}
    assert env == {"OPENBLAS_CORETYPE": "SkylakeX"}
    assert "OPENBLAS_CORETYPE=SkylakeX" in blas.describe_choice()
    # OpenBLAS's own choice stands where it is specific
    monkeypatch.setattr(blas, "probe_core", lambda: {"library": "/lib/libopenblas.so.0", "core": "Haswell"})
    env = {}
    assert blas.choose_core(env) == {"detected": "Haswell", "set": None, "by": None} and env == {}
    assert blas.describe_choice() is None
    # no OpenBLAS (another BLAS, or the probe failed): nothing
    monkeypatch.setattr(blas, "probe_core", lambda: {"library": None, "core": None})
    env = {}
    assert blas.choose_core(env)["set"] is None and env == {}


def test_choose_core_leaves_the_user_and_cpus_without_avx_alone(monkeypatch):
    def no_probe():
        raise AssertionError("probed")
    monkeypatch.setattr(blas, "probe_core", no_probe)
    monkeypatch.setattr(blas, "cpu_flags", lambda: AVX512)
    monkeypatch.setattr(blas, "CHOICE", {})
    env = {}      # numpy loaded: the BLAS has chosen, the variable would change nothing
    assert blas.choose_core(env) == {"detected": None, "set": None, "by": None} and env == {}
    _before_numpy(monkeypatch)
    monkeypatch.setattr(blas, "cpu_flags", lambda: AVX512)
    env = {"OPENBLAS_CORETYPE": "Haswell"}
    assert blas.choose_core(env) == {"detected": None, "set": "Haswell", "by": "user"}
    assert env == {"OPENBLAS_CORETYPE": "Haswell"}
    monkeypatch.setattr(blas, "cpu_flags", lambda: {"sse2", "sse3"})
    env = {}
    assert blas.choose_core(env) == {"detected": None, "set": None, "by": None} and env == {}


def _plain_env(tmp_path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_VERBOSE")}
    return dict(env, PDEFORMER_CACHE=str(tmp_path / "cache"), OPENBLAS_NUM_THREADS="1")


def test_probe_is_kept_per_machine(tmp_path, monkeypatch):
    """The probe runs once (a child process), then comes from the cache."""
    monkeypatch.setenv("PDEFORMER_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv("OPENBLAS_CORETYPE", raising=False)
    first = blas.probe_core()
    (kept,) = (tmp_path / "cache").glob("blas-*.json")
    assert json.loads(kept.read_text()) == first
    assert set(first) == {"library", "core"} and (first["library"] is None) == (first["core"] is None)

    def no_child(*args, **kwargs):
        raise AssertionError("probed again")
    monkeypatch.setattr(blas.subprocess, "run", no_child)
    assert blas.probe_core() == first
    # a damaged cache file is probed again (here: the child fails, so nothing is known)
    kept.write_text(json.dumps({"library": 3, "core": ["x"]}))
    monkeypatch.setattr(blas.subprocess, "run", lambda *a, **k: subprocess.CompletedProcess(a, 1, "", ""))
    assert blas.probe_core() == {"library": None, "core": None}


def test_the_command_runs_on_the_core_it_reports(tmp_path):
    """``pdeformer info`` without OPENBLAS_CORETYPE: the core OpenBLAS takes on its own
    (``python -m pdeformer.tools.blas``), or the better one where that is generic (on a
    CPU newer than the OpenBLAS: Debian 12 on family 6 model 207 gives Prescott there,
    SkylakeX here); with OPENBLAS_CORETYPE set, that one."""
    env = _plain_env(tmp_path)
    own = subprocess.run([sys.executable, "-m", "pdeformer.tools.blas"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=120)
    assert own.returncode == 0, own.stderr
    detected = json.loads(own.stdout)["core"]
    if detected is None:
        pytest.skip("numpy does not use OpenBLAS here")
    exe = os.path.join(os.path.dirname(sys.executable), "pdeformer")
    info = subprocess.run([exe, "info"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert info.returncode == 0, info.stderr
    (line,) = [l for l in info.stdout.splitlines() if l.startswith("openblas")]
    expected = blas.better_core(detected, cpu_flags())
    core = re.search(r"\(core (\S+?)[,)]", line).group(1)
    assert core == (expected or detected), line
    assert ("set by pdeformer" in line) == (expected is not None), line
    chosen = subprocess.run([exe, "info"], cwd=ROOT, env=dict(env, OPENBLAS_CORETYPE="Prescott"),
                            capture_output=True, text=True, timeout=120)
    (line,) = [l for l in chosen.stdout.splitlines() if l.startswith("openblas")]
    assert "(core Prescott, set by OPENBLAS_CORETYPE)" in line, line
