"""The costs the attention's choices are made from (pdeformer/attention/costs.py):
measured once per machine, cached, the same on every rank, pinned by PDEFORMER_COSTS;
and the choices follow them."""

import dataclasses
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from mpi4py import MPI

from pdeformer.attention import costs
from pdeformer.attention.laplace import LaplaceTable

from conftest import ROOT, check_one_line_error, requires_dolfinx, run_cli, write_config

PINNED = os.path.join(ROOT, "tests", "costs.json")


@pytest.fixture
def fresh(monkeypatch, tmp_path):
    """No pinned costs, an empty cache, and this process's costs forgotten (restored after)."""
    monkeypatch.delenv("PDEFORMER_COSTS", raising=False)
    monkeypatch.setenv("PDEFORMER_CACHE", str(tmp_path / "cache"))
    saved = list(costs._COSTS)
    costs.reset()
    yield tmp_path / "cache"
    costs.reset()
    costs._COSTS.extend(saved)


def test_measured_costs_are_seconds_of_this_machine(fresh):
    """Every field measured, positive and finite (compiled ones NaN only without the
    compiled loops). How they compare is the machine's (and its load's), not asserted."""
    c = costs.measure()
    values = dataclasses.asdict(c)
    compiled = costs.kernels() is not None
    for k, v in values.items():
        if k in ("spread", "spread_call", "fine_point") and not compiled:
            assert np.isnan(v), k
        else:
            assert np.isfinite(v) and 0 < v < 1, (k, v)


def test_costs_are_measured_once_and_cached(fresh, monkeypatch):
    first = costs.machine_costs()
    files = list(fresh.glob("costs-*.json"))
    assert len(files) == 1
    assert costs.Costs.from_dict(json.loads(files[0].read_text()), "x") == first
    costs.reset()
    monkeypatch.setattr(costs, "measure", lambda: pytest.fail("measured again"))
    assert costs.machine_costs() == first
    assert costs.machine_costs() is costs.machine_costs()


def test_pinned_costs_are_read(fresh, monkeypatch, tmp_path):
    data = json.load(open(PINNED))
    data["pair"] = 1.25e-9
    pinned = tmp_path / "pinned.json"
    pinned.write_text(json.dumps(data))
    monkeypatch.setenv("PDEFORMER_COSTS", str(pinned))
    monkeypatch.setattr(costs, "measure", lambda: pytest.fail("measured though pinned"))
    assert costs.machine_costs().pair == 1.25e-9


@pytest.mark.parametrize("content, words", [
    ("{", "not JSON"),
    ('{"flop": 1e-11}', "exactly the keys"),
    (json.dumps({f.name: -1.0 for f in dataclasses.fields(costs.Costs)}), "must be positive seconds"),
    (json.dumps({f.name: "fast" for f in dataclasses.fields(costs.Costs)}), "must be a number"),
])
def test_bad_pinned_costs_are_bad_input(fresh, monkeypatch, tmp_path, content, words):
    from pdeformer.tools.errors import InputError
    bad = tmp_path / "bad.json"
    bad.write_text(content)
    monkeypatch.setenv("PDEFORMER_COSTS", str(bad))
    with pytest.raises(InputError, match="PDEFORMER_COSTS") as e:
        costs.machine_costs()
    assert words in str(e.value) and str(bad) in str(e.value)


@requires_dolfinx
def test_bad_pinned_costs_end_the_run_with_one_line(tmp_path, monkeypatch):
    """Under mpirun: one line naming PDEFORMER_COSTS and the file, status 2, every rank ends."""
    bad = tmp_path / "costs.json"
    bad.write_text('{"flop": 1}')
    cfg = write_config(tmp_path, """
[mesh]
lower = [-2.0, -2.0]
upper = [2.0, 2.0]
cells = [4, 4]
[model]
layers = 1
heads = 1
[[prompts]]
kind = "gaussian_mixture"
means = [[0.0, 0.0]]
covs = [0.5]
""")
    monkeypatch.setenv("PDEFORMER_COSTS", str(bad))
    proc = run_cli(["forward", cfg], nprocs=2, check=False)
    check_one_line_error(proc, f"PDEFORMER_COSTS: {bad}: expected a JSON object with exactly the keys")


RANKS_SCRIPT = """
import json, os, sys
from mpi4py import MPI
from pdeformer.attention import costs
rank = MPI.COMM_WORLD.rank
os.environ["PDEFORMER_CACHE"] = sys.argv[1] + f"/rank{rank}"
os.makedirs(os.environ["PDEFORMER_CACHE"], exist_ok=True)
data = json.load(open(sys.argv[2]))
data["pair"] = 1e-9 * (rank + 1)                 # each rank's cache says something else
open(os.environ["PDEFORMER_CACHE"] + f"/costs-{costs.machine_key()}.json", "w").write(json.dumps(data))
got = MPI.COMM_WORLD.allgather(costs.machine_costs(MPI.COMM_WORLD).pair)
print(json.dumps(got) if rank == 0 else "", flush=True)
"""


def test_only_the_compiled_loops_costs_may_be_missing():
    """NaN stands for 'no compiled loops' in spread, spread_call and fine_point only: a
    NaN flop or pair would silently turn every comparison False."""
    data = json.load(open(PINNED))
    assert costs.Costs.from_dict({**data, "spread": float("nan")}, "f").compiled is False
    for key in ("flop", "pair", "dense_node"):
        with pytest.raises(ValueError, match=f"f: {key} must be positive"):
            costs.Costs.from_dict({**data, key: float("nan")}, "f")


def test_a_failure_on_rank_zero_is_raised_everywhere(fresh, monkeypatch):
    """Whatever stops rank 0 while it measures reaches every rank (here: one rank)."""
    monkeypatch.setattr(costs, "cache_dir", lambda: (_ for _ in ()).throw(RuntimeError("no home")))
    with pytest.raises(RuntimeError, match="measuring the attention costs failed on rank 0: RuntimeError: no home"):
        costs.machine_costs(MPI.COMM_WORLD)


@pytest.mark.mpi
def test_every_rank_takes_rank_zeros_costs(tmp_path):
    from pdeformer.tools.parallel import mpirun_command
    script = tmp_path / "ranks.py"
    script.write_text(RANKS_SCRIPT)
    env = {k: v for k, v in os.environ.items() if k != "PDEFORMER_COSTS"}
    proc = subprocess.run(mpirun_command(3) + [sys.executable, str(script), str(tmp_path), PINNED],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == [1e-9] * 3


def _pinned(**changes) -> costs.Costs:
    """The pinned costs with ``changes``."""
    return dataclasses.replace(costs.Costs.from_dict(json.load(open(PINNED)), PINNED), **changes)


def test_tiles_are_summed_the_cheaper_way():
    """A table's tiles go through the panel nodes when the spread is cheap and are summed
    directly when it is dear; both give the same table (to rounding)."""
    rng = np.random.default_rng(3)
    y, w = rng.normal(size=(3000, 2)) * 0.7, rng.random(3000)
    tables = {}
    for name, spread in (("panels", 1e-12), ("dense", 1.0)):
        t = LaplaceTable(y, w, [-3.0, -3.0], [3.0, 3.0], 33, MPI.COMM_WORLD,
                         costs=_pinned(spread=spread, numpy_block=spread))
        tables[name] = t
        assert all((panels is not None) == (name == "panels") for _, panels in t.tile_data if t.layout.tiles)
    assert np.abs(tables["panels"].values - tables["dense"].values).max() <= 1e-12 * np.abs(tables["dense"].values).max()


def test_auto_takes_laplace_where_direct_costs_more():
    """The largest table worth building follows the costs: none when direct triples are
    nearly free, the largest size when they are dear."""
    from pdeformer.attention.softmax import attention_matrices
    from pdeformer.model.heads import HeadMeasure
    from pdeformer.model.velocity import AttentionVelocity
    from pdeformer.model.schema import AttentionOptions
    rng = np.random.default_rng(4)
    heads = HeadMeasure.random(1, 4, 2, 2, seed=1)
    x, y = rng.normal(size=(400, 2)), rng.normal(size=(2000, 2))
    A = attention_matrices(heads.Q[0], heads.K[0])
    sizes = {}
    for pair in (1e-15, 1.0):
        field = AttentionVelocity(x, heads, AttentionOptions(backend="auto"), MPI.COMM_WORLD,
                                  costs=_pinned(pair=pair))
        sizes[pair] = field.worthwhile_size(y, A, x, ("p", 0))
    assert sizes[1e-15] is None
    assert sizes[1.0] == 257
