"""Prompt data sets ([data]): drawn from their seed alone, checked like [[prompts]],
targets from a teacher equal to the teacher's own forward output, the same on 1 and 2
ranks and with prompt groups, bad input as one line."""

from __future__ import annotations

import json

import numpy as np
import pytest

from conftest import check_one_line_error, requires_dolfinx, run_cli, write_config
from pdeformer.model.config import check_config
from pdeformer.tools.errors import ConfigError

BOX = {"lower": [-3.0, -3.0], "upper": [3.0, 3.0], "cells": [16, 16]}


def raw(data, mesh=None, objective="moments", **extra):
    cfg = {"mesh": dict(mesh or BOX), "model": {"layers": 2, "heads": 2, "seed": 1},
           "discretisation": {"steps_per_layer": 4}, "data": data, **extra}
    if objective:
        cfg["objective"] = {"kind": objective}
    return cfg


def test_a_data_set_depends_on_its_seed_alone_and_keeps_to_its_ranges():
    """S prompts data0000.. drawn in order from the seed: the same tables every time, others
    for another seed; components, means and standard deviations within their ranges; on
    the sphere von Mises-Fisher mixtures with unit mean directions."""
    data = {"count": 40, "seed": 5, "components": [2, 4], "mean_range": [-1.5, 0.5],
            "std_range": [0.2, 0.4], "teacher_seed": 1}
    a, b = check_config(raw(data), "."), check_config(raw(data), ".")
    assert a["prompts"] == b["prompts"]
    assert [p["name"] for p in a["prompts"]] == [f"data{i:04d}" for i in range(40)]
    other = check_config(raw(dict(data, seed=6)), ".")
    assert other["prompts"] != a["prompts"]
    counts = [len(p["means"]) for p in a["prompts"]]
    assert set(counts) == {2, 3, 4}                      # every count in [2, 4] drawn (40 draws)
    means = np.concatenate([np.asarray(p["means"]) for p in a["prompts"]])
    stds = np.sqrt(np.concatenate([p["covs"] for p in a["prompts"]]))
    assert means.min() >= -1.5 and means.max() <= 0.5 and stds.min() >= 0.2 and stds.max() <= 0.4
    sphere = check_config(raw({"count": 5, "family": "von_mises_fisher", "concentration_range": [3.0, 4.0],
                               "teacher_seed": 2},
                              mesh={"shape": "sphere", "refinements": 2}), ".")
    for p in sphere["prompts"]:
        assert p["kind"] == "von_mises_fisher" and np.allclose(np.linalg.norm(p["means"], axis=1), 1)
        assert all(3.0 <= k <= 4.0 for k in p["concentrations"])


@pytest.mark.parametrize("data, extra, message", [
    ({"count": 3}, {"prompts": [{"kind": "uniform"}]}, "data.count: give either [[prompts]] tables or a data set"),
    ({"count": 3, "family": "von_mises_fisher"}, {}, "data.family: 'von_mises_fisher' does not fit a box mesh"),
    ({"count": 3, "teacher": "t.npz", "teacher_seed": 2}, {}, "data.teacher_seed: give either data.teacher"),
    ({"count": 0, "teacher_seed": 2}, {}, "prompts[0].target: given, but the targets come from the teacher"),
    ({"count": 3, "std_range": [0.5, 0.2]}, {}, "data.std_range: expected [lo, hi] with 0 < lo <= hi"),
    ({"count": 3, "components": [0, 2]}, {}, "data.components: expected positive integers"),
    ({"count": 3, "components": [3, 2]}, {}, "data.components: expected [min, max] with 1 <= min <= max"),
    ({"count": 3, "teacher_seed": 2}, {"objective_kind": "l2"}, "objective.kind: a teacher gives moment targets"),
    ({"count": 3}, {}, "data.teacher: missing: objective.kind = 'moments' needs targets"),
    ({"count": 0}, {"model_init": {"init": "teacher"}}, "model.init: 'teacher' needs a teacher"),
    ({"count": 3, "teacher_seed": 2}, {"model_init": {"init_noise": 0.1}}, "model.init_noise: given, but model.init is not 'teacher'"),
    ({"count": 3, "teacher_seed": 2}, {"model_init": {"init": "teacher", "params": "p.npz"}},
     "model.init: give either model.params or init = 'teacher'"),
])
def test_bad_data_sets_are_one_line_errors(data, extra, message):
    cfg = raw(data, objective=extra.pop("objective_kind", "moments"), **extra)
    cfg["model"].update(cfg.pop("model_init", {}))
    if data["count"] == 0:
        cfg["prompts"] = [{"kind": "uniform", "target": {"mean": [0.0, 0.0], "cov": 1.0}}]
    with pytest.raises(ConfigError) as e:
        check_config(cfg, ".")
    assert str(e.value).startswith(message), str(e.value)


def test_a_data_set_needs_a_built_in_mesh():
    with pytest.raises(ConfigError, match="^data.count: a generated data set needs a built-in mesh"):
        check_config(raw({"count": 2, "teacher_seed": 1}, mesh={"file": "m.xdmf"}), ".")


CONFIG = """
[mesh]
lower = [-4.0, -4.0]
upper = [4.0, 4.0]
cells = [16, 16]

[discretisation]
steps_per_layer = 8
limiter = false

[model]
layers = 2
heads = 2
seed = 1
init_scale = 0.7

[data]
count = 2
seed = 3
teacher_seed = 9

[objective]
kind = "moments"
"""


@requires_dolfinx
def test_teacher_targets_are_the_teacher_s_output(tmp_path):
    """The targets are the moments of the teacher's forward output: a forward run with the
    teacher's heads ends at them (its diagnostics), a student with the teacher's heads has
    risk zero, and a teacher given as a heads file is the same teacher as one given by
    its seed (the same risk for another student)."""
    from mpi4py import MPI
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.solvers.problem import build_problem
    from pdeformer.model.config import load_config
    cfg = write_config(tmp_path, CONFIG)
    problem = build_problem(load_config(cfg), MPI.COMM_WORLD, differentiable=True)
    run_cli(["forward", cfg, "--set", "model.seed=9", "output.dir=teacher", "output.fields=false"], cwd=str(tmp_path))
    final = json.loads((tmp_path / "teacher" / "summary.json").read_text())["final_diagnostics"]
    assert len(final) == len(problem.targets) == 2
    for target, diag in zip(problem.targets, final):
        np.testing.assert_allclose(target["mean"], diag["mean"], rtol=0, atol=1e-12)
        np.testing.assert_allclose(target["cov"], diag["cov"], rtol=0, atol=1e-12)
    risk = {}
    for name, seed in (("same", 9), ("student", 1)):
        run_cli(["gradient", cfg, "--set", f"model.seed={seed}", f"output.dir={name}"], cwd=str(tmp_path))
        risk[name] = json.loads((tmp_path / name / "summary.json").read_text())["risk"]
    assert risk["same"] < 1e-25 and risk["student"] > 1e-4, risk
    HeadMeasure.random(2, 2, 2, 2, seed=9, scale=0.7).save(str(tmp_path / "teacher.npz"))
    byfile = write_config(tmp_path, CONFIG.replace("teacher_seed = 9", 'teacher = "teacher.npz"'), "file.toml")
    run_cli(["gradient", byfile, "--set", "output.dir=byfile"], cwd=str(tmp_path))
    assert json.loads((tmp_path / "byfile" / "summary.json").read_text())["risk"] == pytest.approx(risk["student"], rel=1e-12)


@requires_dolfinx
@pytest.mark.mpi
def test_data_set_and_teacher_targets_on_two_ranks_and_prompt_groups(tmp_path):
    """The same data set, targets, risk and gradient on 1 rank, 2 ranks and 2 ranks in 2
    prompt groups (each group runs the teacher on its prompts), to 1e-10, for a student
    near the teacher (model.init = "teacher", init_noise 0.05: the noise is drawn alike
    on every rank)."""
    cfg = write_config(tmp_path, CONFIG)
    near = ['model.init="teacher"', "model.init_noise=0.05"]
    for name, nprocs, extra in (("serial", 1, []), ("two", 2, []), ("groups", 2, ["parallel.prompt_groups=2"])):
        run_cli(["gradient", cfg, "--set", f"output.dir={name}", *near, *extra], nprocs=nprocs, cwd=str(tmp_path))
    ref = json.loads((tmp_path / "serial" / "summary.json").read_text())
    g_ref = np.load(tmp_path / "serial" / "gradient.npz")
    for name in ("two", "groups"):
        out = json.loads((tmp_path / name / "summary.json").read_text())
        assert out["config"]["prompts"] == ref["config"]["prompts"]
        assert abs(out["risk"] - ref["risk"]) <= 1e-10 * ref["risk"], (name, out["risk"], ref["risk"])
        g = np.load(tmp_path / name / "gradient.npz")
        for k in g_ref.files:
            np.testing.assert_allclose(g[k], g_ref[k], rtol=0, atol=1e-10 * np.abs(g_ref[k]).max())


@requires_dolfinx
def test_training_on_a_data_set_restarts_and_refuses_another_teacher(tmp_path):
    """train on a drawn data set: a restart continues the uninterrupted history bit for
    bit; a checkpoint is refused for another teacher (one line naming data)."""
    cfg = write_config(tmp_path, CONFIG + "\n[train]\nsteps = 3\nlr = 0.05\ncheckpoint_every = 1\n")
    run_cli(["train", cfg, "--set", "output.dir=whole"], cwd=str(tmp_path))
    run_cli(["train", cfg, "--set", "output.dir=cut", "train.steps=2"], cwd=str(tmp_path))
    run_cli(["train", cfg, "--set", "output.dir=cut", "--restart"], cwd=str(tmp_path))
    whole = (tmp_path / "whole" / "history.csv").read_text().splitlines()
    cut = (tmp_path / "cut" / "history.csv").read_text().splitlines()
    strip = lambda rows: [r.rsplit(",", 1)[0] for r in rows]       # without wall_time
    assert strip(whole) == strip(cut)
    proc = run_cli(["train", cfg, "--set", "output.dir=cut", "--restart", "data.teacher_seed=10"],
                   cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "data")


@requires_dolfinx
def test_a_student_near_the_teacher(tmp_path):
    """[model] init = "teacher": with no noise the student is the teacher (risk zero); with
    init_noise 0.05 its risk is small next to a random student's (the same on 2 ranks:
    test_data_set_and_teacher_targets_on_two_ranks_and_prompt_groups); a teacher of
    other sizes is refused in one line."""
    cfg = write_config(tmp_path, CONFIG)
    risk = {}
    for name, extra in (("exact", ['model.init="teacher"']),
                        ("near", ['model.init="teacher"', "model.init_noise=0.05"]),
                        ("random", [])):
        run_cli(["gradient", cfg, "--set", f"output.dir={name}", *extra], cwd=str(tmp_path))
        risk[name] = json.loads((tmp_path / name / "summary.json").read_text())["risk"]
    assert risk["exact"] < 1e-25 and 0 < risk["near"] < 0.1 * risk["random"], risk
    from pdeformer.model.heads import HeadMeasure
    HeadMeasure.random(2, 3, 2, 2, seed=9, scale=0.7).save(str(tmp_path / "three.npz"))   # 3 heads
    other = write_config(tmp_path, CONFIG.replace("teacher_seed = 9", 'teacher = "three.npz"'), "three.toml")
    proc = run_cli(["gradient", other, "--set", "output.dir=bad", 'model.init="teacher"'],
                   cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "model.init: the teacher's Q has shape (2, 3, 2, 2), the model's (2, 2, 2, 2)")
