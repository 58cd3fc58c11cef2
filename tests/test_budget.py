"""`pdeformer budget`: the terms' constants, the sum at the check points, bad input.

A tiny budget (3 draws per case, L, H, N = 2, 4, 200, meshes of 4 to 8 cells a side,
attention summed directly): the numbers are rough, so the test checks the bookkeeping
against an independent recomputation from the sweeps' rows (budget.csv), not the
physics; the shipped budget (runs/studies/budget.toml) is measured in
docs/verification.md."""

from __future__ import annotations

import csv
import json
import math
import os

import numpy as np
import pytest

from conftest import ROOT, requires_dolfinx, run_cli

pytestmark = [requires_dolfinx]
BUDGET = os.path.join(ROOT, "runs", "studies", "budget.toml")
TINY = ["budget.seeds=3", "budget.groups=1", "budget.transformer=[2,4,200]", "budget.layers=[1,2]",
        "budget.layers_reference=4", "budget.heads=[2,8]", "budget.tokens=[50,200]", "budget.checks=[[1,8,100]]",
        "budget.cells=[[4,4],[6,6]]", "budget.cells_reference=[8,8]",
        "budget.set=[\"model.depth=\\\"smooth\\\"\",\"mesh.cells=[8,8]\",\"output.fields=false\","
        "\"particles.steps_per_layer=2\",\"discretisation.tail_tolerance=1\",\"attention.backend=\\\"direct\\\"\"]"]


def test_shipped_budget_loads():
    from pdeformer.commands.budget import load_budget
    b = load_budget(BUDGET)
    assert b["transformer"] == [8, 8, 1000] and b["degree"] == 1 and b["run_cells"] == [32, 32]


def test_budget_constants_and_sums_follow_from_the_sweeps(tmp_path):
    run_cli(["budget", BUDGET, "--set", *TINY, f"output.dir={tmp_path}/b"])
    with open(tmp_path / "b" / "budget.json") as f:
        out = json.load(f)
    with open(tmp_path / "b" / "budget.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    orders = {"depth": 2.0, "width": 0.5, "tokens": 0.5, "mesh": 2.0}      # DG-1: k + 1 = 2
    swept = {"depth": ["1", "2"], "width": ["2", "8"], "tokens": ["50", "200"], "mesh": ["[4, 4]", "[6, 6]"]}
    for term, p in orders.items():
        for q in ("mean", "cov"):
            sel = [r for r in rows if r["sweep"] == term and r["quantity"] == q]
            assert [r["value"] for r in sel] == swept[term] and all(r["seeds"] == "3" for r in sel)
            h = np.array([float(r["size"]) for r in sel])
            c = np.array([float(r["error"]) for r in sel]) / h ** p    # the mean of e / h^p
            assert out["terms"][term][q]["constant"] == pytest.approx(c.mean(), rel=1e-10)
            assert out["terms"][term][q]["low"] < c.mean() < out["terms"][term][q]["high"]
    checks = out["checks"]
    assert [c["point"] for c in checks] == [[2, 4, 200], [2, 4, 200], [1, 8, 100], [1, 8, 100]]
    for c in checks:
        L, H, N = c["point"]
        k = {t: out["terms"][t][c["quantity"]]["constant"] for t in orders}
        s = math.sqrt(4 / H)                   # depth and mesh scale like a draw's velocity
        parts = [k["depth"] / L ** 2 * s, k["width"] / math.sqrt(H), k["tokens"] / math.sqrt(N),
                 k["mesh"] / 8 ** 2 * s]
        assert c["sum"] == pytest.approx(sum(parts), rel=1e-12)
        assert c["rss"] == pytest.approx(math.sqrt(sum(x * x for x in parts)), rel=1e-12)
        assert c["low"] < c["measured"] < c["high"] and c["measured"] > 0
    with open(tmp_path / "b" / "budget.md") as f:
        text = f.read()
    assert "| width | mean |" in text and "tokens dominate width where N <" in text
    assert "depth dominates width where L <" in text
    with open(tmp_path / "b" / "summary.json") as f:
        assert json.load(f)["status"] == "completed"


@pytest.mark.parametrize("override, message", [
    ("budget.set=[]", "budget.set: the depth term needs heads smooth in depth"),
    ("budget.layers_reference=16", "budget.layers_reference: 16 is not above the depth sweep's 16 layers"),
    ("budget.cells_reference=[16,16]", "budget.cells_reference: [16, 16] is not finer than the mesh sweep"),
    ("budget.quantities=[\"l2\"]", "budget.quantities: expected a list of quantities from mean, cov"),
    ("budget.checks=[[4,16]]", "budget.checks: expected 3 positive integers"),
    ("budget.groups=64", "budget.groups: 64 groups for 32 seeds"),
])
def test_budget_errors(tmp_path, override, message):
    from conftest import check_one_line_error
    proc = run_cli(["budget", BUDGET, "--set", override, f"output.dir={tmp_path}/e"], check=False)
    check_one_line_error(proc, message)
