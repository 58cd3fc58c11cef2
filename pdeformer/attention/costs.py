"""What the attention sums cost on this machine, the numbers pdeformer's choices between
ways of summing are made from: ``auto`` takes a laplace table where its table and
interpolation cost less than direct summation; a table sums each tile of sources
through panel nodes or directly, whichever costs less; numpy interpolates through a
fine grid from the table size where that is cheaper than barycentric interpolation.

Each choice compares counts of operations (flops of matrix products, exponentials,
source-columns spread by the compiled loop, interpolated points, direct pairs) weighted
by their seconds on this machine, measured here with the very code the sums run (an
exponential costs 1-2 ns with a vectorised exp and 5-10 ns with a scalar one: a
machine-independent constant would choose badly somewhere).

They are measured once per machine -- CPU (model and instruction-set flags), numpy
version, the compiled loops' build -- by one rank, in about 0.25 s, and kept in
``$PDEFORMER_CACHE/costs-<key>.json``; every rank of a run takes rank 0's numbers
(broadcast), so the ranks agree, and later runs on the machine, on any number of ranks,
choose alike.
``PDEFORMER_COSTS=FILE`` (a JSON object of the :class:`Costs` fields) pins them: then
no choice depends on the machine (the test suite does this). A choice moves a result
only within ``attention.tol``, the accuracy every way of summing is held to.
"""

from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import logging
import os
import tempfile
import time
from pathlib import Path

import numpy as np
from mpi4py import MPI

from ..tools.errors import InputError
from ..tools.files import read_text
from ..tools.blas import loaded_openblas
from .compiled import cache_dir, cpu_identity, kernel_key, kernels

log = logging.getLogger("pdeformer")


COMPILED_FIELDS = ("spread", "spread_call", "fine_point")   # NaN where there are no compiled loops


@dataclasses.dataclass(frozen=True)
class Costs:
    """Seconds per operation, on this machine (see the module's docstring)."""

    flop: float          # one flop of a dense matrix product (BLAS, the measuring run's threads)
    dense_node: float    # a table's direct sums, per grid node and source besides the products
    pair: float          # direct summation: one (target, head, source) pair, forward
    spread: float        # the compiled panel spread: one source and column (nan: no compiled loops)
    spread_call: float   # ... and its fixed cost per call
    fine_point: float    # compiled fine-grid interpolation: one (target, head) (nan: none)
    numpy_point: float   # the same in numpy
    numpy_block: float   # numpy panel spread: one block of sources (one panel pair)

    @classmethod
    def from_dict(cls, data, where: str) -> "Costs":
        """From a JSON object of the fields (seconds > 0; NaN where there are no compiled
        loops); ValueError naming ``where`` otherwise."""
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(data, dict) or set(data) != set(fields):
            raise ValueError(f"{where}: expected a JSON object with exactly the keys {', '.join(fields)}")
        try:
            values = {k: float(data[k]) for k in fields}
        except (TypeError, ValueError):
            raise ValueError(f"{where}: every value must be a number of seconds") from None
        bad = [k for k, v in values.items() if not (v > 0 or (np.isnan(v) and k in COMPILED_FIELDS))]
        if bad:
            raise ValueError(f"{where}: {', '.join(bad)} must be positive seconds (NaN only for "
                             f"{', '.join(COMPILED_FIELDS)}: no compiled loops)")
        return cls(**values)

    @property
    def compiled(self) -> bool:
        return bool(np.isfinite(self.spread) and np.isfinite(self.fine_point))


def _best(fn, repeat: int = 5) -> float:
    """Least wall time of ``repeat`` calls (noise only ever adds)."""
    fn()
    best = np.inf
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _measure_flop(rng) -> float:
    """A 256 x 256 x 512 matrix product."""
    a, b = rng.random((256, 256)), rng.random((256, 512))
    return _best(lambda: a @ b) / (2 * 256 * 256 * 512)


def _measure_dense(table, rng, flop: float) -> float:
    """A 65 x 65 table's three sums over 8192 sources summed directly (LaplaceTable's own
    loop), less its products' flops, per grid node and source."""
    from .laplace import chebyshev_lobatto, table_flops
    n, M = 65, 8192
    pts, c = rng.uniform(-1, 1, (M, 2)), rng.random((M, 3))
    dense = copy.copy(table)
    dense.n, dense.axes = n, [chebyshev_lobatto(n, -2.0, 2.0) for _ in range(2)]
    shifts = [2.0 * np.abs(nodes) for nodes, _ in dense.axes]
    out = np.zeros((3, n, n))
    t = _best(lambda: dense._dense_sums(pts, shifts, c, out), 3)
    return max(t - table_flops(n, 2, 3, M, None) * flop, 0.05 * t) / (n * M)


def _measure_pair(rng) -> dict:
    """Direct summation of 256 targets, 4 heads and 2048 sources in 2-D."""
    from .softmax import Sources, attention_velocity
    src = Sources.from_arrays(rng.normal(size=(2048, 2)), rng.random(2048))
    x, A, V = rng.normal(size=(256, 2)), 0.5 * rng.normal(size=(4, 2, 2)), rng.normal(size=(4, 2, 2))
    return {"pair": _best(lambda: attention_velocity(x, src, A, V), 3) / (256 * 4 * 2048)}


def _measure_tables(rng, provisional: Costs) -> dict:
    """The panel spread (compiled: at two source counts, for its per-source and fixed
    parts; numpy: per block), and fine-grid interpolation (compiled and numpy) on a
    small table of this rank alone, which sums its tiles by the ``provisional`` costs
    (how it sums them does not matter to what is measured)."""
    from .compiled import panel_spread
    from .laplace import FineGrid, LaplaceTable, Panels
    lib = kernels()
    y = rng.uniform(-1.0, 1.0, (20000, 2))
    cols = rng.random((20000, 3))
    panels = [Panels(-1.0, 1.0, 3.0, 18) for _ in range(2)]
    out = {"spread": np.nan, "spread_call": np.nan, "fine_point": np.nan}
    if lib is not None:
        big = _best(lambda: panel_spread(lib, panels, y, cols), 3)
        small = _best(lambda: panel_spread(lib, panels, y[:2000], cols[:2000]), 3)
        per = max((big - small) / (18000 * 3), 1e-12)
        out.update(spread=per, spread_call=max(small - per * 2000 * 3, 1e-6))
    table = LaplaceTable(y[:2000], cols[:2000, 0], [-2.0, -2.0], [2.0, 2.0], 33, MPI.COMM_SELF,
                         signed=False, lib=None, costs=provisional)
    out["dense_node"] = _measure_dense(table, rng, provisional.flop)
    many = [Panels(-1.0, 1.0, 30.0, 18) for _ in range(2)]      # 10 x 10 panels, 4 sources each
    few, few_cols = y[:400], cols[:400]
    out["numpy_block"] = _best(lambda: table._spread(many, few, few_cols), 3) / (many[0].count * many[1].count)
    x, A, V = rng.uniform(-1, 1, (2000, 2)), 0.3 * rng.normal(size=(4, 2, 2)), rng.normal(size=(4, 2, 2))
    fine = FineGrid(table, 132, lib=None)
    out["numpy_point"] = _best(lambda: fine.velocity(x, A, V), 3) / (2000 * 4)
    if lib is not None:
        fine = FineGrid(table, 132, lib=lib)
        out["fine_point"] = _best(lambda: fine.velocity(x, A, V), 3) / (2000 * 4)
    return out


def measure() -> Costs:
    """The costs of this machine, measured now (about 0.25 s), with this process's BLAS
    threads (under mpirun pdeformer sets one per rank; a serial run may have several):
    the first run on a machine writes the numbers later runs share."""
    rng = np.random.default_rng(0)
    flop = _measure_flop(rng)
    provisional = Costs(flop=flop, **{f.name: np.nan for f in dataclasses.fields(Costs) if f.name != "flop"})
    tables = _measure_tables(rng, provisional)
    return Costs(flop=flop, **_measure_pair(rng), **tables)


def machine_key() -> str:
    """What the costs depend on: the CPU, numpy's version, the compiled loops' build and
    the kernels OpenBLAS runs (pdeformer.tools.blas; another BLAS behind the same numpy is
    not seen: remove the file to measure again). Not the rank count or the BLAS threads
    of the run: runs on 1 and on P ranks of a machine take the same numbers, so they
    choose alike and their results agree to round-off."""
    text = "\n".join([cpu_identity(), np.__version__, kernel_key(), str(loaded_openblas()["core"])])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _read(path: Path, what: str) -> Costs:
    """The costs in a JSON file (non-blocking, at most 64 kB: pdeformer.tools.files);
    InputError naming ``what`` where it cannot be read, ValueError where it holds no costs."""
    text = read_text(str(path), what, max_bytes=64 * 1024)
    try:
        data = json.loads(text)
    except ValueError as e:
        raise ValueError(f"{path}: not JSON ({e})") from None
    return Costs.from_dict(data, str(path))


def _load_or_measure() -> Costs:
    """The pinned costs (PDEFORMER_COSTS: InputError where the file is not one), else
    this machine's from the cache, else measured and cached (written atomically; a cache
    that cannot be written is a warning: later runs measure again and may choose
    otherwise, within tol)."""
    pinned = os.environ.get("PDEFORMER_COSTS")
    if pinned:
        try:
            return _read(Path(pinned), "PDEFORMER_COSTS")
        except ValueError as e:
            raise InputError(f"PDEFORMER_COSTS: {e}") from None
    path = cache_dir() / f"costs-{machine_key()}.json"
    try:
        return _read(path, "the costs cache")
    except (InputError, ValueError):   # missing or damaged: measured again
        pass
    costs = measure()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=path.parent, delete=False, suffix=".tmp") as f:
            json.dump(dataclasses.asdict(costs), f, indent=1)
        os.replace(f.name, path)
    except OSError as e:
        log.warning("warning: the attention costs measured here cannot be kept in %s (%s); "
                    "set PDEFORMER_CACHE to a writable folder", path, e.strerror or e)
    return costs


_COSTS: list = []    # this machine's costs, once loaded (a cache of the measurement)


def machine_costs(comm=None) -> Costs:
    """This machine's costs: loaded or measured by rank 0 of ``comm`` and broadcast, the
    first time (collective then: every rank of ``comm`` calls it); the same object
    afterwards. A run loads them once on all its ranks, ahead of any sum, into its
    context (pdeformer.model.context.RunContext), from which its solvers read them.
    Whatever stops rank 0 is raised on every rank (no rank is left waiting)."""
    if not _COSTS:
        comm = comm if comm is not None else MPI.COMM_SELF
        found, error = None, None
        if comm.rank == 0:
            try:
                found = _load_or_measure()
            except InputError as e:
                error = ("input", str(e))
            except Exception as e:       # noqa: BLE001 (broadcast, then raised everywhere)
                error = ("bug", f"{type(e).__name__}: {e}")
        found, error = comm.bcast((found, error), root=0)
        if error is not None:
            if error[0] == "input":
                raise InputError(error[1])
            raise RuntimeError(f"measuring the attention costs failed on rank 0: {error[1]}")
        _COSTS.append(found)
    return _COSTS[0]


def costs_record(costs: Costs) -> dict:
    """The costs as summary.json records them (``attention.costs_s``; null: no compiled loops)."""
    return {k: (v if np.isfinite(v) else None) for k, v in dataclasses.asdict(costs).items()}


def reset() -> None:
    """Forget this process's costs (tests)."""
    _COSTS.clear()
