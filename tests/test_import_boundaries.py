"""Imports point down only (docs/concepts.md, "Layout of the repository"): the engine never
imports Prefect or the orchestration layer, tasks never import flows, blocks import neither;
inside the engine, a lower floor never imports a higher one (LOWER_FLOORS). Checked on every
module's syntax tree, so an import inside a function counts too."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.conftest import REPO

ORCHESTRATION = ("prefect", "flows", "tasks", "blocks", "deployments")
# The CLI sits on top of every layer: it may reach flows/ and deployments/ inside the commands
# that need them (run, demo, prefect ...), never at import time and never Prefect itself.
CLI = "draftsmith/cli.py"
CLI_MAY_IMPORT_LAZILY = ("flows", "deployments")
# Inside the engine: (a file, or a package ending in "/") -> the modules it must not import.
LOWER_FLOORS = (
    ("draftsmith/data/", "draftsmith.generate"),  # generate's records: data/records.py
    ("draftsmith/serve/", "draftsmith.extract"),  # the aux-layer hooks: model/aux_hooks.py
    ("draftsmith/fingerprints.py", "draftsmith.data"),  # the data's: data/source_fingerprints.py
)


def imports(path: Path) -> list[tuple[list[str], int, bool]]:
    """(the modules it may load, line, at module level) for every import statement in a file:
    `import a` loads a, `from a import b` loads a and, where b is a module, a.b."""
    tree = ast.parse(path.read_text(), filename=str(path))
    top = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [([alias.name], node.lineno, id(node) in top) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append(([node.module, *(f"{node.module}.{alias.name}" for alias in node.names)],
                          node.lineno, id(node) in top))
    return found


def floor_violations(root: Path) -> list[str]:
    """Every engine import under `root` (a checkout) that reaches up a floor."""
    out = []
    for path in sorted((root / "draftsmith").rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        refused = [module for where, module in LOWER_FLOORS
                   if relative == where or (where.endswith("/") and relative.startswith(where))]
        for modules, line, _top_level in imports(path) if refused else []:
            hit = next((m for m in modules for r in refused if m == r or m.startswith(r + ".")),
                       None)
            if hit is not None:
                out.append(f"{relative}:{line} imports {hit}")
    return out


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
        for (module, *_submodules), line, top_level in imports(path):
            root_name = module.split(".", 1)[0]
            if root_name not in forbidden:
                continue
            if relative == CLI and root_name in CLI_MAY_IMPORT_LAZILY and not top_level:
                continue
            out.append(f"{relative}:{line} imports {module}")
    return out


def plant(root: Path, files: dict[str, str]) -> None:
    """A checkout under `root` made of these files (path -> text)."""
    for relative, text in files.items():
        (root / relative).parent.mkdir(parents=True, exist_ok=True)
        (root / relative).write_text(text)


def test_the_engine_imports_nothing_above_it():
    assert violations(REPO) == []


def test_no_engine_module_imports_a_higher_floor():
    assert floor_violations(REPO) == []


def test_a_planted_import_up_a_floor_is_caught(tmp_path):
    """The floor check fails when it should, for each refused direction, in each spelling of an
    import (inside a function too), and passes the same imports pointing down."""
    plant(tmp_path, {
        "draftsmith/data/merge.py": "from draftsmith.data.records import read_records\n"
                                    "from draftsmith.generate.stage import read_records\n",
        "draftsmith/data/tokenize.py": "def f():\n    import draftsmith.generate.journal\n",
        "draftsmith/serve/embedded.py": "from draftsmith.model.aux_hooks import decoder_of\n"
                                        "from draftsmith.extract import capture\n",
        "draftsmith/fingerprints.py": "def f():\n    from draftsmith import data\n",
        "draftsmith/generate/stage.py": "from draftsmith.data.records import write_records\n",
        "draftsmith/extract/capture.py": "from draftsmith.model.aux_hooks import AuxLayerHooks\n",
        "draftsmith/data/source_fingerprints.py": "from draftsmith.fingerprints import identity\n"
                                                  "from draftsmith.data.packaged import rows\n",
        "draftsmith/database.py": "from draftsmith.generate import stage\n",
    })
    assert floor_violations(tmp_path) == [
        "draftsmith/data/merge.py:2 imports draftsmith.generate.stage",
        "draftsmith/data/tokenize.py:2 imports draftsmith.generate.journal",
        "draftsmith/fingerprints.py:2 imports draftsmith.data",
        "draftsmith/serve/embedded.py:2 imports draftsmith.extract",
    ]


def test_a_planted_import_is_caught(tmp_path):
    """The check fails when it should: an engine module that imports Prefect (even inside a
    function), a task that imports a flow, the CLI importing a flow at import time."""
    plant(tmp_path, {
        "draftsmith/__init__.py": "",
        "draftsmith/ok.py": "import torch\nfrom draftsmith.config import PipelineConfig\n",
        "draftsmith/bad.py": "def f():\n    from prefect import task\n",
        "draftsmith/also_bad.py": "import flows.pipeline\n",
        "draftsmith/cli.py": "from flows.pipeline import pipeline\n"
                             "def run():\n    from deployments.setup import setup\n",
        "tasks/stages.py": "from flows import dispatch\n",
        "flows/pipeline.py": "from prefect import flow\nfrom tasks import stages\n",
    })
    assert violations(tmp_path) == [
        "draftsmith/also_bad.py:1 imports flows.pipeline",
        "draftsmith/bad.py:2 imports prefect",
        "draftsmith/cli.py:1 imports flows.pipeline",
        "tasks/stages.py:1 imports flows",
    ]


# Drafter kinds differ by methods of their kind objects (draftsmith/model/registry.py): only the
# kind packages themselves may compare a string with a kind's name.
KIND_NAMES = ("eagle3", "dflash")
KIND_OWNER = "draftsmith/model/"


def names_a_kind(node: ast.AST) -> bool:
    """A kind's name as a literal, or a tuple, list or set literal holding one."""
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return any(names_a_kind(element) for element in node.elts)
    return isinstance(node, ast.Constant) and node.value in KIND_NAMES


def dispatches_on_a_kind_name(node: ast.AST) -> bool:
    if isinstance(node, ast.Dict):
        return any(key is not None and names_a_kind(key) for key in node.keys)
    if isinstance(node, ast.Compare):
        tests = any(isinstance(op, ast.Eq | ast.NotEq | ast.In | ast.NotIn) for op in node.ops)
        return tests and any(names_a_kind(o) for o in [node.left, *node.comparators])
    return False


def kind_name_comparisons(root: Path) -> list[str]:
    """Every `==`, `!=`, `in` or `not in` test against a kind's name, and every dict keyed by
    one (dispatch on the name), outside draftsmith/model/ (engine, flows and tasks), as
    `path:line`."""
    out = []
    for path in sorted(root.rglob("*.py")):
        relative = path.relative_to(root).as_posix()
        if relative.split("/", 1)[0] not in ("draftsmith", "flows", "tasks") \
                or relative.startswith(KIND_OWNER):
            continue
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if dispatches_on_a_kind_name(node):
                out.append(f"{relative}:{node.lineno}")
    return out


def test_no_module_outside_the_kinds_compares_a_kind_name():
    assert kind_name_comparisons(REPO) == []


def test_a_planted_kind_name_comparison_is_caught(tmp_path):
    for relative, text in {
        "draftsmith/train/bad.py": "def f(kind):\n    return kind.name == 'dflash'\n",
        "draftsmith/also_bad.py": "def f(cfg):\n    if 'eagle3' != cfg.kind:\n        pass\n",
        "tasks/bad.py": "x = 1\nok = x in ('dflash',) or x == 2\n",
        "flows/bad.py": "layouts = {'eagle3': 1, 'dflash': 2}\n",
        "draftsmith/model/dflash/layouts.py": "ok = {}.get('type') == 'dflash'\n",
        "draftsmith/ok.py": "KIND = 'eagle3'\nok = KIND == 'other'\n",
        "tests/test_x.py": "assert 'dflash' == 'dflash'\n",
    }.items():
        (tmp_path / relative).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / relative).write_text(text)
    assert kind_name_comparisons(tmp_path) == [
        "draftsmith/also_bad.py:2", "draftsmith/train/bad.py:2", "flows/bad.py:1",
        "tasks/bad.py:2"]
