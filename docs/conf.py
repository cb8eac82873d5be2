"""Sphinx configuration of grace's documentation: the Markdown pages of docs/ (through
myst-parser) and an API reference read from grace's docstrings (autodoc).

Build: python -m sphinx -W --keep-going -b html docs docs/_build/html (tests/unit/test_docs.py)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # grace from this checkout, installed or not

project = "grace"
author = "grace contributors"
release = "0.1.0"

extensions = ["myst_parser", "sphinx.ext.autodoc", "sphinx.ext.napoleon"]
source_suffix = {".md": "markdown", ".rst": "restructuredtext"}
root_doc = "index"
exclude_patterns = ["_build"]

# headings (down to ###) become link targets, so "page.md#a-heading" links resolve (and are checked)
myst_heading_anchors = 3

# The toolkits are mocked: the reference needs grace's docstrings, not a PyTorch, TensorFlow or
# Horovod import (seconds each), and a machine without them still builds the site.
autodoc_mock_imports = ["tensorflow", "tf_keras", "horovod", "torch"]
autodoc_member_order = "bysource"
autodoc_typehints = "description"
napoleon_google_docstring = True
napoleon_numpy_docstring = False

html_theme = "alabaster"
html_title = "grace"
