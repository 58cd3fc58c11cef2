"""What a run needs to know of the machine before numpy loads: its CPU and the folder
where pdeformer keeps what it builds or measures per machine. Imports nothing beyond the
standard library (the ``pdeformer`` command reads it before the BLAS library loads)."""

from __future__ import annotations

import os
import platform
import stat
import tempfile
from pathlib import Path


def cache_home() -> Path:
    """``$XDG_CACHE_HOME``, else ``~/.cache``: where dolfinx keeps its JIT-compiled forms
    (``fenics/``) and pdeformer what it builds and measures (``pdeformer/``)."""
    home = os.environ.get("HOME") or "/"
    return Path(os.environ.get("XDG_CACHE_HOME") or Path(home) / ".cache")


def cache_dir() -> Path:
    """``$PDEFORMER_CACHE``, else ``$XDG_CACHE_HOME/pdeformer`` (``~/.cache/pdeformer``)."""
    if os.environ.get("PDEFORMER_CACHE"):
        return Path(os.environ["PDEFORMER_CACHE"])
    return cache_home() / "pdeformer"


def _writable(folder: Path) -> str | None:
    """None where ``folder`` can be made and written, else why not."""
    if os.path.lexists(folder) and not folder.is_dir():
        return "not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as e:
        return e.strerror or type(e).__name__
    return None


def _private_folder(path: Path) -> str | None:
    """None where ``path`` is (or is made) a folder of this user alone, not a link."""
    try:
        path.mkdir(mode=0o700, exist_ok=True)
        info = os.lstat(path)
    except OSError as e:
        return e.strerror or type(e).__name__
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
        return "not a folder of this user"
    return _writable(path)


def prepare_caches() -> list[str]:
    """Make sure the caches a run writes (dolfinx's JIT forms, pdeformer's compiled loops
    and measured costs) can be written before dolfinx is imported (it fixes its cache
    folder then). Where ``$XDG_CACHE_HOME`` (``~/.cache``) or ``$PDEFORMER_CACHE`` cannot
    be written (a read-only or missing HOME on a cluster node), a private folder in the
    temporary directory takes its place: the environment is set for this process and the
    programs it starts. Returns the warnings to log; InputError where no writable
    folder is found."""
    from .errors import InputError
    notes = []
    for var, folder, sub in (("XDG_CACHE_HOME", cache_home(), "fenics"),
                             ("PDEFORMER_CACHE", cache_dir(), None)):
        if var == "PDEFORMER_CACHE" and not os.environ.get(var):
            folder = cache_dir()           # under XDG_CACHE_HOME, as chosen above
        why = _writable(folder / sub if sub else folder)
        if why is None:
            continue
        try:
            fallback = Path(tempfile.gettempdir()) / f"pdeformer-cache-{os.getuid()}"
            problem = _private_folder(fallback)
        except OSError as e:               # (no usable temporary directory at all)
            fallback, problem = Path(os.environ.get("TMPDIR") or "/tmp"), e.strerror or type(e).__name__
        if problem is not None:
            raise InputError(f"{var}: {folder} cannot be written ({why}), nor {fallback} ({problem}): "
                             "set XDG_CACHE_HOME (and PDEFORMER_CACHE) to a writable folder")
        os.environ[var] = str(fallback if sub else fallback / "pdeformer")
        notes.append(f"warning: {var}: {folder} cannot be written ({why}); the caches go to "
                     f"{os.environ[var]} instead (set {var} to a writable folder to keep them)")
    return notes


def cpu_fields() -> dict:
    """The first processor's fields in Linux's /proc/cpuinfo (lower-case keys; empty
    where there is none)."""
    try:
        block = Path("/proc/cpuinfo").read_text().split("\n\n")[0]
    except OSError:
        return {}
    out = {}
    for line in block.splitlines():
        key, sep, value = line.partition(":")
        if sep:
            out[key.strip().lower()] = value.strip()
    return out


def cpu_identity() -> str:
    """The CPU as far as compiled code cares: model and instruction-set flags (Linux's
    /proc/cpuinfo; elsewhere what platform reports)."""
    keep = ("model name", "flags", "features", "cpu part", "cpu implementer", "isa")
    try:
        lines = Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
        return " | ".join(ln for ln in lines if ln.split(":")[0].strip().lower() in keep)
    except OSError:
        return f"{platform.processor()} {platform.machine()}"


def cpu_flags() -> set:
    """The CPU's instruction-set flags (x86 ``flags``, Arm ``features``)."""
    fields = cpu_fields()
    return set((fields.get("flags") or fields.get("features") or "").split())


def _proc_bytes(path: str, field: str) -> float | None:
    """A "Field:  N kB" line of a /proc file, in bytes (None where there is none)."""
    try:
        with open(path) as f:
            for line in f:
                if line.startswith(field + ":"):
                    return float(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def peak_memory() -> float:
    """This process's peak resident memory in bytes: VmHWM of /proc/self/status (the
    program's own; getrusage's maxrss also counts the process it was forked from)."""
    peak = _proc_bytes("/proc/self/status", "VmHWM")
    if peak is None:
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024.0
    return peak


def available_memory() -> float | None:
    """MemAvailable of this node in bytes (None where /proc/meminfo has none)."""
    return _proc_bytes("/proc/meminfo", "MemAvailable")
