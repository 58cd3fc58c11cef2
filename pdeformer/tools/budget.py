"""How much memory a run will take, estimated from its configuration before anything is
allocated, and refused when it exceeds what the machine has.

Per rank, in bytes (the constants are peak resident sizes of ``pdeformer forward`` and
``particles`` runs measured on dolfinx 0.5.2, rounded up; see docs/reliability.md):

    BASE                                   interpreter, dolfinx, PETSc, JIT modules
    + PER_COEFFICIENT * DG coefficients / ranks of the group (mesh, spaces, forms,
                                           mass solver, stage vectors: 0.48-0.77 kB measured
                                           for DG-1..3 on triangles and tetrahedra)
    + PER_CELL_EVERYWHERE * cells          attention sources and mesh construction, which
                                           every rank holds for the whole mesh
    + LAPLACE_TABLES                       (laplace/auto in 1-D and 2-D; in 3-D
                                           LAPLACE_TABLES_3D: the caps of the fine grid, the
                                           panel sums (twice: reordered) and the tiles' sums)
    + tape                                 (gradient, train: the stage densities of every
                                           step of a prompt, and tables up to tape_mb)
    + PER_TOKEN * d * tokens               (particles: every rank draws all N tokens; 650 B
                                           per token measured in 2-D)
    + heads                                Q, K, V with gradients and optimiser moments

Steps of a CFL-controlled run are not known in advance: the tape counts
MIN_STEPS_PER_LAYER, so for those runs the estimate is a lower bound. A rank's need times
the ranks on its node must stay under ``[output] max_memory_gb`` (default: the node's
available memory, MemAvailable); otherwise the run stops as bad input (exit 2) with the
estimate, on every rank.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from .errors import ConfigError

MB = 2**20
BASE = 160 * MB
PER_COEFFICIENT = 800
PER_CELL_EVERYWHERE = 200
LAPLACE_TABLES = 64 * MB
LAPLACE_TABLES_3D = 512 * MB   # pdeformer.attention.laplace: FINE3_BYTES + 2 PANEL3_BYTES + TILE_SUMS3_BYTES
PER_TOKEN = 400            # per token and dimension
MIN_STEPS_PER_LAYER = 4

ADVICE = {"mesh": "use more nodes or a coarser mesh",
          "tokens": "use fewer particles.tokens (every rank draws all of them)",
          "tape": "use fewer steps_per_layer or a smaller attention.tape_mb",
          "heads": "use fewer model.layers, heads or key_dim",
          "laplace_tables": "use more nodes",
          "jacobian": "use fewer prompts (data.test_fraction, data.count) or heads"}

SIMPLICES_PER_BOX_CELL = {"interval": 1, "triangle": 2, "quadrilateral": 1, "tetrahedron": 6,
                          "hexahedron": 1}


def mesh_size(mesh: dict) -> tuple[int, int, str] | None:
    """(cells, the cells' dimension, cell type) of the [mesh] section: the box's, or read from the
    Topology of the XDMF file's grid (no mesh data is loaded); None if the file does not
    say (reading the mesh then reports what is wrong with it)."""
    if mesh["shape"] == "circle":
        return mesh["cells"][0], 1, "interval"
    if mesh["shape"] == "sphere":
        return 20 * 4 ** mesh["refinements"], 2, "triangle"
    if mesh["file"] is None:
        d = len(mesh["cells"])
        cell = mesh["cell"] or {1: "interval", 2: "triangle", 3: "tetrahedron"}[d]
        return math.prod(mesh["cells"]) * SIMPLICES_PER_BOX_CELL.get(cell, 1), d, cell
    try:
        root = ET.parse(mesh["file"]).getroot()
        grid = next(g for g in root.iter("Grid") if g.get("Name") == mesh["name"])
        topo = grid.find("Topology")
        cells = int(topo.get("NumberOfElements") or topo.find("DataItem").get("Dimensions").split()[0])
        cell = (topo.get("TopologyType") or "").lower()
    except (OSError, ET.ParseError, StopIteration, AttributeError, ValueError, IndexError):
        return None
    d = {"polyline": 1, "interval": 1, "triangle": 2, "quadrilateral": 2, "tetrahedron": 3,
         "hexahedron": 3}.get(cell, 3)
    return cells, d, cell


def token_dimension(mesh: dict, tdim: int) -> int:
    """d of the tokens: the cells' dimension, or one more on a circle or sphere (built
    in, or a mesh file whose Geometry has more coordinates than its cells' dimension)."""
    if mesh["file"] is None:
        return tdim + (mesh["shape"] != "box")
    try:
        root = ET.parse(mesh["file"]).getroot()
        grid = next(g for g in root.iter("Grid") if g.get("Name") == mesh["name"])
        gdim = {"X": 1, "XY": 2, "XYZ": 3}.get(grid.find("Geometry").get("GeometryType", ""), tdim)
    except (OSError, ET.ParseError, StopIteration, AttributeError):
        return tdim
    return gdim if gdim == tdim + 1 else tdim


def dofs_per_cell(cell: str, degree: int, d: int) -> int:
    """DG-k coefficients per cell: simplices C(k + d, d), boxes (k + 1)^d."""
    if cell in ("quadrilateral", "hexahedron"):
        return (degree + 1) ** d
    return math.comb(degree + d, d)


def estimate(cfg: dict, command: str, group_size: int, differentiable: bool = False) -> dict:
    """Bytes per rank, by part (see the module docstring), and their total.
    ``differentiable``: the run keeps a tape for gradients."""
    size = mesh_size(cfg["mesh"])
    cells, tdim, cell = size if size is not None else (0, 3, "tetrahedron")
    d = token_dimension(cfg["mesh"], tdim)     # the tokens' (ambient on a sphere)
    disc, model = cfg["discretisation"], cfg["model"]
    coeffs = cells * dofs_per_cell(cell, disc["degree"], tdim)
    parts = {"base": BASE,
             "mesh": PER_COEFFICIENT * coeffs / group_size + PER_CELL_EVERYWHERE * cells}
    if cfg["attention"]["backend"] in ("laplace", "auto"):
        parts["laplace_tables"] = LAPLACE_TABLES if d <= 2 else LAPLACE_TABLES_3D
    L, H = model["layers"], model["heads"]
    k = model["key_dim"] or d
    if L is not None and H is not None:
        parts["heads"] = 8 * L * H * (2 * k * d + d * d) * 8   # params, gradients, moments, copies
    if command == "gram" and L is not None and H is not None:   # J and dA, dV per output, G
        outputs = len(cfg["prompts"]) * (d + d * (d + 1) // 2)
        parts["jacobian"] = 8 * outputs * (4 * L * H * (2 * k * d + d * d) + outputs)
    if command == "particles":
        tokens = cfg["particles"]["tokens"]
        parts["tokens"] = PER_TOKEN * d * tokens
        if differentiable and L is not None:
            steps = cfg["particles"]["steps_per_layer"] or MIN_STEPS_PER_LAYER
            parts["tape"] = 8 * d * tokens / group_size * L * steps * 4
    elif differentiable and L is not None:
        steps = disc["steps_per_layer"] or MIN_STEPS_PER_LAYER
        stages = 4
        parts["tape"] = 8 * 2 * coeffs / group_size * L * steps * stages \
            + cfg["attention"]["tape_mb"] * MB
    parts["total"] = sum(parts.values())
    return parts


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


def check_memory(cfg: dict, command: str, comm, world=None, differentiable: bool = False) -> dict:
    """Refuse (ConfigError on every rank of ``world``) a run whose estimate, summed over
    the ranks of a node, exceeds ``[output] max_memory_gb`` or the node's available
    memory. ``comm``: the communicator the mesh is partitioned over (a prompt group);
    ``world``: all ranks of the run (default comm). Returns the estimate."""
    from mpi4py import MPI
    world = world or comm
    parts = estimate(cfg, command, comm.size, differentiable)
    node = world.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = node.size
    node.Free()
    limit_gb = cfg["output"]["max_memory_gb"]
    limit = limit_gb * 2**30 if limit_gb is not None else available_memory()
    need = parts["total"] * on_node
    over = limit is not None and need > limit
    worst = world.allreduce((need / limit) if over else 0.0, op=MPI.MAX)
    if worst > 0:
        top = sorted(((v, k) for k, v in parts.items() if k not in ("total", "base")), reverse=True)[:2]
        what = ", ".join(f"{k} {v / 2**30:.3g} GB" for v, k in top)
        where = (f"the limit of {limit_gb:g} GB" if limit_gb is not None
                 else f"the {limit / 2**30:.3g} GB available on this node")
        raise ConfigError("output.max_memory_gb",
                          f"this run needs about {parts['total'] / 2**30:.3g} GB per rank "
                          f"({what}), {need / 2**30:.3g} GB for the {on_node} rank(s) of a node: "
                          f"{worst:.3g} times {where}; {ADVICE[top[0][1]]}, or set output.max_memory_gb")
    return parts
