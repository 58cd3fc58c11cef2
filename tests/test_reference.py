"""The documentation: the reference pages of docs/reference/ are what the code makes
(docs/reference/generate.py), the generator refuses a file, column or check it cannot
describe, and, where Sphinx and MyST are installed, the HTML build (``make docs``) passes
with warnings as errors."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
from conftest import ROOT, requires_dolfinx

REFERENCE = os.path.join(ROOT, "docs", "reference")
REGENERATE = "regenerate them with `make reference` (python docs/reference/generate.py)"


def _generator():
    spec = importlib.util.spec_from_file_location("reference_generate", os.path.join(REFERENCE, "generate.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _generate(*args: str) -> subprocess.CompletedProcess:
    """docs/reference/generate.py in a fresh interpreter: the pages of the package's own
    registries (a test module may register a parameter block or a term of its own)."""
    return subprocess.run([sys.executable, os.path.join(REFERENCE, "generate.py"), *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """The folder of the pages as the code makes them."""
    folder = tmp_path_factory.mktemp("reference")
    proc = _generate("--out", str(folder))
    assert proc.returncode == 0, proc.stderr
    return folder


def test_reference_pages_are_current(made):
    """Every page, made again into a fresh folder, is the committed one."""
    stale = []
    for name in _generator().PAGES:
        committed = os.path.join(REFERENCE, name)
        if not os.path.isfile(committed) or open(committed, encoding="utf-8").read() != \
                (made / name).read_text(encoding="utf-8"):
            stale.append(f"docs/reference/{name}")
    assert not stale, f"{', '.join(stale)} stale: {REGENERATE}"


def test_reference_pages_are_plain(made):
    """No absolute paths, dates or machine in the pages: they depend on the code alone."""
    generate = _generator()
    for name in generate.PAGES:
        text = (made / name).read_text(encoding="utf-8")
        for word in (ROOT, os.path.expanduser("~"), "/tmp/"):
            assert word not in text, f"docs/reference/{name} holds {word!r}"
    config = (made / "config.md").read_text(encoding="utf-8")
    for section in generate.schema.SCHEMA:
        assert f"## `[{section}]`" in config
    assert "**required**" in config and "`[[prompts]]`" in config


def test_generator_refuses_what_it_cannot_describe():
    """A file name, column or check the code adds without a description stops the
    generator, naming it, instead of leaving it out of the pages."""
    generate = _generator()
    output_files = sys.modules["output_files"]
    with pytest.raises(ValueError, match="'new.npz' is not described"):
        output_files.matched(["summary.json", "new.npz"], ["summary.json"], "the file")
    with pytest.raises(ValueError, match=r"describes the file \['gone.csv'\]"):
        output_files.matched(["summary.json"], ["summary.json", "gone.csv"], "the file")

    def check(key, value):
        return value
    check.type = complex
    with pytest.raises(ValueError, match="TYPE_NAMES"):
        generate.type_words(check)
    assert generate.type_words(generate.keys.integer(1, 3)) == "integer in 1..3"
    assert generate.type_words(generate.keys.number(positive=True, hi=1.0)) == "number in (0, 1]"
    assert generate.type_words(generate.keys.string(lambda: ("a", "b"))) == 'string: one of `"a"`, `"b"`'


def test_check_reports_stale_pages(made, tmp_path):
    """``generate.py --check`` names a stale page and the command that remakes it."""
    for name in _generator().PAGES:
        (tmp_path / name).write_text((made / name).read_text(encoding="utf-8"), encoding="utf-8")
    assert _generate("--check", "--out", str(tmp_path)).returncode == 0
    (tmp_path / "cli.md").write_text("old\n", encoding="utf-8")
    proc = _generate("--check", "--out", str(tmp_path))
    assert proc.returncode == 1 and "cli.md is stale: run `make reference`" in proc.stderr
    assert "config.md" not in proc.stderr


def _sphinx_missing() -> str | None:
    for module in ("sphinx", "myst_parser"):
        if importlib.util.find_spec(module) is None:
            return f"{module} is not installed (Debian: apt-get install python3-sphinx python3-myst-parser)"
    return None


@requires_dolfinx   # autodoc imports pdeformer's API
@pytest.mark.skipif(_sphinx_missing() is not None, reason=str(_sphinx_missing()))
def test_sphinx_builds_the_docs_without_warnings(tmp_path):
    """``make docs``: every page, the reference and the API's docstrings through autodoc,
    with warnings as errors (about 5 s)."""
    cmd = [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-q", "-b", "html",
           "-d", str(tmp_path / "doctrees"), os.path.join(ROOT, "docs"), str(tmp_path / "html")]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"sphinx-build -W failed:\n{proc.stdout}\n{proc.stderr}"
    assert (tmp_path / "html" / "reference" / "api.html").is_file()
    assert "pdeformer.solve" in (tmp_path / "html" / "reference" / "api.html").read_text(encoding="utf-8")
