"""How the work divides over ranks, by kind of code: in instructions (callgrind, free of
the machine's noise) or in sampled CPU time (perf, at full speed).

    .venv/bin/python benchmarks/instructions.py --ranks 1 2 -- gradient runs/default.toml \\
        --set mesh.cells=[32,32] model.layers=2
    .venv/bin/python benchmarks/instructions.py --sampler perf --ranks 1 2 -- gradient runs/default.toml -q

Runs a pdeformer command under valgrind's callgrind on each rank count of ``--ranks``
(the first is the reference, normally 1), counting the instructions executed inside one
phase of the run's timer only (``--phase``, default the command's solve: ``gradient`` or
``forward``), and prints per kind of code (the interpreter, numpy, BLAS, pdeformer's
compiled loops, dolfinx and its forms, PETSc, libc, MPI) the instructions of the
reference rank, the largest over the ranks of each run and their ratio: how that kind
of work divides. Instruction counts are the same for the same inputs whatever else the
host is doing, so a ratio below P points at work every rank repeats, where wall and CPU
times on a shared machine move by tens of per cent between runs. MPI's objects (and
libc's locks, which its progress loop takes) are shown apart and left out of the total:
a waiting rank spins there. pdeformer's compiled loops may be counted under ``ctypes``
(libffi's frame): callgrind gives the code entered from libffi's call to libffi where it
cannot tell the entry from a jump.

``--sampler perf`` counts CPU time instead, natively: Linux ``perf record`` samples each
rank's CPU clock (4999 Hz, software event: no hardware counters needed) inside the phase
only (started disabled, enabled at each entry and disabled at each exit through
``--control`` fifos, each switch acknowledged before the phase goes on), and the report
gives samples per kind of code and function. It
runs at full speed (the default 64^2 gradient in seconds), so it measures the cases
callgrind cannot finish; samples move with the host's noise as times do. The kernel's
samples (page faults, the copies of MPI's shared-memory transport) are their own kind,
counted in the total.
Needs ``perf`` (Debian: ``apt-get install linux-perf``) and leave to sample one's own
processes (``kernel.perf_event_paranoid`` at most 2; the kernel's samples need at most 1,
or root).

Under callgrind a run is 100-300x slower than natively: the 32^2 gradient with 2 layers
takes about 8 minutes per rank count; the default 64^2 one had not finished in 38. valgrind
(3.19) does not decode AVX-512: the run uses a fresh cache folder (``PDEFORMER_CACHE``)
in which pdeformer's compiled loops are built for ``-march=haswell`` (through a
compiler wrapper, ``CC``), and OpenBLAS takes its Haswell kernels
(``OPENBLAS_CORETYPE``). The machine's costs, which steer the laplace backend's choices,
are read from ``tests/costs.json`` unless ``PDEFORMER_COSTS`` names another file: measured
afresh they would differ from run to run, and so would the work. Needs valgrind and its header ``valgrind/callgrind.h``
(Debian: ``apt-get install valgrind``).
"""

import argparse
import collections
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CLIENT = r"""
#include <valgrind/callgrind.h>
void phase_begin(void) { CALLGRIND_ZERO_STATS; }
void phase_end(const char *name) { CALLGRIND_DUMP_STATS_AT(name); }
"""

CC_WRAPPER = """#!/bin/sh
# the system compiler, with -march=haswell for -march=native (valgrind has no AVX-512)
for a in "$@"; do
  shift
  if [ "$a" = "-march=native" ]; then set -- "$@" -march=haswell; else set -- "$@" "$a"; fi
done
exec {cc} "$@"
"""

# kinds of code by object file name (the first pattern that matches)
KINDS = [
    ("MPI", r"^(mca_|libmpi|libopen-pal|libopen-rte|libpmix|MPI\.|libevent|libhwloc|libucp|libucs)"),
    ("interpreter", r"^(python3|libpython)"),
    ("numpy", r"^_(multiarray_umath|umath|multiarray)|^_(pocketfft|bounded_integers|generator|mt19937)"),
    ("BLAS", r"blas|lapack"),
    ("compiled loops", r"^fine_[0-9a-f]+\.so$"),
    ("forms", r"^libffcx_"),
    ("dolfinx", r"^(cpp\.|libdolfinx|libbasix|_basixcpp)"),
    ("PETSc", r"^(libpetsc|PETSc\.)"),
    ("libc", r"^libc\.so"),
    ("libm", r"^libm\.so"),
    ("ctypes", r"^(libffi|_ctypes)"),
    ("kernel", r"^\[kernel"),
]


# libc's locks, which MPI's progress loop takes over and over while a rank waits
WAITING = r"^(__)?pthread_mutex_(un)?lock|^sched_yield"
LIBC = dict(KINDS)["libc"]


def kind(obj: str, fn: str | None = None) -> str:
    """The kind of code an object file (path or name) holds: one of KINDS, else 'other';
    libc's locks (``fn`` matching WAITING) count as MPI."""
    name = os.path.basename(obj or "")
    if re.search(LIBC, name) and fn and re.search(WAITING, fn):
        return "MPI"
    for label, pattern in KINDS:
        if re.search(pattern, name):
            return label
    return "other"


def exclusive_costs(path: str) -> collections.Counter:
    """Instructions executed in each (object, function) of a callgrind output file,
    exclusive of their callees: the cost lines under ``fn=``, without the inclusive cost
    line that follows each ``calls=`` line. Names may be compressed (``fn=(12) name``
    once, ``fn=(12)`` after)."""
    names = {"ob": {}, "fn": {}}
    ob = fn = None
    after_call = False
    out = collections.Counter()
    with open(path, errors="replace") as f:
        for line in f:
            head = line[:1]
            if head.isdigit() or head in "+-*":
                if after_call:
                    after_call = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    out[(ob, fn)] += int(parts[1])
                continue
            m = re.match(r"(c?)(ob|fn)=(?:\((\d+)\))?\s*(.*)$", line.rstrip("\n"))
            if m:
                callee, key, ident, name = m.groups()
                if ident is not None and name:
                    names[key][ident] = name
                resolved = names[key].get(ident, name) if ident is not None else name
                if not callee:
                    if key == "ob":
                        ob = resolved
                    else:
                        fn = resolved
                continue
            if line.startswith("calls="):
                after_call = True
    return out


def by_kind(costs: collections.Counter) -> collections.Counter:
    """Instructions per kind of code (:func:`kind`)."""
    out = collections.Counter()
    for (obj, fn), n in costs.items():
        out[kind(obj, fn)] += n
    return out


def dumps(folder: str, rank: int) -> list[str]:
    """The phase's dump files of one rank (``cg.R.1``, ``cg.R.2``, ...: one per time the
    phase ran)."""
    return sorted(os.path.join(folder, f) for f in os.listdir(folder)
                  if re.fullmatch(rf"cg\.{rank}\.\d+", f))


def fresh_folder(folder: str, ranks: int) -> str:
    """The folder of one rank count's run, emptied (no files of an earlier run: --keep)."""
    out = os.path.join(folder, f"ranks{ranks}")
    shutil.rmtree(out, ignore_errors=True)
    os.makedirs(out)
    return out


def launch(ranks: int, tool: list[str], child: list[str], args: list[str], out: str, env: dict) -> None:
    """mpirun of ``tool`` running this script's ``child`` mode on the pdeformer command
    ``args`` (output into ``out``); exits with its stderr where it fails."""
    from pdeformer.tools.parallel import mpirun_command
    cmd = mpirun_command(ranks) + tool + [sys.executable, os.path.abspath(__file__), *child, "--", *args,
                                          "--set", f"output.dir={out}/run", "output.plots=false"]
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr[-4000:]}")


def run_env(**extra) -> dict:
    """The runs' environment: one BLAS thread, the machine's costs from a file
    (``PDEFORMER_COSTS``, default tests/costs.json), and ``extra``."""
    return dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1",
                PDEFORMER_COSTS=os.environ.get("PDEFORMER_COSTS", os.path.join(ROOT, "tests", "costs.json")), **extra)


def run(ranks: int, args: list[str], phase: str, folder: str, env: dict) -> list[collections.Counter]:
    """The command on ``ranks`` ranks under callgrind; per rank, its exclusive costs
    summed over the phase's dumps."""
    out = fresh_folder(folder, ranks)
    launch(ranks, ["valgrind", "--tool=callgrind", "--dump-instr=no",
                   f"--callgrind-out-file={out}/cg.%q{{OMPI_COMM_WORLD_RANK}}"], ["--child", phase], args, out, env)
    per_rank = []
    for r in range(ranks):
        files = dumps(out, r)
        if not files:
            sys.exit(f"rank {r} of the {ranks}-rank run never left phase {phase!r} (no dump in {out})")
        total = collections.Counter()
        for f in files:
            total.update(exclusive_costs(f))
        per_rank.append(total)
    return per_rank


PERF_HZ = 4999


def perf_samples(path: str) -> collections.Counter:
    """CPU-clock samples per (object, function) of one ``perf record`` file."""
    proc = subprocess.run(["perf", "script", "-i", path, "-F", "ip,sym,dso"], capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"perf script -i {path} failed:\n{proc.stderr[-2000:]}")
    return parse_perf_script(proc.stdout)


def parse_perf_script(text: str) -> collections.Counter:
    """Samples per (object, function) from ``perf script -F ip,sym,dso`` lines
    (``  7f12ab34 symbol (/path/object)``; ``[unknown]`` where the object has no symbols)."""
    out = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*[0-9a-f]+\s+(.*)\s+\(([^()]*)\)\s*$", line)   # C++ names hold ' ('
        if m:
            out[(m.group(2), m.group(1))] += 1
    return out


def run_perf(ranks: int, args: list[str], phase: str, folder: str, env: dict) -> list[collections.Counter]:
    """The command on ``ranks`` ranks under ``perf record``, sampling only inside the
    phase; per rank, its samples per (object, function)."""
    out = fresh_folder(folder, ranks)
    for r in range(ranks):
        for name in (f"ctl.{r}", f"ack.{r}"):
            os.mkfifo(os.path.join(out, name))
    rank = "${OMPI_COMM_WORLD_RANK:-${PMI_RANK:-0}}"       # Open MPI's, else MPICH's
    where = shlex.quote(out)
    record = (f'exec perf record -q -D -1 --control fifo:{where}/ctl.{rank},{where}/ack.{rank} '
              f'-e cpu-clock -F {PERF_HZ} -o {where}/perf.{rank}.data -- "$@"')
    launch(ranks, ["sh", "-c", record, "perf"], ["--child-perf", phase, out], args, out, env)
    return [perf_samples(os.path.join(out, f"perf.{r}.data")) for r in range(ranks)]


def report(reference: list[collections.Counter], runs: dict, top: int, unit: str = "instructions") -> None:
    """Per kind: the counts (``unit``) of the reference's busiest rank, of each run's
    busiest, and the ratio; then the functions (outside MPI) whose counts divide worst."""
    ref = [by_kind(c) for c in reference]
    kinds = sorted({k for c in ref for k in c}, key=lambda k: -max(c[k] for c in ref))
    P0 = len(reference)
    header = f"{'kind':16s} {f'{P0} rank(s)':>14s}" + "".join(f" {f'{P} ranks, max':>16s} {'ratio':>6s}" for P in runs)
    print(header)

    def row(label, base, others):
        line = f"{label:16s} {base:14.4e}"
        for value in others:
            line += f" {value:16.4e} {base / value if value else float('inf'):6.2f}"
        print(line)

    counted = {P: [by_kind(c) for c in per_rank] for P, per_rank in runs.items()}
    for k in kinds:
        row(k, max(c[k] for c in ref), [max(c[k] for c in counted[P]) for P in runs])
    total = lambda c: sum(v for k, v in c.items() if k != "MPI")   # noqa: E731
    row("total (no MPI)", max(total(c) for c in ref), [max(total(c) for c in counted[P]) for P in runs])
    base = collections.Counter()          # the reference's ranks together
    for c in reference:
        base.update(c)
    for P, per_rank in runs.items():
        excess = []
        for key in set(base) | set().union(*per_rank):
            if kind(*key) == "MPI":
                continue
            most = max(c.get(key, 0) for c in per_rank)
            excess.append((most - base[key] * P0 / P, key, base[key], most))
        excess.sort(reverse=True)
        print(f"\n{P} ranks: functions whose {unit} divide worst (busiest rank less "
              f"the reference's share)")
        for e, (obj, fn), b, most in excess[:top]:
            print(f"  {e:11.4e}  {b:11.4e} -> {most:11.4e}  {kind(obj, fn):14s} {(fn or '?')[:60]}")


def hook_phase(phase: str, begin, end) -> None:
    """Call ``begin()`` at each entry of the run's timer phase ``phase`` and ``end(phase)``
    at each exit (the phase's own timing inside them)."""
    from pdeformer.tools import parallel
    phase_of = parallel.Timer.phase

    def hooked(self, name):
        inner = phase_of(self, name)
        if name != phase:
            return inner

        class Hooked:
            def __enter__(self):
                begin()
                return inner.__enter__()

            def __exit__(self, *exc):
                result = inner.__exit__(*exc)
                end(name)
                return result

        return Hooked()

    parallel.Timer.phase = hooked


def child(phase: str, args: list[str]) -> int:
    """Inside valgrind: count only inside ``phase`` (zeroed at each entry, dumped at each
    exit), then run the pdeformer command."""
    import ctypes
    from pdeformer.tools.blas import choose_core
    choose_core()
    lib = ctypes.CDLL(os.path.join(os.environ["PDEFORMER_CACHE"], "callgrind_client.so"))
    hook_phase(phase, lib.phase_begin, lambda name: lib.phase_end(name.encode()))
    from pdeformer.commands.cli import main
    return main(args)


def child_perf(phase: str, folder: str, args: list[str]) -> int:
    """Under ``perf record -D -1``: sample only inside ``phase`` (enabled at each entry,
    disabled at each exit, through this rank's control fifo, each command waited for
    until perf acknowledges it), then run the command."""
    from pdeformer.tools.blas import choose_core
    choose_core()
    from mpi4py import MPI
    control = os.path.join(folder, f"ctl.{MPI.COMM_WORLD.rank}")
    ack = os.path.join(folder, f"ack.{MPI.COMM_WORLD.rank}")

    def send(command: str) -> None:
        with open(control, "w") as f:      # perf reads one command per open
            f.write(command + "\n")
        with open(ack) as f:               # its answer: the switch has taken effect
            f.readline()

    hook_phase(phase, lambda: send("enable"), lambda name: send("disable"))
    from pdeformer.commands.cli import main
    return main(args)


def prepare(folder: str) -> dict:
    """The environment of the runs: a fresh cache with the callgrind client library and a
    compiler wrapper for -march=haswell; OpenBLAS on its Haswell kernels, one thread; the
    machine's costs from a file."""
    cc = shutil.which(os.environ.get("CC", "cc"))
    if shutil.which("valgrind") is None or cc is None:
        sys.exit("needs valgrind and a C compiler (Debian: apt-get install valgrind gcc)")
    cache = os.path.join(folder, "cache")
    os.makedirs(cache, exist_ok=True)               # --keep: the loops built before are reused
    source = os.path.join(folder, "client.c")
    with open(source, "w") as f:
        f.write(CLIENT)
    build = subprocess.run([cc, "-O1", "-shared", "-fPIC", "-o", os.path.join(cache, "callgrind_client.so"), source],
                           capture_output=True, text=True)
    if build.returncode != 0:
        sys.exit(f"cannot build the callgrind client (valgrind/callgrind.h missing?):\n{build.stderr}")
    wrapper = os.path.join(folder, "cc")
    with open(wrapper, "w") as f:
        f.write(CC_WRAPPER.format(cc=cc))
    os.chmod(wrapper, 0o755)
    return run_env(PDEFORMER_CACHE=cache, CC=wrapper, OPENBLAS_CORETYPE="Haswell")


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--child"]:
        sys.exit(child(argv[1], argv[3:]))
    if argv[:1] == ["--child-perf"]:
        sys.exit(child_perf(argv[1], argv[2], argv[4:]))
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[1, 2])
    p.add_argument("--phase", default=None, help="the timer phase counted (default: the command's solve)")
    p.add_argument("--top", type=int, default=12, help="functions listed per run")
    p.add_argument("--keep", default=None, help="folder for the callgrind or perf files (default: a temporary one)")
    p.add_argument("--sampler", choices=("callgrind", "perf"), default="callgrind",
                   help="count instructions under callgrind, or sample CPU time natively with perf")
    p.add_argument("command", nargs=argparse.REMAINDER, help="-- and the pdeformer command line")
    a = p.parse_args(argv)
    args = a.command[1:] if a.command[:1] == ["--"] else a.command
    if not args:
        p.error("give the pdeformer command after --")
    phase = a.phase or ("gradient" if args[0] in ("gradient", "train") else "forward")
    with tempfile.TemporaryDirectory() as tmp:
        folder = a.keep or tmp
        os.makedirs(folder, exist_ok=True)
        if a.sampler == "perf":
            if shutil.which("perf") is None:
                sys.exit("--sampler perf needs perf (Debian: apt-get install linux-perf)")
            results = {P: run_perf(P, args, phase, folder, run_env()) for P in a.ranks}
        else:
            env = prepare(folder)
            results = {P: run(P, args, phase, folder, env) for P in a.ranks}
    first = a.ranks[0]
    what = "CPU-clock samples" if a.sampler == "perf" else "instructions"
    print(f"{what} in phase {phase!r} of `pdeformer {' '.join(args)}`")
    report(results[first], {P: results[P] for P in a.ranks[1:]}, a.top, what)


if __name__ == "__main__":
    main()
