"""`pdeformer gradient` and `pdeformer train` end to end: serial vs 2 ranks, the first-order
decrease of the risk, restarts, atomic checkpoints, head point files, bad input."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest

from configs import CONFIG, history
from conftest import requires_dolfinx, run_cli, write_config
from conftest import check_one_line_error

pytestmark = [requires_dolfinx]


def summary(folder):
    with open(os.path.join(folder, "summary.json")) as f:
        return json.load(f)


@pytest.mark.mpi
def test_gradient_serial_and_two_ranks_agree(tmp_path):
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["gradient", cfg, "--set", "output.dir=s"], cwd=str(tmp_path))
    run_cli(["gradient", cfg, "--set", "output.dir=p"], nprocs=2, cwd=str(tmp_path))
    a, b = np.load(tmp_path / "s" / "gradient.npz"), np.load(tmp_path / "p" / "gradient.npz")
    for n in ("dQ", "dK", "dV"):
        assert a[n].shape == (2, 2, 2, 2)
        assert np.abs(a[n] - b[n]).max() < 1e-10, n
        assert np.abs(a[n]).max() > 1e-4           # not trivially zero
    sa, sb = summary(tmp_path / "s"), summary(tmp_path / "p")
    # rank-dependent summation order in the tables, amplified by the panels' e^(2 beta)
    assert abs(sa["risk"] - sb["risk"]) < 1e-10 and sb["ranks"] == 2
    assert sa["risk"] == pytest.approx(float(a["risk"]), rel=1e-15)
    assert sa["tape_bytes_per_rank"] > 0
    # forward with the same [objective] and step plan reports the same risk
    run_cli(["forward", cfg, "--set", "output.dir=f"], cwd=str(tmp_path))
    assert summary(tmp_path / "f")["objective"]["risk"] == pytest.approx(sa["risk"], rel=1e-12)


def test_risk_decrease_matches_first_order(tmp_path):
    """gd with a small step: R_k - R_{k+1} = lr L H |dR/dtheta|^2 (1 + O(lr)), and the
    risk falls every step."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["train", cfg, "--set", "train.lr=0.02", "train.steps=4"], cwd=str(tmp_path))
    h = history(tmp_path / "out")
    assert [r["step"] for r in h] == [0, 1, 2, 3, 4]
    L, H, lr = 2, 2, 0.02
    for r0, r1 in zip(h, h[1:]):
        drop, predicted = r0["risk"] - r1["risk"], lr * L * H * r0["grad_norm"] ** 2
        assert drop > 0
        assert abs(drop / predicted - 1) < 0.03, (drop, predicted)   # O(lr |Hess| / |grad|^2)
        assert r0["step_size"] == pytest.approx(lr * L * H)
        assert r0["displacement"] == pytest.approx(lr * L * H * r0["grad_norm"], rel=1e-12)


def test_restart_extends_and_repeats_the_history(tmp_path):
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["train", cfg, "--set", "output.dir=full", "train.optimizer=adam", "train.lr=0.01"], cwd=str(tmp_path))
    run_cli(["train", cfg, "--set", "output.dir=part", "train.optimizer=adam", "train.lr=0.01",
             "train.steps=3"], cwd=str(tmp_path))
    run_cli(["train", cfg, "--restart", "--set", "output.dir=part", "train.optimizer=adam",
             "train.lr=0.01"], cwd=str(tmp_path))
    full, part = history(tmp_path / "full"), history(tmp_path / "part")
    assert len(full) == len(part) == 6
    for a, b in zip(full, part):
        for k in ("step", "risk", "grad_norm", "displacement"):
            assert a[k] == b[k], (k, a, b)                 # bit for bit
    assert summary(tmp_path / "part")["restarted_at"] == 3
    # the params files and head points agree too; heads.pvd lists every output step
    from pdeformer.tools.output import read_pvd, read_vtu
    p_full, p_part = np.load(tmp_path / "full" / "params_0005.npz"), np.load(tmp_path / "part" / "params_0005.npz")
    assert all(np.array_equal(p_full[n], p_part[n]) for n in "QKV")
    frames = read_pvd(str(tmp_path / "part" / "heads.pvd"))
    assert [t for t, _ in frames] == [0, 1, 2, 3, 4, 5]
    pts = read_vtu(frames[-1][1])
    assert pts["points"].shape == (4, 3)                 # L x H heads
    np.testing.assert_array_equal(pts["point_data"]["V"], p_part["V"].reshape(4, -1))
    np.testing.assert_allclose(pts["points"][:, 0], [0.25, 0.25, 0.75, 0.75])   # layer centres


def test_restart_refusals(tmp_path):
    cfg = write_config(tmp_path, CONFIG)
    proc = run_cli(["train", cfg, "--restart"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "--restart: no checkpoint at")
    run_cli(["train", cfg, "--set", "train.steps=2"], cwd=str(tmp_path))
    proc = run_cli(["train", cfg, "--restart", "--set", "model.heads=3"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "was made for another problem (different model)")
    proc = run_cli(["train", cfg, "--restart", "--set", "prompts[1].means=[[0.0,0.0]]"],
                   cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "(different prompts)")


def _altered_checkpoint(src: str, dst: str, arrays: dict | None = None, meta: dict | None = None,
                        drop: tuple = ()) -> str:
    """A copy of checkpoint ``src`` with arrays replaced, metadata entries replaced (None:
    removed) and arrays dropped."""
    import json
    with np.load(src) as f:
        data = {k: np.array(f[k]) for k in f.files}
    m = json.loads(str(data["meta"]))
    for k, v in (meta or {}).items():
        if v is None:
            m.pop(k)
        else:
            m[k] = v
    data.update(arrays or {}, meta=np.array(json.dumps(m)))
    for k in drop:
        data.pop(k)
    np.savez(dst, **data)
    return dst


def rows(n: int) -> list[dict]:
    """A history of n steps as a training writes it (plain full-batch gd)."""
    return [{"step": k, "risk": 0.5 / (k + 1), "grad_norm": 1.0, "step_size": 0.2, "displacement": 0.01,
             "wall_time": 0.1 * k} for k in range(n)]


def test_restart_refuses_checkpoints_of_another_shape_or_without_metadata(tmp_path):
    """Wrong shapes (Q of one layer, Adam moments of another size), wrong kinds (a float
    step count, integer heads), non-finite heads, no fingerprint, a step that is not a count, a missing array: each an InputError naming
    the file and what is wrong; the checkpoint as written is read back."""
    from pdeformer.model.config import load_config
    from pdeformer.model.schema import options
    from pdeformer.tools.errors import InputError
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.solvers import train
    cfg = load_config(write_config(tmp_path, CONFIG))
    cfg["train"]["optimizer"] = "adam"
    heads = HeadMeasure.random(2, 2, 2, 2, seed=0)
    opt = train.make_optimizer(options(cfg).train, {"attention": heads.params})
    like = heads.params | opt.state()
    good = str(tmp_path / "checkpoint.npz")
    train.write_checkpoint(good, {"attention": heads.params}, opt, 4, rows(4), np.random.default_rng(0), cfg)
    assert train.read_checkpoint(good, cfg, like)["meta"]["step"] == 4
    bad = str(tmp_path / "bad.npz")
    cases = [
        (dict(arrays={"Q": heads.Q[0]}), "array 'Q' has shape (2, 2, 2), this run's is (2, 2, 2, 2)"),
        (dict(arrays={"adam_m_V": np.zeros((3, 2, 2, 2))}), "array 'adam_m_V' has shape (3, 2, 2, 2)"),
        (dict(arrays={"K": np.full_like(heads.K, np.nan)}), "array 'K' is not finite"),
        (dict(arrays={"adam_t": np.array(4.0)}), "array 'adam_t' is float64, this run's is int64"),
        (dict(arrays={"V": heads.V.astype(int)}), "array 'V' is int64, this run's is float64"),
        (dict(meta={"fingerprint": None}), "not a pdeformer checkpoint (its metadata has no dict 'fingerprint')"),
        (dict(meta={"step": "4"}), "not a pdeformer checkpoint (its metadata has no int 'step')"),
        (dict(meta={"step": -1}), "not a pdeformer checkpoint (step -1)"),
        (dict(drop=("adam_t",)), "no array 'adam_t'"),
        # damaged behind an intact fingerprint: the RNG state, the history's rows
        (dict(meta={"rng": {"bit_generator": "PCG64", "state": {"state": "x", "inc": 1}, "has_uint32": 0,
                            "uinteger": 0}}), "its RNG state is damaged"),
        (dict(meta={"rng": {"bit_generator": "MT19937", "state": {}}}), "its RNG state is damaged"),
        (dict(meta={"history": rows(3)}), "its history has 3 row(s) for 4 step(s)"),
        (dict(meta={"history": rows(2) + [{**rows(3)[2], "risk": "x"}] + rows(4)[3:]}), "history row 2 is damaged"),
        (dict(meta={"history": rows(2) + [{**rows(3)[2], "step": 7}] + rows(4)[3:]}), "history row 2 is damaged"),
        (dict(meta={"history": rows(3) + [{"step": 3}]}), "history row 3 is damaged"),
    ]
    for change, message in cases:
        _altered_checkpoint(good, bad, **change)
        with pytest.raises(InputError) as e:
            train.read_checkpoint(bad, cfg, like)
        assert str(e.value).startswith(f"--restart: {bad}: {message}"), (change, str(e.value))


def test_restart_from_a_checkpoint_of_one_layer_ends_with_one_line(tmp_path):
    """The hostile case: Q of one layer in the checkpoint is bad input (exit 2, one line),
    not broadcast into every layer."""
    cfg = write_config(tmp_path, CONFIG)
    run_cli(["train", cfg, "--set", "train.steps=2"], cwd=str(tmp_path))
    ckpt = next(tmp_path.glob("**/checkpoint.npz"))
    with np.load(ckpt) as f:
        q = np.array(f["Q"])
    _altered_checkpoint(str(ckpt), str(ckpt), arrays={"Q": q[0]})
    proc = run_cli(["train", cfg, "--restart"], cwd=str(tmp_path), check=False)
    check_one_line_error(proc, "array 'Q' has shape")


def test_checkpoint_write_is_atomic(tmp_path, monkeypatch):
    """A failure (a kill) during the write leaves the previous checkpoint readable."""
    from pdeformer.model.config import load_config
    from pdeformer.model.schema import options
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.solvers import train
    cfg = load_config(write_config(tmp_path, CONFIG))
    heads = HeadMeasure.random(2, 2, 2, 2, seed=0)
    opt = train.make_optimizer(options(cfg).train, {"attention": heads.params})
    rng = np.random.default_rng(0)
    path = str(tmp_path / "checkpoint.npz")
    train.write_checkpoint(path, {"attention": heads.params}, opt, 4, rows(4), rng, cfg)

    def killed(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(os, "fsync", killed)
    saved = heads.V.copy()
    heads.V += 1.0
    with pytest.raises(KeyboardInterrupt):
        train.write_checkpoint(path, {"attention": heads.params}, opt, 6, rows(6), rng, cfg)
    data = train.read_checkpoint(path, cfg)
    assert data["meta"]["step"] == 4
    assert np.array_equal(data["V"], saved)


@pytest.mark.parametrize("args, expected", [
    (["objective.kind=hinge"], "objective.kind: expected one of"),
    (["prompts[1].target={kind='uniform',lower=[0.0,0.0],upper=[1.0,1.0]}"],
     "prompts[1].target: a 'uniform' target does not fit objective.kind = 'moments'"),
    (["prompts[0].target.mean=[0.1,0.2,0.3]"], "prompts[0].target.mean: expected 2 numbers"),
    (["train.lr=0"], "train.lr: expected a positive number"),
    (["train.steps=-1"], "train.steps: expected an integer in 0.."),
    (["objective.kind=mmd"], "objective.bandwidth: missing"),
])
def test_training_bad_input(tmp_path, args, expected):
    cfg = write_config(tmp_path, CONFIG)
    check_one_line_error(run_cli(["train", cfg, "--set", *args], cwd=str(tmp_path), check=False), expected)


def test_target_missing(tmp_path):
    cfg = write_config(tmp_path, CONFIG.replace('target = { mean = [0.0, 0.5], cov = 0.3 }\n', ""))
    check_one_line_error(run_cli(["gradient", cfg], cwd=str(tmp_path), check=False),
                         "prompts[1].target: missing: objective.kind = 'moments' needs")


# ------------------------------------------------------------------ the shipped config, coarse

def read_risks(folder) -> list[float]:
    with open(os.path.join(folder, "history.csv")) as f:
        return [float(r["risk"]) for r in csv.DictReader(f)]


@pytest.mark.mpi
def test_the_shipped_config_trains_on_32x32_cells_on_2_ranks(tmp_path):
    """`mpirun -n 2 pdeformer train runs/default.toml --set mesh.cells=[32,32]
    train.steps=1` completes (no NaN adjoint at its first step), no step is past the
    stability limit, and the risk goes down."""
    out = tmp_path / "out"
    proc = run_cli(["train", "runs/default.toml", "--set", "mesh.cells=[32,32]", "train.steps=1",
                    f"output.dir={out}"], nprocs=2)
    assert "stability limit" not in proc.stderr + proc.stdout
    risks = read_risks(out)
    assert len(risks) == 2 and risks[0] > risks[1], risks


@pytest.mark.slow
def test_the_shipped_config_trains_on_every_coarse_mesh():
    """benchmarks/coarse_training.py in full (~16 minutes): 16^2-64^2 cells, DG-1 and
    DG-2, 1 and 2 ranks, 5 steps each: every run completes with the risk going down at
    every step, and the histories on 1 and 2 ranks agree to the 6 digits printed
    (docs/training.md)."""
    import subprocess
    import sys
    from conftest import ROOT
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "coarse_training.py")],
                          cwd=ROOT, capture_output=True, text=True, timeout=3600,
                          env=dict(os.environ))   # not this process's MPI variables (mpirun_command)
    assert proc.returncode == 0, proc.stderr
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in proc.stdout.splitlines()
            if line.startswith("| ") and line[2].isdigit()]
    assert len(rows) == 20, proc.stdout
    by_case = {}
    for cells, degree, ranks, status, risks, decreasing, _ in rows:
        assert status == "completed" and decreasing == "yes", (cells, degree, ranks, status, risks)
        by_case.setdefault((cells, degree), []).append(np.array(risks.split(", "), float))
    for (cells, degree), (one, two) in by_case.items():
        np.testing.assert_allclose(two, one, rtol=2e-6, err_msg=f"{cells}, DG-{degree}")


def test_checkpoints_of_other_objectives_keep_their_fingerprint(tmp_path):
    """Keys that only the interaction objective reads do not enter the fingerprint of
    other objectives (changing them does not stop a restart there). With kind =
    interaction they do (changing them is another problem)."""
    import json
    from pdeformer.model.config import load_config
    from pdeformer.model.schema import options
    from pdeformer.solvers.train import fingerprint
    cfg = load_config(write_config(tmp_path, CONFIG))
    before = {k: v for k, v in cfg["objective"].items() if k not in ("interaction", "softening")}
    assert fingerprint(cfg)["objective"] == json.dumps(before, sort_keys=True, default=str)
    inter = load_config(write_config(tmp_path, CONFIG), ["objective.kind=interaction"])
    other = load_config(write_config(tmp_path, CONFIG), ["objective.kind=interaction", "objective.softening=0.5"])
    assert "softening" in fingerprint(inter)["objective"]
    assert fingerprint(inter)["objective"] != fingerprint(other)["objective"]


def test_interaction_objective_from_a_config(tmp_path):
    """objective.kind = interaction end to end: the Eulerian gradient run and the particle
    gradient (2000 tokens) give the same risk to Monte Carlo accuracy (~1/sqrt(N) = 2%,
    plus the tokens' self-interaction W(0)/N = 5e-4), and finite gradients."""
    risks = []
    for command, extra in (("gradient", []), ("particles", ["--gradient"])):
        out = tmp_path / command
        run_cli([command, "runs/default.toml", *extra, "--set", f"output.dir={out}", "mesh.cells=[24,24]",
                 "model.layers=2", "objective.kind=interaction", "objective.width=0.7",
                 "particles.tokens=2000"])
        with open(out / "summary.json") as f:
            summary = json.load(f)
        risk = summary["risk"] if command == "gradient" else summary["objective"]["risk"]
        assert np.isfinite(summary["gradient_norm"]) and summary["gradient_norm"] > 0
        risks.append(risk)
    assert risks[1] == pytest.approx(risks[0], rel=0.06), risks
