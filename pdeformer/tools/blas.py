"""The kernels OpenBLAS runs on this CPU.

OpenBLAS built for several CPUs (``DYNAMIC_ARCH``, as Debian's and the numpy wheels' are)
picks its kernels when it loads, from the CPU's vendor, family and model. A CPU newer
than the OpenBLAS release falls back to a generic core: Debian 12's OpenBLAS 0.3.21 on a
5th-generation Xeon (GenuineIntel family 6 model 207) takes 'Prescott' (SSE3), and its
matrix products run 4-5x slower than with the AVX-512 kernels the CPU has (measured:
15 against 73 GFLOP/s for a 1000^3 product on one core; the 32^2 default forward
pass's velocity 1.6-1.8 s against 0.74-0.82 s).

:func:`choose_core`, which the ``pdeformer`` command calls before numpy loads, asks
which core OpenBLAS takes here (a child process imports numpy and reads
``openblas_get_corename``; the answer is kept per CPU and Python in
``$PDEFORMER_CACHE/blas-<key>.json``), and where that is a generic core (:data:`GENERIC`)
while the CPU has AVX-512 or AVX2 with FMA, sets ``OPENBLAS_CORETYPE`` to the core of
those instructions (:func:`better_core`) for this process and the ones it starts.
``OPENBLAS_CORETYPE`` set by the user is left alone, and so is a BLAS that is not
OpenBLAS or an OpenBLAS built for one CPU (which ignores the variable).
:func:`blas_record` says in summary.json what the run used.

    python -m pdeformer.tools.blas      # the loaded OpenBLAS, its core (JSON; the probe)
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile

from .machine import cache_dir, cpu_fields, cpu_flags, cpu_identity

# OpenBLAS cores whose kernels use no AVX: what an unknown x86 CPU falls back to
GENERIC = frozenset({"prescott", "core2", "penryn", "dunnington", "nehalem", "atom", "katmai",
                     "coppermine", "northwood", "banias", "athlon", "opteron", "opteron_sse3",
                     "barcelona", "bobcat", "unknown", ""})
AVX512 = frozenset({"avx512f", "avx512cd", "avx512bw", "avx512dq", "avx512vl"})
CORENAME_SYMBOLS = ("openblas_get_corename", "openblas_get_corename64_",
                    "scipy_openblas_get_corename", "scipy_openblas_get_corename64_")
PROBE_TIMEOUT_S = 60

# what choose_core found and did in this process (blas_record reports it)
CHOICE: dict = {}


def better_core(core: str, flags) -> str | None:
    """The OPENBLAS_CORETYPE for a CPU with instruction-set ``flags`` on which OpenBLAS
    took ``core``: SkylakeX (AVX-512 F, CD, BW, DQ, VL), Haswell (AVX2 and FMA) or
    Sandybridge (AVX) where ``core`` is generic (:data:`GENERIC`); None where OpenBLAS's own
    choice stands (a specific core, or a CPU without AVX)."""
    if core.lower() not in GENERIC:
        return None
    flags = set(flags)
    if AVX512 <= flags:
        return "SkylakeX"
    if {"avx2", "fma"} <= flags:
        return "Haswell"
    if "avx" in flags:
        return "Sandybridge"
    return None


def loaded_openblas() -> dict:
    """{"library", "core"} of the OpenBLAS this process has loaded (found among its
    mapped libraries by the ``openblas_get_corename`` symbol); both None where none is
    loaded (not yet, another BLAS, or no /proc)."""
    import ctypes
    try:
        with open("/proc/self/maps") as f:
            paths = [line.split()[5] for line in f if len(line.split()) >= 6]
    except OSError:
        return {"library": None, "core": None}
    seen = set()
    for path in paths:
        name = os.path.basename(path).lower()
        if "blas" not in name or ".so" not in name or path in seen:
            continue
        seen.add(path)
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        for symbol in CORENAME_SYMBOLS:
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_char_p
                return {"library": os.path.realpath(path), "core": fn().decode(errors="replace")}
    return {"library": None, "core": None}


def _cache_path():
    """The probe's cache file: per CPU (vendor, family, model, flags) and Python."""
    fields = cpu_fields()
    text = "\n".join([cpu_identity(), fields.get("vendor_id", ""), fields.get("cpu family", ""),
                      fields.get("model", ""), sys.executable, sys.version])
    return cache_dir() / f"blas-{hashlib.sha256(text.encode()).hexdigest()[:16]}.json"


def _well_formed(found) -> bool:
    """Whether a probe's answer (from the child or the cache file) is {"library", "core"}
    with strings or None."""
    return (isinstance(found, dict) and {"library", "core"} <= set(found)
            and all(isinstance(found[k], (str, type(None))) for k in ("library", "core")))


def probe_core() -> dict:
    """{"library", "core"} that OpenBLAS takes here on its own (OPENBLAS_CORETYPE unset):
    from the cache, else from a child process importing numpy (kept, written atomically;
    nothing kept where it failed or the cache cannot be written)."""
    path = _cache_path()
    try:
        with open(path) as f:
            found = json.load(f)
        if _well_formed(found):
            return found
    except (OSError, ValueError):
        pass
    env = {k: v for k, v in os.environ.items() if k not in ("OPENBLAS_CORETYPE", "OPENBLAS_VERBOSE")}
    env.update(OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    try:
        run = subprocess.run([sys.executable, "-m", "pdeformer.tools.blas"], capture_output=True,
                             text=True, env=env, timeout=PROBE_TIMEOUT_S)
        found = json.loads(run.stdout.strip().splitlines()[-1]) if run.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        found = None
    if not _well_formed(found):
        return {"library": None, "core": None}
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(found, f)
        os.replace(f.name, path)
    except OSError:
        pass
    return found


def choose_core(environ=None) -> dict:
    """Before numpy loads: where OpenBLAS would take a generic core on a CPU with AVX
    (:func:`better_core`), set ``OPENBLAS_CORETYPE`` in ``environ`` (default os.environ).
    Returns (and keeps in :data:`CHOICE`) {"detected": OpenBLAS's own core or None,
    "set": the core set here or None, "by": "user" where OPENBLAS_CORETYPE was set
    already}. No probe where nothing could be changed (a CPU without AVX), and nothing
    where numpy is loaded already."""
    environ = os.environ if environ is None else environ
    if "numpy" in sys.modules:        # too late: the BLAS is loaded (an earlier call's record stays)
        if not CHOICE:
            CHOICE.update(detected=None, set=None, by=None)
        return dict(CHOICE)
    CHOICE.clear()
    if environ.get("OPENBLAS_CORETYPE"):
        CHOICE.update(detected=None, set=environ["OPENBLAS_CORETYPE"], by="user")
        return dict(CHOICE)
    flags = cpu_flags()
    if better_core("", flags) is None:
        CHOICE.update(detected=None, set=None, by=None)
        return dict(CHOICE)
    detected = probe_core()["core"]
    better = better_core(detected, flags) if detected is not None else None
    if better is not None:
        environ["OPENBLAS_CORETYPE"] = better
    CHOICE.update(detected=detected, set=better, by="pdeformer" if better else None)
    return dict(CHOICE)


def describe_choice() -> str | None:
    """One log line where pdeformer set the core, else None."""
    if CHOICE.get("by") != "pdeformer":
        return None
    fields = cpu_fields()
    return (f"OpenBLAS takes its generic '{CHOICE['detected']}' kernels on this CPU "
            f"({fields.get('vendor_id', '?')} family {fields.get('cpu family', '?')} model "
            f"{fields.get('model', '?')}); pdeformer set OPENBLAS_CORETYPE={CHOICE['set']} "
            "(set OPENBLAS_CORETYPE yourself to choose)")


def blas_record() -> dict:
    """For summary.json: the OpenBLAS this process uses and its core, what OpenBLAS
    would take on its own (where pdeformer asked) and who set OPENBLAS_CORETYPE."""
    return {**loaded_openblas(), "detected": CHOICE.get("detected"), "coretype_set_by": CHOICE.get("by")}


if __name__ == "__main__":
    import numpy  # noqa: F401  (loads the BLAS numpy uses)
    print(json.dumps(loaded_openblas()))
