"""Imports point down only (docs/concepts.md, "Layout of the repository"): the engine never
imports Prefect or the orchestration layer, tasks never import flows, blocks import neither.
Checked on every module's syntax tree, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

ORCHESTRATION = ("prefect", "flows", "tasks", "blocks", "deployments")
# The CLI sits on top of every layer: it may reach flows/ and deployments/ inside the commands
# that need them (run, demo, prefect ...), never at import time and never Prefect itself.
CLI = "draftsmith/cli.py"
CLI_MAY_IMPORT_LAZILY = ("flows", "deployments")


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(module, line, at module level) for every import statement in a file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.module, node.lineno, id(node) in top))
    return found


def violations(root: Path) -> list[str]:
    """Every import that breaks the layering under `root` (a checkout)."""
    out = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        layer = relative.split("/", 1)[0]
        if layer not in ("draftsmith", "tasks", "blocks"):
            continue
        forbidden = {"draftsmith": ORCHESTRATION, "tasks": ("flows", "deployments"),
                     "blocks": ("flows", "tasks", "deployments")}[layer]
        for module, line, top_level in imports(path):
            root_name = module.split(".", 1)[0]
            if root_name not in forbidden:
                continue
            if relative == CLI and root_name in CLI_MAY_IMPORT_LAZILY and not top_level:
                continue
            out.append(f"{relative}:{line} imports {module}")
    return out


def test_the_engine_imports_nothing_above_it():
    assert violations(REPO) == []


def test_a_planted_import_is_caught(tmp_path):
    """The check fails when it should: an engine module that imports Prefect (even inside a
    function), a task that imports a flow, the CLI importing a flow at import time."""
    for relative, text in {
        "draftsmith/__init__.py": "",
        "draftsmith/ok.py": "import torch\nfrom draftsmith.config import PipelineConfig\n",
        "draftsmith/bad.py": "def f():\n    from prefect import task\n",
        "draftsmith/also_bad.py": "import flows.pipeline\n",
        "draftsmith/cli.py": "from flows.pipeline import pipeline\n"
                             "def run():\n    from deployments.setup import setup\n",
        "tasks/stages.py": "from flows import dispatch\n",
        "flows/pipeline.py": "from prefect import flow\nfrom tasks import stages\n",
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert violations(tmp_path) == [
        "draftsmith/also_bad.py:1 imports flows.pipeline",
        "draftsmith/bad.py:2 imports prefect",
        "draftsmith/cli.py:1 imports flows.pipeline",
        "tasks/stages.py:1 imports flows",
    ]
