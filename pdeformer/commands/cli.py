"""The ``pdeformer`` command.

    mpirun -n P pdeformer forward RUN.toml [--set section.key=value ...]
    mpirun -n P pdeformer gradient RUN.toml
    mpirun -n P pdeformer particles RUN.toml [--gradient]
    mpirun -n P pdeformer train RUN.toml [--restart]
    mpirun -n P pdeformer train RUN.toml --prompt-groups G   # G groups of P/G ranks
    pdeformer plot RUN_DIR [--format svg] [--out DIR]        # no MPI, no dolfinx
    pdeformer info

Errors caused by the input are one line on stderr (``pdeformer: error: ...``), exit
status 2 (3 for a numerical breakdown), no traceback, on every rank at once so the
job ends. Anything unexpected prints its traceback and aborts the whole MPI job.
"""

from __future__ import annotations

import argparse
import math
import os
import re
import sys

from .. import __version__
from ..tools.errors import ConfigError, PdeformerError
from ..tools.outdir import PICTURE_FORMATS


class _Parser(argparse.ArgumentParser):
    """Usage errors: one line, printed by rank 0 only, exit status 2 on every rank."""

    def error(self, message):
        if _world_rank() == 0:
            print(f"pdeformer: error: {message} (see '{self.prog} --help')", file=sys.stderr)
        sys.exit(2)


def _world_rank() -> int:
    """This process's rank in MPI_COMM_WORLD (0 where mpi4py is missing: plot runs without it)."""
    try:
        from mpi4py import MPI
    except ImportError:
        return 0
    return MPI.COMM_WORLD.rank


# the commands that run a config: (name, help, description)
RUN_COMMANDS = (
    ("forward", "forward pass: transport every prompt through the L layers",
     "Transport the token density of every prompt through the L attention layers "
     "(DG in space, SSP Runge-Kutta in depth). Writes diagnostics.csv, "
     "density/velocity fields for ParaView, pdeformer.log and summary.json "
     "into [output] dir."),
    ("gradient", "risk and its gradient with respect to every head (adjoint sweep)",
     "Solve the forward pass of every prompt with a frozen step plan, evaluate the "
     "[objective], and run the adjoint backwards in depth: writes gradient.npz (dQ, dK, "
     "dV, the derivatives of the discrete risk) and summary.json (risk, timings)."),
    ("particles", "the particle model: N tokens per prompt through the layers",
     "Sample [particles] tokens from every prompt (seeded: the same tokens on any number "
     "of ranks) and move them with the same kernel, heads and SSP scheme. Writes "
     "diagnostics.csv (weighted moments), tokens_<prompt>.pvd for ParaView and "
     "summary.json; with --gradient also gradient.npz (exact adjoint of the particle "
     "system)."),
    ("ntk", "is the NTK of attention injective on the run's prompts?",
     "Two tests of the criterion (docs/ntk.md): the log-Laplace transforms Lambda_i of "
     "the prompts sampled at [ntk] b_count points b and the affine part projected out "
     "(singular values), and the NTK Gram matrix of d Gamma_theta[mu_i](x_p)/d theta "
     "over a head measure (eigenvalues). With [ntk] depth the prompts are the densities "
     "of a forward run at that depth. Writes ntk.json, ntk.png and summary.json."),
    ("gram", "the model's Gram matrix J J^T and the gd convergence it predicts",
     "For the moments objective: the Jacobian J of the outputs (mean, covariance) of the "
     "model on the training prompts with respect to every head parameter, by one adjoint "
     "sweep per output; the spectrum of G = J J^T and, for gd at [train] lr, the predicted "
     "risk curve, its slowest rate and the plateau of lost directions (docs/training.md). "
     "Writes gram.json, gram.npz, gram.png and summary.json."),
    ("train", "gradient-flow training of the head particles",
     "Train the heads: each step computes the risk and its gradient and moves every head "
     "particle by -lr L H dR/dtheta ([train] optimizer = gd) or with Adam. Writes "
     "history.csv, params_XXXX.npz, heads_XXXX.vtu + heads.pvd, checkpoint.npz and "
     "summary.json."),
)


def _parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="pdeformer",
        description="Mean-field transformers as PDEs: attention transport of token densities "
                    "with DG in dolfinx. Run under mpirun for parallel runs.",
        epilog="example: mpirun -n 2 pdeformer forward runs/default.toml --set model.layers=4")
    p.add_argument("--version", action="version", version=f"pdeformer {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    for name, helptext, description in RUN_COMMANDS:
        _add_run_command(sub, name, helptext, description)
    _add_converge(sub)
    _add_budget(sub)
    _add_plot(sub)
    sub.add_parser("info", help="versions of pdeformer and its numerical stack",
                   description="Print the versions pdeformer runs with (dolfinx, PETSc, ...).")
    return p


def _add_run_command(sub, name: str, helptext: str, description: str) -> None:
    """A command that runs a config: CONFIG, --set, -q and its own options."""
    c = sub.add_parser(name, help=helptext, description=description,
                       epilog="paths in the config are relative to the config file; paths "
                              "given with --set are relative to the current directory")
    c.add_argument("config", nargs="?", help="run configuration (TOML)")
    c.add_argument("--set", dest="overrides", metavar="SECTION.KEY=VALUE", nargs="+",
                   action="extend", default=[],
                   help="override config values, e.g. --set mesh.cells=[32,32] model.seed=3 "
                        "prompts[0].name=a (values are TOML: numbers, true/false, [lists], strings)")
    c.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    if name != "ntk":
        _prompt_groups_option(c)
    if name == "particles":
        c.add_argument("--gradient", action="store_true",
                       help="also the gradient of the particle risk (needs an [objective])")
    if name == "train":
        c.add_argument("--restart", action="store_true",
                       help="continue from the last checkpoint in output.dir (also after "
                            "train.steps was raised)")
        c.add_argument("--walltime", metavar="[D-]HH:MM:SS", type=_duration,
                       help="stop (with a checkpoint) before a step that would end past "
                            "this time; continue later with --restart")


def _add_study_command(sub, name: str, helptext: str, description: str, section: str):
    """A command that runs a study-like file: FILE, --set section.KEY=VALUE, -q."""
    c = sub.add_parser(name, help=helptext, description=description,
                       epilog=f"example: mpirun -n 2 pdeformer {name} runs/studies/"
                              f"{'mesh' if name == 'converge' else name}.toml")
    c.add_argument("config", nargs="?", help=f"{section} file (TOML, with a [{section}] table)")
    c.add_argument("--set", dest="overrides", metavar=f"{section}.KEY=VALUE", nargs="+",
                   action="extend", default=[], help=f"override {section} values")
    c.add_argument("-q", "--quiet", action="store_true", help="log warnings only")
    return c


def _add_converge(sub) -> None:
    c = _add_study_command(
        sub, "converge", "a convergence study: one swept parameter against a reference",
        "Run every case of a study (a base run config, one swept parameter, a reference: "
        "exact, the exact width limit, finest, another run or an independent draw; ensembles "
        "of seeds with 95% intervals) in this MPI job and write convergence.csv, "
        "convergence.md, convergence.png and summary.json.", "study")
    c.add_argument("--walltime", metavar="[D-]HH:MM:SS", type=_duration,
                   help="stop before a case that would end past this time (partial table)")


def _add_budget(sub) -> None:
    _add_study_command(
        sub, "budget", "how far a finite transformer (L, H, N) is from its mean-field limit",
        "Measure the depth, width, token and mesh terms of a finite transformer's distance to "
        "the mean-field limit by ensemble sweeps, fit their constants and check the sum "
        "against direct measurements. Writes budget.md, budget.json, budget.csv, budget.png "
        "and summary.json.", "budget")


def _add_plot(sub) -> None:
    c = sub.add_parser(
        "plot", help="the pictures of a run (densities, diagnostics, training, heads) and paraview.py",
        description="Draw the pictures of the run in RUN_DIR from the files it wrote (fields.npz, "
                    "diagnostics.csv, history.csv, params_XXXX.npz, gradient.npz): densities, "
                    "diagnostics, training, heads, gradient (.png, or .svg), and paraview.py "
                    "where it wrote field series. Needs numpy and matplotlib only (no MPI, no "
                    "dolfinx): a run copied from a cluster draws on a laptop. Every run draws "
                    "them when it ends unless [output] plots = false.",
        epilog="example: pdeformer plot runs/output/default --format svg")
    c.add_argument("run_dir", metavar="RUN_DIR", help="the output folder of a run")
    c.add_argument("--format", choices=PICTURE_FORMATS, default=None,
                   help="image format (default: the run's [output] plot_format, else png)")
    c.add_argument("--out", metavar="DIR", default=None,
                   help="write the pictures and paraview.py here (default: RUN_DIR)")


def _prompt_groups_option(parser) -> None:
    parser.add_argument("--prompt-groups", metavar="G", type=int, default=None,
                        help="split the ranks into G groups of consecutive ranks, each with its "
                             "own mesh partition and a block of the prompts (overrides [parallel] "
                             "prompt_groups; G must divide the rank count, at most one group per "
                             "prompt)")


def _duration(text: str) -> float:
    """'D-HH:MM:SS' (SLURM's form for a day or more), 'HH:MM:SS', 'MM:SS' or seconds ->
    seconds; finite, not negative."""
    try:
        days = re.fullmatch(r"(\d+)-(.*)", text)
        clock = days[2] if days else text
        parts = [float(p) for p in clock.split(":")]
        if len(parts) > 3 or (days and len(parts) != 3) \
                or not all(math.isfinite(p) and p >= 0 for p in parts):
            raise ValueError
        return (int(days[1]) * 86400 if days else 0) + sum(p * 60**i for i, p in enumerate(reversed(parts)))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected [D-]HH:MM:SS or seconds, got {text!r}") from None


def _config_and_overrides(args) -> tuple[str, list[str]]:
    """The config file may also stand after ``--set a=1 b=2`` (it is the one word
    without '=')."""
    overrides = list(args.overrides)
    if args.config is None:
        plain = [o for o in overrides if "=" not in o]
        if len(plain) != 1:
            raise ConfigError("", "give one config file: pdeformer forward RUN.toml [--set key=value ...]")
        overrides.remove(plain[0])
        return plain[0], overrides
    return args.config, overrides


def _caches(comm) -> list[str]:
    """pdeformer.tools.machine.prepare_caches on every rank, failing on all of them where
    it fails on one (nodes may differ in their HOME); the warnings to log."""
    from ..tools.machine import prepare_caches
    try:
        notes, error = prepare_caches(), None
    except PdeformerError as e:
        notes, error = [], e
    failed = [e for e in comm.allgather(error) if e is not None]
    if failed:
        raise failed[0]
    return notes


def _run(args, comm, notes=()) -> int:
    import logging
    from ..model.config import load_config
    from ..tools.parallel import setup_logging
    setup_logging(comm, logging.WARNING if args.quiet else logging.INFO)
    if comm.rank == 0:
        for note in notes:
            logging.getLogger("pdeformer").warning(note)
    if args.command == "converge":
        from .converge import run_study
        from .study import load_study
        study = load_study(*_config_and_overrides(args))
        summary = run_study(study, comm, walltime=args.walltime)
        if comm.rank == 0:
            print(f"pdeformer: output in {study['output_dir']}")
            print("  " + ", ".join(summary["files"]) + ("" if summary["status"] == "completed"
                                                         else f" (status {summary['status']})"))
        return 0
    if args.command == "budget":
        from .budget import load_budget, run_budget
        budget = load_budget(*_config_and_overrides(args))
        summary = run_budget(budget, comm)
        if comm.rank == 0:
            print(f"pdeformer: output in {budget['output_dir']}")
            print("  " + ", ".join(summary["files"]))
        return 0
    config, overrides = _config_and_overrides(args)
    if getattr(args, "prompt_groups", None) is not None:
        overrides.append(f"parallel.prompt_groups={args.prompt_groups}")
    cfg = load_config(config, overrides)
    launch, report = COMMANDS[args.command]
    summary = launch(cfg, comm, args)
    if comm.rank == 0:
        print(f"pdeformer: output in {cfg['output']['dir']}")
        for line in report(summary, summary["files"]):
            print("  " + line)
    return 0


# ------------------------------------------------------------------ what each command runs and says

def _pictures(files) -> list[str]:
    """The line about the run's pictures and ParaView session (none without them)."""
    names = files.get("pictures", []) + ([files["paraview"]] if "paraview" in files else [])
    return [", ".join(names) + (" (pvpython paraview.py --screenshot out.png)" if "paraview" in files else "")] \
        if names else []


def _forward_report(summary, files) -> list[str]:
    lines = ["diagnostics.csv, summary.json, pdeformer.log"
             + (f", {len(files['fields'])} field series (open the .pvd/.bp in ParaView)"
                if files["fields"] else "")] + _pictures(files)
    if summary.get("objective"):
        lines.append(f"risk {summary['objective']['risk']:.10e}")
    return lines


def _gradient_report(summary, files) -> list[str]:
    return [f"gradient.npz, summary.json, pdeformer.log; risk {summary['risk']:.10e}, "
            f"|gradient| {summary['gradient_norm']:.6e}"] + _pictures(files)


def _ntk_report(summary, files) -> list[str]:
    lse, gram = summary["ntk"]["lse"], summary["ntk"]["ntk"]
    return [", ".join(v for k, v in files.items() if k != "log") + ", summary.json",
            f"LSE test   sigma_min/sigma_max   = {lse['ratio']:.3e}  "
            f"{'independent' if lse['independent'] else 'DEPENDENT'}",
            f"NTK Gram   lambda_min/lambda_max = {gram['ratio']:.3e}  "
            f"{'injective' if gram['injective'] else 'NOT INJECTIVE'}"]


def _gram_report(summary, files) -> list[str]:
    g = summary["gram"]
    return [", ".join(v for k, v in files.items() if k != "log") + ", summary.json",
            f"Gram {g['outputs']} x {g['outputs']}: lambda_min/lambda_max = {g['ratio']:.3e}, "
            f"{g['lost_directions']} lost direction(s)",
            f"gd at lr {g['lr']:g}: slowest rate {g['slowest_rate']:.4g} per step"
            + ("" if g["stable"] else " (UNSTABLE: lr L H lambda_max / S >= 2)")]


def _particles_report(summary, files) -> list[str]:
    return ["diagnostics.csv, summary.json, pdeformer.log"
            + (", tokens_<prompt>.pvd (ParaView)" if files["tokens"] else "")
            + (", gradient.npz" if "gradient" in files else "")] + _pictures(files)


def _train_report(summary, files) -> list[str]:
    risks = [f"{what} {summary[f'initial_{key}']:.6e} -> {summary[f'final_{key}']:.6e}"
             for what, key in (("risk", "risk"), ("train risk", "train_risk"), ("test risk", "test_risk"))
             if summary.get(f"initial_{key}") is not None and summary.get(f"final_{key}") is not None]
    if "initial_train_risk" in summary:
        risks[0] = "batch " + risks[0]
    return [f"history.csv, params_XXXX.npz, heads.pvd (ParaView), checkpoint.npz, summary.json; "
            + ", ".join(risks)] + _pictures(files)


def _launch(name: str, **flags):
    """cfg, comm, args -> summary: pdeformer.commands.run.run_<name>, with these flags read from args."""
    def launch(cfg, comm, args):
        from . import run
        return getattr(run, f"run_{name}")(cfg, comm, **{k: getattr(args, a) for k, a in flags.items()})
    return launch


COMMANDS = {   # command: (run it, the lines rank 0 prints about its output)
    "forward": (_launch("forward"), _forward_report),
    "gradient": (_launch("gradient"), _gradient_report),
    "particles": (_launch("particles", gradient="gradient"), _particles_report),
    "ntk": (_launch("ntk"), _ntk_report),
    "gram": (_launch("gram"), _gram_report),
    "train": (_launch("train", restart="restart", walltime="walltime"), _train_report),
}


def _info(args, comm) -> int:
    from ..fem._dolfinx import versions
    from ..tools.blas import blas_record
    if comm.rank == 0:
        print(f"pdeformer {__version__}")
        for k, v in versions().items():
            print(f"{k:10s} {v}")
        blas = blas_record()
        if blas["library"] is not None:
            by = {"pdeformer": f", set by pdeformer (OpenBLAS's own: {blas['detected']})",
                  "user": ", set by OPENBLAS_CORETYPE"}.get(blas["coretype_set_by"], "")
            print(f"{'openblas':10s} {blas['library']} (core {blas['core']}{by})")
        print(f"{'ranks':10s} {comm.size}")
    return 0


def _plot(args) -> int:
    """``pdeformer plot``: one process, no MPI; bad input is one line and exit status 2."""
    from .plot import plot_command
    try:
        result = plot_command(args.run_dir, args.format, args.out)
    except PdeformerError as e:
        print(f"pdeformer: error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    print(f"pdeformer: pictures in {args.out or args.run_dir}")
    for line in _pictures(result):
        print("  " + line)
    return 0


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "plot":
        return _plot(args)
    from ..tools.blas import choose_core
    choose_core()      # before numpy loads: OpenBLAS's kernels for this CPU (tools/blas.py)
    from mpi4py import MPI
    comm = MPI.COMM_WORLD
    if comm.size > 1:  # one BLAS thread per rank unless told otherwise (before numpy loads)
        for var in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS"):
            os.environ.setdefault(var, "1")
    try:
        notes = _caches(comm)     # before dolfinx is imported
        return _info(args, comm) if args.command == "info" else _run(args, comm, notes)
    except PdeformerError as e:
        # raised on every rank at once (see pdeformer.tools.errors): rank 0 reports
        if comm.rank == 0:
            print(f"pdeformer: error: {e}", file=sys.stderr, flush=True)
        return e.exit_status
    except SystemExit:
        raise
    except KeyboardInterrupt:
        if comm.size > 1:
            comm.Abort(130)
        raise
    except BaseException:
        if comm.size > 1:
            import traceback
            traceback.print_exc()
            sys.stderr.write(f"pdeformer: rank {comm.rank} failed; aborting the MPI job\n")
            sys.stderr.flush()
            comm.Abort(1)
        raise
