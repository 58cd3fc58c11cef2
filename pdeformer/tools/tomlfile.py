"""A TOML file and its ``--set section.key=value`` overrides, read into a raw table.

:func:`read_toml` reads a run configuration, a study or a budget file with one-line
errors naming the file; :func:`parse_override` and :func:`apply_override` put a
command line's ``--set`` values into the raw table before it is checked
(:mod:`pdeformer.tools.keys`). Values are TOML values or bare strings: nothing is
evaluated.
"""

from __future__ import annotations

import os
import re
import tomllib
from typing import Any, Callable

from .errors import ConfigError
from .files import TEXT_FILE, FileError, read_bytes


def read_toml(filename: str, what: str = "config file") -> dict:
    """The TOML table of ``filename``; ConfigError (one line naming the file) where it is
    missing, not a regular file (read non-blocking: pdeformer.tools.files), larger than
    a config holds, unreadable, not text or not TOML."""
    try:
        data = read_bytes(filename, "", TEXT_FILE)
    except FileError as e:
        reason = e.reason
        if reason == "no such file":
            reason = f"no such {what}"
        elif reason.endswith(", not a file"):
            reason = reason.replace("not a file", f"not a {what}")
        raise ConfigError("", f"{filename}: {reason}") from None
    try:
        return tomllib.loads(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise ConfigError("", f"{filename}: not a text file") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError("", f"{filename}: not valid TOML ({e})") from None


def parse_override(text: str) -> tuple[list[str | int], Any]:
    """``'section.key=value'`` -> (path, value). The value is read as a TOML value
    (``3``, ``0.5``, ``true``, ``[64, 64]``, ``"a"``); anything else is a bare string."""
    if "=" not in text:
        raise ConfigError("--set", f"expected section.key=value, got {text!r}")
    lhs, rhs = text.split("=", 1)
    parts: list[str | int] = []
    for tok in re.split(r"\.", lhs.strip()):
        m = re.fullmatch(r"([A-Za-z_][A-Za-z0-9_]*)(?:\[(\d+)\])?|(\d+)", tok)
        if not m:
            raise ConfigError("--set", f"bad key {lhs.strip()!r}")
        if m.group(3) is not None:
            parts.append(int(m.group(3)))
        else:
            parts.append(m.group(1))
            if m.group(2) is not None:
                parts.append(int(m.group(2)))
    if len(parts) < 2:
        raise ConfigError("--set", f"expected section.key=value, got {text!r}")
    try:
        value = tomllib.loads(f"v = {rhs.strip()}")["v"]
    except tomllib.TOMLDecodeError:
        value = rhs.strip()
    return parts, value


def apply_override(raw: dict, parts: list, value, cwd: str, base_dir: str,
                   is_path: Callable[[tuple], bool] = lambda parts: False) -> None:
    """Set ``raw[parts...] = value``. A path given on the command line (``is_path(parts)``)
    is relative to the current directory ``cwd``; it is made relative to the file's
    folder ``base_dir`` here, so that it resolves like the file's own paths."""
    node = raw
    where = ""
    for i, p in enumerate(parts[:-1]):
        where = f"{where}.{p}" if isinstance(p, str) else f"{where}[{p}]"
        if isinstance(p, int):
            if not isinstance(node, list) or p >= len(node):
                raise ConfigError(where.lstrip("."), "no such entry to override")
            node = node[p]
        else:
            if not isinstance(node, dict):
                raise ConfigError(where.lstrip("."), "not a table")
            node = node.setdefault(p, {} if isinstance(parts[i + 1], str) else [])
    last = parts[-1]
    if is_path(tuple(parts)) and isinstance(value, str):
        value = os.path.relpath(os.path.join(cwd, value), base_dir)
    if isinstance(last, int):
        raise ConfigError("--set", "the last part of a key must be a name")
    if not isinstance(node, dict):
        raise ConfigError(where.lstrip("."), "not a table")
    node[last] = value
