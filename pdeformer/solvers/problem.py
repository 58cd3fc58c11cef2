"""The problem a run solves: mesh, heads, prompts, objective and targets, built from a
checked configuration (or from the Python API's objects), and the teacher whose forward
run gives a data set's targets."""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace

import numpy as np

from ..model.schema import Options, options
from ..tools.errors import ConfigError, PdeformerError, within
from ..model.context import RunContext
from ..model.geometry import Geometry
from ..model.heads import BLOCK, HeadMeasure, draw_heads
from ..fem.mesh import bounding_box, make_mesh, mesh_geometry, shortest_edge, token_dim
from ..tools.datasets import data_errors, split_prompts, teacher_given
from ..tools.parallel import PromptGroups, moment_sums, on_root
from ..model.objectives import make_objective, make_target
from ..model.prompts import make_prompt
from ..model.terms import build_terms
from ..model.velocity import check_scores


@dataclass
class Problem:
    """What is solved: mesh, heads and prompts of a checked configuration.

    ``comm`` is the communicator of this rank's prompt group (the world without prompt
    groups): the mesh is partitioned over it and every collective of the group's work
    uses it. ``groups`` (:class:`~pdeformer.tools.parallel.PromptGroups`) says which prompts
    this group solves (``groups.owned``) and combines results over the world.
    ``context`` (:class:`~pdeformer.model.context.RunContext`) carries the communicator,
    groups and attention costs the solvers are given (default: ``comm``'s, with this
    machine's costs)."""

    comm: object
    cfg: dict                  # the checked config: the record of the run (summary.json)
    mesh: object
    heads: HeadMeasure
    prompts: list  # [(name, density object)]
    objective: object = None   # pdeformer.model.objectives.* or None
    targets: list = None       # per prompt (None where the objective needs none)
    groups: PromptGroups = None  # default: one group of all ranks of comm
    opts: Options = None         # cfg as typed sections, what the solvers read (default: from cfg)
    geometry: Geometry = None    # the tokens' space (default: the mesh's, model/geometry.py)
    held_out: list = None        # indices of the held-out (test) prompts ([data] test_fraction)
    teacher: HeadMeasure = None  # a teacher whose targets are still to be computed (teacher_pass)
    terms: list = field(default_factory=list)   # token-wise velocity terms (model/terms.py)
    context: RunContext = None   # the run's communicator, groups and costs

    def __post_init__(self):
        if self.context is None:
            self.context = RunContext.create(self.comm)
        if self.geometry is None:           # every rank of comm constructs it
            self.geometry = mesh_geometry(self.comm, self.mesh)
        if self.groups is None:
            self.groups = PromptGroups.single(self.comm, [n for n, _ in self.prompts])
        if self.opts is None:
            self.opts = options(self.cfg)
        if self.held_out is None:
            self.held_out = split_prompts(self.cfg["data"], len(self.prompts))[1] if "data" in self.cfg else []

    @property
    def training(self) -> list[int]:
        """Indices of the prompts trained on (all but the held-out ones)."""
        held = set(self.held_out)
        return [i for i in range(len(self.prompts)) if i not in held]

    @property
    def dim(self) -> int:
        return token_dim(self.mesh)

    def check_on_mesh(self, objective=None) -> None:
        """Bad input that needs the mesh (``Objective.check_mesh``, e.g. an mmd bandwidth
        degenerate on the mesh's scale; built-in boxes are checked with the configuration
        already) of ``objective`` (default: the problem's). Collective over ``comm``."""
        objective = self.objective if objective is None else objective
        if not getattr(objective, "checks_mesh", False):
            return
        lo, hi = bounding_box(self.comm, self.mesh)
        objective.check_mesh(float(np.linalg.norm(hi - lo)), shortest_edge(self.comm, self.mesh))


def build_heads(comm, model, d: int) -> HeadMeasure:
    """The heads of ``[model]`` (its options): read from ``params`` (on rank 0, broadcast)
    or drawn from its law (gaussian, or the atoms of a file), with k = d where
    ``key_dim`` is not given."""
    if model.params is not None:
        return on_root(comm, HeadMeasure.load, model.params, d, model.layers, model.heads, model.key_dim)
    atoms = None
    if model.law == "atoms":
        atoms = on_root(comm, HeadMeasure.load, model.atoms, d, model.layers, None, model.key_dim,
                        key="model.atoms")
    return draw_heads(model, d, atoms)


def build_problem(cfg: dict, comm, differentiable: bool = False,
                  groups: PromptGroups | None = None, defer_teacher: bool = False,
                  params: dict | None = None, context: RunContext | None = None) -> Problem:
    """Mesh, heads, prompts (and objective, targets) of a checked configuration.
    ``differentiable``: the run takes gradients (gradient, train), so the discrete
    forward map must be smooth in the heads. With ``groups`` the mesh is built on this
    rank's group communicator (``groups.comm``) and ``comm`` is not used. A teacher's
    targets come from a forward run of the teacher, which can break down: with
    ``defer_teacher`` it is left to :func:`teacher_pass` (a run makes it inside its
    output folder, so that a breakdown there is recorded). ``params``: the model's
    parameter tree (the Python API's, checked), instead of ``[model]``'s file or draw.
    ``context``: the run's communicator, groups and costs (default: made from ``comm``
    and ``groups``, this machine's costs agreed on by all ranks of the job); given,
    ``comm`` and ``groups`` are taken from it."""
    if context is None:
        context = RunContext.create(comm, groups)
    comm, groups = context.comm, context.groups
    opts = options(cfg)
    if differentiable and opts.objective.kind is None:
        raise ConfigError("objective.kind", "missing: gradient, train and gram need an [objective]")
    mesh = make_mesh(comm, opts.mesh)
    d = token_dim(mesh)
    geometry = mesh_geometry(comm, mesh)
    heads = build_heads(comm, opts.model, d) if params is None else HeadMeasure.from_params(params[BLOCK])
    if heads.dim != d:
        raise ConfigError("model.params", f"the model's tokens are {heads.dim}-D, the mesh's {d}-D")
    # the record says what was run: the heads' sizes as read or resolved
    cfg["model"].update(layers=heads.layers, heads=heads.heads, key_dim=heads.key_dim)
    prompts = on_root(comm, build_prompts, opts.prompts, d, geometry, opts.data)
    targets = on_root(comm, build_targets, opts.prompts, d, geometry, opts.data)
    for key in ("center", "direction"):
        value = getattr(opts.objective, key)
        if value is not None and len(value) != d:
            raise ConfigError(f"objective.{key}", f"expected {d} numbers (d = {d}), got {value}")
    objective = make_objective(opts.objective, d)
    spl, fpl = opts.discretisation.steps_per_layer, opts.output.frames_per_layer
    if spl is not None and spl % fpl:
        raise ConfigError("output.frames_per_layer",
                          f"{fpl} does not divide discretisation.steps_per_layer = {spl}")
    problem = Problem(comm, cfg, mesh, heads, prompts, objective, targets, groups, options(cfg), geometry,
                      terms=build_terms(opts.model, d, comm, params), context=context)
    teacher = teacher_heads(comm, opts, heads, d) if teacher_given(cfg["data"]) else None
    if opts.model.init == "teacher":
        near_teacher(heads, teacher, opts.model)
    check_attention(comm, mesh, opts, heads, teacher)
    if objective is not None and teacher is not None and "moments" in objective.targets:
        problem.teacher = teacher         # (an objective without targets: none)
        if not defer_teacher:
            teacher_pass(problem)
    return problem


def teacher_pass(problem: Problem) -> None:
    """The targets of a pending teacher (:attr:`Problem.teacher`), set in place in
    ``problem.targets`` (solvers made before hold that list); a breakdown of the teacher's
    forward run is raised as the teacher's (a combination point)."""
    teacher, problem.teacher = problem.teacher, None
    if teacher is None:
        return
    data = problem.opts.data
    source = f"data.teacher = {data.teacher}" if data.teacher is not None else f"data.teacher_seed = {data.teacher_seed}"
    try:
        targets = teacher_targets(problem, teacher)
    except PdeformerError as e:
        raise within(e, f"the teacher's target pass ({source})") from None
    problem.targets[:] = targets


def check_attention(comm, mesh, opts: Options, heads: HeadMeasure, teacher: HeadMeasure | None = None) -> None:
    """The heads (and a teacher's) against the mesh's extent: attention scores and
    velocities that doubles hold (:func:`pdeformer.model.velocity.check_scores`), else a
    ConfigError naming attention.beta, the key that sets the heads' size, or the mesh's."""
    lo, hi = bounding_box(comm, mesh)
    reach = math.hypot(*np.maximum(np.abs(lo), np.abs(hi)))     # (hypot: no overflow of squares)
    model, data = opts.model, opts.data
    mesh_key = "mesh.file" if opts.mesh.file is not None else "mesh.radius" if opts.mesh.shape != "box" else \
        "mesh.lower" if np.max(np.abs(opts.mesh.lower)) > np.max(np.abs(opts.mesh.upper)) else "mesh.upper"
    scale_key = "model.query_scale" if (model.query_scale or 0) > model.init_scale else "model.init_scale"
    teacher_key = "data.teacher" if data.teacher is not None else scale_key
    heads_key = "model.params" if model.params is not None else \
        teacher_key if model.init == "teacher" else scale_key
    for h, key in ((heads, heads_key), (teacher, teacher_key)):
        if h is not None:
            check_scores(h, opts.attention.beta, reach, {"beta": "attention.beta", "heads": key, "mesh": mesh_key})


def _each_prompt(make, tables: tuple, data) -> list:
    """``make(i, table)`` of every checked prompt table; errors about a prompt that [data]
    made name the data.* key that drew it, or its file (data.folder)."""
    out = []
    for i, p in enumerate(tables):
        with data_errors(data, tables, p["name"]):
            out.append(make(i, p))
    return out


def build_prompts(tables: tuple, d: int, geometry: Geometry, data) -> list:
    """[(name, density object)] of the checked prompt tables."""
    return _each_prompt(lambda i, p: (p["name"], make_prompt(p, d, i, geometry=geometry)), tables, data)


def build_targets(tables: tuple, d: int, geometry: Geometry, data) -> list:
    """The prompts' targets (:func:`pdeformer.model.objectives.make_target`)."""
    return _each_prompt(lambda i, p: make_target(p["target"], d, i, geometry), tables, data)


def near_teacher(student: HeadMeasure, teacher: HeadMeasure, model) -> None:
    """``[model] init = "teacher"``: the student's parameters become the teacher's plus
    init_noise N(0, 1) per entry, drawn from (model.seed, 1) in the parameters' order --
    the same on every rank. The teacher must have the student's sizes (model.layers,
    heads, key_dim)."""
    mine, theirs = student.params, teacher.params
    for name, value in theirs.items():
        if value.shape != mine[name].shape:
            raise ConfigError("model.init", f"the teacher's {name} has shape {value.shape}, the model's "
                              f"{mine[name].shape}: give the model the teacher's sizes")
    rng = np.random.default_rng([model.seed, 1])
    for name, value in theirs.items():
        mine[name][:] = value + model.init_noise * rng.standard_normal(value.shape)


def teacher_heads(comm, opts: Options, student: HeadMeasure, d: int) -> HeadMeasure:
    """The data set's teacher: its heads file (``data.teacher``, any sizes) or random heads
    of the student's sizes drawn as ``[model]`` draws them, with ``data.teacher_seed``."""
    data, model = opts.data, opts.model
    if data.teacher is not None:
        return on_root(comm, HeadMeasure.load, data.teacher, d, key="data.teacher")
    return HeadMeasure.random(student.layers, student.heads, student.key_dim, d, seed=data.teacher_seed,
                              scale=model.init_scale, query_scale=model.query_scale, depth=model.depth)


def teacher_targets(problem: Problem, teacher: HeadMeasure) -> list[dict]:
    """Per prompt the target {"kind": "moments", "mean", "cov"} that the teacher's output
    density rho_1 has: a forward run of the teacher (its own steps, as `pdeformer forward`
    with the teacher's heads takes them), its moments by the quadrature the objective
    uses. Every group runs its prompts; all ranks get all targets. A student with the
    teacher's heads then has risk zero up to its own step plan's difference."""
    from ..fem.transport import CellQuadrature
    from .forward import ForwardSolver     # (the solver of the problems built here)
    from ..model.objectives import default_quadrature_degree
    solver = ForwardSolver(replace(problem, heads=teacher, objective=None, targets=None))
    tr, groups = solver.transport, problem.groups
    degree = problem.opts.objective.quadrature_degree or default_quadrature_degree(problem.objective.kind, tr.degree)
    rule = CellQuadrature(tr.mesh, degree, tr.u)
    local = {}
    with groups.combined():
        for s in groups.owned:
            coeffs, _ = solver.solve_prompt(s)
            tr.set_state(coeffs)
            m0, m1, m2, _ = moment_sums(tr.comm, rule.measure * rule.values(), rule.points)
            mean = m1 / m0
            local[s] = (mean, m2 / m0 - np.outer(mean, mean))
    return [{"kind": "moments", "mean": mean, "cov": cov} for mean, cov in groups.gather_prompts(local)]
