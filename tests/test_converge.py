"""`pdeformer converge`: study files, tiny sweeps read back, references; the walltime guard."""

from __future__ import annotations

import csv
import json
import os

import pytest

from conftest import ROOT, requires_dolfinx, run_cli, write_config

pytestmark = [requires_dolfinx]
STUDIES = os.path.join(ROOT, "runs", "studies")


def table(folder):
    with open(os.path.join(folder, "convergence.csv"), newline="") as f:
        return [dict(r, error=float(r["error"]), order=float(r["order"]), size=float(r["size"]))
                for r in csv.DictReader(f)]


def test_shipped_studies_load():
    from pdeformer.model.config import load_config
    from pdeformer.commands.study import load_study
    names = [n for n in os.listdir(STUDIES) if n.endswith(".toml")]
    studies = [n for n in names if "[study]" in open(os.path.join(STUDIES, n)).read()]
    assert {"mesh.toml", "degree.toml", "layers.toml", "heads.toml", "particles.toml"} <= set(studies)
    names = [n for n in names if "[budget]" not in open(os.path.join(STUDIES, n)).read()]  # test_budget.py
    for n in names:
        if n in studies:
            s = load_study(os.path.join(STUDIES, n))
            load_config(s["run"], s["set"])
        else:
            load_config(os.path.join(STUDIES, n))


def test_mesh_sweep_on_the_translation_case(tmp_path):
    """The shipped mesh study, cut to three meshes: a table with one row per case and
    quantity, read back; DG-1 order 2 within 0.3 on the finest pair."""
    proc = run_cli(["converge", os.path.join(STUDIES, "mesh.toml"), "--set",
                    "study.values=[[8,8],[16,16],[32,32]]", f"output.dir={tmp_path}/mesh"])
    assert "convergence.csv" in proc.stdout
    rows = table(tmp_path / "mesh")
    assert sorted({r["quantity"] for r in rows}) == ["cov", "l1", "l2", "mean"]
    l2 = [r for r in rows if r["quantity"] == "l2"]
    assert [r["value"] for r in l2] == ["[8, 8]", "[16, 16]", "[32, 32]"]
    assert l2[0]["error"] > l2[1]["error"] > l2[2]["error"]
    assert abs(l2[-1]["order"] - 2.0) < 0.3, l2
    with open(tmp_path / "mesh" / "convergence.md") as f:
        assert "| [32, 32] | 0.03125 | l2 |" in f.read()
    with open(tmp_path / "mesh" / "summary.json") as f:
        assert json.load(f)["status"] == "completed"


@pytest.mark.mpi
def test_particles_against_a_reference_run(tmp_path):
    run_cli(["converge", os.path.join(STUDIES, "particles.toml"), "--set", "study.values=[100,400]",
             "study.reference_set=[\"mesh.cells=[16,16]\",\"model.layers=2\"]",
             "study.set=[\"model.layers=2\",\"particles.steps_per_layer=4\",\"mesh.cells=[16,16]\"]",
             f"output.dir={tmp_path}/p"], nprocs=2)
    rows = table(tmp_path / "p")
    assert sorted({r["quantity"] for r in rows}) == ["cov", "mean", "mmd"]
    assert all(r["error"] > 0 for r in rows) and len(rows) == 6


def test_finest_reference_and_density_errors_across_meshes(tmp_path):
    """reference = finest with l2 between meshes (the coarse density evaluated on the
    finest mesh's quadrature): the coarser mesh has the larger error."""
    run_cli(["converge", os.path.join(STUDIES, "layers.toml"), "--set",
             "study.values=[[8,8],[16,16],[32,32]]", "study.parameter=mesh.cells",
             "study.set=[\"model.layers=2\",\"model.heads=2\"]", f"output.dir={tmp_path}/f"])
    l2 = [r for r in table(tmp_path / "f") if r["quantity"] == "l2"]
    assert len(l2) == 2 and l2[0]["error"] > l2[1]["error"] > 0


@pytest.mark.parametrize("override, message", [
    ("study.quantities=[\"speed\"]", "study.quantities: unknown quantity 'speed'"),
    ("study.reference=\"run\"", "study.reference_run: missing"),
    ("study.values=[1]", "study.values: expected a list of at least two values"),
    ("study.quantities=[\"mmd\"]", "study.quantities: 'mmd' is not measured by command 'forward'"),
])
def test_study_errors(tmp_path, override, message):
    check_study_error(tmp_path, "mesh.toml", [override], message)


def check_study_error(tmp_path, study: str, overrides: list, message: str) -> None:
    """`converge` of a shipped study with bad overrides: one line naming the key, exit 2."""
    from conftest import check_one_line_error
    proc = run_cli(["converge", os.path.join(STUDIES, study), "--set", *overrides,
                    f"output.dir={tmp_path}/e"], check=False)
    check_one_line_error(proc, message)


def test_walltime_formats():
    """--walltime takes seconds, MM:SS, HH:MM:SS and SLURM's D-HH:MM:SS; NaN, infinity,
    negative values and malformed days are refused (NaN would turn the guard off)."""
    import argparse
    from pdeformer.commands.cli import _duration
    assert [_duration(t) for t in ("90", "0.5", "03:04", "02:03:04", "1-02:03:04")] == \
        [90.0, 0.5, 184.0, 7384.0, 93784.0]
    for text in ("nan", "inf", "-5", "1:nan", "1-02:03", "1.5-00:00:00", "1:2:3:4", "a"):
        with pytest.raises(argparse.ArgumentTypeError, match="expected \\[D-\\]HH:MM:SS"):
            _duration(text)


def test_slurm_template_reads_limits_of_a_day_or_more(tmp_path):
    """runs/slurm.sh turns squeue's time left ([D-][HH:]MM:SS) into --walltime, 5 minutes
    short (a fake squeue and srun on PATH)."""
    import stat
    import subprocess
    for name, body in (("squeue", 'echo "$LIMIT"'), ("srun", 'echo "$@"')):
        f = tmp_path / name
        f.write_text("#!/bin/bash\n" + body + "\n")
        f.chmod(f.stat().st_mode | stat.S_IEXEC)
    for limit, expected in (("1-02:03:04", "--walltime 93484"), ("02:03:04", "--walltime 7084"),
                            ("10:00", "--walltime 300"), ("UNLIMITED", None), ("04:00", None)):
        env = dict(os.environ, PATH=f"{tmp_path}:{os.environ['PATH']}", LIMIT=limit, SLURM_JOB_ID="7")
        out = subprocess.run(["bash", os.path.join(ROOT, "runs", "slurm.sh"), "train", "x.toml"],
                             capture_output=True, text=True, env=env, cwd=ROOT, check=True).stdout
        assert (expected in out) if expected else "--walltime" not in out, (limit, out)


def test_walltime_guard_stops_training_with_a_checkpoint(tmp_path):
    from configs import CONFIG, history
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["train", cfg, "--set", "output.dir=full"], cwd=str(tmp_path))
    proc = run_cli(["train", cfg, "--walltime", "0.05", "--set", "output.dir=cut"], cwd=str(tmp_path))
    assert "walltime guard" in proc.stderr
    with open(tmp_path / "cut" / "summary.json") as f:
        assert json.load(f)["status"] == "walltime"
    assert len(history(tmp_path / "cut")) < 6
    run_cli(["train", cfg, "--restart", "--set", "output.dir=cut"], cwd=str(tmp_path))
    full, cut = history(tmp_path / "full"), history(tmp_path / "cut")
    assert [r["risk"] for r in full] == [r["risk"] for r in cut]


# ------------------------------------------------------------------ ensembles

ENSEMBLE = ["study.values=[2,8]", "study.seeds=4", "study.groups=1",
            "study.set=[\"model.layers=2\",\"mesh.cells=[10,10]\",\"model.depth=\\\"iid\\\"\"]"]


def ensemble(folder):
    with open(os.path.join(folder, "ensemble.csv"), newline="") as f:
        return [dict(r, error=float(r["error"])) for r in csv.DictReader(f)]


def test_ensemble_members_are_seeded_runs_against_the_exact_limit(tmp_path):
    """seeds = 4 with reference = expectation: member j is `forward` with model.seed =
    base + j, and its mean error is |final mean - the prompt's mean| (read from that run's
    own summary); the table's error is the members' mean with a t interval around it."""
    import numpy as np
    run_cli(["converge", os.path.join(STUDIES, "heads.toml"), "--set", *ENSEMBLE,
             f"output.dir={tmp_path}/h"])
    members = [r for r in ensemble(tmp_path / "h") if r["quantity"] == "mean" and r["value"] == "8"]
    assert [r["member"] for r in members] == ["0", "1", "2", "3"]
    with open(tmp_path / "h" / "summary.json") as f:
        summary = json.load(f)
    assert summary["seeds"] == {"model.seed": [3, 4, 5, 6]} and "centred" in summary["reference"]
    prompt_mean = 0.5 * np.array([-1.0, 0.0]) + 0.5 * np.array([1.0, 0.5])     # depth.toml's prompt
    for j in (0, 3):
        run_cli(["forward", os.path.join(STUDIES, "depth.toml"), "--set", "model.layers=2", "model.heads=8",
                 "mesh.cells=[10,10]", "model.depth=\"iid\"", f"model.seed={3 + j}", f"output.dir={tmp_path}/f{j}"])
        with open(tmp_path / f"f{j}" / "summary.json") as f:
            final = np.array(json.load(f)["final_diagnostics"][0]["mean"])
        assert members[j]["error"] == pytest.approx(np.linalg.norm(final - prompt_mean), rel=1e-9)
    row = [r for r in table(tmp_path / "h") if r["quantity"] == "mean" and r["value"] == "8"][0]
    errs = np.array([r["error"] for r in members])
    assert row["error"] == pytest.approx(errs.mean(), rel=1e-12)
    half = 3.182446305284263 * errs.std(ddof=1) / 2                         # t_{0.975, 3}
    assert float(row["ci_high"]) == pytest.approx(errs.mean() + half, rel=1e-9)
    with open(tmp_path / "h" / "convergence.md") as f:
        text = f.read()
    assert "Ensembles of 4 draws" in text and "| mean | " in text.split("Orders fitted")[1]


@pytest.mark.mpi
def test_ensembles_are_the_same_on_1_and_2_ranks_and_in_groups(tmp_path):
    """The members' errors do not depend on the rank count or on how the members are
    dealt to groups of ranks (1e-10), against an independent draw with 32 heads."""
    sets = ENSEMBLE + ["study.reference=\"draw\"", "study.reference_set=[\"model.heads=32\"]",
                       "study.quantities=[\"l2\",\"mean\",\"cov\"]"]
    run_cli(["converge", os.path.join(STUDIES, "heads.toml"), "--set", *sets, f"output.dir={tmp_path}/one"])
    run_cli(["converge", os.path.join(STUDIES, "heads.toml"), "--set", *sets, f"output.dir={tmp_path}/two"],
            nprocs=2)
    run_cli(["converge", os.path.join(STUDIES, "heads.toml"), "--set", *sets, "study.groups=2",
             f"output.dir={tmp_path}/groups"], nprocs=2)
    one = ensemble(tmp_path / "one")
    assert len(one) == 2 * 4 * 3 and all(r["error"] > 0 for r in one)
    for other in ("two", "groups"):
        rows = ensemble(tmp_path / other)
        assert [(r["case"], r["member"], r["quantity"]) for r in rows] == \
            [(r["case"], r["member"], r["quantity"]) for r in one]
        for a, b in zip(one, rows):
            assert b["error"] == pytest.approx(a["error"], rel=1e-10), (other, a, b)
    with open(tmp_path / "groups" / "summary.json") as f:
        summary = json.load(f)
    assert summary["reference_seeds"] == ["model.seed=7"] and summary["parallel"]["groups"] == 2


@pytest.mark.parametrize("override, message", [
    ("study.groups=3", "study.groups: 3 groups for 2 seed(s)"),
    ("study.seed_keys=[\"model.scale\"]", "study.seed_keys: 'model.scale' is not a seed"),
    ("study.quantities=[\"risk\"]", "study.quantities: 'risk' needs a reference run (reference = 'expectation'"),
    ("study.seed_keys=[\"model.heads\"]", "study.seed_keys: 'model.heads' is not a seed"),
])
def test_ensemble_errors(tmp_path, override, message):
    check_study_error(tmp_path, "heads.toml", ["study.seeds=2", override], message)


@pytest.mark.mpi
def test_groups_that_do_not_divide_the_ranks_end_every_rank(tmp_path):
    from conftest import check_one_line_error
    proc = run_cli(["converge", os.path.join(STUDIES, "heads.toml"), "--set", *ENSEMBLE, "study.groups=3",
                    f"output.dir={tmp_path}/e"], nprocs=2, check=False)
    check_one_line_error(proc, "study.groups: 3 groups cannot split 2 rank(s)")


@pytest.mark.mpi
def test_walltime_guard_in_groups_ends_every_group(tmp_path):
    """Each group's first rank decides for its group; the study ends on every rank with
    status walltime and the (here empty) tables written once."""
    proc = run_cli(["converge", os.path.join(STUDIES, "heads.toml"), "--walltime", "0.001", "--set",
                    *ENSEMBLE, "study.groups=2", f"output.dir={tmp_path}/w"], nprocs=2)
    assert "walltime guard" in proc.stderr and "(status walltime)" in proc.stdout
    with open(tmp_path / "w" / "summary.json") as f:
        summary = json.load(f)
    assert summary["status"] == "walltime" and summary["rows"] == []
