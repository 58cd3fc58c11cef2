"""Sphinx configuration: ``make docs`` builds the pages of docs/ as HTML into
docs/_build/html (``sphinx-build -W``: a warning is an error). The pages are markdown
(MyST); docs/reference/ is generated from the code (``make reference``), its api.md
through autodoc, which imports pdeformer from this checkout."""

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

project = "pdeformer"
author = "pdeformer developers"
copyright = "pdeformer developers, MIT licence"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon", "sphinx.ext.mathjax"]
source_suffix = {".md": "markdown"}
root_doc = "index"
exclude_patterns = ["_build", "scaling-record.md"]

myst_heading_anchors = 4            # [text](page.md#a-heading) links, as GitHub makes them
napoleon_google_docstring = False   # the docstrings are numpy-style (Parameters, Returns)
autodoc_member_order = "bysource"

html_theme = "alabaster"
html_title = "pdeformer"
