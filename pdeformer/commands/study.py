"""A convergence study's file and the checks that its numbers can mean something.

:func:`load_study` reads and checks a study file (its keys: pdeformer.commands.converge);
:func:`prepare` makes the configurations of every member and case and of the reference,
refusing (one line, exit 2, before anything runs) seed keys that change nothing, and
references that answer another question: other prompts or model, a quantity they cannot
give, or not beyond the sweep. :func:`check_members_differ` is the check after the runs.
"""

from __future__ import annotations

import json
import math
import os

from ..model.config import input_files, load_config
from ..tools.keys import Key, check_table, integer, number, path, string
from ..tools.tomlfile import apply_override, parse_override, read_toml
from ..tools.errors import ConfigError


QUANTITIES = ("mean", "cov", "risk", "l2", "l1", "mmd", "gradient", "mean_bias", "cov_bias")
BIASES = ("mean_bias", "cov_bias")    # |E q - q_ref| over an ensemble (study_tables.bias_matrix)
REFERENCES = ("exact", "expectation", "finest", "run", "paired", "draw", "atoms")
DEFAULTS = {"forward": ["l2", "mean", "cov"], "particles": ["mean", "cov", "mmd"],
            "gradient": ["risk", "gradient"]}
STUDY = {
    "run": Key(path),
    "command": Key(string(("forward", "particles", "gradient")), "forward"),
    "parameter": Key(string()),
    "values": Key(lambda k, v: _values(k, v)),
    "reference": Key(string(REFERENCES), "finest"),
    "reference_run": Key(path, None),
    "reference_command": Key(string(("forward", "particles", "gradient")), "forward"),
    "reference_set": Key(lambda k, v: override_strings(k, v), []),
    "quantities": Key(lambda k, v: _quantities(k, v), None),
    "expected_order": Key(number(), None),
    "set": Key(lambda k, v: override_strings(k, v), []),
    "bandwidth": Key(lambda k, v: _bandwidth(k, v), 0.5),
    "seeds": Key(integer(1, 10**5), 1),
    "seed_keys": Key(lambda k, v: _seed_keys(k, v), None),
    "groups": Key(integer(1, 10**5), 1),
}


def _bandwidth(key, v):
    """The mmd kernel's bandwidth: a positive number in the range objective.bandwidth
    has (pdeformer.model.objectives.check_bandwidth: 1/bandwidth^2 a finite double)."""
    from ..model.objectives import check_bandwidth
    v = number(positive=True)(key, v)
    check_bandwidth(v, key=key)
    return v


def _values(key, v):
    if not isinstance(v, list) or len(v) < 2:
        raise ConfigError(key, "expected a list of at least two values")
    return v


def override_strings(key, v):
    if not isinstance(v, list) or not all(isinstance(x, str) and "=" in x for x in v):
        raise ConfigError(key, "expected a list of \"section.key=value\" strings")
    return v


# the seeds a member of an ensemble may redraw: what a run draws with each
SEED_KEYS = {"model.seed": "the heads", "particles.seed": "the tokens", "data.seed": "the data set",
             "data.teacher_seed": "the teacher"}
DEFAULT_SEED_KEYS = ["model.seed", "particles.seed"]


def _seed_keys(key, v):
    if not isinstance(v, list) or not v or not all(isinstance(x, str) for x in v):
        raise ConfigError(key, f"expected a list of seeds ({', '.join(SEED_KEYS)})")
    for x in v:
        if x not in SEED_KEYS:
            raise ConfigError(key, f"{x!r} is not a seed ({', '.join(SEED_KEYS)}): the members of an "
                              "ensemble are draws of one run, redrawn by its seeds")
    if len(set(v)) < len(v):
        raise ConfigError(key, f"a seed is named twice in {v}")
    return v


def unused_seed(key: str, cfg: dict, commands) -> str | None:
    """Why seed ``key`` changes nothing in runs of ``cfg`` by ``commands`` (None: it
    redraws something they use)."""
    model, data = cfg["model"], cfg["data"]
    if key == "model.seed":
        if model["params"] is not None:
            return "model.params is given: the heads are read, not drawn"
        if model["init"] == "teacher" and model["init_noise"] == 0:
            return "the heads are the teacher's (model.init = 'teacher', init_noise = 0)"
    elif key == "particles.seed":
        if "particles" not in commands:
            return f"command {' and '.join(sorted(commands))} draws no tokens"
        sampled = [t for p in cfg["prompts"] for t in (p, p.get("target") or {})   # mmd density targets
                   if t.get("kind") not in (None, "points", "moments")]           # are sampled too
        if not sampled:
            return "every prompt is a point cloud: its tokens are read, not drawn"
    elif key == "data.seed" and not data["count"]:
        return "no data set is drawn (data.count = 0)"
    elif key == "data.teacher_seed":
        if data["teacher_seed"] is None:
            return "no teacher is drawn (data.teacher_seed)"
        if cfg["objective"]["kind"] is None and model["init"] != "teacher":
            return "the teacher is not used (no objective, model.init is not 'teacher')"
    return None


def check_seed_keys(study: dict, base: dict) -> None:
    """The seeds an ensemble redraws: each one must change the run (one given in
    study.seed_keys that changes nothing is an error; of the default ones, those are
    left out), and at least one must: otherwise the members are one run repeated, with
    a spread of zero."""
    given = study.get("seed_keys_given", True)
    commands = {study["command"]} | ({study["reference_command"]}
                                     if study["reference"] in ("paired", "draw") else set())
    used, why = [], []
    for key in study["seed_keys"]:
        reason = unused_seed(key, base, commands)
        if reason is None:
            used.append(key)
        elif given:
            raise ConfigError("study.seed_keys", f"{key} changes nothing in these runs ({reason}): "
                              f"the members would repeat one run; leave it out")
        else:
            why.append(f"{key}: {reason}")
    if "data.seed" in used and study["reference"] in ("run", "draw"):
        raise ConfigError("study.seed_keys", f"data.seed redraws the prompts, but a reference = "
                          f"'{study['reference']}' is run once, for the prompts of one draw: leave "
                          "data.seed out, or use reference = 'paired' (each member's own)")
    if not used:
        raise ConfigError("study.seed_keys", f"no seed of {study['seed_keys']} changes the run ("
                          + "; ".join(why) + "): an ensemble needs a seed that redraws what the run "
                          f"uses ({', '.join(SEED_KEYS)})")
    study["seed_keys"] = used


def _quantities(key, v):
    if not isinstance(v, list) or not v:
        raise ConfigError(key, f"expected a list of quantities ({', '.join(QUANTITIES)})")
    for q in v:
        if q not in QUANTITIES:
            raise ConfigError(key, f"unknown quantity {q!r} (use {', '.join(QUANTITIES)})")
    return v


def read_study_file(filename: str, section: str, keys: dict, overrides=()) -> tuple[dict, str]:
    """The checked ``[section]`` table of a study-like file (with ``--set`` overrides) and
    its folder; ``run`` made absolute, ``output_dir`` ([output] dir, default
    output/<file name> beside the file) and ``<section>_file`` added."""
    raw = read_toml(filename, f"{section} file")
    base = os.path.dirname(os.path.abspath(filename))
    for text in overrides:
        apply_override(raw, *parse_override(text), os.getcwd(), base, lambda parts: parts == ("output", "dir"))
    for k in raw:
        if k not in (section, "output"):
            raise ConfigError(k, f"unknown section (a {section} file has [{section}] and [output])")
    table = check_table(section, raw.get(section, {}), keys)
    out = check_table("output", raw.get("output", {}), {"dir": Key(path, None)})
    stem = os.path.splitext(os.path.basename(filename))[0]
    table["run"] = os.path.normpath(os.path.join(base, table["run"]))
    table["output_dir"] = os.path.normpath(os.path.join(base, out["dir"] or os.path.join("output", stem)))
    table[f"{section}_file"] = os.path.abspath(filename)
    return table, base


def load_study(filename: str, overrides=()) -> dict:
    """Read and check a study file (the [study] and an optional [output] table)."""
    study, base = read_study_file(filename, "study", STUDY, overrides)
    if study["reference"] in ("run", "paired"):
        if study["reference_run"] is None:
            raise ConfigError("study.reference_run", f"missing (needed by reference = '{study['reference']}')")
        study["reference_run"] = os.path.normpath(os.path.join(base, study["reference_run"]))
    elif study["reference"] == "draw":
        if study["reference_run"] is not None:
            raise ConfigError("study.reference_run", "a 'draw' reference is the study's own run "
                              "(with reference_set): leave reference_run out")
        study["reference_run"] = study["run"]
        study["reference_command"] = study["command"]
    study["quantities"] = study["quantities"] or DEFAULTS[study["command"]]
    study["seed_keys_given"] = study["seed_keys"] is not None
    study["seed_keys"] = study["seed_keys"] or list(DEFAULT_SEED_KEYS)
    if study["parameter"] in study["seed_keys"]:
        raise ConfigError("study.seed_keys", f"{study['parameter']!r} is the swept parameter: an "
                          "ensemble would set it again in every case")
    if study["groups"] > study["seeds"]:
        raise ConfigError("study.groups", f"{study['groups']} groups for {study['seeds']} seed(s): "
                          "at most one group per member of the ensemble")
    allowed = {"forward": {"mean", "cov", "risk", "l2", "l1"},
               "particles": {"mean", "cov", "risk", "mmd", "gradient"},
               "gradient": {"mean", "cov", "risk", "gradient"}}[study["command"]] | set(BIASES)
    for q in study["quantities"]:
        if q not in allowed:
            raise ConfigError("study.quantities", f"{q!r} is not measured by command {study['command']!r}")
        if q in BIASES and study["seeds"] < 3:
            raise ConfigError("study.quantities", f"{q!r} is a mean over an ensemble: it needs "
                              f"study.seeds >= 3 (got {study['seeds']})")
    if study["reference"] in ("exact", "expectation"):
        for q in study["quantities"]:
            if q not in ("mean", "cov", "l2", "l1") + BIASES:
                raise ConfigError("study.quantities", f"{q!r} needs a reference run (reference = "
                                  f"{study['reference']!r} gives mean, cov, l2 and l1)")
    return study


# the parameters that refine a discretisation (their size falls as they refine)
REFINED = ("mesh.cells", "model.layers", "model.heads", "particles.tokens", "discretisation.cfl",
           "discretisation.steps_per_layer", "particles.steps_per_layer")


def size_of(parameter: str, value) -> float:
    """The discretisation size the observed order refers to."""
    if parameter == "mesh.cells":
        return 1.0 / float(value[0])
    if parameter in ("model.layers", "model.heads", "particles.tokens", "discretisation.steps_per_layer",
                     "particles.steps_per_layer"):
        return 1.0 / float(value)
    if parameter == "discretisation.degree":
        return math.nan       # errors per degree; an order in the degree means nothing
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return float(value)
    return math.nan


def member_sets(study: dict, base: dict, j: int) -> list[str]:
    """The overrides of ensemble member j: every seed key at its base value + j."""
    out = []
    for key in study["seed_keys"]:
        sec, name = key.split(".")
        value = base.get(sec, {}).get(name) if isinstance(base.get(sec), dict) else None
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError("study.seed_keys", f"{key!r} is not an integer seed of the run "
                              "configuration (e.g. model.seed, particles.seed, data.seed)")
        out.append(f"{key}={value + j}")
    return out


def prepare(study: dict) -> tuple[list, list | None, list]:
    """The configurations of a study: ``cfgs[j][i]`` of member j and case i, the
    reference's (None; one for all members; one per member where paired) and the seed
    overrides ``sets[j]`` of members 0..n (member n: the seeds of a drawn reference)."""
    param, values, n = study["parameter"], study["values"], study["seeds"]
    base = load_config(study["run"], study["set"])
    ensemble = n > 1 or study["reference"] in ("draw", "paired")
    if ensemble:
        check_seed_keys(study, base)
    sets = [member_sets(study, base, j) if ensemble else [] for j in range(n + 1)]
    cfgs = [[load_config(study["run"], study["set"] + [f"{param}={json.dumps(v)}"] + sets[j])
             for v in values] for j in range(n)]
    reference_cfgs = None
    if study["reference"] == "run":
        reference_cfgs = [load_config(study["reference_run"], study["reference_set"])]
    elif study["reference"] == "paired":
        reference_cfgs = [load_config(study["reference_run"], study["reference_set"] + sets[j])
                          for j in range(n)]
    elif study["reference"] == "draw":     # seeds base + n: no member uses them
        reference_cfgs = [load_config(study["run"], study["set"] + study["reference_set"] + sets[n])]
    elif study["reference"] == "atoms":
        reference_cfgs = [atoms_run(load_config(study["run"], study["set"] + study["reference_set"]))]
    check_measurable(study, cfgs[0][0], reference_cfgs[0] if reference_cfgs else None)
    if study["reference"] == "finest":
        check_finest_last(study)
    for j, ref in enumerate(reference_cfgs or ()):      # a paired reference: member j's
        check_reference(study, cfgs[j if study["reference"] == "paired" else 0][0], ref)
    return cfgs, reference_cfgs, sets


def atoms_run(cfg: dict) -> dict:
    """The run of a law of atoms with the atoms themselves as its heads, weighted by their
    weights: the exact H -> infinity limit of i.i.d. draws from them (reference = 'atoms')."""
    model = cfg["model"]
    if model["law"] != "atoms" or model["params"] is not None:
        raise ConfigError("study.reference", "'atoms' needs heads drawn from atoms (model.law = 'atoms')")
    model.update(params=model["atoms"], law="gaussian", atoms=None, heads=None)
    return cfg


def _reference_key(study: dict) -> str:
    """The key that says what the reference is: its run file, or for a drawn one its overrides."""
    return "study.reference_set" if study["reference"] == "draw" else "study.reference_run"


def check_measurable(study: dict, case: dict, ref: dict | None) -> None:
    """Every quantity can be measured on the cases and against the reference, before
    anything runs: risk and gradient need an [objective] (and a run reference with one),
    densities (l2, l1) a forward reference, the gradient a reference that computes one."""
    qs = study["quantities"]
    for q in ("risk", "gradient"):
        if q in qs and case["objective"]["kind"] is None:
            raise ConfigError("study.quantities", f"{q!r} needs an [objective] in the study's run")
        if q in qs and ref is not None and ref["objective"]["kind"] is None:
            raise ConfigError(_reference_key(study), f"{q!r} needs an [objective] in the reference run")
    if ref is None:
        return
    command = study["reference_command"]
    if any(q in qs for q in ("l2", "l1")) and command != "forward":
        raise ConfigError("study.reference_command", f"density errors (l2, l1) need a forward "
                          f"reference (reference_command = {command!r} gives tokens)")
    if "gradient" in qs and command == "forward":
        raise ConfigError("study.reference_command", "'gradient' needs a reference that computes one "
                          "(reference_command = 'gradient' or 'particles')")


def check_finest_last(study: dict) -> None:
    """With reference = 'finest' the last case is the reference: it must be finer than
    every other (the smallest size) where sizes are defined."""
    sizes = [size_of(study["parameter"], v) for v in study["values"]]
    if all(math.isfinite(x) for x in sizes) and not sizes[-1] < min(sizes[:-1]):
        raise ConfigError("study.values", f"the last value {json.dumps(study['values'][-1])} is the "
                          "reference (reference = 'finest'), but it is not finer than the others: "
                          "list the values from coarse to fine")


def _prompt_question(cfg: dict, targets: bool) -> list[dict]:
    """The prompts as a reference must share them (targets too where risks are compared)."""
    return [{k: v for k, v in p.items() if targets or k != "target"} for p in cfg["prompts"]]


def _free_keys(study: dict) -> set:
    """The keys in which a reference may differ from the cases: the swept parameter, a
    drawn reference's seeds, the atoms reference's heads (the atoms, where the cases
    draw from them)."""
    free = {study["parameter"]} | (set(study["seed_keys"]) if study["reference"] == "draw" else set())
    if study["reference"] == "atoms":
        free |= {f"model.{k}" for k in ("params", "law", "atoms", "heads", "seed")}
    return free


def check_reference(study: dict, case: dict, ref: dict) -> None:
    """A reference answers the study's question: the same prompts (names, kinds, values;
    with their targets, objective and held-out prompts where risks or gradients are
    compared), the same model (its layers and heads may be more: a finer one; a drawn
    reference's seeds differ) and, for the same command, the swept parameter beyond
    the sweep."""
    key = _reference_key(study)
    risks = any(q in study["quantities"] for q in ("risk", "gradient"))
    mine, theirs = _prompt_question(case, risks), _prompt_question(ref, risks)
    if mine != theirs:
        if len(mine) != len(theirs):
            what = f"{len(theirs)} prompt(s) against the study's {len(mine)}"
        else:
            i = next(i for i, (a, b) in enumerate(zip(mine, theirs)) if a != b)
            diff = sorted(k for k in set(mine[i]) | set(theirs[i]) if mine[i].get(k) != theirs[i].get(k))
            what = (f"prompt {i} ({mine[i]['name']!r} in the study, {theirs[i]['name']!r} in the "
                    f"reference) differs in {', '.join(diff)}")
        raise ConfigError(key, f"the reference's prompts are not the study's: {what}; errors against "
                          "it would compare different inputs")
    if risks:
        for section, name in (("objective", None), ("data", "test_fraction")):
            a, b = (c[section] if name is None else c[section][name] for c in (case, ref))
            if a != b:
                raise ConfigError(key, f"the reference's {section + ('.' + name if name else '')} is "
                                  "not the study's: its risks answer another question")
    param = study["parameter"]
    free = _free_keys(study)
    for name in sorted(set(case["model"]) | set(ref["model"])):
        mine, theirs = case["model"].get(name), ref["model"].get(name)
        if f"model.{name}" in free or mine == theirs:
            continue
        finer = f"model.{name}" in REFINED and None not in (mine, theirs) and theirs > mine
        if not finer:
            raise ConfigError(key, f"the reference's model.{name} = {json.dumps(theirs)} is not the "
                              f"study's ({json.dumps(mine)}): a reference is the same model, or finer")
    if study["reference_command"] != study["command"] or param not in REFINED:
        return
    section, name = param.split(".", 1)
    value = ref.get(section, {}).get(name) if isinstance(ref.get(section), dict) else None
    sizes = [size_of(param, v) for v in study["values"]]
    size = size_of(param, value) if value is not None else math.nan
    if math.isfinite(size) and all(math.isfinite(x) for x in sizes) and not size < min(sizes):
        raise ConfigError(key, f"the reference's {param} = {json.dumps(value)} is not beyond the "
                          f"sweep {json.dumps(study['values'])}: a reference must be finer than "
                          "every case")


def study_inputs(cfgs: list, reference_cfgs) -> list:
    """[(key, path)] of the files the runs of a study read, their configs among them
    (pdeformer.tools.outdir keeps them where they are)."""
    runs = [c for member in cfgs for c in member] + list(reference_cfgs or ())
    return sorted({kp for c in runs for kp in input_files(c)})


def describe_reference(study: dict) -> str:
    """What the study's errors are measured against, in words."""
    kind, n = study["reference"], study["seeds"]
    extra = f" with {', '.join(study['reference_set'])}" if study["reference_set"] else ""
    if kind == "exact":
        return "the exact solution of uniform attention (Q = 0): the prompt translated"
    if kind == "expectation":
        return ("the exact H -> infinity limit over the head law: under a centred gaussian law the "
                "mean-field velocity E[V] E[m_theta(x)] vanishes and the limit is the prompt itself; a "
                "law with means, or of atoms, moves a Gaussian prompt as its mean head (its weighted "
                "atoms) does, by the Gaussian moment ODE")
    if kind == "finest":
        return "the finest case" + (" of the same draw" if n > 1 else "")
    if kind == "atoms":
        return f"the atoms as weighted heads{extra}: the exact H -> infinity limit of i.i.d. draws from them"
    if kind in ("run", "paired"):
        rel = os.path.relpath(study["reference_run"], os.path.dirname(study["study_file"]))
        return f"the run `{rel}`{extra}, " + ("with each member's seeds" if kind == "paired" else "computed once")
    return f"an independent draw of the base run{extra}, its seeds base + {n} (no member uses them)"


def check_members_differ(study: dict, records: list, key: str = "study.seed_keys") -> None:
    """The members of an ensemble are independent draws: where two or more members gave
    the very same errors in every case and quantity, their seeds changed nothing, and
    the interval over them would be a spread of zero (ConfigError naming ``key``)."""
    errors = {}
    for r in records:
        errors.setdefault(r["member"], []).append((r["case"], r["quantity"], r["error"]))
    if len(errors) < 2:
        return
    seen = {}
    for j, errs in sorted(errors.items()):
        same = seen.setdefault(tuple(sorted(errs)), j)
        if same != j:
            raise ConfigError(key, f"members {same} and {j} gave the same errors in every "
                              f"case: their seeds ({', '.join(study['seed_keys'])}) change nothing in "
                              "these runs, so the ensemble is one run repeated")


def exact_reference(problem, cfg: dict, kind: str) -> list:
    """Per prompt (final mean, cov, prompt, shift) of the exact reference: uniform
    attention translates the prompt by the shift (``exact``); the H -> infinity limit of
    heads drawn from the model's law (``expectation``): a centred gaussian law's limit
    velocity E[V] E[m_theta] vanishes and leaves every Gaussian mixture where it is; with
    means, or from atoms, a Gaussian prompt follows the moment ODE of the mean head or of
    the weighted atoms (:mod:`pdeformer.model.exact`)."""
    from ..model.exact import gaussian_moments, mean_head_moments, uniform_attention_mean
    from ..model.heads import GAUSSIAN_MEANS, HeadMeasure
    from ..model.prompts import GaussianMixture
    model, beta = cfg["model"], cfg["attention"]["beta"]
    if kind == "exact" and not problem.heads.uniform():
        raise ConfigError("study.reference", "'exact' needs uniform attention (Q = 0: model.query_scale = 0)")
    if kind == "expectation" and (model["params"] is not None or model["init"] != "random"):
        raise ConfigError("study.reference", "'expectation' needs heads drawn from the model's law "
                          "(no model.params, model.init = 'random')")
    means = [model[k] for k in GAUSSIAN_MEANS]
    moved = kind == "expectation" and (model["law"] == "atoms" or any(a is not None for a in means))
    out = []
    for name, prompt in problem.prompts:
        if not isinstance(prompt, GaussianMixture) or (moved and len(prompt.weights) != 1):
            raise ConfigError("study.reference", f"{kind!r} needs {'Gaussian' if moved else 'Gaussian-mixture'} "
                              f"prompts ({name!r} is not)")
        m0, C0 = prompt.mean(), prompt.cov()
        if kind == "exact":
            m1, C1 = uniform_attention_mean(problem.heads, m0, 1.0), C0
        elif model["law"] == "atoms":
            atoms = HeadMeasure.load(model["atoms"], len(m0), model["layers"], key="model.atoms")
            m1, C1 = (a[-1] for a in gaussian_moments(atoms.Q, atoms.K, atoms.V, m0, C0, beta=beta,
                                                      weights=atoms.weights))
        else:
            m1, C1 = mean_head_moments(means, model["layers"], m0, C0, beta=beta) if moved else (m0, C0)
        if moved:   # the limit density itself, N(m1, C1), unmoved
            prompt, m0 = GaussianMixture([1.0], [m1], [C1]), m1
        out.append((m1, C1, prompt, m1 - m0))
    return out
