"""No import circle inside the engine: a module never imports (even inside a function) a module
that imports it back, directly or through others. extract/stage.py and
extract/sglang_backend.py once did, over the layer-id helper."""

from __future__ import annotations

import ast
from pathlib import Path

ENGINE = Path(__file__).resolve().parent.parent / "draftsmith"


def engine_imports() -> dict[str, set[str]]:
    """Each draftsmith module and the draftsmith modules it imports anywhere in its file."""
    modules = {}
    for path in ENGINE.rglob("*.py"):
        parts = path.relative_to(ENGINE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph = {}
    for name, path in modules.items():
        found = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                candidates = [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
            elif isinstance(node, ast.Import):
                candidates = [a.name for a in node.names]
            else:
                continue
            found |= {c for c in candidates if c in modules and c != name}
        graph[name] = found
    return graph


def reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen, stack = set(), [start]
    while stack:
        for nxt in graph[stack.pop()] - seen:
            seen.add(nxt)
            stack.append(nxt)
    return seen


def test_the_engine_has_no_import_circle():
    graph = engine_imports()
    assert "draftsmith.extract.sglang_backend" in graph  # the walk found the engine
    circles = sorted({tuple(sorted((a, b))) for a in graph for b in graph[a]
                      if a in reachable(graph, b)})
    assert not circles, f"modules that import each other (directly or through others): {circles}"
