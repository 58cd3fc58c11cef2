"""outputs.md: the files a run writes, from the code and the descriptions kept here.

The names come from ``pdeformer.tools.outdir.RUN_FILES``, the columns from
``diagnostics_header`` and the trainer's ``history_columns``, the arrays of params,
gradient and checkpoint files from the parameter registry (``pdeformer.model.params``),
fields.npz's contents from its module's docstring. What each is for is written below:
every file name and column the code makes must match one description here, and every
description a name or column, or the page is not made.
"""

from __future__ import annotations

import ast
import fnmatch
import os
import types

from mdtext import code, from_rst, table
from pdeformer.model import params
from pdeformer.model.geometry import FOURIER_MODES
from pdeformer.tools.outdir import RUN_FILES
from pdeformer.tools.output import PICTURE_PROMPTS, diagnostics_header

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (pattern over RUN_FILES, the commands that write it, what it holds): the first pattern
# a name matches describes it, and the page lists the names it matched
FILES = [
    ("summary.json", "every command", "what the run was and what it gave ([below](#summaryjson))"),
    ("pdeformer.log", "every command", "the run's log: its progress, warnings and errors"),
    ("diagnostics.csv", "forward, particles", "mass, outflow and moments per prompt and frame "
                                              "([below](#diagnosticscsv))"),
    ("gradient.npz", "gradient, particles --gradient", "dR/dθ of the discrete risk ([below](#gradientnpz))"),
    ("history.csv", "train", "one row per training step ([below](#historycsv))"),
    ("checkpoint.npz", "train", "what `--restart` continues from ([below](#checkpointnpz))"),
    ("params_*.npz", "train", "the parameters at step XXXX, every `[train] output_every` steps and at "
                              "the last ([below](#params_xxxxnpz))"),
    ("heads_*.vtu", "train", "the heads at step XXXX as VTK points: one per head at (t_l, tr V/d, "
                             "tr A/d), with point data layer, head, Q, K, V, A and their norms"),
    ("heads.pvd", "train", "the heads_XXXX.vtu as a series over the steps (ParaView)"),
    ("ntk.json", "ntk", "both injectivity tests ([ntk](../ntk.md#output-and-how-to-read-it))"),
    ("ntk.png", "ntk", "their spectra"),
    ("gram.json", "gram", "the spectrum of G = J Jᵀ and the gd convergence it predicts "
                          "([below](#gramjson-and-gramnpz))"),
    ("gram.npz", "gram", "J, G, y and y* ([below](#gramjson-and-gramnpz))"),
    ("gram.png", "gram", "the spectrum and the predicted risk curve"),
    ("convergence.csv", "converge", "the study's table: one row per case and quantity"),
    ("convergence.md", "converge", "the same table in markdown, with the fitted orders"),
    ("convergence.png", "converge", "errors against the swept parameter"),
    ("ensemble.csv", "converge", "with several seeds: every member's errors"),
    ("budget.md", "budget", "the error budget's terms, constants and checks "
                            "([verification](../verification.md))"),
    ("budget.json", "budget", "the terms and checks as numbers"),
    ("budget.csv", "budget", "the measured sweeps"),
    ("budget.png", "budget", "the terms against L, H, N and h"),
    ("*.tmp", "every command", "a file being written: renamed over its name when complete"),
    ("fields.npz", "forward, train, particles", "the frames the pictures draw ([below](#fieldsnpz))"),
    ("paraview.py", "forward, train, particles", "a ParaView script that opens the run's field series "
                                                 "([ParaView](../howto/paraview.md))"),
    ("densities.*", "forward, train, particles", "picture: each prompt's density over depth"),
    ("diagnostics.*", "forward, particles", "picture: mean, covariance, mass and outflow over depth"),
    ("training.*", "train", "picture: risk, gradient norm and step size over the steps"),
    ("heads.*", "train", "picture: each layer's heads at the first and the last step"),
    ("gradient.*", "gradient", "picture: the gradient of every head"),
    ("density_*", "forward (`[output] fields`)", "the density of prompt `*` over depth, for ParaView "
                                                  "(`[output] format`: vtk or vtx)"),
    ("velocity_*", "forward (`[output] velocity`)", "its velocity"),
    ("tokens_*", "particles (`[particles] points`)", "the tokens of prompt `*` over depth"),
]

# diagnostics.csv's columns: (pattern, meaning)
DIAGNOSTICS = [
    ("prompt", "the prompt's name"),
    ("t", "the depth t of the frame: 0, then every frame end (`[output] frames_per_layer` per layer)"),
    ("mass", "∫ρ over the mesh (tokens: 1)"),
    ("outflow", "the mass that has left the mesh up to t; mass + outflow stays 1 (tokens: 0)"),
    ("min_rho", "the least value of ρ at its DG nodes (tokens: nan)"),
    ("mean_*", "component i of the mean of ρ/∫ρ"),
    ("cov_*", "entry (i, j) of its covariance"),
    ("order", "on a circle or sphere: the order parameter \\|Σ w u\\| (1 for a point mass, 0 for "
              "the uniform density)"),
    ("fourier_*", f"on a circle: the Fourier amplitude \\|ρ̂_l\\|, l = 1..{FOURIER_MODES}"),
]

# history.csv's columns: (name, when it is there, meaning)
HISTORY = {
    "step": ("always", "the step k (row k: the risk and gradient at θ_k)"),
    "risk": ("always", "R(θ_k) over the step's prompts (with minibatches: its batch)"),
    "epoch": ("`[train] batch_size`", "the epoch of the step's batch"),
    "train_risk": ("`[train] batch_size`", "every `test_every` steps and at the last: R over all "
                                            "training prompts (nan in other rows)"),
    "test_risk": ("held-out prompts (`[data] test_fraction`)", "R over the held-out prompts, every "
                                                               "`test_every` steps and at the last"),
    "penalty": ("`[train] weight_decay` > 0", "the weight decay's penalty added to the risk"),
    "grad_norm": ("always", "\\|dR/dθ\\| over every parameter"),
    "step_size": ("always", "gd: lr L W of the largest block; adam: lr"),
    "displacement": ("always", "\\|θ_{k+1} − θ_k\\| (0 at the last step)"),
    "gauge_drift": ("always", "max over heads of \\|G_h(θ_k) − G_h(θ_0)\\|_F, G_h = Q Qᵀ − K Kᵀ: "
                              "the gradient flow keeps G_h, its gd steps move it by O(lr)"),
    "wall_time": ("always", "seconds since training started (continued over a restart)"),
}

# summary.json's top-level entries: (entry, commands, meaning)
SUMMARY = [
    ("command", "all", "the command"),
    ("status", "all", '"completed", "walltime" (stopped by `--walltime`; `--restart` continues), '
                      '"breakdown" (a numerical breakdown, exit status 3), "bad_input" (exit status 2), '
                      '"output_error" (a file could not be written, exit status 3) or "failed" (a bug)'),
    ("error", "all", "the one-line error that ended the run, or null"),
    ("config", "all", "the checked configuration, every default filled in (study, budget: `study`, "
                      "`budget`, the study file's tables)"),
    ("provenance", "all", "versions of pdeformer, Python, dolfinx, PETSc, numpy and BLAS; host, platform, "
                          "git commit, command line and start time"),
    ("ranks", "all", "MPI ranks"),
    ("timings", "all", "wall seconds per phase (setup, forward, velocity, transport, gradient, train, "
                       "plots, ...) and total"),
    ("parallel", "all", "prompt groups, compute and communication per rank ([hpc](../hpc.md))"),
    ("files", "all", "the files the run wrote, by role"),
    ("mesh", "runs", "dim, cells, cell_type, and for DG: density_dofs, velocity_nodes, attention_sources"),
    ("model", "runs", "layers, heads, key_dim"),
    ("prompts", "runs", "per prompt: its name and, on a mesh, `mass_on_mesh` and `truncated_mass` at t = 0 "
                        "and the steps of each layer"),
    ("stats", "runs", "steps and velocity evaluations, summed over the prompts"),
    ("attention", "runs", "backend, tol, how its sums were made (table, direct), and `costs_s`, the "
                          "machine's costs its choices were made from"),
    ("memory", "runs", "the memory estimate per rank (and its parts) and the peak measured, in GB"),
    ("final_diagnostics", "forward, particles", "diagnostics.csv's last row per prompt"),
    ("objective", "forward", "with an `[objective]`: risk (training prompts), test_risk, risks per prompt"),
    ("risk, risks, gradient_norm", "gradient, particles", "R, F_s per prompt and \\|dR/dθ\\|"),
    ("tape_bytes_per_rank, step_counts", "gradient", "the largest forward tape held and the steps per "
                                                     "layer of each prompt"),
    ("history", "train", "history.csv's rows"),
    ("initial_risk, final_risk", "train", "the risk at the first and the last step (and "
                                          "initial_/final_train_risk, test_risk where there are)"),
    ("restarted_at", "train", "the step `--restart` continued from, or null"),
    ("ntk", "ntk", "ntk.json's results"),
    ("gram", "gram", "gram.json's results, less the long arrays"),
    ("rows, fits, reference, seeds", "converge", "the study's table, its fitted orders, its reference "
                                                 "and the seeds of its members"),
    ("terms, checks", "budget", "the budget's terms and its checks against direct measurements"),
]

# the shapes of the parameter arrays, by their key in files
SHAPES = {"Q": "(L, H, k, d)", "K": "(L, H, k, d)", "V": "(L, H, d, d)"}

GRAM = ("`gram.json`: outputs, params, prompts, eigenvalues, ratio, injective, tol, "
        "lost_directions, lr, layers, heads, step_factor a, stable, risk, residual_components c_i, "
        "mode_rates, slowest_rate, asymptotic_rate, plateau, predicted_risk (for `[train] steps`) "
        "and the provenance. `gram.npz`: the Jacobian `J` (outputs × parameters), `G` = J Jᵀ, the "
        "outputs `y`, their targets `ystar` and `eigenvalues`. See [the Gram matrix](../training.md).")


def source(module: str) -> ast.Module:
    with open(os.path.join(ROOT, *module.split(".")) + ".py", encoding="utf-8") as f:
        return ast.parse(f.read())


def constant(module: str, name: str):
    """The value of ``name = <expression>`` in ``module``'s source: a literal, or a
    dict's keys."""
    node = next(n.value for n in source(module).body if isinstance(n, ast.Assign)
                and any(getattr(t, "id", None) == name for t in n.targets))
    if isinstance(node, ast.Dict):
        return [ast.literal_eval(k) for k in node.keys]
    return ast.literal_eval(node)


def function(module: str, name: str, **names):
    """A pure function of ``module`` made from its source, its globals ``names``."""
    node = next(n for n in source(module).body if isinstance(n, ast.FunctionDef) and n.name == name)
    namespace = dict(names)
    exec(compile(ast.Module([node], type_ignores=[]), module, "exec"), namespace)
    return namespace[name]


def history_columns() -> list[str]:
    """Every column history.csv can have, in its order (with minibatches, held-out prompts
    and weight decay)."""
    columns = function("pdeformer.solvers.train", "history_columns",
                       HISTORY=constant("pdeformer.solvers.train", "HISTORY"))
    return columns(types.SimpleNamespace(weight_decay=1.0), True, True)


def matched(names: list[str], rules: list[str], what: str) -> dict[str, list[str]]:
    """{rule: the names it is the first to match}; every name matched, every rule used."""
    out = {rule: [] for rule in rules}
    for name in names:
        rule = next((r for r in rules if fnmatch.fnmatchcase(name, r)), None)
        if rule is None:
            raise ValueError(f"{what} {name!r} is not described in docs/reference/output_files.py")
        out[rule].append(name)
    unused = [r for r, hit in out.items() if not hit]
    if unused:
        raise ValueError(f"docs/reference/output_files.py describes {what} {unused} that the code has not")
    return out


def files_section() -> str:
    hits = matched(list(RUN_FILES), [f[0] for f in FILES], "the file")
    rows = [[", ".join(code(n) for n in hits[pattern]), by, what] for pattern, by, what in FILES]
    return ("## The files\n\n" + table(["file", "written by", "what it holds"], rows) + "\n")


def diagnostics_section() -> str:
    columns = diagnostics_header(2, ["order"] + [f"fourier_{l}" for l in range(1, FOURIER_MODES + 1)])
    hits = matched(columns, [c[0] for c in DIAGNOSTICS], "the diagnostics column")
    rows = [[", ".join(code(n) for n in hits[pattern]), what] for pattern, what in DIAGNOSTICS]
    return ("## diagnostics.csv\n\nOne row per prompt and frame; the columns for d = 2 (in d "
            "dimensions `mean_0` to `mean_{d-1}` and the d² entries `cov_ij`):\n\n"
            + table(["columns", "meaning"], rows) + "\n")


def history_section() -> str:
    columns = history_columns()
    hits = matched(columns, list(HISTORY), "the history column")
    rows = [[code(c), *HISTORY[c]] for c in hits]
    return ("## history.csv\n\nOne row per training step k = 0..steps, the columns in this order; "
            "`nan` where a row has no value:\n\n" + table(["column", "when", "meaning"], rows) + "\n")


def fields_section() -> str:
    doc = ast.get_docstring(source("pdeformer.solvers.snapshots"))
    contents = doc[doc.index("Contents"):]
    contents = contents.replace("PICTURE_PROMPTS", str(PICTURE_PROMPTS))
    paragraphs = [from_rst(p) for p in contents.split("\n\n")]
    return "## fields.npz\n\n" + "\n\n".join(paragraphs) + "\n\n"


def params_section() -> str:
    keys = params.file_keys()
    rows = [[code(key), code(block), SHAPES.get(key, "(L, W, ...)")] for key, block in keys.items()]
    return ("## params_XXXX.npz\n\nThe parameters at a step: every array of every block of the model's "
            "parameter tree (`pf.Transformer.params`), the layer on axis 0 and the block's particle (a "
            "head) on axis 1; L layers, H heads, key dimension k, tokens in d dimensions. `[model] "
            "params` and `[data] teacher` read such a file.\n\n"
            + table(["array", "block", "shape"], rows) + "\n")


def gradient_section() -> str:
    keys = ", ".join(code("d" + k) for k in params.file_keys())
    return ("## gradient.npz\n\n`risk`, the discrete risk R, and dR/dθ of every parameter under its "
            f"key with a `d` in front ({keys}), shaped like it.\n\n")


def checkpoint_section() -> str:
    keys = ", ".join(code(k) for k in params.file_keys())
    meta = ", ".join(code(k) for k in constant("pdeformer.solvers.train", "CHECKPOINT_META"))
    return ("## checkpoint.npz\n\nThe parameters θ of the next step (" + keys + "), the optimiser's "
            "state (adam: `adam_t`, and each parameter's key prefixed with `adam_m_` and with "
            f"`adam_v_`; gd: none) and `meta`, a JSON string with {meta}: the next step, "
            "history.csv's rows so far, the optimiser, the random generator's state and the "
            "fingerprint of the problem (mesh, model, prompts, discretisation, objective, data and "
            "their files' digests). `--restart` refuses a checkpoint of another problem, naming what "
            "differs.\n\n")


def summary_section() -> str:
    rows = [[", ".join(code(e) for e in entry.split(", ")), by, what] for entry, by, what in SUMMARY]
    return ("## summary.json\n\nWritten by every command when it ends, whatever ends it (a run a bug "
            "ends writes `command`, `status`, `error`, `config`, `provenance`, `ranks`, `timings` and "
            "the `rank` it happened on). Its top-level entries (\"runs\": forward, gradient, "
            "particles, train, ntk, gram):\n\n" + table(["entry", "commands", "meaning"], rows) + "\n")


def page(note: str) -> str:
    return (note + "# Output files\n\nEvery command writes into its output folder (`[output] dir`, "
            "by default `output/<config name>` beside the config file). A run first moves the "
            "files another run left there into `previous/` and holds the folder with a lock, "
            "`.pdeformer.lock`, while it runs ([reliability](../reliability.md)); "
            "`train --restart` keeps the files of the training it continues. Rank 0 writes the "
            "tables and JSON files.\n\n"
            + files_section() + summary_section() + diagnostics_section() + history_section()
            + fields_section() + params_section() + gradient_section() + checkpoint_section()
            + "## gram.json and gram.npz\n\n" + GRAM + "\n")
