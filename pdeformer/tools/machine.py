"""What a run needs to know of the machine before numpy loads: its CPU and the folder
where pdeformer keeps what it builds or measures per machine. Imports nothing beyond the
standard library (the ``pdeformer`` command reads it before the BLAS library loads)."""

from __future__ import annotations

import os
import platform
from pathlib import Path


def cache_dir() -> Path:
    """``$PDEFORMER_CACHE``, else ``$XDG_CACHE_HOME/pdeformer`` (``~/.cache/pdeformer``)."""
    if os.environ.get("PDEFORMER_CACHE"):
        return Path(os.environ["PDEFORMER_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "pdeformer"


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
