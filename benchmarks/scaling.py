"""Parallel scaling of pdeformer: wall time, compute efficiency and communication per rank.

    .venv/bin/python benchmarks/scaling.py                     # all cases, P = 1, 2, 4, 8
    .venv/bin/python benchmarks/scaling.py --ranks 1 2 --cases forward128 train

For P ranks (oversubscribed where P exceeds the cores) it runs, with `runs/default.toml`:

* ``forward128``, ``forward256``: the forward pass on 128^2 and 256^2 cells (fields off);
* ``train``: one training step (`pdeformer gradient`: forward and adjoint of both prompts,
  what each step of `train` computes) on the default 64^2 mesh;
* ``prompts16``: one training step with 16 prompts (Gaussian mixtures) and G = P prompt
  groups.

and prints the wall time of the command (start-up included: about 2 s here), the time
of its solve (the `forward` or `gradient` phase of summary.json, the largest over ranks:
what a longer job repeats), each with its speedup against one rank, the compute
efficiency E(P) = C(1) / (P max_r C_r(P)) with C_r the compute CPU seconds of rank r
(``parallel.compute_cpu_s`` in summary.json: CPU time outside MPI communication), and
the bytes communicated per rank (largest over ranks). On a machine with fewer cores than
ranks the wall time says little; E(P) says how the run would scale with one core per rank.
A second table gives the same ratio per phase (``parallel.phase_compute_cpu_s``): how the
velocity, transport, limiter and their reverses each divide (with ``--ideal``, also for
the ceiling's copies).
With ``--repeat N`` every figure is the least over N interleaved rounds, and the wall-time
speedup within each round (its 1-rank and P-rank runs minutes apart, so a slow stretch of
a shared machine slows both) is given too, as median and range, and a table per round
sets each round's speedups beside how its phases without communication divided (the
limiter: each rank's own cells, waiting for nothing; not shown for one-rank groups, in
which nothing is metered). Their division is a reference for what the machine gave two
busy cores in that stretch (a ratio of CPU times, not an exact bound); what the run loses
beyond it is the start-up that nothing divides and pdeformer's communication, waiting
and repeated work.

``--ideal`` adds what the machine itself allows a case at P ranks: P copies of its first
prompt, solved on one rank and then by P prompt groups of one rank each (the work divided
perfectly, nothing communicated during the solve). Their speedup is the ceiling of any
division of that work here: process start-up and imports (about 0.9 s, not divided) and
what P busy cores cost each other (memory bandwidth, shared caches) are in it, pdeformer's
communication and repeated work are not. ``reached`` is the case's speedup over it, and
E(P) the compute efficiency of the copies: where P exceeds the cores, what oversubscription
alone leaves of E(P) (prompts16's work is the same kind: gradients on 64^2, one per
prompt, so ``train``'s ceiling at P = 8 bounds its E(8) too).

    .venv/bin/python benchmarks/scaling.py --ranks 1 2 --cases forward128 train --ideal --repeat 3
"""

import argparse
import json
import math
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from pdeformer.tools.parallel import mpirun_command  # noqa: E402

DEFAULT = os.path.join(ROOT, "runs", "default.toml")


def prompts16_config(folder: str) -> str:
    """runs/default.toml with 16 prompts: Gaussian mixtures of one or two components on a
    ring of centres, each with a moments target."""
    with open(DEFAULT) as f:
        text = f.read().split("[[prompts]]")[0]
    for i in range(16):
        a = 2 * math.pi * i / 16
        c, s = 1.2 * math.cos(a), 1.2 * math.sin(a)
        two = i % 2
        text += (f"\n[[prompts]]\nname = \"p{i:02d}\"\nkind = \"gaussian_mixture\"\n"
                 + (f"weights = [0.6, 0.4]\nmeans = [[{c:.4f}, {s:.4f}], [{-s / 2:.4f}, {c / 2:.4f}]]\n"
                    f"covs = [0.12, 0.2]\n" if two else
                    f"means = [[{c:.4f}, {s:.4f}]]\ncovs = [[[0.15, 0.03], [0.03, 0.1]]]\n")
                 + f"target = {{ mean = [{-c / 3:.4f}, {s / 3:.4f}], cov = [[0.8, 0.1], [0.1, 0.4]] }}\n")
    path = os.path.join(folder, "prompts16.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


def copies_config(folder: str, copies: int) -> str:
    """runs/default.toml with its first prompt ``copies`` times (renamed): work that P
    prompt groups divide exactly."""
    with open(DEFAULT) as f:
        head, *prompts = f.read().split("[[prompts]]")
    name = re.search(r'^name\s*=\s*"([^"]+)"', prompts[0], re.M)
    if name is None or any(re.search(r"^\s*\[", p, re.M) for p in prompts):
        sys.exit(f"{DEFAULT}: --ideal expects the [[prompts]] last, the first with a name")
    first = prompts[0]
    text = head + "".join("[[prompts]]" + first[:name.start(1)] + f"{name.group(1)}_{i}" + first[name.end(1):]
                          for i in range(copies))
    path = os.path.join(folder, f"copies{copies}.toml")
    with open(path, "w") as f:
        f.write(text)
    return path


# the solvers' scaling, without the pictures a run draws when it ends (one rank draws them)
NO_PICTURES = ["output.plots=false"]


def case_command(case: str, ranks: int, folder: str) -> tuple[str, list[str], list[str]]:
    """(command, config and flags, --set overrides) of a case; ``CASE@K``: the case on
    K copies of the first prompt in K prompt groups (``--ideal``; one group on one rank)."""
    if "@" in case:
        case, copies = case.split("@")
        command, _, sets = case_command(case, ranks, folder)
        return command, [copies_config(folder, int(copies)), "--prompt-groups", str(ranks)], sets
    if case in ("forward128", "forward256"):
        n = case[-3:]
        return "forward", [DEFAULT], [f"mesh.cells=[{n},{n}]", "output.fields=false"]
    if case == "train":
        return "gradient", [DEFAULT], []
    if case == "prompts16":
        return "gradient", [prompts16_config(folder), "--prompt-groups", str(ranks)], []
    raise ValueError(case)


def run(case: str, ranks: int, folder: str) -> dict:
    command, args, sets = case_command(case, ranks, folder)
    out = os.path.join(folder, f"{case.replace('@', '-copies')}-{ranks}")
    cmd = mpirun_command(ranks) + [sys.executable, "-m", "pdeformer", command, *args, "-q",
                                   "--set", f"output.dir={out}", *sets, *NO_PICTURES]
    env = dict(os.environ, OPENBLAS_NUM_THREADS="1", OMP_NUM_THREADS="1")
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{proc.stderr}")
    with open(os.path.join(out, "summary.json")) as f:
        summary = json.load(f)
    par = summary["parallel"]
    phase = summary["timings"].get(command, summary["timings"]["total"])
    return {"wall": wall, "phase": phase, "compute": par["compute_cpu_s"], "bytes": par["comm_bytes"],
            "comm": par["comm_s"], "phases": par["phase_compute_cpu_s"],
            "phase_comm": par["phase_comm_s"], "solve": command,
            "ranks_per_group": par["ranks_per_group"]}


def least(results: list[dict]) -> dict:
    """Every figure of a case's runs at its least over the runs: wall and solve time, the
    summed and the largest compute over ranks (E(P) compares these), communication time;
    the bytes do not vary."""
    return {"wall": min(r["wall"] for r in results), "phase": min(r["phase"] for r in results),
            "csum": min(sum(r["compute"]) for r in results),
            "cmax": min(max(r["compute"]) for r in results),
            "bytes": max(results[0]["bytes"]), "comm": min(max(r["comm"]) for r in results),
            "phases": {k: min(max(r["phases"].get(k, [0.0])) for r in results)
                       for k in results[0]["phases"]},
            "solve": results[0]["solve"]}


def phase_division(base: dict, r: dict, share: float = 0.05) -> str:
    """How each phase's compute divides: C_phase(1) / max_r C_phase,r(P) (least over the
    runs), for the phases of at least ``share`` of the solve's one-rank compute, the
    solve first."""
    solve = base["phases"].get(base["solve"], 0.0)
    names = [base["solve"]] + sorted((k for k, c in base["phases"].items()
                                      if k != base["solve"] and c >= share * solve),
                                     key=lambda k: -base["phases"][k])
    return "  ".join(f"{k} {base['phases'][k] / r['phases'][k]:.2f}x" for k in names
                     if r["phases"].get(k, 0.0) > 0)


def by_round(base: list[dict], runs: list[dict]) -> str:
    """The wall-time speedup within each round of the interleaved runs (the two runs
    minutes apart, so a slow stretch of the machine slows both): median and range."""
    ratios = sorted(b["wall"] / r["wall"] for b, r in zip(base, runs))
    return f"  {statistics.median(ratios):.2f} ({ratios[0]:.2f}-{ratios[-1]:.2f})"


def quiet_phases(run: dict, share: float = 0.05) -> list[str]:
    """The phases in which no rank communicated (the limiter: each rank's own cells) and
    that take ``share`` of the solve's compute or more. None where the groups have one
    rank each: nothing inside such a group is metered, so no phase tells."""
    if run["ranks_per_group"] == 1:
        return []
    solve = max(run["phases"].get(run["solve"]) or [0.0])
    return [k for k, comm in run["phase_comm"].items()
            if k != run["solve"] and not any(comm) and max(run["phases"][k]) > 0
            and max(run["phases"][k]) >= share * solve]


def round_lines(case: str, P: int, base: list[dict], runs: list[dict]) -> list[str]:
    """Per round: the wall-time and solve speedups, how the compute divided
    (C(1) / max_r C_r(P)), and how the phases without communication divided. Those
    phases' work is split by cells and waits for nothing: a reference for what the
    machine gave two busy cores in that stretch (a ratio of CPU times, which the phase's
    own working set can also move), not an exact bound."""
    lines = []
    for i, (b, r) in enumerate(zip(base, runs)):
        quiet = [k for k in quiet_phases(r) if k in b["phases"]]
        parts = "  ".join(f"{k} {b['phases'][k][0] / max(r['phases'][k]):.2f}x" for k in quiet)
        lines.append(f"{case:>11} {P:>3} {i + 1:>5} {b['wall'] / r['wall']:>8.2f} "
                     f"{b['phase'] / r['phase']:>8.2f} {sum(b['compute']) / max(r['compute']):>8.2f}"
                     f"  {parts}")
    return lines


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--cases", nargs="+", default=["forward128", "forward256", "train", "prompts16"])
    ap.add_argument("--repeat", type=int, default=1,
                    help="runs of every case and P, interleaved; each figure is the least "
                         "over them (a shared machine's noise only ever adds), and the "
                         "speedup within each round is given as a median and range")
    ap.add_argument("--ideal", action="store_true",
                    help="also the ceiling of every case but prompts16: P copies of its first "
                         "prompt on 1 rank and in P groups of one rank")
    args = ap.parse_args()
    print(f"pdeformer scaling on {os.cpu_count()} core(s); E(P) = C(1) / (P max_r C_r(P)) "
          f"from compute_cpu_s; least of {args.repeat} run(s) each", flush=True)
    runs = [(case, P) for case in args.cases for P in args.ranks]
    ideal = [c for c in args.cases if c != "prompts16"] if args.ideal else []
    runs += [(f"{case}@{P}", n) for case in ideal for P in args.ranks if P > 1 for n in (1, P)]
    results = {key: [] for key in runs}
    with tempfile.TemporaryDirectory() as folder:
        for _ in range(args.repeat):
            for key in runs:
                results[key].append(run(*key, folder))
    best = {key: least(rs) for key, rs in results.items()}
    print(f"{'case':>11} {'P':>3} {'wall [s]':>9} {'speedup':>8} {'solve [s]':>9} {'speedup':>8} "
          f"{'C max [s]':>10} {'C sum [s]':>10} {'E(P)':>6} {'MB/rank':>8} {'comm [s]':>9}"
          + ("  speedup by round: median (range)" if args.repeat > 1 else ""))
    for case in args.cases:
        base = best[case, args.ranks[0]]
        for P in args.ranks:
            r = best[case, P]
            E = base["csum"] / (P * r["cmax"]) if args.ranks[0] == 1 else float("nan")
            print(f"{case:>11} {P:>3} {r['wall']:>9.1f} {base['wall'] / r['wall']:>8.2f} "
                  f"{r['phase']:>9.1f} {base['phase'] / r['phase']:>8.2f} {r['cmax']:>10.2f} "
                  f"{r['csum']:>10.2f} {E:>6.2f} {r['bytes'] / 1e6:>8.1f} {r['comm']:>9.2f}"
                  + (by_round(results[case, args.ranks[0]], results[case, P]) if args.repeat > 1 else ""))

    if args.ranks[0] == 1 and args.repeat > 1:
        print("\nper round: speedups of wall time, solve and compute (C(1) / max_r C_r(P)), and "
              "how the phases without communication divided (a reference for what the machine gave the round)")
        print(f"{'case':>11} {'P':>3} {'round':>5} {'wall':>8} {'solve':>8} {'compute':>8}  "
              "phases without communication")
        for case in args.cases:
            for P in args.ranks[1:]:
                print("\n".join(round_lines(case, P, results[case, 1], results[case, P])))

    if args.ranks[0] == 1:
        print("\nhow each phase's compute divides, C_phase(1) / max_r C_phase,r(P) from "
              "phase_compute_cpu_s (phases of 5% of the solve's or more):")
        for case in args.cases:
            for P in args.ranks[1:]:
                print(f"{case:>11} {P:>3}  {phase_division(best[case, 1], best[case, P])}")
    if not ideal:
        return
    several = [P for P in args.ranks if P > 1]     # the rank counts the ceiling was run at
    print("\nceiling: P copies of the first prompt, 1 rank against P groups of one rank")
    print(f"{'case':>11} {'P':>3} {'1 rank [s]':>10} {'P groups [s]':>12} {'ceiling':>8} "
          f"{'solve':>6} {'case':>6} {'reached':>8} {'E(P)':>6}")
    for case in ideal:
        for P in several:
            one, many = best[f"{case}@{P}", 1], best[f"{case}@{P}", P]
            ceiling = one["wall"] / many["wall"]
            speedup = (best[case, 1]["wall"] / best[case, P]["wall"]
                       if (case, 1) in best else float("nan"))
            print(f"{case:>11} {P:>3} {one['wall']:>10.1f} {many['wall']:>12.1f} {ceiling:>8.2f} "
                  f"{one['phase'] / many['phase']:>6.2f} {speedup:>6.2f} {speedup / ceiling:>8.2f} "
                  f"{one['csum'] / (P * many['cmax']):>6.2f}")
    print("\nhow each phase's compute divides in the ceiling (the copies on 1 rank against P groups):")
    for case in ideal:
        for P in several:
            print(f"{case:>11} {P:>3}  {phase_division(best[f'{case}@{P}', 1], best[f'{case}@{P}', P])}")


if __name__ == "__main__":
    main()
