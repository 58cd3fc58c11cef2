"""Keys of a TOML table: what each accepts, its default, its type; checking a table.

A component declares its options beside its code as a table ``{name: Key(check,
default, doc)}``; the run configuration (:mod:`pdeformer.model.schema`) assembles the
tables into sections, and study files declare theirs the same way. A check is a
function ``(key, value) -> normalised value`` that raises a
:class:`~pdeformer.tools.errors.ConfigError` whose message starts with ``key``
(``mesh.cells: ...``). The checks made here carry the Python type of what they return
(``check.type``); :func:`options_class` turns a table into a frozen dataclass whose
fields have those types and the keys' defaults. User strings are data only: nothing
here is evaluated.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import functools
import math
import re
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from .errors import ConfigError

REQUIRED = object()   # the default of a key that must be given


def typename(value) -> str:
    """``value``'s TOML type in words (for 'expected ..., got <typename>')."""
    return {bool: "a boolean", int: "an integer", float: "a number", str: "a string",
            list: "a list", dict: "a table"}.get(type(value), type(value).__name__)


def returns(kind) -> Callable:
    """Mark a check with the type of the values it returns (``check.type``)."""
    def mark(check: Callable) -> Callable:
        check.type = kind
        return check
    return mark


# ----------------------------------------------------------------------------------
# checks: (key, value) -> normalised value, or ConfigError naming key


def integer(lo: int | None = None, hi: int | None = None) -> Callable:
    """An integer (not a boolean) in lo..hi."""
    @returns(int)
    def check(key, v):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(key, f"expected an integer, got {typename(v)} ({v!r})")
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f">= {lo}" if hi is None else f"in {lo}..{hi}"
            raise ConfigError(key, f"expected an integer {rng}, got {v}")
        return v
    return check


def number(positive: bool = False, nonnegative: bool = False, hi: float | None = None,
           lo: float | None = None, why: str = "") -> Callable:
    """A finite number (optionally positive, nonnegative, in [lo, hi]) as a float; ``why``
    is added to a range error."""
    @returns(float)
    def check(key, v):
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise ConfigError(key, f"expected a number, got {typename(v)} ({v!r})")
        try:
            v = float(v)
        except OverflowError:
            raise ConfigError(key, "number too large") from None
        if not math.isfinite(v):
            raise ConfigError(key, f"expected a finite number, got {v}")
        if positive and v <= 0:
            raise ConfigError(key, f"expected a positive number, got {v}")
        if nonnegative and v < 0:
            raise ConfigError(key, f"expected a non-negative number, got {v}")
        if lo is not None and v < lo or hi is not None and v > hi:
            rng = f">= {lo:g}" if hi is None else f"<= {hi:g}" if lo is None else f"in [{lo:g}, {hi:g}]"
            raise ConfigError(key, f"expected a number {rng}, got {v:g}{why}")
        return v
    return check


@returns(bool)
def boolean(key, v):
    if not isinstance(v, bool):
        raise ConfigError(key, f"expected true or false, got {typename(v)} ({v!r})")
    return v


def string(choices=None, pattern: str | None = None) -> Callable:
    """A string, one of ``choices`` (a tuple, or a function giving it when checked: the
    names of a registry that fills after the key is declared) or matching ``pattern``."""
    @returns(str)
    def check(key, v):
        if not isinstance(v, str):
            raise ConfigError(key, f"expected a string, got {typename(v)} ({v!r})")
        allowed = choices() if callable(choices) else choices
        if allowed is not None and v not in allowed:
            raise ConfigError(key, f"expected one of {', '.join(map(repr, allowed))}, got {v!r}")
        if pattern is not None and not re.fullmatch(pattern, v):
            raise ConfigError(key, f"{v!r} is not allowed (1 to 64 letters, digits, '_' or '-')")
        return v
    return check


@returns(str)
def path(key, v):
    """A file path (resolved against the config's folder by whoever reads the table)."""
    if not isinstance(v, str) or not v or "\0" in v:
        raise ConfigError(key, f"expected a file path (string), got {typename(v)} ({v!r})")
    return v


def number_list(length: tuple[int, int] = (1, 3)) -> Callable:
    """A list of finite numbers whose length lies in ``length``."""
    @returns(list[float])
    def check(key, v):
        if not isinstance(v, list) or not length[0] <= len(v) <= length[1]:
            n = f"{length[0]}" if length[0] == length[1] else f"{length[0]} to {length[1]}"
            raise ConfigError(key, f"expected a list of {n} numbers, got {v!r}")
        return [number()(f"{key}[{i}]", x) for i, x in enumerate(v)]
    return check


MAX_CELLS = 10**8


@returns(list[int])
def positive_int_list(key, v):
    """Cells per direction: 1 to 3 positive integers, at most MAX_CELLS cells in all."""
    if not isinstance(v, list) or not 1 <= len(v) <= 3:
        raise ConfigError(key, f"expected a list of 1 to 3 positive integers, got {v!r}")
    for x in v:
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ConfigError(key, f"expected positive integers, got {v!r}")
    if math.prod(v) > MAX_CELLS:
        raise ConfigError(key, f"{math.prod(v):.3g} cells is more than pdeformer allows ({MAX_CELLS:g})")
    return list(v)


@returns(list)
def array(key, v):
    """A nested list of numbers (shape checked later, once d is known)."""
    def walk(x, k):
        if isinstance(x, list):
            if not x:
                raise ConfigError(key, "expected numbers, got an empty list")
            return [walk(y, f"{k}[{i}]") for i, y in enumerate(x)]
        return number()(k, x)
    if not isinstance(v, list):
        raise ConfigError(key, f"expected a list, got {typename(v)} ({v!r})")
    return walk(v, key)


@returns(float | list)
def array_or_number(key, v):
    return number()(key, v) if not isinstance(v, list) else array(key, v)


@returns(dict[str, str])
def petsc_options(key, v):
    """A table of PETSc options, every value as the string PETSc reads."""
    if not isinstance(v, dict):
        raise ConfigError(key, f"expected a table of PETSc options, got {typename(v)}")
    out = {}
    for k, x in v.items():
        if not re.fullmatch(r"[A-Za-z][A-Za-z0-9_]*", k):
            raise ConfigError(f"{key}.{k}", "not a PETSc option name")
        if isinstance(x, bool):
            x = "true" if x else "false"
        elif isinstance(x, (int, float, str)):
            x = str(x)
        else:
            raise ConfigError(f"{key}.{k}", f"expected a string, number or boolean, got {typename(x)}")
        out[k] = x
    return out


# ----------------------------------------------------------------------------------
# keys and tables


@dataclass(frozen=True)
class Key:
    """One key of a table: its check, default (REQUIRED: none) and meaning."""

    check: Callable
    default: Any = REQUIRED
    doc: str = ""

    @property
    def type(self):
        """The type of its checked values (``T | None`` where the default is None; Any
        for a check that does not say)."""
        kind = getattr(self.check, "type", Any)
        return kind | None if self.default is None else kind


def unknown_key(key: str, allowed) -> ConfigError:
    """The error of an unknown ``key``, with the nearest allowed name (or all of them)."""
    name = key.rsplit(".", 1)[-1]
    near = difflib.get_close_matches(name, list(allowed), n=1)
    hint = f" (did you mean {near[0]!r}?)" if near else f" (allowed: {', '.join(sorted(allowed))})"
    return ConfigError(key, f"unknown key{hint}")


def check_table(prefix: str, table: dict, keys: dict[str, Key]) -> dict:
    """A TOML table checked against its ``keys`` (unknown keys refused, defaults filled
    in, errors naming ``prefix.key``), in the keys' order."""
    out = {}
    for k in table:
        if k not in keys:
            raise unknown_key(f"{prefix}.{k}", keys)
    for k, spec in keys.items():
        key = f"{prefix}.{k}"
        if k in table:
            out[k] = spec.check(key, table[k])
        elif spec.default is REQUIRED:
            raise ConfigError(key, "missing (required)")
        else:
            out[k] = copy.deepcopy(spec.default)
    return out


def merge_keys(tables: Iterable[dict[str, Key]]) -> dict[str, Key]:
    """One table of several components' tables (the keys of every objective): a key two
    components share is one declaration (the same Key), and a key a component adds goes
    right after the shared key it follows in that component's table."""
    names: list[str] = []
    merged: dict[str, Key] = {}
    for table in tables:
        at = len(names)
        for name, key in table.items():
            if name in merged:
                if merged[name] is not key:
                    raise ValueError(f"key {name!r} is declared twice, differently")
                at = names.index(name) + 1
                continue
            merged[name] = key
            names.insert(at, name)
            at += 1
    return {name: merged[name] for name in names}


def options_class(name: str, keys: dict[str, Key], module: str, doc: str = "") -> type:
    """A frozen, keyword-only dataclass with a field per key: the key's type and
    default (a fresh copy of a list or table default)."""
    fields = []
    for k, spec in keys.items():
        if spec.default is REQUIRED:
            fields.append((k, spec.type))
        elif isinstance(spec.default, (list, dict)):
            fresh = functools.partial(copy.deepcopy, spec.default)
            fields.append((k, spec.type, dataclasses.field(default_factory=fresh)))
        else:
            fields.append((k, spec.type, dataclasses.field(default=spec.default)))
    cls = dataclasses.make_dataclass(name, fields, frozen=True, kw_only=True)
    cls.__module__, cls.__doc__ = module, doc or cls.__doc__
    return cls
