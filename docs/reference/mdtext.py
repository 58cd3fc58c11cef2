"""Markdown for the reference pages: prose from docstrings and docs, code, tables."""

from __future__ import annotations

import re

CODE_SPAN = re.compile(r"(`+).+?\1")
MARKUP = re.compile(r"([\\|<>_\[\]]|\*(?! ))")   # "* ": a list's bullet, or no emphasis
ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def escape(text: str) -> str:
    """Prose as markdown: what markdown would read as markup (a table's ``|``, ``<tag>``,
    emphasis, links) escaped, code spans (in backticks) kept as they are."""
    out, at = [], 0
    for m in CODE_SPAN.finditer(text):
        out += [MARKUP.sub(r"\\\1", text[at:m.start()]), m.group(0)]
        at = m.end()
    return "".join(out + [MARKUP.sub(r"\\\1", text[at:])])


def from_rst(text: str) -> str:
    """A docstring's reStructuredText as markdown prose: ``literal`` and :role:`target`
    as code spans, the rest escaped."""
    return escape(ROLE.sub(r"`\1`", text).replace("``", "`"))


def code(text: str) -> str:
    """``text`` as a code span."""
    fence = "``" if "`" in text else "`"
    pad = " " if fence == "``" else ""
    return f"{fence}{pad}{text}{pad}{fence}"


def table(header: list[str], rows: list[list[str]]) -> str:
    """A pipe table (cells are one line each)."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("\n", " ") for cell in row) + " |" for row in rows]
    return "\n".join(lines) + "\n"
