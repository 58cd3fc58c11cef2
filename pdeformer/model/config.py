"""Run configuration: TOML file -> checked, resolved dictionary.

A run is described by a TOML file (see ``runs/default.toml`` and the README's tour).
:func:`load_config` reads it, applies ``--set section.key=value`` overrides
(:mod:`pdeformer.tools.tomlfile`), checks every key against
:data:`~pdeformer.model.schema.SCHEMA` (whose sections the components declare), then
the sections together (a mesh file or a built-in shape, the objective's targets, a data
set or [[prompts]], training steps), fills defaults and resolves paths relative to the
config file. The result is a plain nested ``dict`` that is written verbatim into
``summary.json``. Every problem is a :class:`~pdeformer.tools.errors.ConfigError` whose
message starts with the offending key (``mesh.cells: ...``). User strings are data
only: nothing here is evaluated.

Checks that need the mesh (the token dimension d of a mesh file, a prompt's shape)
happen later, where d is known, and name their key the same way.
"""

from __future__ import annotations

import os
from typing import Any

from ..integrator.schemes import AUTO, auto_scheme
from ..tools.datasets import (check_data, data_errors, data_set_given, draw_prompts, read_folder, split_prompts,
                              teacher_given)
from ..tools.errors import ConfigError
from ..tools.keys import REQUIRED, Key, check_table, petsc_options, typename, unknown_key
from ..tools.tomlfile import apply_override, parse_override, read_toml
from .geometry import check_mesh_table
from .heads import GAUSSIAN_MEANS
from .objectives import MOMENTS_TARGET_KEYS, OBJECTIVES
from .schema import NAME, PATH_KEYS, PROMPT_COMMON_KEYS, PROMPT_KINDS, SCHEMA, is_path_key, target_kinds

MAX_HEADS_TOTAL = 10**7
DEFAULT_TRAIN_STEPS = 20


def load_config(filename: str, overrides: list[str] = ()) -> dict:
    """Read, override, check and resolve a run configuration."""
    raw = read_toml(filename)
    base_dir = os.path.dirname(os.path.abspath(filename))
    for text in overrides:
        parts, value = parse_override(text)
        apply_override(raw, parts, value, os.getcwd(), base_dir, is_path_key)
    stem = os.path.splitext(os.path.basename(filename))[0]
    cfg = check_config(raw, base_dir, stem)
    cfg["config_file"] = os.path.abspath(filename)
    cfg["overrides"] = list(overrides)
    return cfg


def check_config(raw: dict, base_dir: str, stem: str = "run") -> dict:
    """Check ``raw`` (parsed TOML) against the schema; fill defaults, resolve paths."""
    cfg = _check_sections(raw)
    check_mesh_table(cfg["mesh"])
    data = cfg["data"]
    check_data(data, cfg["mesh"])
    cfg["prompts"] = _prompt_tables(raw, data, cfg["mesh"], base_dir)
    _check_model(cfg["model"], data)
    _check_objective(cfg["objective"], cfg["prompts"], cfg["mesh"], data)
    _check_train(cfg["train"], len(split_prompts(data, len(cfg["prompts"]))[0]))
    _fill_discretisation(cfg["discretisation"])
    if cfg["output"]["dir"] is None:
        cfg["output"]["dir"] = os.path.join("output", stem)
    _resolve_paths(cfg, base_dir)
    return cfg


def _check_sections(raw: dict) -> dict[str, Any]:
    """Every section of SCHEMA checked on its own (unknown sections refused)."""
    allowed = set(SCHEMA) | {"prompts"}
    for name in raw:
        if name not in allowed:
            raise unknown_key(name, allowed)
    cfg: dict[str, Any] = {}
    for name, keys in SCHEMA.items():
        table = raw.get(name, {})
        if not isinstance(table, dict):
            raise ConfigError(name, f"expected a table [{name}], got {typename(table)}")
        cfg[name] = petsc_options(name, table) if name == "petsc" else check_table(name, table, keys)
    return cfg


def _prompt_tables(raw: dict, data: dict, mesh: dict, base_dir: str) -> list[dict]:
    """The checked prompts: a data set's (drawn or read from a folder), or [[prompts]]."""
    if not data_set_given(data):
        return _check_prompts(raw.get("prompts", REQUIRED))
    if "prompts" in raw:
        key = "data.count" if data["count"] else "data.folder"
        raise ConfigError(key, "give either [[prompts]] tables or a data set ([data] count or "
                               "folder), not both")
    tables = draw_prompts(data, mesh) if data["count"] else read_folder(data, base_dir, NAME)
    with data_errors(data, tables):     # named by the data.* key that made them
        return _check_prompts(tables)


# ----------------------------------------------------------------------------------
# [[prompts]] and their targets


def _check_prompts(prompts) -> list[dict]:
    """The [[prompts]] tables, checked; their names unique."""
    if prompts is REQUIRED:
        raise ConfigError("prompts", "missing: give at least one [[prompts]] table")
    if not isinstance(prompts, list) or not prompts:
        raise ConfigError("prompts", "expected one or more [[prompts]] tables")
    checked = [_check_prompt(i, p) for i, p in enumerate(prompts)]
    seen = set()
    for i, p in enumerate(checked):
        if p["name"] in seen:
            raise ConfigError(f"prompts[{i}].name", f"{p['name']!r} is used twice")
        seen.add(p["name"])
    return checked


def _check_prompt(i: int, p) -> dict:
    """``prompts[i]``: the keys of its kind (PROMPT_KINDS), a name, a target."""
    prefix = f"prompts[{i}]"
    if not isinstance(p, dict):
        raise ConfigError(prefix, f"expected a table, got {typename(p)}")
    if "kind" not in p:
        raise ConfigError(f"{prefix}.kind", f"missing (required: {', '.join(PROMPT_KINDS)})")
    kind = PROMPT_COMMON_KEYS["kind"].check(f"{prefix}.kind", p["kind"])
    keys = {**PROMPT_COMMON_KEYS, **PROMPT_KINDS[kind].keys,
            "target": Key(_check_target, None, "the objective's target")}
    out = check_table(prefix, p, keys)
    if kind == "points":
        _check_point_source(prefix, out)
    if out["name"] is None:
        out["name"] = f"prompt{i}"
    return out


def _check_target(key: str, t) -> dict:
    """A prompt's target: {mean, cov} (moments) or a density/point cloud with a kind."""
    if not isinstance(t, dict):
        raise ConfigError(key, f"expected a table, e.g. {{ mean = [...], cov = [...] }}, got {typename(t)}")
    if "kind" not in t:
        out = check_table(key, t, MOMENTS_TARGET_KEYS)
        out["kind"] = "moments"
        return out
    kind_key = PROMPT_COMMON_KEYS["kind"]
    kind = kind_key.check(f"{key}.kind", t["kind"])
    out = check_table(key, t, {"kind": kind_key, **PROMPT_KINDS[kind].keys})
    if kind == "points":
        _check_point_source(key, out)
    return out


def _check_point_source(prefix: str, table: dict) -> None:
    """A point cloud comes from a file (path) or inline (points [, weights]), not both."""
    if (table["path"] is None) == (table["points"] is None):
        raise ConfigError(f"{prefix}.path", "give either path (a file) or points (inline), one of them")
    if table["weights"] is not None and table["points"] is None:
        raise ConfigError(f"{prefix}.weights", "inline weights go with inline points")


# ----------------------------------------------------------------------------------
# the sections together


def _check_objective(obj: dict, prompts: list, mesh: dict, data: dict | None = None) -> None:
    """The objective's own options and the prompts' targets (a drawn data set's come from
    its teacher, which gives moments)."""
    kind = obj["kind"]
    if kind is None:
        extra = [k for k in obj if obj[k] != SCHEMA["objective"][k].default and k != "kind"]
        if extra:
            raise ConfigError(f"objective.{extra[0]}", "given, but objective.kind is missing")
        return
    cls = OBJECTIVES[kind]
    cls.check_config(obj, mesh)
    want = target_kinds(cls.targets)
    if not want:
        return
    if data is not None and teacher_given(data):
        _check_teacher_targets(kind, want, prompts, data)
        return
    if data is not None and data["count"]:
        raise ConfigError("data.teacher", f"missing: objective.kind = {kind!r} needs targets, which "
                          "a drawn data set takes from a teacher (data.teacher or data.teacher_seed)")
    if data is not None and data["folder"] is not None:
        _check_folder_targets(kind, want, prompts)
    for i, p in enumerate(prompts):
        t = p["target"]
        if t is None:
            what = "{ mean = [...], cov = [...] }" if want == ("moments",) else \
                f"a target with kind = {' or '.join(repr(k) for k in want)}"
            raise ConfigError(f"prompts[{i}].target", f"missing: objective.kind = {kind!r} needs {what}")
        if t["kind"] not in want:
            raise ConfigError(f"prompts[{i}].target", f"a {t['kind']!r} target does not fit objective.kind = {kind!r}")


def _check_teacher_targets(kind: str, want: tuple, prompts: list, data: dict) -> None:
    """Targets from a teacher: moments, of densities, and no other targets given."""
    if "moments" not in want:
        raise ConfigError("objective.kind", f"a teacher gives moment targets; objective.kind = "
                          f"{kind!r} needs {' or '.join(repr(k) for k in want)} targets")
    teacher = f"data.{'teacher' if data['teacher'] is not None else 'teacher_seed'}"
    given = next((i for i, p in enumerate(prompts) if p["target"] is not None), None)
    if given is not None:
        where = ("data.folder", f"{prompts[given]['target']['path']}: a target file") \
            if data["folder"] is not None else (f"prompts[{given}].target", "given")
        raise ConfigError(where[0], f"{where[1]}, but the targets come from the teacher ({teacher})")
    cloud = next((p for p in prompts if p["kind"] == "points"), None)
    if cloud is not None:
        file = f" ({cloud['path']} has no 'density' array or column)" if data["folder"] is not None else ""
        raise ConfigError(teacher, f"prompt {cloud['name']!r} is a point cloud{file}: a teacher's targets "
                          "come from the mesh model, which needs densities")


def _check_folder_targets(kind: str, want: tuple, prompts: list) -> None:
    """A folder data set without a teacher: a fitting target file for every prompt."""
    for p in prompts:
        t = p["target"]
        if t is None and want == ("moments",):
            raise ConfigError("data.teacher", f"missing: objective.kind = {kind!r} needs moment targets, "
                              "which a folder data set takes from a teacher (data.teacher or data.teacher_seed)")
        if t is None:
            raise ConfigError("data.folder", f"prompt {p['name']!r} has no target file (targets/"
                              f"{os.path.basename(p['path'])}); objective.kind = {kind!r} needs one "
                              "per prompt, or a teacher (data.teacher or data.teacher_seed)")
        if t["kind"] not in want:
            raise ConfigError("data.folder", f"{t['path']}: a {t['kind']!r} target does not fit "
                              f"objective.kind = {kind!r}")


def _check_train(t: dict, train_prompts: int) -> None:
    """Steps from epochs (or the default 20), the batch against the training prompts,
    noise only with gd."""
    if t["epochs"] is not None:
        if t["steps"] is not None:
            raise ConfigError("train.epochs", "give either train.steps or train.epochs, not both")
        t["steps"] = t["epochs"] * batches_per_epoch(t["batch_size"], train_prompts)
    elif t["steps"] is None:
        t["steps"] = DEFAULT_TRAIN_STEPS
    if t["batch_size"] is not None and t["batch_size"] > train_prompts:
        raise ConfigError("train.batch_size", f"{t['batch_size']} is more than the {train_prompts} "
                                              "training prompt(s)")
    if t["optimizer"] == "gd" and t["lr"] * t["weight_decay"] >= 2:
        raise ConfigError("train.weight_decay", f"lr x weight_decay = {t['lr'] * t['weight_decay']:.3g} "
                          "is 2 or more: the decay step theta <- (1 - lr weight_decay) theta then grows "
                          "the heads instead of shrinking them; lower train.weight_decay or train.lr")
    if t["temperature"] > 0 and t["optimizer"] != "gd":
        raise ConfigError("train.temperature", "Langevin noise needs optimizer = 'gd' (the Euler-Maruyama "
                                               "step of the gradient flow)")


def batches_per_epoch(batch_size: int | None, train_prompts: int) -> int:
    """Minibatches of one pass over the training prompts (the last one may be smaller;
    ``batch_size`` None: one, the full batch)."""
    return -(-train_prompts // (batch_size or train_prompts))


def _check_model(m: dict, data: dict | None = None) -> None:
    """Heads from a file, drawn, or the teacher's; their count within MAX_HEADS_TOTAL."""
    if m["init"] == "teacher":
        if data is None or not teacher_given(data):
            raise ConfigError("model.init", "'teacher' needs a teacher (data.teacher or data.teacher_seed)")
        if m["params"] is not None:
            raise ConfigError("model.init", "give either model.params or init = 'teacher', not both")
    elif m["init_noise"] != 0.0:
        raise ConfigError("model.init_noise", "given, but model.init is not 'teacher'")
    _check_law(m)
    if m["params"] is None:
        for k in ("layers", "heads"):
            if m[k] is None:
                raise ConfigError(f"model.{k}", "missing: give model.layers and model.heads, or model.params")
        if m["layers"] * m["heads"] > MAX_HEADS_TOTAL:
            raise ConfigError("model.heads", f"layers x heads = {m['layers'] * m['heads']:.3g} is "
                                             f"more than pdeformer allows ({MAX_HEADS_TOTAL:g})")


def _check_law(m: dict) -> None:
    """The law random heads are drawn from: its own keys only, and none where the heads
    are read (model.params) or the teacher's."""
    atoms = m["law"] == "atoms"
    if atoms and m["atoms"] is None:
        raise ConfigError("model.atoms", "missing: law = 'atoms' draws the heads from the atoms of this file")
    given = [k for k in ("atoms",) + GAUSSIAN_MEANS if m[k] is not None]
    for k in given:
        if (k == "atoms") != atoms:
            raise ConfigError(f"model.{k}", f"given, but model.law is {m['law']!r}")
    if (atoms or given) and (m["params"] is not None or m["init"] == "teacher"):
        raise ConfigError(f"model.{given[0] if given else 'law'}",
                          "the heads are read (model.params) or the teacher's, not drawn from a law")


def _fill_discretisation(disc: dict) -> None:
    """Defaults that follow the degree k: velocity and quadrature degrees, the scheme."""
    k = disc["degree"]
    if disc["velocity_degree"] is None:
        disc["velocity_degree"] = k
    if disc["quadrature_degree"] is None:
        disc["quadrature_degree"] = k
    if disc["prompt_quadrature_degree"] is None:
        disc["prompt_quadrature_degree"] = 2 * k + 4
    if disc["scheme"] == AUTO:
        disc["scheme"] = auto_scheme(k)


# ----------------------------------------------------------------------------------
# paths


def _resolve_paths(cfg: dict, base_dir: str) -> None:
    """Paths in the config relative to ``base_dir`` (the config file's folder)."""
    for section, key in PATH_KEYS:
        if cfg[section][key] is not None:
            cfg[section][key] = os.path.normpath(os.path.join(base_dir, cfg[section][key]))
    for p in cfg["prompts"]:
        for table in (p, p["target"] or {}):
            if table.get("kind") in ("file", "points") and table["path"] is not None:
                table["path"] = os.path.normpath(os.path.join(base_dir, table["path"]))


def input_files(cfg: dict) -> list[tuple[str, str]]:
    """[(key, path)] of every file a run of a checked config reads: the config itself,
    the pinned costs, the mesh (and its HDF5 data), heads, teacher, prompt and target
    files."""
    out = [("the config file", cfg["config_file"])] if cfg.get("config_file") else []
    if os.environ.get("PDEFORMER_COSTS"):
        out.append(("PDEFORMER_COSTS", os.environ["PDEFORMER_COSTS"]))
    mesh = cfg["mesh"]["file"]
    if mesh is not None:
        out += [("mesh.file", mesh), ("mesh.file", os.path.splitext(mesh)[0] + ".h5")]
    out += [(f"{s}.{k}", cfg[s][k]) for s, k in (("model", "params"), ("data", "teacher"))
            if cfg[s][k] is not None]
    folder = cfg["data"]["folder"] is not None
    for i, p in enumerate(cfg["prompts"]):
        for key, table in ((f"prompts[{i}]", p), (f"prompts[{i}].target", p.get("target") or {})):
            if table.get("path") is not None:
                out.append(("data.folder" if folder else f"{key}.path", table["path"]))
    return out
