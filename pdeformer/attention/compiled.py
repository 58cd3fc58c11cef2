r"""Compiled loops of the laplace backend (d = 2, 3): fine-grid interpolation, and panel sums (d = 2).

For each head h and target x_i, with b = A_h x_i and m(b) the tensor Lagrange
interpolant of degree p on the uniform fine grid (:class:`pdeformer.attention.laplace.FineGrid`):

* ``fine_velocity``:  v_i = (1/H) sum_h V_h m(A_h x_i)
* ``fine_velocity_vjp``: for cotangents g_i of v_i, with u = V_h^T g_i / H,
  dV_h = (1/H) sum_i g_i m^T,  dA_h = sum_i (dm/db)^T u x_i^T,  the fine-grid
  cotangent mbar_k[node] += L(node; b) u_k (the transposed interpolation) and, for
  moving targets (particles), xbar_i = sum_h A_h^T (dm/db)^T u.

For sources y_j on panels (:class:`pdeformer.attention.laplace.Panels`) with Lagrange weights
L0_j, L1_j on their panels' nodes:

* ``panel_spread``: W[c] = sum_j cols[j, c] L0_j (x) L1_j (the sources on the nodes)
* ``panel_gather``: out[j, i] = <L0_j (x) L1_j, G_i> (its transpose: grids at the sources)

both one pair of panels at a time (a counting sort of the sources, then one
register-blocked product per pair).

The loops are C, shipped as package data in ``pdeformer/attention/kernels/``: ``laplace_kernels.c``
includes ``fine_loops.h`` once per NC in FINE_WIDTHS (the fine-grid loops for NC values
per node), ``fine3_loops.h`` (``fine3_velocity``, ``fine3_velocity_vjp``: the same
loops in 3-D, four values per node) and ``vector.h`` (the vector type). Constants shared with Python are defined
here only and passed as ``-D`` flags (DEFINES: QMAX = PANEL_QMAX, NP = KERNEL_DEGREE + 1;
the C refuses to compile without them). It is compiled once with the system's C compiler
($CC, default cc) for the CPU it runs on (``-march=native``; without that flag where the
compiler refuses it) into ``$PDEFORMER_CACHE`` (default ``$XDG_CACHE_HOME/pdeformer``,
``~/.cache/pdeformer``) and loaded with ctypes. The file name carries a hash of the C
files, the flags and the CPU (its model and instruction-set flags), so a changed source
is recompiled and nodes of different CPUs sharing one cache each get their own build;
the compiled file is moved into place atomically (ranks compiling at once do not clash).
Targets are taken in blocks: stencils and weights are computed across a block
(vectorised), then the fine-grid sums point by point with vectors of 4 (AVX) or 2
doubles. Without a compiler, or with ``PDEFORMER_NO_KERNEL=1``, :func:`kernels` returns
None and the numpy implementation is used (same maps; the interpolation about 100x
slower).
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from ..tools.machine import cache_dir, cpu_identity

log = logging.getLogger("pdeformer")

KERNEL_DIR = Path(__file__).resolve().parent / "kernels"   # the C files (package data)
KERNEL_SOURCE = KERNEL_DIR / "laplace_kernels.c"            # includes the .h files there

# values per fine-grid node the loops are built for: the NC that laplace_kernels.c
# includes fine_loops.h with (kept equal by hand; kernels() looks the symbols up by name)
FINE_WIDTHS = (2, 4)
# the local Lagrange degree of the fine-grid loops: -DNP = 6 nodes (the C refuses other
# NP: its Lagrange denominators are written out for six)
KERNEL_DEGREE = 5
PANEL_QMAX = 64      # the most nodes per panel the panel loops take (-DQMAX)
DEFINES = [f"-DNP={KERNEL_DEGREE + 1}", f"-DQMAX={PANEL_QMAX}"]
# gnu99: vector extensions and fused multiply-adds; -fno-trapping-math lets the
# clamps of the stencil start vectorise (the values are those of IEEE arithmetic)
FLAGS = ["-O3", "-shared", "-fPIC", "-std=gnu99", "-fno-fast-math", "-fno-trapping-math"]
HOST_FLAGS = ["-march=native"]    # tried first; dropped if the compiler refuses it
_loaded: dict = {}


def __getattr__(name: str):
    """VECTOR_C: the text of kernels/vector.h, the vector type (VW doubles: 4 where AVX is
    there, else 2) that benchmarks/velocity.py builds its FMA probe on; read when asked
    for, so that a missing C file costs the kernels (numpy is used), not the import."""
    if name == "VECTOR_C":
        return (KERNEL_DIR / "vector.h").read_text()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def kernel_files() -> list[Path]:
    """The C files the kernels are built from (all of them go into the cache key)."""
    return sorted(KERNEL_DIR.glob("*.[ch]"))


def _compile(target: Path, source: str | None = None) -> None:
    """The kernels (``source`` given: that C text instead) built into the shared library
    ``target`` with $CC (default cc), FLAGS, DEFINES and -I KERNEL_DIR, HOST_FLAGS where
    the compiler takes them; RuntimeError if it fails, OSError without cc."""
    target.parent.mkdir(parents=True, exist_ok=True)
    cc = os.environ.get("CC", "cc")
    with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
        src = KERNEL_SOURCE
        if source is not None:
            src = Path(tmp) / "source.c"
            src.write_text(source)
        lib = Path(tmp) / target.name
        for extra in (HOST_FLAGS, []):
            run = subprocess.run([cc, *FLAGS, *extra, *DEFINES, f"-I{KERNEL_DIR}", str(src),
                                  "-o", str(lib), "-lm"], capture_output=True, timeout=120)
            if run.returncode == 0:
                break
        else:
            raise RuntimeError(f"{cc} failed: {run.stderr.decode(errors='replace')[-300:]}")
        os.replace(lib, target)       # atomic: a rank never loads a half-written file


def _build_key() -> str:
    """The hash that names a build: the C files, the flags and the machine."""
    machine = f"{sys.platform} {platform.machine()} {platform.libc_ver()} {cpu_identity()}"
    digest = hashlib.sha256()
    for f in kernel_files():
        digest.update(f.name.encode() + b"\0" + f.read_bytes() + b"\0")
    digest.update((" ".join(FLAGS + HOST_FLAGS + DEFINES) + machine).encode())
    return digest.hexdigest()[:16]


def _load(target: Path):
    """The library at ``target``, built first where it is missing (or stale: once more)."""
    if not target.exists():
        _compile(target)
    try:
        return ctypes.CDLL(str(target))
    except OSError:            # a stale or foreign file: build it again, once
        _compile(target)
        return ctypes.CDLL(str(target))


def _declare(lib) -> None:
    """The C signatures of the kernels, for ctypes."""
    dp, lg, it = ctypes.POINTER(ctypes.c_double), ctypes.c_long, ctypes.c_int
    lp, db = ctypes.POINTER(ctypes.c_long), ctypes.c_double
    for nc in FINE_WIDTHS:
        fv, vjp = getattr(lib, f"fine_velocity{nc}"), getattr(lib, f"fine_velocity_vjp{nc}")
        fv.argtypes = [dp, lg, lg, dp, dp, it, dp, lg, dp, dp, lg, dp, dp, db, lp, lg, lp]
        vjp.argtypes = [dp, lg, lg, dp, dp, it, dp, lg, dp, dp, lg, dp, dp, dp, dp, dp, db]
        fv.restype = vjp.restype = None
    lib.fine3_velocity.argtypes = [dp, lg, lg, lg, dp, dp, dp, lg, dp, dp, lg, it, dp, dp, db, lp, lg, lp]
    lib.fine3_velocity_vjp.argtypes = [dp, lg, lg, lg, dp, dp, dp, lg, dp, dp, lg, it, dp, dp, dp, dp, dp, db]
    lib.fine3_velocity.restype = lib.fine3_velocity_vjp.restype = None
    panel = [lg, dp, dp, it, dp, lg, dp, lg, it, dp, dp, dp]
    lib.panel_spread.argtypes = lib.panel_gather.argtypes = panel
    lib.panel_spread.restype = lib.panel_gather.restype = ctypes.c_int
    lib.panel_qmax.argtypes, lib.panel_qmax.restype = [], ctypes.c_int


def kernels():
    """The compiled kernels (a ctypes library), or None where they cannot be had."""
    if "lib" in _loaded:
        return _loaded["lib"]
    lib, key = None, "none"
    if os.environ.get("PDEFORMER_NO_KERNEL", "") in ("", "0"):
        try:
            key = _build_key()
            lib = _load(cache_dir() / f"fine_{key}.so")
            _declare(lib)
            if not self_check(lib):
                log.warning("laplace: the compiled loops from %s fail their check (a compiler "
                            "that reorders floating-point sums?); using numpy", os.environ.get("CC", "cc"))
                lib = None
        except (OSError, RuntimeError, subprocess.SubprocessError) as e:
            _loaded["why"] = f"{type(e).__name__}: {str(e)[-200:]}"
            lib = None
    _loaded["lib"] = lib
    _loaded["key"] = key if lib is not None else "none"
    return lib


def kernel_key() -> str:
    """Which build of the compiled loops this process uses ("none": numpy)."""
    kernels()
    return _loaded.get("key", "none")


def self_check(lib) -> bool:
    """The fine-grid loops reproduce a linear m(b) = b between nodes: from the values m
    (NC = 2), and as mu / zeta with mu = b zeta, zeta = 2 + b_0 - b_1 / 3 (NC = 4); the
    same in 3-D.
    Degree-5 Lagrange interpolation is exact for these; a wrong stencil start (e.g. a
    rounding step folded away by the compiler) or lane order is not."""
    nf, h, lo = 12, np.array([0.5, 0.25]), np.array([-1.0, 2.0])
    nodes = np.stack(np.meshgrid(lo[0] + h[0] * np.arange(nf), lo[1] + h[1] * np.arange(nf),
                                 indexing="ij"), axis=-1).reshape(-1, 2)
    zeta = 2.0 + (nodes[:, 0] - nodes[:, 1] / 3) / 20
    signed = np.column_stack([nodes * zeta[:, None], zeta, np.zeros_like(zeta)])
    b = lo + (nf - 1) * h * np.array([[0.137, 0.731], [0.5013, 0.2499], [0.9, 0.05]])
    eye = np.eye(2)[None]
    plain = fine_velocity(lib, nodes, nf, lo, h, KERNEL_DEGREE, b, eye, eye)
    ratio, skipped = fine_velocity(lib, signed, nf, lo, h, KERNEL_DEGREE, b, eye, eye, zmin=1e-3)
    if not (len(skipped) == 0 and all(np.abs(v - b).max() <= 1e-12 * np.abs(b).max() for v in (plain, ratio))):
        return False
    # d = 3: the same with nodes of (m, 0) and (mu, zeta)
    nf3, h3, lo3 = 9, np.array([0.5, 0.25, 0.75]), np.array([-1.0, 2.0, 0.5])
    nodes3 = np.stack(np.meshgrid(*(lo3[a] + h3[a] * np.arange(nf3) for a in range(3)), indexing="ij"),
                      axis=-1).reshape(-1, 3)
    zeta3 = 2.0 + (nodes3[:, 0] - nodes3[:, 1] / 3 + nodes3[:, 2] / 5) / 20
    b3 = lo3 + (nf3 - 1) * h3 * np.array([[0.137, 0.731, 0.42], [0.5013, 0.2499, 0.9], [0.9, 0.05, 0.3]])
    eye3 = np.eye(3)[None]
    plain3 = fine_velocity(lib, np.column_stack([nodes3, np.zeros(len(nodes3))]), nf3, lo3, h3,
                           KERNEL_DEGREE, b3, eye3, eye3, signed=False)
    ratio3, skipped3 = fine_velocity(lib, np.column_stack([nodes3 * zeta3[:, None], zeta3]), nf3, lo3, h3,
                                     KERNEL_DEGREE, b3, eye3, eye3, np.zeros(2), 1e-3, signed=True)
    return bool(len(skipped3) == 0 and all(np.abs(v - b3).max() <= 1e-12 * np.abs(b3).max()
                                                  for v in (plain3, ratio3)))


def kernels_on(comm):
    """The compiled kernels where every rank of ``comm`` has them, else None: the ranks
    of a job must take the same path (a collective call)."""
    from mpi4py import MPI
    lib = kernels()
    if "why" in _loaded and comm.rank == 0 and not _loaded.get("warned"):   # once, by rank 0
        _loaded["warned"] = True
        log.warning("warning: laplace: the compiled loops cannot be built or loaded (%s); numpy "
                    "interpolates instead, about 100 times slower (set CC to a C compiler, or "
                    "PDEFORMER_NO_KERNEL=1 to choose numpy)", _loaded["why"])
    return lib if comm.allreduce(lib is not None, op=MPI.LAND) else None


def _ptr(a: np.ndarray):
    assert a.dtype == np.float64 and a.flags.c_contiguous
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_double))


def _c(a) -> np.ndarray:
    return np.ascontiguousarray(a, dtype=np.float64)


def fine_velocity(lib, flat, nf: int, lo, h, p: int, x, A, V, stats=None, zmin: float = 0.0,
                  signed: bool | None = None):
    """v (N, d) = (1/H) sum_h V_h m(A_h x) with the compiled loop; ``flat`` (nf^d, NC)
    holds m (d = 2, NC = 2; d = 3: (m, 0)) or (mu, zeta, 0) (d = 2, NC = 4; d = 3:
    (mu, zeta)), m = mu / zeta where ``signed`` (default: NC = 4 in 2-D). Signed:
    ``stats`` (an array of 2) becomes max(stats, (max 1/|zeta|, max |m|)) over the
    points, and the pairs with |zeta| < zmin are left out of v; returns (v, their
    indices h N + i) then."""
    flat, lo, h, x, A, V = map(_c, (flat, lo, h, x, A, V))
    out = np.zeros_like(x)
    three = x.shape[1] == 3
    if three and (flat.shape[1] != 4 or signed is None):
        raise ValueError("fine_velocity in 3-D: flat needs four values per node and signed given")
    signed = flat.shape[1] == 4 if signed is None else signed
    if three:
        call = lib.fine3_velocity
        args = (_ptr(flat), nf, nf, nf, _ptr(lo), _ptr(h), _ptr(x), len(x), _ptr(A), _ptr(V), len(A),
                int(signed), _ptr(out), _ptr(stats) if stats is not None else None, zmin)
    else:
        call = getattr(lib, f"fine_velocity{flat.shape[1]}")
        args = (_ptr(flat), nf, nf, _ptr(lo), _ptr(h), p, _ptr(x), len(x), _ptr(A), _ptr(V), len(A),
                _ptr(out), _ptr(stats) if stats is not None else None, zmin)
    if not signed:
        call(*args, None, 0, None)
        return out
    cap, count = max(64, len(x) * len(A) // 16), ctypes.c_long(0)
    skipped = np.empty(cap, dtype=np.int64)
    call(*args, _iptr(skipped), cap, ctypes.byref(count))
    if count.value > cap:               # more than expected: again, with room for all
        out[:] = 0.0
        skipped, count = np.empty(count.value, dtype=np.int64), ctypes.c_long(0)
        call(*args, _iptr(skipped), len(skipped), ctypes.byref(count))
    return out, skipped[:count.value].copy()


def fine_velocity_vjp(lib, flat, nf: int, lo, h, p: int, x, A, V, g, positions: bool = False,
                      zmin: float = 0.0, signed: bool | None = None):
    """(mbar (nf^d, NC), dA (H, d, d), dV (H, d, d), xbar (N, d) or None) for the
    cotangents g of v; mbar is the cotangent of the NC node values of ``flat`` (node by
    node, as ``flat``); xbar
    (the targets' cotangent) with ``positions``. Signed (as in :func:`fine_velocity`):
    without the pairs |zeta| < zmin."""
    flat, lo, h, x, A, V, g = map(_c, (flat, lo, h, x, A, V, g))
    mbar = np.zeros(flat.shape)
    dA, dV = np.zeros_like(A), np.zeros_like(V)
    xbar = np.zeros_like(x) if positions else None
    if x.shape[1] == 3:
        if flat.shape[1] != 4 or signed is None:
            raise ValueError("fine_velocity_vjp in 3-D: flat needs four values per node and signed given")
        lib.fine3_velocity_vjp(_ptr(flat), nf, nf, nf, _ptr(lo), _ptr(h), _ptr(x), len(x), _ptr(A),
                               _ptr(V), len(A), int(bool(signed)), _ptr(g), _ptr(mbar), _ptr(dA),
                               _ptr(dV), _ptr(xbar) if positions else None, zmin)
        return mbar, dA, dV, xbar
    getattr(lib, f"fine_velocity_vjp{flat.shape[1]}")(
        _ptr(flat), nf, nf, _ptr(lo), _ptr(h), p, _ptr(x), len(x), _ptr(A), _ptr(V), len(A),
        _ptr(g), _ptr(mbar), _ptr(dA), _ptr(dV), _ptr(xbar) if positions else None, zmin)
    return mbar, dA, dV, xbar


def _iptr(a: np.ndarray):
    assert a.dtype == np.int64 and a.flags.c_contiguous and ctypes.sizeof(ctypes.c_long) == 8
    return a.ctypes.data_as(ctypes.POINTER(ctypes.c_long))


def _panel_args(panels):
    """Edges, counts and the standard nodes of two axes' Panels (laplace.Panels), and the
    arrays behind the pointers (to be kept alive during the call)."""
    e0, e1, std, lam = (_c(a) for a in (panels[0].edges, panels[1].edges, panels[0].std, panels[0].lam))
    return (_ptr(e0), panels[0].count, _ptr(e1), panels[1].count, panels[0].q, _ptr(std),
            _ptr(lam)), (e0, e1, std, lam)


def panel_spread(lib, panels, y, cols) -> np.ndarray:
    """W (ncols, K0, K1) = sum_j cols[j, c] L(y_j0) (x) L(y_j1): sources on panel nodes."""
    y, cols = _c(y), _c(cols)
    W = np.zeros((cols.shape[1], len(panels[0].nodes), len(panels[1].nodes)))
    args, keep = _panel_args(panels)
    if lib.panel_spread(len(y), _ptr(y), _ptr(cols), cols.shape[1], *args, _ptr(W)):
        raise MemoryError("panel_spread: out of memory")
    return W


def panel_gather(lib, panels, y, G) -> np.ndarray:
    """out (M, ni): the panel-node grids G (ni, K0, K1) interpolated at the sources y."""
    y, G = _c(y), _c(G)
    out = np.empty((len(y), G.shape[0]))
    args, keep = _panel_args(panels)
    if lib.panel_gather(len(y), _ptr(y), _ptr(G), G.shape[0], *args, _ptr(out)):
        raise MemoryError("panel_gather: out of memory")
    return out
