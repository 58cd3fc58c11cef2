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
    + tape                                 (gradient, train: per step and stage of a prompt
                                           the density, velocity and their ghost entries,
                                           and the limiter's records, counted as if every
                                           cell were limited; tables up to tape_mb; see
                                           :func:`dg_tape_bytes`)
    + PER_TOKEN * d * tokens               (particles: every rank draws all N tokens; 650 B
                                           per token measured in 2-D)
    + heads                                Q, K, V with gradients and optimiser moments
    + prompts                              per prompt its records (PER_PROMPT, and
                                           PER_FRAME_ROW per frame) and its initial density
                                           on the rank's share of the mesh (twice with a
                                           teacher, whose pass holds its own)

Steps of a CFL-controlled run are not known in advance: the tape counts
MIN_STEPS_PER_LAYER, so for those runs the estimate is a lower bound. With fixed steps
(``steps_per_layer``; particles always) the tape part bounds the tape the adjoint keeps
(``tape_bytes_per_rank`` of summary.json) from above: without the tables (all of
tape_mb is added), exactly on one rank without the limiter on a box or circle
(elsewhere the velocity's nodes are counted from above).
A rank's need times the ranks on its node must stay under ``[output] max_memory_gb``
(default: the node's available memory, MemAvailable); otherwise the run stops as bad
input (exit 2) with the estimate, on every rank.
"""

from __future__ import annotations

import math
import xml.etree.ElementTree as ET

from ..integrator.schemes import SCHEMES
from ..model.particles import PARTICLE_STEPS_PER_LAYER
from ..tools.datasets import teacher_given
from ..tools.errors import ConfigError, InputError
from ..tools.machine import available_memory

MB = 2**20
BASE = 160 * MB
PER_COEFFICIENT = 800
PER_CELL_EVERYWHERE = 200
LAPLACE_TABLES = 64 * MB
LAPLACE_TABLES_3D = 512 * MB   # pdeformer.attention.laplace: FINE3_BYTES + 2 PANEL3_BYTES + TILE_SUMS3_BYTES
PER_TOKEN = 400            # per token and dimension
PER_PROMPT = 8 * 1024      # a prompt's tables, objects and records on every rank, and its
PER_FRAME_ROW = 6 * 1024   # diagnostics row and frame records per frame (measured with a
                           # teacher's pass, per drawn prompt: 16 kB with 2 frames and 96
                           # coefficients, 43.6 kB with 5 frames and 384 coefficients)
MIN_STEPS_PER_LAYER = 4
LIMITED_CELL_BYTES = 32    # per limited cell: its index, theta, mean and minimum (+ 16 B per dof)
# A rank's share of a partitioned mesh (rank_share): its owned cells and nodes are at most
# PARTITION_IMBALANCE times the average, its ghosts GHOST_CELLS (cells) and GHOST_NODES
# (Lagrange nodes) times owned^((t-1)/t). Largest measured on dolfinx 0.5.2 partitions of
# boxes (triangles, quadrilaterals, tetrahedra, hexahedra), meshes/disk and meshes/ball
# on 2-4 ranks: 1.02 (cells), 1.075 (nodes, 729 of them), 2.5 and 6.7.
PARTITION_IMBALANCE = 1.08
GHOST_CELLS = 3.0
GHOST_NODES = 7.0

ADVICE = {"mesh": "use more nodes or a coarser mesh",
          "prompts": "use fewer prompts (data.count), more nodes or prompt groups",
          "tokens": "use fewer particles.tokens (every rank draws all of them)",
          "tape": "use fewer steps_per_layer or a smaller attention.tape_mb",
          "heads": "use fewer model.layers, heads or key_dim",
          "laplace_tables": "use more nodes",
          "jacobian": "use fewer prompts (data.test_fraction, data.count) or heads"}

SIMPLICES_PER_BOX_CELL = {"interval": 1, "triangle": 2, "quadrilateral": 1, "tetrahedron": 6,
                          "hexahedron": 1}


def _xdmf_grid(mesh: dict):
    """The mesh file's XDMF Grid of the configured name (only the header is read), or
    None where the file cannot say."""
    from ..tools.files import XDMF_BYTES, read_bytes
    try:
        root = ET.fromstring(read_bytes(mesh["file"], "mesh.file", XDMF_BYTES))
        return next(g for g in root.iter("Grid") if g.get("Name") == mesh["name"])
    except (InputError, ET.ParseError, StopIteration):
        return None


def _rows(node) -> int | None:
    """The leading dimension of an XDMF Topology or Geometry (None where it has none)."""
    try:
        return int(node.get("NumberOfElements") or node.find("DataItem").get("Dimensions").split()[0])
    except (AttributeError, ValueError, IndexError):
        return None


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
    grid = _xdmf_grid(mesh)
    topo = grid.find("Topology") if grid is not None else None
    cells = _rows(topo)
    if cells is None:
        return None
    cell = (topo.get("TopologyType") or "").lower()
    d = {"polyline": 1, "interval": 1, "triangle": 2, "quadrilateral": 2, "tetrahedron": 3,
         "hexahedron": 3}.get(cell, 3)
    return cells, d, cell


def token_dimension(mesh: dict, tdim: int) -> int:
    """d of the tokens: the cells' dimension, or one more on a circle or sphere (built
    in, or a mesh file whose Geometry has more coordinates than its cells' dimension)."""
    if mesh["file"] is None:
        return tdim + (mesh["shape"] != "box")
    grid = _xdmf_grid(mesh)
    geometry = grid.find("Geometry") if grid is not None else None
    if geometry is None:
        return tdim
    gdim = {"X": 1, "XY": 2, "XYZ": 3}.get(geometry.get("GeometryType", ""), tdim)
    return gdim if gdim == tdim + 1 else tdim


def dofs_per_cell(cell: str, degree: int, d: int) -> int:
    """DG-k coefficients per cell: simplices C(k + d, d), boxes (k + 1)^d."""
    if cell in ("quadrilateral", "hexahedron"):
        return (degree + 1) ** d
    return math.comb(degree + d, d)


def lagrange_nodes(mesh: dict, cells: int, tdim: int, cell: str, k: int) -> float:
    """Nodes of degree-k Lagrange elements on the whole mesh: on a box prod (k N_a + 1)
    (its simplices add no vertices, so every cell type has the same lattice), on a
    circle k N; otherwise V + (k-1) E + (nodes inside a face) F + (inside a cell) C from
    V vertices (the file's Geometry; C/2 + 2 on the sphere; C + 1 where a file does not
    say), C cells and the bounds of :func:`edges_and_faces`."""
    if mesh["shape"] == "circle":
        return float(k * cells)
    if mesh["shape"] == "box" and mesh["file"] is None:
        return float(math.prod(k * n + 1 for n in mesh["cells"]))
    if mesh["shape"] == "sphere":
        vertices = cells / 2 + 2
    else:
        grid = _xdmf_grid(mesh)
        vertices = _rows(grid.find("Geometry")) if grid is not None else None
        vertices = vertices if vertices is not None else cells + 1
    m = k - 1                                     # nodes inside an edge
    if tdim == 1:
        return float(vertices + m * cells)
    edges, faces = edges_and_faces(cell, vertices, cells)
    simplex = cell in ("triangle", "tetrahedron")
    in_face = m * (m - 1) / 2 if simplex else m * m
    if tdim == 2:
        return float(vertices + m * edges + in_face * cells)
    in_cell = m * (m - 1) * (m - 2) / 6 if simplex else m ** 3
    return float(vertices + m * edges + in_face * faces + in_cell * cells)


def edges_and_faces(cell: str, V: float, C: float) -> tuple[float, float]:
    """Upper bounds on the edges and faces of a mesh of C cells and V vertices, from
    Euler's formula: a surface or a planar mesh with at most one hole has E <= V + C
    (F = C); a volume mesh has F = (f C + F_b) / 2 and E = V + F - C - 1 for f faces per
    cell, with at most 2 V boundary triangles (tetrahedra: E <= 2 V + C, F <= 2 C + V)
    or V boundary quadrilaterals (hexahedra: E <= 1.5 V + 2 C, F <= 3 C + V / 2)."""
    if cell == "tetrahedron":
        return 2 * V + C, 2 * C + V
    if cell == "hexahedron":
        return 1.5 * V + 2 * C, 3 * C + V / 2
    return V + C, C


def rank_share(count: float, tdim: int, ranks: int, layer: float) -> tuple[float, float]:
    """(owned, ghost) entries of one rank when ``count`` cells or nodes of a t-dimensional
    mesh are partitioned over ``ranks``: the owned share times PARTITION_IMBALANCE, and
    ``layer`` (owned)^((t-1)/t) ghosts, no more than the others own; (count, 0) on one
    rank. The ghosts are those of a compact part's boundary (a square of 2 s^2 triangles
    has 4 s edges, 2.8 A^(1/2); a cube of 6 s^3 tetrahedra 12 s^2 faces, 3.6 A^(2/3))."""
    if ranks <= 1:
        return float(count), 0.0
    own = count / ranks
    return PARTITION_IMBALANCE * own, min(layer * own ** ((tdim - 1) / tdim), count - own)


def dg_tape_bytes(cfg: dict, cells: int, tdim: int, cell: str, d: int, ranks: int) -> float:
    """Bytes of one prompt's tape on a rank of a group of ``ranks`` (without its tables,
    ``tape_mb``): per stage of every step (the scheme's stages, steps_per_layer or
    MIN_STEPS_PER_LAYER per layer) the owned density coefficients and d velocity values
    per owned Lagrange node, with their ghost entries (:func:`rank_share`); with the
    limiter one record per stage of LIMITED_CELL_BYTES + 16 B per dof for every owned
    cell (the most it can limit; runs on 32^2-64^2 limit about half their cells)."""
    disc = cfg["discretisation"]
    n = dofs_per_cell(cell, disc["degree"], tdim)
    own, ghosts = rank_share(cells, tdim, ranks, GHOST_CELLS)
    nodes = sum(rank_share(lagrange_nodes(cfg["mesh"], cells, tdim, cell, disc["velocity_degree"]),
                           tdim, ranks, GHOST_NODES))
    stage = 8 * n * (own + ghosts) + 8 * d * nodes
    if disc["limiter"]:
        stage += own * (LIMITED_CELL_BYTES + 16 * n)
    steps = disc["steps_per_layer"] or MIN_STEPS_PER_LAYER
    return cfg["model"]["layers"] * steps * scheme_stages(disc["scheme"]) * stage


def particle_tape_bytes(cfg: dict, d: int, manifold: bool, ranks: int) -> float:
    """Bytes of the largest prompt's particle tape on a rank: per stage of every step its
    block of the tokens' positions and velocities (on a circle or sphere also the
    positions before renormalising and the velocity's radial part). A prompt has
    [particles] tokens, an inline point cloud its own points (a point cloud read from a
    file is counted as [particles] tokens)."""
    disc, pc = cfg["discretisation"], cfg["particles"]
    steps = pc["steps_per_layer"] or disc["steps_per_layer"] or PARTICLE_STEPS_PER_LAYER
    counts = [len(p["points"]) if p.get("kind") == "points" and p.get("points") is not None
              else pc["tokens"] for p in cfg["prompts"]]
    tokens = math.ceil(max(counts, default=pc["tokens"]) / ranks)
    stage = 8 * tokens * (3 * d + 1 if manifold else 2 * d)
    return cfg["model"]["layers"] * steps * scheme_stages(disc["scheme"]) * stage


def scheme_stages(name: str) -> int:
    """Stages of an SSP scheme (pdeformer.integrator.schemes)."""
    return SCHEMES[name].stages


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
    teacher = teacher_given(cfg["data"])
    parts["prompts"] = prompt_bytes(len(cfg["prompts"]), model["layers"] or 1,
                                    cfg["output"]["frames_per_layer"], coeffs / group_size, teacher)
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
            parts["tape"] = particle_tape_bytes(cfg, d, d > tdim, group_size)
    elif differentiable and L is not None:
        parts["tape"] = dg_tape_bytes(cfg, cells, tdim, cell, d, group_size) \
            + cfg["attention"]["tape_mb"] * MB
    parts["total"] = sum(parts.values())
    return parts


def prompt_bytes(prompts: int, layers: int, frames_per_layer: int, coeffs: float = 0.0,
                 teacher: bool = False) -> float:
    """The prompts' share of a rank's memory: their records (config tables, objects,
    diagnostics rows of every frame) and the initial density of each, ``coeffs`` owned
    coefficients (a teacher's pass holds a second copy)."""
    frames = layers * frames_per_layer + 1
    return prompts * (PER_PROMPT + PER_FRAME_ROW * frames + (1 + teacher) * 8 * coeffs)


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


def room_for_tape(parts: dict, cfg: dict, comm) -> float | None:
    """Bytes a rank's gradient tape may take: its share of the limit (``[output]
    max_memory_gb`` or the node's available memory, over the ranks of the node) less the
    rest of the estimate ``parts``; None where no limit is known."""
    from mpi4py import MPI
    node = comm.Split_type(MPI.COMM_TYPE_SHARED)
    on_node = node.size
    node.Free()
    limit_gb = cfg["output"]["max_memory_gb"]
    limit = limit_gb * 2**30 if limit_gb is not None else (available_memory() or math.inf)
    rest = parts["total"] - parts.get("tape", 0.0)
    room = comm.allreduce(max(limit / on_node - rest, 0.25 * limit / on_node), op=MPI.MIN)   # every rank
    return None if math.isinf(room) else room
